"""Stage 6 (reference): the physical rows of the compressed entries each query reads, through its own table
row (the ``csa_cmp`` / ``hca_cmp`` pools; -1 = none).

* HCA (dense, :func:`visible_entry_rows`): every visible entry ``c < (p + 1) // 128`` of the row
  (the plan's ``visible[128]``, :func:`dspark_abi.layout.visible_entries`).
* CSA (:func:`chosen_entry_rows`): the top-k entries the lightning indexer chose.

Both are the ABI's slot formula, :func:`dspark_abi.layout.physical_rows`: -1 for padding rows, a dead column
(entry -1) or an unmapped page.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE, physical_rows
from dspark_kernels.model import plan


def visible_entry_rows(visible: np.ndarray, table_row: np.ndarray, table: np.ndarray,
                       page_size: int = KV_PAGE_SIZE) -> np.ndarray:
    """[T, Vmax] int64 rows of entries ``c < visible[t]`` (visible: [T] counts, 0 on padding rows; table_row [T],
    the table row each row reads, -1 on padding rows); -1 beyond.

    A forward reads these rows from its plan (``BatchPlan.entry_rows``, computed once per batch)."""
    return plan.visible_entry_rows(visible, table_row, table, page_size)


def chosen_entry_rows(entries: np.ndarray, table_row: np.ndarray, table: np.ndarray,
                      page_size: int = KV_PAGE_SIZE) -> np.ndarray:
    """[T, K] int64 rows of the logical entries [T, K] each row chose (-1 = none) through its table row
    (``BatchPlan.table_row`` of the rows; -1 on padding rows)."""
    return physical_rows(table, table_row, entries, page_size, ring=False)
