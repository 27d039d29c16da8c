"""Numeric building blocks shared by every stage and the model layer: precision modes, bf16 rounding, int8
quantisation, products, RMSNorm and the Sylvester Hadamard matrix (the numpy definition; the pypto kernels
mirror it op for op in :mod:`dspark_kernels.pypto._ops`).

Three precisions exist:

* ``"fp32"`` (the default): DeepSeek's exact meaning. Every value stays float32, nothing is quantised.
* ``"a2a3"``: the numerics of the a2a3 kernels (upstream's golden references): bf16 activations and caches,
  int8 projections with per-row symmetric scales, fp32 accumulation. bf16 values are held in float32
  arrays whose values are exactly representable in bf16 (round to nearest even), and int8 values in
  float32 or int8 arrays holding integers in [-127, 127].
* ``"deepseek"``: what DeepSeek's official inference (``inference/model.py`` + ``kernel.py``, bf16 default dtype,
  FP8 checkpoint) computes, held the same way (float32 arrays of bf16 / e4m3 / e2m1 values). Its narrowing
  points, in the official order (:mod:`dspark_kernels.model.deepseek_numerics` holds the quantisers):

  - bf16: the residual streams after every ``hc_post``, ``x_mixed`` of ``hc_pre`` / ``hc_head``, every RMSNorm
    output (attn/ffn/q/kv/compressor/final norms), every Linear output except the fp32 ones below, q and kv
    after RoPE (rotation in fp32), the per-head q RMS (computed in bf16 ops: square, mean, ``+ eps``, rsqrt,
    product each rounded), the pooled compressor entry before its norm, the indexer head weights
    (``bf16(bf16(x weights_proj) * scale)``) and its scores (``q.k``, ``* w``, sum over heads, each rounded),
    the attention probabilities before PV and the attention output before and after the inverse RoPE, the
    routed / shared experts' ``w * silu * up`` before ``w2`` and the MoE output;
  - FP8 e4m3 fake quant (blocks of 64, power-of-two scale) of the non-RoPE dims of window and compressed KV,
    following the release :data:`~dspark_kernels.model.deepseek_numerics.KV_RELEASE`;
  - Hadamard rotation (bf16 out) then FP4 e2m1 fake quant (blocks of 32, power-of-two scale) of the indexer
    queries and compressed indexer keys;
  - e4m3 quantisation per 1x128 block (power-of-two scale) of the input of every Linear whose weight is stored
    FP8 or FP4 as loaded (a shipped checkpoint: ``wq_a``, ``wq_b``, ``wkv``, ``wo_b``, ``indexer.wq_b``, shared
    and routed experts; bf16 / float weights: none, a plain bf16 GEMM as the official ``linear()``), then a
    product with the weights as given, i.e. the FP8 / FP4 GEMM up to fp32 summation order;
  - fp32 throughout: the compressor projections, state and pooling, the gate, hc_pre / hc_post / hc_head
    arithmetic, RoPE tables, attention logits, max and sums, the LM head.

  Weights are used as given in ``"deepseek"``: a real checkpoint's tensors already hold what the official model
  holds (bf16 tensors bf16 values; FP8 / FP4 tensors, dequantised, e4m3 / e2m1 values times powers of two, which
  bf16 also represents exactly; ``wo_a`` is dequantised into bf16 by ``convert.py``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, get_args

import ml_dtypes
import numpy as np

Precision = Literal["fp32", "a2a3", "deepseek"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
#: The precisions whose activations and caches hold bf16 values (:func:`narrow` rounds in them).
BF16_PRECISIONS: tuple[Precision, ...] = ("a2a3", "deepseek")

#: Floor of the absolute maximum before symmetric int8 scaling: per row in upstream's ``int8q``, per channel
#: in pypto-lib's W8A8 weights (``INT8_AMAX_EPS``, :func:`dspark_kernels.model.quant.quant_int8_channels`).
INT8_AMAX_FLOOR = 1e-4
#: Largest int8 magnitude used by the symmetric quantiser.
INT8_MAX = 127
#: Largest integer float32 represents exactly; int8 dot products below it are exact in float32.
FP32_EXACT_INT = 2**24

# a2a3 hyper-connection orders (dspark_kernels.reference.hyper_connections; the pypto kernels share them)
#: a2a3 mix: K = hc*D cut into this many contiguous slices, each reduced by its own cube task; the slice
#: partials are added in ascending order.
HC_K_SPLITS = 4
#: a2a3 mix: the A2/A3 fp32 cube MAD adds this many consecutive products to its accumulator per rounding.
CUBE_MAD_K = 4
#: a2a3 sum of squares: width of the chunks whose sums are accumulated in ascending order; K is zero-padded
#: to a multiple of it.
RMS_CHUNK = 512


def check_precision(precision: str) -> Precision:
    """Return ``precision`` if it names a supported mode, else raise ValueError naming the choices."""
    for known in PRECISIONS:
        if precision == known:
            return known
    raise ValueError(f"precision={precision!r} is not supported; choose one of {list(PRECISIONS)}")


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round to the nearest bf16 value (ties to even) and return float32 of the same shape."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def narrow(x: np.ndarray, precision: Precision) -> np.ndarray:
    """A bf16 narrowing point of the a2a3 kernels and of the official inference: bf16-round in the
    :data:`BF16_PRECISIONS`, identity in ``"fp32"``. (A point only one of them has tests the precision itself.)"""
    return bf16_round(x) if precision in BF16_PRECISIONS else x


def int8_quantize(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8 quantisation over the last axis, exactly as upstream's ``int8q``.

    v: [..., K] float. amax = max|v| clamped to >= 1e-4; scale = 127 / amax; q = round-half-even(v * scale).
    Returns (q [..., K] float32 holding integers in [-127, 127], dequant [...] float32 = 1 / scale),
    so ``q * dequant[..., None]`` approximates ``v``.
    """
    v = np.asarray(v, dtype=np.float32)
    amax = np.maximum(np.abs(v).max(axis=-1), np.float32(INT8_AMAX_FLOOR))          # (...)
    scale = np.float32(INT8_MAX) / amax                                               # (...)
    q = np.clip(np.rint(v * scale[..., None]), -INT8_MAX, INT8_MAX)                   # (..., K)
    return q.astype(np.float32), (np.float32(1.0) / scale).astype(np.float32)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for x [M, K] and an [out, in] weight w [N, K]: [M, N] float32 (possibly a transposed view).

    When M < N the product is formed as ``(w @ x.T).T``: the same dot products, but OpenBLAS runs that
    orientation 1.5-3x faster for few rows against a wide weight (measured on this project's shapes).
    """
    if x.shape[0] < w.shape[0]:
        return np.asarray((w @ x.T).T)
    return np.asarray(x @ w.T)


def int8_matmul(a_q: np.ndarray, b_q: np.ndarray) -> np.ndarray:
    """Exact integer product ``a_q @ b_q.T`` of int8-valued arrays, returned as float32.

    a_q: [M, K], b_q: [N, K] (float or int8 arrays holding integers in [-127, 127]).
    Every partial sum is an integer below 2**24 when K * 127**2 < 2**24 (K <= 1040), so float32 BLAS is
    exact and order-independent, like the int32 accumulation of the hardware. Larger K uses float64.
    """
    k = a_q.shape[-1]
    dtype = np.float32 if k * INT8_MAX * INT8_MAX < FP32_EXACT_INT else np.float64
    out = linear(a_q.astype(dtype, copy=False), b_q.astype(dtype, copy=False))
    return out.astype(np.float32, copy=False)


#: torch's CPU sum (upstream's golden reference): lanes of its float vector and rows summed side by side ...
TORCH_SUM_LANES = 8
#: ... the independent accumulators of its inner loop, ...
TORCH_SUM_ILP = 4
#: ... and the levels of its cascade (each level adds up to 2**power results of the level below in order).
TORCH_SUM_LEVELS = 4


def _in_order(x: np.ndarray, axis: int) -> np.ndarray:
    """Left-to-right float32 sum along ``axis`` (from zero), one add per element, as a scalar loop does."""
    moved = np.ascontiguousarray(np.moveaxis(x, axis, 0))   # each addend contiguous
    acc = np.zeros(moved.shape[1:], np.float32)
    for part in moved:
        np.add(acc, part, out=acc)
    return acc


def _cascade_levels(items: np.ndarray, power: int, levels: int) -> list[np.ndarray]:
    """torch's multi-level cascade over axis -3 of items [..., n, ILP, LANES]: returns the accumulators
    [level 0 (the trailing items), level 1, ..., level ``levels - 1``], each [..., ILP, LANES]."""
    step = 1 << power
    n = items.shape[-3]
    full = n - n % step
    accs = [_in_order(items[..., full:, :, :], -3)]                 # level 0: what follows the last full chunk
    below = items[..., :full, :, :]
    for level in range(1, levels):
        count = below.shape[-3] // step
        sums = _in_order(below.reshape(*below.shape[:-3], count, step, *below.shape[-2:]), -3)   # full chunks
        if level == levels - 1:                     # the last level never flushes: every chunk sum, in order
            accs.append(_in_order(sums, -3))
            break
        flushed = sums.shape[-3] - sums.shape[-3] % step
        accs.append(_in_order(sums[..., flushed:, :, :], -3))     # chunks since this level's last flush
        below = sums[..., :flushed, :, :]
    return accs


def _row_sum(items: np.ndarray) -> np.ndarray:
    """ATen's ``row_sum`` over axis -2 of items [..., n, W] (W lanes summed side by side): groups of
    :data:`TORCH_SUM_ILP` items through the cascade, leftover items into accumulator 0, accumulators in order."""
    n, ilp = items.shape[-2], TORCH_SUM_ILP
    groups = n // ilp
    power = max(4, (int(groups - 1).bit_length() if groups > 1 else 0) // TORCH_SUM_LEVELS)
    grouped = items[..., : groups * ilp, :].reshape(*items.shape[:-2], groups, ilp, items.shape[-1])
    accs = _cascade_levels(grouped, power, TORCH_SUM_LEVELS)
    acc = accs[0]
    for higher in accs[1:]:
        acc = acc + higher                                                                # (..., ilp, W)
    out = np.concatenate([acc[..., :1, :], items[..., groups * ilp:, :], acc[..., 1:, :]], axis=-2)
    return _in_order(out, -2)


def torch_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last (contiguous) axis in exactly the order of torch's CPU float32 ``sum`` / ``mean``
    (ATen's ``cascade_sum``): [..., K] -> [...] float32.

    K >= :data:`TORCH_SUM_LANES`: the row is read as vectors of that many lanes; groups of :data:`TORCH_SUM_ILP`
    vectors feed that many accumulators through a :data:`TORCH_SUM_LEVELS`-level cascade (chunks of
    ``2**max(4, ceil(log2(groups)) // levels)`` groups added in order, chunk sums added in order into the next
    level); leftover vectors join accumulator 0, the accumulators are added in order, then the leftover scalars
    and the lanes, in order, to a zero. Narrower rows take the same steps one scalar at a time. Pinned bit for
    bit against torch (tests/kernels/test_numerics.py).
    """
    v = np.asarray(v, dtype=np.float32)
    k, lanes = v.shape[-1], TORCH_SUM_LANES
    if k < lanes:
        return _row_sum(v[..., None])[..., 0]
    nvec = k // lanes
    lane_sums = _row_sum(v[..., : nvec * lanes].reshape(*v.shape[:-1], nvec, lanes))       # (..., lanes)
    # one scalar accumulator from zero: the scalars past the last vector, then the lanes
    return _in_order(np.concatenate([v[..., nvec * lanes:], lane_sums], axis=-1), -1)


def rms_norm(v: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """``v / sqrt(mean(v**2, last axis) + eps) * weight`` in float32; ``weight=None`` is unweighted.

    v: [..., K] float32; weight: [K] float32 or None. Returns [..., K] float32. The mean of squares is
    :func:`torch_sum` of ``v * v`` over K (torch's ``pow(2).mean(-1)``, as upstream's golden reference computes
    it: an fp32 ``einsum`` flips the inverse RMS by several ulps on most rows and bf16 outputs with it).
    """
    v = np.asarray(v, dtype=np.float32)
    mean_sq = (torch_sum(v * v) / np.float32(v.shape[-1]))[..., None]                   # (..., 1)
    out = v * (np.float32(1.0) / np.sqrt(mean_sq + np.float32(eps)))
    if weight is not None:
        out *= weight
    return out


@lru_cache(maxsize=8)
def hadamard(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order ``n`` (a power of two) scaled by ``1/sqrt(n)``: [n, n] float32.

    H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]. Symmetric and orthogonal. Read-only (cached).
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard order n={n} must be a power of two")
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    out = (h / np.sqrt(np.float32(n))).astype(np.float32)
    out.flags.writeable = False
    result: np.ndarray = out
    return result
