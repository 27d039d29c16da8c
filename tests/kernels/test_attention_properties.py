"""Request isolation properties of `attention` on TINY: packed == alone, chunked == one-shot, isolation,
TP rank views, padding rows.

Tolerances. fp32 results differ between two batch layouts only through summation order (a row's offset
inside a matmul block changes the kernel path): normwise within eps32 * sqrt(K), K = attention_reductions(TINY)
= 1584 summed reduction lengths from input row to output and cache rows (tests/tolerances.py), so FP32_TOL =
4.7e-6; cache rows lie on prefixes of that chain. Measured <= 1.2e-6 (0.26 of the bound) over 4 OpenBLAS
kernels, 1-2 threads and the thorough hypothesis profile; a foreign or stale row moves results by O(1).
In a2a3 such an fp32 ulp can flip one bf16 or int8 rounding downstream: measured <= 3.0e-3 on SWA and HCA
layers (one flipped bf16 rounding; a bf16 ulp is up to 2^-7 of the value), bounded by A2A3_TOL = 2^-6 (two
bf16 ulps of the largest element). On CSA layers a flipped int8 rounding can reorder two near-tied indexer
scores and change a top-k set, so a2a3 CSA layouts are not compared (top-k sets are compared only in fp32,
as upstream's tests do).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tolerances import attention_reductions, order_rel

from dspark_abi.presets import TINY
from dspark_kernels import LayerCaches, attention

from .conftest import TINY_POOLS, build, clone, hidden_rows, logical_rows, new_allocator, rel_err, sequence, written_by

FP32_TOL = order_rel(attention_reductions(TINY))
A2A3_TOL = 2.0**-6
TOL = {"fp32": FP32_TOL, "a2a3": A2A3_TOL}
#: Pools whose rows a call writes, per layer kind (idx_scale is checked with idx).
WRITTEN = {"swa": ("ori",), "csa": ("ori", "csa_cmp", "idx", "csa_state", "csa_inner_state"),
           "hca": ("ori", "hca_cmp", "hca_state")}


def with_history(layer, weights, requests, seqs, precision="fp32"):
    """Allocator and caches after one step that prefilled every request's cached tokens."""
    alloc = new_allocator()
    caches = LayerCaches.allocate(TINY, layer, TINY_POOLS, precision)
    history = [(rid, 0, cached) for rid, cached, _ in requests if cached]
    if history:
        batch = build(alloc, history)
        attention(batch, layer, hidden_rows(batch, seqs), weights, caches, precision=precision)
    return alloc, caches


def cache_values(caches, batch, request, pool):
    logical, rows = written_by(batch, request, pool)
    order = np.argsort(logical)
    values = getattr(caches, pool)[rows[order]].astype(np.float32)
    if pool == "idx":
        values = np.concatenate([values, caches.idx_scale[rows[order]][:, None]], axis=1)
    return logical[order], values


@st.composite
def packed_cases(draw):
    layer = draw(st.sampled_from(range(TINY.num_layers)))
    n_req = draw(st.integers(2, 4))
    cached = draw(st.lists(st.integers(0, 200), min_size=n_req, max_size=n_req))
    new = draw(st.lists(st.integers(0, 45), min_size=n_req, max_size=n_req).filter(lambda v: sum(v) > 0))
    tp = draw(st.sampled_from([1, 2, 4]))
    pad = draw(st.sampled_from(["zero", "continue"]))
    precision = draw(st.sampled_from(["fp32", "fp32", "a2a3"] if TINY.layer_kind(layer) != "csa" else ["fp32"]))
    return layer, [(rid, c, n) for rid, (c, n) in enumerate(zip(cached, new, strict=True))], tp, pad, precision


