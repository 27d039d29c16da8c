"""Stage 3: paged cache writes through slot mappings, and sliding-window rows through a request's table.

``scatter_rows`` kernel (upstream section 5.1 step 5; the same kernel writes every pool):

* ``pool``  [rows, width] in/out (bf16, fp32, int32 or int8): a flattened pool, ``rows = blocks * page_size``.
* ``values`` [P, width] in, same dtype: one row per group token.
* ``slots`` [P] int32 in: physical row per token, -1 = write nothing (padding, non-boundary, unmapped).
  The ABI's slot mappings are int64; the host narrows them (pool rows are < 2**31, checked) because the
  0.2.0 interpreter reads loop scalars only from int32 kernel inputs.
  A per-token loop with a data-dependent branch: O(P) row copies, rows with -1 are skipped.

``window_rows`` kernel (upstream section 5.2):

* ``positions``  [L, 1] int32 in: absolute position p of each local row.
* ``request_ids`` [L, 1] int32 in: local request id (stage 1), -1 = padding.
* ``ori_table``  [R * width] int32 in: the ori block table, flattened row-major.
* ``rows``       [L, W] int32 out: column k < v = min(W, p+1) holds the physical row of key position
  ``p + 1 - v + k`` (``block * 32 + offset``); -1 for k >= v, unmapped pages and padding rows.
Index arithmetic is done in fp32 (exact below 2**24), because integer shifts are not available for int32;
the launchers raise ``ABIError`` ``kernel.index_range`` before building a kernel whose table entries
(R * width), pool rows (block * 32 + offset) or positions would reach 2**24 (:mod:`.index_guard`).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE
from dspark_kernels.pypto.index_guard import check_table
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto

#: Fewest int32 columns a kernel row may have: pypto tiles need rows of at least 32 bytes
#: (``lastDimBytes % BLOCK_SIZE == 0``).
MIN_COLUMNS = 8
_PYPTO_DTYPES = {np.dtype(ml_dtypes.bfloat16): "DT_BF16", np.dtype(np.float32): "DT_FP32",
                 np.dtype(np.int32): "DT_INT32", np.dtype(np.int8): "DT_INT8"}


@lru_cache(maxsize=32)
def scatter_kernel(tokens: int, rows: int, width: int, dtype_name: str) -> Any:
    """Row scatter for one geometry; ``dtype_name`` is a pypto dtype name such as 'DT_BF16'."""
    dtype = getattr(pypto, dtype_name)

    @kernel
    def scatter_rows(pool: pypto.Tensor([rows, width], dtype), values: pypto.Tensor([tokens, width], dtype),
                     slots: pypto.Tensor([tokens], pypto.DT_INT32)):
        _sizes = (tokens, rows, width, dtype)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(1, width)
        for t in pypto.loop(tokens):
            slot = slots[t]
            if slot >= 0:
                pypto.assemble(pypto.view(values, [1, width], [t, 0]), [slot, 0], pool)

    return scatter_rows


def narrow_slots(slots: np.ndarray, pool_rows: int) -> np.ndarray:
    """int64 slot mapping -> int32, raising ValueError if a slot is < -1 or >= pool_rows."""
    slots = np.asarray(slots, dtype=np.int64)
    bad = np.flatnonzero((slots < -1) | (slots >= pool_rows))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"slots[{i}]={int(slots[i])} must be -1 or in [0, {pool_rows}) ({bad.size} bad slots)")
    return slots.astype(np.int32)


def run_scatter(pool: np.ndarray, values: np.ndarray, slots: np.ndarray) -> LaunchResult:
    """``pool[slots[t]] = values[t]`` for slots >= 0, on a copy; ``values[0]`` of the result is the new pool.

    pool: [rows, ...] bf16/fp32/int32 (trailing dims are flattened); values: [P, ...] same trailing shape.
    """
    pool = np.asarray(pool)
    flat_pool = pool.reshape(pool.shape[0], -1)
    flat_values = np.asarray(values).astype(pool.dtype).reshape(len(values), -1)
    if flat_values.shape[1] != flat_pool.shape[1]:
        raise ValueError(f"values row width {flat_values.shape[1]} != pool row width {flat_pool.shape[1]}")
    name = _PYPTO_DTYPES.get(pool.dtype)
    if name is None:
        raise TypeError(f"pool dtype {pool.dtype} is not one of {sorted(str(d) for d in _PYPTO_DTYPES)}")
    k = scatter_kernel(len(flat_values), flat_pool.shape[0], flat_pool.shape[1], name)
    result = launch(k, [flat_pool, flat_values, narrow_slots(slots, pool.shape[0])])
    new_pool = result.values[0].reshape(pool.shape)
    return LaunchResult((new_pool, *result.values[1:]), result.cycles)


@lru_cache(maxsize=32)
def window_kernel(rows: int, requests: int, width: int, window: int, page: int = KV_PAGE_SIZE) -> Any:
    """Window-row construction for one geometry."""

    @kernel
    def window_rows(positions: pypto.Tensor([rows, 1], pypto.DT_INT32),
                    request_ids: pypto.Tensor([rows, 1], pypto.DT_INT32),
                    ori_table: pypto.Tensor([requests * width], pypto.DT_INT32),
                    out: pypto.Tensor([rows, window], pypto.DT_INT32)):
        _sizes = (rows, requests, width, window)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(window)
        column = pypto.reshape(pypto.cast(pypto.arange(window), pypto.DT_FP32), [1, window])
        pypto.set_vec_tile_shapes(16, window)
        k = pypto.expand_clone(column, [rows, window])
        p1 = pypto.expand_clone(pypto.cast(pypto.add(positions, 1), pypto.DT_FP32), [rows, window])
        visible = pypto.minimum(p1, pypto.full([rows, window], float(window), pypto.DT_FP32))
        key_pos = pypto.add(pypto.sub(p1, visible), k)                                      # p + 1 - v + k
        logical_page = pypto.floor(pypto.mul(key_pos, 1.0 / page))
        offset = pypto.sub(key_pos, pypto.mul(logical_page, float(page)))
        request = pypto.expand_clone(pypto.cast(request_ids, pypto.DT_FP32), [rows, window])
        live = pypto.logical_and(pypto.lt(k, visible), pypto.ge(request, 0.0))
        entry = pypto.where(live, pypto.add(pypto.mul(request, float(width)), logical_page), 0.0)
        flat_entry = pypto.reshape(pypto.cast(entry, pypto.DT_INT32), [rows * window])
        block = pypto.cast(pypto.reshape(pypto.index_select(ori_table, 0, flat_entry), [rows, window]), pypto.DT_FP32)
        physical = pypto.add(pypto.mul(block, float(page)), offset)
        mapped = pypto.logical_and(live, pypto.ge(block, 0.0))
        out[:] = pypto.cast(pypto.where(mapped, physical, -1.0), pypto.DT_INT32)

    return window_rows


def run_window(positions: np.ndarray, request_ids: np.ndarray, ori_table: np.ndarray, window: int) -> LaunchResult:
    """Window rows of L local rows; ``values[-1]`` is ``rows`` [L, W] int32 (see the module docstring)."""
    positions = np.asarray(positions, dtype=np.int32).reshape(-1, 1)
    request_ids = np.asarray(request_ids, dtype=np.int32).reshape(-1, 1)
    table = np.asarray(ori_table, dtype=np.int32)
    check_table("ori_block_table", table, KV_PAGE_SIZE, positions)  # fp32 indices exact, before any kernel
    k = window_kernel(len(positions), table.shape[0], table.shape[1], window)
    return launch(k, [positions, request_ids, table.reshape(-1), Out((len(positions), window), np.int32, "rows")])


@lru_cache(maxsize=32)
def entry_rows_kernel(rows: int, requests: int, width: int, columns: int, ratio: int, page: int = KV_PAGE_SIZE
                      ) -> Any:
    """Physical rows of compressed entries through each row's own request table (upstream section 5.3 / 5.9).

    ``ratio == 0`` (CSA): the entries are given (``entries`` [T, K] int32, the top-k, -1 = none).
    ``ratio > 0`` (HCA dense): column c is entry c itself, live while ``c < (p + 1) // ratio``.
    Arguments: ``positions``, ``request_ids`` [T, 1] int32; ``table`` [R * width] int32 flattened;
    ``entries`` [T, K] int32; out ``rows`` [T, K] int32: ``block * 32 + c % 32``, -1 for a dead column, a
    padding row, a page beyond the table or an unmapped page.
    """

    @kernel
    def entry_rows(positions: pypto.Tensor([rows, 1], pypto.DT_INT32),
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
