"""bf16 rounding, int8 quantisation, exact int8 products, RMSNorm and the Hadamard matrix."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dspark_kernels.model.numerics import (
    bf16_round,
    check_precision,
    hadamard,
    int8_matmul,
    int8_quantize,
    narrow,
    rms_norm,
    torch_sum,
)


def test_bf16_round_ties_to_even():
    one = np.float32(1.0)
    values = np.array([one + 2**-8, one + 3 * 2**-8, one + 2**-7, one + 2**-9, -(one + 3 * 2**-8)], np.float32)
    expected = np.array([1.0, 1 + 2**-6, 1 + 2**-7, 1.0, -(1 + 2**-6)], np.float32)
    np.testing.assert_array_equal(bf16_round(values), expected)
    assert bf16_round(values).dtype == np.float32


BIG = float(np.float32(1e30))


@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(-BIG, BIG, width=32)))
def test_bf16_round_is_nearest_and_idempotent(v):
    r = bf16_round(v)
    np.testing.assert_array_equal(bf16_round(r), r)
    assert np.all(np.abs(r.astype(np.float64) - v) <= np.abs(v.astype(np.float64)) * 2.0**-8 + 2.0**-133)
    np.testing.assert_array_equal(narrow(v, "fp32"), v)


def test_int8_quantize_hand_case():
    q, dq = int8_quantize(np.array([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]], np.float32))
    np.testing.assert_array_equal(q[0], [127, -64, 32])  # -63.5 rounds half to even; 31.75 -> 32
    np.testing.assert_array_equal(q[1], [0, 0, 0])
    np.testing.assert_allclose(dq, [1 / 127, 1e-4 / 127], rtol=1e-6)  # amax floor 1e-4


@given(hnp.arrays(np.float32, (3, 16), elements=st.floats(-100, 100, width=32)))
def test_int8_quantize_bounds(v):
    q, dq = int8_quantize(v)
    assert np.all(np.abs(q) <= 127) and np.all(q == np.rint(q))
    # dequantised error is at most half a step of the row's scale
    assert np.all(np.abs(q * dq[:, None] - v) <= dq[:, None] * 0.5 * (1 + 1e-5) + 1e-12)


@given(st.integers(1, 1500))
def test_int8_matmul_is_exact(k):
    rng = np.random.default_rng(k)
    a = rng.integers(-127, 128, (3, k))
    b = rng.integers(-127, 128, (5, k))
    np.testing.assert_array_equal(int8_matmul(a.astype(np.float32), b.astype(np.int8)), (a @ b.T).astype(np.float32))


def test_rms_norm_against_loop():
    rng = np.random.default_rng(0)
    v, w = rng.standard_normal((4, 10), dtype=np.float32), rng.standard_normal(10, dtype=np.float32)
    for i in range(4):
        want = v[i] / np.sqrt(sum(float(e) ** 2 for e in v[i]) / 10 + 1e-6) * w
        np.testing.assert_allclose(rms_norm(v, w, 1e-6)[i], want, rtol=1e-6)
    np.testing.assert_allclose(rms_norm(v, None, 1e-6) * w, rms_norm(v, w, 1e-6), rtol=1e-6)


@pytest.mark.parametrize("width", [4096, 512, 64, 7, 100, 4100, 300_000, 4 * 8 * 16**3 + 13])
def test_torch_sum_is_torchs_cpu_sum_bit_for_bit(width: int):
    """rms_norm's mean of squares is torch's ``pow(2).mean(-1)`` on CPU bit for bit (upstream's golden reference),
    on FLASH's width 4096 and on widths that reach every branch of torch's cascade: a ragged last vector (7, 100,
    4100), a lone chunk (64), two and three cascade levels (300,000; 4*8*16**3 + 13 reaches the fourth). An fp32
    einsum or numpy's pairwise mean differs on about a third of the rows at 4096 (measured)."""
    import torch  # the test extra installs it; the library never imports it

    rng = np.random.default_rng(width)
    rows = 64 if width <= 4100 else 2
    x = (rng.standard_normal((rows, width)) * rng.uniform(1e-3, 30, (rows, 1))).astype(np.float32)
    want = torch.from_numpy(x).pow(2).mean(-1).numpy()
    np.testing.assert_array_equal(torch_sum(x * x) / np.float32(width), want)
    if width == 4096:
        t = torch.from_numpy(x)
        np.testing.assert_array_equal(rms_norm(x, None, 1e-6), (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True)
                                                                                + 1e-6)).numpy())
        assert (np.einsum("ij,ij->i", x, x) / np.float32(width) != want).sum() > rows // 8  # the test can fail


def test_rms_norm_at_the_edges_of_its_formula():
    """Rows whose mean of squares is near eps (eps inside the square root matters), a zero row (gives zeros, not
    NaN) and a constant row (the norm of c is sign(c) exactly up to eps), against float64."""
    eps = 1e-6
    near = np.full((1, 256), np.float32(1e-3))             # mean(v**2) = 1e-6 = eps: the root halves
    zero = np.zeros((1, 256), np.float32)
    const = np.full((1, 256), np.float32(-3.0))
    v = np.concatenate([near, zero, const])
    got = rms_norm(v, None, eps)
    want = v.astype(np.float64) / np.sqrt((v.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps)
    # one rounding each in the square, the mean (exact for equal addends of a power-of-two count), the add,
    # the root, the division and the product: a few fp32 ulps
    np.testing.assert_allclose(got, want, rtol=4 * np.finfo(np.float32).eps, atol=0)
    assert not got[1].any() and np.isfinite(got).all()
    assert abs(float(got[0, 0]) - 1e-3 / np.sqrt(1e-6)) > 0.2   # eps outside the root would give ~1.0


def test_hadamard():
    np.testing.assert_allclose(hadamard(2), np.array([[1, 1], [1, -1]]) / np.sqrt(2), rtol=1e-7)
    h = hadamard(128)
    np.testing.assert_allclose(h @ h.T, np.eye(128), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    assert not h.flags.writeable
    with pytest.raises(ValueError, match="power of two"):
        hadamard(12)


def test_check_precision():
    assert check_precision("a2a3") == "a2a3"
    with pytest.raises(ValueError, match="bf16"):
        check_precision("bf16")
