"""The reference kernels at the model's real depth: TINY heads with 1,048,576-position tables (``tiny-1m``).

Requests continue after cached contexts far beyond upstream's 16,384 positions and beyond several turns of
the ring tables (ori holds 258 pages = 8,256 positions, the ratio-4 state rings 4,101 pages = 8,202). Prefilling
such a history through the kernels would take minutes, so the history is *planted*: the allocator maps what a
request at that depth holds (its reach of ori and state rows, its whole compressed history) and those rows get
deterministic values keyed by (request, pool, logical index), the same whatever block holds them. Packed ==
alone and chunked == one-shot then compare two runs over the same logical history.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from tolerances import attention_reductions, order_rel

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.layout import live_range, physical_rows
from dspark_abi.presets import TINY, TINY_1M
from dspark_kernels import AttentionWeights, LayerCaches, attention

from .conftest import clone, logical_rows, rel_err, written_by

DEEP = TINY_1M
#: two summation orders along an attention call's reduction chain (tests/tolerances.py)
FP32_TOL = order_rel(attention_reductions(DEEP))
#: pools each layer kind writes (idx_scale is checked with idx)
WRITTEN = {"swa": ("ori",), "csa": ("ori", "csa_cmp", "idx", "csa_state", "csa_inner_state"),
           "hca": ("ori", "hca_cmp", "hca_state")}
#: cached contexts: past 16,384 and past several ring turns; HCA layers go deeper (their history is short)
CONTEXTS = {"swa": (300_001, 40_000), "csa": (20_003, 33_333), "hca": (700_000, 123_457)}


@pytest.fixture(scope="module")
def deep_weights() -> dict[int, AttentionWeights]:
    return {layer: AttentionWeights.random(DEEP, layer, seed=7) for layer in range(TINY.num_layers)}


def planted(layer: int, contexts: dict[int, int]) -> tuple[BlockAllocator, LayerCaches]:
    """Allocator and caches of requests ``rid -> cached tokens`` whose history rows hold planted values."""
    kind = DEEP.layer_kind(layer)
    blocks = pool_blocks_for(DEEP, [c + 600 for c in contexts.values()], slack=64)
    alloc = BlockAllocator(DEEP, blocks)
    ids, cached = list(contexts), np.array(list(contexts.values()), dtype=np.int64)
    alloc.commit(alloc.plan(ids, cached, cached))        # what requests at these depths hold, nothing new
    caches = LayerCaches.allocate(DEEP, layer, blocks)
    tables = alloc.table_rows(ids)
    for i, rid in enumerate(ids):
        for pool in WRITTEN[kind]:
            pl = DEEP.layout.pools[pool]
            lo, hi = live_range(pl, cached[i:i + 1], cached[i:i + 1] + 1, DEEP.sliding_window)
            logical = np.arange(int(lo[0]), int(hi[0]) - (0 if pl.ratio else 1))   # history only: < cached
            rows = physical_rows(tables[pool], np.full(logical.size, i), logical, pl.page_size, ring=pl.is_ring)
            if (rows < 0).any():
                raise AssertionError(f"{pool}: the allocator did not map the history of request {rid}")
            pool_array = getattr(caches, pool)
            rng = np.random.default_rng([rid, zlib.crc32(pool.encode()), int(logical[0]) if logical.size else 0])
            if pool == "idx":
                pool_array[rows] = rng.integers(-127, 128, (logical.size, *pool_array.shape[1:]), dtype=np.int8)
                caches.idx_scale[rows] = rng.uniform(0.01, 0.02, logical.size).astype(caches.idx_scale.dtype)
            else:
                pool_array[rows] = rng.standard_normal((logical.size, *pool_array.shape[1:])).astype(pool_array.dtype)
    return alloc, caches


def step(alloc: BlockAllocator, requests: list[tuple[int, int, int]], tp: int):
    builder = BatchBuilder(DEEP, PaddingPolicy(tp_size=tp), alloc)
    for rid, cached, new in requests:
        builder.add(rid, num_cached=cached, num_new=new)
    batch = builder.build()
    builder.commit(batch)
    return batch


def hidden(batch, seed: int = 0) -> np.ndarray:
    """x [P, hidden]: a row's values depend only on (request id, position), so every run sees the same input."""
    x = np.zeros((batch.padded_rows, DEEP.hidden_size), dtype=np.float32)
    live = np.flatnonzero(batch.row_request >= 0)
    ids = batch.request_ids[batch.row_request[live]]
    for i, rid, pos in zip(live.tolist(), ids.tolist(), batch.positions[live].tolist(), strict=True):
        x[i] = np.random.default_rng([seed, rid, pos]).standard_normal(DEEP.hidden_size, dtype=np.float32)
    return x


