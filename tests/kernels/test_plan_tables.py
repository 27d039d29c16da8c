"""Every kernel table lookup goes through the plan's ``tables[pool][table_row[rows], column]``.

A plan may carry tables other than the batch's (a serving loop's persistent tables: one row per request slot,
any width). Handing every layer such tables, with the same pages mapped in other rows and at other widths, must
give bit-for-bit the outputs and cache writes of the batch's own tables: a kernel that read ``batch.tables``,
indexed a table by the request instead of its table row, or took the width from the step would differ.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_abi import ABIError, PackedBatch
from dspark_abi.layout import table_column, touched_pages
from dspark_abi.presets import TINY
from dspark_kernels import LayerCaches
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import prepared_for
from dspark_kernels.reference.attention import attend

from .conftest import build, hidden_rows, new_allocator, sequence

#: Extra rows and columns of the persistent tables (free slots and ring columns the step never reads).
EXTRA_ROWS, EXTRA_COLUMNS = 3, 5


def _persistent(batch: PackedBatch, slot: np.ndarray) -> dict[str, np.ndarray]:
    """The batch's mappings of every page the step touches, moved to row ``slot[r]`` of tables EXTRA_COLUMNS
    wider (ring pools: page ``i`` in column ``i % W_t``); every other entry unmapped (-1)."""
    requests = batch.requests
    start = requests.first_position
    end = start + requests.lengths
    out = {}
    for pool, table in batch.tables.items():
        pl = TINY.layout.pools[pool]
        wide = np.full((slot.max() + 1 + EXTRA_ROWS, table.shape[1] + EXTRA_COLUMNS), -1, np.int32)
        r, page = touched_pages(pl, start, end, TINY.sliding_window)
        wide[slot[r], table_column(pl, page, wide.shape[1])] = table[r, table_column(pl, page, table.shape[1])]
        out[pool] = wide
    return out


def _run(batch: PackedBatch, plan: BatchPlan, x: np.ndarray, caches: dict[int, LayerCaches], weights
         ) -> list[np.ndarray]:
    return [attend(plan, layer, x, prepared_for(weights[layer], "fp32", None), caches[layer])
            for layer in range(TINY.num_layers)]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_plan_over_persistent_tables_reads_the_same_rows(tiny_weights, tp):
    alloc = new_allocator()
    seqs = {rid: sequence(rid, 400) for rid in range(3)}
    first = build(alloc, [(0, 0, 150), (1, 0, 40), (2, 0, 131)], tp=tp)   # boundaries of both ratios
    second = build(alloc, [(0, 150, 70), (1, 40, 0), (2, 131, 140)], tp=tp)  # chunks continuing the rings
    caches = {layer: LayerCaches.allocate(TINY, layer, first.pool_blocks) for layer in range(TINY.num_layers)}
    _run(first, BatchPlan.build(first), hidden_rows(first, seqs), caches, tiny_weights)

    x = hidden_rows(second, seqs)
    slot = np.array([4, 0, 2], np.int32)[:second.num_requests]   # not the request index, not in order
    theirs = {layer: c.copy() for layer, c in caches.items()}
    for rank in [None, *range(tp)]:
        own = BatchPlan.build(second, rank=rank)
        persistent = BatchPlan.build(second, rank=rank, tables=_persistent(second, slot), request_table_row=slot)
        assert persistent.tables["ori"].shape[0] != second.num_requests
        np.testing.assert_array_equal(persistent.table_row, np.where(second.row_request >= 0,
                                                                     slot[second.row_request], -1))
        mine = {layer: c.copy() for layer, c in caches.items()}
        want = _run(second, own, x, mine, tiny_weights)
        got = _run(second, persistent, x, theirs if rank is None else {k: c.copy() for k, c in caches.items()},
                   tiny_weights)
        for layer, (a, b) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"layer {layer} rank {rank}")
        if rank is None:
            for layer in caches:
                for pool in TINY.layout.pools:
                    np.testing.assert_array_equal(getattr(theirs[layer], pool), getattr(mine[layer], pool))


def test_a_plan_refuses_tables_that_do_not_fit():
    batch = build(new_allocator(), [(0, 0, 9), (1, 0, 5)])
    with pytest.raises(ABIError) as err:
        BatchPlan.build(batch, tables={"ori": batch.tables["ori"]})
    assert err.value.codes == {"array.shape"}
    with pytest.raises(ABIError) as err:
        BatchPlan.build(batch, request_table_row=np.array([0, batch.tables["ori"].shape[0]]))
    assert err.value.codes == {"array.shape"}
