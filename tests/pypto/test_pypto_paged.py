"""Stage 3: slot-mapping scatters and window-row construction against the reference (exact: pure data movement).

Ring tables (ABI 1.1): ``ring_batch`` (``tiny-1m``) puts request 0 at position ~294k, 35 turns of its 258-column ori
ring; the kernel's in-kernel ``page mod width`` (``_ops.ring_column``) is checked on its own over the whole fp32-exact
range, and through the window kernel on the batch's table, on the same blocks re-laid at a width where the
uncorrected fp32 quotient is off, and on a table rolled by one column (which must change the rows).
"""

import ml_dtypes
import numpy as np
import pypto_cases
import pytest
from pypto_fixtures import (
    CONFIG,
    RING_CONFIG,
    SEED,
    correction_width,
    packed_batch,
    rewidth,
    ring_batch,
    uncorrected_column,
    uncorrected_ring_rows,
)

from dspark_abi.layout import physical_rows, table_column
from dspark_abi.presets import FLASH
from dspark_kernels.pypto.index_guard import FP32_EXACT_LIMIT
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference.paged import scatter_rows
from dspark_kernels.reference.window import window_rows

pytestmark = pytest.mark.pypto
ORI_RING = CONFIG.layout.pools["ori"].is_ring  # True: ori tables are ring tables (column = page % width)


def test_scatter_through_slot_mappings_matches_reference():
    batch = packed_batch()
    rng = np.random.default_rng(SEED)
    layout = CONFIG.layout
    cases = []
    for pool, dtype in (("ori", ml_dtypes.bfloat16), ("csa_state", np.float32), ("idx", np.int8)):
        pl = layout.pools[pool]
        rows = batch.pool_blocks[pool] * pl.page_size
        width = int(np.prod(pl.row_shape))
        if dtype is np.int8:
            before = rng.integers(-127, 128, (rows, width)).astype(np.int8)
            values = rng.integers(-127, 128, (batch.padded_rows, width)).astype(np.int8)
        else:
            before = rng.standard_normal((rows, width)).astype(dtype)
            values = rng.standard_normal((batch.padded_rows, width)).astype(dtype)
        cases.append((before, values, batch.slots[pool]))
    results = run_isolated(pypto_cases.scatter_many, cases)
    for (before, values, slots), got in zip(cases, results, strict=True):
        expected = before.copy()
        scatter_rows(expected, slots, values)
        assert (slots < 0).any() and (slots >= 0).any()  # the case exercises both writes and skips
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))  # bitwise, NaN-safe


