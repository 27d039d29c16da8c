"""Stage 3: paged cache writes through slot mappings (window rows: :mod:`.window`).

``scatter_rows`` kernel (upstream's paged KV-cache writes; the same kernel writes every pool):

* ``pool``  [rows, width] in/out (bf16, fp32, int32 or int8): a flattened pool, ``rows = blocks * page_size``.
* ``values`` [P, width] in, same dtype: one row per group token.
* ``slots`` [P] int32 in: physical row per token, -1 = write nothing (padding, non-boundary, unmapped).
  The ABI's slot mappings are int64; the host narrows them (pool rows are < 2**31, checked) because the
  0.2.0 interpreter reads loop scalars only from int32 kernel inputs.
  A per-token loop with a data-dependent branch: O(P) row copies, rows with -1 are skipped.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_kernels.pypto._ops import MIN_ROW_BYTES
from dspark_kernels.pypto.runtime import LaunchResult, kernel, launch, pypto

_PYPTO_DTYPES = {np.dtype(ml_dtypes.bfloat16): "DT_BF16", np.dtype(np.float32): "DT_FP32",
                 np.dtype(np.int32): "DT_INT32", np.dtype(np.int8): "DT_INT8"}


@lru_cache(maxsize=32)
def scatter_kernel(tokens: int, rows: int, width: int, dtype_name: str) -> Any:
    """Row scatter for one geometry; ``dtype_name`` is a pypto dtype name such as 'DT_BF16'."""
    dtype = getattr(pypto, dtype_name)

    @kernel
    def scatter_rows(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            pool: pypto.Tensor([rows, width], dtype),
            values: pypto.Tensor([tokens, width], dtype),
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


def scatter_into(pool: np.ndarray, slots: np.ndarray, values: np.ndarray, *, bf16: bool) -> None:
    """The scatter kernel on a model pool, in place (bf16 pools are held as float32 arrays of bf16 values).

    pool: a :class:`~dspark_kernels.model.caches.LayerCaches` array ([rows, ...], or [rows] for ``idx_scale``:
    one fp32 per row, padded to :data:`~dspark_kernels.pypto._ops.MIN_ROW_BYTES` for the kernel);
    slots [P] (-1 = no write); values [P, ...].
    """
    if not (np.asarray(slots) >= 0).any():
        return
    dtype = ml_dtypes.bfloat16 if bf16 else pool.dtype
    if pool.ndim == 1:  # one fp32 per row (idx_scale): pad rows to 32 bytes, pypto's minimum tile row
        padded = np.zeros((pool.shape[0], MIN_ROW_BYTES // pool.itemsize), pool.dtype)
        padded[:, 0] = pool
        wide = np.zeros((len(values), padded.shape[1]), pool.dtype)
        wide[:, 0] = values
        pool[...] = run_scatter(padded, wide, slots).values[0][:, 0]
        return
    pool[...] = run_scatter(pool.astype(dtype), np.asarray(values).astype(dtype), slots).values[0].astype(pool.dtype)
