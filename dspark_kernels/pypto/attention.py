"""`attention_pypto`: one attention layer over a packed batch with the pypto kernels (the ``pypto`` backend).

Same contract as :func:`dspark_kernels.reference.attention.attention` with ``precision="a2a3"`` (the
numerics the kernels implement): same arguments, same output, same in-place cache updates. Every stage
runs through a pypto kernel; the host only prepares metadata (RoPE rows, the compressor boundary rows,
static row / column counts) and moves arrays between calls:

=====================================================  =========================
stage                                                  backend
=====================================================  =========================
local request ids of the query rows (stage 1)          pypto ``lowering``
shared kv (all P rows) and q path (query rows) (2)     pypto ``projections``
``ori``, state, compressed and idx writes (3)          pypto ``paged.scatter``
window rows through the request's ori table (3)        pypto ``paged.window``
compressors ratio 4 / 128, state rings (4)             pypto ``compressor`` (+ ``paged.scatter``)
indexer compressor: Hadamard, int8 idx cache (5)       pypto ``compressor`` (+ ``paged.scatter``)
lightning indexer scores and top-k (5)                 pypto ``indexer`` (candidates: ``paged.entry_rows``)
compressed rows through the request's table (6)        pypto ``paged.entry_rows``
sparse attention core with sink, inverse RoPE (6)      pypto ``sparse_attention``
grouped o_proj with int8 activations (7)               pypto ``o_proj``
=====================================================  =========================

By default the whole layer runs in a child process (:func:`~dspark_kernels.pypto.isolate.run_isolated`):
pypto leaks ~23 MB per kernel call and can end the process on some errors. The child's caches are
copied back into ``caches`` in place.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.batch import PackedBatch
from dspark_abi.layout import RATIO4_STATE_PAGE_SIZE, RATIO128_STATE_PAGE_SIZE
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference.caches import LayerCaches
from dspark_kernels.reference.checks import check_attention_inputs
from dspark_kernels.reference.weights import AttentionWeights

#: The reference precision whose numerics the kernels implement.
PRECISION = "a2a3"
#: Compression ratio of the indexer's entries (the CSA ratio-4 entries).
INDEX_RATIO = 4
#: pypto tiles need rows of at least 32 bytes ("lastDimBytes % BLOCK_SIZE == 0").
_MIN_ROW_BYTES = 32


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
    if pool.ndim == 1:  # one fp32 per row (idx_scale): pad rows to 32 bytes, pypto's minimum tile row
        padded = np.zeros((pool.shape[0], _MIN_ROW_BYTES // pool.itemsize), pool.dtype)
        padded[:, 0] = pool
        wide = np.zeros((len(values), padded.shape[1]), pool.dtype)
        wide[:, 0] = values
        pool[...] = run_scatter(padded, wide, slots).values[0][:, 0]
        return
    pool[...] = run_scatter(pool.astype(dtype), np.asarray(values).astype(dtype), slots).values[0].astype(pool.dtype)


def _attention_in_process(batch: PackedBatch, layer: int, x: np.ndarray, weights: AttentionWeights,
                          caches: LayerCaches, rank: int | None) -> np.ndarray:
    from dspark_kernels.pypto.compressor import compress_into
    from dspark_kernels.pypto.indexer import run_indexer
    from dspark_kernels.pypto.lowering import run_lowering
    from dspark_kernels.pypto.o_proj import run_o_proj
    from dspark_kernels.pypto.paged import run_entry_rows, run_window
    from dspark_kernels.pypto.projections import run_query, run_shared_kv
    from dspark_kernels.pypto.sparse_attention import run_sparse_attention
    from dspark_kernels.reference.compressor import window_start_positions
    from dspark_kernels.reference.numerics import narrow
    from dspark_kernels.reference.rope import rope_at

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
        b, (entries,) = compress_into(xn, positions, request_full, batch.slots[f"{main}_state"],
                                      batch.tables[f"{main}_state"], getattr(caches, f"{main}_state"), w.compressor,
                                      cmp_cos, cmp_sin, page_size=state_page, eps=eps)
        _scatter(getattr(caches, f"{main}_cmp"), batch.slots[f"{main}_cmp"][b], entries, bf16=True)
        if kind == "csa":
            b, (idx, idx_scale) = compress_into(xn, positions, request_full, batch.slots["csa_inner_state"],
                                                batch.tables["csa_inner_state"], caches.csa_inner_state,
                                                w.idx_compressor, cmp_cos, cmp_sin, page_size=RATIO4_STATE_PAGE_SIZE,
                                                eps=eps, hadamard=w.idx_hadamard)
            _scatter(caches.idx, batch.slots["idx"][b], idx, bf16=False)
            _scatter(caches.idx_scale, batch.slots["idx"][b], idx_scale, bf16=False)

    # ---- query side over this call's rows
    lo, hi = (0, batch.padded_rows) if rank is None else (rank * batch.local_rows, (rank + 1) * batch.local_rows)
    request = run_lowering(batch.query_start_loc, lo, hi - lo).values[-1].astype(np.int64)
    q_pos, q_x = positions[lo:hi], xn[lo:hi]
    q_cos, q_sin = cos[lo:hi], sin[lo:hi]
    q, qr_q, qr_scale = (v.astype(np.float32) for v in run_query(
        q_x, w.wq_a, w.q_norm, w.wq_b, w.wq_b_scale, q_cos, q_sin, config.num_attention_heads, eps).values[-3:])
    window = run_window(q_pos, request, batch.tables["ori"], config.sliding_window).values[-1]
    cmp_rows, cmp_pool = None, None
    if kind == "csa":
        top = np.full((hi - lo, config.index_topk), -1, np.int32)
        columns = int(np.where(request >= 0, (q_pos + 1) // INDEX_RATIO, 0).max(initial=0))
        if columns > 0:  # candidates: the request's own visible idx entries, through its table
            candidates = run_entry_rows(q_pos, request, batch.tables["idx"], None, ratio=INDEX_RATIO,
                                        columns=columns).values[-1]
            top = run_indexer(qr_q, qr_scale, w.idx_wq_b, w.idx_wq_b_scale, q_x, w.idx_weights_proj, q_cos, q_sin,
                              w.idx_hadamard, caches.idx, caches.idx_scale, candidates,
                              heads=config.index_n_heads, topk=config.index_topk,
                              weight_scale=config.index_weight_scale).values[-1]
        cmp_rows = run_entry_rows(q_pos, request, batch.tables["csa_cmp"], top).values[-1]
        cmp_pool = caches.csa_cmp
    elif kind == "hca":
        ratio = config.compress_ratios[layer]
        columns = int(np.where(request >= 0, (q_pos + 1) // ratio, 0).max(initial=0))
        if columns > 0:  # HCA dense: every visible entry through the request's table
            cmp_rows = run_entry_rows(q_pos, request, batch.tables["hca_cmp"], None, ratio=ratio,
                                      columns=columns).values[-1]
            cmp_pool = caches.hca_cmp
    o = run_sparse_attention(q, window, cmp_rows, caches.ori, cmp_pool, w.attn_sink, q_cos, q_sin,
                             scale=config.softmax_scale).values[-1].astype(np.float32)
    out = run_o_proj(o.reshape(o.shape[0], -1), w.wo_a, w.wo_b, w.wo_b_scale, config.o_groups).values[-1]
    out = out.astype(np.float32)
    out[request < 0] = 0
    return out
