"""Lightning indexer of CSA layers: its key compressor, its queries, scores and top-k selection.

Keys (all group rows): the ratio-4 compressor at ``index_head_dim`` (own weights and state pool), then the
Hadamard rotation ``z = y @ Hd`` (Sylvester / sqrt(dI)). fp32 stores z exactly (scale 1.0); a2a3 rounds z to
bf16 (y already bf16, Hd bf16) and stores ``int8q(z)``: int8 row + float32 dequant scale.

Queries (query rows): ``q = (qr @ indexer.wq_b.T).reshape(T, HI, dI)`` from the attention's normalised
low-rank query (no per-head norm), RoPE on the last rd dims at the token's position with the
compressed-layer frequencies, then the same Hadamard. a2a3: int8 product for the projection, bf16 after
RoPE, ``bf16(q) @ Hd`` then ``int8q`` per (token, head). Head weights
``w = (x @ weights_proj.T) * index_weight_scale`` [T, HI].

Score of candidate entry c (the request's own entries ``c < (p + 1) // 4``, through its idx table):
``score = k_scale[c] * sum_h w[h] * ReLU(q_scale[h] * <q[h], k[c]>)``; with fp32's unit scales this is
``sum_h w[h] * ReLU(q[h] . k[c])``. Top-k: :func:`~dspark_kernels.reference.topk.select_topk`.
"""

from __future__ import annotations

import attrs
import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE, RATIO4_STATE_PAGE_SIZE
from dspark_kernels.reference.compressor import compress
from dspark_kernels.reference.numerics import Precision, bf16_round, int8_matmul, int8_quantize, linear, narrow
from dspark_kernels.reference.paged import gather_rows, request_rows, scatter_rows
from dspark_kernels.reference.prepared import PreparedWeights
from dspark_kernels.reference.projections import LowRankQuery
from dspark_kernels.reference.rope import apply_rope
from dspark_kernels.reference.tiling import request_runs, tiles
from dspark_kernels.reference.topk import select_topk

#: Indexer compression ratio (entries are the CSA ratio-4 entries).
INDEX_RATIO = 4
#: Upper bound of the [T, HI, C] score intermediate per tile, in elements.
SCORE_TILE_ELEMENTS = 1 << 22


@attrs.frozen(eq=False)
class IndexerQuery:
    """Indexer queries of T rows."""

    q: np.ndarray
    """[T, HI, dI] float32, Hadamard-rotated (int8 values in a2a3)"""
    q_scale: np.ndarray
    """[T, HI] float32 dequant scale per (token, head); 1.0 in fp32"""
    weights: np.ndarray
    """[T, HI] float32 head weights, index_weight_scale included"""

    def rows(self, lo: int, hi: int) -> IndexerQuery:
        return IndexerQuery(self.q[lo:hi], self.q_scale[lo:hi], self.weights[lo:hi])


def compress_index_keys(x: np.ndarray, positions: np.ndarray, request: np.ndarray, state_slots: np.ndarray,
                        state_table: np.ndarray, state_pool: np.ndarray, idx_slots: np.ndarray,
                        idx_pool: np.ndarray, idx_scale_pool: np.ndarray, w: PreparedWeights,
                        cos: np.ndarray, sin: np.ndarray, *, eps: float, precision: Precision) -> None:
    """Indexer compressor over a TP group's rows; **mutates** the inner state, idx and idx_scale pools.

    x [P, X]; positions, request [P]; state_slots, idx_slots [P] int64 (-1 = no write); state_table [R, w];
    state_pool [rows, 4*dI]; idx_pool [rows, dI] (int8 in a2a3, float32 in fp32); idx_scale_pool [rows];
    cos, sin [P, rd/2] at each row's window start.
    """
    if w.idx_compressor is None or w.idx_hadamard is None:
        raise ValueError("compress_index_keys needs CSA weights (indexer compressor and Hadamard)")
    b, y = compress(x, positions, request, state_slots, state_table, state_pool, w.idx_compressor, cos, sin,
                    page_size=RATIO4_STATE_PAGE_SIZE, eps=eps, precision=precision)
    z = y @ w.idx_hadamard                                                            # (B, dI)
    slots = np.asarray(idx_slots)[b]
    if precision == "fp32":
        scatter_rows(idx_pool, slots, z)
        scatter_rows(idx_scale_pool, slots, np.ones(b.size, dtype=np.float32))
        return
    z_q, z_scale = int8_quantize(bf16_round(z))
    scatter_rows(idx_pool, slots, z_q.astype(np.int8))
    scatter_rows(idx_scale_pool, slots, z_scale)


