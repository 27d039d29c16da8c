"""Stage 6 (reference): the sparse attention core, one softmax over a query's window keys and compressed keys,
with the sink.

For query t and head h, over the key set U_t = window rows (``ori`` pool) + compressed rows (``csa_cmp`` /
``hca_cmp`` pool), every key u a D-dim latent used as both key and value:

    l(u) = (q_th . u) * D^-0.5,  M = max_u l(u)   (the sink is not in the max)
    o_th = sum_u e^(l(u) - M) u / (sum_u e^(l(u) - M) + e^(sink_h - M))

then inverse RoPE on the last rd dims of o at the query's own position. Queries without keys (padding
rows) give 0. a2a3: q and keys are bf16, logits and sums fp32, the probabilities are rounded to bf16
before the PV product, and o is rounded to bf16 (the kernel's online softmax over key tiles is
algebraically this one-pass softmax). deepseek (the official tilelang ``sparse_attn``): the same, and o is bf16
before the inverse RoPE as well as after it. The official kernel rounds each 64-key block's probabilities
relative to the running maximum at that block, not the row's final one: the same precision, other rounding
points (identical for queries with at most 64 keys, as on TINY; beyond that not compared).

Implementation: queries are processed in tiles of one request, so memory stays bounded by the tile
size. A tile gathers the union of its queries' window rows once ([U, D], about t + W - 1 rows) and masks
each query to its own; masked keys contribute exact zeros. Compressed rows join that shared union when it
is small (HCA: every query sees a prefix of the same entries), and are gathered per query ([t, K, D],
batched matmuls) when the union is much larger than each query's own set (CSA top-k at long contexts).
Both forms compute the same softmax; only the amount of wasted work differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark_kernels.model.numerics import Precision, narrow
from dspark_kernels.model.plan import Run
from dspark_kernels.model.rope import apply_rope
from dspark_kernels.reference.paged import gather_rows
from dspark_kernels.reference.tiling import request_runs, tiles

#: Query rows per attention tile.
ATTENTION_TILE = 64
#: Gather compressed rows per query once their tile union exceeds this many times one query's set.
PER_QUERY_GATHER_RATIO = 2


def _union(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct rows >= 0 [U], position of every entry of ``rows`` in it or -1) for rows [t, K]."""
    union = np.unique(rows[rows >= 0])
    where = np.searchsorted(union, np.maximum(rows, 0))
    return union, np.where(rows >= 0, where, -1)


def _membership(columns: list[np.ndarray], offsets: list[int], t: int, width: int) -> np.ndarray:
    """[t, width] bool: True where a query's key list (columns[i] + offsets[i], -1 = none) hits."""
    mask = np.zeros((t, width), dtype=bool)
    for cols, off in zip(columns, offsets, strict=True):
        qi, ki = np.nonzero(cols >= 0)
        mask[qi, cols[qi, ki] + off] = True
    return mask


def _attend_tile(q: np.ndarray, keys: np.ndarray, member: np.ndarray, own: np.ndarray | None,
                 own_valid: np.ndarray | None, sink: np.ndarray, scale: float, precision: Precision) -> np.ndarray:
    """o [t, H, D] for q [t, H, D]; zeros where a query has no key.

    keys [U, D] shared by the tile, member [t, U] which of them each query sees; own [t, K, D] per-query
    keys with own_valid [t, K], or None.
    """
    t, heads, dim = q.shape
    logits = (q.reshape(t * heads, dim) @ keys.T).reshape(t, heads, -1)              # (t, H, U)
    visible = member
    if own is not None and own_valid is not None:
        logits = np.concatenate([logits, np.matmul(q, own.transpose(0, 2, 1))], axis=2)  # (t, H, U + K)
        visible = np.concatenate([member, own_valid], axis=1)
    logits *= np.float32(scale)
    logits += np.where(visible, np.float32(0), np.float32(-np.inf))[:, None, :]
    top = logits.max(axis=2, keepdims=True) if logits.shape[2] else np.full((t, heads, 1), -np.inf, np.float32)
    has_keys = np.isfinite(top)                                                       # (t, H, 1)
    top[~has_keys] = 0
    probs = np.exp(np.subtract(logits, top, out=logits), out=logits)                 # (t, H, U [+ K]), in place
    denom = probs.sum(axis=2, keepdims=True) + np.exp(sink[None, :, None] - top)     # (t, H, 1)
    pv = narrow(probs, precision)
    shared = keys.shape[0]
    o = (np.ascontiguousarray(pv[:, :, :shared]).reshape(t * heads, shared) @ keys).reshape(t, heads, dim)
    if own is not None:
        o += np.matmul(pv[:, :, shared:], own)                                        # (t, H, D)
    o /= denom
    o[~has_keys[:, :, 0]] = 0
    return np.asarray(o)


def sparse_attention(q: np.ndarray, request: np.ndarray, window_rows: np.ndarray, ori_pool: np.ndarray,
                     cmp_rows: np.ndarray | None, cmp_pool: np.ndarray | None, sink: np.ndarray,
                     cos: np.ndarray, sin: np.ndarray, *, scale: float, precision: Precision,
                     tile: int = ATTENTION_TILE, runs: Sequence[Run] | None = None) -> np.ndarray:
    """Attention output o [T, H, D] float32 (bf16 values in a2a3).

    q: [T, H, D] float32 queries (RoPE applied); request: [T] (-1 = padding row, output 0);
    window_rows: [T, W] int64 physical ``ori`` rows (-1 = none); ori_pool: [rows, D];
    cmp_rows: [T, K] int64 physical rows of the compressed pool (-1 = none) or None (SWA layers);
    cmp_pool: [rows, D] or None; sink: [H] float32 per-head sink logit;
    cos, sin: [T, rd/2] RoPE at each query's position (for the inverse rotation of the output).
    runs: the rows' request runs (the plan's, :meth:`~dspark_kernels.model.plan.BatchPlan.runs_in`; derived
    from ``request`` when None).
    """
    t_all, heads, dim = q.shape
    out = np.zeros((t_all, heads, dim), dtype=np.float32)
    for start, stop, r in request_runs(request) if runs is None else runs:
        if r < 0:
            continue
        for lo, hi in tiles(start, stop, tile):
            w_union, w_cols = _union(window_rows[lo:hi])
            key_parts, cols, offsets = [ori_pool[w_union]], [w_cols], [0]
            own = own_valid = None
            if cmp_rows is not None and cmp_pool is not None:
                rows = cmp_rows[lo:hi]
                c_union, c_cols = _union(rows)
                if c_union.size <= PER_QUERY_GATHER_RATIO * rows.shape[1]:
                    key_parts.append(cmp_pool[c_union])
                    cols.append(c_cols)
                    offsets.append(w_union.size)
                else:
                    own, own_valid = gather_rows(cmp_pool, rows)                      # (t, K, D), (t, K)
                    own = own.astype(np.float32, copy=False)
            keys = np.concatenate(key_parts).astype(np.float32, copy=False)          # (U, D)
            member = _membership(cols, offsets, hi - lo, keys.shape[0])               # (t, U)
            out[lo:hi] = _attend_tile(q[lo:hi], keys, member, own, own_valid, sink, scale, precision)
    if precision == "deepseek":  # the kernel writes o in bf16; the inverse RoPE then runs in fp32
        out = narrow(out, precision)
    return narrow(apply_rope(out, cos, sin, inverse=True, out=out), precision)
