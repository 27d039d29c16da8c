"""`attention_pypto`: one attention layer over a packed batch with the pypto kernels (the ``pypto`` backend).

Same contract as :func:`dspark_kernels.reference.attention.attention` with ``precision="a2a3"`` (the
numerics the kernels implement): same arguments, same output, same in-place cache updates. Every stage that
computes runs through a pypto kernel; the host reads the batch's plan (request ids, RoPE rows, window rows,
visible entry rows, the compressors' boundary rows and windows: table lookups that are the same for every layer,
computed once per batch and rank) and moves arrays between calls. The stage modules mirror the reference's
(``lowering`` and ``window`` are kernels of the plan's lookups, tested against it; a forward reads the plan's):

=====================================================  ==================================================
stage                                                  module
=====================================================  ==================================================
local request ids of the query rows (1)                the plan's ``request`` (kernel: ``lowering``)
shared kv (all P rows) and q path (query rows) (2)     ``projections``
``ori``, state, compressed and idx writes (3)          ``paged``
window rows through the request's ori table (3)        the plan's ``window`` (kernel: ``window``)
compressors ratio 4 / 128, state rings (4)             ``compressor`` (+ ``paged``)
indexer compressor: Hadamard, int8 idx cache (5)       ``compressor`` (+ ``paged``)
lightning indexer scores and top-k (5)                 ``indexer`` (candidates: the plan's ``entry_rows``)
compressed rows through the request's table (6)        ``entry_rows`` (CSA); HCA: the plan's ``entry_rows``
sparse attention core with sink, inverse RoPE (6)      ``sparse_attention``
grouped o_proj with int8 activations (7)               ``o_proj``
=====================================================  ==================================================

The order of the stages is the model layer's one orchestrator (:func:`~dspark_kernels.model.backends.run_attention`)
over :class:`PyptoStages`, which runs its kernels in this process; the pypto backend
(:class:`~dspark_kernels.pypto.backend.PyptoBackend`) runs every layer in a child process
(:func:`~dspark_kernels.pypto.isolate.run_isolated`): pypto leaks ~23 MB per kernel call and can end the process
on some errors. The child's caches are copied back into ``caches`` in place. Importing this module imports
neither torch nor pypto.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

import numpy as np

from dspark_abi import PackedBatch
from dspark_abi.pools import TABLE_FIELDS
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.backends import PYPTO_PRECISION as PRECISION
from dspark_kernels.model.backends import HcMix, KeyRows, QueryPath, run_attention
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.checks import check_attention_inputs
from dspark_kernels.model.plan import BatchPlan, IndexKeyPools, RopeRows
from dspark_kernels.model.prepared import PreparedWeights, PreparedWeightsCache, prepared_for

T = TypeVar("T")


def attention_pypto(batch: PackedBatch, layer: int, x: np.ndarray, weights: AttentionWeights, caches: LayerCaches,
                    *, rank: int | None = None, isolate: bool = True,
                    prepared: PreparedWeightsCache | None = None) -> np.ndarray:
    """Attention output of layer ``layer``; **mutates** ``caches`` in place (see the reference's docstring).

    x: [P, hidden_size] float32 post-attn_norm rows (padding rows zero). caches: allocated with
    ``precision="a2a3"``. rank: None for all P rows (output [P, hidden]) or a TP rank (output [L, hidden]).
    isolate: run in a child process (default); False runs pypto in this process. prepared: a cache of
    prepared weights the caller keeps across calls (default: prepare them now).
    """
    from dspark_kernels.pypto.backend import PyptoBackend

    check_attention_inputs(batch, layer, x, weights, caches, rank, PRECISION)
    plan = BatchPlan.build(batch, rank=rank, precision=PRECISION)
    w = prepared_for(weights, PRECISION, prepared)
    return PyptoBackend(isolate=isolate).attention(plan, layer, x, w, caches)


def attend_in_process(plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights, caches: LayerCaches
                      ) -> np.ndarray:
    """One layer's attention with the pypto kernels in this process (the model layer's orchestrator over
    :class:`PyptoStages`); ``plan.precision`` and ``weights.precision`` are a2a3 (the backend checks them)."""
    return run_attention(PyptoStages(), plan, layer, x, weights, caches)


class PyptoStages:
    """The pypto kernels' :class:`~dspark_kernels.model.backends.AttentionStages` (a2a3), run in this process.

    The query side runs all of the plan's query rows in one block (``query_block = 0``): the kernels tile them.
    """

    query_block: int = 0

    def shared_kv(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                  caches: LayerCaches) -> None:
        from dspark_kernels.pypto.paged import scatter_into
        from dspark_kernels.pypto.projections import run_shared_kv

        rope = plan.rope[plan.config.layer_kind(layer)]
        kv = run_shared_kv(x, weights.wkv, weights.kv_norm, rope.cos, rope.sin,
                           plan.config.rms_norm_eps).values[-1][:, 0].astype(np.float32)
        scatter_into(caches.ori, plan.batch.slots["ori"], kv, bf16=True)

    def compress(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                 caches: LayerCaches) -> None:
        from dspark_kernels.pypto.compressor import compress_into
        from dspark_kernels.pypto.paged import scatter_into

        config = plan.config
        kind = config.layer_kind(layer)
        state = plan.compressor_state(f"{kind}_state", caches.pool(f"{kind}_state"))
        b, (entries,) = compress_into(x, plan.positions, plan.request, state,
                                      _given(weights.compressor, "compressor"),
                                      plan.window_rope[config.compress_ratios[layer]], eps=config.rms_norm_eps)
        scatter_into(caches.pool(f"{kind}_cmp"), plan.batch.slots[f"{kind}_cmp"][b], entries, bf16=True)

    def compress_index_keys(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                            caches: LayerCaches) -> None:
        from dspark_kernels.pypto.compressor import compress_into
        from dspark_kernels.pypto.paged import scatter_into

        config = plan.config
        state = plan.compressor_state("csa_inner_state", caches.pool("csa_inner_state"))
        b, (idx, idx_scale) = compress_into(x, plan.positions, plan.request, state,
                                            _given(weights.idx_compressor, "indexer.compressor"),
                                            plan.window_rope[config.compress_ratios[layer]], eps=config.rms_norm_eps,
                                            hadamard=weights.idx_hadamard)
        slots = plan.batch.slots["idx"][b]
        scatter_into(caches.pool("idx"), slots, idx, bf16=False)
        scatter_into(caches.pool("idx_scale"), slots, idx_scale, bf16=False)

    def query(self, plan: BatchPlan, layer: int, x: np.ndarray, rows: slice, weights: PreparedWeights
              ) -> QueryPath:
        from dspark_kernels.pypto.projections import run_query

        config, w = plan.config, weights
        cos, sin = plan.rope[config.layer_kind(layer)].rows(rows.start, rows.stop)
        q, qr_q, qr_scale = (v.astype(np.float32) for v in run_query(
            x[rows], w.wq_a, w.q_norm, w.wq_b, _given(w.wq_b_scale, "wq_b scale"), cos, sin,
            config.num_attention_heads, config.rms_norm_eps).values[-3:])
        return QueryPath(q=q, low_rank=(qr_q, qr_scale))

    def index_topk(self, plan: BatchPlan, layer: int, x: np.ndarray, rows: slice, query: QueryPath,
                   weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
        from dspark_kernels.pypto.indexer import IndexerWeights, run_indexer

        config, w = plan.config, weights
        candidates = plan.entry_rows_in("idx", rows.start, rows.stop)  # the request's own visible idx entries
        if candidates.shape[1] == 0:
            return np.full((rows.stop - rows.start, config.index_topk), -1, np.int32)
        rope = plan.rope[config.layer_kind(layer)]
        top: np.ndarray = run_indexer(query.low_rank, x[rows], IndexerWeights.of(w, config),
                                      RopeRows(*rope.rows(rows.start, rows.stop)),
                                      IndexKeyPools(caches.pool("idx"), caches.pool("idx_scale")), candidates,
                                      topk=config.index_topk).values[-1]
        return top

    def chosen_entry_rows(self, plan: BatchPlan, rows: slice, entries: np.ndarray) -> np.ndarray:
        from dspark_kernels.pypto.entry_rows import run_entry_rows

        pool = plan.config.layout.pools["csa_cmp"]
        result: np.ndarray = run_entry_rows(plan.positions[rows], plan.table_row[rows].astype(np.int64),
                                            plan.tables["csa_cmp"], entries, ring=pool.is_ring,
                                            table_name=TABLE_FIELDS["csa_cmp"]).values[-1]
        return result

    def sparse_attention(self, plan: BatchPlan, layer: int, rows: slice, query: QueryPath, keys: KeyRows,
                         weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
        from dspark_kernels.pypto.sparse_attention import run_sparse_attention

        cos, sin = plan.rope[plan.config.layer_kind(layer)].rows(rows.start, rows.stop)
        pool = None if keys.pool is None else caches.pool(keys.pool)
        return run_sparse_attention(query.q, keys.window, keys.compressed, caches.ori, pool, weights.attn_sink,
                                    cos, sin, scale=plan.config.softmax_scale).values[-1].astype(np.float32)

    def output_projection(self, plan: BatchPlan, o: np.ndarray, weights: PreparedWeights) -> np.ndarray:
        from dspark_kernels.pypto.o_proj import run_o_proj

        return run_o_proj(o, weights.wo_a, weights.wo_b, _given(weights.wo_b_scale, "wo_b scale"),
                          plan.config.o_groups).values[-1].astype(np.float32)


def _given(value: T | None, what: str) -> T:
    """An array (or compressor) the a2a3 weights of this layer kind always have."""
    if value is None:
        raise ValueError(f"the a2a3 weights of this layer lack the {what}")
    return value


def __getattr__(name: str) -> Any:
    """``PyptoAttention`` (deprecated for one minor version): :class:`~dspark_kernels.pypto.backend.PyptoBackend`."""
    if name == "PyptoAttention":
        from dspark_kernels.pypto.backend import PyptoBackend

        warnings.warn("dspark_kernels.pypto.attention.PyptoAttention is deprecated: use "
                      "dspark_kernels.pypto.backend.PyptoBackend", DeprecationWarning, stacklevel=2)
        return PyptoBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HcMix", "PyptoStages", "attend_in_process", "attention_pypto"]
