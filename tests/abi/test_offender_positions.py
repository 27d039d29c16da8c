"""Every per-request rule, with the offending request first, in the middle and last.

A rule evaluated over ``requests[:-1]`` or ``requests[1:]`` (an off-by-one in a per-request mask, a loop bound,
a slice of ``query_start_loc``) passes every test whose offender is request 0. Each case here breaks one rule in
exactly one request of a three-request batch, at each of the three places, and requires the report to name that
rule and that request, without raising: through :func:`dspark_abi.validate` and through a serving loop's
:class:`~dspark_abi.incremental.StepValidator`, which checks pages incrementally against the loop's previous step.

The mutations are the library's own single-rule mutations (:data:`dspark_abi.testing.MUTATIONS`): for each rule
and place, the first seed whose mutation lands on the wanted request is used. Where the mutation lands is read
from the arrays it changed (never from the report under test). The table-width rule has no such mutation (the
library's narrows a table to no column at all, a shape error), so it has its own cases below, and so do the
request-level rules of ``query_start_loc`` (an empty request under ``allow_empty_requests=False``) and
``request_ids`` (an id used twice: the second use is named).
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, PoolBlocks, validate
from dspark_abi.errors import ValidationReport
from dspark_abi.incremental import StepValidator
from dspark_abi.layout import POOL_NAMES, PoolName, live_pages
from dspark_abi.pools import SLOT_FIELDS, TABLE_FIELDS
from dspark_abi.presets import TINY
from dspark_abi.testing import MutatedBatch, mutate

#: The three places of the offender in a three-request batch.
PLACES = {"first": 0, "middle": 1, "last": 2}
#: (num_cached, num_new) of three requests that can each break every per-request rule: two or more new tokens,
#: positions on and off the compressed pools' boundaries, two or more live pages in every pool that has pages.
REQUESTS = ((130, 9), (40, 7), (260, 12))
#: Rules that name one request: positions, token ids, tables, coverage, aliasing, slots, writes, isolation.
PER_REQUEST_CODES = (
    "positions.negative", "positions.not_contiguous", "positions.out_of_range", "token_ids.range",
    "tables.block_range", "coverage.unmapped", "tables.alias", "state.ring_alias", "slots.mismatch",
    "slots.off_boundary", "slots.range", "writes.duplicate", "isolation.foreign_write",
)
#: Seeds tried per (rule, place); every rule lands on every place within the first few.
SEEDS = range(200)


def _steps(requests: tuple[tuple[int, int], ...], blocks: int = 512) -> tuple[PackedBatch, PackedBatch]:
    """Two steps of one serving loop: every request's cached prefix as a first chunk, then its new tokens."""
    # pad_position="zero": moving the last request's positions leaves the padding rows' positions alone
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2, pad_position="zero"),
                           BlockAllocator(TINY, PoolBlocks.uniform(blocks)))
    for rid, (cached, _new) in enumerate(requests):
        builder.add(rid, num_cached=0, num_new=cached, token_ids=np.arange(cached) + 1)
    first = builder.build()
    for rid, (cached, new) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new, token_ids=np.arange(new) + 1)
    return first, builder.build()


def _build(requests: tuple[tuple[int, int], ...], blocks: int = 512) -> PackedBatch:
    return _steps(requests, blocks)[1]


FIRST, BATCH = _steps(REQUESTS)
#: The validators that must agree: validate(), and a serving loop's StepValidator checking the step against the
#: loop's previous one (its incremental page rules), with ring pools checked in full or tracked.
VALIDATORS = ("validate", "step", "step_tracked")


def _validate(how: str, first: PackedBatch, arrays: dict[str, np.ndarray], batch: PackedBatch) -> ValidationReport:
    if how == "validate":
        return validate(arrays, batch.config, batch.policy, batch.pool_blocks)
    validator = StepValidator(batch.config, batch.policy, batch.pool_blocks,
                              ring_pools="tracked" if how == "step_tracked" else "exact")
    assert validator.validate(first).ok  # the loop's previous step: the baseline
    return validator.validate(arrays)


def _row_requests(batch: PackedBatch, rows: np.ndarray) -> set[int]:
    live = rows[rows < batch.num_tokens]
    return set(np.searchsorted(batch.query_start_loc, live, side="right").astype(int) - 1)


