"""Paged cache access: scatter rows through slot mappings, resolve logical indices through block tables.

A pool is a flat array ``[blocks * page_size, ...]``. A block-table row maps logical page ``i // page_size``
to a physical block (``-1`` = unmapped); the physical row of logical index ``i`` is
``block * page_size + i % page_size``. ``-1`` is never used as an index: it never wraps to the last row.
"""

from __future__ import annotations

import numpy as np

#: Physical-row value meaning "no row" (unmapped page, padding row, or beyond the table).
NO_ROW = -1


def physical_rows(table: np.ndarray, request: np.ndarray, logical: np.ndarray, page_size: int) -> np.ndarray:
    """Physical rows of logical indices, each looked up in its own request's table row.

    table: [R, width] int32 block table (-1 = unmapped page).
    request: [T] int, request of each row (-1 = padding row).
    logical: [T, K] int, logical index per row and column (negative = none).
    Returns [T, K] int64: ``table[request, logical // page_size] * page_size + logical % page_size``,
    or -1 where the request is -1, the logical index is negative or beyond the table, or the page is unmapped.
    """
    request = np.asarray(request, dtype=np.int64)
    logical = np.asarray(logical, dtype=np.int64)
    page = logical // page_size                                                     # (T, K)
    ok = (request[:, None] >= 0) & (logical >= 0) & (page < table.shape[1])          # (T, K)
    block = np.full(logical.shape, NO_ROW, dtype=np.int64)
    t_idx, k_idx = np.nonzero(ok)
    block[t_idx, k_idx] = table[request[t_idx], page[t_idx, k_idx]]
    rows = block * page_size + logical % page_size
    return np.where(block >= 0, rows, NO_ROW)


def request_rows(table_row: np.ndarray, logical: np.ndarray, page_size: int) -> np.ndarray:
    """Physical rows [K] int64 of logical indices [K] through ONE request's table row [width]; -1 if unmapped."""
    return physical_rows(table_row[None, :], np.zeros(1, np.int64), np.asarray(logical)[None, :], page_size)[0]


def scatter_rows(pool: np.ndarray, slots: np.ndarray, values: np.ndarray) -> None:
    """In place: ``pool[slots[t]] = values[t]`` for every ``t`` with ``slots[t] >= 0``; -1 rows write nothing.

    pool: [rows, ...]; slots: [T] int64 (distinct where >= 0, as the ABI requires); values: [T, ...].
    Values are cast to the pool dtype.
    """
    slots = np.asarray(slots, dtype=np.int64)
    live = slots >= 0
    pool[slots[live]] = values[live]


def gather_rows(pool: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``pool`` at physical ``rows`` [...] (int, -1 = none).

    Returns (values [..., row...] with zeros where rows < 0, valid [...] bool). Never wraps -1.
    """
    rows = np.asarray(rows, dtype=np.int64)
    valid = rows >= 0
    values = np.take(pool, np.where(valid, rows, 0), axis=0)
    values[~valid] = 0
    return values, valid
