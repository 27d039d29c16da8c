"""The weight arrays each precision computes with, derived from an `AttentionWeights`, and the cache of them
that the caller of a forward (or of one attention call) owns.

``"fp32"`` and ``"deepseek"``: the checkpoint's float32 arrays unchanged; no scales (``"deepseek"`` quantises
activations, never weights: :mod:`dspark_kernels.model.deepseek_numerics`; ``fp8_inputs`` names the Linears whose
weights were stored FP8 / FP4 as loaded, whose inputs it quantises).
``"a2a3"``: the dtypes of upstream's a2a3 kernels (their prefill entry's tensor list):

* bf16 (bf16-rounded float32): ``wq_a``, ``q_norm``, ``wkv``, ``kv_norm``, ``wo_a``, compressor ``wkv``/``wgate``/
  ``norm``, indexer ``weights_proj``, and the Hadamard matrix;
* int8 per output channel (integer-valued float32 + [out] float32 dequant scale, the ``int8q`` recipe over
  each [out, in] row, or the checkpoint's own int8 values and scales when it stores them so,
  ``AttentionWeights.stored_int8``): ``wq_b``, ``indexer.wq_b``, ``wo_b``;
* fp32: ``attn_sink`` and the compressor ``ape`` biases.
"""

from __future__ import annotations

import threading

import attrs
import numpy as np

from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.attention_weights import AttentionWeights, CompressorWeights
from dspark_kernels.model.numerics import Precision, bf16_round, check_precision, hadamard, int8_quantize

#: A compressor's arrays in one precision: the same fields as the checkpoint's, with narrowed weights.
PreparedCompressor = CompressorWeights


@attrs.frozen(eq=False)
class PreparedWeights:
    """Arrays of one layer in one precision. ``*_scale`` are [out] dequant scales (``None`` in fp32)."""

    precision: Precision
    wq_a: np.ndarray
    """[Q, X]"""
    q_norm: np.ndarray
    """[Q]"""
    wq_b: np.ndarray
    """[H*D, Q] (int8-valued in a2a3)"""
    wq_b_scale: np.ndarray | None
    wkv: np.ndarray
    """[D, X]"""
    kv_norm: np.ndarray
    """[D]"""
    wo_a: np.ndarray
    """[G, Ro, H*D/G]: wo_a rows grouped [g][r]"""
    wo_b: np.ndarray
    """[X, G*Ro] (int8-valued in a2a3)"""
    wo_b_scale: np.ndarray | None
    attn_sink: np.ndarray
    """[H] fp32"""
    compressor: PreparedCompressor | None
    idx_wq_b: np.ndarray | None
    """[HI*dI, Q] (int8-valued in a2a3); CSA only"""
    idx_wq_b_scale: np.ndarray | None
    idx_weights_proj: np.ndarray | None
    """[HI, X]; CSA only"""
    idx_compressor: PreparedCompressor | None
    idx_hadamard: np.ndarray | None
    """[dI, dI] Sylvester Hadamard / sqrt(dI) (bf16-rounded in a2a3); CSA only"""
    fp8_inputs: frozenset[str] = frozenset()
    """Block-relative names (``attn.wq_a``, ...) of the Linears whose weight is stored FP8 / FP4 as loaded, minus
    ``wo_a`` (:func:`~dspark_kernels.model.deepseek_numerics.fp8_inputs`): ``"deepseek"`` quantises their inputs."""


def _weight(w: np.ndarray, precision: Precision) -> np.ndarray:
    """A weight the a2a3 kernels read in bf16: bf16-rounded in ``"a2a3"``; ``"fp32"`` and ``"deepseek"`` use it as
    given (a real checkpoint's values are already what the official inference holds)."""
    return bf16_round(w) if precision == "a2a3" else w


def _compressor(cw: CompressorWeights | None, precision: Precision) -> PreparedCompressor | None:
    if cw is None:
        return None
    return PreparedCompressor(_weight(cw.wkv, precision), _weight(cw.wgate, precision), cw.ape,
                              _weight(cw.norm, precision))


