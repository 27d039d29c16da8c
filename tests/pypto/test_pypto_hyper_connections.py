"""hc_pre (sum of squares, cube-order mix, gates, 20-step Sinkhorn, stream mix) and hc_post against the reference
in a2a3 precision, on the packed TINY rows of ``packed_batch`` (P = 10, one zero padding row).

Measured (docs/pypto.md): 4 seeds x 2 gate scales x 64 random rows, and 3 seeds x 2 gate scales x both chain
forms on the fixture below (12 cases), with the kernel's default 4-column chain and with one matmul per K slice:

* hc_pre ``x_mixed`` (bf16): at most 1 differing element per case (1 of 8192 or 1 of 1280; only with the
  SWA-like gate scale): a bf16 rounding flipped by the mixes' or the gate's last fp32 bit. Either one bf16 step
  (relative <= 6.6e-3 < 2**-7, up to 3.05e-5 absolute) or, where a row's streams cancel to ~5e-7, a few bf16
  steps of that tiny value (<= 2.2e-8 absolute).
* ``post``: 10-40 % of elements differ, by at most 2.4e-7 absolute (one fp32 ulp of values in [1, 2)) and 2.5e-7
  relative: torch's ``exp`` in the interpreter against numpy's, and the mixes' last bits.
* ``comb``: 65-80 % of elements differ (the exp differences carried through 20 normalisation rounds), by at most
  1.8e-7 absolute and 1.4e-6 relative.
* hc_post: bit-exact (the same fp32 multiplies and adds in the same order).
* the fused sub-block RMSNorm ``x_normed = bf16(rms(x_mixed, norm))`` (X = 128): torch's and numpy's sums of the
  X squares differ by at most ~X u relative (u = 2**-24; 8e-6 << one bf16 step, 2**-8), so an element is equal or
  one bf16 step apart. Measured (3 seeds x 2 gate scales): against the norm of the kernel's own x_mixed, 0
  differing elements; against the reference's x_mixed, 1 element in one case (x_mixed's flip of a cancelling
  element above, 3e-7 after the norm).
"""

import numpy as np
import pytest
from pypto_fixtures import CONFIG, SEED, packed_batch

# x_mixed: one bf16 step where a rounding flips, plus the near-zero floor of rows whose streams cancel
from tolerances import BF16_ATOL_CANCELLING as BF16_ATOL
from tolerances import BF16_RTOL, MAX_DIFFERING_FRACTION

from dspark_kernels.model.block_weights import HcWeights
from dspark_kernels.model.numerics import bf16_round, rms_norm
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference import hyper_connections as ref

pytestmark = pytest.mark.pypto

#: post in (0, 2): measured <= 2.4e-7 absolute, 2.5e-7 relative; 4x margin.
POST_RTOL, POST_ATOL = 1e-6, 1e-6
#: comb in (0, 1]: measured <= 1.8e-7 absolute, 1.4e-6 relative (small entries); 5-7x margin.
COMB_RTOL, COMB_ATOL = 1e-5, 1e-6
#: Gate scales of the pre gate: SWA-like (amplifies the mixes' last bits into x_mixed) and CSA-like.
PRE_SCALES = (2.08, 0.076)


def _inputs(seed: int, pre_scale: float) -> tuple[np.ndarray, HcWeights]:
    batch = packed_batch()
    hc, d = CONFIG.hc_mult, CONFIG.hidden_size
    rows = (2 + hc) * hc
    rng = np.random.default_rng([seed, 17])
    w = HcWeights(fn=(rng.standard_normal((rows, hc * d)) * 0.05).astype(np.float32),
                  scale=np.array([pre_scale, 0.032, 0.226], np.float32),
                  base=(rng.standard_normal(rows) * 2.0).astype(np.float32))
    x = (rng.standard_normal((batch.padded_rows, hc, d)) * 0.05).astype(np.float32)
    x[batch.row_request < 0] = 0
    return x, w


# --- run in the child process (run_isolated imports this module there) ------------------------------------

