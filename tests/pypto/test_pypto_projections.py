"""Stage 2 (q and kv projections) and stage 7 (grouped o_proj) against the reference in a2a3 precision.

Tolerances come from the measured error distribution (docs/pypto.md): over 5 seeds on this fixture the
kernels matched the reference bit for bit (q, kv, qr_q, o_proj: 0 differing elements; qr_scale max relative
error 2.3e-7, fp32 division order). Bit-exactness is not guaranteed by the math: fp32 matmul accumulation
order may differ between torch (the interpreter) and numpy, which can flip a bf16 rounding or an int8
rounding. The bounds below allow that (one bf16 ulp, one int8 step) on a small fraction of elements.
"""

from types import SimpleNamespace

import numpy as np
import pypto_cases
import pytest
from pypto_fixtures import CONFIG, SEED, hidden_rows, packed_batch
from tolerances import BF16_ATOL, BF16_RTOL, MAX_DIFFERING_FRACTION

from dspark_abi.presets import FLASH
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.numerics import bf16_round
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.model.rope import rope_at
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference.o_proj import output_projection
from dspark_kernels.reference.projections import low_rank_query, query_heads, shared_kv

pytestmark = pytest.mark.pypto

#: An int8 activation may move by one step when its pre-rounding value sits on a rounding boundary.
INT8_STEP = 1.0
#: Dequant scales are one fp32 division each (127 / amax, then 1 / scale).
SCALE_RTOL = 1e-6


def _close_bf16(got: np.ndarray, want: np.ndarray, name: str) -> None:
    assert got.shape == want.shape, name
    assert np.isfinite(got).all(), name
    np.testing.assert_allclose(got, want, rtol=BF16_RTOL, atol=BF16_ATOL, err_msg=name)
    assert np.mean(got != want) <= MAX_DIFFERING_FRACTION, name


@pytest.mark.parametrize("kind_layer", [("swa", 0), ("csa", 1)], ids=lambda k: k[0])
def test_q_and_kv_projections_match_reference(kind_layer):
    kind, layer = kind_layer
    batch = packed_batch()
    w = prepare_weights(AttentionWeights.random(CONFIG, layer, seed=SEED), "a2a3")
    x = hidden_rows(batch)
    eps = CONFIG.rms_norm_eps
    cos_full, sin_full = rope_at(CONFIG, kind, batch.positions, "a2a3")
    cases, expected = [], []
    for r in range(batch.tp_size):
        rows = slice(batch.rank(r).row_start, batch.rank(r).row_stop)
        lrq = low_rank_query(x[rows], w, eps, "a2a3")
        q = query_heads(lrq, w, cos_full[rows], sin_full[rows], CONFIG.num_attention_heads, eps, "a2a3")
        expected.append((q, lrq.qr_q, lrq.qr_scale))
        cases.append((x[rows], x, w, cos_full[rows], sin_full[rows], cos_full, sin_full,
                      CONFIG.num_attention_heads, eps))
    kv_ref = shared_kv(x, w, cos_full, sin_full, eps, "a2a3")
    for (q_ref, qr_q_ref, qr_scale_ref), (q, qr_q, qr_scale, kv) in zip(expected, run_isolated(
            pypto_cases.projections_many, cases), strict=True):
        _close_bf16(q, q_ref, "q")
        assert np.abs(qr_q - qr_q_ref).max() <= INT8_STEP
        assert np.mean(qr_q != qr_q_ref) <= MAX_DIFFERING_FRACTION
        np.testing.assert_allclose(qr_scale[:, 0], qr_scale_ref, rtol=SCALE_RTOL)
        _close_bf16(kv, kv_ref, "kv")


def test_shared_kv_split_over_k_matches_reference_at_flash_widths():
    # FLASH's X = 4096 splits x @ wkv.T into K slices added in the epilogue: a summation order of its own
    x_dim, d, rd, rows = FLASH.hidden_size, FLASH.head_dim, FLASH.qk_rope_head_dim, 48
    rng = np.random.default_rng(SEED)
    x = bf16_round(rng.standard_normal((rows, x_dim)).astype(np.float32))
    w = SimpleNamespace(wkv=bf16_round((rng.standard_normal((d, x_dim)) / np.sqrt(x_dim)).astype(np.float32)),
                        kv_norm=bf16_round(rng.uniform(0.5, 1.5, d).astype(np.float32)))
    angle = rng.uniform(0, 2 * np.pi, (rows, rd // 2))
    cos, sin = bf16_round(np.cos(angle).astype(np.float32)), bf16_round(np.sin(angle).astype(np.float32))
    eps = FLASH.rms_norm_eps
    kv, slices = run_isolated(pypto_cases.shared_kv_slices, x, w.wkv, w.kv_norm, cos, sin, eps)
    assert slices > 1  # the case exercises the split
    want = shared_kv(x, w, cos, sin, eps, "a2a3")
    # Two fp32 orders of a K-long dot product differ by ~sqrt(K) u sum|x w| (random-walk rounding; 4x margin),
    # scaled by the RMS normalisation and norm weight, and through RoPE by |cos| + |sin|; then each side rounds
    # to bf16 (one step of the value). Measured: 0.02 - 0.04 % of elements differ, by at most 0.002.
    latent = x.astype(np.float64) @ w.wkv.T.astype(np.float64)
    inv_rms = 1 / np.sqrt(np.mean(latent**2, axis=1, keepdims=True) + eps)
    spread = 4 * np.sqrt(x_dim) * 2.0**-24 * (np.abs(x) @ np.abs(w.wkv).T) * inv_rms * w.kv_norm
    spread[:, d - rd:] *= np.repeat(np.abs(cos) + np.abs(sin), 2, axis=1)
    np.testing.assert_array_less(np.abs(kv - want), spread + BF16_RTOL * np.abs(want) + BF16_ATOL)
    assert np.mean(kv != want) <= MAX_DIFFERING_FRACTION


def test_grouped_o_proj_matches_reference():
    batch = packed_batch()
    rng = np.random.default_rng(SEED)
    heads_dim = CONFIG.num_attention_heads * CONFIG.head_dim
    cases, expected = [], []
    for seed in (SEED, SEED + 1):
        w = prepare_weights(AttentionWeights.random(CONFIG, 0, seed=seed), "a2a3")
        attn = bf16_round(rng.standard_normal((batch.local_rows, heads_dim)).astype(np.float32))
        attn[batch.rank(1).local_request_ids < 0] = 0  # a padding row
        cases.append((attn, w))
        expected.append(output_projection(attn, w, "a2a3"))
    for got, want in zip(run_isolated(pypto_cases.o_proj_many, cases), expected, strict=True):
        # an int8 flip of one activation moves the output by <= one step of that group's scale
        _close_bf16(got, want, "o_proj")
