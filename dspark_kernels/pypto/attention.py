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

By default every layer runs in a child process (:func:`~dspark_kernels.pypto.isolate.run_isolated`):
pypto leaks ~23 MB per kernel call and can end the process on some errors. The child's caches are
copied back into ``caches`` in place. Importing this module imports neither torch nor pypto.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import attrs
import numpy as np

from dspark_abi import ModelConfig, PackedBatch
from dspark_abi.pools import TABLE_FIELDS
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.backends import PYPTO_PRECISION as PRECISION
from dspark_kernels.model.block_weights import HcWeights, HeadWeights, MoEWeights
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.checks import check_attention_inputs
from dspark_kernels.model.numerics import narrow
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import PreparedWeights, PreparedWeightsCache, prepared_for
from dspark_kernels.pypto.isolate import run_isolated

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
    check_attention_inputs(batch, layer, x, weights, caches, rank, PRECISION)
    plan = BatchPlan.build(batch, rank=rank, precision=PRECISION)
    w = prepared_for(weights, PRECISION, prepared)
    return PyptoAttention(isolate=isolate)(plan, layer, x, w, caches)


@attrs.define(eq=False)
class PyptoAttention:
    """The pypto :class:`~dspark_kernels.model.backends.AttentionBackend` (``plan.precision`` must be a2a3).

    It keeps no per-plan state: the batch's table lookups (request ids, window rows, visible entry rows, compressor
    windows) are the plan's, computed once per batch and rank. isolate: False runs pypto in this process. One
    instance serves any number of plans (the ranks of an in-process TP group share one).
    """

    isolate: bool = True

    def __call__(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                 caches: LayerCaches) -> np.ndarray:
        if plan.precision != PRECISION or weights.precision != PRECISION:
            raise ValueError(f"the pypto kernels compute {PRECISION}, not plan {plan.precision} / weights "
                             f"{weights.precision}")
        if not self.isolate:
            return _attention_in_process(plan, layer, x, weights, caches)
        out, updated = run_isolated(_attention_and_caches, plan, layer, x, weights, caches)
        for name, array in caches.arrays().items():
            array[...] = updated[name]
        return out

    # the layer's hyper-connection stages (model.backends.HyperConnectionStages), through the pypto kernels
    def hc_pre(self, x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: str,
               norm: np.ndarray | None = None) -> HcMix:
        """The reference's ``hc_pre`` in a2a3 numerics, through :mod:`dspark_kernels.pypto.hyper_connections`;
        with ``norm`` [D] the sub-block's RMSNorm of ``x_mixed`` is fused into the kernel (``x_normed``)."""
        _check_precision(precision)
        run = run_isolated if self.isolate else _direct
        return HcMix(*run(_hc_pre, x_hc, weights, config, norm))

    def hc_post(self, out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray, *, precision: str
                ) -> np.ndarray:
        """The reference's ``hc_post`` in a2a3 numerics, through :mod:`dspark_kernels.pypto.hyper_connections`."""
        _check_precision(precision)
        run = run_isolated if self.isolate else _direct
        result: np.ndarray = run(_hc_post, out, x_hc, post, comb)
        return result

    # the head's stages (model.backends.HeadStages), through the pypto kernels of .hyper_connections and .head
    def hc_head(self, x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: str) -> np.ndarray:
        """The reference's ``hc_head`` in a2a3 numerics (the DSpark target features): [T, D] fp32 (bf16 values)."""
        _check_precision(precision)
        return self._run(_hc_head, x_hc, weights, config)

    def final_hidden(self, x_hc: np.ndarray, weights: HeadWeights, config: ModelConfig, *, precision: str
                     ) -> np.ndarray:
        """The reference's ``final_hidden`` (hc_head + final RMSNorm) in a2a3 numerics: [T, D] fp32 (bf16 values)."""
        _check_precision(precision)
        return self._run(_final_hidden, x_hc, weights, config)

    def logits_for_rows(self, x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
        """The reference's ``logits_for_rows`` (``head_w``: the whole head or this rank's vocabulary shard)."""
        return self._run(_logits_for_rows, x_out, rows, head_w)

    def greedy(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The reference's ``greedy``: [M] int64 first-maximum ids, -1 on inactive rows."""
        return self._run(_greedy, logits, rows)

    # the layer's MoE FFN (model.backends.MoEStage), through the pypto kernels of .moe
    def moe(self, x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
            token_ids: np.ndarray | None = None, live: np.ndarray | None = None, precision: str) -> np.ndarray:
        """The reference's ``moe`` in a2a3 numerics, through :mod:`dspark_kernels.pypto.moe`: its gate and experts
        kernels run in child processes (when isolated); the grouping by expert and the experts' int8 weights are
        prepared in this process, so only arrays travel."""
        _check_precision(precision)
        from dspark_kernels.pypto.moe import moe

        return moe(x, weights, config, norm=norm, token_ids=token_ids, live=live,
                   run=run_isolated if self.isolate else None)

    def _run(self, func: Callable[..., np.ndarray], *args: object) -> np.ndarray:
        return run_isolated(func, *args) if self.isolate else func(*args)


@attrs.frozen
class HcMix:
    """hc_pre's outputs (the reference's ``HcPre`` fields): x_mixed [T, D] fp32 holding bf16 values, post [T, hc],
    comb [T, hc, hc]; x_normed [T, D] fp32 (bf16 values), the fused RMSNorm when hc_pre was given a ``norm``."""

    x_mixed: np.ndarray
    post: np.ndarray
    comb: np.ndarray
    x_normed: np.ndarray | None = None


def _check_precision(precision: str) -> None:
    if precision != PRECISION:
        raise ValueError(f"the pypto kernels compute {PRECISION}, not {precision}")


def _direct(func: Callable[..., T], *args: object) -> T:
    return func(*args)


def _hc_pre(x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, norm: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """In the kernel process: hc_pre's arrays (plain arrays travel back; the kernel module stays in the child)."""
    from dspark_kernels.pypto.hyper_connections import hc_pre

    result = hc_pre(x_hc, weights, config, norm=norm)
    return result.x_mixed, result.post, result.comb, result.x_normed


def _hc_post(out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    from dspark_kernels.pypto.hyper_connections import hc_post

    return hc_post(out, x_hc, post, comb)


def _hc_head(x_hc: np.ndarray, weights: HcWeights, config: ModelConfig) -> np.ndarray:
    from dspark_kernels.pypto.hyper_connections import hc_head

    return hc_head(x_hc, weights, config)


def _final_hidden(x_hc: np.ndarray, weights: HeadWeights, config: ModelConfig) -> np.ndarray:
    from dspark_kernels.pypto.head import final_hidden

    return final_hidden(x_hc, weights, config)


def _logits_for_rows(x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
    from dspark_kernels.pypto.head import logits_for_rows

    return logits_for_rows(x_out, rows, head_w)


def _greedy(logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    from dspark_kernels.pypto.head import greedy

    return greedy(logits, rows)



def _attention_and_caches(plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                          caches: LayerCaches) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    out = _attention_in_process(plan, layer, x, weights, caches)
    return out, caches.arrays()


def _attention_in_process(plan: BatchPlan, layer: int, x: np.ndarray, w: PreparedWeights, caches: LayerCaches
                          ) -> np.ndarray:
    """The output rows of one layer."""
    from dspark_kernels.pypto.compressor import compress_into
    from dspark_kernels.pypto.entry_rows import run_entry_rows
    from dspark_kernels.pypto.indexer import run_indexer
    from dspark_kernels.pypto.o_proj import run_o_proj
    from dspark_kernels.pypto.paged import scatter_into
    from dspark_kernels.pypto.projections import run_query, run_shared_kv
    from dspark_kernels.pypto.sparse_attention import run_sparse_attention

    batch, config = plan.batch, plan.config
    pools = config.layout.pools  # each table's addressing (ring or not) comes from its PoolLayout
    kind = config.layer_kind(layer)
    xn = narrow(x, PRECISION)
    eps = config.rms_norm_eps

    # ---- KV side over all P rows; every write happens before any read
    rope = plan.rope[kind]
    kv = run_shared_kv(xn, w.wkv, w.kv_norm, rope.cos, rope.sin, eps).values[-1][:, 0].astype(np.float32)
    scatter_into(caches.ori, batch.slots["ori"], kv, bf16=True)
    if kind != "swa" and w.compressor is not None:
        ratio = config.compress_ratios[layer]
        start = plan.window_rope[ratio]
        state = f"{kind}_state"
        b, (entries,) = compress_into(xn, plan.positions, plan.request, batch.slots[state], batch.tables[state],
                                      caches.pool(state), w.compressor, start.cos, start.sin,
                                      page_size=pools[state].page_size, eps=eps, ring=pools[state].is_ring,
                                      windows=plan.state_windows[state])
        scatter_into(caches.pool(f"{kind}_cmp"), batch.slots[f"{kind}_cmp"][b], entries, bf16=True)
        if kind == "csa":
            inner = "csa_inner_state"
            b, (idx, idx_scale) = compress_into(xn, plan.positions, plan.request, batch.slots[inner],
                                                batch.tables[inner], caches.pool(inner),
                                                _given(w.idx_compressor, "indexer.compressor"), start.cos,
                                                start.sin, page_size=pools[inner].page_size, eps=eps,
                                                ring=pools[inner].is_ring, hadamard=w.idx_hadamard,
                                                windows=plan.state_windows[inner])
            scatter_into(caches.pool("idx"), batch.slots["idx"][b], idx, bf16=False)
            scatter_into(caches.pool("idx_scale"), batch.slots["idx"][b], idx_scale, bf16=False)

    # ---- query side over the plan's rows; the table lookups (request ids, window, entry rows) are the plan's
    lo, hi = plan.row_start, plan.row_stop
    request = plan.query_request.astype(np.int64)
    q_x = xn[lo:hi]
    q_cos, q_sin = rope.rows(lo, hi)
    q, qr_q, qr_scale = (v.astype(np.float32) for v in run_query(
        q_x, w.wq_a, w.q_norm, w.wq_b, _given(w.wq_b_scale, "wq_b scale"), q_cos, q_sin, config.num_attention_heads,
        eps).values[-3:])
    window = plan.window_in(lo, hi)
    cmp_rows, cmp_pool = None, None
    if kind == "csa":
        top = np.full((hi - lo, config.index_topk), -1, np.int32)
        candidates = plan.entry_rows_in("idx", lo, hi)  # the request's own visible idx entries, through its table
        if candidates.shape[1] > 0:
            top = run_indexer(qr_q, qr_scale, _given(w.idx_wq_b, "indexer.wq_b"),
                              _given(w.idx_wq_b_scale, "indexer.wq_b scale"), q_x,
                              _given(w.idx_weights_proj, "indexer.weights_proj"), q_cos, q_sin,
                              _given(w.idx_hadamard, "indexer Hadamard"), caches.pool("idx"), caches.pool("idx_scale"),
                              candidates,
                              heads=config.index_n_heads, topk=config.index_topk,
                              weight_scale=config.index_weight_scale).values[-1]
        cmp_rows = run_entry_rows(plan.positions[lo:hi], request, batch.tables["csa_cmp"], top,
                                  ring=pools["csa_cmp"].is_ring, table_name=TABLE_FIELDS["csa_cmp"]).values[-1]
        cmp_pool = caches.pool("csa_cmp")
    elif kind == "hca":
        visible = plan.entry_rows_in("hca_cmp", lo, hi)  # HCA dense: every visible entry through the request's table
        if visible.shape[1] > 0:
            cmp_rows, cmp_pool = visible, caches.pool("hca_cmp")
    o = run_sparse_attention(q, window, cmp_rows, caches.ori, cmp_pool, w.attn_sink, q_cos, q_sin,
                             scale=config.softmax_scale).values[-1].astype(np.float32)
    out = run_o_proj(o.reshape(o.shape[0], -1), w.wo_a, w.wo_b, _given(w.wo_b_scale, "wo_b scale"),
                     config.o_groups).values[-1]
    out = out.astype(np.float32)
    out[request < 0] = 0
    return out


def _given(value: T | None, what: str) -> T:
    """An array (or compressor) the a2a3 weights of this layer kind always have."""
    if value is None:
        raise ValueError(f"the a2a3 weights of this layer lack the {what}")
    return value
