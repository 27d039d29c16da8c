"""Stage 2: q and shared-kv projections with RMSNorm and RoPE (upstream's pre-attention projections).

``query`` kernel (T = the rank's L local rows; X hidden, Q q_lora_rank, H heads, D head_dim, rd rope dims):

* ``x``          [T, X] bf16 in: attention input (after attn_norm); padding rows 0.
* ``wq_a``       [Q, X] bf16 in; ``q_norm`` [1, Q] fp32 in (bf16 values).
* ``wq_b``       [H*D, Q] int8 in; ``wq_b_scale`` [1, H*D] fp32 in (per output channel).
* ``cos``, ``sin`` [T, rd/2] bf16 in: the layer's main RoPE table at each row's position.
* ``q``          [T, H, D] bf16 out; ``qr_q`` [T, Q] int8 out and ``qr_scale`` [T, 1] fp32 out (reused by
  the indexer).

Math: ``qr = rms(x @ wq_a.T, q_norm)`` (fp32 accumulation); ``(qr_q, qr_scale) = int8q(qr)``;
``q = (qr_q @ wq_b.T as int32) * qr_scale * wq_b_scale``; unweighted RMS per head; RoPE on the last rd dims
of every head (interleaved pairs); bf16.

``shared_kv`` kernel (all P group rows): ``x`` [P, X] bf16, ``wkv`` [D, X] bf16, ``kv_norm`` [1, D] fp32,
``cos``/``sin`` [P, rd/2] bf16 in; ``kv`` [P, D] bf16 out = bf16(rope(rms(x @ wkv.T, kv_norm))).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_kernels.pypto._ops import int8_rows, rms_norm, rope_rows, tile
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto

BF16 = ml_dtypes.bfloat16
#: Tiles chosen with the cost model (benchmarks/bench_pypto.py, FLASH sizes, P = 512): the shared kv kernel
#: costs 262k cycles with 128^3 cube tiles and (16, 64) vector tiles, 187k with a 1024-deep K panel in L1
#: (A and B reused across the K loop), 125k with (64, 128) vector tiles as well, 124k with 256-deep K steps
#: (roofline 11.8k). The q path (L = 128): 1380k -> 706k (same choices) -> 636k with (4, 16, 128) tiles on
#: [T, H, D] -> 628k with 256-deep K steps (roofline 67k). Bigger M/N tiles or split-K did not help.
K_L0_CAP = 256
K_L1_CAP = 1024
VEC_ROWS = 64


def rope_heads(v: Any, cos: Any, sin: Any, rows: int, heads: int, dim: int, rope: int, *, inverse: bool = False
               ) -> tuple[Any, Any]:
    """(nope [rows, heads, dim-rope], roped [rows, heads, rope]) of v [rows, heads, dim] fp32.

    cos, sin: [rows, rope/2] bf16, broadcast over heads; ``inverse`` rotates back (attention output).
    """
    nope = pypto.view(v, [rows, heads, dim - rope], [0, 0, 0])
    return nope, rope_rows(pypto.view(v, [rows, heads, rope], [0, 0, dim - rope]), cos, sin, inverse=inverse)


@lru_cache(maxsize=16)
def query_kernel(rows: int, hidden: int, q_rank: int, heads: int, dim: int, rope: int, eps: float) -> Any:
    """The q-path jit kernel for one geometry."""
    tm, tk, tn = tile(rows, 128), tile(max(hidden, q_rank), K_L0_CAP), tile(q_rank, 128)
    tk_l1 = tile(max(hidden, q_rank), K_L1_CAP)

    @kernel
    def query(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            x: pypto.Tensor([rows, hidden], pypto.DT_BF16),
            wq_a: pypto.Tensor([q_rank, hidden], pypto.DT_BF16),
            q_norm: pypto.Tensor([1, q_rank], pypto.DT_FP32),
            wq_b: pypto.Tensor([heads * dim, q_rank], pypto.DT_INT8),
            wq_b_scale: pypto.Tensor([1, heads * dim], pypto.DT_FP32),
            cos: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            sin: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            q: pypto.Tensor([rows, heads, dim], pypto.DT_BF16),
            qr_q: pypto.Tensor([rows, q_rank], pypto.DT_INT8),
            qr_scale: pypto.Tensor([rows, 1], pypto.DT_FP32)):
        _sizes = (rows, hidden, q_rank, heads, dim, rope)  # closure capture: the annotations read these
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk_l1], [tn, tn])
        pypto.set_vec_tile_shapes(VEC_ROWS, 128)
        qr = rms_norm(pypto.matmul(x, wq_a, pypto.DT_FP32, b_trans=True), q_norm, eps)     # [T, Q]
        qr_i8, qr_dq = int8_rows(qr)
        wide = pypto.cast(pypto.matmul(qr_i8, wq_b, pypto.DT_INT32, b_trans=True), pypto.DT_FP32)  # [T, H*D]
        wide = pypto.mul(pypto.mul(wide, qr_dq), wq_b_scale)
        # storing into an output hands the tensor over, so outputs are written after their last use
        qr_q[:] = qr_i8
        qr_scale[:] = qr_dq
        pypto.set_vec_tile_shapes(4, 16, 128)
        heads3 = rms_norm(pypto.reshape(wide, [rows, heads, dim]), None, eps)               # [T, H, D]
        nope, roped = rope_heads(heads3, cos, sin, rows, heads, dim, rope)
        pypto.assemble(pypto.cast(nope, pypto.DT_BF16), [0, 0, 0], q)
        pypto.assemble(pypto.cast(roped, pypto.DT_BF16), [0, 0, dim - rope], q)

    return query


@lru_cache(maxsize=16)
def shared_kv_kernel(rows: int, hidden: int, dim: int, rope: int, eps: float) -> Any:
    """The kv-path jit kernel for one geometry."""
    tm, tk, tn = tile(rows, 128), tile(hidden, K_L0_CAP), tile(dim, 128)
    tk_l1 = tile(hidden, K_L1_CAP)

    @kernel
    def shared_kv(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            x: pypto.Tensor([rows, hidden], pypto.DT_BF16),
            wkv: pypto.Tensor([dim, hidden], pypto.DT_BF16),
            kv_norm: pypto.Tensor([1, dim], pypto.DT_FP32),
            cos: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            sin: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            kv: pypto.Tensor([rows, 1, dim], pypto.DT_BF16)):
        _sizes = (rows, hidden, dim, rope)  # closure capture: the annotations read these
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk_l1], [tn, tn])
        pypto.set_vec_tile_shapes(VEC_ROWS, 128)
        latent = rms_norm(pypto.matmul(x, wkv, pypto.DT_FP32, b_trans=True), kv_norm, eps)  # [P, D]
        pypto.set_vec_tile_shapes(VEC_ROWS, 1, 128)
        nope, roped = rope_heads(pypto.reshape(latent, [rows, 1, dim]), cos, sin, rows, 1, dim, rope)
        pypto.assemble(pypto.cast(nope, pypto.DT_BF16), [0, 0, 0], kv)
        pypto.assemble(pypto.cast(roped, pypto.DT_BF16), [0, 0, dim - rope], kv)

    return shared_kv


def run_query(x: np.ndarray, wq_a: np.ndarray, q_norm: np.ndarray, wq_b_q: np.ndarray, wq_b_scale: np.ndarray,
              cos: np.ndarray, sin: np.ndarray, heads: int, eps: float) -> LaunchResult:
    """q path on numpy arrays (float inputs holding bf16 / int8 values); ``values[-3:]`` = q, qr_q, qr_scale."""
    rows, hidden = x.shape
    q_rank = wq_a.shape[0]
    dim = wq_b_q.shape[0] // heads
    rope = 2 * cos.shape[1]
    k = query_kernel(rows, hidden, q_rank, heads, dim, rope, float(eps))
    return launch(k, [x.astype(BF16), wq_a.astype(BF16), np.asarray(q_norm, np.float32).reshape(1, -1),
                      wq_b_q.astype(np.int8), np.asarray(wq_b_scale, np.float32).reshape(1, -1),
                      cos.astype(BF16), sin.astype(BF16), Out((rows, heads, dim), BF16, "q"),
                      Out((rows, q_rank), np.int8, "qr_q"), Out((rows, 1), np.float32, "qr_scale")])


def run_shared_kv(x: np.ndarray, wkv: np.ndarray, kv_norm: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                  eps: float) -> LaunchResult:
    """kv path on numpy arrays; ``values[-1]`` = kv [P, 1, D] bf16."""
    rows, hidden = x.shape
    dim = wkv.shape[0]
    k = shared_kv_kernel(rows, hidden, dim, 2 * cos.shape[1], float(eps))
    return launch(k, [x.astype(BF16), wkv.astype(BF16), np.asarray(kv_norm, np.float32).reshape(1, -1),
                      cos.astype(BF16), sin.astype(BF16), Out((rows, 1, dim), BF16, "kv")])
