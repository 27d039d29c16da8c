"""Stage 3 (reference): sliding-window key rows, the last ``min(W, p + 1)`` positions of a query's own request.

Isolation comes only from using the query's own request's ``ori`` table row with absolute positions;
causality from keys <= p. Keys of the current chunk were written to the cache before this is read.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE, physical_rows
from dspark_kernels.reference.paged import NO_ROW


def window_rows(positions: np.ndarray, request: np.ndarray, ori_table: np.ndarray, window: int,
                page_size: int = KV_PAGE_SIZE) -> np.ndarray:
    """Physical ``ori`` rows of every query's window, oldest first.

    positions: [T] int, absolute in-request position p of each query row.
    request: [T] int, request of each row; -1 = padding row.
    ori_table: [R, width] int32 ori ring table (page ``i // page_size`` in column ``page % width``).
    Returns [T, W] int64. With ``v = min(W, p + 1)``, column k < v holds the row of key position
    ``p + 1 - v + k``; columns >= v, padding rows and unmapped pages hold -1.
    """
    p = np.asarray(positions, dtype=np.int64)[:, None]                   # (T, 1)
    k = np.arange(window, dtype=np.int64)[None, :]                       # (1, W)
    visible = np.minimum(window, p + 1)                                  # (T, 1)
    key_pos = np.where(k < visible, p + 1 - visible + k, -1)             # (T, W)
    rows = physical_rows(ori_table, request, key_pos, page_size, ring=True)
    return np.where(k < visible, rows, NO_ROW)
