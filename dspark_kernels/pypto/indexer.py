"""Stage 5: lightning indexer queries, scores and top-k (upstream's lightning indexer; keys: ``compressor``).

Kernel arguments (T query rows = the rank's L local rows; Q q_lora_rank, X hidden, HI/dI indexer heads/dim,
rd rope dims, C candidate columns, k = index_topk, Ri idx-pool rows; shapes static per call):

* ``qr_q`` [T, Q] int8, ``qr_scale`` [T, 1] fp32 in: the int8 low-rank query of stage 2.
* ``wq_b`` [HI*dI, Q] int8, ``wq_b_scale`` [1, HI*dI] fp32 in: ``indexer.wq_b`` per output channel.
* ``x`` [T, X] bf16 in; ``weights_proj`` [HI, X] bf16 in.
* ``cos``, ``sin`` [T, rd/2] bf16 in: compressed-layer RoPE at each row's own position.
* ``hadamard`` [dI, dI] bf16 in: Sylvester Hadamard / sqrt(dI).
* ``idx`` [Ri, dI] int8, ``idx_scale`` [Ri] fp32 in: the idx cache (written by the indexer compressor first,
  so a boundary row sees its own new entry).
* ``candidates`` [T, C] int32 in: physical idx rows of entries ``c < (p + 1) // 4`` through the row's own
  request table (``entry_rows.run_entry_rows`` with ratio 4), -1 = not a candidate (invisible, unmapped, padding).
* ``top`` [T, k] int32 out: logical entries of the k best scores, best first; -1 after ``min(k, candidates)``.

Math: ``q = rope((qr_q @ wq_b.T) * qr_scale * wq_b_scale)`` per head, bf16; ``q = bf16(q) @ hadamard``;
``(q_i8, q_dq) = int8q(q)`` per (row, head); ``w = (x @ weights_proj.T) * index_weight_scale``;
``score[c] = idx_scale[c] * sum_h w[h] * relu(q_dq[h] * <q_i8[h], idx[c]>)`` (int32 dot products); top-k
over the candidates with pypto's ``topk`` (in rounds of <= 128 for k > 128). Ties may come out in any order (the
reference takes the lower entry first); callers compare selections as sets with a tie tolerance.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_kernels.pypto._ops import MASKED_SCORE, int8_rows, rope_rows, tile
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto

BF16 = ml_dtypes.bfloat16
#: Largest k pypto 0.2.0's ``topk`` supports.
TOPK_MAX_K = 128
#: Elements of one selection tile: topk and the masking scatter need whole rows in a tile
#: (``The axis is not supported for tile splitting``).
SELECT_TILE_ELEMENTS = 4096
#: pypto's sort needs tiles whose last axis is a multiple of 32 elements.
SORT_ALIGN = 32


def _select(score: Any, topk: int, rounds: int) -> tuple[Any, Any]:
    """Top-k (values, int32 columns) of score [T, C] fp32, best first, in ``rounds`` pypto ``topk`` calls.

    pypto 0.2.0's ``topk`` accepts k <= 128 (``The k should less than or equal to128``) and its ``argsort``
    over several tiles cannot be costed (``No pipe type ... opcode=TWOTILEMRGSORT``). So k = 512 (FLASH) takes
    the best k / rounds columns per round and masks them out before the next round: the rounds come out in
    descending order, so their concatenation is the sorted top-k.
    """
    if rounds == 1:
        return pypto.topk(score, topk, -1, True)
    per_round = topk // rounds
    values, picked = [], []
    for _ in range(rounds):
        v, i = pypto.topk(score, per_round, -1, True)
        values.append(v)
        picked.append(i)
        score = pypto.scatter(score, 1, i, MASKED_SCORE)
    return pypto.concat(values, -1), pypto.concat(picked, -1)


@lru_cache(maxsize=16)
def indexer_kernel(rows: int, q_rank: int, hidden: int, heads: int, dim: int, rope: int, columns: int,
                   topk: int, pool_rows: int, weight_scale: float, rounds: int = 0) -> Any:
    """The jit kernel for one geometry (module docstring); ``rounds``: see :func:`_select` (0 = as few as k allows)."""
    rounds = rounds or -(-topk // TOPK_MAX_K)
    tm, tk, tn = tile(rows, 128), tile(max(hidden, q_rank), 128), tile(dim, 128)
    if tm == 64:  # an M tile of 64 here ends the process with SIGSEGV in pypto 0.2.0 (seen for 64 <= T < 128)
        tm = 32

    @kernel
    def lightning_indexer(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            qr_q: pypto.Tensor([rows, q_rank], pypto.DT_INT8),
            qr_scale: pypto.Tensor([rows, 1], pypto.DT_FP32),
            wq_b: pypto.Tensor([heads * dim, q_rank], pypto.DT_INT8),
            wq_b_scale: pypto.Tensor([1, heads * dim], pypto.DT_FP32),
            x: pypto.Tensor([rows, hidden], pypto.DT_BF16),
            weights_proj: pypto.Tensor([heads, hidden], pypto.DT_BF16),
            cos: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            sin: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            hadamard: pypto.Tensor([dim, dim], pypto.DT_BF16),
            idx: pypto.Tensor([pool_rows, dim], pypto.DT_INT8),
            idx_scale: pypto.Tensor([pool_rows], pypto.DT_FP32),
            candidates: pypto.Tensor([rows, columns], pypto.DT_INT32),
            top: pypto.Tensor([rows, topk], pypto.DT_INT32)):
        _sizes = (rows, q_rank, hidden, heads, dim, rope, columns, topk, pool_rows)  # closure capture
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk], [tn, tn])
        pypto.set_vec_tile_shapes(16, 128)
        wide = pypto.cast(pypto.matmul(qr_q, wq_b, pypto.DT_INT32, b_trans=True), pypto.DT_FP32)  # [T, HI*dI]
        wide = pypto.mul(pypto.mul(wide, qr_scale), wq_b_scale)
        head_w = pypto.mul(pypto.matmul(x, weights_proj, pypto.DT_FP32, b_trans=True), weight_scale)  # [T, HI]
        pypto.set_vec_tile_shapes(8, 4, 64)  # (1, 8, 128) here ends the process with SIGSEGV in pypto 0.2.0
        q3 = pypto.reshape(wide, [rows, heads, dim])
        roped = rope_rows(pypto.view(q3, [rows, heads, rope], [0, 0, dim - rope]), cos, sin)
        q3 = pypto.cast(pypto.concat([pypto.view(q3, [rows, heads, dim - rope], [0, 0, 0]), roped], -1),
                        pypto.DT_BF16)
        pypto.set_vec_tile_shapes(16, 128)
        rotated = pypto.matmul(pypto.reshape(q3, [rows * heads, dim]), hadamard, pypto.DT_FP32)  # [T*HI, dI]
        q_i8, q_dq = int8_rows(rotated)                                                          # [T*HI, dI], [T*HI, 1]
        pypto.set_vec_tile_shapes(16, min(columns, 128))
        cand = pypto.cast(candidates, pypto.DT_FP32)
        present = pypto.ge(cand, 0.0)
        safe = pypto.cast(pypto.where(present, cand, 0.0), pypto.DT_INT32)
        key_scale = pypto.index_select(idx_scale, 0, safe)                                       # [T, C]
        pypto.set_vec_tile_shapes(1, min(columns, 64), 128)
        keys = pypto.index_select(idx, 0, safe)                                                  # [T, C, dI]
        dots = pypto.matmul(pypto.reshape(q_i8, [rows, heads, dim]), keys, pypto.DT_INT32, b_trans=True)
        pypto.set_vec_tile_shapes(1, 8, min(columns, 128))
        dots = pypto.mul(pypto.cast(dots, pypto.DT_FP32), pypto.reshape(q_dq, [rows, heads, 1]))  # [T, HI, C]
        weighted = pypto.mul(pypto.relu(dots), pypto.reshape(head_w, [rows, heads, 1]))
        score = pypto.reshape(pypto.sum(weighted, 1, keepdim=True), [rows, columns])            # [T, C]
        pypto.set_vec_tile_shapes(16, min(columns, 128))
        score = pypto.where(present, pypto.mul(score, key_scale), MASKED_SCORE)
        pypto.set_vec_tile_shapes(max(1, min(16, SELECT_TILE_ELEMENTS // columns)), columns)  # whole rows
        values, picked = _select(score, topk, rounds)
        chosen = pypto.gt(values, MASKED_SCORE * 0.5)
        top[:] = pypto.cast(pypto.where(chosen, pypto.cast(picked, pypto.DT_FP32), -1.0), pypto.DT_INT32)

    return lightning_indexer


def run_indexer(qr_q: np.ndarray, qr_scale: np.ndarray, wq_b: np.ndarray, wq_b_scale: np.ndarray, x: np.ndarray,
                weights_proj: np.ndarray, cos: np.ndarray, sin: np.ndarray, hadamard: np.ndarray,
                idx: np.ndarray, idx_scale: np.ndarray, candidates: np.ndarray, *, heads: int, topk: int,
                weight_scale: float, rounds: int = 0) -> LaunchResult:
    """Top-k entries [T, k] int32 (``values[-1]``); candidates [T, C] int (-1 = none); ``rounds`` of topk calls
    (k divisible by it; 0 = ceil(k / 128))."""
    if rounds and topk % rounds:
        raise ValueError(f"topk={topk} must be divisible by rounds={rounds}")
    rows, q_rank = qr_q.shape
    candidates = np.asarray(candidates, np.int32)
    # topk needs at least k columns, the sort tiles a multiple of 32: pad with non-candidates
    columns = max(topk, -(-candidates.shape[1] // SORT_ALIGN) * SORT_ALIGN)
    if candidates.shape[1] < columns:
        pad = np.full((rows, columns - candidates.shape[1]), -1, np.int32)
        candidates = np.concatenate([candidates, pad], axis=1)
    dim = hadamard.shape[0]
    k = indexer_kernel(rows, q_rank, x.shape[1], heads, dim, 2 * cos.shape[1], candidates.shape[1], topk,
                       idx.shape[0], float(weight_scale), rounds)
    return launch(k, [np.asarray(qr_q).astype(np.int8), np.asarray(qr_scale, np.float32).reshape(rows, 1),
                      np.asarray(wq_b).astype(np.int8), np.asarray(wq_b_scale, np.float32).reshape(1, -1),
                      x.astype(BF16), weights_proj.astype(BF16), cos.astype(BF16), sin.astype(BF16),
                      np.asarray(hadamard).astype(BF16), np.asarray(idx).astype(np.int8),
                      np.asarray(idx_scale, np.float32).reshape(-1), candidates,
                      Out((rows, topk), np.int32, "top")])
