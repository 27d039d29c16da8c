"""Stage 1: rank-local request ids from ``query_start_loc`` in O(L + R) (upstream's request-id lowering).

Kernel arguments (static shapes per call):

* ``query_start_loc`` [R+1] int32 in: ``[0, q0, q0+q1, ..., N]``, non-decreasing (validated on the host).
* ``local_base``      [1] int32 in: ``tp_rank * L``, the group row of local row 0.
* ``ids``             [L] int32 out: ``r`` where ``qsl[r] <= local_base + i < qsl[r+1]``, else -1 (padding).

Method, without any row-by-request scan: row q belongs to request ``#{r : qsl[r] <= q} - 1``, and to no
request when that count is R+1 (q >= N). Every boundary ``qsl[r]`` that falls inside the rank's rows adds
one mark at its row (one ``index_put_`` with accumulation, O(R)); boundaries before the rank are counted
once (O(R)); a prefix sum over the L marks (O(L)) gives every row's count. Empty requests put two marks
on the same row and so own no row. Counts are carried in fp32, exact for any N <= 2**24.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import numpy as np

from dspark_abi import lower_local_request_ids as abi_lowering
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto


@lru_cache(maxsize=32)
def lowering_kernel(boundaries: int, rows: int) -> Any:
    """The jit kernel for ``R + 1 = boundaries`` and ``L = rows``."""
    tile = 64

    @kernel
    def lower_local_request_ids(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            query_start_loc: pypto.Tensor([boundaries], pypto.DT_INT32),
            local_base: pypto.Tensor([1], pypto.DT_INT32),
            ids: pypto.Tensor([rows], pypto.DT_INT32)):
        pypto.set_vec_tile_shapes(tile)
        rel = pypto.cast(pypto.sub(query_start_loc, pypto.expand_clone(local_base, [boundaries])), pypto.DT_FP32)
        before = pypto.sum(pypto.where(pypto.lt(rel, 0.0), 1.0, 0.0), 0, keepdim=True)          # [1]
        inside = pypto.logical_and(pypto.ge(rel, 0.0), pypto.lt(rel, float(rows)))
        mark_row = pypto.cast(pypto.where(inside, rel, float(rows)), pypto.DT_INT32)  # outside -> spare row L
        marks = pypto.full([rows + 1], 0, pypto.DT_INT32)
        pypto.index_put_(marks, (mark_row,), pypto.full([boundaries], 1, pypto.DT_INT32), True)
        running = pypto.cast(pypto.view(pypto.cumsum(marks, 0), [rows], [0]), pypto.DT_FP32)
        count = pypto.add(running, pypto.expand_clone(before, [rows]))                              # [L]
        live = pypto.lt(count, float(boundaries))
        ids[:] = pypto.cast(pypto.where(live, pypto.sub(count, 1.0), -1.0), pypto.DT_INT32)

    return lower_local_request_ids


def run_lowering(query_start_loc: np.ndarray, local_base: int, local_rows: int) -> LaunchResult:
    """Check ``query_start_loc`` (raises ABIError with qsl.* codes) and run the kernel.

    Returns the launch result; ``values[-1]`` is ``ids`` [L] int32. The pypto backend runs it once per plan.
    """
    qsl = np.asarray(query_start_loc)
    # the ABI's O(R) host checks (1-D, qsl[0] == 0, non-decreasing, base and rows >= 0) without lowering a row
    # on the host (the kernel lowers them): a count of min(rows, 0) is empty, or negative and reported
    abi_lowering(qsl, local_base, min(local_rows, 0))
    k = lowering_kernel(qsl.size, local_rows)
    return launch(k, [qsl.astype(np.int32), np.array([local_base], np.int32), Out((local_rows,), np.int32, "ids")])
