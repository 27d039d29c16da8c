"""Stage 1: rank-local request ids lowered by the pypto kernel equal dspark_abi's lowering."""

import numpy as np
import pypto_cases
import pytest
from pypto_fixtures import packed_batch

from dspark_abi.lowering import lower_local_request_ids
from dspark_kernels.pypto.isolate import run_isolated

pytestmark = pytest.mark.pypto


def test_lowering_matches_reference_on_every_rank_and_edge_case():
    batch = packed_batch()
    cases = [(batch.query_start_loc, [(batch.rank(r).row_start, batch.local_rows) for r in range(batch.tp_size)])]
    # empty requests (leading, inner, trailing), a single request, and a rank entirely past N
    cases.append((np.array([0, 0, 5, 5, 9, 12, 12], np.int32), [(0, 4), (4, 4), (8, 4), (12, 4)]))
    cases.append((np.array([0, 7], np.int32), [(0, 8)]))
    results = run_isolated(pypto_cases.lowering_many, cases)
    for (qsl, windows), got_list in zip(cases, results, strict=True):
        for (base, rows), got in zip(windows, got_list, strict=True):
            want = lower_local_request_ids(qsl, base, rows)
            np.testing.assert_array_equal(got, want, err_msg=f"qsl={qsl} base={base}")
    # the packed batch's own per-rank ids (request 1 spans both ranks, the last row is padding)
    np.testing.assert_array_equal(np.concatenate(results[0]), np.concatenate(
        [batch.rank(r).local_request_ids for r in range(batch.tp_size)]))
