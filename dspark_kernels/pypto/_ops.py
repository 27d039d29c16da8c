"""What the pypto kernels share: their tiling rules and masked values, and the building blocks traced inside
them (paged table lookups, int8 row quantisation, RMSNorm, interleaved RoPE).

Each building block takes and returns pypto tensors and is called while a ``@kernel`` function is traced;
each mirrors the model's numerics (:mod:`dspark_kernels.model.numerics` / :mod:`~dspark_kernels.model.rope`)
op for op.
"""

from __future__ import annotations

from typing import Any

from dspark_kernels.model.numerics import INT8_AMAX_FLOOR
from dspark_kernels.pypto.runtime import pypto

Tensor = Any  # pypto.Tensor while tracing

#: pypto tiles need rows of at least 32 bytes (``lastDimBytes % BLOCK_SIZE == 0``): kernel rows narrower than
#: this are padded (with -1 columns, or zero fp32 columns).
MIN_ROW_BYTES = 32
#: Fewest int32 columns a kernel row may have (:data:`MIN_ROW_BYTES` of int32).
MIN_COLUMNS = MIN_ROW_BYTES // 4
#: Masked score / logit: below every real score and finite, so the tile ops stay finite (a row whose entries
#: are all masked pools to 0 and selects nothing; ``e^(MASKED_SCORE - m)`` is exactly 0 for any real maximum).
MASKED_SCORE = -1e30


def tile(n: int, cap: int) -> int:
    """Largest power of two <= min(n, cap), at least 16 (the cube's fractal size)."""
    t = 16
    while t * 2 <= min(n, cap):
        t *= 2
    return t


def ring_column(page: Tensor, width: int) -> Tensor:
    """``page mod width`` (in ``[0, width)``) of an fp32 tensor of integer pages, exactly: a ring table's column.

    ``q = floor(page * fl(1 / width))``, ``r = page - q * width``, then one correction each way:
    ``r < 0 -> r + width`` and ``r >= width -> r - width``. Why this is exact for integer pages
    ``|page| < 2**24`` and ``|page| + width <= 2**24`` (:func:`~dspark_kernels.pypto.index_guard.index_range_issues`
    checks this with ``ring=True``): ``fl(1 / width)`` and the product are two roundings, so the computed
    quotient is ``(page / width)(1 + d)`` with ``|d| <= 2**-23 + 2**-48``, an absolute error below
    ``2**24 / width * 2**-23 <= 2 / 3`` for ``width >= 3`` (``width`` 1 or 2: ``1 / width`` and the product are
    exact). The error is < 1, so ``q`` is the true quotient or off by one (it is, e.g., at page 41 of a 41-wide
    table: ``41 * fl(1/41)`` rounds to just below 1). ``q * width`` is an integer of magnitude
    ``<= |page| + width <= 2**24``, hence exact, and ``r`` is an integer in ``(-width, 2 * width)``, so the
    subtraction is exact too; an off-by-one ``q`` leaves ``r`` exactly one width outside ``[0, width)``, which
    the matching correction (exact integer arithmetic again) removes.
    """
    w = float(width)
    q = pypto.floor(pypto.mul(page, 1.0 / width))
    r = pypto.sub(page, pypto.mul(q, w))
    r = pypto.where(pypto.lt(r, 0.0), pypto.add(r, w), r)
    return pypto.where(pypto.ge(r, w), pypto.sub(r, w), r)


def table_rows(table: Tensor, request: Tensor, logical: Tensor, live: Tensor, *, width: int, page: int,
               ring: bool) -> Tensor:
    """Physical rows (fp32, -1 = none) of logical indices through each one's request table (the ABI's slot
    formula, :func:`dspark_abi.layout.physical_rows`): ``table[request, column] * page + logical % page``.

    table: [R * width] int32, the [R, width] table flattened; request, logical: fp32 [rows, cols] (integers);
    live: bool [rows, cols], False = no row. page: the pool's page size (a power of two: ``1 / page`` and the
    floor are exact). ring: the table is a ring table (``PoolLayout.is_ring``): page ``i // page`` sits in
    column ``(i // page) % width`` (:func:`ring_column`); otherwise in column ``i // page``, and a page
    beyond the table (a trimmed compressed table) gives -1, never a wrap. A negative request or logical index
    and an unmapped block (-1) give -1. Every value is an fp32 integer below 2**24 (the launchers' guard).
    """
    rows, cols = logical.shape
    logical_page = pypto.floor(pypto.mul(logical, 1.0 / page))
    offset = pypto.sub(logical, pypto.mul(logical_page, float(page)))
    live = pypto.logical_and(live, pypto.logical_and(pypto.ge(request, 0.0), pypto.ge(logical, 0.0)))
    if ring:
        column = ring_column(logical_page, width)
    else:
        column = logical_page
        live = pypto.logical_and(live, pypto.lt(logical_page, float(width)))
    entry = pypto.where(live, pypto.add(pypto.mul(request, float(width)), column), 0.0)
    flat = pypto.reshape(pypto.cast(entry, pypto.DT_INT32), [rows * cols])
    saved = pypto.get_vec_tile_shapes()
    # one 1-D tile per 2-D tile of the caller, whose first entry alone split the lookup into 16s (the ratio-128
    # pooling kernel: 32 lookup tasks of 16 entries; 77k -> 51k cycles with this tile)
    pypto.set_vec_tile_shapes(min(rows, saved[0]) * min(cols, saved[-1]))
    picked = pypto.index_select(table, 0, flat)
    pypto.set_vec_tile_shapes(*saved)
    block = pypto.cast(pypto.reshape(picked, [rows, cols]), pypto.DT_FP32)
    mapped = pypto.logical_and(live, pypto.ge(block, 0.0))
    return pypto.where(mapped, pypto.add(pypto.mul(block, float(page)), offset), -1.0)


