"""Stage 7 (reference): grouped output projection (DeepSeek-V4 ``Attention.forward``; upstream's sparse attention
output stage).

Heads are split into G = o_groups groups of heads_per_group consecutive heads; group g's concatenated
outputs ``o_g`` [H*D/G] go through its own ``wo_a[g]`` [Ro, H*D/G] (rows ``g*Ro .. g*Ro+Ro-1`` of
``wo_a.weight``): ``y_g = o_g @ wo_a[g].T`` [Ro]; then ``out = concat_g(y_g) @ wo_b.T`` [X].

a2a3: o and wo_a are bf16 (fp32 accumulation); ``y`` is int8-quantised per (token, group); each group's
exact integer product with its int8 ``wo_b`` column block is scaled by that group's dequant scale and
summed over groups, then multiplied by the per-output-channel ``wo_b`` scale and rounded to bf16.

deepseek (the official ``Attention.forward``): ``y_g`` is a bf16 einsum with the bf16 ``wo_a`` that ``convert.py``
dequantised (no activation quantisation), then ``wo_b`` is an FP8 GEMM (e4m3 input per 1x128 block of the G*Ro
inputs, bf16 output).
"""

from __future__ import annotations

import numpy as np

from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.numerics import Precision, bf16_round, int8_matmul, int8_quantize, linear
from dspark_kernels.model.prepared import PreparedWeights


def output_projection(o: np.ndarray, w: PreparedWeights, precision: Precision) -> np.ndarray:
    """out [T, X] float32 (bf16 values in a2a3 and deepseek) from attention outputs o [T, H*D] (head-major)."""
    groups, rank, width = w.wo_a.shape
    y = np.empty((o.shape[0], groups, rank), dtype=np.float32)                        # (T, G, Ro)
    for g in range(groups):  # one 2-D matmul per group keeps BLAS on contiguous operands
        if precision == "deepseek":
            y[:, g] = ds.linear(o[:, g * width:(g + 1) * width], w.wo_a[g], "attn.wo_a", w.fp8_inputs)
        else:
            y[:, g] = linear(o[:, g * width:(g + 1) * width], w.wo_a[g])
    if precision == "deepseek":
        return ds.linear(y.reshape(o.shape[0], groups * rank), w.wo_b, "attn.wo_b", w.fp8_inputs)     # (T, X)
    if precision == "fp32" or w.wo_b_scale is None:
        return linear(y.reshape(o.shape[0], groups * rank), w.wo_b)                     # (T, X)
    y_q, y_scale = int8_quantize(y)                                                   # (T, G, Ro), (T, G)
    out = np.zeros((o.shape[0], w.wo_b.shape[0]), dtype=np.float32)
    for g in range(groups):
        block = w.wo_b[:, g * rank:(g + 1) * rank]                                    # (X, Ro)
        out += int8_matmul(y_q[:, g], block) * y_scale[:, g, None]
    return bf16_round(out * w.wo_b_scale[None, :])
