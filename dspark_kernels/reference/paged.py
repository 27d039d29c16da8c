"""Stage 3 (reference): paged cache writes through slot mappings, and row gathers from a pool.

A pool is a flat array ``[blocks * page_size, ...]``. A block-table row maps logical page ``i // page_size``
(in column ``page % width`` of a ring pool's table) to a physical block (``-1`` = unmapped); the physical row
of logical index ``i`` is
``block * page_size + i % page_size`` (the ABI's slot formula, :func:`dspark_abi.layout.physical_rows`).
``-1`` is never used as an index: it never wraps to the last row.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.layout import physical_rows

#: Physical-row value meaning "no row" (unmapped page, padding row, or beyond the table).
NO_ROW = -1


def request_rows(table_row: np.ndarray, logical: np.ndarray, page_size: int, *, ring: bool = False) -> np.ndarray:
    """Physical rows [K] int64 of logical indices [K] through ONE request's table row [width]; -1 if unmapped.

    ring: the row is a ring table's (ori, state pools); the default suits the compressed pools."""
    rows: np.ndarray = physical_rows(table_row[None, :], np.zeros(1, np.int64), np.asarray(logical)[None, :],
                                     page_size, ring=ring)
    return np.asarray(rows[0])


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
