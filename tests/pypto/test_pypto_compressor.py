"""Stage 4 (compressors ratio 4 and 128) and the indexer's key compressor (stage 5) against the reference (a2a3).

Fixture: ``compressor_batch`` (TP 2; ratio-4 windows that began in the previous chunk and are read back from the
state ring by absolute position, entry 0 of a fresh request without a previous window, two ratio-128 boundaries,
a request crossing the rank boundary, a padding row) with random state history.

Measured (docs/pypto.md, 3 seeds): entries, idx and idx_scale bit-exact; state rows differ by <= 4.8e-7 on <= 1 %
of elements (fp32 accumulation order of the x @ w products: torch vs numpy). Entries are bf16 roundings of
values computed from those states, so one bf16 step (or one int8 step) may flip on a rounding boundary.

Ring state tables (ABI 1.1): ``ring_batch`` (``tiny-1m``) pools windows ~294k positions deep through state tables
trimmed to the step's live pages (at most the 4101 / 1041 ring width), so the kernel's column is page mod width;
the same blocks re-laid at a width where the uncorrected fp32 quotient is off must give the same entries, and a
table rolled by one column must not.
"""

import numpy as np
import pypto_cases
import pytest
from pypto_fixtures import (
    CONFIG,
    RING_CONFIG,
    SEED,
    compressor_batch,
    correction_width,
    hidden_rows,
    random_history,
    request_spans,
    rewidth,
    ring_batch,
    uncorrected_ring_rows,
)

# entries: one bf16 step, flipped by the state's last-bit differences, on a fraction allowed for fp32 states that
# flip more roundings under load
from tolerances import BF16_ATOL, BF16_RTOL, assert_close, bf16_ulp, order_atol
from tolerances import MAX_DIFFERING_FRACTION_UNDER_LOAD as MAX_DIFFERING_FRACTION

from dspark_abi.layout import RATIO4_STATE_PAGE_SIZE, RATIO128_STATE_PAGE_SIZE, live_pages
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.geometry import boundary_rows, window_positions, window_start_positions, window_state_rows
from dspark_kernels.model.plan import CompressorState, RopeRows
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.model.rope import rope_at
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference.compressor import compress, compress_index_keys

pytestmark = pytest.mark.pypto

#: fp32 state rows: accumulation order over hidden_size products (measured <= 4.8e-7 on unit-scale rows).
STATE_RTOL, STATE_ATOL = 1e-5, 1e-5
#: A flip of one bf16 intermediate of a row moves an entry element by at most one bf16 step of the row's scale:
#: RoPE mixes each element with its pair partner (measured: -8.0e-4 -> -7.2e-4 on a row whose max is 2.25, i.e.
#: 3.7e-5 x max|row|, in one run on a loaded machine; the interpreter runs a call on many threads).
ROW_STEP = 2.0**-8
#: One int8 step on the idx cache, one fp32 rounding on its scale.
INT8_STEP, SCALE_RTOL = 1, 1e-6


def _setup(layer: int):
    batch = compressor_batch()
    w = prepare_weights(AttentionWeights.random(CONFIG, layer, seed=SEED), "a2a3")
    caches = LayerCaches.allocate(CONFIG, layer, batch.pool_blocks, precision="a2a3")
    random_history(caches, np.random.default_rng(SEED + layer))
    kind = CONFIG.layer_kind(layer)
    ratio = CONFIG.compress_ratios[layer]
    positions = batch.positions.astype(np.int64)
    cos, sin = rope_at(CONFIG, kind, window_start_positions(positions, ratio), "a2a3")
    return batch, w, caches, positions, cos, sin, hidden_rows(batch)


def _state(pool: np.ndarray, slots: np.ndarray, table: np.ndarray, batch, page: int) -> CompressorState:
    """The reference compressor's state addressing over a batch's own table (each row reads its request's row)."""
    return CompressorState(pool=pool, slots=slots, table=table, table_row=batch.row_request, page_size=page)


def _check_state(got: np.ndarray, want: np.ndarray, before: np.ndarray, slots: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=STATE_RTOL, atol=STATE_ATOL)
    untouched = np.setdiff1d(np.arange(len(before)), slots[slots >= 0])
    np.testing.assert_array_equal(got[untouched].view(np.uint32), before[untouched].view(np.uint32))


@pytest.mark.parametrize("layer", [1, 2], ids=["ratio4", "ratio128"])
def test_main_compressor_matches_reference(layer):
    batch, w, caches, positions, cos, sin, x = _setup(layer)
    main = CONFIG.layer_kind(layer)
    page = RATIO4_STATE_PAGE_SIZE if main == "csa" else RATIO128_STATE_PAGE_SIZE
    state, slots, table = getattr(caches, f"{main}_state"), batch.slots[f"{main}_state"], batch.tables[f"{main}_state"]
    ring = CONFIG.layout.pools[f"{main}_state"].is_ring
    (b, (entries,), new_state), = run_isolated(pypto_cases.compress_many, [
        (x, positions, batch.row_request, slots, table, state, w.compressor, cos, sin, page, CONFIG.rms_norm_eps,
         None, ring)])
    assert ring
    ref_state = state.copy()
    want_b, want = compress(x, positions, batch.row_request, _state(ref_state, slots, table, batch, page),
                            w.compressor, RopeRows(cos, sin), eps=CONFIG.rms_norm_eps, precision="a2a3")
    np.testing.assert_array_equal(b, want_b)
    assert b.size >= (5 if main == "csa" else 2)  # the fixture's boundaries, including the fresh entry 0
    _check_state(new_state, ref_state, state, slots)
    # elementwise: one bf16 step of the element itself, or of the row's scale where RoPE mixed in a flipped partner
    row_scale = ROW_STEP * np.abs(want).max(axis=1, keepdims=True)
    assert (np.abs(entries - want) <= np.maximum(BF16_RTOL * np.abs(want) + BF16_ATOL, row_scale)).all()
    assert np.mean(entries != want) <= MAX_DIFFERING_FRACTION


