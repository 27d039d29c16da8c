"""`attention`: the whole attention module of one layer over a packed batch (SWA, CSA and HCA layers).

Order (upstream's CSA / HCA layer assembly; DeepSeek-V4 ``Attention.forward``):

1. KV side, over all P group rows (every TP rank recomputes it, as upstream's DSA-CP does):
   shared kv -> ``ori`` cache write; compressor -> ``csa_cmp`` / ``hca_cmp`` writes (state ring first);
   CSA: indexer compressor -> ``idx`` writes. All writes happen before any read below.
2. Query side, over the query rows (all P, or one rank's L), in blocks of ``QUERY_BLOCK`` rows:
   q path; CSA: indexer queries and top-k over the request's own visible entries; window rows through the
   request's ori table; HCA: every visible entry ``c < (p + 1) // 128``; sparse attention; grouped o-proj.

Padding rows (request -1) give zero output rows and write nothing (their slots are -1).
"""

from __future__ import annotations

import numpy as np

from dspark_abi.batch import PackedBatch
from dspark_abi.layout import KV_PAGE_SIZE, RATIO4_STATE_PAGE_SIZE, RATIO128_STATE_PAGE_SIZE
from dspark_kernels.reference.caches import LayerCaches
from dspark_kernels.reference.checks import check_attention_inputs
from dspark_kernels.reference.compressor import compress, window_start_positions
from dspark_kernels.reference.indexer import compress_index_keys, index_query, lightning_topk
from dspark_kernels.reference.numerics import Precision, check_precision, narrow
from dspark_kernels.reference.o_proj import output_projection
from dspark_kernels.reference.paged import physical_rows, scatter_rows
from dspark_kernels.reference.prepared import PreparedWeights
from dspark_kernels.reference.projections import low_rank_query, query_heads, shared_kv
from dspark_kernels.reference.rope import rope_at
from dspark_kernels.reference.sparse_attention import sparse_attention
from dspark_kernels.reference.weights import AttentionWeights
from dspark_kernels.reference.window import window_rows

#: Query rows per block of the query side (bounds the [rows, H*D] q and o intermediates).
QUERY_BLOCK = 256


def attention(batch: PackedBatch, layer: int, x: np.ndarray, weights: AttentionWeights, caches: LayerCaches,
              *, precision: str = "fp32", rank: int | None = None) -> np.ndarray:
    """Attention output of layer ``layer`` for a packed batch; **mutates** ``caches`` in place.

    batch: the TP group's validated PackedBatch (P rows). x: [P, hidden_size] float32, the post-attn_norm
    hidden rows of all group rows (padding rows zero). weights / caches: of this config and layer; caches
    allocated for ``precision``. precision: ``"fp32"`` (default, exact DeepSeek math) or ``"a2a3"`` (the
    a2a3 kernels' bf16/int8 numerics). rank: None for the whole group (output [P, hidden_size]) or a TP
    rank r (output [L, hidden_size] for rows [r*L, (r+1)*L), equal to that slice of the whole-group
    result; the KV side and its cache writes still cover all P rows).
    Every input is checked before any cache is touched (TypeError / ABIError).
    """
    prec = check_precision(precision)
    check_attention_inputs(batch, layer, x, weights, caches, rank, prec)
    config = batch.config
    kind = config.layer_kind(layer)
    w = weights.prepared(prec)
    positions = batch.positions.astype(np.int64)
    request = batch.row_request
    xn = narrow(x, prec)  # the a2a3 kernels receive bf16 hidden rows
    eps = config.rms_norm_eps

    # ---- KV side: all P group rows, writes before reads
    cos, sin = rope_at(config, kind, positions, prec)                                 # (P, rd/2)
    scatter_rows(caches.ori, batch.slots["ori"], shared_kv(xn, w, cos, sin, eps, prec))
    if kind != "swa" and w.compressor is not None:
        ratio = config.compress_ratios[layer]
        cmp_cos, cmp_sin = rope_at(config, kind, window_start_positions(positions, ratio), prec)
        main = "csa" if kind == "csa" else "hca"
        state_page = RATIO4_STATE_PAGE_SIZE if kind == "csa" else RATIO128_STATE_PAGE_SIZE
        b, entries = compress(xn, positions, request, batch.slots[f"{main}_state"], batch.tables[f"{main}_state"],
                              getattr(caches, f"{main}_state"), w.compressor, cmp_cos, cmp_sin,
                              page_size=state_page, eps=eps, precision=prec)
        scatter_rows(getattr(caches, f"{main}_cmp"), batch.slots[f"{main}_cmp"][b], entries)
        if kind == "csa":
            compress_index_keys(xn, positions, request, batch.slots["csa_inner_state"],
                                batch.tables["csa_inner_state"], caches.csa_inner_state, batch.slots["idx"],
                                caches.idx, caches.idx_scale, w, cmp_cos, cmp_sin, eps=eps, precision=prec)

    # ---- query side: this call's query rows
    lo, hi = (0, batch.padded_rows) if rank is None else (rank * batch.local_rows, (rank + 1) * batch.local_rows)
    out = np.zeros((hi - lo, config.hidden_size), dtype=np.float32)
    for start in range(lo, hi, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, hi)
        if (request[start:stop] < 0).all():
            continue
        out[start - lo:stop - lo] = _query_block(batch, layer, xn[start:stop], positions[start:stop],
                                                 request[start:stop], w, caches, prec)
    return out