def _landing(batch: PackedBatch, case: MutatedBatch) -> int | None:
    """The one request a mutation breaks the rule of (the request the report must name), from the changed arrays;
    None when the mutation touched no request or several."""
    before = batch.to_arrays()
    touched: set[int] = set()
    changed_rows: dict[str, np.ndarray] = {}
    for name, new in case.arrays.items():
        old = before[name]
        if old.shape != new.shape or (name == "query_start_loc" and (old != new).any()):
            return None
        diff = np.flatnonzero((old != new).reshape(old.shape[0], -1).any(axis=1))
        changed_rows[name] = diff
        if name in TABLE_FIELDS.values() or name == "request_ids":
            touched |= set(diff.tolist())
        else:
            touched |= _row_requests(batch, diff)
    if len(touched) != 1:
        return None
    if case.code == "isolation.foreign_write":  # another request's table now maps a block the writer writes
        (field,) = [f for f, rows in changed_rows.items() if rows.size]
        pool = next(p for p in POOL_NAMES if TABLE_FIELDS[p] == field)
        r = int(changed_rows[field][0])
        new_blocks = set(case.arrays[field][r][case.arrays[field][r] != before[field][r]].tolist())
        ps = TINY.layout.pools[pool].page_size
        slots = before[SLOT_FIELDS[pool]][:batch.num_tokens]
        writers = np.flatnonzero(np.isin(slots // ps, list(new_blocks)) & (slots >= 0))
        owners = _row_requests(batch, writers)
        return owners.pop() if len(owners) == 1 else None
    if case.code == "writes.duplicate":  # the later of the two tokens writing one row is the one named
        (field,) = [f for f, rows in changed_rows.items() if rows.size]
        j = int(changed_rows[field][0])
        i = np.flatnonzero(before[field][:batch.num_tokens] == case.arrays[field][j])
        return _row_requests(batch, np.array([max(j, int(i[0]))])).pop() if i.size else None
    return touched.pop()


def _case_at(code: str, request: int) -> MutatedBatch:
    for seed in SEEDS:
        case = mutate(BATCH, code, seed)
        if case is not None and _landing(BATCH, case) == request:
            return case
    raise AssertionError(f"no mutation of {code} among {len(SEEDS)} seeds lands on request {request} alone")


@pytest.mark.parametrize("how", VALIDATORS)
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("code", PER_REQUEST_CODES)
def test_every_per_request_rule_names_the_offender_wherever_it_is(code: str, place: str, how: str):
    request = PLACES[place]
    case = _case_at(code, request)
    assert case.hidden is None  # no per-request rule needs hidden rows
    report = _validate(how, FIRST, case.arrays, BATCH)
    named = [issue.request for issue in report.issues if issue.code == code]
    assert named, f"{code} broken in request {request} ({place}) not reported: {report.codes}"
    assert named[0] == request, (code, place, named)


# ------------------------------------------------------------------------------------------------- table width

#: The offender reads and writes more pages than the other two in every pool below (its live range is the
#: longest and ends furthest), so a table one column narrower than it needs is wide enough for the others.
OFFENDER, OTHERS = (200, 70), ((40, 7), (130, 9))
#: hca_cmp is left out: one of its pages spans 4096 positions, so no request of TINY needs a second column.
WIDTH_POOLS: tuple[PoolName, ...] = ("ori", "csa_cmp", "idx", "csa_state", "csa_inner_state", "hca_state")


def _width_case(pool: PoolName, request: int) -> tuple[PackedBatch, PackedBatch, dict[str, np.ndarray], int]:
    requests = list(OTHERS)
    requests.insert(request, OFFENDER)
    first, batch = _steps(tuple(requests))
    pl = TINY.layout.pools[pool]
    need = live_pages(pl, batch.request_starts, batch.request_starts + batch.request_lengths, TINY.sliding_window)
    others = np.delete(need, request)
    assert need[request] >= 2 and need[request] > others.max(), (pool, need)  # the case's premise
    arrays = {k: np.array(v) for k, v in batch.to_arrays().items()}
    arrays[TABLE_FIELDS[pool]] = arrays[TABLE_FIELDS[pool]][:, :int(need[request]) - 1].copy()
    return first, batch, arrays, int(need[request])


@pytest.mark.parametrize("how", VALIDATORS)
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("pool", WIDTH_POOLS)
def test_a_table_too_narrow_for_one_request_names_it_wherever_it_is(pool: PoolName, place: str, how: str):
    request = PLACES[place]
    first, batch, arrays, need = _width_case(pool, request)
    report = _validate(how, first, arrays, batch)  # must not raise (IndexError)
    width = [issue for issue in report.issues if issue.code == "tables.width"]
    assert width, f"{TABLE_FIELDS[pool]} one column short for request {request} ({place}) accepted: {report.codes}"
    assert width[0].field == TABLE_FIELDS[pool] and width[0].request == request, width[0]
    assert width[0].expected == need and width[0].actual == need - 1, width[0]


# ------------------------------------------------------------------------------ query_start_loc and request ids
@pytest.mark.parametrize("place", PLACES)
def test_an_empty_request_is_named_wherever_it_is(place: str):
    """With ``allow_empty_requests=False`` the empty request is reported (its index in query_start_loc is the
    next entry, which repeats its start)."""
    request = PLACES[place]
    requests = [(10, 3), (20, 4)]
    requests.insert(request, (5, 0))
    batch = _build(tuple(requests))
    strict = batch.policy.model_copy(update={"allow_empty_requests": False})
    report = validate(batch.to_arrays(), batch.config, strict, batch.pool_blocks)
    (issue,) = [i for i in report.issues if i.code == "qsl.empty_request"]
    assert (issue.request, issue.index, issue.count) == (request, request + 1, 1), issue


@pytest.mark.parametrize(("first", "second"), [(0, 1), (1, 2), (0, 2)])
def test_a_repeated_request_id_names_its_second_use_wherever_the_pair_is(first: int, second: int):
    arrays = {k: np.array(v) for k, v in BATCH.to_arrays().items()}
    arrays["request_ids"][second] = arrays["request_ids"][first]
    report = validate(arrays, BATCH.config, BATCH.policy, BATCH.pool_blocks)
    (issue,) = [i for i in report.issues if i.code == "request_ids.duplicate"]
    assert (issue.request, issue.actual) == (second, [first, second]), issue