def hc_pre_many(cases: list[tuple]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per (x_hc, weights, k_step): the kernel's (x_mixed, post, comb)."""
    from dspark_kernels.pypto.hyper_connections import hc_pre

    out = []
    for x, w, k_step in cases:
        r = hc_pre(x, w, CONFIG, k_step=k_step)
        out.append((r.x_mixed, r.post, r.comb))
    return out


def hc_pre_normed_many(cases: list[tuple]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per (x_hc, weights, norm): the kernel's (x_mixed, x_normed)."""
    from dspark_kernels.pypto.hyper_connections import hc_pre

    out = []
    for x, w, norm in cases:
        r = hc_pre(x, w, CONFIG, norm=norm)
        out.append((r.x_mixed, r.x_normed))
    return out


def hc_post_many(cases: list[tuple]) -> list[np.ndarray]:
    """Per (out, x_hc, post, comb): the kernel's y [T, hc, X]."""
    from dspark_kernels.pypto.hyper_connections import hc_post

    return [hc_post(*case) for case in cases]


def kernel_perms() -> list[int]:
    from dspark_kernels.pypto import hyper_connections as k

    return k.butterfly_perms(4).tolist()


def hc_post_bad_output() -> None:
    from dspark_kernels.pypto.hyper_connections import run_hc_post

    x = np.zeros((8, 4, 16), np.float32)
    run_hc_post(np.full((8, 16), 1.0 + 2.0**-12, np.float32), x, np.ones((8, 4), np.float32),
                np.ones((8, 4, 4), np.float32))


# --- tests --------------------------------------------------------------------------------------------------

def test_hc_pre_matches_reference():
    cases, expected = [], []
    split = ref.cube_padded_width(CONFIG.hc_mult * CONFIG.hidden_size) // ref.HC_K_SPLITS
    for seed in (SEED, SEED + 1):
        for pre_scale in PRE_SCALES:
            x, w = _inputs(seed, pre_scale)
            cases.append((x, w, ref.CUBE_MAD_K))
            expected.append(ref.hc_pre(x, w, CONFIG, precision="a2a3"))
    x, w = _inputs(SEED + 2, PRE_SCALES[0])
    cases.append((x, w, split))  # the hardware form: one matmul per K slice
    expected.append(ref.hc_pre(x, w, CONFIG, precision="a2a3"))
    padding = packed_batch().row_request < 0
    for (x_mixed, post, comb), want in zip(run_isolated(hc_pre_many, cases), expected, strict=True):
        assert np.isfinite(x_mixed).all() and np.isfinite(post).all() and np.isfinite(comb).all()
        np.testing.assert_allclose(x_mixed, want.x_mixed, rtol=BF16_RTOL, atol=BF16_ATOL)
        assert np.mean(x_mixed != want.x_mixed) <= MAX_DIFFERING_FRACTION
        assert not x_mixed[padding].any()
        np.testing.assert_allclose(post, want.post, rtol=POST_RTOL, atol=POST_ATOL)
        np.testing.assert_allclose(comb, want.comb, rtol=COMB_RTOL, atol=COMB_ATOL)


def test_hc_pre_fuses_the_sub_block_norm():
    """``hc_pre(..., norm=w)`` also returns the layer's ``narrow(rms_norm(x_mixed, w))`` (attn_norm / ffn_norm)."""
    cases, expected = [], []
    for seed in (SEED, SEED + 1, SEED + 2):
        for pre_scale in PRE_SCALES:
            x, w = _inputs(seed, pre_scale)
            norm = bf16_round(1.0 + 0.2 * np.random.default_rng([seed, 29]).standard_normal(CONFIG.hidden_size))
            cases.append((x, w, norm))
            expected.append(ref.hc_pre(x, w, CONFIG, precision="a2a3"))
    padding = packed_batch().row_request < 0
    for (_, _, norm), want, (x_mixed, x_normed) in zip(cases, expected, run_isolated(hc_pre_normed_many, cases),
                                                        strict=True):
        np.testing.assert_allclose(x_mixed, want.x_mixed, rtol=BF16_RTOL, atol=BF16_ATOL)
        of_own = bf16_round(rms_norm(x_mixed, norm, CONFIG.rms_norm_eps))  # the norm stage alone
        np.testing.assert_allclose(x_normed, of_own, rtol=BF16_RTOL, atol=BF16_ATOL)
        assert np.mean(x_normed != of_own) <= MAX_DIFFERING_FRACTION
        # against the layer's two reference stages: x_mixed's allowed difference, carried through the norm's gain
        # |norm| / rms(x_mixed) (a cancelling element's BF16_ATOL is measured 1.1e-5 after the norm: 3e-7 apart)
        of_reference = bf16_round(rms_norm(want.x_mixed, norm, CONFIG.rms_norm_eps))
        gain = np.abs(norm) / np.sqrt(np.mean(want.x_mixed**2, axis=1, keepdims=True) + CONFIG.rms_norm_eps)
        assert np.all(np.abs(x_normed - of_reference) <= BF16_RTOL * np.abs(of_reference) + BF16_ATOL * gain)
        assert np.mean(x_normed != of_reference) <= MAX_DIFFERING_FRACTION
        assert not x_normed[padding].any()


def test_hc_post_matches_reference_exactly():
    cases, expected = [], []
    for seed in (SEED, SEED + 1):
        x, w = _inputs(seed, PRE_SCALES[0])
        pre = ref.hc_pre(x, w, CONFIG, precision="a2a3")
        rng = np.random.default_rng([seed, 23])
        out = bf16_round(rng.standard_normal(pre.x_mixed.shape).astype(np.float32))  # a bf16 sub-block output
        out[packed_batch().row_request < 0] = 0
        cases.append((out, x, pre.post, pre.comb))
        expected.append(ref.hc_post(out, x, pre.post, pre.comb, precision="a2a3"))
    for got, want in zip(run_isolated(hc_post_many, cases), expected, strict=True):
        np.testing.assert_array_equal(got, want)
        assert not got[packed_batch().row_request < 0].any()


def test_butterfly_perms_and_input_checks():
    # the order constants (HC_K_SPLITS, CUBE_MAD_K, RMS_CHUNK) have one home, dspark_kernels.model.numerics
    # (tests/test_architecture.py checks that)
    perms = run_isolated(kernel_perms)
    j = np.arange(16)
    assert perms == np.concatenate([j ^ 1, j ^ 2, j ^ 4, j ^ 8]).tolist()
    with pytest.raises(ValueError, match="bf16"):
        run_isolated(hc_post_bad_output)
