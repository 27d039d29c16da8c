"""Checkpoint number formats and the official fake quantisation (``dspark_kernels.model.quant``).

Every dequantisation is compared with a deliberately naive restatement written here (Python loops over the
definitions in docs/checkpoints.md), not with the vectorised code under test.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from dspark_kernels.model import quant

E4M3, E2M1, UE8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu
#: e2m1 by 4-bit code, written out: bit 3 is the sign, bits 2..1 the exponent, bit 0 the mantissa.
E2M1_BY_CODE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _random_e4m3(rng, shape):
    """Random finite e4m3 bit patterns (0x7f / 0xff are NaN)."""
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    return raw.view(E4M3)


def _bf16(x):
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _is_pow2(x):
    m, _ = np.frexp(np.asarray(x, dtype=np.float32))
    return bool(np.all(m == 0.5))


# ---------------------------------------------------------------------------------------------- FP8 blocks
def naive_fp8_dequant(q, scale_bytes_or_floats, block=128):
    out, inp = q.shape
    w = np.empty((out, inp), dtype=np.float32)
    for i in range(out):
        for j in range(inp):
            s = scale_bytes_or_floats[i // block][j // block]
            s = 2.0 ** (int(s) - 127) if isinstance(s, np.uint8 | int) else float(s)
            w[i, j] = float(q[i, j]) * s
    return w


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 257), (5, 7)])
def test_fp8_dequant_equals_the_naive_definition_including_ragged_blocks(shape):
    rng = np.random.default_rng(1)
    q = _random_e4m3(rng, shape)
    ob, ib = -(-shape[0] // 128), -(-shape[1] // 128)
    exps = rng.integers(110, 140, size=(ob, ib), dtype=np.uint8)
    want = naive_fp8_dequant(q, exps)
    assert np.array_equal(quant.dequant_fp8_blocks(q, exps.view(UE8M0)), want)
    assert np.array_equal(quant.dequant_fp8_blocks(q, exps), want)  # raw uint8 exponent bytes
    f32 = np.ldexp(np.float32(1), exps.astype(np.int32) - 127).astype(np.float32)
    assert np.array_equal(quant.dequant_fp8_blocks(q.view(np.uint8), f32), want)  # float32 scales, raw bytes


def test_fp8_dequant_with_non_power_of_two_float_scales():
    rng = np.random.default_rng(2)
    q = _random_e4m3(rng, (130, 140))
    s = rng.uniform(1e-3, 1.0, size=(2, 2)).astype(np.float32)
    assert np.array_equal(quant.dequant_fp8_blocks(q, s), naive_fp8_dequant(q, s))


def test_fp8_dequant_rejects_a_scale_of_the_wrong_shape():
    q = np.zeros((256, 256), dtype=E4M3)
    with pytest.raises(ValueError, match=r"scale shape \(2, 1\)"):
        quant.dequant_fp8_blocks(q, np.ones((2, 1), dtype=np.float32))


@pytest.mark.parametrize("shape", [(256, 128), (129, 300)])
def test_fp8_encoder_uses_power_of_two_block_scales_and_round_trips(shape):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 50, size=(shape[0], 1))).astype(np.float32)
    q, s = quant.quant_fp8_blocks(w)
    assert q.dtype == E4M3 and s.dtype == UE8M0 and s.shape == quant.fp8_scale_shape(shape)
    s32 = s.astype(np.float32)
    assert _is_pow2(s32)
    for bi in range(s.shape[0]):  # scale = 2**ceil(log2(amax / 448)): amax/448 <= s < 2 * amax/448
        for bj in range(s.shape[1]):
            amax = np.abs(w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]).max()
            assert amax / 448 <= s32[bi, bj] < 2 * amax / 448 * (1 + 1e-6)
    deq = quant.dequant_fp8_blocks(q, s)
    block_max = np.repeat(np.repeat(s32, 128, 0), 128, 1)[: shape[0], : shape[1]] * 448
    assert np.all(np.abs(deq - w) <= block_max * 2.0**-4)  # e4m3: 3 mantissa bits
    q2, s2 = quant.quant_fp8_blocks(deq)  # values on the grid come back exactly
    assert np.array_equal(quant.dequant_fp8_blocks(q2, s2), deq)
    q3, s3 = quant.quant_fp8_blocks(w, scale_dtype="float32")
    assert s3.dtype == np.float32 and np.array_equal(s3, s32) and np.array_equal(q3.view(np.uint8), q.view(np.uint8))


def test_ue8m0_holds_only_powers_of_two():
    assert quant.float32_to_ue8m0(np.array([1.0, 2.0**-127, 2.0**127], np.float32)).view(np.uint8).tolist() == \
        [127, 0, 254]
    with pytest.raises(ValueError, match="powers of two"):
        quant.float32_to_ue8m0(np.array([3.0], np.float32))
    assert np.isnan(quant.scale_to_float32(np.array([255], np.uint8))[0])


# ---------------------------------------------------------------------------------------------- FP4 blocks
def test_fp4_nibble_order_is_pinned_by_hand_computed_bytes():
    # 0x2B: low nibble 0xB = 1011 -> sign 1, exponent 01, mantissa 1 -> -1.5 (element 0);
    #       high nibble 0x2 = 0010 -> +1.0 (element 1).
    assert quant.unpack_fp4(np.array([0x2B], np.uint8)).tolist() == [-1.5, 1.0]
    assert quant.unpack_fp4(np.array([[0x7F, 0x91]], np.uint8)).tolist() == [[-6.0, 6.0, 0.5, -0.5]]  # 0x91: 1 | 9
    assert quant.unpack_fp4(np.array([-1], np.int8)).tolist() == [-6.0, -6.0]  # the checkpoint stores int8
    assert quant.pack_fp4(np.array([-1.5, 1.0], np.float32)).tolist() == [0x2B]
    assert quant.pack_fp4(np.array([[6.0, -6.0, -1.0, -0.5]], np.float32)).tolist() == [[0xF7, 0x9A]]


def naive_fp4_dequant(packed, exps, block=32):
    out, half = packed.shape
    w = np.empty((out, 2 * half), dtype=np.float32)
    for i in range(out):
        for j in range(2 * half):
            byte = int(packed[i, j // 2]) & 0xFF
            code = (byte >> 4) if j % 2 else (byte & 0x0F)
            w[i, j] = E2M1_BY_CODE[code] * 2.0 ** (int(exps[i, j // block]) - 127)
    return w


@pytest.mark.parametrize("shape", [(8, 64), (3, 100)])
def test_fp4_dequant_equals_the_naive_definition(shape):
    rng = np.random.default_rng(4)
    packed = rng.integers(-128, 128, size=(shape[0], shape[1] // 2), dtype=np.int8)
    exps = rng.integers(115, 135, size=quant.fp4_scale_shape(shape), dtype=np.uint8)
    want = naive_fp4_dequant(packed, exps)
    assert np.array_equal(quant.dequant_fp4_blocks(packed, exps.view(UE8M0)), want)
    assert np.array_equal(quant.dequant_fp4_blocks(packed.view(np.uint8), exps), want)


def test_fp4_encoder_round_trips_grid_values_and_uses_the_official_scale():
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 16, size=(4, 64), dtype=np.uint8)
    exps = rng.integers(120, 130, size=(4, 2), dtype=np.uint8)
    codes[:, 0], codes[:, 32] = 7, 15  # one +-6 per block: then the re-encoded scale is the same power of two
    w = naive_fp4_dequant(quant.pack_fp4(codes.view(E2M1)), exps)
    packed, s = quant.quant_fp4_blocks(w)
    assert s.dtype == UE8M0 and s.shape == (4, 2) and np.array_equal(s.view(np.uint8), exps)
    assert np.array_equal(quant.dequant_fp4_blocks(packed, s), w)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    _, s2 = quant.quant_fp4_blocks(x)
    amax = np.abs(x).reshape(2, 2, 32).max(-1)
    assert _is_pow2(s2.astype(np.float32)) and np.all(amax / 6 <= s2.astype(np.float32) * (1 + 1e-6))


def test_e2m1_rounds_to_nearest_even():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25], np.float32)
    assert quant.unpack_fp4(quant.pack_fp4(np.append(x, 0))).tolist()[:9] == [0, 1, 1, 2, 2, 4, 4, 6, -0.0]


# ---------------------------------------------------------------------------------------------- int8
def test_int8_per_channel_dequant_and_encoder():
    rng = np.random.default_rng(6)
    q = rng.integers(-127, 128, size=(5, 9), dtype=np.int8)
    s = rng.uniform(0.001, 1, size=5).astype(np.float32)
    want = np.array([[float(q[i, j]) * float(s[i]) for j in range(9)] for i in range(5)], np.float32)
    assert np.array_equal(quant.dequant_int8_channels(q, s), want)
    assert np.array_equal(quant.dequant_int8_channels(q.T.copy(), s, axis=0), want.T)  # [in, out] layout
    w = rng.standard_normal((3, 4, 16)).astype(np.float32)
    q3, s3 = quant.quant_int8_channels(w)
    assert s3.shape == (3, 4) and np.allclose(s3, np.abs(w).max(-1) / 127)
    assert np.all(np.abs(quant.dequant_int8_channels(q3, s3) - w) <= s3[..., None] / 2 * (1 + 1e-6))
    with pytest.raises(ValueError, match="per-channel scale"):
        quant.dequant_int8_channels(q, np.ones(9, np.float32))


# ---------------------------------------------------------------------------------------------- scales
def test_pow2_scale_is_the_fp32_reciprocal_rule_of_fast_round_scale():
    amax = np.array([448.0, 449.0, 1.0, 1e-9, 896.0, 447.99997, 3e5], np.float32)
    got = quant.pow2_scale(amax, 448.0, 1e-4)
    for a, g in zip(amax, got, strict=True):
        x = np.float32(max(a, np.float32(1e-4))) * np.float32(1 / 448)  # float32 product, as the kernel
        assert g == 2.0 ** math.ceil(math.log2(float(x)))
    assert _is_pow2(got)


# ---------------------------------------------------------------------------------------------- activations
def test_fp8_act_fake_quant_of_the_first_release_is_identity_on_bf16():
    rng = np.random.default_rng(7)
    x = _bf16(rng.standard_normal((2, 3, 512)) * 3)
    assert np.array_equal(quant.fp8_act_fake_quant(x, release="v4-flash", dims=slice(0, 448)), x)
    y = rng.standard_normal((4, 128)).astype(np.float32)
    assert np.array_equal(quant.fp8_act_fake_quant(y, release="v4-flash"), _bf16(y))  # fp32 in: bf16 rounding only


def test_fp8_act_fake_quant_v41_rounds_each_block_of_64_to_e4m3():
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((3, 512)) * rng.uniform(0.001, 100, size=(3, 1))).astype(np.float32)
    x[1, :64] = 0.0  # an all-zero block keeps the 1e-4 amax floor
    y = quant.fp8_act_fake_quant(x, 64, release="v4.1-flash", dims=slice(0, 448))
    assert np.array_equal(y[:, 448:], x[:, 448:])  # the RoPE dims stay as they are
    for r in range(3):
        for b in range(7):
            blk = x[r, b * 64:(b + 1) * 64]
            amax = max(float(np.abs(blk).max()), 1e-4)
            s = 2.0 ** math.ceil(math.log2(float(np.float32(amax) * np.float32(1 / 448))))
            want = [float(E4M3(v / s)) * s for v in blk]
            assert y[r, b * 64:(b + 1) * 64].tolist() == pytest.approx(want, rel=0, abs=0)
    with pytest.raises(ValueError, match="release"):
        quant.fp8_act_fake_quant(x, release="v5")


def test_fp4_act_fake_quant_lands_on_the_e2m1_grid_times_a_power_of_two():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    x[0, :32] = 0.0
    y = quant.fp4_act_fake_quant(x)
    assert np.array_equal(y[0, :32], np.zeros(32, np.float32))
    for r in range(5):
        for b in range(4):
            blk, out = x[r, b * 32:(b + 1) * 32], y[r, b * 32:(b + 1) * 32]
            amax = max(float(np.abs(blk).max()), 6 * 2.0**-126)
            s = 2.0 ** math.ceil(math.log2(float(np.float32(amax) * np.float32(1 / 6))))
            assert set((out / s).tolist()) <= set(E2M1_BY_CODE)
            assert out.tolist() == [float(E2M1(v / s)) * s for v in blk]
    assert np.array_equal(_bf16(y), y)


def sylvester(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


def test_hadamard_rotation_is_the_scaled_sylvester_matrix():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((3, 4, 128)).astype(np.float32)
    want = x.astype(np.float64) @ sylvester(128).T / math.sqrt(128)
    assert np.allclose(quant.hadamard_rotate(x), want, rtol=0, atol=1e-5)
    assert np.allclose(quant.hadamard_rotate(quant.hadamard_rotate(x)), x, atol=1e-5)  # H / sqrt(d) is an involution
    with pytest.raises(ValueError, match="power-of-two"):
        quant.hadamard_rotate(np.zeros((2, 96), np.float32))


def test_hadamard_fp4_fake_quant_is_rotation_then_fp4():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    rot = _bf16(quant.hadamard_rotate(x))
    assert np.array_equal(quant.hadamard_fp4_fake_quant(x), quant.fp4_act_fake_quant(rot))


def test_gemm_activation_quant_is_per_128_with_power_of_two_scales():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 256)).astype(np.float32) * 7
    q, s = quant.fp8_gemm_act_quant(x)
    assert q.dtype == E4M3 and s.shape == (3, 2) and _is_pow2(s)
    assert np.all(np.abs(q.astype(np.float32)) <= 448)
    with pytest.raises(ValueError, match="multiple of the block"):
        quant.fp8_gemm_act_quant(np.zeros((1, 100), np.float32))


def test_fp8_and_fp4_block_linear_are_the_dequantised_products():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    xq, sa = quant.fp8_gemm_act_quant(x)
    xd = xq.astype(np.float64) * np.repeat(sa, 128, axis=1)
    wq, ws = quant.quant_fp8_blocks(rng.standard_normal((130, 256)).astype(np.float32))
    want = xd @ quant.dequant_fp8_blocks(wq, ws).astype(np.float64).T
    assert np.allclose(quant.fp8_block_linear(x, wq, ws), want, rtol=1e-5, atol=1e-4)
    packed, ps = quant.quant_fp4_blocks(rng.standard_normal((64, 256)).astype(np.float32))
    want4 = xd @ quant.dequant_fp4_blocks(packed, ps).astype(np.float64).T
    assert np.allclose(quant.fp4_block_linear(x, packed, ps), want4, rtol=1e-5, atol=1e-4)