def _int8_or_float(w: np.ndarray, precision: Precision, stored: tuple[np.ndarray, np.ndarray] | None
                   ) -> tuple[np.ndarray, np.ndarray | None]:
    if precision != "a2a3":
        return w, None
    if stored is not None:  # a W8A8 checkpoint: its own int8 values and scales (re-quantising moves scales an ulp)
        return stored
    return int8_quantize(w)  # per output channel: one scale per row of [out, in]


def prepare_weights(weights: AttentionWeights, precision: str) -> PreparedWeights:
    """Derive the arrays ``precision`` uses from ``weights`` (pure; the caller caches the result)."""
    prec = check_precision(precision)
    c = weights.config
    stored = weights.stored_int8
    wq_b, wq_b_scale = _int8_or_float(weights.wq_b, prec, stored.get("wq_b.weight"))
    wo_b, wo_b_scale = _int8_or_float(weights.wo_b, prec, stored.get("wo_b.weight"))
    wo_a = _weight(weights.wo_a, prec).reshape(c.o_groups, c.o_lora_rank, -1)   # (G, Ro, H*D/G)
    idx = weights.indexer
    idx_wq_b = idx_scale = idx_proj = idx_h = None
    if idx is not None:
        idx_wq_b, idx_scale = _int8_or_float(idx.wq_b, prec, stored.get("indexer.wq_b.weight"))
        idx_proj = _weight(idx.weights_proj, prec)
        idx_h = _weight(hadamard(c.index_head_dim), prec)
    return PreparedWeights(
        precision=prec, wq_a=_weight(weights.wq_a, prec), q_norm=_weight(weights.q_norm, prec),
        wq_b=wq_b, wq_b_scale=wq_b_scale, wkv=_weight(weights.wkv, prec), kv_norm=_weight(weights.kv_norm, prec),
        wo_a=wo_a, wo_b=wo_b, wo_b_scale=wo_b_scale, attn_sink=weights.attn_sink,
        compressor=_compressor(weights.compressor, prec), idx_wq_b=idx_wq_b, idx_wq_b_scale=idx_scale,
        idx_weights_proj=idx_proj, idx_compressor=_compressor(idx.compressor if idx else None, prec),
        idx_hadamard=idx_h, fp8_inputs=ds.fp8_inputs(weights.fp8_stored, "attn."),
    )


def prepared_for(weights: AttentionWeights, precision: str, cache: PreparedWeightsCache | None) -> PreparedWeights:
    """``cache.get(weights, precision)``, or the weights prepared now when there is no cache."""
    return prepare_weights(weights, precision) if cache is None else cache.get(weights, precision)


class PreparedWeightsCache:
    """Prepared weights per (layer, precision), owned by the call that runs the layers (a forward, a prefill,
    a run of several prefills, a benchmark), never by the frozen :class:`AttentionWeights` they come from.

    :meth:`get` prepares a layer's weights on first use and returns the kept result while it is asked for the
    same :class:`AttentionWeights` object again (a :class:`~dspark_kernels.model.weights.ModelWeights` that
    keeps its layers hands out the same object each time). ``keep=False`` keeps nothing (streaming weights,
    ``keep_layers=False``: a kept entry would hold every layer in memory). Thread-safe: the ranks of an
    in-process TP group share one cache and prepare each layer once.
    """

    def __init__(self, *, keep: bool = True):
        self.keep = keep
        self._entries: dict[tuple[int, str], tuple[AttentionWeights, PreparedWeights]] = {}
        self._lock = threading.Lock()

    def get(self, weights: AttentionWeights, precision: str) -> PreparedWeights:
        """The :class:`PreparedWeights` of ``weights`` in ``precision`` (prepared now unless kept)."""
        prec = check_precision(precision)
        key = (weights.layer, prec)
        with self._lock:
            kept = self._entries.get(key)
            if kept is not None and kept[0] is weights:
                return kept[1]
            prepared = prepare_weights(weights, prec)
            if self.keep:
                self._entries[key] = (weights, prepared)
            return prepared
