"""MoE gate and experts against per-token loop implementations written from DeepSeek-V4's math (fp32) and from
upstream's a2a3 W8A8 goldens (a2a3)."""

from __future__ import annotations

import math

import attrs
import ml_dtypes
import numpy as np
import pytest
from tolerances import bf16_ulp, moe_reductions, order_atol

from dspark_abi import ABIError
from dspark_abi.presets import TINY
from dspark_kernels.model.block_weights import ExpertStack, MoEWeights
from dspark_kernels.model.numerics import rms_norm
from dspark_kernels.reference.moe import moe, quantized_gate, route

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
        # the shared expert clamps like the routed ones (DeepSeek's DSpark release of inference/model.py)
        g = np.minimum(w.shared_w1 @ xt, lim)
        u = np.clip(w.shared_w3 @ xt, -lim, lim)
        out[t] += w.shared_w2 @ (_silu(g) * u)
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


@pytest.mark.parametrize("precision", ["fp32", "deepseek", "a2a3"])
def test_shared_expert_clamps_in_every_precision(precision: str):
    """Shared-expert pre-activations above ``swiglu_limit`` (and below -limit for the up projection) are clamped
    in every precision, as DeepSeek's DSpark release builds ``Expert(..., swiglu_limit=...)`` for it. The routed
    experts are switched off (zero w2), so the output is the shared expert alone; without the clamp it moves by
    far more than bf16 / int8 rounding (>= 5 %, the shared activations reach several times the limit)."""
    rng = np.random.default_rng(17)
    w = _weights(rng, hash_layer=False)
    w = attrs.evolve(w, w2=np.zeros_like(w.w2))
    x = (rng.standard_normal((8, TINY.hidden_size)) * 4).astype(np.float32)
    lim = TINY.moe.swiglu_limit
    g, u = x @ w.shared_w1.T, x @ w.shared_w3.T
    assert (g > 3 * lim).any() and (u < -3 * lim).any()  # the inputs really reach the clamp, on both sides
    x64 = x.astype(np.float64)
    g64, u64 = np.minimum(x64 @ w.shared_w1.T, lim), np.clip(x64 @ w.shared_w3.T, -lim, lim)
    want = (g64 / (1 + np.exp(-g64)) * u64) @ w.shared_w2.T.astype(np.float64)
    got = moe(x, w, TINY, precision=precision)
    raw = x64 @ w.shared_w1.T
    unclamped = (raw / (1 + np.exp(-raw)) * (x64 @ w.shared_w3.T)) @ w.shared_w2.T.astype(np.float64)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    # fp32: summation order only (measured 1.6e-7); a2a3: int8 x, weights and h (each <= 1/254 of its row's
    # amax, measured 2.1e-2); deepseek: e4m3 x and h (3 mantissa bits: <= 2**-4 per element, rms ~2**-4/sqrt(3)
    # each, measured 7.0e-2) and bf16 outputs. Without the clamp the output is ~0.9 away (measured in all three).
    assert rel < {"fp32": 1e-5, "a2a3": 5e-2, "deepseek": 0.15}[precision], rel
    assert np.linalg.norm(got - unclamped) / np.linalg.norm(unclamped) > 0.5


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


def test_norm_is_applied_by_the_stage():
    """With ``norm`` the stage gets hc_pre's x_mixed rows and applies ffn_norm itself (the layer passes it so)."""
    rng = np.random.default_rng(16)
    w = _weights(rng, hash_layer=False)
    x = (rng.standard_normal((9, TINY.hidden_size)) * 3).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(TINY.hidden_size)).astype(np.float32)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + TINY.rms_norm_eps) * norm
    _close(moe(x, w, TINY, norm=norm), _loop_moe(normed.astype(np.float32), w, np.zeros(9, int)))


# --- a2a3: upstream's W8A8 MoE, restated token by token from its goldens -----------------------------------------
def _bf16(v):
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _int8_rows(v):
    """upstream's int8q: amax floored at 1e-4, q = rint(v * (127 / amax)), dequant 1 / (127 / amax)."""
    v = np.asarray(v, np.float32)
    sq = np.float32(127) / np.maximum(np.abs(v).max(), np.float32(1e-4))
    return np.rint(v * sq), np.float32(1) / sq


def _int8_channels(w):
    """The W8A8 weight rule (pypto-lib expert_shared.py golden): scale = max(amax, 1e-4) / 127, q = rint(w / scale)."""
    s = (np.maximum(np.abs(w).max(axis=1), np.float32(1e-4)) / np.float32(127)).astype(np.float32)
    return np.rint(w / s[:, None]), s