@given(case=packed_cases())
def test_packed_equals_alone(case, tiny_weights):
    """Each request's output rows and written cache rows equal running it alone from the same caches."""
    layer, requests, tp, pad, precision = case
    seqs = {rid: sequence(rid, c + n) for rid, c, n in requests}
    alloc, caches = with_history(layer, tiny_weights[layer], requests, seqs, precision)
    a_p, c_p = clone(alloc, caches)
    packed = build(a_p, requests, tp, pad)
    out_p = attention(packed, layer, hidden_rows(packed, seqs), tiny_weights[layer], c_p, precision=precision)
    for i, (rid, cached, new) in enumerate(requests):
        if new == 0:
            continue
        a_a, c_a = clone(alloc, caches)
        alone = build(a_a, [(rid, cached, new)], tp, pad)
        out_a = attention(alone, layer, hidden_rows(alone, seqs), tiny_weights[layer], c_a, precision=precision)
        assert rel_err(out_p[packed.row_request == i], out_a[alone.row_request == 0]) <= TOL[precision]
        for pool in WRITTEN[TINY.layer_kind(layer)]:
            lp, vp = cache_values(c_p, packed, i, pool)
            la, va = cache_values(c_a, alone, 0, pool)
            np.testing.assert_array_equal(lp, la)
            assert rel_err(vp, va) <= TOL[precision], pool


def logical_state(caches, batch, request, length):
    """Cache contents of one request by logical index after it reached ``length`` tokens."""
    layout = TINY.layout.pools
    out = {}
    for pool in WRITTEN[caches.kind]:
        pl = layout[pool]
        lo = max(0, length - pl.reach) if pl.is_ring else 0   # ring pools keep only their reach
        hi = length // pl.ratio if pl.ratio else length
        rows = logical_rows(batch, request, pool, np.arange(lo, hi))
        assert np.all(rows >= 0), pool
        out[pool] = getattr(caches, pool)[rows].astype(np.float32)
    return out


@given(layer=st.sampled_from(range(TINY.num_layers)), n=st.integers(2, 280),
       cut_frac=st.lists(st.floats(0.01, 0.99), min_size=1, max_size=2), tp=st.sampled_from([1, 2, 4]))
def test_chunked_equals_one_shot(layer, n, cut_frac, tp, tiny_weights):
    """A prompt split into 2-3 chunks at arbitrary boundaries gives the one-call outputs and caches."""
    cuts = sorted({min(n - 1, max(1, int(f * n))) for f in cut_frac})
    seqs = {0: sequence(0, n), 1: sequence(1, 40)}
    w = tiny_weights[layer]
    a1 = new_allocator()
    one = build(a1, [(1, 0, 17), (0, 0, n)], tp)  # a bystander request packed alongside
    c1 = LayerCaches.allocate(TINY, layer, TINY_POOLS)
    out_one = attention(one, layer, hidden_rows(one, seqs), w, c1)[one.row_request == 1]
    a2 = new_allocator()
    c2 = LayerCaches.allocate(TINY, layer, TINY_POOLS)
    bounds, outs, batch = (0, *cuts, n), [], None
    for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        reqs = [(1, 0, 17), (0, lo, hi - lo)] if k == 0 else [(0, lo, hi - lo)]
        batch = build(a2, reqs, tp)
        own = 1 if k == 0 else 0
        outs.append(attention(batch, layer, hidden_rows(batch, seqs), w, c2)[batch.row_request == own])
    assert rel_err(np.concatenate(outs), out_one) <= FP32_TOL
    want, got = logical_state(c1, one, 1, n), logical_state(c2, batch, 0, n)
    for pool in want:
        assert rel_err(got[pool], want[pool]) <= FP32_TOL, pool


