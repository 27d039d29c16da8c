"""`attention`: the whole attention module of one layer over a packed batch (SWA, CSA and HCA layers).

Order (upstream's CSA / HCA layer assembly; DeepSeek-V4 ``Attention.forward``):

1. KV side, over all P group rows (every TP rank recomputes it, as upstream's DSA-CP does):
   shared kv -> ``ori`` cache write; compressor -> ``csa_cmp`` / ``hca_cmp`` writes (state ring first);
   CSA: indexer compressor -> ``idx`` writes. All writes happen before any read below.
2. Query side, over the plan's query rows (all P, or one rank's L), in blocks of ``QUERY_BLOCK`` rows:
   q path; CSA: indexer queries and top-k over the request's own visible entries; window rows through the
   request's ori table; HCA: every visible entry ``c < (p + 1) // 128``; sparse attention; grouped o-proj.

Padding rows (request -1) give zero output rows and write nothing (their slots are -1).

:func:`attention` is the checked entry for one layer of a batch; :func:`attend` is the reference
:class:`~dspark_kernels.model.backends.AttentionBackend` a forward calls with the batch's plan.
"""

from __future__ import annotations

import numpy as np

from dspark_abi import PackedBatch
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.checks import check_attention_inputs
from dspark_kernels.model.geometry import INDEX_RATIO
from dspark_kernels.model.numerics import check_precision, narrow
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import PreparedWeights, PreparedWeightsCache, prepared_for
from dspark_kernels.reference.compressor import compress, compress_index_keys
from dspark_kernels.reference.entry_rows import chosen_entry_rows
from dspark_kernels.reference.indexer import IndexCandidates, index_query, lightning_topk
from dspark_kernels.reference.lowering import local_request_ids
from dspark_kernels.reference.o_proj import output_projection
from dspark_kernels.reference.paged import scatter_rows
from dspark_kernels.reference.projections import low_rank_query, query_heads, shared_kv
from dspark_kernels.reference.sparse_attention import sparse_attention

#: Query rows per block of the query side (bounds the [rows, H*D] q and o intermediates).
QUERY_BLOCK = 256


def attention(batch: PackedBatch, layer: int, x: np.ndarray, weights: AttentionWeights, caches: LayerCaches,
              *, precision: str = "fp32", rank: int | None = None,
              prepared: PreparedWeightsCache | None = None) -> np.ndarray:
    """Attention output of layer ``layer`` for a packed batch; **mutates** ``caches`` in place.

    batch: the TP group's validated PackedBatch (P rows). x: [P, hidden_size] float32, the post-attn_norm
    hidden rows of all group rows (padding rows zero). weights / caches: of this config and layer; caches
    allocated for ``precision``. precision: ``"fp32"`` (default, exact DeepSeek math), ``"a2a3"`` (the
    a2a3 kernels' bf16/int8 numerics) or ``"deepseek"`` (the official inference's bf16 activations and FP8/FP4
    fake quantisation, :mod:`dspark_kernels.model.numerics`). rank: None for the whole group (output
    [P, hidden_size]) or a TP rank r (output [L, hidden_size] for rows [r*L, (r+1)*L), equal to that slice
    of the whole-group result; the KV side and its cache writes still cover all P rows). prepared: a cache of
    prepared weights the caller keeps across calls (default: prepare them now).
    Every input is checked before any cache is touched (TypeError / ABIError).
    """
    prec = check_precision(precision)
    check_attention_inputs(batch, layer, x, weights, caches, rank, prec)
    plan = BatchPlan.build(batch, rank=rank, precision=prec)
    w = prepared_for(weights, prec, prepared)
    return attend(plan, layer, x, w, caches)


