"""MoE gate and experts against a per-token loop implementation written from DeepSeek-V4's math."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tolerances import moe_reductions, order_atol

from dspark_abi.presets import TINY
from dspark_kernels.model.block_weights import MoEWeights
from dspark_kernels.reference.moe import moe, route

#: fp32 grouped matmuls vs a float64 per-token loop: the measured max error is ~4e-7 of the output's largest
#: magnitude (10 seeds). Compare with an absolute tolerance of 1e-5 * max|out| (25x margin for BLAS order); a wrong
#: weight, clamp or expert moves outputs by >= 1e-2 of that scale.
SCALED_ATOL = 1e-5


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=SCALED_ATOL * float(np.abs(want).max()))


def _weights(rng: np.random.Generator, *, hash_layer: bool, cfg=TINY) -> MoEWeights:
    e, d, i, k = cfg.moe.n_routed_experts, cfg.hidden_size, cfg.moe.moe_intermediate_size, cfg.moe.num_experts_per_tok
    s = cfg.moe.n_shared_experts * i
    tid2eid = None
    if hash_layer:  # a permutation prefix per token: distinct experts
        tid2eid = np.argsort(rng.random((cfg.vocab_size, e)), axis=1)[:, :k].astype(np.int32)
    return MoEWeights(
        gate_w=(rng.standard_normal((e, d)) * 0.3).astype(np.float32),
        gate_bias=None if hash_layer else (rng.standard_normal(e) * 0.1).astype(np.float32),
        tid2eid=tid2eid,
        w1=(rng.standard_normal((e, i, d)) * 0.5).astype(np.float32),  # large enough to hit the swiglu clamp
        w2=(rng.standard_normal((e, d, i)) * 0.1).astype(np.float32),
        w3=(rng.standard_normal((e, i, d)) * 0.5).astype(np.float32),
        shared_w1=(rng.standard_normal((s, d)) * 0.5).astype(np.float32),
        shared_w2=(rng.standard_normal((d, s)) * 0.1).astype(np.float32),
        shared_w3=(rng.standard_normal((s, d)) * 0.5).astype(np.float32),
    )


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def _loop_moe(x: np.ndarray, w: MoEWeights, token_ids: np.ndarray, cfg=TINY) -> np.ndarray:
    m = cfg.moe
    lim = m.swiglu_limit
    out = np.zeros(x.shape, dtype=np.float64)
    for t in range(x.shape[0]):
        xt = x[t].astype(np.float64)
        scores = [math.sqrt(math.log1p(math.exp(float(w.gate_w[e] @ xt)))) for e in range(m.n_routed_experts)]
        if w.tid2eid is not None:
            chosen = [int(e) for e in w.tid2eid[token_ids[t]]]
        else:
            biased = [scores[e] + float(w.gate_bias[e]) for e in range(m.n_routed_experts)]
            chosen = sorted(range(m.n_routed_experts), key=lambda e: (-biased[e], e))[: m.num_experts_per_tok]
        total = sum(scores[e] for e in chosen)
        for e in chosen:
            g = np.minimum(w.w1[e] @ xt, lim)
            u = np.clip(w.w3[e] @ xt, -lim, lim)
            out[t] += w.w2[e] @ (scores[e] / total * m.routed_scaling_factor * _silu(g) * u)
        out[t] += w.shared_w2 @ (_silu(w.shared_w1 @ xt) * (w.shared_w3 @ xt))
    return out


@pytest.mark.parametrize("hash_layer", [False, True])
def test_moe_matches_loop(hash_layer: bool):
    rng = np.random.default_rng(10 + hash_layer)
    w = _weights(rng, hash_layer=hash_layer)
    x = rng.standard_normal((37, TINY.hidden_size)).astype(np.float32)
    ids = rng.integers(0, TINY.vocab_size, 37)
    got = moe(x, w, TINY, token_ids=ids)
    _close(got, _loop_moe(x, w, ids))


def test_clamp_is_exercised_and_matters():
    rng = np.random.default_rng(12)
    w = _weights(rng, hash_layer=False)
    x = (rng.standard_normal((8, TINY.hidden_size)) * 4).astype(np.float32)
    pre = x @ w.w1[0].T
    assert (pre > TINY.moe.swiglu_limit).any()  # the inputs really reach the clamp
    unclamped = TINY.model_copy(update={"moe": TINY.moe.model_copy(update={"swiglu_limit": 0.0})})
    assert np.abs(moe(x, w, TINY) - moe(x, w, unclamped)).max() > 1e-2


def test_gate_bias_shifts_choice_not_weights():
    rng = np.random.default_rng(13)
    w = _weights(rng, hash_layer=False)
    x = rng.standard_normal((16, TINY.hidden_size)).astype(np.float32)
    big = np.zeros(TINY.moe.n_routed_experts, np.float32)
    big[[1, 3]] = 100.0
    import attrs

    wts, ids = route(x, attrs.evolve(w, gate_bias=big), TINY)
    assert (np.sort(ids, axis=1) == [1, 3]).all()
    np.testing.assert_allclose(wts.sum(axis=1), TINY.moe.routed_scaling_factor, rtol=1e-6)


def test_live_mask_zero_rows_and_permutation_invariance():
    rng = np.random.default_rng(14)
    w = _weights(rng, hash_layer=False)
    x = rng.standard_normal((12, TINY.hidden_size)).astype(np.float32)
    live = np.ones(12, bool)
    live[[3, 11]] = False
    got = moe(x, w, TINY, live=live)
    assert not got[[3, 11]].any()
    perm = rng.permutation(12)
    ref, ref_live = moe(x, w, TINY), moe(x[live], w, TINY)
    # permuted or fewer rows sit elsewhere in the expert matmuls' blocks: two summation orders over the MoE chain
    # (gate D, up D, down I), so |diff| <= eps32 * sqrt(2D + I) * max|out| (tests/tolerances.py; measured <= 0.2 of
    # it over 40 seeds and 4 OpenBLAS kernels). Elementwise rtol cannot hold where outputs cancel to ~0.
    atol = order_atol(ref, moe_reductions(TINY))
    assert np.abs(ref[[1, 0]] - ref[[0, 1]]).max() > 100 * atol  # the bound sees one swapped row
    np.testing.assert_allclose(moe(x[perm], w, TINY)[np.argsort(perm)], ref, rtol=0, atol=atol)
    np.testing.assert_allclose(got[live], ref_live, rtol=0, atol=order_atol(ref_live, moe_reductions(TINY)))


def test_hash_layer_needs_token_ids():
    rng = np.random.default_rng(15)
    w = _weights(rng, hash_layer=True)
    with pytest.raises(ValueError, match="token_ids"):
        moe(np.ones((2, TINY.hidden_size), np.float32), w, TINY)
