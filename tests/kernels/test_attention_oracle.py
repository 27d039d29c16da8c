"""The fp32 reference against the independent loop oracle (tests/kernels/oracle.py), for every layer kind.

Measured (TINY, seed 7, sequences of 37-260 tokens): output relative error <= 1.0e-6 and cache rows
<= 5.1e-6, growing with position: the oracle forms RoPE angles and YaRN blends in its own float32
operation order, and an ulp of omega times a position of ~260 moves an angle by ~1e-5 rad at most.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dspark_abi import BatchBuilder, PaddingPolicy
from dspark_abi.presets import TINY
from dspark_kernels import LayerCaches, attention
from dspark_kernels.model.plan import BatchPlan, IndexKeyPools
from dspark_kernels.model.prepared import prepare_weights, prepared_for
from dspark_kernels.model.rope import rope_at
from dspark_kernels.reference.attention import attend
from dspark_kernels.reference.indexer import IndexCandidates, index_query, lightning_topk
from dspark_kernels.reference.projections import low_rank_query

from .conftest import build, hidden_rows, logical_rows, new_allocator, rel_err, sequence
from .oracle import oracle_attention

#: Outputs against the oracle (measured <= 1.0e-6).
ORACLE_OUT_TOL = 1e-5
#: Cache rows against the oracle (measured <= 5.1e-6 at positions < 300; RoPE angle rounding grows with p).
ORACLE_CACHE_TOL = 2e-5

LENGTHS = {0: 150, 1: 37, 2: 260}


@pytest.fixture(scope="module")
def oracles(tiny_weights):
    seqs = {r: sequence(r, n) for r, n in LENGTHS.items()}
    results = {(layer, r): oracle_attention(TINY, layer, tiny_weights[layer].to_tensors(prefix=""), seqs[r])
               for layer in range(TINY.num_layers) for r in LENGTHS}
    return seqs, results


#: The block-table forms the kernels read: the batch's own tables, or the persistent tables (spec 5.9).
FORMS = ["full", "persistent"]


def run_step(form, alloc, requests, tp, layer, seqs, weights, caches):
    """(full-form batch, attention output) of one step of ``requests`` in ``form``, committed to ``alloc``: the
    persistent form plans over the allocator's persistent tables right after ``commit(step)``."""
    if form == "full":
        batch = build(alloc, requests, tp=tp)
        caches = caches or LayerCaches.allocate(TINY, layer, batch.pool_blocks)
        return batch, caches, attention(batch, layer, hidden_rows(batch, seqs), weights, caches)
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp), alloc)
    for rid, cached, new in requests:
        builder.add(rid, cached, new)
    step = builder.build_step()
    builder.commit(step)
    plan = BatchPlan.from_step(step, alloc.persistent)
    caches = caches or LayerCaches.allocate(TINY, layer, plan.batch.pool_blocks)
    return plan.batch, caches, attend(plan, layer, hidden_rows(plan.batch, seqs), prepared_for(weights, "fp32", None),
                                      caches)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_packed_one_shot_matches_oracle(layer, form, tiny_weights, oracles):
    seqs, results = oracles
    alloc = new_allocator()
    batch, caches, out = run_step(form, alloc, [(r, 0, n) for r, n in LENGTHS.items()], 2, layer, seqs,
                                  tiny_weights[layer], None)
    ratio = TINY.compress_ratios[layer]
    for r, n in LENGTHS.items():
        orc = results[(layer, r)]
        assert rel_err(out[batch.row_request == r], orc.out) <= ORACLE_OUT_TOL
        assert rel_err(caches.ori[logical_rows(batch, r, "ori", np.arange(n))], orc.kv) <= ORACLE_CACHE_TOL
        entries = np.arange(n // ratio) if ratio else np.arange(0)
        if ratio == 4:
            assert rel_err(caches.csa_cmp[logical_rows(batch, r, "csa_cmp", entries)], orc.cmp) <= ORACLE_CACHE_TOL
            assert rel_err(caches.idx[logical_rows(batch, r, "idx", entries)], orc.idx) <= ORACLE_CACHE_TOL
        elif ratio == 128:
            assert rel_err(caches.hca_cmp[logical_rows(batch, r, "hca_cmp", entries)], orc.cmp) <= ORACLE_CACHE_TOL
    assert np.all(out[batch.row_request < 0] == 0)


@pytest.mark.parametrize("layer", [1, 3])
def test_topk_sets_match_oracle(layer, tiny_weights, oracles):
    """fp32 top-k sets equal the oracle's (first min(topk, visible) entries, then -1)."""
    seqs, results = oracles
    alloc = new_allocator()
    batch = build(alloc, [(r, 0, n) for r, n in LENGTHS.items()])
    caches = LayerCaches.allocate(TINY, layer, batch.pool_blocks)
    x = hidden_rows(batch, seqs)
    attention(batch, layer, x, tiny_weights[layer], caches)
    w = prepare_weights(tiny_weights[layer], "fp32")
    pos = batch.positions.astype(np.int64)
    cos, sin = rope_at(TINY, "csa", pos)
    iq = index_query(low_rank_query(x, w, TINY.rms_norm_eps, "fp32"), x, w, cos, sin, TINY.index_n_heads,
                     TINY.index_weight_scale, "fp32")
    top = lightning_topk(iq, batch.row_request, IndexKeyPools(caches.idx, caches.idx_scale),
                         IndexCandidates.lookup(pos, batch.row_request, batch.tables["idx"]), topk=TINY.index_topk,
                         precision="fp32")
    for i in np.flatnonzero(batch.row_request >= 0):
        r, p = int(batch.row_request[i]), int(pos[i])
        want = results[(layer, r)].topk[p]
        assert set(top[i, :len(want)].tolist()) == set(want)
        assert np.all(top[i, len(want):] == -1)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layer", range(TINY.num_layers))
@pytest.mark.parametrize("cuts", [(13, 130), (127, 128, 200)])
def test_chunked_matches_oracle(layer, cuts, form, tiny_weights, oracles):
    """Chunks cut mid-window, mid-page and mid-compression-window reproduce the one-sequence oracle, on both
    table forms (the persistent tables advanced by each chunk's delta)."""
    seqs, results = oracles
    n = LENGTHS[2]
    alloc = new_allocator()
    caches = None
    bounds = (0, *cuts, n)
    for lo, hi in itertools.pairwise(bounds):
        _, caches, out = run_step(form, alloc, [(2, lo, hi - lo)], 2, layer, seqs, tiny_weights[layer], caches)
        assert rel_err(out[: hi - lo], results[(layer, 2)].out[lo:hi]) <= ORACLE_OUT_TOL
