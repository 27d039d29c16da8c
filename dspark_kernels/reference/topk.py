"""Deterministic top-k selection of the lightning indexer.

Order: higher score first; among equal scores, the lower entry index first. Entries with score -inf are
not candidates (invisible or unmapped) and are never selected; rows with fewer than k candidates select
all of them and pad with -1. The selection is exact (no approximate partitioning): the k-th largest score
is found with ``np.partition`` and ties at that threshold are broken by entry index.
"""

from __future__ import annotations

import numpy as np


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
