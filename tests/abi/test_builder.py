"""Serving-side builder and allocator: chunked prefill, TP padding, rings, release, all-or-nothing."""

import numpy as np
import pytest

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, PoolBlocks, validate
from dspark_abi.presets import TINY


def _builder(tp=1, blocks=256, **policy):
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(blocks))
    return BatchBuilder(TINY, PaddingPolicy(tp_size=tp, **policy), alloc), alloc


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_unaligned_n_is_padded_per_policy(tp):
    builder, _ = _builder(tp=tp, pad_position="continue")
    builder.add(0, num_cached=5, num_new=3)
    builder.add(1, num_cached=0, num_new=6)
    batch = builder.build()
    assert batch.num_tokens == 9 and batch.padded_rows == -(-9 // tp) * tp
    assert batch.positions[9:].tolist() == list(range(6, 6 + batch.padded_rows - 9))
    ids = np.concatenate([batch.rank(r).local_request_ids for r in range(tp)])
    assert ids.tolist() == [0] * 3 + [1] * 6 + [-1] * (batch.padded_rows - 9)


def test_chunked_prefill_reuses_tables_and_continues_positions():
    builder, alloc = _builder(tp=2)
    builder.add(7, num_cached=0, num_new=50)
    first = builder.build()
    builder.commit(first)
    builder.add(7, num_cached=50, num_new=30)
    second = builder.build()
    builder.commit(second)
    assert second.positions[:30].tolist() == list(range(50, 80))
    def ori_block(batch, page):  # a ring table holds logical page i in column i % width
        return batch.tables.ori[0, page % batch.tables.ori.shape[1]]

    # ori page 1 (positions 32..63) is still in the window of position 50 and keeps its block; page 0 fell out
    # of the window (50 - (W - 1) = 35 > 31) and was recycled into the new page 2; the second step's ori table
    # is as narrow as its live range, pages 1..2
    assert second.tables.ori.shape == (1, 2)
    assert ori_block(second, 1) == ori_block(first, 1)
    assert ori_block(second, 2) == ori_block(first, 0)
    np.testing.assert_array_equal(second.tables.csa_cmp[0, :1], first.tables.csa_cmp[0, :1])
    assert alloc.cached_tokens(7) == 80
    assert validate(second).ok


def test_continuation_must_start_where_previous_chunk_ended():
    builder, _ = _builder()
    builder.add(0, num_cached=0, num_new=10)
    builder.commit(builder.build())
    builder.add(0, num_cached=12, num_new=4)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.issues[0].expected == 10 and err.value.issues[0].actual == 12


def test_state_ring_pages_are_recycled():
    builder, alloc = _builder(blocks=300)
    used = []
    for step in range(20):  # 20 chunks of 64 tokens: 1280 positions, far more than 300 state blocks hold
        builder.add(0, num_cached=64 * step, num_new=64)
        batch = builder.build()
        builder.commit(batch)
        assert validate(batch).ok
        used.append((300 - alloc.free_blocks("csa_state"), 300 - alloc.free_blocks("ori")))
        assert alloc.held_blocks(0)["ori"] == used[-1][1]
    # the ratio-4 ring holds only the carried 8 positions plus the chunk: (8 + 64) / 2 rows per page
    assert max(u for u, _ in used) <= (8 + 64) // 2 + 1
    # the raw KV ring holds the window reach (W - 1 = 15) plus the chunk, not the 1280 / 32 = 40 pages written
    assert max(o for _, o in used) <= -(-(15 + 64) // 32) + 1 < 1280 // 32


def test_release_returns_every_block():
    builder, alloc = _builder()
    builder.add(0, num_cached=0, num_new=100)
    builder.add(1, num_cached=40, num_new=10)
    builder.commit(builder.build())
    alloc.release(0)
    alloc.release(1)
    assert all(alloc.free_blocks(p) == 256 for p in ("ori", "csa_cmp", "hca_cmp", "idx", "csa_state",
                                                     "csa_inner_state", "hca_state"))


def test_capacity_grows_beyond_initial_rows():
    builder, _ = _builder(blocks=2000)
    for rid in range(40):
        builder.add(rid, num_cached=rid, num_new=2)
    batch = builder.build()
    assert batch.num_requests == 40 and validate(batch).ok


def test_failed_build_keeps_queue_for_retry():
    builder, _ = _builder(blocks=8)
    builder.add(0, num_cached=0, num_new=600)
    with pytest.raises(ABIError):
        builder.build()
    builder.clear()
    builder.add(0, num_cached=0, num_new=10)
    assert builder.build().num_tokens == 10


def test_token_ids_and_logit_rows():
    builder, _ = _builder(tp=4)
    builder.add(0, num_cached=0, num_new=3, token_ids=[5, 6, 7])
    builder.add(1, num_cached=0, num_new=0, token_ids=[])
    builder.add(2, num_cached=3, num_new=2, token_ids=[8, 9])
    batch = builder.build()
    assert batch.token_ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert batch.logit_rows.tolist() == [2, -1, 4]


def test_batch_is_frozen_and_private():
    builder, _ = _builder()
    ids = np.array([1, 2, 3])
    builder.add(0, num_cached=0, num_new=3, token_ids=ids)
    batch = builder.build()
    ids[0] = 99
    assert batch.token_ids[0] == 1
    with pytest.raises(ValueError):
        batch.positions[0] = 5
    with pytest.raises(AttributeError):
        batch.positions = None


def test_add_many_builds_what_add_builds():
    rng = np.random.default_rng(4)
    ids, cached, new = np.array([5, 9, 2, 7]), rng.integers(0, 500, 4), np.array([3, 0, 11, 6])
    tokens = rng.integers(0, TINY.vocab_size, int(new.sum()))
    one, _ = _builder(tp=2)
    offsets = np.concatenate([[0], np.cumsum(new)])
    for i in range(4):
        one.add(int(ids[i]), int(cached[i]), int(new[i]), token_ids=tokens[offsets[i]:offsets[i + 1]])
    many, _ = _builder(tp=2)
    many.add_many(ids[:2], cached[:2], new[:2], token_ids=tokens[: offsets[2]])   # two calls mix fine
    many.add_many(ids[2:].tolist(), cached[2:].tolist(), new[2:].tolist(), token_ids=tokens[offsets[2]:])
    assert one.build() == many.build()


@pytest.mark.parametrize(("args", "field"), [
    (([1, 2], [0, 0, 0], [1, 1]), "add_many"),                  # one entry per request
    (([1, 2], [0.0, 0.0], [1, 1]), "num_cached"),               # floats are not counts
    (([1, 2], [0, -3], [1, 1]), "num_cached"),
    ((np.array([[1, 2]]), [0, 0], [1, 1]), "request_ids"),      # 1-D only
    (([1, 1], [0, 0], [1, 1]), "request_id"),                   # unique ids
])
def test_add_many_refuses_bad_arrays_with_the_argument_named(args, field):
    builder, alloc = _builder()
    builder.add_many(*args)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.codes == {"builder.request"}
    assert field in {i.field for i in err.value.issues}
    assert alloc.free_blocks("ori") == 256 and len(builder._pending) == 1   # nothing allocated, queue kept


def test_add_many_token_ids_count_is_checked():
    builder, _ = _builder()
    builder.add_many([0, 1], [0, 0], [2, 3], token_ids=[1, 2, 3, 4])
    with pytest.raises(ABIError) as err:
        builder.build()
    (issue,) = err.value.issues
    assert issue.field == "token_ids" and issue.expected == 5 and issue.actual == 4


def test_fixed_ring_width_gives_static_shapes_and_the_same_slots():
    from dspark_abi.presets import TINY_1M

    def step(ring_width):
        alloc = BlockAllocator(TINY_1M, PoolBlocks.uniform(12_000))
        builder = BatchBuilder(TINY_1M, PaddingPolicy(tp_size=2), alloc, ring_width=ring_width)
        builder.add_many([0, 1], [300_000, 17], [40, 9])
        return builder.build()

    narrow, fixed = step("step"), step("fixed")
    for pl in TINY_1M.layout:
        if pl.is_ring:
            assert fixed.tables[pl.name].shape == (2, pl.ring_width) > narrow.tables[pl.name].shape
        else:
            assert fixed.tables[pl.name].shape == narrow.tables[pl.name].shape
        np.testing.assert_array_equal(fixed.slots[pl.name], narrow.slots[pl.name])   # same blocks, other columns
    assert validate(fixed).ok and validate(narrow).ok


def test_a_step_validator_of_another_config_is_refused():
    from dspark_abi.incremental import StepValidator
    from dspark_abi.presets import TINY_1M

    alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
    with pytest.raises(ABIError) as err:
        BatchBuilder(TINY, PaddingPolicy(), alloc, validator=StepValidator(TINY_1M, PaddingPolicy(), alloc.pool_blocks))
    assert err.value.codes == {"config.mismatch"} and err.value.issues[0].field == "validator"


def test_a_serving_loop_with_a_step_validator_builds_the_same_batches():
    from dspark_abi.allocator import pool_blocks_for
    from dspark_abi.incremental import StepValidator
    from dspark_abi.presets import TINY_1M

    blocks = pool_blocks_for(TINY_1M, [420_000, 9_000, 5_000])
    policy = PaddingPolicy(tp_size=2)
    plain = BatchBuilder(TINY_1M, policy, BlockAllocator(TINY_1M, blocks))
    validator = StepValidator(TINY_1M, policy, blocks)
    checked = BatchBuilder(TINY_1M, policy, BlockAllocator(TINY_1M, blocks), validator=validator)
    steps = [[(0, 400_000, 64), (1, 0, 100)], [(0, 400_064, 32), (1, 100, 7), (2, 0, 50)], [(1, 107, 90)],
             [(0, 400_096, 1), (2, 50, 3)], [(0, 400_097, 40), (2, 53, 8)]]
    for requests in steps:
        for builder in (plain, checked):
            for rid, cached, new in requests:
                builder.add(rid, num_cached=cached, num_new=new)
        built = checked.build(), plain.build()
        assert built[0] == built[1]
        checked.commit(built[0])
        plain.commit(built[1])
    # request 0 continues from the step before: the last step re-proved its new compressed pages only, not its
    # 100,024-entry history (a request absent from the previous step is checked afresh)
    assert validator.last_stats.compared["csa_cmp"] > 10 * max(1, validator.last_stats.fresh["csa_cmp"])


# ---------------------------------------------------------------------------------------------- build, then commit
def _state(alloc):
    """Everything the allocator holds (tables, free stacks, runs, cached counts)."""
    return ({p: t.copy() for p, t in alloc._tables.items()}, {p: f[: alloc._top[p]].copy() for p, f in
                                                               alloc._free.items()}, dict(alloc._cached))


def _same_state(a, b):
    return (all(np.array_equal(a[0][p], b[0][p]) for p in a[0]) and all(np.array_equal(a[1][p], b[1][p])
                                                                       for p in a[1]) and a[2] == b[2])


def _queue(builder, step):
    for rid, cached, new in step:
        builder.add(rid, num_cached=cached, num_new=new)


def test_build_changes_nothing_and_a_dropped_batch_can_be_built_again():
    builder, alloc = _builder(tp=2)
    _queue(builder, [(0, 0, 50), (1, 0, 9)])
    builder.commit(builder.build())
    before = _state(alloc)
    step = [(0, 50, 30), (1, 9, 4), (2, 0, 7)]          # request 2 is new: it gets a table row only on commit
    _queue(builder, step)
    dropped = builder.build()
    assert _same_state(_state(alloc), before) and not alloc.knows(2) and alloc.cached_tokens(0) == 50
    del dropped
    _queue(builder, step)
    first = builder.build()
    _queue(builder, step)
    again = builder.build()
    assert first == again                                 # every array equal
    assert _same_state(_state(alloc), before)
    builder.commit(again)
    assert [alloc.cached_tokens(r) for r in (0, 1, 2)] == [80, 13, 7]


def test_a_batch_is_committed_once_by_its_own_builder():
    builder, alloc = _builder()
    other = BatchBuilder(TINY, PaddingPolicy(), alloc)
    _queue(builder, [(0, 0, 10)])
    batch = builder.build()
    for committer, copy in ((other, batch), (builder, PackedBatch.from_arrays(batch.to_arrays(), TINY,
                                                                                batch.policy, batch.pool_blocks))):
        with pytest.raises(ABIError) as err:              # another builder's batch, a batch made from arrays
            committer.commit(copy)
        assert err.value.codes == {"alloc.stale_plan"} and err.value.issues[0].field == "batch"
        assert "not built by this builder" in err.value.issues[0].message
    assert not alloc.knows(0)
    builder.commit(batch)
    before = _state(alloc)
    with pytest.raises(ABIError) as err:
        builder.commit(batch)
    assert err.value.codes == {"alloc.stale_plan"} and "committed already" in err.value.issues[0].message
    assert _same_state(_state(alloc), before) and alloc.cached_tokens(0) == 10


def test_a_batch_overtaken_by_a_commit_or_a_release_is_stale():
    builder, alloc = _builder()
    _queue(builder, [(0, 0, 10), (1, 0, 5)])
    builder.commit(builder.build())
    _queue(builder, [(0, 10, 4)])
    a = builder.build()
    _queue(builder, [(0, 10, 6)])
    b = builder.build()                                   # two candidate steps built on the same state
    builder.commit(b)
    before = _state(alloc)
    with pytest.raises(ABIError) as err:
        builder.commit(a)
    assert err.value.codes == {"alloc.stale_plan"} and err.value.issues[0].field == "plan"
    assert _same_state(_state(alloc), before) and alloc.cached_tokens(0) == 16
    _queue(builder, [(1, 5, 3)])
    c = builder.build()
    alloc.release(0)
    after_release = _state(alloc)
    with pytest.raises(ABIError) as err:
        builder.commit(c)
    assert err.value.codes == {"alloc.stale_plan"}
    assert _same_state(_state(alloc), after_release) and alloc.cached_tokens(1) == 5


def test_the_continuation_hint_says_to_commit_the_previous_batch():
    builder, _ = _builder()
    _queue(builder, [(0, 0, 10)])
    builder.commit(builder.build())
    _queue(builder, [(0, 10, 5)])
    builder.build()                                       # built, never committed
    _queue(builder, [(0, 15, 5)])
    with pytest.raises(ABIError) as err:
        builder.build()
    issue = err.value.issues[0]
    assert (issue.code, issue.expected, issue.actual) == ("builder.request", 10, 15)
    assert "num_cached=10" in issue.fix and "commit" in issue.fix


def test_the_step_validator_takes_a_step_as_baseline_on_commit_only():
    """A built and dropped step leaves the validator's baseline alone: rebuilding it gives the same report and the
    same incremental work as building it once, and the next step is checked against the committed one."""
    from dspark_abi.incremental import StepValidator

    def loop(drop):
        alloc = BlockAllocator(TINY, PoolBlocks.uniform(256))
        validator = StepValidator(TINY, PaddingPolicy(), alloc.pool_blocks)
        builder = BatchBuilder(TINY, PaddingPolicy(), alloc, validator=validator)
        stats = []
        for step in ([(0, 0, 200), (1, 0, 150)], [(0, 200, 200), (1, 150, 150)], [(0, 400, 100)]):
            if drop:
                _queue(builder, [(rid, cached, new + 1) for rid, cached, new in step])
                builder.build()                           # another candidate, dropped
            _queue(builder, step)
            batch = builder.build()
            stats.append(validator.last_stats)
            builder.commit(batch)
        return stats

    assert loop(drop=True) == loop(drop=False)


def test_the_request_record_travels_with_the_batch_and_its_rank_views():
    from dspark_abi.requests import BatchRequests

    builder, _ = _builder(tp=2)
    builder.add(0, num_cached=126, num_new=3)
    builder.add(5, num_cached=40, num_new=0)
    builder.add(1, num_cached=30, num_new=4)
    batch = builder.build(logit_rows=[6])
    record = batch.requests
    assert record.ids.tolist() == [0, 5, 1] and record.first_position.tolist() == [126, 40, 30]
    assert (record.row_start.tolist(), record.row_end.tolist()) == ([0, 3, 3], [3, 3, 7])
    assert record.logit_row.tolist() == [-1, -1, 6] and record.commit_rows.tolist() == [3, 0, 4]
    derived = BatchRequests.from_arrays(batch.query_start_loc, batch.positions, batch.request_ids, batch.logit_rows)
    assert derived.first_position.tolist() == [126, -1, 30]        # the arrays do not carry an empty request's
    assert record.agrees_with(batch.query_start_loc, batch.positions, batch.request_ids, batch.logit_rows)
    assert batch.row_request.tolist() == record.row_request(batch.padded_rows).tolist() == [0, 0, 0, 2, 2, 2, 2, -1]
    assert batch.request_starts.tolist() == [126, -1, 30]
    for r in range(2):
        view = batch.rank(r)
        assert view.requests is record
        assert view.local_request_ids.tolist() == record.owner_in(view.row_start, batch.local_rows).tolist()
    last = batch.with_logit_rows([2, 6])                  # another output intent: the record follows the arrays
    assert last.requests.logit_row.tolist() == [2, -1, 6] and batch.requests.logit_row.tolist() == [-1, -1, 6]
    with pytest.raises(ValueError):
        record.ids[0] = 9
