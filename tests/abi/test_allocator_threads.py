"""`BlockAllocator` shared by several threads: every method is atomic, and a step planned before another
thread's commit is refused (``alloc.stale_plan``) instead of handing the same blocks to two requests."""

import contextlib
import random
import sys
import threading

import numpy as np
import pytest

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.layout import POOL_NAMES
from dspark_abi.presets import TINY


def _assert_consistent(alloc, live):
    """No block is owned by two live requests, no block is both free and used, free + used == total."""
    live = sorted(live)
    assert sorted(alloc._row_of) == live
    tables = alloc.table_rows(live) if live else {p: np.zeros((0, 1), np.int32) for p in POOL_NAMES}
    for p in POOL_NAMES:
        used = tables[p][tables[p] >= 0]
        free = alloc._free[p][: alloc._top[p]]  # the stack below its top
        assert np.unique(used).size == used.size, f"{p}: a block is owned twice"
        assert np.unique(free).size == free.size, f"{p}: a block is free twice"
        assert not np.isin(free, used).any(), f"{p}: a block is free and used"
        assert used.size + alloc.free_blocks(p) == alloc.pool_blocks[p], p


def test_plan_made_stale_by_another_commit_is_refused(monkeypatch):
    """Thread B builds and commits between thread A's plan and A's commit (forced interleaving): A's commit is
    refused, nothing of it is allocated, and building the step again succeeds on the new state."""
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
    a = BatchBuilder(TINY, PaddingPolicy(), alloc)
    b = BatchBuilder(TINY, PaddingPolicy(), alloc)
    a.add(0, num_cached=0, num_new=40)
    b.add(1, num_cached=0, num_new=40)
    real_assemble = a._assemble

    def assemble_while_b_commits(*args, **kwargs):
        batch = real_assemble(*args, **kwargs)
        b.commit(b.build())  # "another thread" commits a step that takes the same blocks and the same table row
        return batch

    monkeypatch.setattr(a, "_assemble", assemble_while_b_commits)
    stale = a.build()
    with pytest.raises(ABIError) as err:
        a.commit(stale)
    assert err.value.codes == {"alloc.stale_plan"}
    issue = err.value.issues[0]
    assert issue.field == "plan" and issue.expected != issue.actual
    assert alloc.knows(1) and not alloc.knows(0)
    _assert_consistent(alloc, [1])
    monkeypatch.undo()
    a.add(0, num_cached=0, num_new=40)
    batch = a.build()  # the step, planned again on the current state
    a.commit(batch)
    assert batch.request_ids.tolist() == [0]
    _assert_consistent(alloc, [0, 1])


def test_plan_made_stale_by_a_release_is_refused():
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
    builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
    builder.add(0, num_cached=0, num_new=20)
    builder.commit(builder.build())
    plan = alloc.plan([0], np.array([20]), np.array([30]))
    alloc.release(0)
    with pytest.raises(ABIError) as err:
        alloc.commit(plan)
    assert err.value.codes == {"alloc.stale_plan"}
    _assert_consistent(alloc, [])


def test_plan_of_another_allocator_is_refused():
    one, two = BlockAllocator(TINY, PoolBlocks.uniform(64)), BlockAllocator(TINY, PoolBlocks.uniform(64))
    plan = one.plan([0], np.array([0]), np.array([5]))
    with pytest.raises(ABIError) as err:
        two.commit(plan)
    assert err.value.codes == {"alloc.stale_plan"}
    _assert_consistent(two, [])


def test_every_query_waits_for_the_lock():
    """While one thread holds ``allocator.lock`` (e.g. around a whole ``build()``), no other thread can read
    a half-made change."""
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
    BatchBuilder(TINY, PaddingPolicy(), alloc).add(0, num_cached=0, num_new=3)
    calls = [lambda: alloc.free_blocks("ori"), lambda: alloc.knows(0), lambda: alloc.table_rows([]),
             lambda: alloc.plan([0], np.array([0]), np.array([3])), lambda: alloc.release(0)]
    for call in calls:
        done = threading.Event()

        def run(call=call, done=done):
            with contextlib.suppress(ABIError):
                call()
            done.set()

        with alloc.lock:
            t = threading.Thread(target=run)
            t.start()
            assert not done.wait(0.05), call
        assert done.wait(5)
        t.join()


def test_lock_held_across_build_is_reentrant():
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
    builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
    builder.add(0, num_cached=0, num_new=5)
    with alloc.lock:  # plan, commit and the builder's queries re-enter the lock
        builder.commit(builder.build())
    assert alloc.cached_tokens(0) == 5


