"""One full DeepSeek-V4 layer over a packed batch, for the whole TP group or one rank's view (a plan).

    x_hc --hc_pre(attn)--> x_mixed --attn_norm--> x_n --attention--> attn_out --hc_post--> attn_stage
    attn_stage --hc_pre(ffn)--> x_mixed --MoE (ffn_norm, gate, experts)--> ffn_out --hc_post--> x_next

Every stage is the backend's (:class:`~dspark_kernels.model.backends.Backend`). attn_norm runs inside its hc_pre
stage (``hc_pre(..., norm=...)``), ffn_norm inside the MoE stage (``moe(x_mixed, ..., norm=...)``: the a2a3
kernels defer it into the gate, as upstream's do).
Shapes: x_hc, attn_stage, x_next [P, hc, D] fp32; x_n, x_f, attn_out, ffn_out [P, D] (bf16 values in a2a3 mode).
Padding rows (request -1) are zero in ``x_hc`` and stay zero: hc_pre/norms map zero to zero, attention returns
zero rows and writes nothing for them, and the MoE skips them.

Rank view (upstream's TP split, docs/glossary.md): every rank computes hc_pre, the norms and all KV-side work over the P
group rows (the caches are replicated), but only its own L query rows (``plan.query_rows``) through attention and
the MoE; the two ``all_gather`` calls (attention output, FFN output) rebuild the [P, D] rows rank-major, so every
rank ends the layer with the same replicated ``x_next``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from dspark_kernels.model.backends import Backend, default_backend
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import PreparedWeightsCache, prepared_for
from dspark_kernels.model.weights import LayerWeights

#: ``all_gather(local [L, ...]) -> [TP * L, ...]``: rank-major concatenation of every rank's rows.
AllGather = Callable[[np.ndarray], np.ndarray]


def run_layer(plan: BatchPlan, layer: int, x_hc: np.ndarray, weights: LayerWeights, caches: LayerCaches, *,
              token_ids: np.ndarray | None = None, all_gather: AllGather | None = None,
              backend: Backend | None = None, prepared: PreparedWeightsCache | None = None,
              attention: Backend | None = None) -> np.ndarray:
    """Run layer ``layer``: x_hc [P, hc, D] fp32 -> x_next [P, hc, D] fp32; ``caches`` are written in place.

    plan: the batch's plan (its rank: None for the whole group, else the rank whose L query rows this process
    owns; then ``all_gather`` must combine the ranks' rows, identity when TP = 1); its precision is the layer's.
    token_ids: [P] int (MoE hash routing; required on hash layers). backend: the :class:`Backend` whose stages run
    the layer (default the registry's reference; ``attention=`` is its deprecated name). prepared: the caller's
    cache of prepared attention weights (default: prepare now).
    Inputs are not validated here (the forward does it once for all layers).
    """
    cfg, precision = plan.config, plan.precision
    rows = plan.query_rows
    gather = _identity if plan.rank is None else all_gather or _identity
    live = plan.query_request >= 0                                                # (L,) or (P,)
    attn_weights = prepared_for(weights.attn, precision, prepared)
    if attention is not None:
        warnings.warn("run_layer(attention=...) is deprecated: pass backend=", DeprecationWarning, stacklevel=2)
        backend = attention if backend is None else backend
    stages = default_backend(backend)

    attn_pre = stages.hc_pre(x_hc, weights.hc_attn, cfg, precision=precision, norm=weights.attn_norm)
    x_n = attn_pre.x_normed                                  # (P, D): narrow(rms_norm(x_mixed, attn_norm)), fused
    if x_n is None:
        raise ValueError("the backend's hc_pre returned no x_normed although it was given the norm")
    attn_out = gather(stages.attention(plan, layer, x_n, attn_weights, caches))
    attn_stage = stages.hc_post(attn_out, x_hc, attn_pre.post, attn_pre.comb, precision=precision)  # (P, hc, D)

    ffn_pre = stages.hc_pre(attn_stage, weights.hc_ffn, cfg, precision=precision)
    ids = None if token_ids is None else token_ids[rows]
    ffn_out = gather(stages.moe(ffn_pre.x_mixed[rows], weights.moe, cfg, norm=weights.ffn_norm, token_ids=ids,
                                live=live, precision=precision))       # (L, D); the MoE applies ffn_norm
    return stages.hc_post(ffn_out, attn_stage, ffn_pre.post, ffn_pre.comb, precision=precision)


def _identity(a: np.ndarray) -> np.ndarray:
    return a
