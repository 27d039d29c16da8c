"""Stage 6 (and the indexer's candidates of stage 5): physical rows of compressed entries through each row's
own request table (upstream's compressed-entry gathers of sparse attention and the indexer).

Index arithmetic is done in fp32 (exact below 2**24), as for the window rows (:mod:`.window`); the launcher
raises ``ABIError`` ``kernel.index_range`` before building a kernel whose indices would reach 2**24
(:mod:`.index_guard`, with the table's own width). The compressed pools (``csa_cmp``, ``idx``, ``hca_cmp``) are
not ring pools: entry ``c`` sits in column ``c // 32``, and their tables may be trimmed to the batch's widest live
range, so a page at or beyond the table's width is "no row" (-1), never a wrap onto another column. Rows
narrower than 32 bytes (fewer than :data:`~dspark_kernels.pypto._ops.MIN_COLUMNS` entries) are padded with dead
columns.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE
from dspark_kernels.pypto._ops import MIN_COLUMNS, table_rows
from dspark_kernels.pypto.index_guard import check_table
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto

#: Columns of the kernel's [16, n] vector tiles. Whole rows overflow the 192 KB unified buffer from about 2,000
#: columns (an HCA request ~294k positions deep sees 2296 entries: ``CMP ... in/output total size [199872] exceeds
#: MEM_UB size [196608]``; FLASH at 1,048,576 positions sees up to 8192); 512 keeps an fp32 tile at 32 KB.
TILE_COLUMNS = 512


@lru_cache(maxsize=32)
def entry_rows_kernel(rows: int, requests: int, width: int, columns: int, ratio: int, page: int = KV_PAGE_SIZE,
                      *, ring: bool) -> Any:
    """Physical rows of compressed entries through each row's own request table (upstream's entry gathers).

    ``ratio == 0`` (CSA): the entries are given (``entries`` [T, K] int32, the top-k, -1 = none).
    ``ratio > 0`` (HCA dense): column c is entry c itself, live while ``c < (p + 1) // ratio``.
    Arguments: ``positions``, ``request_ids`` [T, 1] int32; ``table`` [R * width] int32 flattened;
    ``entries`` [T, K] int32; out ``rows`` [T, K] int32: ``block * 32 + c % 32``, -1 for a dead column, a
    padding row, a page beyond the table (``ring=False``, the compressed pools) or an unmapped page.
    ring: the table is a ring table (``PoolLayout.is_ring``; False for every pool this stage reads).
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
        pypto.set_vec_tile_shapes(16, min(columns, TILE_COLUMNS))
        request = pypto.expand_clone(pypto.cast(request_ids, pypto.DT_FP32), [rows, columns])
        if ratio > 0:
            entry = pypto.expand_clone(column, [rows, columns])
            p1 = pypto.expand_clone(pypto.cast(pypto.add(positions, 1), pypto.DT_FP32), [rows, columns])
            visible = pypto.floor(pypto.mul(p1, 1.0 / ratio))  # exact: ratio is a power of two
            live = pypto.lt(entry, visible)
        else:
            entry = pypto.cast(entries, pypto.DT_FP32)
            live = pypto.ge(entry, 0.0)
        physical = table_rows(table, request, entry, live, width=width, page=page, ring=ring)
        out[:] = pypto.cast(physical, pypto.DT_INT32)

    return entry_rows


def run_entry_rows(positions: np.ndarray, request_ids: np.ndarray, table: np.ndarray, entries: np.ndarray | None,
                   *, ring: bool, ratio: int = 0, columns: int | None = None, table_name: str = "block_table"
                   ) -> LaunchResult:
    """Physical rows [T, K] int32 (``values[-1]``) of compressed entries; see :func:`entry_rows_kernel`.

    CSA: ``entries`` [T, K] int (top-k logical entries, -1 = none), ``ratio=0``.
    HCA: ``entries=None``, ``ratio=128`` and ``columns`` = K, the widest visible count of the rows.
    ring: ``config.layout.pools[pool].is_ring`` of the table's pool (False for csa_cmp, idx, hca_cmp: a page
    beyond a trimmed table is -1). table_name: the table's name in a ``kernel.index_range`` issue (raised
    before any kernel is built).
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
    check_table(table_name, table, KV_PAGE_SIZE, np.concatenate([positions.reshape(-1), entries.reshape(-1)]),
                ring=ring)
    entries = entries.astype(np.int32)
    wanted = entries.shape[1]
    if wanted < MIN_COLUMNS:  # rows of fewer than 32 bytes cannot be tiled; padded columns are dead (-1)
        entries = np.concatenate([entries, np.full((len(entries), MIN_COLUMNS - wanted), -1, np.int32)], axis=1)
    k = entry_rows_kernel(len(positions), table.shape[0], table.shape[1], entries.shape[1], ratio, ring=ring)
    result = launch(k, [positions, request_ids, table.reshape(-1), entries, Out(entries.shape, np.int32, "rows")])
    return LaunchResult((*result.values[:-1], result.values[-1][:, :wanted]), result.cycles)
