"""Stage 3 (reference): sliding-window key rows, the last ``min(W, p + 1)`` positions of a query's own request.

Isolation comes only from using the query's own request's ``ori`` table row with absolute positions;
causality from keys <= p. Keys of the current chunk were written to the cache before this is read.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE
from dspark_kernels.model.plan import window_key_rows


def window_rows(positions: np.ndarray, request: np.ndarray, ori_table: np.ndarray, window: int,
                page_size: int = KV_PAGE_SIZE) -> np.ndarray:
    """Physical ``ori`` rows of every query's window, oldest first.

    positions: [T] int, absolute in-request position p of each query row.
    request: [T] int, request of each row; -1 = padding row.
    ori_table: [R, width] int32 ori ring table (page ``i // page_size`` in column ``page % width``).
    Returns [T, W] int64. With ``v = min(W, p + 1)``, column k < v holds the row of key position
    ``p + 1 - v + k``; columns >= v, padding rows and unmapped pages hold -1. A forward reads these rows from its
    plan (``BatchPlan.window``, computed once per batch with the same function).
    """
    return window_key_rows(positions, request, ori_table, window, page_size)
