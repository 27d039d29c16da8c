"""Quantised number formats of DeepSeek-V4 checkpoints and the official inference's fake quantisation (numpy).

Everything here is plain numpy + ml_dtypes (no torch) and vectorised. Values are float32 unless a function
says otherwise; "e4m3" is ``ml_dtypes.float8_e4m3fn`` (max 448, no inf), "e2m1" is ``ml_dtypes.float4_e2m1fn``
(the 16 values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) and "ue8m0" is ``ml_dtypes.float8_e8m0fnu`` (a bare power of two
``2**(byte - 127)``; byte 255 is NaN). ``docs/checkpoints.md`` states the formats and cites their sources.

Stored formats (what a checkpoint holds; dequantisation is exact: one float32 multiply per element)

=========================  ==========================================  =========================================
format                     stored                                      scale
=========================  ==========================================  =========================================
FP8 block (attention, ...) ``q`` e4m3 [out, in]                        [ceil(out/128), ceil(in/128)] ue8m0 or f32
FP4 block (routed experts) ``packed`` int8/uint8 [out, in/2], element  [out, ceil(in/32)] ue8m0
                           ``2j`` in the LOW nibble of byte ``j``
int8 per channel (W8A8)    ``q`` int8 [..., in]                        [...] f32 (one per output channel)
=========================  ==========================================  =========================================

Sources: DeepSeek's V4-Flash ``inference/convert.py`` (``FP4_TABLE``, ``low = x & 0x0F``, the ``wo_a``
dequantisation ``weight * scale`` per 128x128 block) and ``inference/model.py`` (``Linear``: the scale shapes)
as published with the first V4-Flash inference code (byte copy: GitHub Mockingjay1316/deepseek-v4-flash-spark
at commit 0825add); vLLM ``vllm/model_executor/models/deepseek_v4.py`` (scales are ``float8_e8m0fnu`` in the
FP4-expert checkpoints, float32 in the FP8-expert "Flash-Base" ones); pypto-lib (hw-native-sys/pypto-lib
commit 634e77b, ``models/deepseek_v4_flash_dspark/expert_shared.py`` golden and ``config.py``) for the int8
per-channel W8A8 rule ``scale = max(amax, 1e-4) / 127``, ``q = round_half_even(w / scale)``.

Fake quantisation (what the official inference applies to activations at run time)

* :func:`fp8_act_fake_quant` -- e4m3 with power-of-two scales in blocks of 64 on the non-RoPE part of the
  window and compressed KV (``act_quant(kv[..., :-rd], 64, "ue8m0", ..., inplace=True)``). Release dependent:
  ``"v4-flash"`` (first V4-Flash ``kernel.py``) writes back through bf16 and is an identity on bf16 inputs;
  ``"v4.1-flash"`` rounds to e4m3 (a torch restatement of DeepSeek-V4.1-Flash ``kernel.py``).
* :func:`hadamard_fp4_fake_quant` -- Sylvester-Hadamard rotation (``scale = d**-0.5``) then e2m1 with
  power-of-two scales in blocks of 32 on the lightning indexer's q and compressed keys (same in both releases).
* :func:`fp8_gemm_act_quant` / :func:`fp8_block_linear` / :func:`fp4_block_linear` -- the FP8 GEMM path of
  ``linear()``: activations e4m3 per 1x128 block along K (power-of-two scale), weights FP8 128x128 blocks or
  FP4 1x32 blocks, fp32 accumulation of per-K-block partial products times both scales.

The official kernels compute the power-of-two scale as ``2**ceil(log2(amax * fp32(1/qmax)))`` with the
reciprocal rounded to float32 (``fast_round_scale``); :func:`pow2_scale` reproduces that bit for bit.
"""

from __future__ import annotations

from typing import Literal

import ml_dtypes
import numpy as np

from dspark_kernels.model.numerics import INT8_AMAX_FLOOR, INT8_MAX

#: ml_dtypes dtypes of the stored formats.
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
UE8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