def attend(plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
    """The reference :class:`~dspark_kernels.model.backends.AttentionBackend`: layer ``layer`` over ``plan``.

    x [P, hidden] float32; weights prepared in ``plan.precision``; caches written in place. Returns
    [rows, hidden] for the plan's query rows. Inputs are not checked here (see :func:`attention`).
    """
    batch, config = plan.batch, plan.config
    kind = config.layer_kind(layer)
    prec = plan.precision
    xn = narrow(x, prec)  # the a2a3 kernels and the official inference receive bf16 hidden rows
    eps = config.rms_norm_eps
    w = weights

    # ---- KV side: all P group rows, writes before reads
    rope = plan.rope[kind]
    scatter_rows(caches.ori, batch.slots["ori"], shared_kv(xn, w, rope.cos, rope.sin, eps, prec))
    if kind != "swa" and w.compressor is not None:
        ratio = config.compress_ratios[layer]
        start = plan.window_rope[ratio]
        state = f"{kind}_state"
        b, entries = compress(xn, plan.positions, plan.request, batch.slots[state], batch.tables[state],
                              caches.pool(state), w.compressor, start.cos, start.sin,
                              page_size=config.layout.pools[state].page_size, eps=eps, precision=prec,
                              windows=plan.state_windows[state])
        scatter_rows(caches.pool(f"{kind}_cmp"), batch.slots[f"{kind}_cmp"][b], entries)
        if kind == "csa":
            compress_index_keys(xn, plan.positions, plan.request, batch.slots["csa_inner_state"],
                                batch.tables["csa_inner_state"], caches.pool("csa_inner_state"), batch.slots["idx"],
                                caches.pool("idx"), caches.pool("idx_scale"), w, start.cos, start.sin, eps=eps,
                                precision=prec, windows=plan.state_windows["csa_inner_state"])

    # ---- query side: the plan's query rows
    lo, hi = plan.row_start, plan.row_stop
    request = local_request_ids(plan)
    out = np.zeros((hi - lo, config.hidden_size), dtype=np.float32)
    for start_row in range(lo, hi, QUERY_BLOCK):
        stop_row = min(start_row + QUERY_BLOCK, hi)
        if not plan.runs_in(start_row, stop_row):
            continue  # padding rows only
        out[start_row - lo:stop_row - lo] = _query_block(plan, layer, xn, start_row, stop_row,
                                                         request[start_row - lo:stop_row - lo], w, caches)
    return out


def _query_block(plan: BatchPlan, layer: int, xn: np.ndarray, lo: int, hi: int, request: np.ndarray,
                 w: PreparedWeights, caches: LayerCaches) -> np.ndarray:
    """Output rows [T, hidden] of the T consecutive query rows ``[lo, hi)`` (zero on padding rows)."""
    batch, config = plan.batch, plan.config
    kind = config.layer_kind(layer)
    prec = plan.precision
    eps = config.rms_norm_eps
    x, positions, runs = xn[lo:hi], plan.positions[lo:hi], plan.runs_in(lo, hi)
    cos, sin = plan.rope[kind].rows(lo, hi)                                          # (T, rd/2)
    lrq = low_rank_query(x, w, eps, prec)
    q = query_heads(lrq, w, cos, sin, config.num_attention_heads, eps, prec)         # (T, H, D)
    window = plan.window_in(lo, hi)                                                   # (T, W)
    cmp_rows, cmp_pool = None, None
    if kind == "csa":
        iq = index_query(lrq, x, w, cos, sin, config.index_n_heads, config.index_weight_scale, prec)
        candidates = IndexCandidates(plan.visible[INDEX_RATIO][lo:hi], plan.entry_rows_in("idx", lo, hi))
        top = lightning_topk(iq, positions, request, batch.tables["idx"], caches.pool("idx"), caches.pool("idx_scale"),
                             topk=config.index_topk, precision=prec, runs=runs, candidates=candidates)
        cmp_rows, cmp_pool = chosen_entry_rows(top, request, batch.tables["csa_cmp"]), caches.pool("csa_cmp")
    elif kind == "hca":
        cmp_rows, cmp_pool = plan.entry_rows_in("hca_cmp", lo, hi), caches.pool("hca_cmp")
    o = sparse_attention(q, request, window, caches.ori, cmp_rows, cmp_pool, w.attn_sink, cos, sin,
                         scale=config.softmax_scale, precision=prec, runs=runs)
    out = output_projection(o.reshape(o.shape[0], -1), w, prec)
    out[request < 0] = 0
    return out
