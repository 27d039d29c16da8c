"""Indexer scores/top-k, sparse attention and the output projection against loop implementations,
in fp32 and in the a2a3 numerics (int8 and bf16 steps written out one by one)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tolerances import assert_close, bf16_ulp, order_atol

from dspark_abi.presets import TINY
from dspark_kernels import AttentionWeights
from dspark_kernels.model.numerics import bf16_round, int8_quantize
from dspark_kernels.model.plan import IndexKeyPools
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.reference import sparse_attention as sparse_attention_module
from dspark_kernels.reference.indexer import IndexCandidates, IndexerQuery, index_scores, lightning_topk
from dspark_kernels.reference.o_proj import output_projection
from dspark_kernels.reference.projections import LowRankQuery
from dspark_kernels.reference.sparse_attention import sparse_attention

#: Vectorized stage vs loop in fp32 differ in summation order only: the bounds below are
#: ``order_atol(want, K)`` = eps32 * sqrt(K) * max|want| with K the stage's summed reduction lengths
#: (tests/tolerances.py). In a2a3 both sides round the same fp32 values to bf16 at the end, and an fp32 order
#: difference can push one value across a rounding boundary: one bf16 step, ``bf16_ulp(want)``.


def rng_query(t=5, heads=3, dim=16, seed=0, precision="fp32"):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, heads, dim), dtype=np.float32)
    scale = np.ones((t, heads), np.float32)
    if precision == "a2a3":
        q, scale = int8_quantize(q)
    return IndexerQuery(q, scale, rng.standard_normal((t, heads), dtype=np.float32))


@pytest.mark.parametrize("precision", ["fp32", "a2a3"])
def test_index_scores_against_loop(precision):
    iq = rng_query(precision=precision)
    rng = np.random.default_rng(1)
    keys = rng.integers(-127, 128, (7, 16)).astype(np.float32) if precision == "a2a3" else \
        rng.standard_normal((7, 16), dtype=np.float32)
    k_scale = rng.uniform(0.01, 0.1, 7).astype(np.float32) if precision == "a2a3" else np.ones(7, np.float32)
    got = index_scores(iq, keys, k_scale, precision)
    want = np.array([[k_scale[c] * sum(iq.weights[t, h] * max(iq.q_scale[t, h] * float(iq.q[t, h] @ keys[c]), 0.0)
                                       for h in range(3)) for c in range(7)] for t in range(5)])
    # q.k over 16 dims (exact integer products in a2a3), then the weighted sum over 3 heads, which can cancel to ~0
    np.testing.assert_allclose(got, want, rtol=0, atol=order_atol(want, 16 + 3))


def test_lightning_topk_uses_only_own_visible_entries():
    """Two requests with interleaved idx pages: each row ranks only its own entries c < (p+1)//4."""
    rng = np.random.default_rng(2)
    dim, k = 16, 3
    pool = rng.standard_normal((4 * 32, dim), dtype=np.float32)
    scale = np.ones(4 * 32, np.float32)
    table = np.array([[2, 0, -1], [1, 3, -1]], np.int32)
    positions = np.array([2, 3, 9, 45, 0, 7, 140, 141])
    request = np.array([0, 0, 0, 0, 1, 1, 1, -1])
    iq = rng_query(t=8, dim=dim, seed=3)
    top = lightning_topk(iq, request, IndexKeyPools(pool, scale), IndexCandidates.lookup(positions, request, table),
                         topk=k, precision="fp32")
    for i in range(8):
        r, v = int(request[i]), (int(positions[i]) + 1) // 4
        if r < 0:
            assert np.all(top[i] == -1)
            continue
        rows = [table[r][c // 32] * 32 + c % 32 for c in range(v)]
        scores = index_scores(iq.rows(i, i + 1), pool[rows].reshape(v, dim), np.ones(v, np.float32), "fp32")[0]
        want = sorted(range(v), key=lambda c: (-scores[c], c))[:k]
        np.testing.assert_array_equal(top[i], want + [-1] * (k - len(want)))


def test_lightning_topk_skips_unmapped_entries():
    iq = rng_query(t=1, dim=16)
    table = np.array([[0, -1]], np.int32)  # entries 32.. unmapped
    pool = np.ones((32, 16), np.float32)
    top = lightning_topk(iq, np.array([0]), IndexKeyPools(pool, np.ones(32, np.float32)),
                         IndexCandidates.lookup(np.array([199]), np.array([0]), table), topk=64, precision="fp32")
    assert set(top[0][top[0] >= 0].tolist()) == set(range(32))


def attention_loop(q, keys_per_query, sink, scale, precision):
    t_n, h_n, _d = q.shape
    o = np.zeros_like(q)
    for t in range(t_n):
        k = keys_per_query[t]
        if len(k) == 0:
            continue
        for h in range(h_n):
            logits = (k @ q[t, h]) * np.float32(scale)
            m = logits.max()
            p = np.exp(logits - m)
            pv = bf16_round(p) if precision == "a2a3" else p
            o[t, h] = (pv @ k) / (p.sum() + np.exp(sink[h] - m))
    return o


@pytest.mark.parametrize("gather_ratio", [2, 0])  # 0 forces the per-query gather of compressed rows
@pytest.mark.parametrize("precision", ["fp32", "a2a3"])
def test_sparse_attention_against_loop(precision, gather_ratio, monkeypatch):
    monkeypatch.setattr(sparse_attention_module, "PER_QUERY_GATHER_RATIO", gather_ratio)
    rng = np.random.default_rng(4)
    t_n, h_n, d = 6, 2, 8
    ori = bf16_round(rng.standard_normal((40, d), dtype=np.float32))
    cmp = bf16_round(rng.standard_normal((10, d), dtype=np.float32))
    q = bf16_round(rng.standard_normal((t_n, h_n, d), dtype=np.float32))
    window = np.array([[0, 1, 2, -1], [3, 4, -1, -1], [5, -1, -1, -1], [6, 7, 8, 9], [-1] * 4, [11, 12, 13, 14]])
    cmp_rows = np.array([[0, 1], [-1, -1], [2, 9], [3, -1], [4, -1], [0, 1]])
    request = np.array([0, 0, 1, 1, 1, -1])
    sink = np.array([0.3, -1.0], np.float32)
    zeros = np.zeros((t_n, 2), np.float32)
    got = sparse_attention(q, request, window, ori, cmp_rows, cmp, sink, zeros + 1, zeros, scale=0.35,
                           precision=precision)  # cos 1, sin 0: the inverse RoPE is the identity here
    keys = [np.concatenate([ori[window[t][window[t] >= 0]], cmp[cmp_rows[t][cmp_rows[t] >= 0]]]) if request[t] >= 0
            else np.zeros((0, d), np.float32) for t in range(t_n)]
    want = attention_loop(q, keys, sink, 0.35, precision)
    # q.k over d = 8, then the softmax sum and p @ v over <= 6 keys: K = 8 + 2 * 6
    atol = order_atol(want, d + 2 * 6)
    if precision == "a2a3":  # plus one step of the final bf16 rounding; the bf16 p values are >= 398 fp32 ulps
        want = bf16_round(want)  # from a rounding midpoint, so no order difference flips them
        atol = atol + bf16_ulp(want)
    assert_close(got, want, atol, precision)
    assert np.all(got[5] == 0)


def test_sink_only_in_denominator():
    """One key u, logit l: o = u * e^l / (e^l + e^sink) (the sink does not enter the max)."""
    u = np.array([[1.0, 2.0]], np.float32)
    q = np.array([[[0.5, 0.25]]], np.float32)
    sink = np.array([3.0], np.float32)
    one = np.ones((1, 1), np.float32)
    got = sparse_attention(q, np.array([0]), np.array([[0]]), u, None, None, sink, one, 0 * one, scale=1.0,
                           precision="fp32")
    logit = 0.5 + 0.5
    np.testing.assert_allclose(got[0, 0], u[0] * math.exp(logit) / (math.exp(logit) + math.exp(3.0)), rtol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "a2a3"])
def test_output_projection_against_loop(precision):
    w = prepare_weights(AttentionWeights.random(TINY, 0, seed=5), precision)
    o = bf16_round(np.random.default_rng(6).standard_normal((3, 8 * 128), dtype=np.float32))
    got = output_projection(o, w, precision)
    g_n, ro = TINY.o_groups, TINY.o_lora_rank
    want = np.zeros_like(got)
    for t in range(3):
        groups = o[t].reshape(g_n, -1)  # group g = heads 2g, 2g+1
        y = [w.wo_a[g] @ groups[g] for g in range(g_n)]
        if precision == "fp32":
            want[t] = w.wo_b @ np.concatenate(y)
            continue
        acc = np.zeros(TINY.hidden_size, np.float64)
        for g in range(g_n):
            y_q, y_dq = int8_quantize(y[g][None, :])
            acc += (w.wo_b[:, g * ro:(g + 1) * ro].astype(np.int64) @ y_q[0].astype(np.int64)) * float(y_dq[0])
        want[t] = (acc * w.wo_b_scale).astype(np.float32)
    if precision == "fp32":  # wo_a over a group (H * hd / G = 256), then wo_b over G * Ro = 128
        np.testing.assert_allclose(got, want, rtol=0, atol=order_atol(want, 256 + g_n * ro))
        return
    # exact int8 products; fp32 vs float64 sum over the G groups (+ 2 scale roundings), then one bf16 step. Every y
    # lies >= 2 order bounds (eps32 * sqrt(256) * max|y|) from an int8 rounding boundary: no quantisation flips.
    atol = order_atol(want, g_n + 2) + bf16_ulp(bf16_round(want))
    assert_close(got, bf16_round(want), atol, "a2a3 o-proj")


def test_low_rank_int8_projection_is_the_upstream_formula():
    rng = np.random.default_rng(8)
    qr = rng.standard_normal((4, 64), dtype=np.float32)
    w_q, w_scale = int8_quantize(rng.standard_normal((10, 64), dtype=np.float32))
    qr_q, qr_scale = int8_quantize(qr)
    got = LowRankQuery(qr, qr_q, qr_scale).project(w_q, w_scale)
    want = (qr_q.astype(np.int64) @ w_q.astype(np.int64).T) * qr_scale[:, None] * w_scale[None, :]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got, qr @ (w_q * w_scale[:, None]).T, rtol=0.05, atol=0.05)
