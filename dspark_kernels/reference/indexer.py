"""Stage 5 (reference): the lightning indexer of CSA layers: its queries, scores and deterministic top-k selection.

Keys: written by the indexer's key compressor (:func:`dspark_kernels.reference.compressor.compress_index_keys`).

Queries (query rows): ``q = (qr @ indexer.wq_b.T).reshape(T, HI, dI)`` from the attention's normalised
low-rank query (no per-head norm), RoPE on the last rd dims at the token's position with the
compressed-layer frequencies, then the same Hadamard. a2a3: int8 product for the projection, bf16 after
RoPE, ``bf16(q) @ Hd`` then ``int8q`` per (token, head). Head weights
``w = (x @ weights_proj.T) * index_weight_scale`` [T, HI].

Score of candidate entry c (the request's own entries ``c < (p + 1) // 4``, through its idx table):
``score = k_scale[c] * sum_h w[h] * ReLU(q_scale[h] * <q[h], k[c]>)``; with fp32's unit scales this is
``sum_h w[h] * ReLU(q[h] . k[c])``.

deepseek (the official ``Indexer.forward``): ``indexer.wq_b`` is an FP8 GEMM (bf16 out), q is bf16 after RoPE, then
rotated and FP4-fake-quantised (:func:`~dspark_kernels.model.deepseek_numerics.index_fake_quant`), like the keys;
``w = bf16(bf16(x @ weights_proj.T) * index_weight_scale)``; the scores are bf16 tensor ops:
``bf16(sum_h bf16(ReLU(bf16(q[h] . k[c])) * w[h]))`` (each product and the head sum rounded once). bf16 scores
tie often; the selection below breaks ties by entry index (``torch.topk`` leaves their order unspecified).

Top-k (:func:`select_topk`, deterministic): higher score first; among equal scores, the lower entry index first.
Entries with score -inf are not candidates (invisible or unmapped) and are never selected; rows with fewer than
k candidates select all of them and pad with -1. The selection is exact (no approximate partitioning): the k-th
largest score is found with ``np.partition`` and ties at that threshold are broken by entry index.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE, visible_entries
from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.geometry import INDEX_RATIO
from dspark_kernels.model.numerics import Precision, int8_matmul, int8_quantize, linear, narrow
from dspark_kernels.model.plan import BatchPlan, IndexKeyPools, Run, visible_entry_rows
from dspark_kernels.model.prepared import PreparedWeights
from dspark_kernels.model.rope import apply_rope
from dspark_kernels.reference.paged import gather_rows
from dspark_kernels.reference.projections import LowRankQuery
from dspark_kernels.reference.tiling import request_runs, tiles

#: Upper bound of the [T, HI, C] score intermediate per tile, in elements.
SCORE_TILE_ELEMENTS = 1 << 22


@attrs.frozen(eq=False)
class IndexerQuery:
    """Indexer queries of T rows."""

    q: np.ndarray
    """[T, HI, dI] float32, Hadamard-rotated (int8 values in a2a3, FP4 fake-quantised in deepseek)"""
    q_scale: np.ndarray
    """[T, HI] float32 dequant scale per (token, head); 1.0 in fp32"""
    weights: np.ndarray
    """[T, HI] float32 head weights, index_weight_scale included"""

    def rows(self, lo: int, hi: int) -> IndexerQuery:
        return IndexerQuery(self.q[lo:hi], self.q_scale[lo:hi], self.weights[lo:hi])


@attrs.frozen(eq=False)
class IndexCandidates:
    """The candidate lookups of T query rows: every visible idx entry of each row, through its table row.

    visible: [T] int64 idx entries each row sees, ``(p + 1) // 4`` (0 on padding rows), the plan's ``visible[4]``.
    table_row: [T] int the row of ``table`` each row reads (-1 on padding rows), the plan's ``table_row``.
    table: [R_t, width] int32 the idx block table (-1 = unmapped), the plan's ``tables["idx"]``.

    Rows of one request see prefixes of the same entries, so a run's candidates are its widest row's: :meth:`row`
    derives one row's, O(its visible count); :attr:`rows` derives all of them, [T, max(visible)], which at 1M
    positions (262,144 entries a row) is what a forward must not hold.
    """

    visible: np.ndarray
    table_row: np.ndarray
    table: np.ndarray

    @classmethod
    def of_plan(cls, plan: BatchPlan, lo: int, hi: int) -> IndexCandidates:
        """The candidates of the plan's group rows ``[lo, hi)``."""
        return cls(plan.visible[INDEX_RATIO][lo:hi], plan.table_row[lo:hi], plan.tables["idx"])

    def row(self, t: int) -> np.ndarray:
        """[visible[t]] int64 physical idx rows of row t's visible entries (-1 = unmapped)."""
        one: np.ndarray = visible_entry_rows(self.visible[t:t + 1], self.table_row[t:t + 1], self.table,
                                             KV_PAGE_SIZE)[0]
        return one

    @property
    def rows(self) -> np.ndarray:
        """[T, max(visible)] int64 physical idx rows of every row's visible entries (-1 beyond a row's count or
        unmapped)."""
        return visible_entry_rows(self.visible, self.table_row, self.table, KV_PAGE_SIZE)

    @classmethod
    def lookup(cls, positions: np.ndarray, table_row: np.ndarray, idx_table: np.ndarray) -> IndexCandidates:
        """The candidates of T rows looked up on bare arrays (a forward reads its plan's instead): positions [T],
        table_row [T] the ``idx_table`` [R_t, width] row each row reads (-1 = padding row)."""
        table_row = np.asarray(table_row)
        visible = np.where(table_row >= 0, visible_entries(positions, INDEX_RATIO), 0)
        return cls(visible, table_row, idx_table)


