"""Stage 6 (and the indexer's candidates of stage 5): physical rows of compressed entries through each row's
own request table (upstream's compressed-entry gathers of sparse attention and the indexer).

Index arithmetic is done in fp32 (exact below 2**24), as for the window rows (:mod:`.window`); the launcher
raises ``ABIError`` ``kernel.index_range`` before building a kernel whose indices would reach 2**24
(:mod:`.index_guard`). Rows narrower than 32 bytes (fewer than :data:`~dspark_kernels.pypto._ops.MIN_COLUMNS`
entries) are padded with dead columns.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE
from dspark_kernels.pypto._ops import MIN_COLUMNS
from dspark_kernels.pypto.index_guard import check_table
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto


@lru_cache(maxsize=32)
def entry_rows_kernel(rows: int, requests: int, width: int, columns: int, ratio: int, page: int = KV_PAGE_SIZE
                      ) -> Any:
    """Physical rows of compressed entries through each row's own request table (upstream's entry gathers).

    ``ratio == 0`` (CSA): the entries are given (``entries`` [T, K] int32, the top-k, -1 = none).
    ``ratio > 0`` (HCA dense): column c is entry c itself, live while ``c < (p + 1) // ratio``.
    Arguments: ``positions``, ``request_ids`` [T, 1] int32; ``table`` [R * width] int32 flattened;
    ``entries`` [T, K] int32; out ``rows`` [T, K] int32: ``block * 32 + c % 32``, -1 for a dead column, a
    padding row, a page beyond the table or an unmapped page.
    """

    @kernel
    def entry_rows(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            positions: pypto.Tensor([rows, 1], pypto.DT_INT32),
            request_ids: pypto.Tensor([rows, 1], pypto.DT_INT32),
            table: pypto.Tensor([requests * width], pypto.DT_INT32),
            entries: pypto.Tensor([rows, columns], pypto.DT_INT32),
            out: pypto.Tensor([rows, columns], pypto.DT_INT32)):
        _sizes = (rows, requests, width, columns)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(columns)
        column = pypto.reshape(pypto.cast(pypto.arange(columns), pypto.DT_FP32), [1, columns])
        pypto.set_vec_tile_shapes(16, columns)
        request = pypto.expand_clone(pypto.cast(request_ids, pypto.DT_FP32), [rows, columns])
        if ratio > 0:
            entry = pypto.expand_clone(column, [rows, columns])
            p1 = pypto.expand_clone(pypto.cast(pypto.add(positions, 1), pypto.DT_FP32), [rows, columns])
            visible = pypto.floor(pypto.mul(p1, 1.0 / ratio))  # exact: ratio is a power of two
            live = pypto.lt(entry, visible)
        else:
            entry = pypto.cast(entries, pypto.DT_FP32)
            live = pypto.ge(entry, 0.0)
        logical_page = pypto.floor(pypto.mul(entry, 1.0 / page))
        live = pypto.logical_and(live, pypto.logical_and(pypto.ge(request, 0.0), pypto.lt(logical_page, float(width))))
        offset = pypto.sub(entry, pypto.mul(logical_page, float(page)))
        slot = pypto.where(live, pypto.add(pypto.mul(request, float(width)), logical_page), 0.0)
        flat = pypto.reshape(pypto.cast(slot, pypto.DT_INT32), [rows * columns])
        block = pypto.cast(pypto.reshape(pypto.index_select(table, 0, flat), [rows, columns]), pypto.DT_FP32)
        mapped = pypto.logical_and(live, pypto.ge(block, 0.0))
        out[:] = pypto.cast(pypto.where(mapped, pypto.add(pypto.mul(block, float(page)), offset), -1.0), pypto.DT_INT32)

    return entry_rows


def run_entry_rows(positions: np.ndarray, request_ids: np.ndarray, table: np.ndarray, entries: np.ndarray | None,
                   *, ratio: int = 0, columns: int | None = None, table_name: str = "block_table"
                   ) -> LaunchResult:
    """Physical rows [T, K] int32 (``values[-1]``) of compressed entries; see :func:`entry_rows_kernel`.

    CSA: ``entries`` [T, K] int (top-k logical entries, -1 = none), ``ratio=0``.
    HCA: ``entries=None``, ``ratio=128`` and ``columns`` = K, the widest visible count of the rows.
    table_name: the table's name in a ``kernel.index_range`` issue (raised before any kernel is built).
    """
    positions = np.asarray(positions, dtype=np.int32).reshape(-1, 1)
    request_ids = np.asarray(request_ids, dtype=np.int32).reshape(-1, 1)
    table = np.asarray(table, dtype=np.int32)
    if entries is None:
        if ratio <= 0 or columns is None:
            raise ValueError("dense entry rows need ratio > 0 and columns")
        entries = np.zeros((len(positions), columns), np.int32)
    elif ratio != 0:
        raise ValueError("given entries need ratio=0")
    entries = np.asarray(entries, dtype=np.int64)
    check_table(table_name, table, KV_PAGE_SIZE, np.concatenate([positions.reshape(-1), entries.reshape(-1)]))
    entries = entries.astype(np.int32)
    wanted = entries.shape[1]
    if wanted < MIN_COLUMNS:  # rows of fewer than 32 bytes cannot be tiled; padded columns are dead (-1)
        entries = np.concatenate([entries, np.full((len(entries), MIN_COLUMNS - wanted), -1, np.int32)], axis=1)
    k = entry_rows_kernel(len(positions), table.shape[0], table.shape[1], entries.shape[1], ratio)
    result = launch(k, [positions, request_ids, table.reshape(-1), entries, Out(entries.shape, np.int32, "rows")])
    return LaunchResult((*result.values[:-1], result.values[-1][:, :wanted]), result.cycles)
