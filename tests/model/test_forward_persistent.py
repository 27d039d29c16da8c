"""Whole TINY layers on the persistent form (spec 5.9): a step built with ``build_step`` and planned over the
persistent tables (``BatchPlan.from_step``) runs every layer bit for bit as the same step built with ``build()``,
for the whole group in one call and for a TP group of ranks running as threads (each rank its plan, the rows
joined by the in-process all-gather), outputs and every cache array alike."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dspark_abi import BatchBuilder
from dspark_abi.presets import TINY
from dspark_kernels.model.layer import run_layer
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.tp import ThreadGroup

from .conftest import Session, tokens_of


def _queue(builder, requests):
    for rid, cached, new in requests:
        builder.add(rid, num_cached=cached, num_new=new, token_ids=tokens_of(rid)[cached:cached + new])


def _layers(plans, x_hc, weights, replicas, token_ids):
    """Every layer, one thread per plan (a rank of the group) or inline for a single whole-group plan."""
    group = ThreadGroup(len(plans))
    out: list = [None] * len(plans)
    errors: list = []

    def work(r):
        try:
            x = x_hc.copy()
            for i in range(TINY.num_layers):
                x = run_layer(plans[r], i, x, weights.layer(i), replicas[r][i], token_ids=token_ids,
                              all_gather=group.gatherer(r) if plans[r].rank is not None else None)
            out[r] = x
        except BaseException as exc:
            errors.append(exc)
            group.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_layers_on_the_persistent_form_equal_the_full_form(tp):
    s = Session(tp=tp)
    s.batch([(0, 0, 150), (1, 0, 40), (2, 0, 131)])          # history written by the full form
    builder = BatchBuilder(TINY, s.policy, s.alloc)
    for requests in ([(0, 150, 70), (2, 131, 140), (3, 0, 33)], [(0, 220, 190), (1, 40, 9), (3, 33, 100)]):
        _queue(builder, requests)
        batch = builder.build()
        _queue(builder, requests)
        step = builder.build_step()
        mirror = s.alloc.persistent.copy()
        mirror.apply(step)                                     # the device mirror: the delta before the forward
        x_hc = np.repeat(s.weights.embed_rows(batch.token_ids)[:, None, :], TINY.hc_mult, axis=1)
        x_hc[batch.row_request < 0] = 0.0
        ranks = [None] if tp == 1 else list(range(tp))
        for ranks_run in ([None], ranks):
            full = [s.caches.copy() for _ in ranks_run]
            pers = [s.caches.copy() for _ in ranks_run]
            want = _layers([BatchPlan.build(batch, rank=r) for r in ranks_run], x_hc, s.weights, full,
                           batch.token_ids)
            got = _layers([BatchPlan.from_step(step, mirror, rank=r) for r in ranks_run], x_hc, s.weights, pers,
                          batch.token_ids)
            for r, (a, b) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {ranks_run[r]}")
            for layer in range(TINY.num_layers):
                for pool, arr in pers[0][layer].arrays().items():
                    np.testing.assert_array_equal(arr, full[0][layer].arrays()[pool], err_msg=f"{layer} {pool}")
        _layers([BatchPlan.build(batch)], x_hc, s.weights, [s.caches], batch.token_ids)   # the step's writes
        builder.commit(step)
