"""The persistent form's hot path makes no full form: a persistent step runs through ``prefill``, ``run_forward``,
a TP group of threads and the serving loops (``generate``, ``greedy_decode``) without ever rebuilding its narrow
``[R, w]`` tables (``PersistentStep.to_full`` / ``full_tables``) or running the full stateless validator, and
gives the full form's results bit for bit. The delta is proven once per step, by the mirror's ``apply``."""

from __future__ import annotations

import numpy as np
import pytest

import dspark_abi.batch
import dspark_abi.incremental
import dspark_abi.persistent as persistent
from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.persistent import PersistentStep
from dspark_abi.presets import TINY, TINY_DSPARK
from dspark_kernels.api import prefill
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.forward import ForwardOptions, RankContext, run_forward
from dspark_kernels.model.plan import PersistentRows, PlanSource, StepRows
from dspark_kernels.model.tp import run_tp_inprocess
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.speculative import RandomDrafter, generate, greedy_decode


class FullFormMade(AssertionError):
    """Raised by the patched full-form builders: the hot path must not reach them."""


def _refuse_full_forms(monkeypatch) -> None:
    """Make every full-form rebuild of a persistent step and every use of the stateless validator raise."""
    def refuse(*args, **kwargs):
        raise FullFormMade("the persistent path rebuilt a step's full form or ran the full validator")

    monkeypatch.setattr(PersistentStep, "to_full", refuse)
    monkeypatch.setattr(PersistentStep, "full_tables", refuse)
    monkeypatch.setattr(persistent, "narrow_tables", refuse)
    for module in (persistent, dspark_abi.batch, dspark_abi.incremental):
        whole = module.validate_arrays

        def shapes_only(arrays, *args, level="full", _whole=whole, **kwargs):
            """The shape level (O(R + P), a step's own check runs it) passes; any deeper level raises."""
            if level != "shape":
                refuse()
            return _whole(arrays, *args, level=level, **kwargs)

        monkeypatch.setattr(module, "validate_arrays", shapes_only)


@pytest.fixture(scope="module")
def weights():
    return ModelWeights.random(TINY, seed=3)


def _both_forms(tp):
    """A second step (a ring continues, a new request takes a slot) in both forms: (full-form batch, persistent
    step, a mirror holding its delta, caches after the first step)."""
    alloc = BlockAllocator(TINY, pool_blocks_for(TINY, [80, 40, 40]))
    caches = ModelCaches.allocate(TINY, alloc.pool_blocks)
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp), alloc)
    rng = np.random.default_rng(1)
    tokens = {rid: rng.integers(0, TINY.vocab_size, 80) for rid in range(3)}
    mirror = alloc.persistent.copy()
    for queue in ([(0, 0, 40), (1, 0, 20)], [(0, 40, 30), (2, 0, 25)]):
        for rid, cached, new in queue:
            builder.add(rid, num_cached=cached, num_new=new, token_ids=tokens[rid][cached:cached + new])
        step = builder.build_step()
        mirror.apply(step)
        batch = step.to_full(alloc.persistent)             # the full form, made here, before any patch
        if queue[0][1] == 0:
            builder.commit(step)
    return batch, step, mirror, caches


def _assert_same(got, want, names):
    for name in names:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_the_patch_catches_a_full_form(monkeypatch):
    """The patched builders raise where a full form is made (the tests below can fail)."""
    batch, step, mirror, _ = _both_forms(1)
    _refuse_full_forms(monkeypatch)
    with pytest.raises(FullFormMade):
        step.to_full(mirror)
    with pytest.raises(FullFormMade):      # the stateless validator, as a full form's construction runs it
        PackedBatch.from_arrays(batch.to_arrays(), batch.config, batch.policy, batch.pool_blocks)


@pytest.mark.parametrize("tp", [1, 2])
def test_prefill_run_forward_and_threads_make_no_full_form(weights, tp, monkeypatch):
    batch, step, mirror, caches = _both_forms(tp)
    want_caches = caches.copy()
    want = prefill(batch, batch.token_ids, weights, want_caches)
    want_ranks = run_tp_inprocess(batch, batch.token_ids, weights, caches.copy())   # the same rank views
    _refuse_full_forms(monkeypatch)

    got_caches = caches.copy()
    got = prefill(step, step.token_ids, weights, got_caches, tables=mirror)
    assert got.batch is step                    # the step's own rows: no wrapper, no full form
    _assert_same(got, want, ("hidden", "x_hc", "logits", "sampled", "logit_rows"))
    for name, array in got_caches.arrays().items():
        np.testing.assert_array_equal(array, want_caches.arrays()[name], err_msg=name)

    forward = run_forward(step, step.token_ids, weights, caches.copy(), ForwardOptions(), tables=mirror)
    _assert_same(forward, want, ("hidden", "x_hc", "logits", "sampled"))

    ranks = run_tp_inprocess(step, step.token_ids, weights, caches.copy(), tables=mirror)
    for r, w in zip(ranks, want_ranks, strict=True):
        _assert_same(r.result, w.result, ("hidden", "x_hc", "logits", "sampled"))
        for name, array in r.caches.arrays().items():
            np.testing.assert_array_equal(array, w.caches.arrays()[name], err_msg=name)


def test_a_rank_of_a_group_plans_the_step_rows(monkeypatch):
    """One rank's plan (rank 1 of 2) comes from the step's rows and the persistent tables alone."""
    _, step, mirror, _ = _both_forms(2)
    _refuse_full_forms(monkeypatch)
    source = PlanSource.of(step, mirror)
    assert source.batch is step and source.plan().batch is step
    plan = source.plan(rank=1)
    np.testing.assert_array_equal(plan.table_row[plan.request >= 0],
                                  step.table_slots[plan.request[plan.request >= 0]])
    assert plan.tables["ori"].shape[0] == mirror.slots       # the persistent tables, every slot


