"""The DSpark drafter's observe (reference): ``main_x`` of committed rows, the input of every stage's window keys
(DeepSeek's ``main_proj`` + ``main_norm`` of the V4-Flash-DSpark release).

``main_x = rms_norm(features @ main_proj.T, main_norm)`` [n, D] of target features [n, T*D] (T target layers, D
hidden). Per precision:

* ``"fp32"``: float32 throughout.
* ``"a2a3"``: the a2a3 kernels' numerics: the features and ``main_proj`` read in bf16 (bf16-rounded: the
  target's a2a3 features are bf16 values already; ``main_proj`` as the target's bf16 projection weights), the
  product accumulated in fp32, the fp32 RMSNorm, and ``main_x`` rounded to bf16, the
  activation every a2a3 kernel hands the next (the shared kv kernel that computes the window keys reads bf16 rows).
* ``"deepseek"``: the official inference: an FP8 ``main_proj`` quantises its input in 1x128 blocks, the GEMM's
  output and the norm's are bf16.

Each stage's window keys of these rows are :func:`~dspark_kernels.reference.draft_attention.context_keys`.
"""

from __future__ import annotations

import numpy as np

from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.numerics import Precision, bf16_round, linear, narrow, rms_norm


def main_x(features: np.ndarray, main_proj: np.ndarray, main_norm: np.ndarray, eps: float, precision: Precision,
           fp8: bool = False) -> np.ndarray:
    """``rms_norm(main_proj(features), main_norm)`` [n, D] float32 (bf16 values in a2a3 and deepseek).

    features: [n, T*D] float32 target features (bf16 values in a2a3 and deepseek); main_proj: [D, T*D] float32
    (dequantised); main_norm: [D] float32; fp8: ``main_proj`` is stored FP8 (deepseek quantises its input).
    """
    if precision == "deepseek":
        a = ds.act_quant(features) if fp8 else features
        return narrow(rms_norm(bf16_round(linear(a, main_proj)), main_norm, eps), precision)
    if precision == "a2a3":
        return bf16_round(rms_norm(linear(bf16_round(features), bf16_round(main_proj)), main_norm, eps))
    return rms_norm(linear(features, main_proj), main_norm, eps)
