"""Stage 7: grouped output projection with per-token, per-group int8 activations (upstream's attention output stage).

Kernel arguments (T rows = the rank's L local rows; H heads, D head_dim, G o_groups, Ro o_lora_rank,
X hidden_size; all shapes static per call):

* ``attn``      [T, H*D] bf16 in: attention output after inverse RoPE, heads concatenated; padding rows 0.
* ``wo_a``      [G*Ro, H*D/G] bf16 in: ``wo_a.weight`` ([out, in]); group g uses rows g*Ro..(g+1)*Ro.
* ``wo_b``      [X, G*Ro] int8 in: ``wo_b.weight`` quantised per output channel.
* ``wo_b_scale`` [1, X] fp32 in: its per-output-channel dequant scale.
* ``out``       [T, X] bf16 out: ``attn_out``.

Math per group g: ``y_g = attn[:, g] @ wo_a[g].T`` (bf16 x bf16 -> fp32); ``(q_g, dq_g) = int8q(y_g)`` per row;
``out = bf16(sum_g (q_g @ wo_b[:, g].T as int32 -> fp32) * dq_g * wo_b_scale)``.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_kernels.pypto._ops import int8_rows, tile
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto


@lru_cache(maxsize=16)
def o_proj_kernel(rows: int, groups: int, group_in: int, rank: int, hidden: int) -> Any:
    """The jit kernel for one geometry (see the module docstring for the argument contract)."""
    # L0A/L0B hold 64 KB: tk * tn * 2 B <= 64 KB. Cost model at FLASH sizes (L = 128): 874k cycles with 128^3
    # tiles and (tm, 64) vector tiles, 449k with a 1024-deep K panel in L1 and (64, 128) vector tiles, 421k
    # with 256-deep K steps as well (roofline 143k: the weights' bytes).
    tm, tk, tn = tile(rows, 128), tile(group_in, 256), tile(max(rank, hidden), 128)
    tk_l1 = tile(group_in, 1024)

    @kernel
    def o_proj(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            attn: pypto.Tensor([rows, groups * group_in], pypto.DT_BF16),
            wo_a: pypto.Tensor([groups * rank, group_in], pypto.DT_BF16),
            wo_b: pypto.Tensor([hidden, groups * rank], pypto.DT_INT8),
            wo_b_scale: pypto.Tensor([1, hidden], pypto.DT_FP32),
            out: pypto.Tensor([rows, hidden], pypto.DT_BF16)):
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk_l1], [tn, tn])
        pypto.set_vec_tile_shapes(64, 128)
        acc = pypto.full([rows, hidden], 0.0, pypto.DT_FP32)
        for g in range(groups):  # static: unrolled while tracing
            x_g = pypto.view(attn, [rows, group_in], [0, g * group_in])
            w_g = pypto.view(wo_a, [rank, group_in], [g * rank, 0])
            y_g = pypto.matmul(x_g, w_g, pypto.DT_FP32, b_trans=True)                    # [T, Ro]
            q_g, dq_g = int8_rows(y_g)                                                   # [T, Ro], [T, 1]
            wb_g = pypto.view(wo_b, [hidden, rank], [0, g * rank])
            part = pypto.cast(pypto.matmul(q_g, wb_g, pypto.DT_INT32, b_trans=True), pypto.DT_FP32)  # [T, X]
            acc = pypto.add(acc, pypto.mul(part, dq_g))
        out[:] = pypto.cast(pypto.mul(acc, wo_b_scale), pypto.DT_BF16)

    return o_proj


def run_o_proj(attn: np.ndarray, wo_a: np.ndarray, wo_b_q: np.ndarray, wo_b_scale: np.ndarray,
               groups: int) -> LaunchResult:
    """Run the kernel on numpy arrays.

    attn: [T, H*D] float (bf16-valued); wo_a: [G*Ro, H*D/G] or [G, Ro, H*D/G] float (bf16-valued);
    wo_b_q: [X, G*Ro] integer-valued float or int8 in [-127, 127]; wo_b_scale: [X] float32.
    Returns the launch result; ``values[-1]`` is ``out`` [T, X] bf16.
    """
    rows, width = attn.shape
    hidden = wo_b_q.shape[0]
    wo_a = np.asarray(wo_a).reshape(-1, width // groups)
    rank = wo_a.shape[0] // groups
    k = o_proj_kernel(rows, groups, width // groups, rank, hidden)
    return launch(k, [attn.astype(ml_dtypes.bfloat16), wo_a.astype(ml_dtypes.bfloat16), wo_b_q.astype(np.int8),
                      np.asarray(wo_b_scale, np.float32).reshape(1, hidden),
                      Out((rows, hidden), ml_dtypes.bfloat16, "out")])
