"""Stage 3: slot-mapping scatters and window-row construction against the reference (exact: pure data movement)."""

import ml_dtypes
import numpy as np
import pypto_cases
import pytest
from pypto_fixtures import CONFIG, SEED, packed_batch

from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference.paged import scatter_rows
from dspark_kernels.reference.window import window_rows

pytestmark = pytest.mark.pypto


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
        cases.append((view.positions, view.local_request_ids, batch.tables.ori, CONFIG.sliding_window))
    # an unmapped page inside a window must give -1 (a table hole the reference also maps to -1)
    holed = batch.tables.ori.copy()
    holed[0, 126 // 32] = -1
    cases.append((batch.rank(0).positions, batch.rank(0).local_request_ids, holed, CONFIG.sliding_window))
    results = run_isolated(pypto_cases.window_many, cases)
    for (positions, request_ids, table, width), got in zip(cases, results, strict=True):
        np.testing.assert_array_equal(got, window_rows(positions, request_ids, table, width))
    assert (results[-1] == -1).sum() > (results[0] == -1).sum()
