"""Multi-layer forward over a packed batch: embedding, the config's layer schedule, hc_head, final norm, LM head,
and the DSpark drafter's target hidden features.

``run_forward`` does not validate the batch (``dspark_kernels.prefill`` does that first); it does check,
before anything is read or written, that weights, caches, input rows, layers, logit rows and the rank fit the batch.
It then derives the batch's :class:`~dspark_kernels.model.plan.BatchPlan` once (for its rank) and runs every layer
on it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import attrs
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig, PackedBatch
from dspark_abi.persistent import PersistentStep, PersistentTables
from dspark_kernels.model.backends import Backend, default_backend, head_stages
from dspark_kernels.model.block_weights import HeadWeights
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.geometry import vocab_shard, vocab_shard_width
from dspark_kernels.model.layer import AllGather, run_layer
from dspark_kernels.model.numerics import Precision, check_precision
from dspark_kernels.model.plan import PlanSource
from dspark_kernels.model.prepared import PreparedWeightsCache
from dspark_kernels.model.weights import ModelWeights


@attrs.frozen(eq=False)
class ForwardResult:
    """What a forward returns (every rank of a TP group returns the same values).

    x_hc: [P, hc, D] fp32, residual streams after the last layer run (input of a following layer range).
    hidden: [P, D] fp32, ``rms(hc_head(x_hc), norm)`` (bf16 values in a2a3 mode); padding rows zero.
    logit_rows: [M] int32, group rows the logits belong to; -1 = inactive.
    logits: [M, V] fp32; zero rows where inactive.
    sampled: [M] int64, greedy next token (first maximum); -1 where inactive.
    target_hidden: [P, T * D] fp32 (bf16 values in a2a3 and deepseek), the DSpark drafter's features as DeepSeek
        defines them: slice k is the mean of the hc streams of ``x_hc`` after layer ``config.dspark_target_layers[k]``
        (:func:`target_features`, ``reduction="mean"``), zero where that layer was not run and on padding rows;
        None when the config names no target layer.
    target_hidden_hc_head: the same with ``hc_head`` as the reduction (upstream pypto-lib's
        ``dspark_target_hidden``, ``reduction="hc_head"``), for comparison with it; None likewise.
    """

    x_hc: np.ndarray
    hidden: np.ndarray
    logit_rows: np.ndarray
    logits: np.ndarray
    sampled: np.ndarray
    target_hidden: np.ndarray | None = None
    target_hidden_hc_head: np.ndarray | None = None


#: The reductions :func:`target_features` offers: ``"mean"`` (DeepSeek's, the default) and ``"hc_head"``
#: (upstream pypto-lib's).
TargetReduction = Literal["mean", "hc_head"]
TARGET_REDUCTIONS: tuple[TargetReduction, ...] = get_args(TargetReduction)


def target_features(x_hc: np.ndarray, head: HeadWeights, config: ModelConfig, *, precision: Precision,
                    stages: Backend | None = None, reduction: TargetReduction = "mean") -> np.ndarray:
    """One target layer's DSpark feature [T, D] from the layer's output streams x_hc [T, hc, D] (after its FFN
    ``hc_post``); bf16 values in a2a3 and deepseek. Padding (zero) rows give zero rows.

    * ``"mean"`` (default): the plain mean of the hc streams, DeepSeek's definition (``Transformer.forward`` of
      its DSpark release appends ``h.mean(dim=2)`` after each target layer; docs/checkpoints.md section 6), what
      the drafter was trained on;
    * ``"hc_head"``: the model-level ``hc_head`` of the streams (the value whose RMS norm feeds the LM head after
      the last layer), upstream pypto-lib's ``dspark_target_hidden``, kept for comparison with it.

    stages: the backend whose ``stream_mean`` / ``hc_head`` stage computes it (default the registry's reference).
    """
    chosen = head_stages(None) if stages is None else stages
    if reduction == "hc_head":
        return chosen.hc_head(x_hc, head.hc, config, precision=precision)
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r} is not one of {list(TARGET_REDUCTIONS)}")
    return chosen.stream_mean(x_hc, precision=precision)


@attrs.frozen
class RankContext:
    """One rank's view of a TP group: ``rank`` (None = the whole group: every row) and ``all_gather``, the
    collective that joins the ranks' rows (:data:`~dspark_kernels.model.layer.AllGather`; needed by a rank of a
    group of more than one). The rank bounds are the batch's :meth:`~dspark_abi.PaddingPolicy.rank_issues`."""

    rank: int | None = None
    all_gather: AllGather | None = None


