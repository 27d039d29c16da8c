"""TP 2 across two processes on torch.distributed (gloo) equals the single-process and in-process results.

The case is upstream's ragged2: request 0 has 3 new tokens after 126 cached, request 1 has 4 after 30
(N = 7, P = 8, L = 4), so request 1 crosses the rank boundary and one padding row sits at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from tolerances import forward_reductions, order_atol

from dspark_abi import ABIError
from dspark_abi.presets import TINY, TINY_DSPARK
from dspark_kernels.model.forward import run_forward
from dspark_kernels.model.tp import DistributedJob, launch, run_tp_inprocess

from .conftest import Session

#: Two processes vs one: each rank runs its L query rows, the single process all P, i.e. two summation orders
#: over the whole forward: eps32 * sqrt(K) * max|ref| with K = forward_reductions(TINY) (see test_forward).
FORWARD_K = forward_reductions(TINY)
#: Generous bound on the whole two-process run (spawn + torch import + 4 TINY layers take ~10 s).
LAUNCH_TIMEOUT_S = 120.0


@pytest.mark.distributed
def test_two_process_gloo_equals_single_process():
    s = Session(tp=2, config=TINY_DSPARK)          # with the DSpark drafter's target hidden features
    ctx = s.batch([(0, 0, 126), (1, 0, 30)])  # fill the cached context by running the earlier tokens
    run_forward(ctx, ctx.token_ids, s.weights, s.caches)
    b = s.batch([(0, 126, 3), (1, 30, 4)])
    assert b.query_start_loc.tolist() == [0, 3, 7] and b.padded_rows == 8
    assert b.rank(0).local_request_ids.tolist() == [0, 0, 0, 1]
    assert b.rank(1).local_request_ids.tolist() == [1, 1, 1, -1]

    single_caches = s.caches.copy()
    single = run_forward(b, b.token_ids, s.weights, single_caches)
    threads = run_tp_inprocess(b, b.token_ids, s.weights, s.caches.copy())
    procs = launch(DistributedJob(b, b.token_ids, s.weights, s.caches), backend="gloo", timeout=LAUNCH_TIMEOUT_S)

    assert [p.rank for p in procs] == [0, 1]
    for p, t in zip(procs, threads, strict=True):
        # same per-rank computation, real collectives instead of shared memory: bit-identical
        np.testing.assert_array_equal(p.result.hidden, t.result.hidden)
        np.testing.assert_array_equal(p.result.logits, t.result.logits)
        for name, arr in p.caches.arrays().items():
            np.testing.assert_array_equal(arr, t.caches.arrays()[name])
        np.testing.assert_allclose(p.result.hidden, single.hidden, rtol=0, atol=order_atol(single.hidden, FORWARD_K))
        np.testing.assert_allclose(p.result.logits, single.logits, rtol=0, atol=order_atol(single.logits, FORWARD_K))
        assert p.result.sampled.tolist() == single.sampled.tolist()
        assert p.result.logit_rows.tolist() == [2, 6]
        assert not p.result.hidden[7].any()  # the padding row
        np.testing.assert_array_equal(p.result.target_hidden, t.result.target_hidden)
        np.testing.assert_allclose(p.result.target_hidden, single.target_hidden, rtol=0,
                                   atol=order_atol(single.target_hidden, FORWARD_K))


def test_torch_is_not_imported_by_the_forward_modules():
    code = ("import sys; import dspark_kernels.model.tp, dspark_kernels.model.forward, dspark_kernels.model.weights, "
            "dspark_kernels.model.caches; sys.exit(1 if 'torch' in sys.modules else 0)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


def test_inprocess_rank_failure_is_raised_not_hung():
    s = Session(tp=2)
    b = s.batch([(0, 0, 130), (1, 0, 3)])
    with pytest.raises(ABIError):
        run_tp_inprocess(b, b.token_ids, s.weights, s.caches, logit_rows=[999])


@pytest.mark.distributed
def test_rank_group_mirrors_follow_the_allocator_by_deltas_alone():
    """A serving loop's TP 2 group of rank processes (RankGroup): each process loads the persistent tables once and
    advances its own mirror by every step's delta (``apply``), never receiving the tables again; over three steps
    (new slots, ring pages leaving the window) every rank's results equal the in-process ranks' on the full form bit
    for bit, and after the loop each rank's mirror equals the allocator's tables."""
    from dspark_abi import BatchBuilder
    from dspark_kernels.model.tp import RankGroup

    from .conftest import tokens_of

    s = Session(tp=2)
    builder = BatchBuilder(TINY, s.policy, s.alloc)
    steps = [[(0, 0, 150), (1, 0, 40)], [(0, 150, 70), (1, 40, 9), (2, 0, 33)], [(0, 220, 190), (2, 33, 100)]]
    with RankGroup(2, s.alloc.persistent, timeout=LAUNCH_TIMEOUT_S) as group:
        for requests in steps:
            for queue in range(2):
                for rid, cached, new in requests:
                    builder.add(rid, num_cached=cached, num_new=new, token_ids=tokens_of(rid)[cached:cached + new])
                if queue == 0:
                    batch = builder.build()
            step = builder.build_step()
            threads = run_tp_inprocess(batch, batch.token_ids, s.weights, s.caches.copy())
            ranks = group.run(DistributedJob(step, step.token_ids, s.weights, s.caches), s.alloc.persistent.slots)
            for p, t in zip(ranks, threads, strict=True):
                np.testing.assert_array_equal(p.result.hidden, t.result.hidden)
                np.testing.assert_array_equal(p.result.logits, t.result.logits)
                for name, arr in p.caches.arrays().items():
                    np.testing.assert_array_equal(arr, t.caches.arrays()[name], err_msg=name)
            if requests is steps[-1]:       # a one-shot launch ships the step with the tables holding its delta
                tables = s.alloc.persistent.copy()
                tables.apply(step)
                once = launch(DistributedJob(step, step.token_ids, s.weights, s.caches, tables=tables),
                              timeout=LAUNCH_TIMEOUT_S)
                for p, t in zip(once, threads, strict=True):
                    np.testing.assert_array_equal(p.result.logits, t.result.logits)
            for name, array in s.caches.arrays().items():
                array[...] = ranks[0].caches.arrays()[name]
            builder.commit(step)
        want = s.alloc.persistent.to_arrays()
        for rank, mirror in enumerate(group.mirrors()):
            assert set(mirror) == set(want)
            for name, array in want.items():
                np.testing.assert_array_equal(mirror[name], array, err_msg=f"rank {rank} {name}")
        slot = s.alloc.persistent.slot_of(1)
        s.alloc.release(1)                  # a finished request: its slot's generation advances on every mirror
        group.release(slot)
        want = s.alloc.persistent.to_arrays()
        assert not want["slot_in_use"][slot]
        for rank, mirror in enumerate(group.mirrors()):
            for name, array in want.items():
                np.testing.assert_array_equal(mirror[name], array, err_msg=f"rank {rank} {name} after release")


@pytest.mark.distributed
def test_rank_group_drafter_keeps_features_and_refuses_with_nothing_written():
    """The DSpark drafter in a RankGroup's rank processes (TP 2 over the group): a step's results carry no target
    features (they stay in the ranks); the drafter observes the step's committed rows by position alone and drafts
    what a single-group drafter in this process drafts from the same features (the in-process ranks', bit-equal to
    the rank processes'); a coded error raised in the ranks (a request twice in one observe, rows that are not
    the step's, an anchor that does not follow the history, an unknown request) reaches the caller as the same
    ABIError, nothing written (the next observe continues the history as if the refused call never came) and the
    group keeps serving."""
    from dspark_abi import BatchBuilder
    from dspark_kernels.drafter import DSparkDrafter
    from dspark_kernels.model.tp import RankGroup

    from .conftest import tokens_of
    from .test_drafter import K_DRAFT

    s = Session(tp=2, config=TINY_DSPARK)
    lengths = {0: 20, 1: 12}
    builder = BatchBuilder(TINY_DSPARK, s.policy, s.alloc)
    for queue in range(2):
        for rid, n in lengths.items():
            builder.add(rid, num_cached=0, num_new=n, token_ids=tokens_of(rid)[:n])
        if queue == 0:
            batch = builder.build()
    step = builder.build_step()
    single = DSparkDrafter.random(TINY_DSPARK, s.weights, seed=5)
    assert single.recipe is not None
    threads = run_tp_inprocess(batch, batch.token_ids, s.weights, s.caches.copy())[0].result
    starts = batch.query_start_loc.tolist()
    with RankGroup(2, s.alloc.persistent, timeout=LAUNCH_TIMEOUT_S) as group:
        group.attach_drafter(single.recipe, s.weights)
        ranks = group.run(DistributedJob(step, step.token_ids, s.weights, s.caches), s.alloc.persistent.slots)
        assert all(r.result.target_hidden is None and r.result.target_hidden_hc_head is None for r in ranks)
        np.testing.assert_array_equal(ranks[0].result.logits, threads.logits)   # the step ran as before
        builder.commit(step)
        refusals = [(lambda: group.drafter_observe([1, 0, 0], [0, 0, 0], [12, 3, 3]), "request_ids"),
                    (lambda: group.drafter_observe([0], [1], [4]), "counts"),
                    (lambda: group.drafter_observe([0], [0], [21]), "counts"),
                    (lambda: group.drafter_draft([5], np.array([1]), np.array([0])), "request_ids")]
        for call, field in refusals:
            with pytest.raises(ABIError) as err:
                call()
            assert err.value.issues[0].field == field, err.value.issues
        group.drafter_observe([0, 1], [0, 0], [20, 12])       # continues from nothing: nothing was written
        single.attach(s.alloc.persistent)                     # the tables the ranks' mirrors equal
        single.observe([0, 1], [np.arange(20), np.arange(12)],
                       [threads.target_hidden[starts[k]: starts[k] + n] for k, n in enumerate(lengths.values())])
        anchors = np.array([tokens_of(0)[20], tokens_of(1)[12]])
        with pytest.raises(ABIError) as err:
            group.drafter_draft([0, 1], anchors, np.array([20, 11]))
        assert [(i.code, i.request) for i in err.value.issues] == [("drafter.gap", 1)]
        got = group.drafter_draft([0, 1], anchors, np.array([20, 12]))
        want = single.draft([0, 1], anchors, np.array([20, 12]))
        np.testing.assert_array_equal(got.tokens, want.tokens)
        # the ranks' TP 2 draft vs the single group: two summation orders over the drafter (test_drafter.py)
        np.testing.assert_allclose(got.confidence, want.confidence, rtol=0,
                                   atol=order_atol(want.confidence, K_DRAFT, 4))
        group.drafter_release([0])
        with pytest.raises(ABIError) as err:
            group.drafter_draft([0], anchors[:1], np.array([20]))
        assert err.value.issues[0].code == "drafter.unknown_request"
