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


def _plan_bytes(plan: BatchPlan) -> int:
    """Bytes of every array a plan holds of its own (its tables are the caller's and not counted)."""
    import attrs

    def arrays(value):
        if isinstance(value, np.ndarray):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from arrays(v)
        elif attrs.has(type(value)):
            for f in attrs.fields(type(value)):
                yield from arrays(getattr(value, f.name))

    return sum(a.nbytes for f in attrs.fields(BatchPlan) if f.name not in ("batch", "tables")
               for a in arrays(getattr(plan, f.name)))


def test_a_plan_does_not_grow_with_the_context():
    """A verify step's plan holds O(rows) of its own, whatever the depth: the same 16 x 4 verify rows at contexts
    near 100K and near 900K (1M-position TINY heads) give plans of equal size. (Until 1.4 a plan materialised every
    row's visible compressed entries: [rows, up to 262,144] int64, 9 times larger at the deeper contexts.) The
    tile a kernel reads is still derived on demand and equals the visible entries through the request's table."""
    from dspark_abi import BlockAllocator
    from dspark_abi.allocator import pool_blocks_for
    from dspark_abi.layout import physical_rows, visible_entries
    from dspark_abi.presets import TINY_1M
    from dspark_kernels.model.plan import PlanSource

    config = TINY_1M.model_copy(update={"name": "tiny-1m-k3", "dspark_block_size": 3})
    sizes = []
    for depth in (100_000, 900_000):
        contexts = np.arange(16, dtype=np.int64) * 37 + depth
        alloc = BlockAllocator(config, pool_blocks_for(config, [int(c) + 8 for c in contexts], slack=2))
        alloc.commit(alloc.plan(list(range(16)), contexts, contexts))        # deep histories, no compute
        builder = BatchBuilder(config, PaddingPolicy(tp_size=2), alloc)
        builder.add_verify_many(list(range(16)), contexts, np.full(16, 4), np.zeros(64, np.int64))
        step = builder.build_step()
        builder.commit(step, accepted=np.full(16, 4))
        plan = PlanSource.of(step, alloc.persistent).plan()
        sizes.append(_plan_bytes(plan))
        lo, hi = 8, 12                                                       # rows of requests 2 and 3
        rows = plan.entry_rows_in("idx", lo, hi)
        visible = visible_entries(plan.positions[lo:hi], 4)
        assert rows.shape == (hi - lo, int(visible.max()))
        c = np.arange(rows.shape[1])[None, :]
        want = physical_rows(alloc.persistent.table("idx"), plan.table_row[lo:hi],
                             np.where(c < visible[:, None], c, -1), 32, ring=False)
        np.testing.assert_array_equal(rows, want)
        assert (rows[:, :int(visible.min())] >= 0).all()                      # the history is mapped
    assert sizes[0] == sizes[1], sizes