def int8_rows(v: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 quantisation over the last axis: (q int8 [..., K], dequant fp32 [..., 1]).

    amax = max(max|v|, 1e-4); scale = 127 / amax; q = round-half-even(v * scale) via int32 -> fp16 -> int8
    (|q| <= 127, so the fp16 and int8 steps are exact); dequant = 1 / scale.
    """
    v = pypto.cast(v, pypto.DT_FP32)
    amax = pypto.amax(pypto.abs(v), -1, keepdim=True)
    amax = pypto.maximum(amax, pypto.full(amax.shape, INT8_AMAX_FLOOR, pypto.DT_FP32))
    scale = pypto.div(pypto.full(amax.shape, 127.0, pypto.DT_FP32), amax)
    q32 = pypto.cast(pypto.mul(v, scale), pypto.DT_INT32, pypto.CastMode.CAST_RINT)
    q8 = pypto.cast(pypto.cast(q32, pypto.DT_FP16, pypto.CastMode.CAST_ROUND), pypto.DT_INT8, pypto.CastMode.CAST_TRUNC)
    dequant = pypto.div(pypto.full(scale.shape, 1.0, pypto.DT_FP32), scale)
    return q8, dequant


def rms_norm(v: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``v * rsqrt(mean(v^2) + eps) * weight`` over the last axis, fp32 in and out.

    v: [..., K] fp32; weight: [1, ..., K] fp32 broadcastable row, or None (unweighted).
    """
    k = v.shape[-1]
    mean_sq = pypto.sum(pypto.mul(pypto.mul(v, v), 1.0 / k), -1, keepdim=True)
    inv = pypto.div(pypto.full(mean_sq.shape, 1.0, pypto.DT_FP32), pypto.sqrt(pypto.add(mean_sq, eps)))
    out = pypto.mul(v, inv)
    return out if weight is None else pypto.mul(out, weight)


def rope_interleaved(even: Tensor, odd: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False
                     ) -> tuple[Tensor, Tensor]:
    """Rotate interleaved pairs (e, o) given as two [..., rd/2] fp32 tensors.

    forward: (e cos - o sin, e sin + o cos); inverse: (e cos + o sin, o cos - e sin).
    """
    if inverse:
        return (pypto.add(pypto.mul(even, cos), pypto.mul(odd, sin)),
                pypto.sub(pypto.mul(odd, cos), pypto.mul(even, sin)))
    return (pypto.sub(pypto.mul(even, cos), pypto.mul(odd, sin)),
            pypto.add(pypto.mul(even, sin), pypto.mul(odd, cos)))


def _pair_indices(rd: int) -> tuple[Tensor, Tensor, Tensor]:
    """int32 [rd/2] even and odd positions, and the [rd] permutation that interleaves [evens | odds] back."""
    saved = pypto.get_vec_tile_shapes()
    pypto.set_vec_tile_shapes(rd)  # arange needs a 1-D tile shape
    half = pypto.cast(pypto.arange(rd // 2), pypto.DT_FP32)
    even = pypto.cast(pypto.mul(half, 2.0), pypto.DT_INT32)
    odd = pypto.cast(pypto.add(pypto.mul(half, 2.0), 1.0), pypto.DT_INT32)
    j = pypto.cast(pypto.arange(rd), pypto.DT_FP32)
    pair = pypto.floor(pypto.mul(j, 0.5))                                   # j // 2
    interleave = pypto.cast(pypto.add(pypto.mul(pypto.sub(j, pypto.mul(pair, 2.0)), float(rd // 2)), pair),
                            pypto.DT_INT32)                                 # (j % 2) * rd/2 + j // 2
    pypto.set_vec_tile_shapes(*saved)
    return even, odd, interleave


def rope_rows(tail: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False) -> Tensor:
    """Rotate interleaved pairs of ``tail`` [rows, heads, rd] fp32 by cos/sin [rows, rd/2] (broadcast over heads),
    or of a single-head ``tail`` [rows, rd] (2-D tiles throughout: the compressed entries).

    Pairs are separated and re-interleaved with ``index_select`` on the last axis; the values are only moved,
    never rounded. pypto's cost model prices this far below reshape + transpose de-interleaving (the shared kv
    kernel at FLASH sizes: 125k vs 262k cycles) and below a one-gather partner-swap form (605k).
    """
    if len(tail.shape) == 2:
        even_idx, odd_idx, interleave = _pair_indices(tail.shape[1])
        c, s = pypto.cast(cos, pypto.DT_FP32), pypto.cast(sin, pypto.DT_FP32)
        even, odd = rope_interleaved(pypto.index_select(tail, 1, even_idx), pypto.index_select(tail, 1, odd_idx),
                                     c, s, inverse=inverse)
        return pypto.index_select(pypto.concat([even, odd], -1), 1, interleave)
    rows, heads, rd = tail.shape
    even_idx, odd_idx, interleave = _pair_indices(rd)
    c = pypto.expand_clone(pypto.reshape(pypto.cast(cos, pypto.DT_FP32), [rows, 1, rd // 2]), [rows, heads, rd // 2])
    s = pypto.expand_clone(pypto.reshape(pypto.cast(sin, pypto.DT_FP32), [rows, 1, rd // 2]), [rows, heads, rd // 2])
    even, odd = rope_interleaved(pypto.index_select(tail, 2, even_idx), pypto.index_select(tail, 2, odd_idx), c, s,
                                 inverse=inverse)
    return pypto.index_select(pypto.concat([even, odd], -1), 2, interleave)