def index_query(lrq: LowRankQuery, x: np.ndarray, w: PreparedWeights, cos: np.ndarray, sin: np.ndarray,
                heads: int, weight_scale: float, precision: Precision) -> IndexerQuery:
    """Indexer queries of query rows: lrq over T rows, x [T, X], cos/sin [T, rd/2] at the rows' positions."""
    if w.idx_wq_b is None or w.idx_weights_proj is None or w.idx_hadamard is None:
        raise ValueError("index_query needs CSA weights (indexer.wq_b, weights_proj)")
    q = lrq.project(w.idx_wq_b, w.idx_wq_b_scale, "attn.indexer.wq_b")               # (T, HI*dI)
    q = narrow(apply_rope(q.reshape(q.shape[0], heads, -1), cos, sin), precision)    # (T, HI, dI)
    if precision == "deepseek":
        proj = ds.linear(x, w.idx_weights_proj, "attn.indexer.weights_proj", w.fp8_inputs)          # (T, HI) bf16
        return IndexerQuery(ds.index_fake_quant(q), np.ones(q.shape[:2], dtype=np.float32),
                            narrow(proj * np.float32(weight_scale), precision))
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
    if precision == "deepseek":  # bf16 tensor ops; key scales are 1.0
        relu = np.maximum(narrow(linear(flat, keys), precision).reshape(t, heads, -1), 0)   # (T, HI, C)
        weighted = narrow(relu * query.weights[:, :, None], precision)                      # (T, HI, C)
        return narrow(weighted.sum(axis=1, dtype=np.float32), precision)                     # (T, C)
    dots = int8_matmul(flat, keys) if precision == "a2a3" else linear(flat, keys)        # (T*HI, C)
    relu = np.maximum(dots.reshape(t, heads, -1) * query.q_scale[:, :, None], 0)     # (T, HI, C)
    return np.asarray(np.matmul(query.weights[:, None, :], relu)[:, 0, :] * key_scale[None, :])  # (T, C)


def lightning_topk(query: IndexerQuery, request: np.ndarray, keys: IndexKeyPools, candidates: IndexCandidates, *,
                   topk: int, precision: Precision, runs: Sequence[Run] | None = None) -> np.ndarray:
    """Top-k compressed entries of every query row, from its own request's visible entries only.

    query over T rows; request [T] (-1 padding); keys: the layer's idx and idx_scale pools; candidates: the rows'
    visible counts and candidate rows (the plan's, :meth:`~dspark_kernels.model.plan.BatchPlan.entry_rows_in`, or
    :meth:`IndexCandidates.lookup`); runs: the rows' request runs (the plan's,
    :meth:`~dspark_kernels.model.plan.BatchPlan.runs_in`; derived from ``request`` when None). Returns
    [T, topk] int32 logical entry indices (descending score, ties by lower index), -1 after
    ``min(topk, visible)`` entries and on padding rows. Unmapped entries are never chosen.
    """
    out = np.full((len(request), topk), -1, dtype=np.int32)
    for start, stop, r in request_runs(request) if runs is None else runs:
        if r < 0:
            continue
        visible = candidates.visible[start:stop]                                     # (n,)
        count = int(visible.max())
        if count == 0:
            continue
        # the run's widest row sees every entry of the run: its candidate rows are the run's keys
        rows = candidates.row(start + int(np.argmax(visible)))                       # (C,)
        run_keys, mapped = gather_rows(keys.keys, rows)                               # (C, dI)
        key_scale, _ = gather_rows(keys.scales, rows)                                 # (C,)
        run_keys = run_keys.astype(np.float32)
        tile = max(1, SCORE_TILE_ELEMENTS // (query.q.shape[1] * count))
        for lo, hi in tiles(start, stop, tile):
            scores = index_scores(query.rows(lo, hi), run_keys, key_scale, precision)  # (t, C)
            candidate = mapped[None, :] & (np.arange(count)[None, :] < visible[lo - start:hi - start, None])
            out[lo:hi] = select_topk(np.where(candidate, scores, -np.inf), topk)
    return out


def select_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Top-k entries of each row.

    scores: [T, C] float32, -inf = not a candidate. Returns [T, k] int32: the first ``min(k, candidates)``
    columns are entry indices in descending score (ties: ascending index), the rest -1.
    """
    t, c = scores.shape
    valid = np.isfinite(scores)                                                       # (T, C)
    n_valid = valid.sum(axis=1)                                                       # (T,)
    if c > k:
        thr = np.partition(np.where(valid, scores, -np.inf), c - k, axis=1)[:, c - k]  # k-th largest, (T,)
        above = valid & (scores > thr[:, None])
        at = valid & (scores == thr[:, None])
        need = np.minimum(k, n_valid) - above.sum(axis=1)                             # ties still to take
        chosen = above | (at & (np.cumsum(at, axis=1) <= need[:, None]))
        chosen = np.where((n_valid <= k)[:, None], valid, chosen)
    else:
        chosen = valid
    out = np.full((t, k), -1, dtype=np.int32)
    rows, cols = np.nonzero(chosen)                                                   # ascending index per row
    out[rows, (np.cumsum(chosen, axis=1) - 1)[rows, cols]] = cols
    picked = np.where(out >= 0, scores[np.arange(t)[:, None], np.maximum(out, 0)], -np.inf)  # (T, k)
    order = np.argsort(-picked, axis=1, kind="stable")  # stable: equal scores keep ascending index
    return np.take_along_axis(out, order, axis=1)