def test_indexer_key_compressor_matches_reference():
    batch, w, caches, positions, cos, sin, x = _setup(1)
    slots, table, state = batch.slots["csa_inner_state"], batch.tables["csa_inner_state"], caches.csa_inner_state
    (b, (idx, idx_scale), new_state), = run_isolated(pypto_cases.compress_many, [
        (x, positions, batch.row_request, slots, table, state, w.idx_compressor, cos, sin, RATIO4_STATE_PAGE_SIZE,
         CONFIG.rms_norm_eps, w.idx_hadamard, CONFIG.layout.pools["csa_inner_state"].is_ring)])
    ref = caches.copy()
    ref_b, keys = compress_index_keys(x, positions, batch.row_request,
                                      _state(ref.csa_inner_state, slots, table, batch, RATIO4_STATE_PAGE_SIZE), w,
                                      RopeRows(cos, sin), eps=CONFIG.rms_norm_eps, precision="a2a3")
    np.testing.assert_array_equal(ref_b, b)
    ref.idx[batch.slots["idx"][b]], ref.idx_scale[batch.slots["idx"][b]] = keys.keys, keys.scales
    _check_state(new_state, ref.csa_inner_state, state, slots)
    written = batch.slots["idx"][b]
    assert (written >= 0).all() and b.size >= 5
    assert np.abs(idx.astype(np.int32) - ref.idx[written].astype(np.int32)).max() <= INT8_STEP
    assert np.mean(idx != ref.idx[written]) <= MAX_DIFFERING_FRACTION
    np.testing.assert_allclose(idx_scale, ref.idx_scale[written], rtol=SCALE_RTOL)


def _entry_atol(want: np.ndarray) -> np.ndarray:
    """One bf16 step of the element, or of its row's scale where RoPE mixed in a flipped partner (module docs)."""
    return np.maximum(bf16_ulp(want), ROW_STEP * np.abs(want).max(axis=1, keepdims=True))


@pytest.mark.parametrize("layer", [1, 2], ids=["ratio4", "ratio128"])
def test_compressor_reads_ring_state_tables_modulo_their_width(layer):
    c = RING_CONFIG
    batch = ring_batch()
    kind, ratio = c.layer_kind(layer), c.compress_ratios[layer]
    pool = f"{kind}_state"
    pl = c.layout.pools[pool]
    table, slots, ring = batch.tables[pool], batch.slots[pool], pl.is_ring
    assert ring and table.shape[1] <= pl.ring_width < pl.table_width
    w = prepare_weights(AttentionWeights.random(c, layer, seed=SEED), "a2a3")
    rng = np.random.default_rng(SEED + layer)
    state = rng.standard_normal((batch.pool_blocks[pool] * pl.page_size, *pl.row_shape)).astype(np.float32)
    positions = batch.positions.astype(np.int64)
    cos, sin = rope_at(c, kind, window_start_positions(positions, ratio), "a2a3")
    x = hidden_rows(batch)
    b = boundary_rows(positions, batch.row_request, ratio)
    window = window_positions(positions[b], ratio)
    pages = window[window >= 0] // pl.page_size
    assert pages.max() // table.shape[1] >= 35  # request 0's windows sit many ring turns past column 0
    starts, ends = request_spans(batch)
    narrow = rewidth(batch, pool, correction_width(pages, int(live_pages(pl, starts, ends, c.sliding_window).max())))
    rolled = np.roll(table, 1, axis=1)
    results = run_isolated(pypto_cases.compress_many, [
        (x, positions, batch.row_request, slots, t, state, w.compressor, cos, sin, pl.page_size, c.rms_norm_eps, None,
         ring) for t in (table, narrow)])
    ref_state = state.copy()
    want_b, want = compress(x, positions, batch.row_request, _state(ref_state, slots, table, batch, pl.page_size),
                            w.compressor, RopeRows(cos, sin), eps=c.rms_norm_eps, precision="a2a3")
    written = slots[slots >= 0]
    for t, (got_b, (entries,), new_state) in zip((table, narrow), results, strict=True):
        what = f"{t.shape[1]}-column {pool} table"
        np.testing.assert_array_equal(got_b, want_b)
        assert_close(new_state[written], ref_state[written], order_atol(ref_state[written], c.hidden_size), what)
        untouched = np.setdiff1d(np.arange(len(state)), written)
        np.testing.assert_array_equal(new_state[untouched].view(np.uint32), state[untouched].view(np.uint32))
        assert_close(entries, want, _entry_atol(want), what)
        assert np.mean(entries != want) <= MAX_DIFFERING_FRACTION
    # the comparison can fail: the uncorrected fp32 column reads other state rows of the narrow table, and a table
    # one column off pools other slots into entries beyond the tolerance
    _, rows = window_state_rows(positions, batch.row_request, narrow, ratio, pl.page_size, b)
    assert (uncorrected_ring_rows(narrow, batch.row_request[b], window, pl.page_size) != rows).any()
    _, wrong = compress(x, positions, batch.row_request, _state(state.copy(), slots, rolled, batch, pl.page_size),
                        w.compressor, RopeRows(cos, sin), eps=c.rms_norm_eps, precision="a2a3")
    with pytest.raises(AssertionError):
        assert_close(results[0][1][0], wrong, _entry_atol(wrong))