def test_window_rows_match_reference_on_every_rank():
    batch = packed_batch()
    cases = []
    for r in range(batch.tp_size):
        view = batch.rank(r)
        cases.append((view.positions, view.local_request_ids, batch.tables.ori, CONFIG.sliding_window, ORI_RING))
    # an unmapped page inside a window must give -1 (a table hole the reference also maps to -1)
    holed = batch.tables.ori.copy()
    holed[0, table_column(CONFIG.layout.pools["ori"], 126 // 32, holed.shape[1])] = -1  # request 0's page 3
    cases.append((batch.rank(0).positions, batch.rank(0).local_request_ids, holed, CONFIG.sliding_window, ORI_RING))
    results = run_isolated(pypto_cases.window_many, cases)
    for (positions, request_ids, table, width, _), got in zip(cases, results, strict=True):
        np.testing.assert_array_equal(got, window_rows(positions, request_ids, table, width))
    assert (results[-1] == -1).sum() > (results[0] == -1).sum()


# ---- ring tables (ABI 1.1): ori's page i // 32 sits in column (i // 32) % width of a table narrower than the pages
def _ring_column_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
    """[64, 128] int32 pages per width (tiny-1m's and FLASH's ring widths, the widths of ``ring_batch``'s trimmed
    ring tables and :data:`CORRECTION_WIDTHS`): multiples of the width and their neighbours across the whole
    fp32-exact range, every page where the uncorrected fp32 quotient is off (first and last 1024), a few negative
    pages (the compressor forms them before position 0) and random pages."""
    batch = ring_batch()
    widths = sorted({pl.ring_width for cfg in (RING_CONFIG, FLASH) for pl in cfg.layout if pl.is_ring}
                    | set(CORRECTION_WIDTHS)
                    | {batch.tables[pl.name].shape[1] for pl in RING_CONFIG.layout if pl.is_ring})
    cases = []
    for width in widths:
        limit = FP32_EXACT_LIMIT - width  # page + width <= 2**24: index_guard's ring bound
        k = rng.integers(1, limit // width, 1024)
        near = (k[:, None] * width + np.arange(-1, 2)[None, :]).ravel()
        every = np.arange(limit, dtype=np.int64)
        off = every[uncorrected_column(every, width) != every % width]
        pages = np.concatenate([np.arange(-64, 0), [0, width - 1, width, limit - 1], near, off[:1024], off[-1024:]])
        pages = np.concatenate([pages, rng.integers(0, limit, 64 * 128 - pages.size)])
        cases.append((pages.astype(np.int32).reshape(64, 128), width))
    return cases


#: Widths whose uncorrected fp32 quotient is wrong somewhere below 2**24 (3: first at page 12,582,914; 41 already
#: at page 41, where 41 * fp32(1/41) rounds to just below 1); the ring widths of tiny-1m / FLASH never are.
CORRECTION_WIDTHS = (3, 41, 47)


def test_ring_column_is_exact_where_the_fp32_quotient_is_off():
    cases = _ring_column_cases(np.random.default_rng(SEED))
    results = run_isolated(pypto_cases.ring_columns_many, cases)
    for (pages, width), got in zip(cases, results, strict=True):
        np.testing.assert_array_equal(got, pages.astype(np.int64) % width, err_msg=f"width {width}")
        if width in CORRECTION_WIDTHS:  # the comparison can fail: without the correction these pages go wrong
            assert (uncorrected_column(pages, width) != pages % width).sum() >= 1024, width


def _window_keys(positions: np.ndarray, window: int) -> np.ndarray:
    p = np.asarray(positions, np.int64)[:, None]
    k = np.arange(window)[None, :]
    visible = np.minimum(window, p + 1)
    return np.where(k < visible, p + 1 - visible + k, -1)


def test_window_rows_through_ring_tables_match_reference():
    batch = ring_batch()
    c, pl = RING_CONFIG, RING_CONFIG.layout.pools["ori"]
    window, ring = c.sliding_window, pl.is_ring
    table = batch.tables.ori
    assert ring and table.shape[1] <= pl.ring_width < pl.table_width  # the step's live pages, of 32768
    rank0 = batch.rank(0)
    pos0, req0 = rank0.positions.astype(np.int64), rank0.local_request_ids.astype(np.int64)
    keys = _window_keys(pos0, window)
    pages = keys[keys >= 0] // pl.page_size
    assert pages.max() // table.shape[1] >= 35  # request 0 reads many ring turns past column 0
    narrow = rewidth(batch, "ori", correction_width(pages, 2))  # same blocks, a width the fp32 correction matters at
    rolled = np.roll(table, 1, axis=1)                           # every page one column off
    cases = [(batch.rank(r).positions, batch.rank(r).local_request_ids, table, window, ring) for r in (0, 1)]
    cases += [(rank0.positions, rank0.local_request_ids, t, window, ring) for t in (narrow, rolled)]
    results = run_isolated(pypto_cases.window_many, cases)
    wants = [window_rows(pos, req, t, window) for pos, req, t, _, _ in cases]
    for (_, _, t, _, _), got, want in zip(cases, results, wants, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=f"{t.shape[1]}-wide ring table")
    # the comparisons can fail: each alternative addressing reads another row (or none) somewhere
    live = wants[0] >= 0
    assert live.sum() >= 100
    assert (physical_rows(table, req0, keys, pl.page_size, ring=False)[live] == -1).all()  # no modulo: no row
    np.testing.assert_array_equal(wants[2], wants[0])  # the narrow table holds the same blocks: the same rows
    assert (uncorrected_ring_rows(narrow, req0, keys, pl.page_size) != wants[2])[live].any()
    assert (wants[3] != wants[0])[live].any()