def _a2a3_restated(x, w: MoEWeights, norm, token_ids, cfg=TINY, *, shared_clamp=True, requant_h=True,
                   bf16_per_expert=True):
    """Per token: gate_golden_core (deferred norm, fp32 gate), expert goldens (int8 x and weights, clamp, int8
    h, h_q * (h_scale * w) @ w2, bf16 per expert), shared expert (clamped), combine in slot order, bf16."""
    m, lim = cfg.moe, np.float32(cfg.moe.swiglu_limit)
    quant = {}

    def q(name, e=None):
        key = (name, e)
        if key not in quant:
            quant[key] = _int8_channels(getattr(w, name) if e is None else getattr(w, name)[e])
        return quant[key]

    def ffn(xq, xs, w1, w3, w2, row_w, clamp):
        g = (np.float32(w1[0] @ xq) * xs * w1[1]).astype(np.float32)           # integer dots: exact in float64
        u = (np.float32(w3[0] @ xq) * xs * w3[1]).astype(np.float32)
        if clamp:
            g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
        h = g * (np.float32(1) / (np.float32(1) + np.exp(-g))) * u
        if not requant_h:
            return np.float32(w2[0] @ h.astype(np.float64)) * row_w * w2[1]
        hq, hs = _int8_rows(h)
        return np.float32(w2[0] @ hq) * (hs * row_w) * w2[1]

    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        xt = x[t].astype(np.float32)
        inv = np.float32(1) / np.sqrt(np.float32(xt.astype(np.float64) @ xt) * np.float32(1 / xt.size)
                                      + np.float32(cfg.rms_norm_eps))
        xg = xt * _bf16(norm)
        xq, xd = _int8_rows(xg)
        xq, xs = xq.astype(np.float64), xd * inv
        logits = np.float32(w.gate_w.astype(np.float64) @ xg) * inv
        s = np.sqrt(np.maximum(logits, 0) + np.log1p(np.exp(-np.abs(logits))))
        if w.tid2eid is not None:
            chosen = [int(e) for e in w.tid2eid[token_ids[t]]]
        else:
            biased = s + w.gate_bias
            chosen = sorted(range(m.n_routed_experts), key=lambda e: (-biased[e], e))[: m.num_experts_per_tok]
        vals = s[chosen]
        route = vals / vals.sum() * np.float32(m.routed_scaling_factor)
        acc = _bf16(ffn(xq, xs, q("shared_w1"), q("shared_w3"), q("shared_w2"), np.float32(1), shared_clamp))
        for e, rw in zip(chosen, route, strict=True):
            y = ffn(xq, xs, q("w1", e), q("w3", e), q("w2", e), np.float32(rw), True)
            acc = acc + (_bf16(y) if bf16_per_expert else y)
        out[t] = _bf16(acc)
    return out


#: The a2a3 reference against the restatement: the integer products are exact on both sides and the elementwise fp32
#: steps are the same; only the order of the gate's logits and sum of squares differs (float64 dots here vs BLAS),
#: which moves x_scale and the scores by an ulp and so can flip an int8 rounding of ``h`` or a bf16 rounding (one bf16
#: step of one element). Measured over 12 seeds x 2 layer kinds: bit-identical. Allowed: 2 % of elements, 2 bf16
#: steps each. The broken variants below (no shared clamp, no int8 h, no bf16 per expert) move >= 29 % (measured).
A2A3_MAX_DIFFERING, A2A3_MAX_STEPS = 0.02, 2.0


def _a2a3_case(seed, hash_layer):
    rng = np.random.default_rng([40, seed, hash_layer])
    w = _weights(rng, hash_layer=hash_layer)
    w = MoEWeights(**{f: (v if not isinstance(v, np.ndarray) or v.dtype.kind in "iu" else _bf16(v))
                      for f, v in attrs.asdict(w, recurse=False).items()})
    x = _bf16(rng.standard_normal((24, TINY.hidden_size)) * 2)
    norm = _bf16(1 + 0.1 * rng.standard_normal(TINY.hidden_size))
    return w, x, norm, rng.integers(0, TINY.vocab_size, 24)


def _steps(got, want):
    """(fraction of differing elements, largest difference in bf16 steps of the expected value)."""
    return float(np.mean(got != want)), float((np.abs(got - want) / bf16_ulp(want)).max())


