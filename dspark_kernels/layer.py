"""One full DeepSeek-V4 layer over a packed batch, for the whole TP group or one rank's view.

    x_hc --hc_pre(attn)--> x_mixed --attn_norm--> x_n --attention--> attn_out --hc_post--> attn_stage
    attn_stage --hc_pre(ffn)--> x_mixed --ffn_norm--> x_f --MoE--> ffn_out --hc_post--> x_next

Shapes: x_hc, attn_stage, x_next [P, hc, D] fp32; x_n, x_f, attn_out, ffn_out [P, D] (bf16 values in a2a3 mode).
Padding rows (request -1) are zero in ``x_hc`` and stay zero: hc_pre/norms map zero to zero, attention returns
zero rows and writes nothing for them, and the MoE skips them.

Rank view (upstream's TP split, docs/glossary.md): every rank computes hc_pre, the norms and all KV-side work over the P
group rows (the caches are replicated), but only its own L query rows through attention and the MoE; the two
``all_gather`` calls (attention output, FFN output) rebuild the [P, D] rows rank-major, so every rank ends the
layer with the same replicated ``x_next``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dspark_abi.batch import PackedBatch
from dspark_kernels.model_weights import LayerWeights
from dspark_kernels.reference.attention import attention
from dspark_kernels.reference.caches import LayerCaches
from dspark_kernels.reference.hyper_connections import hc_post, hc_pre
from dspark_kernels.reference.moe import moe
from dspark_kernels.reference.numerics import Precision, narrow, rms_norm

#: ``all_gather(local [L, ...]) -> [TP * L, ...]``: rank-major concatenation of every rank's rows.
AllGather = Callable[[np.ndarray], np.ndarray]
#: The attention stage of one layer, with the contract of the reference ``attention(...)`` (a backend choice).
AttentionFn = Callable[..., np.ndarray]


def run_layer(batch: PackedBatch, layer: int, x_hc: np.ndarray, weights: LayerWeights, caches: LayerCaches, *,
              token_ids: np.ndarray | None = None, precision: Precision = "fp32", rank: int | None = None,
              all_gather: AllGather | None = None, attention_fn: AttentionFn = attention) -> np.ndarray:
    """Run layer ``layer``: x_hc [P, hc, D] fp32 -> x_next [P, hc, D] fp32; ``caches`` are written in place.

    token_ids: [P] int (MoE hash routing; required on hash layers). rank: None for the whole group, else the
    rank whose L query rows this process owns; then ``all_gather`` must combine the ranks' rows (identity when
    TP = 1). attention_fn: the attention backend (default the numpy reference). Inputs are not validated here
    (the forward does it once for all layers).
    """
    cfg = batch.config
    if rank is None:
        rows, gather = slice(0, batch.padded_rows), _identity
    else:
        view = batch.rank(rank)
        rows, gather = slice(view.row_start, view.row_stop), all_gather or _identity
    live = batch.row_request[rows] >= 0                                           # (L,) or (P,)

    attn_pre = hc_pre(x_hc, weights.hc_attn, cfg, precision=precision)
    x_n = narrow(rms_norm(attn_pre.x_mixed, weights.attn_norm, cfg.rms_norm_eps), precision)  # (P, D)
    attn_out = gather(attention_fn(batch, layer, x_n, weights.attn, caches, precision=precision, rank=rank))
    attn_stage = hc_post(attn_out, x_hc, attn_pre.post, attn_pre.comb)           # (P, hc, D)

    ffn_pre = hc_pre(attn_stage, weights.hc_ffn, cfg, precision=precision)
    x_f = narrow(rms_norm(ffn_pre.x_mixed[rows], weights.ffn_norm, cfg.rms_norm_eps), precision)  # (L, D)
    ids = None if token_ids is None else token_ids[rows]
    ffn_out = gather(moe(x_f, weights.moe, cfg, token_ids=ids, live=live, precision=precision))
    return hc_post(ffn_out, attn_stage, ffn_pre.post, ffn_pre.comb)


def _identity(a: np.ndarray) -> np.ndarray:
    return a
