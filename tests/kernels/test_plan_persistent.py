"""The reference kernels on the persistent form (spec 5.9): a step built with ``build_step`` and planned over the
persistent tables (``BatchPlan.from_step``: every slot, ring tables RW_p wide, ``table_row = table_slots[request]``)
gives bit for bit the outputs and cache writes of the same step built with ``build()`` and planned over its own
narrow tables, for the whole group and for every rank's plan (the plans a threads TP group runs)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_abi import ABIError, BatchBuilder, PaddingPolicy
from dspark_abi.presets import TINY
from dspark_kernels import LayerCaches
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import prepared_for
from dspark_kernels.reference.attention import attend

from .conftest import hidden_rows, new_allocator, sequence


def _layers(plan, x, caches, weights):
    return [attend(plan, layer, x, prepared_for(weights[layer], "fp32", None), caches[layer])
            for layer in range(TINY.num_layers)]


def _queue(builder, requests):
    for rid, cached, new in requests:
        builder.add(rid, cached, new)


@pytest.mark.parametrize("tp", [1, 2])
def test_reference_layers_on_the_persistent_form_equal_the_full_form(tiny_weights, tp):
    alloc = new_allocator()
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp), alloc)
    seqs = {rid: sequence(rid, 600) for rid in range(4)}
    caches = {layer: LayerCaches.allocate(TINY, layer, alloc.pool_blocks) for layer in range(TINY.num_layers)}
    steps = [[(0, 0, 150), (1, 0, 40), (2, 0, 131)],                 # boundaries of both ratios
             [(0, 150, 70), (2, 131, 140), (3, 0, 33)],              # rings continue, a new request claims a slot
             [(0, 220, 190), (1, 40, 9), (3, 33, 100)]]              # ori pages leave the window: released cells
    for requests in steps:
        _queue(builder, requests)
        batch = builder.build()
        _queue(builder, requests)
        step = builder.build_step()
        mirror = alloc.persistent.copy()       # a device mirror: the delta applied before the forward reads it
        mirror.apply(step)
        x = hidden_rows(batch, seqs)
        for rank in [None, *range(tp)]:
            plan = BatchPlan.from_step(step, mirror, rank=rank)
            assert plan.tables["ori"].shape[1] == TINY.layout.pools["ori"].ring_width
            np.testing.assert_array_equal(plan.table_row, np.where(batch.row_request >= 0,
                                                                   step.table_slots[batch.row_request], -1))
            mine = {layer: c.copy() for layer, c in caches.items()}
            theirs = {layer: c.copy() for layer, c in caches.items()}
            want = _layers(BatchPlan.build(batch, rank=rank), x, mine, tiny_weights)
            got = _layers(plan, x, theirs, tiny_weights)
            for layer, (a, b) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_array_equal(a, b, err_msg=f"layer {layer} rank {rank}")
            for layer in caches:
                for pool in TINY.layout.pools:
                    np.testing.assert_array_equal(getattr(theirs[layer], pool), getattr(mine[layer], pool))
        _layers(BatchPlan.build(batch), x, caches, tiny_weights)      # the step's writes, for the next step
        builder.commit(step)


def test_a_plan_of_a_step_needs_current_slots():
    alloc = new_allocator()
    builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
    builder.add(0, 0, 20)
    builder.commit(builder.build_step())
    builder.add(0, 20, 5)
    step = builder.build_step()
    alloc.release(0)                           # the slot's generation advances
    with pytest.raises(ABIError) as err:
        BatchPlan.from_step(step, alloc.persistent)
    assert err.value.codes == {"tables.stale_slot"}
