"""hc_pre / hc_post / hc_head against per-row loop implementations written straight from the math."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tolerances import hc_pre_reductions, order_atol

from dspark_abi.presets import TINY
from dspark_kernels.reference.hyper_connections import HcWeights, hc_head, hc_post, hc_pre

#: post and comb are positive and cancel nowhere: their errors are the mixes' absolute errors through sigmoid /
#: exp, i.e. relative. Measured <= 23 eps32 elementwise (3 OpenBLAS kernels, 30 seeds); RTOL keeps 7x margin.
RTOL = 2e-5
#: Absolute floor for comb entries near 0 (entries are in (0, 1], post in (0, 2): 8 eps32 of the largest value).
ATOL = 1e-6
#: x_mixed = sum_h pre[h] * x[h] cancels to ~0 in places (elementwise relative error up to 2e-3 there), so it is
#: compared absolutely: order_atol(want, K) with K = mean square + mixes over hc*D, then the hc-stream sum
#: (tests/tolerances.py); measured <= 0.12 of it.
HC_PRE_K = hc_pre_reductions(TINY)


def _sig(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def _loop_hc_pre(x: np.ndarray, w: HcWeights, hc: int, iters: int, eps: float, norm_eps: float):
    t_rows, _, d = x.shape
    xm, post, comb = np.zeros((t_rows, d)), np.zeros((t_rows, hc)), np.zeros((t_rows, hc, hc))
    fn, sc, b = (np.asarray(a, np.float64) for a in (w.fn, w.scale, w.base))
    for t in range(t_rows):
        f = x[t].reshape(-1).astype(np.float64)
        rho = 1.0 / math.sqrt(float(np.mean(f * f)) + norm_eps)
        mix = [float(fn[j] @ f) * rho for j in range(fn.shape[0])]
        pre = [_sig(mix[h] * sc[0] + b[h]) + eps for h in range(hc)]
        post[t] = [2 * _sig(mix[hc + h] * sc[1] + b[hc + h]) for h in range(hc)]
        m = [[mix[2 * hc + i * hc + o] * sc[2] + b[2 * hc + i * hc + o] for o in range(hc)] for i in range(hc)]
        for i in range(hc):  # softmax along each row, + eps
            ex = [math.exp(v - max(m[i])) for v in m[i]]
            s = sum(ex)
            m[i] = [v / s + eps for v in ex]
        for step in range(2 * iters - 1):  # col, then (row, col) * (iters - 1)
            if step % 2 == 0:
                for o in range(hc):
                    s = sum(m[i][o] for i in range(hc)) + eps
                    for i in range(hc):
                        m[i][o] /= s
            else:
                for i in range(hc):
                    s = sum(m[i]) + eps
                    m[i] = [v / s for v in m[i]]
        comb[t] = m
        xm[t] = sum(pre[h] * x[t, h].astype(np.float64) for h in range(hc))
    return xm, post, comb


def _weights(rng: np.random.Generator, rows: int, hc: int, d: int, nscale: int) -> HcWeights:
    return HcWeights(fn=(rng.standard_normal((rows, hc * d)) * 0.05).astype(np.float32),
                     scale=(rng.uniform(0.5, 2.0, nscale)).astype(np.float32),
                     base=(rng.standard_normal(rows) * 0.5).astype(np.float32))


def test_hc_pre_matches_loop():
    rng = np.random.default_rng(1)
    hc, d = TINY.hc_mult, TINY.hidden_size
    w = _weights(rng, (2 + hc) * hc, hc, d, 3)
    x = rng.standard_normal((5, hc, d)).astype(np.float32)
    got = hc_pre(x, w, TINY)
    xm, post, comb = _loop_hc_pre(x, w, hc, TINY.hc_sinkhorn_iters, TINY.hc_eps, TINY.rms_norm_eps)
    np.testing.assert_allclose(got.x_mixed, xm, rtol=0, atol=order_atol(xm, HC_PRE_K))
    np.testing.assert_allclose(got.post, post, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got.comb, comb, rtol=RTOL, atol=ATOL)
    # after 20 Sinkhorn rounds ending on columns, columns sum to ~1
    np.testing.assert_allclose(got.comb.sum(axis=1), 1.0, atol=1e-4)


def test_hc_post_matches_loop_and_padding_stays_zero():
    rng = np.random.default_rng(2)
    hc, d, t = 4, 16, 3
    out = rng.standard_normal((t, d)).astype(np.float32)
    x = rng.standard_normal((t, hc, d)).astype(np.float32)
    post = rng.random((t, hc)).astype(np.float32)
    comb = rng.random((t, hc, hc)).astype(np.float32)
    out[2] = 0
    x[2] = 0
    got = hc_post(out, x, post, comb)
    want = np.zeros((t, hc, d))
    for r in range(t):
        for o in range(hc):
            want[r, o] = post[r, o] * out[r] + sum(comb[r, i, o] * x[r, i] for i in range(hc))
    # post * out + sum over hc streams: hc + 1 products summed in fp32, cancelling in places
    np.testing.assert_allclose(got, want, rtol=0, atol=order_atol(want, hc + 1))
    assert not got[2].any()


def test_hc_head_matches_loop_and_zero_rows():
    rng = np.random.default_rng(3)
    hc, d = TINY.hc_mult, TINY.hidden_size
    w = _weights(rng, hc, hc, d, 1)
    x = rng.standard_normal((4, hc, d)).astype(np.float32)
    x[3] = 0
    got = hc_head(x, w, TINY)
    want = np.zeros((4, d))
    for t in range(4):
        f = x[t].reshape(-1).astype(np.float64)
        rho = 1.0 / math.sqrt(float(np.mean(f * f)) + TINY.rms_norm_eps)
        pre = [_sig(float(w.fn[h] @ f) * rho * w.scale[0] + w.base[h]) + TINY.hc_eps for h in range(hc)]
        want[t] = sum(pre[h] * f.reshape(hc, d)[h] for h in range(hc))
    np.testing.assert_allclose(got, want, rtol=0, atol=order_atol(want, HC_PRE_K))  # as x_mixed
    assert not got[3].any()


def test_a2a3_rounds_x_mixed_to_bf16_and_rejects_unknown_precision():
    rng = np.random.default_rng(4)
    hc, d = TINY.hc_mult, TINY.hidden_size
    w = _weights(rng, (2 + hc) * hc, hc, d, 3)
    x = rng.standard_normal((3, hc, d)).astype(np.float32)
    a = hc_pre(x, w, TINY, precision="a2a3").x_mixed
    bits = a.view(np.uint32)
    assert not (bits & 0xFFFF).any()  # bf16 values: low 16 mantissa bits clear
    # the same fp32 value rounded to nearest bf16: |error| <= 2**-8 |value| exactly (any machine)
    np.testing.assert_allclose(a, hc_pre(x, w, TINY).x_mixed, rtol=2**-8)
    with pytest.raises(ValueError, match="precision"):
        hc_pre(x, w, TINY, precision="fp16")  # type: ignore[arg-type]