def index_query(lrq: LowRankQuery, x: np.ndarray, w: PreparedWeights, cos: np.ndarray, sin: np.ndarray,
                heads: int, weight_scale: float, precision: Precision) -> IndexerQuery:
    """Indexer queries of query rows: lrq over T rows, x [T, X], cos/sin [T, rd/2] at the rows' positions."""
    if w.idx_wq_b is None or w.idx_weights_proj is None or w.idx_hadamard is None:
        raise ValueError("index_query needs CSA weights (indexer.wq_b, weights_proj)")
    q = lrq.project(w.idx_wq_b, w.idx_wq_b_scale)                                    # (T, HI*dI)
    q = narrow(apply_rope(q.reshape(q.shape[0], heads, -1), cos, sin), precision)    # (T, HI, dI)
    q = (q.reshape(-1, q.shape[2]) @ w.idx_hadamard).reshape(q.shape)                 # (T, HI, dI)
    head_w = linear(x, w.idx_weights_proj) * np.float32(weight_scale)                 # (T, HI)
    if precision == "fp32":
        return IndexerQuery(q, np.ones(q.shape[:2], dtype=np.float32), head_w)
    q_q, q_scale = int8_quantize(q)
    return IndexerQuery(q_q, q_scale, head_w)


def index_scores(query: IndexerQuery, keys: np.ndarray, key_scale: np.ndarray, precision: Precision) -> np.ndarray:
    """[T, C] float32 scores of T queries against C keys [C, dI] (int8 values in a2a3) with scales [C]."""
    t, heads, dim = query.q.shape
    flat = query.q.reshape(t * heads, dim)                                            # (T*HI, dI)
    dots = int8_matmul(flat, keys) if precision == "a2a3" else linear(flat, keys)        # (T*HI, C)
    relu = np.maximum(dots.reshape(t, heads, -1) * query.q_scale[:, :, None], 0)     # (T, HI, C)
    return np.matmul(query.weights[:, None, :], relu)[:, 0, :] * key_scale[None, :]  # (T, C)


def lightning_topk(query: IndexerQuery, positions: np.ndarray, request: np.ndarray, idx_table: np.ndarray,
                   idx_pool: np.ndarray, idx_scale_pool: np.ndarray, *, topk: int,
                   precision: Precision) -> np.ndarray:
    """Top-k compressed entries of every query row, from its own request's visible entries only.

    query over T rows; positions, request [T] (-1 padding); idx_table [R, width]; idx_pool [rows, dI];
    idx_scale_pool [rows]. Returns [T, topk] int32 logical entry indices (descending score, ties by lower
    index), -1 after ``min(topk, visible)`` entries and on padding rows. Unmapped entries are never chosen.
    """
    positions = np.asarray(positions, dtype=np.int64)
    out = np.full((positions.size, topk), -1, dtype=np.int32)
    for start, stop, r in request_runs(request):
        if r < 0:
            continue
        visible = (positions[start:stop] + 1) // INDEX_RATIO                          # (n,)
        count = int(visible.max())
        if count == 0:
            continue
        rows = request_rows(idx_table[r], np.arange(count), KV_PAGE_SIZE)            # (C,)
        keys, mapped = gather_rows(idx_pool, rows)                                    # (C, dI)
        key_scale, _ = gather_rows(idx_scale_pool, rows)                              # (C,)
        keys = keys.astype(np.float32)
        tile = max(1, SCORE_TILE_ELEMENTS // (query.q.shape[1] * count))
        for lo, hi in tiles(start, stop, tile):
            scores = index_scores(query.rows(lo, hi), keys, key_scale, precision)    # (t, C)
            candidate = mapped[None, :] & (np.arange(count)[None, :] < visible[lo - start:hi - start, None])
            out[lo:hi] = select_topk(np.where(candidate, scores, -np.inf), topk)
    return out
