"""The numerics helpers at the edges of their formulas: mean squares near eps, zero rows, constant rows, ties.

On unit-scale rows ``eps`` changes an RMSNorm by ~5e-7 of the output, so a misplaced ``eps`` (outside the square
root, added to the root, dropped) hides in the rounding noise. Rows whose mean square is 0, 1e-2, 0.5, 1, 2 and
100 times ``eps`` make it count: at ``mean(v**2) = eps`` the definition gives ``v / sqrt(2 eps)``, eps outside the
root ``v / (sqrt(eps) + eps)``, 29 % larger.

Every helper is compared with the formula's definition evaluated in float64 on the same float32 inputs. The
tolerance of an fp32 evaluation (any summation order of the mean square: the helpers' and the a2a3 chunked one
alike) is derived in tests/tolerances.py: the mean square of K terms carries at most ``order_rel(K)`` relative
error, the inverse square root halves it, and the root, division and product add one rounding each (3 eps32).
"""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import EPS32, assert_close, order_rel

from dspark_kernels.model.deepseek_numerics import head_rms
from dspark_kernels.model.numerics import bf16_round, int8_quantize, rms_norm
from dspark_kernels.reference.hyper_connections import a2a3_inv_rms, cube_padded_width

#: FLASH's rms_norm_eps.
EPS = 1e-6
#: mean(v**2) / eps of the rows: below, at and above eps, and 0 (a zero row, e.g. padding).
RATIOS = (0.0, 1e-2, 0.5, 1.0, 2.0, 100.0)
#: Row lengths: a head, a chunk of the a2a3 sum of squares, several chunks with a partial last one, FLASH's D.
LENGTHS = (7, 512, 1000, 4096)
#: Relative error of one fp32 evaluation of ``rsqrt(mean(v**2) + eps)``: half the mean square's order bound,
#: then the root and the division (module docstring); the product with v adds one more rounding.
ROUNDINGS = 3


def _rows(k: int, shape: str, seed: int = 0) -> np.ndarray:
    """float32 rows [len(RATIOS), k] whose float64 mean square is RATIOS[i] * EPS (up to the float32 rounding of
    the entries): random signs and magnitudes, or constant rows (every element the largest: ties)."""
    base = np.random.default_rng(seed).standard_normal(k) if shape == "random" else np.ones(k)
    base /= np.sqrt(np.mean(base**2))
    return np.stack([base * np.sqrt(r * EPS) for r in RATIOS]).astype(np.float32)


def _inv_rms64(v: np.ndarray, eps: float = EPS) -> np.ndarray:
    """The definition, float64: ``1 / sqrt(mean(v**2) + eps)`` per row."""
    v64 = v.astype(np.float64)
    return 1.0 / np.sqrt(np.mean(v64 * v64, axis=-1) + eps)


def _tol(k: int, scale: np.ndarray, shape: str = "random") -> np.ndarray:
    """Absolute tolerance per row of an fp32 evaluation whose exact value has magnitude ``scale``.

    Random rows: the probabilistic bound of tests/tolerances.py. Constant rows add K equal terms, whose rounding
    errors do not cancel (they all round the same way), so they take the worst-case bound of a K-term sum,
    ``(K - 1) u`` (u = eps32 / 2; Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 4.4),
    still 2000x below the 29 % a misplaced eps makes at K = 4096.
    """
    mean_sq_rel = order_rel(k) if shape == "random" else (k - 1) * EPS32 / 2
    return (mean_sq_rel / 2 + ROUNDINGS * EPS32) * scale