E4M3_MAX = 448.0
"""Largest finite e4m3 value (``float8_e4m3fn``)."""
E2M1_MAX = 6.0
"""Largest e2m1 value."""

WEIGHT_BLOCK = 128
"""Edge of the square FP8 weight blocks (``quantization_config.weight_block_size = [128, 128]``)."""
FP4_BLOCK = 32
"""Elements along K sharing one ue8m0 scale in FP4 routed-expert weights and FP4 activation fake quant."""
KV_ACT_BLOCK = 64
"""Block of the FP8 fake quant of the KV caches' non-RoPE dims (``act_quant(..., 64, ...)``)."""
GEMM_ACT_BLOCK = 128
"""Block along K of the FP8 activation quantisation in front of FP8/FP4 GEMMs (``model.py`` ``block_size``)."""

FP8_ACT_AMAX_FLOOR = 1e-4
"""``act_quant`` clamps each block's absolute maximum to at least this."""
FP4_ACT_AMAX_FLOOR = 6.0 * 2.0**-126
"""``fp4_act_quant`` clamps each block's absolute maximum to at least this (scale >= 2**-126)."""

#: The 16 e2m1 values by 4-bit code (bit 3 = sign), as DeepSeek's ``convert.py`` ``FP4_TABLE``.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)
FP4_VALUES.flags.writeable = False

Release = Literal["v4-flash", "v4.1-flash"]
RELEASES: tuple[Release, ...] = ("v4-flash", "v4.1-flash")


# ---------------------------------------------------------------------------------------------- scales
def scale_to_float32(scale: np.ndarray) -> np.ndarray:
    """Block scales as float32: ue8m0 -> ``2**(e - 127)``, uint8 = raw ue8m0 bytes, floats cast.

    scale: any shape; ``float8_e8m0fnu``, ``uint8`` (raw exponent bytes, as vLLM holds them), or a float dtype
    (float32 scales of FP8-expert checkpoints). Returns float32 of the same shape (NaN for byte 255).
    """
    a = np.asarray(scale)
    if a.dtype == np.uint8:
        a = a.view(UE8M0)
    if a.dtype == UE8M0 or a.dtype.kind == "f" or a.dtype == np.dtype(ml_dtypes.bfloat16):
        return a.astype(np.float32)
    raise TypeError(f"block scales must be float8_e8m0fnu, raw uint8 exponents or floats, got {a.dtype}")


def float32_to_ue8m0(scale: np.ndarray) -> np.ndarray:
    """Exact powers of two in [2**-127, 2**127] (float32) -> ``float8_e8m0fnu``; anything else raises."""
    s = np.asarray(scale, dtype=np.float32)
    mant, exp = np.frexp(s)
    bad = ~((mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127))
    if bad.any():
        raise ValueError(f"ue8m0 holds powers of two in [2**-127, 2**127] only; got {s[bad].ravel()[:3]}")
    return s.astype(UE8M0)


def pow2_scale(amax: np.ndarray, qmax: float, floor: float) -> np.ndarray:
    """The official power-of-two scale ``2**ceil(log2(max(amax, floor) * fp32(1/qmax)))`` (float32).

    Bit-identical to ``fast_round_scale`` of DeepSeek's ``kernel.py``: the product is formed in float32 with
    the float32-rounded reciprocal, and ``ceil(log2(.))`` is exact (computed from the binary exponent).
    amax: [...] >= 0, finite. Returns [...] float32 powers of two.
    """
    a = np.maximum(np.asarray(amax, dtype=np.float32), np.float32(floor))
    x = a * np.float32(1.0 / qmax)                                                    # (...) float32 product
    mant, exp = np.frexp(x)                                                           # x = mant * 2**exp
    k = np.where(mant == 0.5, exp - 1, exp)                                           # ceil(log2(x))
    return np.ldexp(np.float32(1.0), k).astype(np.float32)