@pytest.mark.parametrize("hash_layer", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a2a3_moe_matches_the_w8a8_restatement(seed, hash_layer):
    w, x, norm, ids = _a2a3_case(seed, hash_layer)
    got = moe(x, w, TINY, norm=norm, token_ids=ids, precision="a2a3")
    differing, steps = _steps(got, _a2a3_restated(x, w, norm, ids))
    assert differing <= A2A3_MAX_DIFFERING and steps <= A2A3_MAX_STEPS, (differing, steps)
    for broken in (dict(shared_clamp=False), dict(requant_h=False), dict(bf16_per_expert=False)):
        worse, _ = _steps(got, _a2a3_restated(x, w, norm, ids, **broken))
        assert worse > 5 * A2A3_MAX_DIFFERING, (broken, worse)  # the comparison sees each numerics point


def test_a2a3_int8_activations_are_per_token_of_the_unnormalised_rows():
    """The gate quantises xg = x * norm (the RMS factor rides the scale, as upstream's deferred norm), never a bf16
    copy of the normalised row: the int8 codes equal int8q(x * norm), the scale amax / 127 / rms."""
    w, x, norm, _ = _a2a3_case(0, False)
    g = quantized_gate(x, w, TINY, norm=norm)
    for t in range(x.shape[0]):
        q, d = _int8_rows(x[t] * norm)
        rms = np.sqrt(np.mean(x[t].astype(np.float64) ** 2) + TINY.rms_norm_eps)
        np.testing.assert_array_equal(g.x_q[t], q)
        np.testing.assert_allclose(g.x_scale[t], d / rms, rtol=1e-6)  # sum-of-squares order: 1.7e-7 (12 seeds)
    normed = _bf16(rms_norm(x, norm, TINY.rms_norm_eps))
    assert (quantized_gate(normed, w, TINY).x_q != g.x_q).any()  # bf16 normalised rows would quantise differently


def test_a2a3_uses_a_checkpoints_stored_int8_experts():
    """A stored W8A8 expert (``ExpertStack.int8``) is used as stored; without one the float expert is quantised
    when a token reaches it (a streaming stack reads it then)."""
    w, x, norm, _ = _a2a3_case(1, False)
    floats = moe(x, w, TINY, norm=norm, precision="a2a3")
    names = ("w1", "w2", "w3")
    lazy = attrs.evolve(w, **{n: ExpertStack(getattr(w, n).shape, getattr(w, n).__getitem__) for n in names})
    np.testing.assert_array_equal(moe(x, lazy, TINY, norm=norm, precision="a2a3"), floats)

    def stored(name):  # the float read is 1.5x off: only the stored int8 gives ``floats``
        arr = getattr(w, name)
        return ExpertStack(arr.shape, lambda e: arr[e] * np.float32(1.5), lambda e: _int8_channels(arr[e]))

    with_int8 = attrs.evolve(w, **{n: stored(n) for n in ("w1", "w2", "w3")})
    np.testing.assert_array_equal(moe(x, with_int8, TINY, norm=norm, precision="a2a3"), floats)
    off = attrs.evolve(w, **{n: getattr(w, n) * np.float32(1.5) for n in ("w1", "w2", "w3")})
    assert np.mean(moe(x, off, TINY, norm=norm, precision="a2a3") != floats) > 0.5  # the floats would be seen


def test_a2a3_padding_rows_are_zero_and_expert_ids_are_checked():
    w, x, norm, ids = _a2a3_case(2, True)
    live = np.ones(x.shape[0], bool)
    live[[0, 7]] = False
    got = moe(x, w, TINY, norm=norm, token_ids=ids, live=live, precision="a2a3")
    assert not got[~live].any()
    np.testing.assert_array_equal(got[live], moe(x[live], w, TINY, norm=norm, token_ids=ids[live], precision="a2a3"))
    bad = attrs.evolve(w, tid2eid=np.full_like(w.tid2eid, TINY.moe.n_routed_experts))
    with pytest.raises(ABIError) as err:
        moe(x, bad, TINY, norm=norm, token_ids=ids, precision="a2a3")
    assert err.value.codes == {"config.mismatch"}


def test_a2a3_gate_inv_rms_is_upstreams_torch_reduction_bit_for_bit():
    """The deferred ffn RMSNorm of the a2a3 gate: ``rsqrt(sum(x * x) * (1 / D) + eps)`` with torch's CPU sum, as
    upstream's ``golden_gate_core``, at FLASH's D = 4096: the rows' dequant scales (``amax / 127 * inv_rms``) equal
    the torch-computed ones bit for bit (with an fp32 einsum inv_rms differed on all 64 rows, measured)."""
    import torch  # the test extra installs it; the library never imports it

    from dspark_kernels.model.numerics import int8_quantize

    rng = np.random.default_rng(21)
    d, e = 4096, TINY.moe.n_routed_experts
    x = _bf16(rng.standard_normal((64, d)) * rng.uniform(0.01, 20, (64, 1)))
    norm = _bf16(1 + 0.1 * rng.standard_normal(d))
    w = MoEWeights(gate_w=(rng.standard_normal((e, d)) * 0.02).astype(np.float32),
                   gate_bias=np.zeros(e, np.float32), tid2eid=None, w1=np.zeros((e, 1, d), np.float32),
                   w2=np.zeros((e, d, 1), np.float32), w3=np.zeros((e, 1, d), np.float32))
    gate = quantized_gate(x, w, TINY, norm=norm)
    t = torch.from_numpy(x)
    inv = torch.rsqrt((t * t).sum(dim=-1, keepdim=True) * (1.0 / d) + TINY.rms_norm_eps).numpy()[:, 0]
    _, dq = int8_quantize(x * norm)
    np.testing.assert_array_equal(gate.x_scale, (dq * inv).astype(np.float32))