@pytest.mark.parametrize("shape", ["random", "constant"])
@pytest.mark.parametrize("k", LENGTHS)
def test_rms_norm_follows_its_definition_where_eps_matters(k: int, shape: str):
    v = _rows(k, shape)
    w = (1.0 + np.random.default_rng(1).standard_normal(k) / 4).astype(np.float32)
    want = v.astype(np.float64) * _inv_rms64(v)[:, None]
    scale = np.abs(want).max(axis=1, keepdims=True)
    for weight, expect in ((None, want), (w, want * w)):
        got = rms_norm(v, weight, EPS)
        assert got.dtype == np.float32 and np.isfinite(got).all()
        assert_close(got, expect, _tol(k, scale * (1.0 if weight is None else np.abs(w).max()), shape)
                     + ROUNDINGS * EPS32 * np.abs(expect), f"rms_norm K={k} {shape}")
    # at mean(v**2) = eps the row is scaled by exactly 1 / sqrt(2 eps) (pinned: eps under the root)
    at_eps = RATIOS.index(1.0)
    np.testing.assert_allclose(rms_norm(v[at_eps:at_eps + 1], None, EPS)[0] / v[at_eps],
                               1 / np.sqrt(2 * EPS), rtol=2 * float(_tol(k, np.ones(1), shape)[0]) + 2 * EPS32)


def test_rms_norm_of_a_zero_row_is_zero():
    v = np.zeros((3, 16), np.float32)
    np.testing.assert_array_equal(rms_norm(v, np.ones(16, np.float32), EPS), v)


@pytest.mark.parametrize("shape", ["random", "constant"])
@pytest.mark.parametrize("k", LENGTHS[1:])
def test_a2a3_inverse_rms_follows_its_definition_where_eps_matters(k: int, shape: str):
    v = _rows(k, shape)
    padded = np.zeros((v.shape[0], cube_padded_width(k)), np.float32)
    padded[:, :k] = v                       # the zero columns add nothing to the sum of squares
    want = _inv_rms64(v)
    got = a2a3_inv_rms(padded, k, EPS)
    assert got.dtype == np.float32
    # per row, the tolerance scales with the row's own value (rows span 1/sqrt(eps) to 1/sqrt(101 eps))
    assert_close(got, want, _tol(k, want, shape), f"a2a3_inv_rms K={k} {shape}")
    assert got[0] == np.float32(1 / np.sqrt(np.float32(EPS)))  # a zero row: rsqrt(eps), nothing else


#: head_rms rounds each of its five steps to bf16 (half a bf16 step, 2**-9, of relative error each; the root
#: halves what its input carries): at most (2**-9 + 2**-9) / 2 + 2**-9 / 2 + 2 * 2**-9 < 2**-7 of the value.
HEAD_RMS_REL = 2.0**-7


@pytest.mark.parametrize("k", (7, 64, 512))
def test_head_rms_follows_its_definition_where_eps_matters(k: int):
    q = bf16_round(_rows(k, "random"))
    want = q.astype(np.float64) * _inv_rms64(q)[:, None]
    got = head_rms(q, EPS)
    np.testing.assert_array_equal(bf16_round(got), got)
    scale = np.abs(want).max(axis=1, keepdims=True)
    assert_close(got, want, (HEAD_RMS_REL + order_rel(k)) * scale, f"head_rms K={k}")


def test_int8_quantize_rounds_ties_to_even():
    # amax 127 makes the scale exactly 1: every k + 0.5 is a tie, rounded to the even neighbour on both signs
    ties = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]], np.float32)
    q, dequant = int8_quantize(ties)
    np.testing.assert_array_equal(q[0], [127, 0, 2, 2, -0, -2, -2, 126])
    assert dequant[0] == 1.0


def test_int8_quantize_of_a_zero_row_and_at_the_amax_floor():
    q, dequant = int8_quantize(np.array([[0.0] * 4, [1e-4, -1e-4, 5e-5, 0.0]], np.float32))
    np.testing.assert_array_equal(q, [[0, 0, 0, 0], [127, -127, 64, 0]])  # 63.5 -> 64 (even)
    np.testing.assert_array_equal(dequant, np.float32(1) / (np.float32(127) / np.float32(1e-4)))