@pytest.mark.parametrize("layer", range(TINY.num_layers))
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_equals_alone_beyond_16k(layer, tp, deep_weights):
    kind = DEEP.layer_kind(layer)
    deep, mid = CONTEXTS[kind]
    contexts = {0: deep, 1: mid, 2: 5}
    requests = [(0, deep, 37), (1, mid, 70), (2, 5, 20)]
    alloc, caches = planted(layer, contexts)
    a_p, c_p = clone(alloc, caches)
    packed = step(a_p, requests, tp)
    assert packed.positions.max() > 16_384
    out_p = attention(packed, layer, hidden(packed), deep_weights[layer], c_p)
    for i, (rid, cached, new) in enumerate(requests):
        a_a, c_a = clone(alloc, caches)
        alone = step(a_a, [(rid, cached, new)], tp)
        out_a = attention(alone, layer, hidden(alone), deep_weights[layer], c_a)
        assert rel_err(out_p[packed.row_request == i], out_a[alone.row_request == 0]) <= FP32_TOL, rid
        for pool in WRITTEN[kind]:
            lp, rp = written_by(packed, i, pool)
            la, ra = written_by(alone, 0, pool)
            np.testing.assert_array_equal(lp, la)
            assert rel_err(getattr(c_p, pool)[rp].astype(np.float32),
                           getattr(c_a, pool)[ra].astype(np.float32)) <= FP32_TOL, pool


@pytest.mark.parametrize("layer", range(TINY.num_layers))
@pytest.mark.parametrize("cuts", [(1,), (90, 91), (33, 150)])
def test_chunked_equals_one_shot_beyond_16k(layer, cuts, deep_weights):
    kind = DEEP.layer_kind(layer)
    cached, n = CONTEXTS[kind][0], 200
    alloc, caches = planted(layer, {0: cached})
    a1, c1 = clone(alloc, caches)
    one = step(a1, [(0, cached, n)], 1)
    out_one = attention(one, layer, hidden(one), deep_weights[layer], c1)
    a2, c2 = clone(alloc, caches)
    outs, batch = [], None
    for lo, hi in zip((0, *cuts), (*cuts, n), strict=True):
        batch = step(a2, [(0, cached + lo, hi - lo)], 1)
        outs.append(attention(batch, layer, hidden(batch), deep_weights[layer], c2)[batch.row_request == 0])
    assert rel_err(np.concatenate(outs), out_one[one.row_request == 0]) <= FP32_TOL
    end = cached + n
    for pool in WRITTEN[kind]:        # the caches hold the same values at every logical row they keep
        pl = DEEP.layout.pools[pool]
        lo, hi = live_range(pl, np.array([end]), np.array([end + 1]), DEEP.sliding_window)
        logical = np.arange(max(int(lo[0]), cached // pl.ratio if pl.ratio else cached),
                            int(hi[0]) - (0 if pl.ratio else 1))
        want, got = logical_rows(one, 0, pool, logical), logical_rows(batch, 0, pool, logical)
        assert (want >= 0).all() and (got >= 0).all(), pool
        assert rel_err(getattr(c2, pool)[got].astype(np.float32),
                       getattr(c1, pool)[want].astype(np.float32)) <= FP32_TOL, pool


@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_the_planted_history_is_what_deep_queries_read(layer, deep_weights):
    """Two runs agreeing proves nothing if both miss the history (e.g. a table looked up without the ring
    modulo finds no block past its width): changing each pool's planted history must change the output."""
    kind = DEEP.layer_kind(layer)
    cached = CONTEXTS[kind][0]
    alloc, caches = planted(layer, {0: cached})
    a0, c0 = clone(alloc, caches)
    batch = step(a0, [(0, cached, 64)], 1)
    base = attention(batch, layer, hidden(batch), deep_weights[layer], c0)
    for pool in WRITTEN[kind]:
        a1, c1 = clone(alloc, caches)
        history = getattr(c1, pool)
        if pool == "idx":
            history[:] = -history                        # other keys: another top-k choice
        else:
            history *= 2
        again = step(a1, [(0, cached, 64)], 1)
        out = attention(again, layer, hidden(again), deep_weights[layer], c1)
        # the state history feeds the first compressed entries of the step, which CSA's top-k may not pick:
        # what the step wrote to the compressed pools counts as read too
        changed = [np.abs(out - base).max() > 0]
        for written in {"csa": ("csa_cmp", "idx"), "hca": ("hca_cmp",)}.get(kind, ()):
            rows = written_by(batch, 0, written)[1]
            changed.append(not np.array_equal(getattr(c1, written)[rows], getattr(c0, written)[rows]))
        assert any(changed), f"layer {layer}: the {pool} history at depth {cached} is not read"
