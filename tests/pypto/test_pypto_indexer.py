"""Stage 5: lightning indexer scores and top-k (candidates through the request's idx table) against the reference.

Fixture: ``long_batch`` (rows see up to 100 visible entries for k = 8; a fresh request with none; a request
crossing the rank boundary; a padding row) with a random idx cache, on both ranks, plus a case whose idx table
has an unmapped page (those entries must never be chosen). The selections are compared as sets with upstream's
tie tolerance (``pypto_fixtures.assert_topk_sets_match``), scores recomputed from the reference's inputs.
Measured (docs/pypto.md): the selections were identical, order included, on every row of 3 seeds.
"""

import numpy as np
import pypto_cases
import pytest
from pypto_fixtures import CONFIG, SEED, assert_topk_sets_match, hidden_rows, long_batch, random_history

from dspark_abi.layout import physical_rows
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.plan import IndexKeyPools
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.model.rope import rope_at
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference.indexer import IndexCandidates, index_query, index_scores, lightning_topk
from dspark_kernels.reference.projections import low_rank_query

pytestmark = pytest.mark.pypto
LAYER = 1  # CSA
IDX_RING = CONFIG.layout.pools["idx"].is_ring  # False: a compressed pool (column = page)


def _reference_scores(iq, positions, request, table, caches) -> np.ndarray:
    """[T, C] reference scores of every visible, mapped candidate (-inf elsewhere)."""
    visible = np.where(request >= 0, (positions + 1) // 4, 0)
    c = np.arange(max(1, int(visible.max())))[None, :]
    rows = physical_rows(table, request, np.where(c < visible[:, None], c, -1), 32, ring=IDX_RING)
    keys = caches.idx[np.maximum(rows, 0)].astype(np.float32)                      # (T, C, dI)
    scale = caches.idx_scale[np.maximum(rows, 0)]                                   # (T, C)
    scores = np.stack([index_scores(iq.rows(t, t + 1), keys[t], scale[t], "a2a3")[0] for t in range(len(rows))])
    return np.where(rows >= 0, scores, -np.inf)


def test_lightning_topk_matches_reference_as_sets():
    batch = long_batch()
    w = prepare_weights(AttentionWeights.random(CONFIG, LAYER, seed=SEED), "a2a3")
    caches = LayerCaches.allocate(CONFIG, LAYER, batch.pool_blocks, precision="a2a3")
    random_history(caches, np.random.default_rng(SEED))
    x_all = hidden_rows(batch)
    holed = batch.tables["idx"].copy()
    holed[0, 1] = -1  # request 0's entries 32..63 unmapped
    cases, expected = [], []
    # the fourth case selects in 4 rounds of 2, as k = 512 (FLASH) does in 4 rounds of 128; the last ones repeat
    # the rank's 5 rows to 10 and 20, so the kernel's loop runs whole blocks of ROW_BLOCK rows
    for rank, table, rounds, reps in ((0, batch.tables["idx"], 1, 1), (1, batch.tables["idx"], 1, 1),
                                      (0, holed, 1, 1), (0, batch.tables["idx"], 4, 1),
                                      (1, batch.tables["idx"], 4, 2), (0, batch.tables["idx"], 1, 4)):
        view = batch.rank(rank)
        x = np.tile(x_all[view.row_start:view.row_stop], (reps, 1))
        pos = np.tile(view.positions.astype(np.int64), reps)
        req = np.tile(view.local_request_ids.astype(np.int64), reps)
        cos, sin = rope_at(CONFIG, "csa", pos, "a2a3")
        lrq = low_rank_query(x, w, CONFIG.rms_norm_eps, "a2a3")
        iq = index_query(lrq, x, w, cos, sin, CONFIG.index_n_heads, CONFIG.index_weight_scale, "a2a3")
        want = lightning_topk(iq, req, IndexKeyPools(caches.idx, caches.idx_scale),
                              IndexCandidates.lookup(pos, req, table), topk=CONFIG.index_topk, precision="a2a3")
        expected.append((want, _reference_scores(iq, pos, req, table, caches)))
        cases.append((pos, req, table, lrq.qr_q, lrq.qr_scale, w, x, cos, sin, caches.idx, caches.idx_scale,
                      CONFIG.index_n_heads, CONFIG.index_topk, CONFIG.index_weight_scale, rounds, IDX_RING))
    results = run_isolated(pypto_cases.indexer_many, cases)
    for (want, scores), got in zip(expected, results, strict=True):
        assert_topk_sets_match(got, want, scores)
    assert (expected[1][0] == -1).all(axis=1).any()   # rank 1 holds rows without visible entries
    assert (expected[0][0] >= 0).all(axis=1).any()    # and full selections out of many candidates
    assert not np.isin(results[2][0], np.arange(32, 64)).any()  # unmapped entries never chosen (row 0 = request 0)


def test_topk_comparison_rejects_a_wrong_selection():
    """The set comparison itself must fail on a swap beyond the tie tolerance."""
    scores = np.array([[3.0, 2.0, 1.0, 0.5]], np.float32)
    want = np.array([[0, 1]], np.int32)
    assert_topk_sets_match(np.array([[1, 0]], np.int32), want, scores)  # order is free
    with pytest.raises(AssertionError):
        assert_topk_sets_match(np.array([[0, 2]], np.int32), want, scores)
    near = np.array([[3.0, 1.0 + 5e-6, 1.0, 0.5]], np.float32)
    assert_topk_sets_match(np.array([[0, 2]], np.int32), want, near)  # a tie within tolerance
