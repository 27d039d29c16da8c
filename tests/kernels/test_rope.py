"""RoPE frequencies (YaRN), tables, and the interleaved rotation."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from tolerances import EPS32, assert_close

from dspark_abi.presets import DEMO, FLASH, TINY, TINY_1M
from dspark_kernels.model.numerics import bf16_round
from dspark_kernels.model.rope import apply_rope, inverse_frequencies, rope_at


def test_flash_yarn_ramp():
    """Compressed FLASH layers: pairs 0-15 keep omega, 25-31 get omega/16, 16-24 are blended."""
    plain = 1.0 / 160000.0 ** (np.arange(0, 64, 2) / 64)
    got = inverse_frequencies(FLASH, "csa")
    np.testing.assert_allclose(got[:16], plain[:16], rtol=1e-6)
    np.testing.assert_allclose(got[25:], plain[25:] / 16, rtol=1e-6)
    ramp = (np.arange(16, 25) - 15) / 10  # low 15, high 25
    np.testing.assert_allclose(got[16:25], plain[16:25] * (1 - ramp) + plain[16:25] / 16 * ramp, rtol=1e-6)
    np.testing.assert_allclose(got[16] / plain[16], 0.90625, rtol=1e-6)


def test_swa_and_no_yarn_profiles():
    np.testing.assert_allclose(inverse_frequencies(FLASH, "swa"), 1.0 / 1e4 ** (np.arange(0, 64, 2) / 64), rtol=1e-6)
    # DEMO: original_max_position_embeddings == 0 -> plain compress theta
    np.testing.assert_allclose(inverse_frequencies(DEMO, "hca"), 1.0 / 4e4 ** (np.arange(0, 64, 2) / 64), rtol=1e-6)


def test_angles_at_positions_and_bf16_gather():
    omega = inverse_frequencies(TINY, "csa")
    pos = np.array([0, 5, 4095])
    cos, _ = rope_at(TINY, "csa", pos)
    # the angle is the float32 product p * omega (exact for p < 2**24), whatever positions are asked together
    np.testing.assert_array_equal(cos, np.cos(pos.astype(np.float32)[:, None] * omega[None, :]))
    np.testing.assert_array_equal(rope_at(TINY, "csa", pos[1:2])[0][0], cos[1])
    c, s = rope_at(TINY, "csa", pos, "a2a3")
    np.testing.assert_array_equal(c[0], 1.0)
    np.testing.assert_allclose(c[1], cos[1], rtol=2**-8)  # round to nearest bf16: <= 2**-8 relative, exactly
    np.testing.assert_array_equal(bf16_round(s), s)


def test_angles_at_the_real_depth_cost_only_the_positions_asked():
    top = TINY_1M.max_position_embeddings - 1
    cos, sin = rope_at(TINY_1M, "hca", np.array([top, 16384]))
    assert cos.shape == (2, 32) and np.isfinite(cos).all()
    # cos^2 + sin^2 = 1 within two fp32 roundings of values <= 1 (<= 4 eps32)
    assert_close(cos**2 + sin**2, np.ones_like(cos), 4 * EPS32, "unit circle")


def test_rotation_against_complex_loop():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 10), dtype=np.float32)  # 4 nope dims + 3 interleaved pairs
    ang = rng.uniform(-3, 3, (3, 3)).astype(np.float32)
    out = apply_rope(x, np.cos(ang), np.sin(ang))
    for t in range(3):
        for h in range(2):
            np.testing.assert_array_equal(out[t, h, :4], x[t, h, :4])
            for i in range(3):
                e, o = x[t, h, 4 + 2 * i], x[t, h, 5 + 2 * i]
                z = complex(e, o) * np.exp(1j * float(ang[t, i]))
                # fp32 cos/sin within 2 ulp (<= eps32 each) plus 3 roundings (<= eps32 in all) of values bounded by
                # |e| + |o|: <= 2 eps32 * (|e| + |o|), also where e cos - o sin cancels; 2x headroom (measured 0.9)
                assert_close(out[t, h, 4 + 2 * i: 6 + 2 * i], np.array([z.real, z.imag]),
                             4 * EPS32 * (abs(float(e)) + abs(float(o))), f"row {t} head {h} pair {i}")


@given(st.integers(0, 4095), st.integers(0, 4095))
def test_inverse_and_relative_position(p1, p2):
    rng = np.random.default_rng(p1 * 4096 + p2)
    q, k = rng.standard_normal((2, 1, 128), dtype=np.float32)
    cq, sq = rope_at(TINY, "csa", np.array([p1]))
    ck, sk = rope_at(TINY, "csa", np.array([p2]))
    # two rotations of <= 2 eps32 * (|e| + |o|) <= 4 eps32 * max|q| each (see above) and cos^2 + sin^2 = 1 only to
    # ~2 eps32: <= 11 eps32 * max|q| (measured <= 1.7)
    np.testing.assert_allclose(apply_rope(apply_rope(q, cq, sq), cq, sq, inverse=True), q, rtol=0,
                               atol=16 * EPS32 * float(np.abs(q).max()))
    # <R(p1) q, R(p2) k> depends on p1 - p2 only: compare against shifting both to (p1 - p2, 0)
    d = p1 - p2
    c0, s0 = rope_at(TINY, "csa", np.array([abs(d)]))
    lhs = float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())
    q2, k2 = (apply_rope(q, c0, s0), k) if d >= 0 else (q, apply_rope(k, c0, s0))
    np.testing.assert_allclose(lhs, float((q2 * k2).sum()), rtol=0, atol=_relative_position_bound(q, k, p1, p2))


def _relative_position_bound(q: np.ndarray, k: np.ndarray, p1: int, p2: int) -> float:
    """Bound on |<R(p1) q, R(p2) k> - <R(p1 - p2) q, k>| in fp32: the tables hold fl(p * omega), so the three angles
    carry <= u * p * omega each (u = eps32 / 2), which grows with position (~1e-3 at p ~ 4000); cos/sin add
    <= 4 eps32 per pair; each pair contributes |q_pair| |k_pair| times that; the two 128-term fp32 sums add
    eps32 * sqrt(128) * sum|q k| each (tests/tolerances.py). Measured <= 0.3 of it; a one-position shift moves
    the pair with omega = 1 by ~|q_pair| |k_pair| >> bound."""
    omega = inverse_frequencies(TINY, "csa").astype(np.float64)
    qe, qo, ke, ko = (a[0, s::2].astype(np.float64) for a in (q, k) for s in (-64, -63))
    amp = np.hypot(qe, qo) * np.hypot(ke, ko)
    angle = EPS32 / 2 * omega * (p1 + p2 + abs(p1 - p2))
    sums = 2 * EPS32 * np.sqrt(q.shape[-1]) * float(np.abs(q.astype(np.float64) * k).sum())
    return float((amp * (angle + 4 * EPS32)).sum()) + sums
