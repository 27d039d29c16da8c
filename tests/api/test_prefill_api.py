"""`dspark_kernels.prefill`: validates everything first, leaves caches and inputs bit-for-bit unchanged on
any error (including a backend failing half-way), and returns per-request views."""

import attrs
import numpy as np
import pytest
from tolerances import assert_close, forward_reductions, order_atol

import dspark_kernels.api as prefill_module
from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.presets import FLASH, TINY
from dspark_kernels.api import prefill
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.weights import ModelWeights


@pytest.fixture(scope="module")
def weights():
    return ModelWeights.random(TINY, seed=3)


def _setup(tp=2):
    alloc = BlockAllocator(TINY, pool_blocks_for(TINY, [40, 20]))
    caches = ModelCaches.allocate(TINY, alloc.pool_blocks)
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp), alloc)
    rng = np.random.default_rng(0)
    builder.add(0, num_cached=0, num_new=7, token_ids=rng.integers(0, TINY.vocab_size, 7))
    builder.add(1, num_cached=0, num_new=6, token_ids=rng.integers(0, TINY.vocab_size, 6))
    return builder.build(), caches


def _state(caches):
    return {k: v.copy() for k, v in caches.arrays().items()}


def _assert_unchanged(caches, before):
    after = caches.arrays()
    assert set(after) == set(before)
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)


def test_result_and_per_request_views(weights):
    batch, caches = _setup()
    res = prefill(batch, batch.token_ids, weights, caches)
    assert res.hidden.shape == (batch.padded_rows, TINY.hidden_size)
    assert np.all(res.hidden[batch.num_tokens:] == 0)
    reqs = res.requests
    assert [r.positions.tolist() for r in reqs] == [list(range(7)), list(range(6))]
    assert reqs[1].sampled == int(res.sampled[1]) == int(np.argmax(res.logits[1]))


def test_padding_hidden_rows_rejected_and_nothing_written(weights):
    batch, caches = _setup()
    before = _state(caches)
    hidden = np.zeros((batch.padded_rows, TINY.hidden_size), np.float32)
    hidden[-1, 0] = 1.0  # padding row not zero
    with pytest.raises(ABIError) as err:
        prefill(batch, hidden, weights, caches, layers=[1, 2, 3])
    assert "padding.hidden" in err.value.codes
    _assert_unchanged(caches, before)


def test_padding_hidden_check_matches_the_validator(weights):
    """prefill checks the padding rows of ``hidden`` itself: the validator's issue, and no padding rows at all is
    fine (regression: the direct check once failed on a batch without padding)."""
    from dspark_abi import validate

    batch, caches = _setup()
    hidden = np.zeros((batch.padded_rows, TINY.hidden_size), np.float32)
    hidden[-1, 0] = 1.0
    issues = prefill_module._padding_hidden_issues(batch, hidden)
    assert issues == [i for i in validate(batch, hidden=hidden).issues if i.code == "padding.hidden"]
    unpadded, caches = _setup(tp=1)
    assert unpadded.padded_rows == unpadded.num_tokens
    x = np.random.default_rng(1).standard_normal((unpadded.padded_rows, TINY.hidden_size)).astype(np.float32)
    assert prefill(unpadded, x, weights, caches, layers=[0]).hidden.shape == x.shape


@pytest.mark.parametrize("bad", ["nan_hidden", "wrong_rows", "pad_token", "backend", "layers"])
def test_bad_inputs_raise_before_touching_anything(weights, bad):
    batch, caches = _setup()
    before = _state(caches)
    inputs = batch.token_ids.copy()
    kwargs = {}
    if bad == "nan_hidden":
        inputs = np.full((batch.padded_rows, TINY.hidden_size), np.nan, np.float32)
        kwargs["layers"] = [1]
    elif bad == "wrong_rows":
        inputs = inputs[:-1]
    elif bad == "pad_token":
        inputs[-1] = 5
    elif bad == "backend":
        kwargs["backend"] = "cuda"
    elif bad == "layers":
        kwargs["layers"] = [0, 9]
    snapshot = inputs.copy()
    with pytest.raises(ABIError):
        prefill(batch, inputs, weights, caches, **kwargs)
    _assert_unchanged(caches, before)
    np.testing.assert_array_equal(inputs, snapshot)


