"""Serving-stack group shapes: inactive groups (query_start_loc all zero) and repeated terminal boundaries."""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import assert_close, forward_reductions, order_atol

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks, validate
from dspark_abi.presets import TINY
from dspark_kernels import ModelCaches, prefill
from dspark_kernels.model.forward import ForwardOptions, run_forward
from dspark_kernels.model.tp import run_tp_inprocess
from dspark_kernels.model.weights import ModelWeights

POOLS = PoolBlocks(ori=64, csa_cmp=16, hca_cmp=8, idx=16, csa_state=512, csa_inner_state=512, hca_state=128)


@pytest.fixture(scope="module")
def weights():
    return ModelWeights.random(TINY, seed=3)


def _inactive(tp=2, requests=3):
    alloc = BlockAllocator(TINY, POOLS)
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp, allow_inactive=True), alloc)
    for rid in range(requests):
        builder.add(rid, num_cached=0, num_new=0)
    return builder.build(), alloc


def _snapshot(caches):
    return [array.copy() for layer in caches.layers for array in layer.arrays().values()]


def test_inactive_group_is_a_policy_option():
    batch, _ = _inactive()
    assert batch.query_start_loc.tolist() == [0, 0, 0, 0] and batch.padded_rows == 0 and batch.local_rows == 0
    assert batch.logit_rows.tolist() == [-1, -1, -1]
    assert validate(batch).ok
    # without the option N = 0 is the usual mistake, and the fix names the option
    report = validate(batch.to_arrays(), TINY, PaddingPolicy(tp_size=2), POOLS)
    assert report.codes == {"qsl.token_count"} and "allow_inactive" in report.issues[0].hint
    with pytest.raises(ABIError, match="allow_empty_requests"):
        PaddingPolicy(allow_inactive=True, allow_empty_requests=False)


def test_inactive_group_with_live_logit_rows_is_rejected():
    batch, _ = _inactive()
    arrays = dict(batch.to_arrays(), logit_rows=np.array([0, -1, -1], np.int32))
    assert validate(arrays, TINY, batch.policy, POOLS).codes == {"logits.range"}


@pytest.mark.parametrize("mode", ["group", "threads"])
def test_inactive_group_writes_nothing_and_returns_zeros(weights, mode):
    batch, alloc = _inactive()
    caches = ModelCaches.allocate(TINY, alloc.pool_blocks)
    for layer in caches.layers:                                     # non-zero contents that must survive
        for array in layer.arrays().values():
            array[...] = np.arange(array.size).reshape(array.shape) % 7
    before = _snapshot(caches)
    inputs = np.zeros(0, np.int64)
    if mode == "group":
        results = [prefill(batch, inputs, weights, caches)]
    else:
        ranks = run_tp_inprocess(batch, inputs, weights, caches)
        results = [r.result for r in ranks]
        for r in ranks[1:]:
            for got, want in zip(_snapshot(r.caches), before, strict=True):
                np.testing.assert_array_equal(got, want)
    for result in results:
        assert result.hidden.shape == (0, TINY.hidden_size) and result.x_hc.shape == (0, TINY.hc_mult,
                                                                                       TINY.hidden_size)
        assert result.logit_rows.tolist() == [-1, -1, -1] and result.sampled.tolist() == [-1, -1, -1]
        assert result.logits.shape == (3, TINY.vocab_size) and not result.logits.any()
    for got, want in zip(_snapshot(caches), before, strict=True):
        np.testing.assert_array_equal(got, want)                    # bit-identical


def test_inactive_group_runs_no_stage(weights):
    """No attention backend (reference or pypto) is called for an idle group."""
    batch, alloc = _inactive()

    def boom(*args, **kwargs):
        raise AssertionError("an attention stage ran for an inactive group")

    result = run_forward(batch, np.zeros(0, np.int64), weights, ModelCaches.allocate(TINY, alloc.pool_blocks),
                         ForwardOptions(backend=boom))
    assert result.sampled.tolist() == [-1, -1, -1]


def test_repeated_terminal_boundaries_change_nothing(weights):
    """A group with fewer requests than the dispatch's R repeats N at the tail of query_start_loc."""
    rng = np.random.default_rng(5)
    prompts = {0: rng.integers(0, TINY.vocab_size, 9), 1: rng.integers(0, TINY.vocab_size, 6)}
    results, caches = [], []
    for tail in (0, 3):
        alloc = BlockAllocator(TINY, POOLS)
        builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2), alloc)
        for rid, ids in prompts.items():
            builder.add(rid, num_cached=0, num_new=len(ids), token_ids=ids)
        for rid in range(10, 10 + tail):
            builder.add(rid, num_cached=0, num_new=0, token_ids=[])
        batch = builder.build()
        if tail:
            assert batch.query_start_loc.tolist() == [0, 9, 15, 15, 15, 15]
            assert batch.logit_rows.tolist() == [8, 14, -1, -1, -1]
        c = ModelCaches.allocate(TINY, alloc.pool_blocks)
        results.append(prefill(batch, batch.token_ids, weights, c))
        caches.append(c)
    short, long = results
    # the same rows and the same blocks (the tail requests map none), so the same sums: within the order bound
    assert_close(long.hidden, short.hidden, order_atol(short.hidden, forward_reductions(TINY)), "hidden rows")
    np.testing.assert_array_equal(long.sampled[:2], short.sampled)
    assert long.sampled[2:].tolist() == [-1, -1, -1]
    for got, want in zip(_snapshot(caches[1]), _snapshot(caches[0]), strict=True):
        np.testing.assert_array_equal(got, want)


def test_builder_refuses_an_empty_step_without_the_option():
    builder = BatchBuilder(TINY, PaddingPolicy(), BlockAllocator(TINY, POOLS))
    builder.add(0, num_cached=0, num_new=0)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert "qsl.token_count" in err.value.codes
