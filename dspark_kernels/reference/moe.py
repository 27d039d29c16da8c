"""MoE FFN: the ffn RMSNorm, gate (sqrtsoftplus scoring, bias-shifted top-k or hash routing), routed SwiGLU
experts, shared expert.

Math (DeepSeek-V4 ``Gate`` / ``Expert`` / ``MoE``; upstream's post-attention stage), for a row ``x [D]``:

* ``x_f = rms_norm(x, ffn_norm)`` when the layer's norm weight is passed (``norm``; ``x`` is then hc_pre's
  ``x_mixed`` row), else ``x`` as given (rows already normalised);
* ``s = score(x_f @ gate_w.T)`` with ``score`` = sqrt(softplus(.)) (``sqrtsoftplus``, computed as
  ``sqrt(max(l, 0) + log1p(exp(-|l|)))``), softmax or sigmoid;
* selection: hash layers (``layer < num_hash_layers``) take ``tid2eid[token_id]``; other layers take the
  top-k of ``s + gate_bias`` (the bias shifts the choice only, never the weights). Ties go to the lower
  expert id (stable sort), so packed and alone runs choose alike;
* weights ``w = s[selected]``, divided by their sum when ``norm_topk_prob`` and scoring is not softmax
  (DeepSeek-V4 never renormalises softmax scores), then times ``routed_scaling_factor``;
* routed expert e: ``h = silu(min(x@w1.T, L)) * clip(x@w3.T, -L, L)`` with ``L = swiglu_limit`` (0 = no clamp),
  ``y_e = (w_e * h) @ w2.T``; the shared expert is the same clamped SwiGLU without a weight (DeepSeek's
  ``inference/model.py`` as shipped with DeepSeek-V4-Flash-DSpark / -0731 builds it with ``swiglu_limit``; the
  earlier V4-Flash release, 0825add, did not: docs/checkpoints.md section 4);
* ``out = sum_e y_e + shared``.

Experts run vectorized: the (row, slot) pairs are grouped by expert id
(:class:`~dspark_kernels.model.experts.ExpertGroups`) and each expert runs one matmul over all its rows (one
Python iteration per expert used, never per token), then the results are added back per row.

Precision ``"a2a3"``: the numerics of upstream's a2a3 MoE kernels and their goldens (hw-native-sys/pypto-lib
commit 634e77b, ``models/deepseek_v4_flash_dspark/``: ``gate.py`` (``gate``, ``golden_gate_core``),
``expert_routed.py``, ``expert_shared.py``, and ``moe.py`` (``combine``)), W8A8 throughout:

* input bf16 rows. The ffn RMSNorm is deferred into the gate: ``inv_rms = 1 / sqrt(sum(x^2) * (1/D) + eps)`` (the
  sum in torch's CPU order, :func:`~dspark_kernels.model.numerics.torch_sum`, as upstream's ``golden_gate_core``) and
  ``xg = x * bf16(ffn_norm)`` in fp32, never narrowed (without ``norm``: ``inv_rms = 1``, ``xg = x``);
* gate in fp32: ``logits = (xg @ gate_w.T) * inv_rms``, scores, selection and weights as above;
* one per-token int8 quantisation of ``xg`` (``int8q``: amax floored at 1e-4, ``q = rint(xg * 127 / amax)``)
  with dequant scale ``(amax / 127) * inv_rms`` (a positive per-row factor changes no int8 code, so the norm
  rides the scale); the routed and the shared expert both read it;
* weights int8 with one fp32 scale per output channel (:func:`~dspark_kernels.model.experts.expert_int8`: an
  expert is quantised when a token is routed to it, or the checkpoint's stored int8 is used);
* per (row, slot) pair of expert e: ``gate = (x_q @ w1_q.T in int32) * x_scale * w1_scale``, ``up`` likewise
  with w3, the SwiGLU clamp, ``h = gate * (1 / (1 + exp(-gate))) * up`` in fp32; ``h`` re-quantised per row
  (``int8q`` again: ``h_q``, ``h_scale``); ``y = bf16((h_q @ w2_q.T in int32) * (h_scale * w) * w2_scale)``:
  the routing weight joins after the re-quantisation, on the dequant scale;
* the shared expert: the same chain without a routing weight, with the SwiGLU clamp (as upstream's
  ``expert_shared`` and DeepSeek's DSpark release), output bf16;
* ``out = bf16(shared + y_slot0 + y_slot1 + ...)``, fp32 additions in slot order.

Precision ``"deepseek"`` (DeepSeek's official ``MoE`` / ``Expert``, :mod:`dspark_kernels.model.deepseek_numerics`):
bf16 input rows, the gate in fp32; every expert projection returns bf16 and, when its weight is stored FP8 / FP4
(``MoEWeights.fp8_stored``; shipped: routed FP4, shared FP8), quantises its input to e4m3 per 1x128 block first;
``silu(gate) * up`` (times the routing weight) in fp32, rounded to bf16 before
``w2``; the expert outputs are summed in fp32 in expert order, then the shared expert; the output is bf16.
"""