@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_isolation_from_other_requests(layer, tiny_weights):
    """Changing another request's inputs and cache pages leaves this request's results bit-identical."""
    requests = [(0, 100, 40), (1, 60, 50), (2, 0, 30)]
    seqs = {rid: sequence(rid, c + n) for rid, c, n in requests}
    alloc, caches = with_history(layer, tiny_weights[layer], requests, seqs)
    batch = build(alloc, requests, tp=2)
    x = hidden_rows(batch, seqs)
    c_ref, c_mod = caches.copy(), caches.copy()
    out_ref = attention(batch, layer, x, tiny_weights[layer], c_ref)
    rng = np.random.default_rng(3)
    x_mod = x.copy()
    victim = batch.row_request == 1
    x_mod[victim] = rng.standard_normal((int(victim.sum()), TINY.hidden_size), dtype=np.float32)
    for pool, array in c_mod.arrays().items():  # scribble over every page request 1 owns
        table = batch.tables["idx" if pool == "idx_scale" else pool][1]
        page = TINY.layout.pools["idx" if pool == "idx_scale" else pool].page_size
        rows = (table[table >= 0][:, None].astype(np.int64) * page + np.arange(page)).ravel()
        array[rows] = rng.integers(-100, 100, size=array[rows].shape).astype(array.dtype)
    out_mod = attention(batch, layer, x_mod, tiny_weights[layer], c_mod)
    for i in (0, 2):
        np.testing.assert_array_equal(out_mod[batch.row_request == i], out_ref[batch.row_request == i])
        for pool in WRITTEN[TINY.layer_kind(layer)]:
            got, want = cache_values(c_mod, batch, i, pool)[1], cache_values(c_ref, batch, i, pool)[1]
            np.testing.assert_array_equal(got, want)
    assert not np.array_equal(out_mod[victim], out_ref[victim])  # the perturbation did reach request 1


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_rank_views_concatenate_to_group(layer, tp, tiny_weights):
    """Rank r's output equals rows [r*L, (r+1)*L) of the group result; every rank writes identical caches."""
    requests = [(0, 90, 7), (1, 0, 9), (2, 140, 5)]  # N = 21: never TP-aligned, requests straddle ranks
    seqs = {rid: sequence(rid, c + n) for rid, c, n in requests}
    alloc, caches = with_history(layer, tiny_weights[layer], requests, seqs)
    batch = build(alloc, requests, tp=tp, pad_position="continue")
    x = hidden_rows(batch, seqs)
    c_group = caches.copy()
    whole = attention(batch, layer, x, tiny_weights[layer], c_group)
    parts = []
    for r in range(tp):
        c_rank = caches.copy()
        parts.append(attention(batch, layer, x, tiny_weights[layer], c_rank, rank=r))
        assert parts[-1].shape == (batch.local_rows, TINY.hidden_size)
        for name, array in c_group.arrays().items():
            np.testing.assert_array_equal(getattr(c_rank, name), array, err_msg=name)
    assert rel_err(np.concatenate(parts), whole) <= FP32_TOL


@pytest.mark.parametrize("pad_position", ["zero", "continue"])
@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_padding_rows_and_unmapped_rows(layer, pad_position, tiny_weights):
    """Padding rows give zero output; every cache row outside the batch's slot mappings is bit-unchanged."""
    requests = [(0, 30, 3), (1, 126, 6)]  # N = 9 -> P = 12 at TP 4: three padding rows
    seqs = {rid: sequence(rid, c + n) for rid, c, n in requests}
    alloc, caches = with_history(layer, tiny_weights[layer], requests, seqs)
    rng = np.random.default_rng(5)
    for array in caches.arrays().values():  # sentinel values everywhere, so a stray write shows
        array += rng.integers(1, 50, size=array.shape).astype(array.dtype)
    batch = build(alloc, requests, tp=4, pad_position=pad_position)
    before = {n: a.copy() for n, a in caches.arrays().items()}
    out = attention(batch, layer, hidden_rows(batch, seqs), tiny_weights[layer], caches)
    assert batch.padded_rows - batch.num_tokens == 3
    assert np.all(out[batch.row_request < 0] == 0)
    assert np.all(np.abs(out[batch.row_request >= 0]).max(axis=1) > 0)
    for name, array in caches.arrays().items():
        slots = batch.slots["idx" if name == "idx_scale" else name]
        untouched = np.ones(array.shape[0], dtype=bool)
        untouched[slots[slots >= 0]] = False
        np.testing.assert_array_equal(array[untouched], before[name][untouched], err_msg=name)
