"""Audit minors: the upstream round trip of fixed-width batches, coded errors for every invalid PaddingPolicy,
and a StepValidator whose memory follows the pools in use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.presets import TINY_1M
from dspark_abi.upstream import from_upstream, to_upstream

STEPS = [[(7, 0, 8000), (3, 0, 40)], [(7, 8000, 300), (3, 40, 0), (5, 0, 90)]]


def _build(ring_width: str, tp: int = 2):  # type: ignore[no-untyped-def]
    contexts = [8300, 40, 90]
    alloc = BlockAllocator(TINY_1M, pool_blocks_for(TINY_1M, contexts, slack=8))
    builder = BatchBuilder(TINY_1M, PaddingPolicy(tp_size=tp), alloc, ring_width=ring_width)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    for step in STEPS:
        for rid, cached, new in step:
            builder.add(rid, num_cached=cached, num_new=new, token_ids=rng.integers(1, TINY_1M.vocab_size, new))
        batch = builder.build()
    return batch


def _back(tensors, batch, **kw):  # type: ignore[no-untyped-def]
    return from_upstream(tensors, batch.config, batch.policy, batch.pool_blocks, request_ids=batch.request_ids, **kw)


@pytest.mark.parametrize("tp", [1, 3])
def test_round_trip_of_fixed_width_batches(tp):
    fixed, step = _build("fixed", tp), _build("step", tp)
    widths = {pl.name: pl.ring_width for pl in TINY_1M.layout if pl.is_ring}
    assert {p: fixed.tables[p].shape[1] for p in widths} == widths
    assert any(step.tables[p].shape[1] != w for p, w in widths.items())
    # why the width must be named: both builder modes give the same upstream tensors
    up_fixed, up_step = to_upstream(fixed), to_upstream(step)
    assert all(np.array_equal(up_fixed[k], up_step[k]) for k in up_fixed)
    assert _back(up_fixed, fixed, ring_widths="fixed") == fixed
    assert _back(up_step, step) == step == _back(up_step, step, ring_widths="step")


def test_an_unknown_ring_width_word_is_a_coded_error():
    batch = _build("step")
    with pytest.raises(ABIError) as err:
        _back(to_upstream(batch), batch, ring_widths="wide")
    assert err.value.codes == {"config.invalid"}


@pytest.mark.parametrize("kwargs", [
    {"allow_inactive": True, "allow_empty_requests": False},
    {"tp_size": 0}, {"tp_size": 65}, {"tp_size": 2.0}, {"token_cap": 0}, {"pad_slot": 0}, {"pad_request_id": 3},
    {"pad_position": "last"}, {"pad_token_id": -1}, {"allow_inactive": "yes"}, {"bogus": 1},
])
def test_every_invalid_padding_policy_is_a_coded_abi_error(kwargs):
    with pytest.raises(ABIError) as err:
        PaddingPolicy(**kwargs)
    assert err.value.codes == {"config.invalid"}
    issue = err.value.issues[0]
    assert issue.field.startswith("PaddingPolicy") and issue.message, issue


def test_valid_padding_policies_still_build_and_compare():
    assert PaddingPolicy(tp_size=4, allow_inactive=True) == PaddingPolicy(tp_size=4, allow_inactive=True)
    assert PaddingPolicy.model_validate({"tp_size": 2}).tp_size == 2


#: Address space a StepValidator over the largest legal pools must fit in, with the interpreter and numpy.
ADDRESS_SPACE = 3 << 30


def test_step_validator_over_the_largest_legal_pools_fits_in_3_gib_of_address_space():
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, {ADDRESS_SPACE}))
        from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy
        from dspark_abi.allocator import pool_blocks_for
        from dspark_abi.incremental import StepValidator
        from dspark_abi.presets import FLASH
        largest = {{pl.name: (2**31 - 1) // pl.page_size for pl in FLASH.layout}}
        for ring_pools in ("exact", "tracked"):
            v = StepValidator(FLASH, PaddingPolicy(), largest, ring_pools=ring_pools)
            assert v.tracked_pools, v.tracked_pools
        # and a step through it still validates (its state covers the blocks the step uses)
        builder = BatchBuilder(FLASH, PaddingPolicy(), BlockAllocator(FLASH, pool_blocks_for(FLASH, [300])))
        builder.add(0, num_cached=0, num_new=300)
        batch = builder.build()
        for ring_pools in ("exact", "tracked"):
            v = StepValidator(FLASH, PaddingPolicy(), largest, ring_pools=ring_pools)
            assert v.validate(batch.to_arrays()).ok and v.validate(batch).ok
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_a_step_validator_that_cannot_grow_its_state_checks_exactly(monkeypatch):
    from dspark_abi import incremental
    from dspark_abi.validation import validate_arrays

    def no_memory(self, blocks):  # type: ignore[no-untyped-def]
        raise MemoryError

    batch = _build("step")
    v = incremental.StepValidator(TINY_1M, batch.policy, batch.pool_blocks, ring_pools="tracked")
    assert v.tracked_pools
    monkeypatch.setattr(incremental._BlockRefs, "cover", no_memory)
    report = v.validate(batch)
    assert report == validate_arrays(batch.to_arrays(), TINY_1M, batch.policy, batch.pool_blocks) and report.ok
    assert v.tracked_pools == ()
    v.reset()
    assert v.tracked_pools == () and v.validate(batch).ok
