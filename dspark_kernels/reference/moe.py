"""MoE FFN: gate (sqrtsoftplus scoring, bias-shifted top-k or hash routing), routed SwiGLU experts, shared expert.

Math (DeepSeek-V4 ``Gate`` / ``Expert`` / ``MoE``; upstream's post-attention stage), for a row ``x [D]``:

* ``s = score(x @ gate_w.T)`` with ``score`` = sqrt(softplus(.)) (``sqrtsoftplus``), softmax or sigmoid;
* selection: hash layers (``layer < num_hash_layers``) take ``tid2eid[token_id]``; other layers take the
  top-k of ``s + gate_bias`` (the bias shifts the choice only, never the weights). Ties go to the lower
  expert id (stable sort), so packed and alone runs choose alike;
* weights ``w = s[selected]``, divided by their sum when ``norm_topk_prob`` and scoring is not softmax
  (DeepSeek-V4 never renormalises softmax scores), then times ``routed_scaling_factor``;
* routed expert e: ``h = silu(min(x@w1.T, L)) * clip(x@w3.T, -L, L)`` with ``L = swiglu_limit`` (0 = no clamp),
  ``y_e = (w_e * h) @ w2.T``; the shared expert is the same SwiGLU without the clamp and without a weight;
* ``out = sum_e y_e + shared``.

Experts run vectorized: the (row, slot) pairs are sorted by expert id and each expert runs one matmul over
all its rows (one Python iteration per expert, never per token), then the results are added back per row.

Precision ``"a2a3"``: the input is bf16 (the ffn norm output), the gate is fp32, expert matmuls accumulate in
fp32, ``w_e * h`` is rounded to bf16 before ``w2`` (where the hardware narrows it), and the output is bf16.
Weights are used exactly as given: checkpoint and random weights hold bf16 values already. The int8 expert
weights (per-channel scales) of the a2a3 kernels are not emulated.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.config import ModelConfig
from dspark_kernels.model.block_weights import MoEWeights
from dspark_kernels.model.numerics import Precision, check_precision, narrow


def _score(logits: np.ndarray, func: str) -> np.ndarray:
    if func == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if func == "sigmoid":
        return np.exp(-np.logaddexp(np.float32(0), -logits))
    return np.sqrt(np.logaddexp(np.float32(0), logits))  # sqrtsoftplus


def route(x: np.ndarray, weights: MoEWeights, config: ModelConfig, token_ids: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Gate T rows: returns (expert weights [T, K] fp32, expert ids [T, K] int64).

    x: [T, D] fp32 rows (live rows only). token_ids: [T] int, required by hash layers (``tid2eid`` set).
    """
    moe = config.moe
    logits = np.asarray(x, dtype=np.float32) @ weights.gate_w.T  # (T, E)
    scores = _score(logits, moe.scoring_func).astype(np.float32)
    k = moe.num_experts_per_tok
    if weights.tid2eid is not None:
        if token_ids is None:
            raise ValueError("token_ids are required by a hash-routed layer (tid2eid), got None")
        experts = weights.tid2eid[np.asarray(token_ids, dtype=np.int64)].astype(np.int64)  # (T, K)
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
    return gate / (np.float32(1) + np.exp(-gate)) * up  # silu(gate) * up


def routed_experts(x: np.ndarray, expert_w: np.ndarray, expert_ids: np.ndarray, weights: MoEWeights,
                   config: ModelConfig, *, precision: Precision = "fp32") -> np.ndarray:
    """Sum of the selected experts' outputs per row, grouped by expert: [T, D] fp32.

    x: [T, D]; expert_w: [T, K] fp32 routing weights; expert_ids: [T, K] int in [0, E).
    """
    t, k = expert_ids.shape
    out = np.zeros((t, x.shape[1]), dtype=np.float32)
    flat = expert_ids.reshape(-1)
    order = np.argsort(flat, kind="stable")                               # pairs grouped by expert
    counts = np.bincount(flat, minlength=weights.w1.shape[0])
    bounds = np.concatenate([[0], np.cumsum(counts)])
    pair_w = expert_w.reshape(-1)
    limit = float(config.moe.swiglu_limit)
    for e in np.flatnonzero(counts):
        pairs = order[bounds[e]:bounds[e + 1]]                            # (n_e,) pair ids
        rows = pairs // k                                                 # (n_e,) token rows
        xe = x[rows]                                                      # (n_e, D)
        h = _swiglu(xe @ weights.w1[e].T, xe @ weights.w3[e].T, limit)
        h = narrow(h * pair_w[pairs][:, None], precision)                 # (n_e, I)
        ye = h @ weights.w2[e].T                       # (n_e, D)
        np.add.at(out, rows, ye)  # a row may pick one expert twice only through a hash table; add.at sums both
    return out


def shared_expert(x: np.ndarray, weights: MoEWeights, *, precision: Precision = "fp32") -> np.ndarray:
    """The always-on expert (SwiGLU without the clamp): [T, D] -> [T, D] fp32; zeros when there is none."""
    if weights.shared_w1 is None or weights.shared_w3 is None or weights.shared_w2 is None:
        if not (weights.shared_w1 is None and weights.shared_w3 is None and weights.shared_w2 is None):
            raise ValueError("shared_w1, shared_w2 and shared_w3 must be all set or all None")
        return np.zeros_like(x, dtype=np.float32)
    h = _swiglu(x @ weights.shared_w1.T, x @ weights.shared_w3.T, 0.0)
    return narrow(h, precision) @ weights.shared_w2.T


def moe(x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, token_ids: np.ndarray | None = None,
        live: np.ndarray | None = None, precision: Precision = "fp32") -> np.ndarray:
    """The MoE FFN over T rows: x [T, D] (ffn-normed) -> [T, D] fp32 (bf16 values in a2a3 mode).

    token_ids: [T] int, used by hash layers. live: [T] bool, rows to compute (padding rows are False and
    return exact zeros); None means every row.
    """
    check_precision(precision)
    x = narrow(np.asarray(x, dtype=np.float32), precision)
    out = np.zeros_like(x)
    rows = np.arange(x.shape[0]) if live is None else np.flatnonzero(live)
    if rows.size == 0:
        return out
    xl = x[rows]
    ids = None if token_ids is None else np.asarray(token_ids)[rows]
    expert_w, expert_ids = route(xl, weights, config, ids)
    y = routed_experts(xl, expert_w, expert_ids, weights, config, precision=precision)
    y += shared_expert(xl, weights, precision=precision)
    out[rows] = narrow(y, precision)
    return out