#: The whole TP group in one call (no rank view).
WHOLE_GROUP = RankContext()


@attrs.frozen(eq=False)
class ForwardOptions:
    """What a forward runs and how (every field optional).

    precision: ``"fp32"``, ``"a2a3"`` or ``"deepseek"`` (:mod:`dspark_kernels.model.numerics`). layers: the layer
    indices to run, in order (default every layer of the config). logit_rows: [M] group rows in [0, N) or -1
    (default ``batch.logit_rows``; none if that is None). backend: the
    :class:`~dspark_kernels.model.backends.Backend` whose stages run every layer and the head (default the
    registry's reference). prepared: the caller's cache of prepared attention weights, to reuse them across calls
    (default: one for this call, kept only if the weights keep their layers). on_layer(done, total): called after
    each layer. caches_checked: the caller already raised on ``caches.issues_for(batch, precision, layers)`` (a
    prefill checks the caches before it snapshots them; the check runs once).
    """

    precision: str = "fp32"
    layers: Sequence[int] | None = None
    logit_rows: Sequence[int] | np.ndarray | None = None
    backend: Backend | None = None
    prepared: PreparedWeightsCache | None = None
    on_layer: Callable[[int, int], None] | None = None
    caches_checked: bool = False


def run_forward(batch: PackedBatch | PersistentStep | PlanSource, hidden_or_token_ids: np.ndarray,
                weights: ModelWeights, caches: ModelCaches, options: ForwardOptions | None = None, *,
                tp: RankContext = WHOLE_GROUP, tables: PersistentTables | None = None,
                **deprecated: Any) -> ForwardResult:
    """Run ``options.layers`` (default: every layer of the config, in order) and the head.

    hidden_or_token_ids: [P] int token ids (embedded; padding rows zeroed), or [P, hc, D] / [P, D] fp32 hidden
    rows (a [P, D] input is copied to every stream); padding rows must be zero (not checked here).
    Token ids for hash layers come from an int input, else from ``batch.token_ids``.
    options: :class:`ForwardOptions` (default all defaults). tp: one rank's view of a TP group
    (:class:`RankContext`; see :func:`dspark_kernels.model.layer.run_layer`); the LM head is then split by
    vocabulary and its shards gathered too. The keywords of earlier versions (``precision=``, ``layers=``,
    ``logit_rows=``, ``backend=``, ``prepared=``, ``on_layer=``, ``caches_checked=``, ``rank=``, ``all_gather=``,
    ``attention=``) still work for one minor version, with a DeprecationWarning.
    batch: a full-form :class:`PackedBatch`, or a :class:`~dspark_abi.persistent.PersistentStep` with ``tables``,
    the persistent tables holding its delta (a device mirror after ``tables.apply(step)``, or the allocator's after
    ``commit``): the kernels then read ``tables`` at each request's slot (:class:`PlanSource`); or a
    :class:`PlanSource` already made of either (a TP group makes it once for all its ranks).
    Caches are written in place. Raises :class:`ABIError` (nothing touched) when anything does not fit.
    """
    source = batch if isinstance(batch, PlanSource) else PlanSource.of(batch, tables)
    batch = source.batch
    if deprecated:
        options, tp = _from_keywords(options, tp, deprecated)
    opts = ForwardOptions() if options is None else options
    prec = check_precision(opts.precision)
    rank, all_gather, backend = tp.rank, tp.all_gather, opts.backend
    cfg = batch.config
    run = list(range(cfg.num_layers)) if opts.layers is None else [int(i) for i in opts.layers]
    wanted = batch.logit_rows if opts.logit_rows is None else opts.logit_rows
    rows = np.zeros(0, np.int64) if wanted is None else np.asarray(wanted, dtype=np.int64).reshape(-1)
    inputs = np.asarray(hidden_or_token_ids)
    token_ids = inputs.astype(np.int64) if inputs.dtype.kind in "iu" else batch.token_ids
    _check(batch, inputs, token_ids, weights, caches, prec, run, rows, tp, opts.caches_checked)
    targets = {layer: k for k, layer in enumerate(cfg.dspark_target_layers)}   # layer -> feature slot
    d = cfg.hidden_size
    if batch.num_tokens == 0:   # an inactive group (PaddingPolicy.allow_inactive): no row, nothing written
        return ForwardResult(x_hc=np.zeros((0, cfg.hc_mult, d), np.float32), hidden=np.zeros((0, d), np.float32),
                             logit_rows=rows.astype(np.int32), logits=np.zeros((rows.size, cfg.vocab_size), np.float32),
                             sampled=np.full(rows.size, -1, np.int64),
                             target_hidden=np.zeros((0, len(targets) * d), np.float32) if targets else None,
                             target_hidden_hc_head=np.zeros((0, len(targets) * d), np.float32) if targets else None)
    plan = source.plan(rank=rank, precision=prec)
    stages = default_backend(backend)  # the registry's reference when no backend is given
    cache = PreparedWeightsCache(keep=weights.keep_layers) if opts.prepared is None else opts.prepared

    if inputs.dtype.kind in "iu":
        x_hc = np.repeat(weights.embed_rows(inputs)[:, None, :], cfg.hc_mult, axis=1)
        x_hc[plan.request < 0] = 0.0  # padding rows carry zero hidden state
    elif inputs.ndim == 2:
        x_hc = np.repeat(inputs.astype(np.float32)[:, None, :], cfg.hc_mult, axis=1)
    else:
        x_hc = np.array(inputs, dtype=np.float32)
    head = weights.head()
    features = np.zeros((x_hc.shape[0], len(targets) * d), np.float32) if targets else None
    features_hc_head = None if features is None else np.zeros_like(features)
    for done, i in enumerate(run, start=1):
        x_hc = run_layer(plan, i, x_hc, weights.layer(i), caches[i], token_ids=token_ids, all_gather=all_gather,
                         backend=stages, prepared=cache)
        if features is not None and features_hc_head is not None and i in targets:
            k = targets[i]
            features[:, k * d:(k + 1) * d] = target_features(x_hc, head, cfg, precision=prec, stages=stages)
            features_hc_head[:, k * d:(k + 1) * d] = target_features(x_hc, head, cfg, precision=prec, stages=stages,
                                                                     reduction="hc_head")
        if opts.on_layer is not None:
            opts.on_layer(done, len(run))

    hidden = stages.final_hidden(x_hc, head, cfg, precision=prec)
    if plan.rank is None or batch.tp_size == 1 or all_gather is None:  # _check: a rank of a group has a gather
        logits = stages.logits_for_rows(hidden, rows, head.head)
    else:  # vocabulary shards, padded to equal width with -inf, gathered along the vocabulary
        width = vocab_shard_width(cfg.vocab_size, batch.tp_size)
        shard = np.full((rows.size, width), -np.inf, dtype=np.float32)
        part = stages.logits_for_rows(hidden, rows, head.head[vocab_shard(cfg.vocab_size, batch.tp_size, plan.rank)])
        shard[:, : part.shape[1]] = part
        logits = np.ascontiguousarray(all_gather(np.ascontiguousarray(shard.T)).T[:, : cfg.vocab_size])
    return ForwardResult(x_hc=x_hc, hidden=hidden, logit_rows=rows.astype(np.int32), logits=logits,
                         sampled=stages.greedy(logits, rows), target_hidden=features,
                         target_hidden_hc_head=features_hc_head)


