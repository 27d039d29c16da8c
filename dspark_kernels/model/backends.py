"""The backends a forward runs with: the :class:`Backend` protocol (every stage a layer and the head run), the
:class:`AttentionStages` protocol (the attention module's stages, which :func:`run_attention`, the one
orchestrator, drives) and the registry that resolves a backend's name without importing it here.

=============  ========================================================  ==========================================
name           backend (resolved by module path, imported when resolved)  precisions
=============  ========================================================  ==========================================
``reference``  :class:`dspark_kernels.reference.backend.ReferenceBackend`  ``fp32``, ``a2a3``, ``deepseek``
``pypto``      :class:`dspark_kernels.pypto.backend.PyptoBackend`          ``a2a3`` (the numerics its kernels implement)
=============  ========================================================  ==========================================

Both backends implement every stage of both protocols with the same signatures (a test pins it); neither is
imported by the model layer, which reaches them only through :func:`resolve_backend`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig, PackedBatch
from dspark_kernels.model.accept import Acceptance
from dspark_kernels.model.block_weights import HcWeights, HeadWeights, MoEWeights
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.numerics import Precision, narrow
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import PreparedWeights

BackendName = Literal["reference", "pypto"]
#: The backend names, in the order help texts list them.
BACKENDS: tuple[BackendName, ...] = ("reference", "pypto")
#: The precision the pypto kernels compute.
PYPTO_PRECISION: Precision = "a2a3"
#: Where the registry finds each backend: (module path, class), imported only when the name is resolved.
REGISTRY: dict[str, tuple[str, str]] = {"reference": ("dspark_kernels.reference.backend", "ReferenceBackend"),
                                        "pypto": ("dspark_kernels.pypto.backend", "PyptoBackend")}


# ---------------------------------------------------------------------------------------------- stage values
@attrs.frozen(eq=False)
class HcMix:
    """hc_pre's outputs: x_mixed [T, D] fp32 (bf16 values in a2a3), post [T, hc] and comb [T, hc, hc] fp32; and
    x_normed [T, D] fp32, ``narrow(rms_norm(x_mixed, norm, rms_norm_eps), precision)``, the sub-block's input,
    when hc_pre was given the sub-block's ``norm`` (a backend may fuse it), else None."""

    x_mixed: np.ndarray
    post: np.ndarray
    comb: np.ndarray
    x_normed: np.ndarray | None = None


@attrs.frozen(eq=False)
class QueryPath:
    """The q path of T query rows: ``q`` [T, H, D] float32 roped attention queries (bf16 values in a2a3), and
    ``low_rank``, what the backend's lightning indexer reads of the normalised low-rank query (the backend's own
    value: the reference's ``LowRankQuery``, the pypto kernels' int8 rows and scales)."""

    q: np.ndarray
    low_rank: Any


@attrs.frozen(eq=False)
class KeyRows:
    """The keys T query rows attend to: ``window`` [T, W] int64 ``ori`` rows (the plan's), ``compressed``
    [T, K] int64 rows of the ``pool`` compressed pool (``csa_cmp`` or ``hca_cmp``; K may be 0) or None with
    ``pool`` None on SWA layers; -1 = no key."""

    window: np.ndarray
    compressed: np.ndarray | None = None
    pool: str | None = None


