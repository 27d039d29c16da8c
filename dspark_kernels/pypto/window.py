"""Stage 3: sliding-window rows through a request's ``ori`` table (upstream's sliding-window key rows).

``window_rows`` kernel:

* ``positions``  [L, 1] int32 in: absolute position p of each local row.
* ``request_ids`` [L, 1] int32 in: local request id (stage 1), -1 = padding.
* ``ori_table``  [R * width] int32 in: the ori block table, flattened row-major. ``ori`` is a ring pool
  (``PoolLayout.is_ring``): page ``i // 32`` sits in column ``(i // 32) % width``, ``width`` the table's own
  columns (``ring_width`` from the allocator; at the full ``table_width`` the modulo is the identity).
* ``rows``       [L, W] int32 out: column k < v = min(W, p+1) holds the physical row of key position
  ``p + 1 - v + k`` (``block * 32 + offset``); -1 for k >= v, unmapped pages and padding rows.
Index arithmetic is done in fp32 (exact below 2**24), because integer shifts are not available for int32; the
ring column is computed in-kernel and exactly (:func:`~dspark_kernels.pypto._ops.ring_column`). The launchers
raise ``ABIError`` ``kernel.index_range`` before building a kernel whose table entries (R * width), pool rows
(block * 32 + offset), positions or ring quotients would reach 2**24 (:mod:`.index_guard`).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import numpy as np

from dspark_abi.layout import KV_PAGE_SIZE
from dspark_kernels.pypto._ops import table_rows
from dspark_kernels.pypto.index_guard import check_table
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto


@lru_cache(maxsize=32)
def window_kernel(rows: int, requests: int, width: int, window: int, page: int = KV_PAGE_SIZE, *,
                  ring: bool) -> Any:
    """Window-row construction for one geometry; ``ring``: the ori table is a ring table (``pl.is_ring``)."""

    @kernel
    def window_rows(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            positions: pypto.Tensor([rows, 1], pypto.DT_INT32),
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
        request = pypto.expand_clone(pypto.cast(request_ids, pypto.DT_FP32), [rows, window])
        physical = table_rows(ori_table, request, key_pos, pypto.lt(k, visible), width=width, page=page, ring=ring)
        out[:] = pypto.cast(physical, pypto.DT_INT32)

    return window_rows


def run_window(positions: np.ndarray, request_ids: np.ndarray, ori_table: np.ndarray, window: int, *,
               ring: bool) -> LaunchResult:
    """Window rows of L local rows; ``values[-1]`` is ``rows`` [L, W] int32 (see the module docstring).

    ring: ``config.layout.pools["ori"].is_ring`` (True in ABI 1.1: columns are pages modulo the table's width).
    """
    positions = np.asarray(positions, dtype=np.int32).reshape(-1, 1)
    request_ids = np.asarray(request_ids, dtype=np.int32).reshape(-1, 1)
    table = np.asarray(ori_table, dtype=np.int32)
    check_table("ori_block_table", table, KV_PAGE_SIZE, positions, ring=ring)  # fp32 exact, before any kernel
    k = window_kernel(len(positions), table.shape[0], table.shape[1], window, ring=ring)
    return launch(k, [positions, request_ids, table.reshape(-1), Out((len(positions), window), np.int32, "rows")])
