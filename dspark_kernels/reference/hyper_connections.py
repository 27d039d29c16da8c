"""Hyper-connections: the ``hc_mult`` residual streams around attention and the FFN, and the head's reduction.

Math (upstream's pre-attention and post-attention stages; DeepSeek-V4 ``Block.hc_pre`` / ``hc_post`` /
``ParallelHead.hc_head``). For a row with streams ``x [hc, D]`` flattened to ``f [hc*D]``:

* ``rho = rsqrt(mean(f**2) + rms_norm_eps)`` and ``mix = (f @ fn.T) * rho`` -> ``[(2 + hc) * hc]``;
* ``pre = sigmoid(mix[:hc] * scale[0] + base[:hc]) + hc_eps``;
* ``post = 2 * sigmoid(mix[hc:2hc] * scale[1] + base[hc:2hc])``;
* ``comb = softmax_over_columns(reshape(mix[2hc:] * scale[2] + base[2hc:], hc x hc)) + hc_eps``, then a column
  normalisation, then ``hc_sinkhorn_iters - 1`` further (row, column) normalisations, every denominator ``+ hc_eps``;
* ``x_mixed = sum_h pre[h] * x[h]`` (bf16 in a2a3 mode);
* ``hc_post``: ``y[o] = post[o] * out + sum_i comb[i, o] * x[i]`` (fp32);
* ``hc_head``: ``pre = sigmoid(mix[:hc] * scale[0] + base) + hc_eps`` with the head's own ``fn [hc, hc*D]``, then
  ``sum_h pre[h] * x[h]`` (bf16 in a2a3 mode).

A zero row (padding) gives ``x_mixed = 0`` and ``hc_post(0, 0) = 0``, so padding rows stay zero through a layer.

a2a3 reduction orders (``precision="a2a3"`` of :func:`hc_pre` and :func:`hc_post`; fp32 keeps numpy's / BLAS's
orders). The mix is an fp32 product over K = hc*D, and on an SWA layer the gate scale amplifies its last bits
into flipped bf16 roundings of ``x_mixed``, so the a2a3 mode forms it in the A2/A3 cube's order, as upstream's
hc_pre golden defines it:

* K is zero-padded to a multiple of :data:`RMS_CHUNK` (FLASH's 16384 needs none; zeros change no sum);
* mix: K cut into :data:`HC_K_SPLITS` = 4 contiguous slices (one cube task each); inside a slice the fp32 cube
  MAD adds :data:`CUBE_MAD_K` = 4 consecutive products to the running accumulator with one rounding to fp32
  (products and their sum formed in float64, as upstream's golden does), groups in ascending K order; the
  slice partials are then added in ascending order (((s0 + s1) + s2) + s3);
* sum of squares: 512-column chunks (:data:`RMS_CHUNK`), chunk sums accumulated in fp32 in ascending order,
  ``mean = ssq * fp32(1/K)``; inside a chunk (left to torch's reduction upstream) halving folds, column i plus
  column i + n/2 down to one, so the order is the same on every machine;
* gates ``1 / (1 + exp(-z))`` (the kernel's form); the hc-element sums of the Sinkhorn rows and columns and of
  ``x_mixed`` are pairwise trees, (a0 + a1) + (a2 + a3) for hc = 4 (upstream's kernel writes the column sums
  and the stream sum so);
* ``hc_post``: ``y[o] = post[o] * out``, then ``+ comb[i, o] * x[i]`` for i = 0, 1, ... in turn (the kernel's).

``hc_head`` keeps the fp32 orders in both precisions.

``precision="deepseek"`` (the official ``Block.hc_pre`` / ``hc_post`` / ``ParallelHead.hc_head``): fp32 arithmetic in
the fp32 orders (the tilelang Sinkhorn kernel's reductions are not restated), ``x_mixed`` and the hc_head output
rounded to bf16, and the ``hc_post`` output rounded to bf16: the official residual streams are bf16 tensors.
"""

from __future__ import annotations

import attrs
import numpy as np

from dspark_abi.config import ModelConfig
from dspark_kernels.model.block_weights import HcWeights
from dspark_kernels.model.numerics import (
    CUBE_MAD_K,
    HC_K_SPLITS,
    RMS_CHUNK,
    Precision,
    bf16_round,
    check_precision,
    narrow,
)


@attrs.frozen
class HcPre:
    """hc_pre outputs for T rows.

    x_mixed: [T, D] fp32 (bf16-representable in a2a3 mode); the single stream fed to the norm.
    post: [T, hc] fp32; stream weights of the sub-block output in :func:`hc_post`.
    comb: [T, hc, hc] fp32; ``comb[t, i, o]`` carries input stream i into output stream o.
    """

    x_mixed: np.ndarray
    post: np.ndarray
    comb: np.ndarray