def _blocks_amax(x: np.ndarray, block: int) -> np.ndarray:
    """Absolute maximum of each run of ``block`` elements along the last axis (last run may be shorter)."""
    k = x.shape[-1]
    nb = -(-k // block)
    pad = nb * block - k
    a = np.abs(x)
    if pad:
        a = np.concatenate([a, np.zeros((*a.shape[:-1], pad), dtype=a.dtype)], axis=-1)
    result: np.ndarray = a.reshape((*a.shape[:-1], nb, block)).max(axis=-1)
    return result


def _expand_last(scale: np.ndarray, block: int, k: int) -> np.ndarray:
    """[..., ceil(k/block)] -> [..., k]: each scale repeated over its run of ``block`` elements."""
    return np.repeat(scale, block, axis=-1)[..., :k]


def _check_2d(name: str, a: np.ndarray) -> None:
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {a.shape}")


# ---------------------------------------------------------------------------------------------- FP8 weights
def fp8_scale_shape(shape: tuple[int, int], block: int = WEIGHT_BLOCK) -> tuple[int, int]:
    """Scale shape ``(ceil(out/block), ceil(in/block))`` of an FP8 block-quantised [out, in] weight."""
    out, inp = shape
    return -(-out // block), -(-inp // block)


def dequant_fp8_blocks(q: np.ndarray, scale: np.ndarray, block: int = WEIGHT_BLOCK) -> np.ndarray:
    """``w[i, j] = float32(q[i, j]) * scale[i // block, j // block]`` (exact; ragged edge blocks allowed).

    q: [out, in] ``float8_e4m3fn`` (or uint8 holding e4m3 bytes). scale: [ceil(out/block), ceil(in/block)]
    ue8m0 / raw uint8 exponents / float32. Returns [out, in] float32. As DeepSeek's ``convert.py`` does for
    ``wo_a`` (``weight.float() * scale.float()`` per 128x128 block).
    """
    q = np.asarray(q)
    if q.dtype == np.uint8:
        q = q.view(E4M3)
    if q.dtype != E4M3:
        raise TypeError(f"FP8 weights must be float8_e4m3fn, got {q.dtype}")
    _check_2d("q", q)
    s = scale_to_float32(scale)
    if s.shape != fp8_scale_shape(q.shape, block):
        raise ValueError(f"scale shape {s.shape} does not match {fp8_scale_shape(q.shape, block)} for q {q.shape} "
                         f"and {block}x{block} blocks")
    out, inp = q.shape
    ob, ib = s.shape
    if out == ob * block and inp == ib * block:
        w = q.astype(np.float32)
        w.reshape(ob, block, ib, block)[...] *= s[:, None, :, None]                  # in place, no padding
        return w
    w = np.zeros((ob * block, ib * block), dtype=np.float32)
    w[:out, :inp] = q.astype(np.float32)
    w.reshape(ob, block, ib, block)[...] *= s[:, None, :, None]
    return np.ascontiguousarray(w[:out, :inp])


def quant_fp8_blocks(w: np.ndarray, block: int = WEIGHT_BLOCK, *,
                     scale_dtype: Literal["ue8m0", "float32"] = "ue8m0") -> tuple[np.ndarray, np.ndarray]:
    """Encode float [out, in] into e4m3 with one power-of-two scale per ``block`` x ``block`` tile.

    Scale = ``2**ceil(log2(amax / 448))`` of the tile (amax floored so the scale stays >= 2**-127), the rule of
    pypto-lib's golden ``sim_fp8`` (DeepSeek did not publish its weight quantiser); ``q = e4m3(clip(w / s))``
    rounds to nearest even. Returns (q [out, in] float8_e4m3fn, scale [ceil(out/b), ceil(in/b)] as
    ``float8_e8m0fnu`` or float32 holding the same powers of two). ``dequant_fp8_blocks`` inverts it up to the
    e4m3 rounding; values already on the grid round-trip exactly.
    """
    w = np.asarray(w, dtype=np.float32)
    _check_2d("w", w)
    out, inp = w.shape
    ob, ib = fp8_scale_shape(w.shape, block)
    pad = np.zeros((ob * block, ib * block), dtype=np.float32)
    pad[:out, :inp] = w
    tiles = pad.reshape(ob, block, ib, block)
    amax = np.abs(tiles).max(axis=(1, 3))                                             # (ob, ib)
    s = pow2_scale(amax, E4M3_MAX, E4M3_MAX * 2.0**-127)
    qt = np.clip(tiles / s[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    q = qt.reshape(ob * block, ib * block)[:out, :inp].astype(E4M3)
    return np.ascontiguousarray(q), (float32_to_ue8m0(s) if scale_dtype == "ue8m0" else s)


# ---------------------------------------------------------------------------------------------- FP4 weights
def fp4_scale_shape(shape: tuple[int, int], block: int = FP4_BLOCK) -> tuple[int, int]:
    """Scale shape ``(out, ceil(in/block))`` of an FP4 [out, in] (logical) weight."""
    out, inp = shape
    return out, -(-inp // block)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Two e2m1 codes per byte -> float32 values; element ``2j`` is the LOW nibble of byte ``j``.

    packed: [..., k/2] int8 or uint8 (the checkpoint stores int8). Returns [..., k] float32 in
    ``FP4_VALUES``. Nibble order as DeepSeek's ``convert.py`` (``low = x & 0x0F; high = (x >> 4) & 0x0F``,
    stacked low-then-high along the last axis) and the ``float4_e2m1fn_x2`` packing of ``kernel.py``.
    """
    b = np.asarray(packed)
    if b.dtype == np.int8:
        b = b.view(np.uint8)
    if b.dtype != np.uint8:
        raise TypeError(f"packed FP4 must be int8 or uint8 bytes, got {b.dtype}")
    out = np.empty((*b.shape[:-1], 2 * b.shape[-1]), dtype=np.float32)
    out[..., 0::2] = FP4_VALUES[b & 0x0F]
    out[..., 1::2] = FP4_VALUES[b >> 4]
    return out


def pack_fp4(values: np.ndarray) -> np.ndarray:
    """float values on the e2m1 grid (or ``float4_e2m1fn``) [..., k] (k even) -> packed uint8 [..., k/2].

    Element ``2j`` goes to the low nibble of byte ``j``. Values off the grid are rounded to nearest even e2m1
    (saturating at +-6) by ``ml_dtypes``.
    """
    v = np.asarray(values)
    if v.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last axis, got {v.shape}")
    codes = (v if v.dtype == E2M1 else v.astype(np.float32).astype(E2M1)).view(np.uint8)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def dequant_fp4_blocks(packed: np.ndarray, scale: np.ndarray, block: int = FP4_BLOCK) -> np.ndarray:
    """``w[i, j] = e2m1(packed)[i, j] * scale[i, j // block]`` -- routed-expert weights as shipped (exact).

    packed: [out, in/2] int8/uint8 (low nibble first, see :func:`unpack_fp4`). scale: [out, ceil(in/block)]
    ue8m0 / raw uint8 exponents / float32. Returns [out, in] float32. The layout of ``model.py``'s FP4
    ``Linear`` (weight ``[out, in // 2]``, scale ``[out, in // 32]`` float8_e8m0fnu) and ``fp4_gemm``.
    """
    v = unpack_fp4(packed)
    _check_2d("packed", v)
    s = scale_to_float32(scale)
    if s.shape != fp4_scale_shape(v.shape, block):
        raise ValueError(f"scale shape {s.shape} does not match {fp4_scale_shape(v.shape, block)} for packed "
                         f"{np.shape(packed)} (logical {v.shape}) and 1x{block} blocks")
    out, inp = v.shape
    if inp % block == 0:
        v.reshape(out, -1, block)[...] *= s[:, :, None]
        return v
    result: np.ndarray = v * _expand_last(s, block, inp)
    return result


def quant_fp4_blocks(w: np.ndarray, block: int = FP4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Encode float [out, in] (in even) into packed e2m1 + one ue8m0 scale per 1 x ``block`` run.

    Scale = ``2**ceil(log2(amax * fp32(1/6)))`` (amax floored at ``6 * 2**-126``), the rule of the official
    ``fp4_quant_kernel``; codes round to nearest even. Returns (packed uint8 [out, in/2], scale
    [out, ceil(in/block)] float8_e8m0fnu).
    """
    w = np.asarray(w, dtype=np.float32)
    _check_2d("w", w)
    inp = w.shape[1]
    s = pow2_scale(_blocks_amax(w, block), E2M1_MAX, FP4_ACT_AMAX_FLOOR)              # (out, nb)
    v = np.clip(w / _expand_last(s, block, inp), -E2M1_MAX, E2M1_MAX)
    return pack_fp4(v), float32_to_ue8m0(s)


# ---------------------------------------------------------------------------------------------- int8 W8A8
def dequant_int8_channels(q: np.ndarray, scale: np.ndarray, *, axis: int = -1) -> np.ndarray:
    """``w = q * scale`` with one float scale per channel; ``axis`` is the reduction (input) axis.

    q: int8 array; scale: ``q.shape`` without ``axis`` (e.g. [out] for an [out, in] weight and ``axis=-1``,
    [out] for an [in, out] weight and ``axis=0``, [E, out] for [E, out, in]). Returns float32 ``q.shape``.
    The W8A8 layout of pypto-lib's a2a3 kernels (int8 weights, float32 per-output-channel scales).
    """
    q = np.asarray(q)
    if q.dtype != np.int8:
        raise TypeError(f"int8 weights must be int8, got {q.dtype}")
    ax = axis % q.ndim
    s = np.asarray(scale, dtype=np.float32)
    want = q.shape[:ax] + q.shape[ax + 1:]
    if s.shape != want:
        raise ValueError(f"per-channel scale shape {s.shape} does not match {want} (q {q.shape}, axis {axis})")
    return q.astype(np.float32) * np.expand_dims(s, ax)


def quant_int8_channels(w: np.ndarray, *, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per channel: ``scale = max(amax, 1e-4) / 127``, ``q = round_half_even(w / scale)``.

    amax is taken over ``axis``. Returns (q int8 ``w.shape``, scale float32 ``w.shape`` without ``axis``).
    """
    w = np.asarray(w, dtype=np.float32)
    amax = np.maximum(np.abs(w).max(axis=axis), np.float32(INT8_AMAX_FLOOR))
    s = (amax / np.float32(INT8_MAX)).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(s, axis % w.ndim)), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, s


# ---------------------------------------------------------------------------------------------- activations
def _check_release(release: str) -> Release:
    if release not in RELEASES:
        raise ValueError(f"release={release!r} is not known; choose one of {list(RELEASES)}")
    return release


def fp8_act_quant(x: np.ndarray, block: int, *, pow2: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise e4m3 quantisation along the last axis, as ``act_quant`` (non in-place) of ``kernel.py``.

    x: [..., K] float (the official input is bf16), K % block == 0. amax per block floored at 1e-4; scale
    :func:`pow2_scale` (``pow2``, ``scale_fmt="ue8m0"``) or ``amax * fp32(1/448)``; ``q = e4m3(clip(x / s))``.
    Returns (q [..., K] float8_e4m3fn, scale [..., K/block] float32).
    """
    x = np.asarray(x, dtype=np.float32)
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last axis {k} is not a multiple of the block {block} (the official kernel asserts it)")
    amax = np.maximum(_blocks_amax(x, block), np.float32(FP8_ACT_AMAX_FLOOR))
    s = pow2_scale(amax, E4M3_MAX, FP8_ACT_AMAX_FLOOR) if pow2 else amax * np.float32(1.0 / E4M3_MAX)
    q = np.clip(x / _expand_last(s, block, k), -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, s.astype(np.float32)


def fp8_act_fake_quant(x: np.ndarray, block: int = KV_ACT_BLOCK, *, release: Release,
                       dims: slice = slice(None)) -> np.ndarray:
    """The in-place ``act_quant(x[..., dims], block, "ue8m0", ..., inplace=True)`` of the official inference.

    x: [..., D] float32; ``dims`` selects the fake-quantised channels of the last axis (the KV caches use
    ``slice(0, D - rope_dim)``: the 448 non-RoPE dims, blocks of 64); the other channels are returned unchanged.
    Returns a new [..., D] float32 array. ``release``:

    * ``"v4-flash"`` -- ``kernel.py`` of the first V4-Flash inference code: the in-place branch casts
      ``x / s`` to the *input* dtype (bf16), not e4m3, then multiplies by the power-of-two scale, so the
      selected values only round to bf16 (an identity on bf16 inputs).
    * ``"v4.1-flash"`` -- ``kernel.py`` of DeepSeek-V4.1-Flash (as restated by a torch port): ``x / s``
      rounds to e4m3 (saturating at 448) before the multiply, i.e. real FP8 precision.
    """
    rel = _check_release(release)
    out = np.array(x, dtype=np.float32, copy=True)
    part = out[..., dims]
    if rel == "v4-flash":
        out[..., dims] = part.astype(ml_dtypes.bfloat16).astype(np.float32)
        return out
    q, s = fp8_act_quant(part, block)
    deq = q.astype(np.float32) * _expand_last(s, block, part.shape[-1])
    out[..., dims] = deq.astype(ml_dtypes.bfloat16).astype(np.float32)              # exact: e4m3 * 2**k fits bf16
    return out


def fp4_act_fake_quant(x: np.ndarray, block: int = FP4_BLOCK) -> np.ndarray:
    """The in-place ``fp4_act_quant(x, 32, True)`` of the official inference (identical in both releases).

    x: [..., K] float32, K % block == 0. Per block: amax floored at ``6 * 2**-126``, scale
    ``2**ceil(log2(amax * fp32(1/6)))``, ``y = e2m1(clip(x / s, +-6)) * s`` (round to nearest even).
    Returns [..., K] float32 (exactly representable in bf16, as the kernel writes bf16).
    """
    x = np.asarray(x, dtype=np.float32)
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last axis {k} is not a multiple of the block {block} (the official kernel asserts it)")
    s = _expand_last(pow2_scale(_blocks_amax(x, block), E2M1_MAX, FP4_ACT_AMAX_FLOOR), block, k)
    v = np.clip(x / s, -E2M1_MAX, E2M1_MAX).astype(E2M1).astype(np.float32)
    result: np.ndarray = v * s
    return result


def hadamard_rotate(x: np.ndarray) -> np.ndarray:
    """``x @ H_d.T / sqrt(d)`` over the last axis for the Sylvester Hadamard matrix H_d (d a power of two).

    H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]] (natural order; symmetric, so ``x @ H`` equals ``x @ H.T``).
    This is ``rotate_activation`` of ``model.py`` (``fast_hadamard_transform.hadamard_transform(x,
    scale=d**-0.5)``), computed by the O(d log d) butterfly in float32. x: [..., d]. Returns [..., d] float32.
    """
    y = np.array(x, dtype=np.float32, copy=True)
    d = y.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two last axis, got {d}")
    lead = y.shape[:-1]
    h = 1
    while h < d:
        v = y.reshape(-1, d // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2).reshape((*lead, d))
        h *= 2
    return y * np.float32(d**-0.5)


def hadamard_fp4_fake_quant(x: np.ndarray, block: int = FP4_BLOCK, *, bf16_rotation: bool = True) -> np.ndarray:
    """The lightning indexer's ``rotate_activation`` then ``fp4_act_quant(., 32, True)`` (q and compressed keys).

    x: [..., d] float32 (d = index_head_dim, a power of two; RoPE already applied). The rotation's output is
    rounded to bf16 first when ``bf16_rotation`` (the official transform writes bf16). Returns [..., d]
    float32. Identical in the ``v4-flash`` and ``v4.1-flash`` releases.
    """
    r = hadamard_rotate(x)
    if bf16_rotation:
        r = r.astype(ml_dtypes.bfloat16).astype(np.float32)
    return fp4_act_fake_quant(r, block)


def fp8_gemm_act_quant(x: np.ndarray, block: int = GEMM_ACT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """The activation side of the FP8/FP4 GEMMs: ``act_quant(x, 128, "ue8m0")`` per 1x128 block along K.

    x: [M, K] float (K % 128 == 0). Returns (q [M, K] float8_e4m3fn, scale [M, K/128] float32 powers of two).
    """
    return fp8_act_quant(x, block, pow2=True)


def fp8_block_linear(x: np.ndarray, w_q: np.ndarray, w_scale: np.ndarray, *, block: int = WEIGHT_BLOCK) -> np.ndarray:
    """``linear(x, w)`` with an FP8 weight, as ``fp8_gemm``: ``C = sum_k (Aq_k @ Bq_k.T) * sa_k * sb_k``.

    x: [M, K] float (quantised here per 1x128 with :func:`fp8_gemm_act_quant`); w_q: [N, K] float8_e4m3fn;
    w_scale: [ceil(N/128), K/128] (ue8m0/uint8/float32). Each K block's partial product is formed in float32
    and added, scaled by ``sa[m, k] * sb[n // 128, k]``, in K order. Returns [M, N] float32 (the kernel then
    casts to bf16).
    """
    xq, sa = fp8_gemm_act_quant(x, block)
    w_q = np.asarray(w_q)
    if w_q.dtype == np.uint8:
        w_q = w_q.view(E4M3)
    sb = scale_to_float32(w_scale)
    n, k = w_q.shape
    if xq.shape[-1] != k or sb.shape != fp8_scale_shape((n, k), block):
        raise ValueError(f"fp8_block_linear: x {xq.shape}, w {w_q.shape}, w_scale {sb.shape} do not fit")
    a, b = xq.astype(np.float32), w_q.astype(np.float32)
    sb_rows = np.repeat(sb, block, axis=0)[:n]                                        # (N, K/128)
    acc = np.zeros((a.shape[0], n), dtype=np.float32)
    for kb in range(k // block):
        cols = slice(kb * block, (kb + 1) * block)
        acc += (a[:, cols] @ b[:, cols].T) * (sa[:, kb, None] * sb_rows[None, :, kb])
    return acc


def fp4_block_linear(x: np.ndarray, w_packed: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """``linear(x, w)`` with an FP4 routed-expert weight, as ``fp4_gemm`` (FP8 act x FP4 weight).

    x: [M, K] float (quantised per 1x128 e4m3); w_packed: [N, K/2] int8/uint8; w_scale: [N, K/32] ue8m0.
    Per K block of 32: ``acc += (Aq_k @ B_k.T) * sa[m, k // 4] * sb[n, k]``. Returns [M, N] float32.
    """
    xq, sa = fp8_gemm_act_quant(x, GEMM_ACT_BLOCK)
    b = unpack_fp4(w_packed)
    sb = scale_to_float32(w_scale)
    n, k = b.shape
    if xq.shape[-1] != k or sb.shape != (n, k // FP4_BLOCK):
        raise ValueError(f"fp4_block_linear: x {xq.shape}, w {b.shape}, w_scale {sb.shape} do not fit")
    a = xq.astype(np.float32)
    sub = GEMM_ACT_BLOCK // FP4_BLOCK
    acc = np.zeros((a.shape[0], n), dtype=np.float32)
    for kb in range(k // FP4_BLOCK):
        cols = slice(kb * FP4_BLOCK, (kb + 1) * FP4_BLOCK)
        acc += (a[:, cols] @ b[:, cols].T) * (sa[:, kb // sub, None] * sb[None, :, kb])
    return acc
