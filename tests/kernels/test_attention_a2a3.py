"""a2a3 numerics against the exact fp32 reference: the measured error distribution and its tolerances.

Measured on TINY (random weights seed 7; requests of 150/37/260/300 tokens, or 34/20/30 for the short CSA
case), a2a3 vs fp32:

* output rows, relative L2 error per row: median 1.23e-2 - 1.30e-2, max 1.94e-2 (SWA, HCA, and CSA when
  every visible entry is selected). Sources: bf16 hidden/q/kv/probabilities and int8 qr and o-proj
  activations (~0.4% each). For long CSA prompts 6% of rows select a different top-k set (compare sets
  only in fp32) and those rows differ by up to 55%; the median stays at 1.3e-2.
* caches, normwise (max|a - f| / max|f|): ori/cmp <= 6.8e-3 (bf16 storage), states <= 2.5e-3 (bf16
  inputs, fp32 storage), dequantised idx <= 7.0e-3 (bf16 + int8).
* indexer scores over each request's visible entries, normwise per request: <= 1.7e-2.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_abi.presets import TINY
from dspark_kernels import LayerCaches, attention
from dspark_kernels.model.numerics import narrow
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.model.rope import rope_at
from dspark_kernels.reference.indexer import index_query, index_scores
from dspark_kernels.reference.paged import gather_rows, request_rows
from dspark_kernels.reference.projections import low_rank_query

from .conftest import build, hidden_rows, new_allocator, rel_err, sequence

#: Per-row relative L2 error, a2a3 vs fp32, largest row (measured 1.94e-2).
A2A3_ROW_REL_MAX = 3e-2
#: Per-row relative L2 error, median row (measured <= 1.30e-2, also for long CSA prompts).
A2A3_ROW_REL_MEDIAN = 2e-2
#: bf16 KV-like pools (ori, csa_cmp, hca_cmp), normwise (measured <= 6.8e-3).
A2A3_KV_TOL = 1.5e-2
#: fp32 state pools fed by bf16 inputs, normwise (measured <= 2.5e-3).
A2A3_STATE_TOL = 5e-3
#: Dequantised int8 idx rows, normwise (measured <= 7.0e-3).
A2A3_IDX_TOL = 1.5e-2
#: Indexer scores per request, normwise (measured <= 1.7e-2).
A2A3_SCORE_TOL = 4e-2

LONG = {0: 150, 1: 37, 2: 260, 3: 300}
SHORT = {0: 34, 1: 20, 2: 30}  # (p+1)//4 <= index_topk: every visible entry is selected in both precisions


def run_both(layer, weights, lengths):
    seqs = {r: sequence(r, n) for r, n in lengths.items()}
    res = {}
    for precision in ("fp32", "a2a3"):
        batch = build(new_allocator(), [(r, 0, n) for r, n in lengths.items()], tp=2)
        caches = LayerCaches.allocate(TINY, layer, batch.pool_blocks, precision)
        x = hidden_rows(batch, seqs)
        res[precision] = (attention(batch, layer, x, weights, caches, precision=precision), caches, x)
    return batch, res


def row_rel(a, f):
    return np.linalg.norm(a - f, axis=1) / np.linalg.norm(f, axis=1)


@pytest.mark.parametrize(("layer", "lengths"), [(0, LONG), (2, LONG), (1, SHORT), (3, SHORT)])
def test_outputs_and_caches_within_tolerance(layer, lengths, tiny_weights):
    batch, res = run_both(layer, tiny_weights[layer], lengths)
    live = batch.row_request >= 0
    err = row_rel(res["a2a3"][0][live], res["fp32"][0][live])
    assert err.max() <= A2A3_ROW_REL_MAX
    assert np.median(err) <= A2A3_ROW_REL_MEDIAN
    assert np.all(res["a2a3"][0][~live] == 0)
    fp, aa = res["fp32"][1], res["a2a3"][1]
    for name in ("ori", "csa_cmp", "hca_cmp"):
        if getattr(fp, name) is not None:
            assert rel_err(getattr(aa, name), getattr(fp, name)) <= A2A3_KV_TOL, name
    for name in ("csa_state", "csa_inner_state", "hca_state"):
        if getattr(fp, name) is not None:
            assert rel_err(getattr(aa, name), getattr(fp, name)) <= A2A3_STATE_TOL, name
    if fp.idx is not None:
        assert aa.idx.dtype == np.int8
        assert rel_err(aa.idx.astype(np.float32) * aa.idx_scale[:, None], fp.idx) <= A2A3_IDX_TOL


@pytest.mark.parametrize("layer", [1, 3])
def test_long_csa_median_row_and_indexer_scores(layer, tiny_weights):
    batch, res = run_both(layer, tiny_weights[layer], LONG)
    live = batch.row_request >= 0
    assert np.median(row_rel(res["a2a3"][0][live], res["fp32"][0][live])) <= A2A3_ROW_REL_MEDIAN
    pos = batch.positions.astype(np.int64)
    scores = {}
    for precision in ("fp32", "a2a3"):
        _out, caches, x = res[precision]
        w = prepare_weights(tiny_weights[layer], precision)
        xn = narrow(x, precision)
        cos, sin = rope_at(TINY, "csa", pos, precision)
        iq = index_query(low_rank_query(xn, w, TINY.rms_norm_eps, precision), xn, w, cos, sin,
                         TINY.index_n_heads, TINY.index_weight_scale, precision)
        scores[precision] = []
        for r, n in LONG.items():
            rows = np.flatnonzero(batch.row_request == r)
            keys = request_rows(batch.tables["idx"][r], np.arange(n // 4), 32)
            k, _ = gather_rows(caches.idx, keys)
            k_scale, _ = gather_rows(caches.idx_scale, keys)
            s = index_scores(iq.rows(rows[0], rows[-1] + 1), k.astype(np.float32), k_scale, precision)
            visible = np.arange(n // 4)[None, :] < ((pos[rows] + 1) // 4)[:, None]
            scores[precision].append(np.where(visible, s, 0.0))
    for s_a, s_f in zip(scores["a2a3"], scores["fp32"], strict=True):
        assert rel_err(s_a, s_f) <= A2A3_SCORE_TOL
