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
from pypto_fixtures import (
    CONFIG,
    SEED,
    TOPK_TIE_ATOL,
    TOPK_TIE_RTOL,
    assert_topk_sets_match,
    hidden_rows,
    long_batch,
    random_history,
)

from dspark_abi.layout import physical_rows
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.numerics import bf16_round
from dspark_kernels.model.plan import IndexKeyPools, RopeRows
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.model.rope import rope_at
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference.indexer import IndexCandidates, index_query, index_scores, lightning_topk, select_topk
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


def _distinct_at_k(scores: np.ndarray, k: int) -> bool:
    """Whether a row's k-th best score beats its (k+1)-th by more than the tie tolerance (or it has <= k
    candidates): then the kernel's selection must equal the reference's exactly, not only up to ties."""
    best = np.sort(scores[np.isfinite(scores)])[::-1]
    return best.size <= k or best[k - 1] - best[k] > TOPK_TIE_ATOL + TOPK_TIE_RTOL * abs(best[k - 1])


def _direct_case(rows: int, columns: int, pool_rows: int, first_position: int, edit) -> tuple:  # type: ignore[no-untyped-def]
    """An indexer call on host-built candidates: random CSA weights and rows at ``first_position`` onwards, an idx
    pool of ``pool_rows`` random keys, each row's ``columns`` distinct candidate rows (then ``edit(cand, rng)``
    changes them in place). Returns (the ``indexer_direct`` arguments before ``topk``, the reference's scores
    [rows, columns], -inf on non-candidates)."""
    rng = np.random.default_rng(SEED)
    c = CONFIG
    w = prepare_weights(AttentionWeights.random(c, LAYER, seed=SEED), "a2a3")
    x = bf16_round(rng.standard_normal((rows, c.hidden_size)).astype(np.float32))
    cos, sin = rope_at(c, "csa", np.arange(rows, dtype=np.int64) + first_position, "a2a3")
    lrq = low_rank_query(x, w, c.rms_norm_eps, "a2a3")
    iq = index_query(lrq, x, w, cos, sin, c.index_n_heads, c.index_weight_scale, "a2a3")
    keys = IndexKeyPools(rng.integers(-127, 128, (pool_rows, c.index_head_dim)).astype(np.int8),
                         rng.uniform(1e-3, 2e-2, pool_rows).astype(np.float32))
    cand = np.stack([rng.permutation(pool_rows)[:columns] for _ in range(rows)]).astype(np.int32)
    edit(cand, rng)
    scores = np.stack([index_scores(iq.rows(t, t + 1), keys.keys[np.maximum(cand[t], 0)].astype(np.float32),
                                    keys.scales[np.maximum(cand[t], 0)], "a2a3")[0] for t in range(rows)])
    case = ((lrq.qr_q, lrq.qr_scale), x, w, c.index_n_heads, c.index_weight_scale, RopeRows(cos, sin), keys, cand)
    return case, np.where(cand >= 0, scores, -np.inf)


def test_tiled_topk_matches_reference():
    """The top-k in column tiles merged as a tree (``indexer.sort_tiles``: 200 candidates in 4 tiles of 64, merged
    in pairs, 4 -> 2 -> 1; in 3 tiles of 96 merged at once; with k = 8 in 4 rounds of 2) and the single pass,
    on host-built candidates, against the reference's ``select_topk``. Rows: distinct keys; 40 % non-candidate
    (-1) columns in every tile; 5 candidates (< k) spread over 4 tiles; every key 10 times (exact ties)."""
    columns, pool_rows = 200, 256

    def edit(cand: np.ndarray, rng: np.random.Generator) -> None:
        cand[1, rng.random(columns) < 0.4] = -1
        cand[2] = -1
        cand[2, [3, 70, 130, 150, 199]] = rng.choice(pool_rows, 5, replace=False)
        cand[3] = np.arange(columns) % 20

    case, scores = _direct_case(4, columns, pool_rows, 1000, edit)
    k = CONFIG.index_topk
    want = select_topk(scores, k)
    args = (*case, k)
    runs = ((0, 1), (64, 1), (64, 4), (96, 1))  # (tile_columns, rounds)
    results = run_isolated(pypto_cases.indexer_direct, [(*args, rounds, tiles) for tiles, rounds in runs])
    assert [r[1][:2] for r in results] == [(1, 224), (4, 64), (4, 64), (3, 96)]  # single pass, then tiled
    assert [r[1][2] for r in results[1:]] == [2, 2, 3]                            # merge fan-in (kw = 32)
    distinct = [_distinct_at_k(s, k) for s in scores[:3]]
    assert all(distinct) and not _distinct_at_k(scores[3], k)  # the fixture has the rows it claims
    assert (want[2] >= 0).sum() == 5
    for (tiles, rounds), (got, _) in zip(runs, results, strict=True):
        assert_topk_sets_match(got, want, scores)
        for t in range(3):  # distinct scores at the k-th: the same set exactly
            assert set(got[t].tolist()) == set(want[t].tolist()), (tiles, rounds, t, got[t], want[t])


def test_sort_tiles_cover_every_candidate_within_the_buffer():
    """``sort_tiles``: n tiles of W cover the candidates, each fits one sort (UB budget) and holds its winners, a
    merge fits too; FLASH's 16,384 candidates (a 65,536-deep request) sort as 4 tiles of 4,096, its 1,024 (4,096
    deep) in one pass."""
    cases = [(c, k, w) for k in (8, 128, 512, 2048) for c in (1, 100, 1024, 4097, 9000, 16384, 65536)
             for w in (0, 4 * -(-k // 32) * 32)]
    plans = run_isolated(pypto_cases.sort_tile_plans, cases)
    for (c, k, w), ((n, width, fan_in), widest_sort, kw) in zip(cases, plans, strict=True):
        assert n * width >= max(c, k) and width % 32 == 0 and width <= widest_sort, (c, k, w, n, width)
        assert n == 1 or (width >= kw and fan_in >= 2 and fan_in * kw <= widest_sort), (c, k, w, n, width, fan_in)
        assert n * width - max(c, k) < n * 32 + (kw * n if n > 1 else 0), (c, k, w, n, width)  # little padding
    flash = dict(zip(cases, plans, strict=True))
    assert flash[(16384, 512, 0)][0] == (4, 4096, 8) and flash[(1024, 512, 0)][0][0] == 1
    assert flash[(16384, 512, 0)][1] == 9728  # (196,608 - 4 * 512) / 20, in whole 32-column groups


def test_tiled_topk_at_the_flash_geometry():
    """The default tiling at FLASH's 64K-context geometry: 16,384 candidates per row and k = 512 (4 rounds), which
    no single sort holds (``max_sort_columns(512)`` = 9,728), so the kernel sorts 4 tiles of 4,096 and merges their
    winners at once. Distinct random scores (one row 30 % non-candidates): the selected sets equal the reference's."""
    rows, columns, k = 2, 16384, 512

    def edit(cand: np.ndarray, rng: np.random.Generator) -> None:
        cand[1, rng.random(columns) < 0.3] = -1

    case, scores = _direct_case(rows, columns, 20000, 70000, edit)
    want = select_topk(scores, k)
    [(got, plan)] = run_isolated(pypto_cases.indexer_direct, [(*case, k, 0, 0)])
    assert plan[:2] == (4, 4096)                       # the production tiling, not the single pass
    assert all(_distinct_at_k(s, k) for s in scores)   # the k-th score is not tied: the sets are exact
    for t in range(rows):
        assert set(got[t].tolist()) == set(want[t].tolist()), t