def test_a_stale_step_is_still_refused(weights, monkeypatch):
    """The O(R) check that replaced the full form's: a slot recycled since the step was built is coded."""
    _, step, mirror, caches = _both_forms(1)
    _refuse_full_forms(monkeypatch)
    stale = mirror.copy()
    stale.release(int(step.table_slots[0]))
    with pytest.raises(ABIError) as err:
        run_forward(step, step.token_ids, weights, caches, ForwardOptions(), tables=stale, tp=RankContext())
    assert "tables.stale_slot" in err.value.codes


@pytest.mark.parametrize("tp,mode", [(1, "single"), (2, "threads")])
def test_the_loops_make_no_full_form_and_check_each_step_once(tp, mode, monkeypatch):
    """generate() and greedy_decode() on the persistent form: the same tokens as the full form, no full form made,
    the stateless validator never run, and one incremental proof of each step's delta by the mirror (plus the
    builder's own, when it builds the step)."""
    dspark = ModelWeights.random(TINY_DSPARK, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY_DSPARK.vocab_size, n) for n in (5, 23, 40)]
    args = dict(tp=tp, tp_mode=mode, prefill_chunk=8)
    drafts = TINY_DSPARK.dspark_block_size
    want = generate(prompts, dspark, RandomDrafter(TINY_DSPARK.vocab_size, seed=1), 6, drafts, **args, tables="full")
    want_plain = greedy_decode(prompts, dspark, 3, tp=tp, tp_mode=mode, tables="full")

    _refuse_full_forms(monkeypatch)
    applied = []
    apply = persistent.PersistentTables.apply

    def counted(self, step):
        applied.append(id(step))
        return apply(self, step)

    monkeypatch.setattr(persistent.PersistentTables, "apply", counted)
    got = generate(prompts, dspark, RandomDrafter(TINY_DSPARK.vocab_size, seed=1), 6, drafts, **args,
                   tables="persistent")
    assert len(applied) == len(set(applied)) == len(got.steps)   # one proof of each step's delta, by the mirror
    got_plain = greedy_decode(prompts, dspark, 3, tp=tp, tp_mode=mode, tables="persistent")
    for a, b in ((got, want), (got_plain, want_plain)):
        assert len(a.steps) == len(b.steps)
        assert all(isinstance(s.batch, PersistentStep) for s in a.steps)
        for i, tokens in b.tokens.items():
            np.testing.assert_array_equal(a.tokens[i], tokens)
        for name, array in a.caches.arrays().items():
            np.testing.assert_array_equal(array, b.caches.arrays()[name], err_msg=name)


def test_a_forward_refuses_tables_without_the_steps_delta(weights):
    # a step's rows are proven against the tables its delta produced; any other tables would be read at pages the
    # rows do not map, so the forward refuses them before a kernel runs, and nothing is written
    alloc = BlockAllocator(TINY, pool_blocks_for(TINY, [80, 40]))
    caches = ModelCaches.allocate(TINY, alloc.pool_blocks)
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=1), alloc)
    tokens = np.random.default_rng(2).integers(0, TINY.vocab_size, 80)
    builder.add(0, num_cached=0, num_new=40, token_ids=tokens[:40])
    first = builder.build_step()
    mirror = alloc.persistent.copy()
    before = {name: array.copy() for name, array in caches.arrays().items()}

    def refused(tables) -> list[str]:
        with pytest.raises(ABIError) as err:
            prefill(first, first.token_ids, weights, caches, tables=tables)
        return err.value.codes

    assert "tables.unapplied" in refused(alloc.persistent)        # built, not committed: the delta is not there
    assert "tables.unapplied" in refused(mirror)                  # a mirror that did not apply it
    mirror.apply(first)
    assert "tables.unapplied" in refused(mirror.copy())           # a copy proves nothing until it applies a step
    builder.commit(first)
    builder.add(0, num_cached=40, num_new=30, token_ids=tokens[40:70])
    second = builder.build_step()
    mirror.apply(second)
    assert "tables.unapplied" in refused(mirror)                  # tables moved on to the next step
    for name, array in caches.arrays().items():
        np.testing.assert_array_equal(array, before[name], err_msg=name)
    builder.commit(second)
    for tables in (mirror, alloc.persistent):                     # the tables right after the step: accepted
        prefill(second, second.token_ids, weights, caches, tables=tables)


def test_a_step_is_its_own_rows():
    """A persistent step carries what the kernels read of a step (StepRows) itself, derived from the one home the
    full form uses: its row ownership equals its full form's, is made once and cannot be written."""
    batch, step, _, _ = _both_forms(2)
    for name in [n for n in dir(StepRows) if not n.startswith("_")]:
        assert hasattr(step, name), name
    np.testing.assert_array_equal(step.row_request, batch.row_request)
    assert step.row_request.dtype == np.int32 and step.row_request is step.row_request
    assert not step.row_request.flags.writeable
    assert (step.row_request[step.num_tokens:] == -1).all() and step.padded_rows > step.num_tokens
    assert (step.tp_size, step.padded_rows, step.num_requests, step.num_tokens, step.local_rows) == \
        (batch.tp_size, batch.padded_rows, batch.num_requests, batch.num_tokens, batch.local_rows)


def test_persistent_rows_is_a_deprecated_alias_of_the_step():
    """The old wrapper's name still works for one minor version: it returns the step, warning at the caller."""
    _, step, _, _ = _both_forms(1)
    for make in (PersistentRows.of, PersistentRows):
        with pytest.warns(DeprecationWarning, match="PersistentRows is deprecated") as caught:
            assert make(step) is step
        assert caught[0].filename == __file__