def test_caches_and_weights_from_another_config_rejected(weights):
    batch, caches = _setup()
    before = _state(caches)
    other = ModelCaches.allocate(TINY, {p: b + 1 for p, b in batch.pool_blocks.as_dict().items()})
    with pytest.raises(ABIError) as err:
        prefill(batch, batch.token_ids, weights, other)
    assert "config.mismatch" in err.value.codes
    flash_weights = ModelWeights.random(FLASH, seed=0)
    with pytest.raises(ABIError) as err:
        prefill(batch, batch.token_ids, flash_weights, caches)
    assert "config.mismatch" in err.value.codes
    _assert_unchanged(caches, before)


def test_backend_failure_half_way_restores_every_written_row(weights, monkeypatch):
    batch, caches = _setup()
    before = _state(caches)
    real = prefill_module.run_forward

    def fails_after_two_layers(batch, inputs, weights, caches, options):
        real(batch, inputs, weights, caches, attrs.evolve(options, layers=[0, 1]))  # really writes layers 0 and 1
        raise RuntimeError("device lost")

    monkeypatch.setattr(prefill_module, "run_forward", fails_after_two_layers)
    with pytest.raises(RuntimeError, match="device lost"):
        prefill(batch, batch.token_ids, weights, caches)
    _assert_unchanged(caches, before)


def test_same_result_twice_from_same_state(weights):
    batch, caches = _setup()
    copy = caches.copy()
    a = prefill(batch, batch.token_ids, weights, caches)
    b = prefill(batch, batch.token_ids, weights, copy)
    np.testing.assert_array_equal(a.logits, b.logits)