def _query_block(batch: PackedBatch, layer: int, x: np.ndarray, positions: np.ndarray, request: np.ndarray,
                 w: PreparedWeights, caches: LayerCaches, prec: Precision) -> np.ndarray:
    """Output rows [T, hidden] of T consecutive query rows (zero on padding rows)."""
    config = batch.config
    kind = config.layer_kind(layer)
    eps = config.rms_norm_eps
    cos, sin = rope_at(config, kind, positions, prec)                                # (T, rd/2)
    lrq = low_rank_query(x, w, eps, prec)
    q = query_heads(lrq, w, cos, sin, config.num_attention_heads, eps, prec)         # (T, H, D)
    window = window_rows(positions, request, batch.tables["ori"], config.sliding_window)  # (T, W)
    cmp_rows, cmp_pool = None, None
    if kind == "csa":
        iq = index_query(lrq, x, w, cos, sin, config.index_n_heads, config.index_weight_scale, prec)
        top = lightning_topk(iq, positions, request, batch.tables["idx"], caches.idx, caches.idx_scale,
                             topk=config.index_topk, precision=prec)
        cmp_rows = physical_rows(batch.tables["csa_cmp"], request, top, KV_PAGE_SIZE)
        cmp_pool = caches.csa_cmp
    elif kind == "hca":
        visible = _visible_entries(positions, request, config.compress_ratios[layer])
        cmp_rows = physical_rows(batch.tables["hca_cmp"], request, visible, KV_PAGE_SIZE)
        cmp_pool = caches.hca_cmp
    o = sparse_attention(q, request, window, caches.ori, cmp_rows, cmp_pool, w.attn_sink, cos, sin,
                         scale=config.softmax_scale, precision=prec)
    out = output_projection(o.reshape(o.shape[0], -1), w, prec)
    out[request < 0] = 0
    return out


def _visible_entries(positions: np.ndarray, request: np.ndarray, ratio: int) -> np.ndarray:
    """[T, Vmax] int64 logical entries ``c < (p + 1) // ratio`` of each row, -1 beyond and on padding rows."""
    visible = np.where(request >= 0, (positions + 1) // ratio, 0)                    # (T,)
    c = np.arange(int(visible.max(initial=0)), dtype=np.int64)[None, :]              # (1, Vmax)
    return np.where(c < visible[:, None], c, -1)
