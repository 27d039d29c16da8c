"""Compressors (ratio 4 and 128) and their state rings against the loop definition of DeepSeek-V4's ``Compressor``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tolerances import order_atol

from dspark_abi.errors import ABIError
from dspark_kernels.model.geometry import window_start_positions
from dspark_kernels.model.plan import CompressorState, RopeRows
from dspark_kernels.model.prepared import PreparedCompressor
from dspark_kernels.reference.compressor import compress

from .oracle import compress_sequence

D, X, RD = 8, 6, 4
OMEGA = np.array([0.3, 0.01], np.float32)


def stage_k(ratio: int) -> int:
    """Summed reduction lengths of a compressor entry: projections (X), the softmax pooling's numerator and
    denominator over coff * ratio rows, the norm (D).

    Stage vs loop (float64 softmax in the loop) differ in summation order: ``order_atol(want, stage_k, c=2)``
    (tests/tolerances.py). c = 2 because at K ~ 30 the ~9 elementwise roundings after the reductions (softmax,
    norm scaling, RoPE) weigh as much as the reductions; measured <= 0.25 of the bound (<= 2.5 fp32 ulps of
    max|want|) over 4 OpenBLAS kernels and numpy SIMD levels.
    """
    return X + 2 * (2 if ratio == 4 else 1) * ratio + D


def weights(ratio: int, seed: int = 0) -> PreparedCompressor:
    rng = np.random.default_rng(seed)
    coff = 2 if ratio == 4 else 1
    return PreparedCompressor(rng.standard_normal((coff * D, X), dtype=np.float32),
                              rng.standard_normal((coff * D, X), dtype=np.float32),
                              rng.standard_normal((ratio, coff * D), dtype=np.float32),
                              1 + 0.1 * rng.standard_normal(D, dtype=np.float32))


def run(ratio, x, chunks, page, table, pool, w):
    """Feed positions [lo, hi) chunk by chunk; return {entry index: entry}."""
    entries = {}
    for lo, hi in chunks:
        pos = np.arange(lo, hi)
        req = np.zeros(hi - lo, np.int32)
        slots = table[0][pos // page].astype(np.int64) * page + pos % page
        ang = window_start_positions(pos, ratio).astype(np.float32)[:, None] * OMEGA[None, :]
        state = CompressorState(pool=pool, slots=slots, table=table, table_row=req, page_size=page)
        b, e = compress(x[lo:hi], pos, req, state, w, RopeRows(np.cos(ang), np.sin(ang)), eps=1e-6,
                        precision="fp32")
        for i, row in zip(b, e, strict=True):
            entries[(lo + int(i) + 1) // ratio - 1] = row
    return entries


@pytest.mark.parametrize(("ratio", "page", "length", "cuts"),
                         [(4, 2, 37, (5,)), (4, 2, 37, (1, 18, 30)), (128, 8, 300, (100, 129)), (128, 8, 300, ())])
def test_compress_matches_loop_across_chunks(ratio, page, length, cuts):
    rng = np.random.default_rng(ratio + length)
    x = rng.standard_normal((length, X), dtype=np.float32)
    w = weights(ratio)
    blocks = -(-length // page)
    table = rng.permutation(blocks + 3)[:blocks][None, :].astype(np.int32)  # scrambled ring pages
    pool = np.zeros(((blocks + 3) * page, 2 * w.wkv.shape[0]), np.float32)
    bounds = (0, *cuts, length)
    got = run(ratio, x, list(itertools.pairwise(bounds)), page, table, pool, w)
    want = compress_sequence(x, w.wkv, w.wgate, w.ape, w.norm, ratio, OMEGA, 1e-6)
    assert sorted(got) == list(range(length // ratio))
    np.testing.assert_allclose(np.stack([got[j] for j in sorted(got)]), want, rtol=0,
                               atol=order_atol(want, stage_k(ratio), c=2))


def test_ratio128_requires_mapped_history():
    w = weights(128)
    x = np.ones((1, X), np.float32)
    table = np.zeros((1, 16), np.int32)
    table[0, 3] = -1  # positions 24..31 unmapped, inside the window of position 127
    pool = np.full((8 * 16, 2 * D), 7.0, np.float32)
    before = pool.copy()
    cos = np.ones((1, RD // 2), np.float32)
    with pytest.raises(ABIError) as err:
        state = CompressorState(pool=pool, slots=np.array([127]), table=table, table_row=np.array([0]), page_size=8)
        compress(x, np.array([127]), np.array([0]), state, w, RopeRows(cos, 0 * cos), eps=1e-6, precision="fp32")
    assert err.value.codes == {"coverage.unmapped"}
    np.testing.assert_array_equal(pool, before)


def test_padding_rows_write_nothing_and_produce_no_entry():
    w = weights(4)
    x = np.ones((4, X), np.float32)
    pool = np.full((8, 4 * D), 3.0, np.float32)
    table = np.arange(4, dtype=np.int32)[None, :]
    cos = np.ones((4, RD // 2), np.float32)
    padding = np.array([-1, -1, -1, -1])
    state = CompressorState(pool=pool, slots=np.full(4, -1), table=table, table_row=padding, page_size=2)
    b, e = compress(x, np.array([0, 1, 2, 3]), padding, state, w, RopeRows(cos, 0 * cos), eps=1e-6,
                    precision="fp32")
    assert b.size == 0 and e.shape == (0, D)
    assert np.all(pool == 3.0)