@pytest.mark.parametrize("hold_lock", [False, True], ids=["unlocked_builds", "builds_under_lock"])
def test_threads_hammering_one_allocator(hold_lock):
    """4 threads add, continue and release their own requests through their own builders on one allocator.
    Without the lock they must only see ``alloc.stale_plan`` (then retry) or ``alloc.exhausted``; with it held
    around ``build()`` never a stale plan. Afterwards every block is owned once and free + used == total."""
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(48), capacity=2)  # small: rows grow, pools run out
    threads, iterations = 4, 150
    errors, live, stale = [], set(), [0]
    live_lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker(t):
        rng = random.Random(t)
        builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
        mine: dict[int, int] = {}
        next_id = t * 10_000
        try:
            start.wait()
            for _ in range(iterations):
                if mine and (len(mine) >= 3 or rng.random() < 0.25):
                    rid = rng.choice(sorted(mine))
                    alloc.release(rid)
                    with live_lock:
                        live.discard(rid)
                    del mine[rid]
                    continue
                if mine and rng.random() < 0.5:
                    rid = rng.choice(sorted(mine))
                else:
                    rid, next_id = next_id, next_id + 1
                cached = mine.get(rid, 0)
                new = rng.randint(1, min(48, TINY.max_position_embeddings - cached))
                for _attempt in range(50):
                    builder.clear()
                    builder.add(rid, num_cached=cached, num_new=new)
                    try:
                        if hold_lock:
                            with alloc.lock:
                                builder.commit(builder.build())
                        else:
                            builder.commit(builder.build())
                    except ABIError as exc:
                        if exc.codes == {"alloc.stale_plan"} and not hold_lock:
                            stale[0] += 1
                            continue  # build the step again on the current state
                        if exc.codes != {"alloc.exhausted"}:
                            raise
                        builder.clear()
                        if mine:  # make room: finish one of this thread's requests
                            victim = min(mine)
                            alloc.release(victim)
                            with live_lock:
                                live.discard(victim)
                            del mine[victim]
                        break
                    else:
                        mine[rid] = cached + new
                        with live_lock:
                            live.add(rid)
                        break
        except BaseException as exc:  # reported by the main thread
            errors.append((t, exc))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible to provoke interleavings
    try:
        pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not any(th.is_alive() for th in pool)
    assert not errors, errors
    _assert_consistent(alloc, live)
    for rid in sorted(live):
        alloc.release(rid)
    _assert_consistent(alloc, [])
    assert all(alloc.free_blocks(p) == alloc.pool_blocks[p] for p in POOL_NAMES)


def test_table_rows_of_an_unknown_request_is_coded():
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
    BatchBuilder(TINY, PaddingPolicy(), alloc).add(0, num_cached=0, num_new=3)
    with pytest.raises(ABIError) as err:  # e.g. another thread released it
        alloc.table_rows([5, 6])
    assert err.value.codes == {"alloc.unknown_request"}
    assert (err.value.issues[0].index, err.value.issues[0].count) == (0, 2)


def test_table_rows_of_a_plan_are_the_tables_after_its_commit():
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
    builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
    builder.add(0, num_cached=0, num_new=5)
    builder.commit(builder.build())
    plan = alloc.plan([0, 1], np.array([5, 0]), np.array([40, 9]))  # request 1 is new in this step
    planned = alloc.table_rows([0, 1], plan)
    with pytest.raises(ABIError) as err:
        alloc.table_rows([1])  # not allocated before the commit
    assert err.value.codes == {"alloc.unknown_request"}
    alloc.commit(plan)
    after = alloc.table_rows([0, 1])
    assert all(np.array_equal(planned[p], after[p]) for p in POOL_NAMES)
    with pytest.raises(ABIError) as err:
        alloc.table_rows([0, 1], plan)  # committed: the plan is stale now
    assert err.value.codes == {"alloc.stale_plan"}


def test_deepcopy_is_an_independent_snapshot_with_its_own_lock():
    import copy

    original = BlockAllocator(TINY, PoolBlocks.uniform(64))
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=1), original)
    builder.add(0, num_cached=0, num_new=5)
    builder.commit(builder.build())
    clone = copy.deepcopy(original)
    assert clone.lock is not original.lock
    assert clone.cached_tokens(0) == 5 and clone.free_blocks("ori") == original.free_blocks("ori")
    plan = original.plan([0], np.array([5]), np.array([40]))
    with pytest.raises(ABIError) as err:   # a plan belongs to the allocator that made it
        clone.commit(plan)
    assert err.value.codes == {"alloc.stale_plan"}
    original.commit(plan)
    assert clone.cached_tokens(0) == 5 and original.cached_tokens(0) == 40
