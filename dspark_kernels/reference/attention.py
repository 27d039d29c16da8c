"""`attention`: the whole attention module of one layer over a packed batch (SWA, CSA and HCA layers).

The order of the stages (upstream's CSA / HCA layer assembly; DeepSeek-V4 ``Attention.forward``) is the model
layer's one orchestrator, :func:`~dspark_kernels.model.backends.run_attention`; this module holds the reference's
stage set it drives (:class:`ReferenceStages`, the query side in blocks of ``QUERY_BLOCK`` rows), the checked
entry for one layer of a batch (:func:`attention`) and :func:`attend`, the reference backend's attention stage.

Padding rows (request -1) give zero output rows and write nothing (their slots are -1).
"""

from __future__ import annotations

import numpy as np

from dspark_abi import PackedBatch
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.backends import KeyRows, QueryPath, run_attention
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.checks import check_attention_inputs
from dspark_kernels.model.numerics import check_precision
from dspark_kernels.model.plan import BatchPlan, IndexKeyPools
from dspark_kernels.model.prepared import PreparedCompressor, PreparedWeights, PreparedWeightsCache, prepared_for
from dspark_kernels.reference.compressor import compress, compress_index_keys
from dspark_kernels.reference.entry_rows import chosen_entry_rows
from dspark_kernels.reference.indexer import IndexCandidates, index_query, lightning_topk
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


class ReferenceStages:
    """The reference's :class:`~dspark_kernels.model.backends.AttentionStages` (numpy, every precision)."""

    query_block: int = QUERY_BLOCK

    def shared_kv(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                  caches: LayerCaches) -> None:
        rope = plan.rope[plan.config.layer_kind(layer)]
        kv = shared_kv(x, weights, rope.cos, rope.sin, plan.config.rms_norm_eps, plan.precision)
        scatter_rows(caches.ori, plan.batch.slots["ori"], kv)

    def compress(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                 caches: LayerCaches) -> None:
        config = plan.config
        kind = config.layer_kind(layer)
        state = plan.compressor_state(f"{kind}_state", caches.pool(f"{kind}_state"))
        b, entries = compress(x, plan.positions, plan.request, state, _given(weights.compressor),
                              plan.window_rope[config.compress_ratios[layer]], eps=config.rms_norm_eps,
                              precision=plan.precision)
        scatter_rows(caches.pool(f"{kind}_cmp"), plan.batch.slots[f"{kind}_cmp"][b], entries)

    def compress_index_keys(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                            caches: LayerCaches) -> None:
        config = plan.config
        state = plan.compressor_state("csa_inner_state", caches.pool("csa_inner_state"))
        b, keys = compress_index_keys(x, plan.positions, plan.request, state, weights,
                                      plan.window_rope[config.compress_ratios[layer]], eps=config.rms_norm_eps,
                                      precision=plan.precision)
        slots = plan.batch.slots["idx"][b]
        scatter_rows(caches.pool("idx"), slots, keys.keys)
        scatter_rows(caches.pool("idx_scale"), slots, keys.scales)

    def query(self, plan: BatchPlan, layer: int, x: np.ndarray, rows: slice, weights: PreparedWeights
              ) -> QueryPath:
        config = plan.config
        cos, sin = plan.rope[config.layer_kind(layer)].rows(rows.start, rows.stop)        # (T, rd/2)
        lrq = low_rank_query(x[rows], weights, config.rms_norm_eps, plan.precision)
        q = query_heads(lrq, weights, cos, sin, config.num_attention_heads, config.rms_norm_eps, plan.precision)
        return QueryPath(q=q, low_rank=lrq)                                               # q: (T, H, D)

    def index_topk(self, plan: BatchPlan, layer: int, x: np.ndarray, rows: slice, query: QueryPath,
                   weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
        config = plan.config
        lo, hi = rows.start, rows.stop
        cos, sin = plan.rope[config.layer_kind(layer)].rows(lo, hi)
        iq = index_query(query.low_rank, x[rows], weights, cos, sin, config.index_n_heads,
                         config.index_weight_scale, plan.precision)
        candidates = IndexCandidates.of_plan(plan, lo, hi)
        keys = IndexKeyPools(caches.pool("idx"), caches.pool("idx_scale"))
        return lightning_topk(iq, plan.request[rows], keys, candidates, topk=config.index_topk,
                              precision=plan.precision, runs=plan.runs_in(lo, hi))

    def chosen_entry_rows(self, plan: BatchPlan, rows: slice, entries: np.ndarray) -> np.ndarray:
        return chosen_entry_rows(entries, plan.table_row[rows], plan.tables["csa_cmp"])

    def sparse_attention(self, plan: BatchPlan, layer: int, rows: slice, query: QueryPath, keys: KeyRows,
                         weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
        config = plan.config
        cos, sin = plan.rope[config.layer_kind(layer)].rows(rows.start, rows.stop)
        pool = None if keys.pool is None else caches.pool(keys.pool)
        return sparse_attention(query.q, plan.request[rows], keys.window, caches.ori, keys.compressed, pool,
                                weights.attn_sink, cos, sin, scale=config.softmax_scale, precision=plan.precision,
                                runs=plan.runs_in(rows.start, rows.stop))

    def output_projection(self, plan: BatchPlan, o: np.ndarray, weights: PreparedWeights) -> np.ndarray:
        return output_projection(o, weights, plan.precision)


def attend(plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
    """The reference backend's attention stage: layer ``layer`` over ``plan`` (the model layer's orchestrator
    :func:`~dspark_kernels.model.backends.run_attention` with :class:`ReferenceStages`).

    x [P, hidden] float32; weights prepared in ``plan.precision``; caches written in place. Returns
    [rows, hidden] for the plan's query rows. Inputs are not checked here (see :func:`attention`).
    """
    return run_attention(ReferenceStages(), plan, layer, x, weights, caches)


def _given(compressor: PreparedCompressor | None) -> PreparedCompressor:
    """The compressor of a CSA / HCA layer (the orchestrator calls ``compress`` only when there is one)."""
    if compressor is None:
        raise ValueError("this layer's weights have no compressor")
    return compressor