def _from_keywords(options: ForwardOptions | None, tp: RankContext, keywords: dict[str, Any]
                   ) -> tuple[ForwardOptions, RankContext]:
    """The options and rank context of :func:`run_forward`'s deprecated keywords (one minor version)."""
    fields = {f.name for f in attrs.fields(ForwardOptions)}
    unknown = sorted(set(keywords) - fields - {"rank", "all_gather", "attention"})
    if unknown:
        raise TypeError(f"run_forward() got an unexpected keyword argument {unknown[0]!r}")
    if options is not None or tp is not WHOLE_GROUP:
        raise TypeError("run_forward(): pass either ForwardOptions / RankContext or the deprecated keywords")
    warnings.warn(f"run_forward({', '.join(f'{k}=' for k in sorted(keywords))}) is deprecated: pass "
                  "ForwardOptions(...) and tp=RankContext(rank, all_gather)", DeprecationWarning, stacklevel=3)
    chosen = {k: v for k, v in keywords.items() if k in fields}
    if keywords.get("attention") is not None and chosen.get("backend") is None:  # the backend's older name
        chosen["backend"] = keywords["attention"]
    return ForwardOptions(**chosen), RankContext(keywords.get("rank"), keywords.get("all_gather"))


def _check(batch: PackedBatch, inputs: np.ndarray, token_ids: np.ndarray | None, weights: ModelWeights,
           caches: ModelCaches, precision: str, run: list[int], rows: np.ndarray, tp: RankContext,
           caches_checked: bool) -> None:
    cfg, p = batch.config, batch.padded_rows
    issues: list[Issue] = []
    if weights.config != cfg:
        issues.append(Issue("config.mismatch", "weights.config", "weights belong to another config",
                            expected=cfg.name, actual=weights.config.name))
    bad = [i for i in run if not 0 <= i < cfg.num_layers]
    if bad or len(set(run)) != len(run):
        issues.append(Issue("config.mismatch", "layers", "layers must be distinct indices of the config's schedule",
                            expected=f"distinct values in [0, {cfg.num_layers})", actual=run))
    elif not isinstance(caches, ModelCaches):
        issues.append(Issue("config.mismatch", "caches", "caches must be a ModelCaches",  # type: ignore[unreachable]  # runtime guard
                            expected="ModelCaches", actual=type(caches).__name__))
    elif not caches_checked:
        issues += caches.issues_for(batch, precision, run)
    hc, d = cfg.hc_mult, cfg.hidden_size
    if inputs.dtype.kind in "iu":
        if inputs.shape != (p,):
            issues.append(Issue("geometry.rows", "token_ids", "token ids need one entry per group row",
                                expected=[p], actual=list(inputs.shape)))
        elif inputs.size and (inputs.min() < 0 or inputs.max() >= cfg.vocab_size):
            issues.append(Issue("token_ids.range", "token_ids", "token ids must be vocabulary ids",
                                expected=f"[0, {cfg.vocab_size})", actual=[int(inputs.min()), int(inputs.max())]))
    elif inputs.dtype.kind != "f":
        issues.append(Issue("array.dtype", "hidden", "hidden rows must be float (or token ids int)",
                            expected="float32", actual=str(inputs.dtype)))
    elif inputs.shape not in ((p, hc, d), (p, d)):
        issues.append(Issue("geometry.rows" if inputs.shape[:1] != (p,) else "array.shape", "hidden",
                            "hidden rows must be [P, hc, D] or [P, D]", expected=[p, hc, d], actual=list(inputs.shape)))
    if token_ids is None and any(i < cfg.moe.num_hash_layers for i in run):
        issues.append(Issue("array.missing", "token_ids", "hash-routed layers need token ids",
                            expected=f"[{p}] int", actual="None"))
    if rows.size and (rows.min() < -1 or rows.max() >= batch.num_tokens):
        issues.append(Issue("logits.range", "logit_rows", "logit rows must be live rows or -1",
                            expected=f"-1 or [0, {batch.num_tokens})", actual=rows.tolist()))
    rank_issues = batch.policy.rank_issues(tp.rank, whole_group=True)
    issues += rank_issues
    if tp.rank is not None and not rank_issues and batch.tp_size > 1 and tp.all_gather is None:
        issues.append(Issue("rank.index", "all_gather", "a rank view of a TP group needs an all_gather",
                            expected="a collective", actual=None))
    if issues:
        raise ABIError(issues)
