"""Stage 2 (reference): query and shared-KV projections of an attention layer (DeepSeek-V4 ``Attention``;
upstream's pre-attention stage).

q path (query rows): ``qr = rms_norm(x @ wq_a.T, q_norm)`` [T, Q];
``q = (qr @ wq_b.T).reshape(T, H, D)``, an unweighted per-head RMS norm, RoPE on the last rd dims at the
token's position. In a2a3, ``qr`` is int8-quantised per row and ``q = (qr_i8 @ wq_b_i8) * qr_scale *
wq_b_scale`` (exact integer product), and q is rounded to bf16 after RoPE. ``qr`` is reused by the indexer.

kv path (all group rows): ``kv = rms_norm(x @ wkv.T, kv_norm)`` [T, D], RoPE on the last rd dims; bf16 in
a2a3. This single latent is both key and value of every head.

deepseek (the official ``Attention.forward``): ``wq_a``, ``wq_b`` and ``wkv`` are FP8 GEMMs (e4m3 input per 1x128
block, bf16 output); ``qr``, the per-head RMS (bf16 ops) and every norm output are bf16; q and kv are bf16
after RoPE, and kv's non-RoPE dims are then FP8 fake-quantised
(:func:`~dspark_kernels.model.deepseek_numerics.kv_fake_quant`).
"""

from __future__ import annotations

import attrs
import numpy as np

from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.numerics import Precision, int8_matmul, int8_quantize, linear, narrow, rms_norm
from dspark_kernels.model.prepared import PreparedWeights
from dspark_kernels.model.rope import apply_rope


@attrs.frozen(eq=False)
class LowRankQuery:
    """The normalised low-rank query ``qr`` and, in a2a3, its per-row int8 form."""

    qr: np.ndarray
    """[T, Q] float32"""
    qr_q: np.ndarray | None
    """[T, Q] int8-valued float32 (a2a3) or None"""
    qr_scale: np.ndarray | None
    """[T] float32 dequant scale (a2a3) or None"""
    precision: Precision = "fp32"
    fp8: frozenset[str] = frozenset()
    """deepseek: the layer's Linears stored FP8 / FP4 (``PreparedWeights.fp8_inputs``)"""

    def project(self, weight: np.ndarray, scale: np.ndarray | None, name: str | None = None) -> np.ndarray:
        """``qr @ weight.T`` [T, out]; with int8 ``weight`` and ``scale`` [out], the a2a3 integer product; in
        deepseek the official Linear of checkpoint tensor ``name`` (required there; FP8 GEMM, bf16 output)."""
        if self.precision == "deepseek":
            if name is None:
                raise ValueError("a deepseek projection needs the weight's checkpoint name (e.g. 'attn.wq_b')")
            return ds.linear(self.qr, weight, name, self.fp8)
        if scale is None or self.qr_q is None or self.qr_scale is None:
            return linear(self.qr, weight)
        return np.asarray(int8_matmul(self.qr_q, weight) * self.qr_scale[:, None] * scale[None, :])


def low_rank_query(x: np.ndarray, w: PreparedWeights, eps: float, precision: Precision) -> LowRankQuery:
    """``qr = rms_norm(x @ wq_a.T, q_norm)`` for query rows x [T, X]; quantised per row in a2a3."""
    if precision == "deepseek":
        qr = narrow(rms_norm(ds.linear(x, w.wq_a, "attn.wq_a", w.fp8_inputs), w.q_norm, eps), precision)  # (T, Q)
        return LowRankQuery(qr, None, None, precision, w.fp8_inputs)
    qr = rms_norm(linear(x, w.wq_a), w.q_norm, eps)                                     # (T, Q)
    if precision == "fp32":
        return LowRankQuery(qr, None, None)
    qr_q, qr_scale = int8_quantize(qr)
    return LowRankQuery(qr, qr_q, qr_scale)


def query_heads(lrq: LowRankQuery, w: PreparedWeights, cos: np.ndarray, sin: np.ndarray, heads: int,
                eps: float, precision: Precision) -> np.ndarray:
    """q [T, H, D] float32: wq_b projection, unweighted per-head RMS norm, RoPE (cos/sin [T, rd/2])."""
    q = lrq.project(w.wq_b, w.wq_b_scale, "attn.wq_b")                               # (T, H*D)
    q = q.reshape(q.shape[0], heads, -1)                                             # (T, H, D)
    q = ds.head_rms(q, eps) if precision == "deepseek" else rms_norm(q, None, eps)
    return narrow(apply_rope(q, cos, sin, out=q), precision)


def shared_kv(x: np.ndarray, w: PreparedWeights, cos: np.ndarray, sin: np.ndarray, eps: float,
              precision: Precision) -> np.ndarray:
    """kv [T, D] float32 (bf16 values in a2a3; FP8-fake-quantised non-RoPE dims in deepseek):
    ``rms_norm(x @ wkv.T, kv_norm)`` then RoPE."""
    if precision == "deepseek":
        kv = narrow(rms_norm(ds.linear(x, w.wkv, "attn.wkv", w.fp8_inputs), w.kv_norm, eps), precision)  # (T, D)
        return ds.kv_fake_quant(narrow(apply_rope(kv, cos, sin, out=kv), precision), 2 * cos.shape[-1])
    kv = rms_norm(linear(x, w.wkv), w.kv_norm, eps)                                     # (T, D)
    return narrow(apply_rope(kv, cos, sin, out=kv), precision)
