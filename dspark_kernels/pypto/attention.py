"""`attention_pypto`: one attention layer over a packed batch with the pypto kernels (the ``pypto`` backend).

Same contract as :func:`dspark_kernels.reference.attention.attention` with ``precision="a2a3"`` (the
numerics the kernels implement): same arguments, same output, same in-place cache updates. Stages run
through pypto where a kernel exists, the rest through the reference:

=====================================================  =========================
stage                                                  backend
=====================================================  =========================
local request ids of the query rows (stage 1)          pypto ``lowering``
shared kv (all P rows) and q path (query rows) (2)     pypto ``projections``
``ori`` write and compressed-entry writes (3)          pypto ``paged.scatter``
window rows through the request's ori table (3)        pypto ``paged.window``
compressors ratio 4 / 128, state rings (4)             reference
indexer compressor, lightning indexer, top-k (5)       reference
sparse attention core with sink, inverse RoPE (6)      reference
grouped o_proj with int8 activations (7)               pypto ``o_proj``
=====================================================  =========================

By default the whole layer runs in a child process (:func:`~dspark_kernels.pypto.isolate.run_isolated`):
pypto leaks ~23 MB per kernel call and can end the process on some errors. The child's caches are
copied back into ``caches`` in place.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.batch import PackedBatch
from dspark_abi.layout import KV_PAGE_SIZE, RATIO4_STATE_PAGE_SIZE, RATIO128_STATE_PAGE_SIZE
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference.caches import LayerCaches
from dspark_kernels.reference.checks import check_attention_inputs
from dspark_kernels.reference.weights import AttentionWeights

#: The reference precision whose numerics the kernels implement.
PRECISION = "a2a3"


def attention_pypto(batch: PackedBatch, layer: int, x: np.ndarray, weights: AttentionWeights, caches: LayerCaches,
                    *, rank: int | None = None, isolate: bool = True) -> np.ndarray:
    """Attention output of layer ``layer``; **mutates** ``caches`` in place (see the reference's docstring).

    x: [P, hidden_size] float32 post-attn_norm rows (padding rows zero). caches: allocated with
    ``precision="a2a3"``. rank: None for all P rows (output [P, hidden]) or a TP rank (output [L, hidden]).
    isolate: run in a child process (default); False runs pypto in this process.
    """
    check_attention_inputs(batch, layer, x, weights, caches, rank, PRECISION)
    if not isolate:
        return _attention_in_process(batch, layer, x, weights, caches, rank)
    out, updated = run_isolated(_attention_and_caches, batch, layer, x, weights, caches, rank)
    for name, array in caches.arrays().items():
        array[...] = updated[name]
    return out


def _attention_and_caches(batch: PackedBatch, layer: int, x: np.ndarray, weights: AttentionWeights,
                          caches: LayerCaches, rank: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    out = _attention_in_process(batch, layer, x, weights, caches, rank)
    return out, caches.arrays()


def _scatter(pool: np.ndarray, slots: np.ndarray, values: np.ndarray, bf16: bool) -> None:
    """pypto scatter into a reference pool in place (bf16 pools are held as float32 bf16 values)."""
    import ml_dtypes

    from dspark_kernels.pypto.paged import run_scatter

    if not (np.asarray(slots) >= 0).any():
        return
    dtype = ml_dtypes.bfloat16 if bf16 else pool.dtype
    pool[...] = run_scatter(pool.astype(dtype), np.asarray(values).astype(dtype), slots).values[0].astype(pool.dtype)


def _attention_in_process(batch: PackedBatch, layer: int, x: np.ndarray, weights: AttentionWeights,
                          caches: LayerCaches, rank: int | None) -> np.ndarray:
    from dspark_kernels.pypto.lowering import run_lowering
    from dspark_kernels.pypto.o_proj import run_o_proj
    from dspark_kernels.pypto.paged import run_window
    from dspark_kernels.pypto.projections import run_query, run_shared_kv
    from dspark_kernels.reference.compressor import compress, window_start_positions
    from dspark_kernels.reference.indexer import compress_index_keys, index_query, lightning_topk
    from dspark_kernels.reference.numerics import narrow
    from dspark_kernels.reference.paged import physical_rows
    from dspark_kernels.reference.projections import LowRankQuery
    from dspark_kernels.reference.rope import rope_at
    from dspark_kernels.reference.sparse_attention import sparse_attention

    config = batch.config
    kind = config.layer_kind(layer)
    w = weights.prepared(PRECISION)
    positions = batch.positions.astype(np.int64)
    request_full = batch.row_request
    xn = narrow(x, PRECISION)
    eps = config.rms_norm_eps

    # ---- KV side over all P rows; every write happens before any read
    cos, sin = rope_at(config, kind, positions, PRECISION)
    kv = run_shared_kv(xn, w.wkv, w.kv_norm, cos, sin, eps).values[-1][:, 0].astype(np.float32)
    _scatter(caches.ori, batch.slots["ori"], kv, bf16=True)
    if kind != "swa" and w.compressor is not None:
        ratio = config.compress_ratios[layer]
        cmp_cos, cmp_sin = rope_at(config, kind, window_start_positions(positions, ratio), PRECISION)
        main = "csa" if kind == "csa" else "hca"
        state_page = RATIO4_STATE_PAGE_SIZE if kind == "csa" else RATIO128_STATE_PAGE_SIZE
        b, entries = compress(xn, positions, request_full, batch.slots[f"{main}_state"], batch.tables[f"{main}_state"],
                              getattr(caches, f"{main}_state"), w.compressor, cmp_cos, cmp_sin,
                              page_size=state_page, eps=eps, precision=PRECISION)
        _scatter(getattr(caches, f"{main}_cmp"), batch.slots[f"{main}_cmp"][b], entries, bf16=True)
        if kind == "csa":
            compress_index_keys(xn, positions, request_full, batch.slots["csa_inner_state"],
                                batch.tables["csa_inner_state"], caches.csa_inner_state, batch.slots["idx"],
                                caches.idx, caches.idx_scale, w, cmp_cos, cmp_sin, eps=eps, precision=PRECISION)

    # ---- query side over this call's rows
    lo, hi = (0, batch.padded_rows) if rank is None else (rank * batch.local_rows, (rank + 1) * batch.local_rows)
    request = run_lowering(batch.query_start_loc, lo, hi - lo).values[-1].astype(np.int64)
    q_pos, q_x = positions[lo:hi], xn[lo:hi]
    q_cos, q_sin = cos[lo:hi], sin[lo:hi]
    q, qr_q, qr_scale = (v.astype(np.float32) for v in run_query(
        q_x, w.wq_a, w.q_norm, w.wq_b, w.wq_b_scale, q_cos, q_sin, config.num_attention_heads, eps).values[-3:])
    window = run_window(q_pos, request, batch.tables["ori"], config.sliding_window).values[-1].astype(np.int64)
    cmp_rows, cmp_pool = None, None
    if kind == "csa":
        lrq = LowRankQuery(qr_q * qr_scale, qr_q, qr_scale[:, 0])
        iq = index_query(lrq, q_x, w, q_cos, q_sin, config.index_n_heads, config.index_weight_scale, PRECISION)
        top = lightning_topk(iq, q_pos, request, batch.tables["idx"], caches.idx, caches.idx_scale,
                             topk=config.index_topk, precision=PRECISION)
        cmp_rows, cmp_pool = physical_rows(batch.tables["csa_cmp"], request, top, KV_PAGE_SIZE), caches.csa_cmp
    elif kind == "hca":
        visible = np.where(request >= 0, (q_pos + 1) // 128, 0)
        c = np.arange(int(visible.max(initial=0)), dtype=np.int64)[None, :]
        entries = np.where(c < visible[:, None], c, -1)
        cmp_rows, cmp_pool = physical_rows(batch.tables["hca_cmp"], request, entries, KV_PAGE_SIZE), caches.hca_cmp
    o = sparse_attention(q, request, window, caches.ori, cmp_rows, cmp_pool, w.attn_sink, q_cos, q_sin,
                         scale=config.softmax_scale, precision=PRECISION)
    out = run_o_proj(o.reshape(o.shape[0], -1), w.wo_a, w.wo_b, w.wo_b_scale, config.o_groups).values[-1]
    out = out.astype(np.float32)
    out[request < 0] = 0
    return out
