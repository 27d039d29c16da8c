"""Property-based: rank views partition the group rows, every single-rule mutation is rejected with its code,
and the O(L + R) lowering equals the nested scan."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dspark_abi import lower_local_request_ids, validate
from dspark_abi.fields import BATCH_FIELDS, SLOT_FIELDS
from dspark_abi.lowering import nested_scan_local_request_ids
from dspark_abi.testing import MUTATIONS, mutate, packed_batches


@given(packed_batches())
def test_rank_views_partition_the_group_rows(batch):
    # the builder validated the batch already; this checks what it does not: the per-rank views
    views = [batch.rank(r) for r in range(batch.tp_size)]
    np.testing.assert_array_equal(np.concatenate([v.local_request_ids for v in views]), batch.row_request)
    np.testing.assert_array_equal(np.concatenate([v.positions for v in views]), batch.positions)
    assert [(v.row_start, v.row_stop) for v in views] == [(r * batch.local_rows, (r + 1) * batch.local_rows)
                                                         for r in range(batch.tp_size)]


@given(packed_batches(token_ids=True))
def test_rank_views_carry_every_declared_per_row_field(batch):
    # the per-row fields come from the declarations: a new [P] field reaches the rank views with no edit there
    declared = {f.name for f in BATCH_FIELDS if f.shape[0] == "P"}
    whole = batch.to_arrays()
    views = [batch.rank(r) for r in range(batch.tp_size)]
    for view in views:
        assert set(view.local) == declared & set(whole)
        assert view.positions is view.local["positions"]
        assert all(view.slots[p] is view.local[name] for p, name in SLOT_FIELDS.items())
    for name in declared & set(whole):
        np.testing.assert_array_equal(np.concatenate([v.local[name] for v in views]), whole[name])


@pytest.mark.parametrize("code", sorted(MUTATIONS))
@given(batch=packed_batches(token_ids=True), seed=st.integers(0, 1000))
def test_mutations_are_rejected_with_their_code(code, batch, seed):
    case = mutate(batch, code, seed)
    assume(case is not None)
    report = validate(case.arrays, case.config, case.policy, case.pool_blocks, hidden=case.hidden)
    assert code in report.codes, str(report)


@st.composite
def qsl_and_window(draw):
    lengths = draw(st.lists(st.integers(0, 20), min_size=1, max_size=12))
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    rows = -(-max(int(qsl[-1]), 1) // tp) * tp
    local = rows // tp
    return qsl, draw(st.integers(0, tp - 1)) * local, local


@given(qsl_and_window())
def test_lowering_equals_nested_scan(case):
    qsl, base, local = case
    np.testing.assert_array_equal(lower_local_request_ids(qsl, base, local),
                                  nested_scan_local_request_ids(qsl, base, local))


@given(packed_batches(), st.integers(0, 64))
def test_the_request_record_is_the_arrays_requests(batch, extra_rows):
    """The builder's record describes the batch's arrays exactly, and every ownership view of it equals the
    executable specification (the O(L*R) nested scan) on any window, padding rows and beyond included."""
    from dspark_abi.requests import BatchRequests

    record = batch.requests
    assert record.agrees_with(batch.query_start_loc, batch.positions, batch.request_ids, batch.logit_rows)
    derived = BatchRequests.from_arrays(batch.query_start_loc, batch.positions, batch.request_ids,
                                        batch.logit_rows)
    live = derived.first_position >= 0
    assert np.array_equal(record.first_position[live], derived.first_position[live])
    assert np.array_equal(record.commit_rows, record.lengths)          # every row commits (no verify step yet)
    for lo in (0, batch.local_rows, batch.num_tokens):
        count = batch.padded_rows - lo + extra_rows
        assert np.array_equal(record.owner_in(lo, count),
                              nested_scan_local_request_ids(batch.query_start_loc, lo, count))
    starts, stops, owners = record.runs()
    assert np.array_equal(np.repeat(owners, stops - starts), batch.row_request[: batch.num_tokens])