def sigmoid(z: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function."""
    return np.asarray(np.exp(-np.logaddexp(np.float32(0), -z)).astype(np.float32))


def _mixes(x_hc: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    """``(flat(x) @ fn.T) * rsqrt(mean(flat(x)**2) + eps)``: [T, hc, D] -> [T, rows(fn)] fp32."""
    flat = x_hc.reshape(x_hc.shape[0], -1)  # (T, hc*D)
    mean_sq = np.einsum("tk,tk->t", flat, flat, dtype=np.float32) / np.float32(flat.shape[1])
    rho = (1.0 / np.sqrt(mean_sq + np.float32(norm_eps))).astype(np.float32)
    return np.asarray((flat @ fn.T) * rho[:, None])  # (T, mix)


def kernel_sigmoid(z: np.ndarray) -> np.ndarray:
    """The a2a3 kernels' logistic function ``1 / (1 + exp(-z))`` in fp32 (exp overflows to inf for z < -88: 0)."""
    z = np.asarray(z, dtype=np.float32)
    with np.errstate(over="ignore"):
        return np.asarray((np.float32(1) / (np.exp(-z) + np.float32(1))).astype(np.float32))


def pair_sum(v: np.ndarray, axis: int) -> np.ndarray:
    """Pairwise-tree fp32 sum over ``axis`` (kept as length 1): ``(v0 + v1) + (v2 + v3)`` for 4 elements.

    Adjacent pairs are added level by level; an odd level carries its last element (a zero pad: ``x + 0 = x``).
    """
    v = np.moveaxis(np.asarray(v, dtype=np.float32), axis, -1)
    while v.shape[-1] > 1:
        if v.shape[-1] % 2:
            v = np.concatenate([v, np.zeros_like(v[..., :1])], axis=-1)
        v = v[..., 0::2] + v[..., 1::2]
    return np.moveaxis(v, -1, axis)


def split_sinkhorn(mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, *, hc_mult: int,
                   iters: int, eps: float, precision: Precision = "fp32"
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``mixes [T, (2+hc)*hc]`` into ``pre [T, hc]``, ``post [T, hc]`` and the Sinkhorn-normalised
    ``comb [T, hc, hc]``.

    The first normalisation is a softmax over the last axis (+eps), then columns; ``iters - 1`` more rounds of
    rows then columns follow, so ``comb`` ends column-normalised after ``iters`` column steps. ``"a2a3"`` uses
    the kernels' sigmoid form and pairwise-tree row / column sums (module docstring); ``"fp32"`` numpy's.
    """
    hc = hc_mult
    eps32 = np.float32(eps)
    if precision == "a2a3":
        sig = kernel_sigmoid

        def rows(c: np.ndarray) -> np.ndarray:
            return pair_sum(c, -1)

        def cols(c: np.ndarray) -> np.ndarray:
            return pair_sum(c, -2)
    else:
        sig = sigmoid

        def rows(c: np.ndarray) -> np.ndarray:
            return np.asarray(c.sum(axis=-1, keepdims=True))

        def cols(c: np.ndarray) -> np.ndarray:
            return np.asarray(c.sum(axis=-2, keepdims=True))
    pre = sig(mixes[:, :hc] * scale[0] + base[:hc]) + eps32
    post = np.float32(2) * sig(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)  # (T, in, out)
    comb = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = comb / rows(comb) + eps32
    comb = comb / (cols(comb) + eps32)
    for _ in range(iters - 1):
        comb = comb / (rows(comb) + eps32)
        comb = comb / (cols(comb) + eps32)
    return pre.astype(np.float32), post.astype(np.float32), comb.astype(np.float32)


def cube_padded_width(k: int) -> int:
    """K = hc*D rounded up to a whole number of :data:`RMS_CHUNK` columns (the a2a3 orders' zero padding)."""
    return -(-k // RMS_CHUNK) * RMS_CHUNK


def _pad_columns(a: np.ndarray, width: int) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    if a.shape[1] == width:
        return a
    return np.concatenate([a, np.zeros((a.shape[0], width - a.shape[1]), np.float32)], axis=1)


def a2a3_inv_rms(flat: np.ndarray, k: int, norm_eps: float) -> np.ndarray:
    """``rsqrt(ssq * fp32(1/k) + eps)`` with the a2a3 sum-of-squares order: flat [T, Kp] (zero-padded) -> [T].

    Each 512-column chunk of ``x*x`` is reduced by halving folds; chunk sums are accumulated in ascending order.
    """
    t_rows, kp = flat.shape
    sq = (flat * flat).reshape(t_rows, kp // RMS_CHUNK, RMS_CHUNK)   # (T, chunks, 512)
    while sq.shape[-1] > 1:
        half = sq.shape[-1] // 2
        sq = sq[..., :half] + sq[..., half:]
    ssq = np.add.accumulate(sq[..., 0], axis=1)[:, -1]              # sequential over chunks
    mean_sq = ssq * np.float32(1.0 / k) + np.float32(norm_eps)
    return np.asarray((np.float32(1) / np.sqrt(mean_sq)).astype(np.float32))


def cube_mixes(flat: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """``flat @ fn.T`` in the A2/A3 cube's order: flat [T, Kp], fn [M, Kp] (Kp a multiple of 16) -> [T, M] fp32.

    Kp is cut into :data:`HC_K_SPLITS` slices; each slice runs one fp32 accumulator chain over groups of
    :data:`CUBE_MAD_K` consecutive products (group sum formed in float64, added to the accumulator and rounded
    to fp32 once), groups in ascending K order; the slice partials are added in ascending order. The loop runs
    over the Kp / 16 groups of the chain (a sequential recurrence), vectorized over tokens, rows and slices.
    """
    t_rows, kp = flat.shape
    groups = kp // (HC_K_SPLITS * CUBE_MAD_K)
    x4 = flat.reshape(t_rows, HC_K_SPLITS, groups, CUBE_MAD_K)
    w4 = np.asarray(fn, dtype=np.float32).reshape(-1, HC_K_SPLITS, groups, CUBE_MAD_K)
    acc = np.zeros((HC_K_SPLITS, t_rows, w4.shape[0]), np.float32)                 # (slice, T, M)
    for g in range(groups):
        xg = x4[:, :, g, :].transpose(1, 0, 2).astype(np.float64)                  # (slice, T, 4)
        wg = w4[:, :, g, :].transpose(1, 2, 0).astype(np.float64)                  # (slice, 4, M)
        acc = (acc + np.matmul(xg, wg)).astype(np.float32)  # exact products; one rounding into fp32
    return np.asarray(np.add.accumulate(acc, axis=0)[-1])                                     # ((s0 + s1) + s2) + s3


def hc_pre(x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision = "fp32") -> HcPre:
    """Reduce the ``hc`` streams of every row to one (see the module docstring).

    x_hc: [T, hc, D] fp32 residual streams; padding rows are zero and give zero ``x_mixed``.
    """
    check_precision(precision)
    x_hc = np.asarray(x_hc, dtype=np.float32)
    if precision == "a2a3":
        flat = x_hc.reshape(x_hc.shape[0], -1)
        kp = cube_padded_width(flat.shape[1])
        flat_p = _pad_columns(flat, kp)
        rho = a2a3_inv_rms(flat_p, flat.shape[1], config.rms_norm_eps)
        mixes = cube_mixes(flat_p, _pad_columns(weights.fn, kp)) * rho[:, None]
    else:
        mixes = _mixes(x_hc, weights.fn, config.rms_norm_eps)
    pre, post, comb = split_sinkhorn(mixes, weights.scale, weights.base, hc_mult=config.hc_mult,
                                     iters=config.hc_sinkhorn_iters, eps=config.hc_eps, precision=precision)
    if precision == "a2a3":
        x_mixed = pair_sum(pre[:, :, None] * x_hc, 1)[:, 0]  # (T, D): (y0 + y1) + (y2 + y3)
    else:
        x_mixed = np.einsum("th,thd->td", pre, x_hc, dtype=np.float32)  # (T, D)
    return HcPre(x_mixed=narrow(x_mixed, precision), post=post, comb=comb)


def hc_post(out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray, *,
            precision: Precision = "fp32") -> np.ndarray:
    """Expand a sub-block output back to ``hc`` streams:
    ``y[:, o] = post[:, o] * out + sum_i comb[:, i, o] * x_hc[:, i]``.

    out: [T, D] attention or FFN output (fp32 values); x_hc: [T, hc, D] the streams hc_pre read.
    Returns [T, hc, D] fp32 (computed in fp32 in every precision, as upstream does). ``"a2a3"`` adds in the
    kernel's order, ``post * out`` first and then the streams i = 0, 1, ... one by one; ``"deepseek"`` rounds the
    result to bf16 (``y.type_as(x)`` of the official ``hc_post``).
    """
    check_precision(precision)
    out = np.asarray(out, dtype=np.float32)
    if precision == "a2a3":
        x_hc = np.asarray(x_hc, dtype=np.float32)
        mixed = post[:, :, None] * out[:, None, :]                       # (T, hc, D)
        for i in range(x_hc.shape[1]):
            mixed = mixed + comb[:, i, :, None] * x_hc[:, i, None, :]
        return np.asarray(mixed.astype(np.float32))
    mixed = np.einsum("tio,tid->tod", comb, x_hc, dtype=np.float32)  # (T, hc, D)
    mixed += post[:, :, None] * out[:, None, :]
    return bf16_round(mixed) if precision == "deepseek" else mixed


def hc_head(x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision = "fp32") -> np.ndarray:
    """The head's stream reduction (no Sinkhorn): x_hc [T, hc, D] -> [T, D] fp32 (bf16 values in a2a3 mode)."""
    check_precision(precision)
    x_hc = np.asarray(x_hc, dtype=np.float32)
    mixes = _mixes(x_hc, weights.fn, config.rms_norm_eps)  # (T, hc)
    pre = sigmoid(mixes * weights.scale[0] + weights.base) + np.float32(config.hc_eps)
    y = np.einsum("th,thd->td", pre, x_hc, dtype=np.float32)
    return narrow(y, precision)
