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
"""

from __future__ import annotations

import attrs
import numpy as np

from dspark_abi.config import ModelConfig
from dspark_kernels.reference.numerics import Precision, check_precision, narrow


@attrs.frozen
class HcWeights:
    """One hyper-connection mixer (``hc_attn_*``, ``hc_ffn_*`` or ``hc_head_*``), all fp32.

    fn: [(2 + hc) * hc, hc * D] for a layer mixer, [hc, hc * D] for the head.
    scale: [3] for a layer mixer (pre, post, comb), [1] for the head.
    base: [(2 + hc) * hc] or [hc].
    """

    fn: np.ndarray
    scale: np.ndarray
    base: np.ndarray


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
    return np.exp(-np.logaddexp(np.float32(0), -z)).astype(np.float32)


def _mixes(x_hc: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    """``(flat(x) @ fn.T) * rsqrt(mean(flat(x)**2) + eps)``: [T, hc, D] -> [T, rows(fn)] fp32."""
    flat = x_hc.reshape(x_hc.shape[0], -1)  # (T, hc*D)
    mean_sq = np.einsum("tk,tk->t", flat, flat, dtype=np.float32) / np.float32(flat.shape[1])
    rho = (1.0 / np.sqrt(mean_sq + np.float32(norm_eps))).astype(np.float32)
    return (flat @ fn.T) * rho[:, None]  # (T, mix)


def split_sinkhorn(mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, *, hc_mult: int,
                   iters: int, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``mixes [T, (2+hc)*hc]`` into ``pre [T, hc]``, ``post [T, hc]`` and the Sinkhorn-normalised
    ``comb [T, hc, hc]``.

    The first normalisation is a softmax over the last axis (+eps), then columns; ``iters - 1`` more rounds of
    rows then columns follow, so ``comb`` ends column-normalised after ``iters`` column steps.
    """
    hc = hc_mult
    eps32 = np.float32(eps)
    pre = sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps32
    post = np.float32(2) * sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)  # (T, in, out)
    comb = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + eps32
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps32)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps32)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps32)
    return pre.astype(np.float32), post.astype(np.float32), comb.astype(np.float32)


def hc_pre(x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision = "fp32") -> HcPre:
    """Reduce the ``hc`` streams of every row to one (see the module docstring).

    x_hc: [T, hc, D] fp32 residual streams; padding rows are zero and give zero ``x_mixed``.
    """
    check_precision(precision)
    x_hc = np.asarray(x_hc, dtype=np.float32)
    mixes = _mixes(x_hc, weights.fn, config.rms_norm_eps)
    pre, post, comb = split_sinkhorn(mixes, weights.scale, weights.base, hc_mult=config.hc_mult,
                                     iters=config.hc_sinkhorn_iters, eps=config.hc_eps)
    x_mixed = np.einsum("th,thd->td", pre, x_hc, dtype=np.float32)  # (T, D)
    return HcPre(x_mixed=narrow(x_mixed, precision), post=post, comb=comb)


def hc_post(out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Expand a sub-block output back to ``hc`` streams:
    ``y[:, o] = post[:, o] * out + sum_i comb[:, i, o] * x_hc[:, i]``.

    out: [T, D] attention or FFN output (fp32 values); x_hc: [T, hc, D] the streams hc_pre read.
    Returns [T, hc, D] fp32 (computed in fp32 in both precisions, as upstream does).
    """
    mixed = np.einsum("tio,tid->tod", comb, x_hc, dtype=np.float32)  # (T, hc, D)
    mixed += post[:, :, None] * np.asarray(out, dtype=np.float32)[:, None, :]
    return mixed


def hc_head(x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision = "fp32") -> np.ndarray:
    """The head's stream reduction (no Sinkhorn): x_hc [T, hc, D] -> [T, D] fp32 (bf16 values in a2a3 mode)."""
    check_precision(precision)
    x_hc = np.asarray(x_hc, dtype=np.float32)
    mixes = _mixes(x_hc, weights.fn, config.rms_norm_eps)  # (T, hc)
    pre = sigmoid(mixes * weights.scale[0] + weights.base) + np.float32(config.hc_eps)
    y = np.einsum("th,thd->td", pre, x_hc, dtype=np.float32)
    return narrow(y, precision)