from __future__ import annotations

import attrs
import numpy as np

from dspark_abi.config import ModelConfig
from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.block_weights import MoEWeights
from dspark_kernels.model.experts import ExpertGroups, check_expert_ids, expert_int8, linear_int8
from dspark_kernels.model.numerics import (
    Precision,
    bf16_round,
    check_precision,
    int8_matmul,
    int8_quantize,
    linear,
    narrow,
    rms_norm,
    torch_sum,
)


def _score(logits: np.ndarray, func: str) -> np.ndarray:
    result: np.ndarray
    if func == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        result = e / e.sum(axis=-1, keepdims=True)
        return result
    if func == "sigmoid":
        result = np.exp(-np.logaddexp(np.float32(0), -logits))
        return result
    # sqrtsoftplus, in upstream's stable form (golden_gate_core; equal to F.softplus)
    result = np.sqrt(np.maximum(logits, np.float32(0)) + np.log1p(np.exp(-np.abs(logits))))
    return result


def route(x: np.ndarray, weights: MoEWeights, config: ModelConfig, token_ids: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Gate T rows: returns (expert weights [T, K] fp32, expert ids [T, K] int64).

    x: [T, D] fp32 rows (live rows only). token_ids: [T] int, required by hash layers (``tid2eid`` set).
    """
    logits = np.asarray(x, dtype=np.float32) @ weights.gate_w.T  # (T, E)
    return _select(_score(logits, config.moe.scoring_func).astype(np.float32), weights, config, token_ids)


def _select(scores: np.ndarray, weights: MoEWeights, config: ModelConfig, token_ids: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray]:
    """(routing weights [T, K] fp32, expert ids [T, K] int64) from the scores [T, E] fp32."""
    moe = config.moe
    k = moe.num_experts_per_tok
    if weights.tid2eid is not None:
        if token_ids is None:
            raise ValueError("token_ids are required by a hash-routed layer (tid2eid), got None")
        experts = weights.tid2eid[np.asarray(token_ids, dtype=np.int64)].astype(np.int64)  # (T, K)
        check_expert_ids(experts, scores.shape[1], "tid2eid[token_ids]")
    else:
        biased = scores if weights.gate_bias is None else scores + weights.gate_bias
        experts = np.argsort(-biased, axis=-1, kind="stable")[:, :k].astype(np.int64)  # (T, K)
    w = np.take_along_axis(scores, experts, axis=-1)  # (T, K)
    if moe.norm_topk_prob and moe.scoring_func != "softmax":
        w = w / w.sum(axis=-1, keepdims=True)
    return (w * np.float32(moe.routed_scaling_factor)).astype(np.float32), experts


def _swiglu(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    if limit > 0:
        up = np.clip(up, -limit, limit)
        gate = np.minimum(gate, np.float32(limit))
    # silu(gate) * up, as the kernels
    result: np.ndarray = gate * (np.float32(1) / (np.float32(1) + np.exp(-gate))) * up
    return result


def _project(x: np.ndarray, w: np.ndarray, name: str, precision: Precision, fp8: frozenset[str]) -> np.ndarray:
    """``x @ w.T``; in ``"deepseek"`` the official Linear of checkpoint tensor ``name`` (bf16 out; an FP8 / FP4
    GEMM when ``name`` is in ``fp8``, the layer's ``MoEWeights.fp8_stored``)."""
    return ds.linear(x, w, name, fp8) if precision == "deepseek" else x @ w.T


def routed_experts(x: np.ndarray, expert_w: np.ndarray, expert_ids: np.ndarray, weights: MoEWeights,
                   config: ModelConfig, *, precision: Precision = "fp32") -> np.ndarray:
    """Sum of the selected experts' outputs per row, grouped by expert: [T, D] fp32.

    x: [T, D]; expert_w: [T, K] fp32 routing weights; expert_ids: [T, K] int in [0, E).
    """
    t, k = expert_ids.shape
    out = np.zeros((t, x.shape[1]), dtype=np.float32)
    pair_w = expert_w.reshape(-1)
    limit = float(config.moe.swiglu_limit)
    for e, pairs in ExpertGroups.build(expert_ids, weights.w1.shape[0]):  # pairs: (n_e,) pair ids t*K + k
        rows = pairs // k                                                 # (n_e,) token rows
        xe = x[rows]                                                      # (n_e, D)
        h = _swiglu(_project(xe, weights.w1[e], "ffn.experts.w1", precision, weights.fp8_stored),
                    _project(xe, weights.w3[e], "ffn.experts.w3", precision, weights.fp8_stored), limit)
        h = narrow(h * pair_w[pairs][:, None], precision)                 # (n_e, I)
        ye = _project(h, weights.w2[e], "ffn.experts.w2", precision, weights.fp8_stored)     # (n_e, D)
        np.add.at(out, rows, ye)  # a row may pick one expert twice only through a hash table; add.at sums both
    return out


def shared_expert(x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, precision: Precision = "fp32"
                  ) -> np.ndarray:
    """The always-on expert, a SwiGLU clamped at ``swiglu_limit`` like the routed experts (DeepSeek's DSpark
    release): [T, D] -> [T, D] fp32; zeros when there is none."""
    w1, w2, w3 = weights.shared_w1, weights.shared_w2, weights.shared_w3
    if _no_shared(weights) or w1 is None or w2 is None or w3 is None:
        return np.zeros_like(x, dtype=np.float32)
    fp8 = weights.fp8_stored
    h = _swiglu(_project(x, w1, "ffn.shared_experts.w1", precision, fp8),
                _project(x, w3, "ffn.shared_experts.w3", precision, fp8), float(config.moe.swiglu_limit))
    return _project(narrow(h, precision), w2, "ffn.shared_experts.w2", precision, fp8)


# ---------------------------------------------------------------------------------------------- a2a3 (W8A8)
@attrs.frozen(eq=False)
class QuantizedGate:
    """The a2a3 gate's outputs (upstream's ``gate``): the rows' int8 activations and their routing.

    x_q: [T, D] int8; x_scale: [T] fp32 dequant scale of each row (``inv_rms`` folded in); weights: [T, K] fp32;
    experts: [T, K] int64.
    """

    x_q: np.ndarray
    x_scale: np.ndarray
    weights: np.ndarray
    experts: np.ndarray


def quantized_gate(x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
                   token_ids: np.ndarray | None = None) -> QuantizedGate:
    """The a2a3 gate over T live rows: deferred ffn RMSNorm, fp32 logits and routing, per-token int8 of ``xg``.

    x: [T, D] fp32 holding bf16 values (``x_mixed`` rows with ``norm`` [D], else rows already normalised).
    """
    x = np.asarray(x, dtype=np.float32)
    if norm is None:
        xg, inv_rms = x, np.ones(x.shape[0], np.float32)
    else:
        ssq = torch_sum(x * x)   # (T,) in the order of upstream's golden (torch's CPU sum of x * x)
        inv_rms = np.float32(1) / np.sqrt(ssq * np.float32(1.0 / x.shape[1]) + np.float32(config.rms_norm_eps))
        xg = x * bf16_round(np.asarray(norm, dtype=np.float32))                             # (T, D)
    x_q, x_dq = int8_quantize(xg)
    logits = linear(xg, np.asarray(weights.gate_w, dtype=np.float32)) * inv_rms[:, None]  # (T, E)
    w, experts = _select(_score(logits, config.moe.scoring_func).astype(np.float32), weights, config, token_ids)
    return QuantizedGate(x_q=x_q.astype(np.int8), x_scale=(x_dq * inv_rms).astype(np.float32), weights=w,
                         experts=experts)


def _w8a8(x_q: np.ndarray, x_scale: np.ndarray, w_q: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """``(x_q @ w_q.T in integers) * x_scale (per row) * w_scale (per column)``: [M, N] fp32."""
    result: np.ndarray = int8_matmul(x_q, w_q) * x_scale[:, None] * w_scale[None, :]
    return result


def _down(h: np.ndarray, row_w: np.ndarray | None, w_q: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """w2 of the a2a3 experts: h [M, I] re-quantised per row, ``(h_q @ w2_q.T) * (h_scale * row_w) * w2_scale``."""
    h_q, h_scale = int8_quantize(h)
    row = h_scale if row_w is None else h_scale * row_w
    result: np.ndarray = int8_matmul(h_q, w_q) * row[:, None] * w_scale[None, :]
    return result


def quantized_experts(gate: QuantizedGate, weights: MoEWeights, config: ModelConfig) -> np.ndarray:
    """[T, K, D] fp32 holding bf16 values: each (row, slot) pair's weighted routed-expert output (a2a3).

    Grouped by expert; each used expert is quantised to int8 once (:func:`expert_int8`).
    """
    t, k = gate.experts.shape
    y = np.zeros((t * k, gate.x_q.shape[1]), dtype=np.float32)
    pair_w = gate.weights.reshape(-1)
    limit = float(config.moe.swiglu_limit)
    for e, pairs in ExpertGroups.build(gate.experts, weights.w1.shape[0]):
        rows = pairs // k                                                                   # (n_e,)
        xq, xs = gate.x_q[rows], gate.x_scale[rows]                                         # (n_e, D), (n_e,)
        h = _swiglu(_w8a8(xq, xs, *expert_int8(weights.w1, e)), _w8a8(xq, xs, *expert_int8(weights.w3, e)), limit)
        y[pairs] = bf16_round(_down(h, pair_w[pairs], *expert_int8(weights.w2, e)))        # (n_e, D)
    return y.reshape(t, k, -1)


def quantized_shared_expert(gate: QuantizedGate, weights: MoEWeights, config: ModelConfig) -> np.ndarray:
    """The a2a3 shared expert (with the SwiGLU clamp, as upstream's kernel): [T, D] fp32 holding bf16 values."""
    w1, w2, w3 = weights.shared_w1, weights.shared_w2, weights.shared_w3
    if _no_shared(weights) or w1 is None or w2 is None or w3 is None:
        return np.zeros(gate.x_q.shape, dtype=np.float32)
    limit = float(config.moe.swiglu_limit)
    h = _swiglu(_w8a8(gate.x_q, gate.x_scale, *linear_int8(w1)), _w8a8(gate.x_q, gate.x_scale, *linear_int8(w3)),
                limit)
    return bf16_round(_down(h, None, *linear_int8(w2)))


def _no_shared(weights: MoEWeights) -> bool:
    if weights.shared_w1 is None or weights.shared_w3 is None or weights.shared_w2 is None:
        if not (weights.shared_w1 is None and weights.shared_w3 is None and weights.shared_w2 is None):
            raise ValueError("shared_w1, shared_w2 and shared_w3 must be all set or all None")
        return True
    return False


def moe(x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
        token_ids: np.ndarray | None = None, live: np.ndarray | None = None, precision: Precision = "fp32"
        ) -> np.ndarray:
    """The MoE FFN over T rows: x [T, D] -> [T, D] fp32 (bf16 values in a2a3 and deepseek).

    x: hc_pre's ``x_mixed`` rows when ``norm`` (the layer's ``ffn_norm`` weight [D]) is given, the stage then
    applying the RMSNorm itself (deferred into the gate in a2a3, as upstream's); without ``norm``, rows already
    normalised. token_ids: [T] int, used by hash layers. live: [T] bool, rows to compute (padding rows are
    False and return exact zeros); None means every row.
    """
    check_precision(precision)
    x = narrow(np.asarray(x, dtype=np.float32), precision)
    out = np.zeros_like(x)
    rows = np.arange(x.shape[0]) if live is None else np.flatnonzero(live)
    if rows.size == 0:
        return out
    xl = x[rows]
    ids = None if token_ids is None else np.asarray(token_ids)[rows]
    if precision == "a2a3":
        gate = quantized_gate(xl, weights, config, norm=norm, token_ids=ids)
        y = quantized_experts(gate, weights, config)                                        # (T, K, D)
        acc = quantized_shared_expert(gate, weights, config)
        for k in range(y.shape[1]):  # slot order, as the kernels' combine adds them
            acc = acc + y[:, k]
        out[rows] = bf16_round(acc)
        return out
    if norm is not None:
        xl = narrow(rms_norm(xl, np.asarray(norm, dtype=np.float32), config.rms_norm_eps), precision)
    expert_w, expert_ids = route(xl, weights, config, ids)
    y = routed_experts(xl, expert_w, expert_ids, weights, config, precision=precision)
    y += shared_expert(xl, weights, config, precision=precision)
    out[rows] = narrow(y, precision)
    return out