# ---------------------------------------------------------------------------------------------- protocols
class AttentionStages(Protocol):
    """The stages of one attention layer that :func:`run_attention` drives (in the order it calls them).

    Every stage reads the batch's :class:`BatchPlan` (rows, positions, ownership and table lookups) instead of
    deriving them. x: [P, hidden] float32 post-attn_norm rows, already narrowed to the plan's precision.
    rows: a slice of group query rows ``[lo, hi)`` (one query block). weights: the layer's
    :class:`PreparedWeights` in the plan's precision; caches: its :class:`LayerCaches`, written in place.
    ``query_block``: query rows per block (bounds the [rows, H*D] intermediates); 0 = all query rows at once.
    """

    query_block: int

    def shared_kv(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                  caches: LayerCaches) -> None:
        """KV side, all P rows: the shared kv rows, written to ``ori`` through its slot mapping."""
        ...

    def compress(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                 caches: LayerCaches) -> None:
        """KV side, CSA / HCA: the layer's compressor (state ring, then the new entries of ``{kind}_cmp``)."""
        ...

    def compress_index_keys(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                            caches: LayerCaches) -> None:
        """KV side, CSA: the lightning indexer's key compressor (inner state ring, then ``idx`` / ``idx_scale``)."""
        ...

    def query(self, plan: BatchPlan, layer: int, x: np.ndarray, rows: slice, weights: PreparedWeights
              ) -> QueryPath:
        """The q path of query rows ``rows``."""
        ...

    def index_topk(self, plan: BatchPlan, layer: int, x: np.ndarray, rows: slice, query: QueryPath,
                   weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
        """CSA: [T, topk] int32 logical ``csa_cmp`` entries the lightning indexer chose (-1 = none)."""
        ...

    def chosen_entry_rows(self, plan: BatchPlan, rows: slice, entries: np.ndarray) -> np.ndarray:
        """CSA: [T, K] int physical ``csa_cmp`` rows of the chosen logical entries [T, K] (-1 = none)."""
        ...

    def sparse_attention(self, plan: BatchPlan, layer: int, rows: slice, query: QueryPath, keys: KeyRows,
                         weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
        """[T, H, D] float32 attention core over ``keys`` with the sink and inverse RoPE."""
        ...

    def output_projection(self, plan: BatchPlan, o: np.ndarray, weights: PreparedWeights) -> np.ndarray:
        """[T, hidden] float32 grouped o_proj of o [T, H*D]."""
        ...


class Backend(Protocol):
    """Every stage a layer and the head run (:func:`~dspark_kernels.model.layer.run_layer`,
    :func:`~dspark_kernels.model.forward.run_forward`), one signature each.

    ``attention(plan, layer, x, weights, caches)``: x [P, hidden] float32 post-attn_norm rows (padding rows
    zero), weights prepared in ``plan.precision``, caches written in place (every group row's writes); returns
    [rows, hidden] float32 for the plan's query rows (zero on padding rows). Both backends run it with
    :func:`run_attention` over their :class:`AttentionStages`.
    """

    def batch_issues(self, batch: PackedBatch, layers: Sequence[int], tables: Mapping[str, np.ndarray] | None = None
                     ) -> list[Issue]:
        """Issues of a valid batch this backend cannot compute over ``layers`` (checked before anything runs).
        tables: pool -> the block table the kernels read (the persistent tables of a persistent step,
        :meth:`~dspark_kernels.model.plan.PlanSource.read_tables`); default the batch's own."""
        ...

    def hc_pre(self, x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision,
               norm: np.ndarray | None = None) -> HcMix:
        """x_hc [T, hc, D] -> :class:`HcMix`; with ``norm`` [D] also the sub-block's normed input."""
        ...

    def attention(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                  caches: LayerCaches) -> np.ndarray:
        ...

    def hc_post(self, out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray, *,
                precision: Precision) -> np.ndarray:
        """[T, hc, D] float32 streams after the sub-block: out [T, D], x_hc [T, hc, D], post [T, hc], comb."""
        ...

    def moe(self, x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
            token_ids: np.ndarray | None = None, live: np.ndarray | None = None, precision: Precision
            ) -> np.ndarray:
        """[T, D] float32 MoE FFN of hc_pre's x_mixed rows x [T, D]; ``norm`` the layer's ffn_norm (applied here),
        token_ids [T] (hash layers), live [T] bool (padding rows skipped, zero output)."""
        ...

    def hc_head(self, x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision
                ) -> np.ndarray:
        """[T, D] float32 model-level hc_head of the streams x_hc [T, hc, D]."""
        ...

    def stream_mean(self, x_hc: np.ndarray, *, precision: Precision) -> np.ndarray:
        """[T, D] float32 plain mean of the streams x_hc [T, hc, D] (the DSpark target features)."""
        ...

    def final_hidden(self, x_hc: np.ndarray, weights: HeadWeights, config: ModelConfig, *, precision: Precision
                     ) -> np.ndarray:
        """[T, D] float32 ``rms_norm(hc_head(x_hc), norm)``."""
        ...

    def logits_for_rows(self, x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
        """[M, V] float32 logits of group rows ``rows`` [M] (-1 = inactive, zero row); head_w [V, D]."""
        ...

    def greedy(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """[M] int64 first-maximum token of every row, -1 where ``rows`` is -1."""
        ...

    def accept(self, tokens: np.ndarray, greedy: np.ndarray, widths: np.ndarray) -> Acceptance:
        """Greedy acceptance of R verify requests: tokens [R, W] inputs ``[anchor, d_1 ..]``, greedy [R, W] the
        greedy ids at their rows, widths [R] (:func:`dspark_kernels.model.accept.accept_greedy`)."""
        ...


# ---------------------------------------------------------------------------------------------- the orchestrator
def run_attention(stages: AttentionStages, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                  caches: LayerCaches) -> np.ndarray:
    """One attention layer over ``plan`` with a backend's stages (upstream's CSA / HCA layer assembly).

    1. KV side, over all P group rows (every TP rank recomputes it, as upstream's DSA-CP does): shared kv ->
       ``ori``; CSA / HCA: the compressor -> ``{kind}_cmp`` (state ring first); CSA: the indexer's keys -> ``idx``.
       All writes happen before any read below.
    2. Query side, over the plan's query rows in blocks of ``stages.query_block``: q path; CSA: indexer top-k
       over the request's own visible entries and their rows; HCA: every visible entry (the plan's rows);
       the window rows (the plan's); sparse attention; grouped o_proj. Padding-only blocks are skipped.

    x [P, hidden] float32; returns [rows, hidden] float32, zero on padding rows (request -1), which write
    nothing (their slots are -1).
    """
    config = plan.config
    kind = config.layer_kind(layer)
    xn = narrow(x, plan.precision)  # the a2a3 kernels and the official inference receive bf16 hidden rows
    stages.shared_kv(plan, layer, xn, weights, caches)
    if kind != "swa" and weights.compressor is not None:
        stages.compress(plan, layer, xn, weights, caches)
        if kind == "csa":
            stages.compress_index_keys(plan, layer, xn, weights, caches)

    lo, hi = plan.row_start, plan.row_stop
    out = np.zeros((hi - lo, config.hidden_size), dtype=np.float32)
    block = stages.query_block or max(hi - lo, 1)
    for start in range(lo, hi, block):
        rows = slice(start, min(start + block, hi))
        if plan.runs_in(rows.start, rows.stop):  # else padding rows only: zero
            out[rows.start - lo:rows.stop - lo] = _query_block(stages, plan, layer, xn, rows, weights, caches)
    return out


def _query_block(stages: AttentionStages, plan: BatchPlan, layer: int, xn: np.ndarray, rows: slice,
                 weights: PreparedWeights, caches: LayerCaches) -> np.ndarray:
    """Output rows [T, hidden] of the query rows ``rows`` (zero on padding rows)."""
    kind = plan.config.layer_kind(layer)
    query = stages.query(plan, layer, xn, rows, weights)
    keys = KeyRows(plan.window_in(rows.start, rows.stop))
    if kind == "csa":
        top = stages.index_topk(plan, layer, xn, rows, query, weights, caches)
        keys = attrs.evolve(keys, compressed=stages.chosen_entry_rows(plan, rows, top), pool="csa_cmp")
    elif kind == "hca":
        keys = attrs.evolve(keys, compressed=plan.entry_rows_in("hca_cmp", rows.start, rows.stop), pool="hca_cmp")
    o = stages.sparse_attention(plan, layer, rows, query, keys, weights, caches)
    out = stages.output_projection(plan, o.reshape(o.shape[0], -1), weights)
    out[plan.request[rows] < 0] = 0
    return out


# ---------------------------------------------------------------------------------------------- the registry
def backend_issues(backend: object, precision: object) -> list[Issue]:
    """``config.invalid`` issues of a backend name and the precision asked of it (empty = resolvable)."""
    if backend not in BACKENDS:
        return [Issue("config.invalid", "backend", "unknown backend", expected=list(BACKENDS), actual=backend)]
    if backend == "pypto" and precision != PYPTO_PRECISION:
        return [Issue("config.invalid", "precision", "the pypto backend computes the a2a3 kernels' numerics",
                      expected=PYPTO_PRECISION, actual=precision)]
    return []


def resolve_backend(backend: str, precision: str) -> Backend:
    """The :class:`Backend` named ``backend`` for layers computed in ``precision``.

    Imports the backend's module now ('pypto' imports :mod:`dspark_kernels.pypto.backend`, not pypto itself: its
    kernels run in child processes); the result pickles, so a launcher can resolve it once for all ranks. Raises
    :class:`ABIError` (``config.invalid``) for an unknown backend or a precision it cannot compute.
    """
    issues = backend_issues(backend, precision)
    if issues:
        raise ABIError(issues)
    module, name = REGISTRY[backend]
    result: Backend = getattr(importlib.import_module(module), name)()
    return result


def default_backend(backend: Backend | None) -> Backend:
    """``backend``, or the registry's reference backend when None (the default of a caller given no backend)."""
    return resolve_backend("reference", "fp32") if backend is None else backend


def head_stages(backend: Backend | None) -> Backend:
    """The backend whose head stages a forward runs: :func:`default_backend`."""
    return default_backend(backend)


def __getattr__(name: str) -> Any:
    """Deprecated names (one minor version): ``AttentionBackend``, ``HeadStages``, ``HyperConnectionStages`` and
    ``MoEStage`` are parts of :class:`Backend` now."""
    if name in ("AttentionBackend", "HeadStages", "HyperConnectionStages", "MoEStage"):
        warnings.warn(f"dspark_kernels.model.backends.{name} is deprecated: use Backend", DeprecationWarning,
                      stacklevel=2)
        return Backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