def test_pool_exhaustion_mid_run_leaves_caches_and_tables_intact(weights):
    """A serving loop whose pools run out on the second chunk: the step is refused before any kernel runs,
    caches keep exactly the first chunk's rows, and after freeing a finished request the step succeeds with
    the same result as a run with roomy pools."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, TINY.vocab_size, 80)
    other = rng.integers(0, TINY.vocab_size, 60)

    def step(builder, caches, rid, cached, ids):
        builder.add(rid, num_cached=cached, num_new=len(ids), token_ids=ids)
        batch = builder.build()
        result = prefill(batch, batch.token_ids, weights, caches)
        builder.commit(batch)
        return result

    roomy = BlockAllocator(TINY, pool_blocks_for(TINY, [80, 60], slack=64))
    roomy_caches = ModelCaches.allocate(TINY, roomy.pool_blocks)
    b = BatchBuilder(TINY, PaddingPolicy(), roomy)
    step(b, roomy_caches, 1, 0, other)
    step(b, roomy_caches, 0, 0, prompt[:40])
    expected = step(b, roomy_caches, 0, 40, prompt[40:])

    # the same sizes, except that ori holds just the first two steps' window pages (2 + 2 blocks): the third step
    # needs ori page 2 (positions 64..79) while page 0 is still inside position 40's window, so it is refused
    tight = BlockAllocator(TINY, attrs.evolve(roomy.pool_blocks, ori=4))
    caches = ModelCaches.allocate(TINY, tight.pool_blocks)
    b = BatchBuilder(TINY, PaddingPolicy(), tight)
    step(b, caches, 1, 0, other)
    step(b, caches, 0, 0, prompt[:40])
    assert tight.free_blocks("ori") == 0
    before = _state(caches)
    free_before = {p: tight.free_blocks(p) for p in ("ori", "csa_cmp", "hca_cmp", "idx", "csa_state")}
    with pytest.raises(ABIError) as err:
        step(b, caches, 0, 40, prompt[40:])
    assert "alloc.exhausted" in err.value.codes
    _assert_unchanged(caches, before)
    assert {p: tight.free_blocks(p) for p in free_before} == free_before
    assert tight.cached_tokens(0) == 40
    tight.release(1)                                           # the finished request frees its blocks
    b.clear()
    result = step(b, caches, 0, 40, prompt[40:])
    # other physical blocks only reorder the keys a tile sums over (the tile's key union is sorted by physical
    # row): two summation orders along the forward's reduction chain, within eps32 * sqrt(K) * max|ref|
    assert_close(result.hidden, expected.hidden, order_atol(expected.hidden, forward_reductions(TINY)),
                 "hidden after a refused and retried step")


@pytest.mark.parametrize("layers", [[1.5], ["1"], 3, [True], [np.float64(2.0)]], ids=repr)
def test_non_integer_layers_are_coded_before_anything_is_touched(weights, layers):
    batch, caches = _setup()
    before = _state(caches)
    with pytest.raises(ABIError) as err:
        prefill(batch, batch.token_ids, weights, caches, layers=layers)
    assert err.value.codes == {"config.invalid"}
    assert err.value.issues[0].field == "layers"
    _assert_unchanged(caches, before)


def _cut(array, rows=10):
    return array[:rows].copy()


@pytest.mark.parametrize("damage", ["ori", "idx_scale", "csa_state", "layer_list", "layer_object"])
def test_cut_short_caches_are_coded_before_anything_is_touched(weights, damage):
    """A pool array replaced by a shorter one (or a missing layer) is an issue, not an IndexError half-way."""
    batch, caches = _setup()
    if damage == "layer_list":
        del caches.layers[-1]
        field, code = "caches.layers", "array.shape"
    elif damage == "layer_object":
        caches.layers[2] = caches.layers[1]  # layer 1's pools where layer 2's belong
        field, code = "caches.layers.2", "config.mismatch"
    else:
        layer = {"ori": 1, "idx_scale": 3, "csa_state": 1}[damage]
        setattr(caches.layers[layer], damage, _cut(getattr(caches.layers[layer], damage)))
        field, code = f"caches.layers.{layer}.{damage}", "array.shape"
    before = _state(caches)
    with pytest.raises(ABIError) as err:
        prefill(batch, batch.token_ids, weights, caches)
    assert err.value.codes == {code}
    assert [i.field for i in err.value.issues] == [field]
    _assert_unchanged(caches, before)


def test_pypto_index_range_is_checked_before_anything_is_touched(weights):
    """The pypto kernels index in fp32: an ori pool of more than 2**24 rows is refused up front."""
    big = dict(pool_blocks_for(TINY, [40]).as_dict(), ori=2**24 // 32 + 1)
    builder = BatchBuilder(TINY, PaddingPolicy(), BlockAllocator(TINY, big))
    builder.add(0, num_cached=0, num_new=7)
    batch = builder.build()
    caches = ModelCaches.allocate(TINY, pool_blocks_for(TINY, [40]), precision="a2a3")  # cannot hold 2**24 rows
    before = _state(caches)
    with pytest.raises(ABIError) as err:
        prefill(batch, np.zeros(batch.padded_rows, np.int64), weights, caches, backend="pypto", precision="a2a3")
    issue = next(i for i in err.value.issues if i.code == "kernel.index_range")
    assert issue.field == "ori_block_table" and issue.actual == 2**24 // 32
    _assert_unchanged(caches, before)


# ---------------------------------------------------------------------------------------------- persistent form
def _both_forms(tp=2):
    """One step of two requests after a first one (a ring continues, a new request takes a slot) in both forms:
    (full-form batch, persistent step, a mirror holding its delta, caches after the first step)."""
    alloc = BlockAllocator(TINY, pool_blocks_for(TINY, [80, 40, 40]))
    caches = ModelCaches.allocate(TINY, alloc.pool_blocks)
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp), alloc)
    rng = np.random.default_rng(1)
    tokens = {rid: rng.integers(0, TINY.vocab_size, 80) for rid in range(3)}
    first = [(0, 0, 40), (1, 0, 20)]
    second = [(0, 40, 30), (2, 0, 25)]
    for rid, cached, new in first:
        builder.add(rid, num_cached=cached, num_new=new, token_ids=tokens[rid][cached:cached + new])
    step = builder.build_step()
    mirror = alloc.persistent.copy()
    mirror.apply(step)
    prefill(step, step.token_ids, ModelWeights.random(TINY, seed=3), caches, tables=mirror)
    builder.commit(step)
    for queue in range(2):
        for rid, cached, new in second:
            builder.add(rid, num_cached=cached, num_new=new, token_ids=tokens[rid][cached:cached + new])
        if queue == 0:
            batch = builder.build()
    step = builder.build_step()
    mirror.apply(step)      # the device mirror, advanced by the delta alone across both steps
    return batch, step, mirror, caches


@pytest.mark.parametrize("tp", [1, 2])
def test_prefill_of_a_persistent_step_equals_the_full_form_bit_for_bit(weights, tp):
    batch, step, mirror, caches = _both_forms(tp)
    full_caches, pers_caches = caches.copy(), caches.copy()
    want = prefill(batch, batch.token_ids, weights, full_caches)
    got = prefill(step, step.token_ids, weights, pers_caches, tables=mirror)
    assert got.batch is step                      # the step's own rows (never its full form): the same views
    for mine, theirs in zip(got.requests, want.requests, strict=True):
        assert (mine.index, mine.request_id, mine.rows, mine.sampled) == \
            (theirs.index, theirs.request_id, theirs.rows, theirs.sampled)
        np.testing.assert_array_equal(mine.positions, theirs.positions)
    for name in ("hidden", "x_hc", "logits", "sampled", "logit_rows", "target_hidden"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for name, array in pers_caches.arrays().items():
        np.testing.assert_array_equal(array, full_caches.arrays()[name], err_msg=name)


def test_a_persistent_step_needs_its_tables_and_a_batch_none(weights):
    batch, step, mirror, caches = _both_forms()
    before = _state(caches)
    with pytest.raises(ABIError) as err:
        prefill(step, step.token_ids, weights, caches)
    assert err.value.codes == {"array.missing"} and err.value.issues[0].field == "tables"
    with pytest.raises(ABIError) as err:
        prefill(batch, batch.token_ids, weights, caches, tables=mirror)
    assert err.value.codes == {"config.invalid"}
    stale = mirror.copy()
    stale.release(int(step.table_slots[0]))       # the slot recycled since the step was built
    with pytest.raises(ABIError) as err:
        prefill(step, step.token_ids, weights, caches, tables=stale)
    assert "tables.stale_slot" in err.value.codes
    _assert_unchanged(caches, before)


def test_pypto_index_range_covers_the_persistent_tables_the_kernels_read(weights):
    """The pypto kernels flatten the table they read (entry ``row * width + column`` in fp32): the persistent tables
    (S slots x the ring width) can reach 2**24 entries where the step's narrow tables do not; the pre-check reads
    the plan's tables."""
    from dspark_kernels.model.plan import PlanSource
    from dspark_kernels.pypto.backend import PyptoBackend

    _, step, mirror, _ = _both_forms()
    source = PlanSource.of(step, mirror)
    layers = list(range(TINY.num_layers))
    assert PyptoBackend().batch_issues(source.batch, layers, source.read_tables()) == []
    pl = TINY.layout.pools["ori"]
    slots = 2**24 // pl.ring_width + 1                            # just past the fp32-exact flattened entry
    wide = dict(source.read_tables()) | {"ori": np.broadcast_to(np.int32(-1), (slots, pl.ring_width))}
    assert PyptoBackend().batch_issues(step.to_full(mirror), layers) == []  # the narrow tables alone pass
    issues = PyptoBackend().batch_issues(source.batch, layers, wide)
    assert [i.field for i in issues if i.code == "kernel.index_range"] == ["ori_block_table"]
