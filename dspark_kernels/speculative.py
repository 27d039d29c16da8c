"""The greedy speculative loop: prefill, then build -> forward -> accept -> commit, one dispatch per step.

Each step packs, for every unfinished request, either its next prefill chunk (logits at the last row of the final
chunk only) or a verify request ``[anchor, d_1 .. d_k]`` whose drafts come from a :class:`Drafter`; prefill chunks
of other requests ride in the same dispatches as the verify requests (mixed steps). After the forward, the
acceptance stage (:func:`dspark_kernels.model.accept.accept_greedy`) keeps each verify request's longest agreeing
prefix plus the bonus token, and ``BatchBuilder.commit(batch, accepted=...)`` advances every request by exactly
the rows it keeps. Rows written for rejected drafts are rewritten by the request's next step before any read.

Greedy only: the loop yields exactly the tokens of plain greedy decoding (:func:`greedy_decode`, one token per
step); temperature sampling is out of scope.

Two kinds of drafter plug in. A :class:`Drafter` proposes drafts from the token contexts alone; this module ships
test and demo ones: :class:`ReplayDrafter` (replays a known token stream: always right), :class:`RandomDrafter`
(seeded uniform ids) and :class:`FixedHitsDrafter` (right on exactly the first ``hits`` drafts of each block). A
:class:`ConditionedDrafter` (the DSpark drafter, ``dspark_kernels.drafter.DSparkDrafter``) conditions on the
target: it is attached to the allocator's persistent tables (its window cache lives in their ``ori`` pool, spec
5.10), after every commit the loop hands it the target features of the rows just committed (every row of a
prefill chunk, the accepted rows of a verify request; DeepSeek's mean reduction unless the caller explicitly asks
for ``hc_head``), before each verify step is built it drafts a block per request, and a finished request is
released. The
verify width is fixed (``K``) or adaptive from the drafter's confidence head (:func:`draft_widths`).
:func:`check_deployment` checks a deployment's choices once, before the first step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import numpy as np

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, Issue, ModelConfig, PackedBatch, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.persistent import PersistentStep, PersistentTables
from dspark_kernels.model.accept import Acceptance, greedy_matrix
from dspark_kernels.model.backends import Backend, BackendName, backend_issues, resolve_backend
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.numerics import PRECISIONS
from dspark_kernels.model.plan import PlanSource, StepRows
from dspark_kernels.model.weights import ModelWeights

__all__ = [
    "FEATURE_REDUCTIONS",
    "TABLE_FORMS",
    "TP_MODES",
    "ConditionedDrafter",
    "DraftBlock",
    "Drafter",
    "FixedHitsDrafter",
    "GenerateResult",
    "RandomDrafter",
    "ReplayDrafter",
    "StepRecord",
    "VerifyOutput",
    "check_deployment",
    "checkpoint_drafter_issues",
    "draft_widths",
    "generate",
    "greedy_decode",
    "rejected_rows",
]

TpMode = Literal["single", "threads", "distributed"]
#: How a step's forward runs a TP group: one process ("single"), one thread per rank, one process per rank.
TP_MODES: tuple[TpMode, ...] = ("single", "threads", "distributed")
TableForm = Literal["persistent", "full"]
#: The block-table form the loops run on: ``"persistent"`` (spec 5.9: ``build_step()``, the kernels read the
#: persistent tables through a mirror advanced by each step's delta; the default) or ``"full"`` (``build()``).
TABLE_FORMS: tuple[TableForm, ...] = ("persistent", "full")
FeatureReduction = Literal["mean", "hc_head"]
#: How the loop reduces a target layer's hc streams to the drafter's features: ``"mean"`` (DeepSeek's definition,
#: what the checkpoint's drafter was trained on) or ``"hc_head"`` (upstream pypto-lib's; only when asked for
#: explicitly, ``allow_hc_head=True``).
FEATURE_REDUCTIONS: tuple[FeatureReduction, ...] = ("mean", "hc_head")


# ---------------------------------------------------------------------------------------------- drafters
@runtime_checkable
class Drafter(Protocol):
    """Proposes drafts for the verify requests of one step.

    request_ids: [R] ids; contexts: per request its tokens so far (prompt, generated tokens, the anchor last);
    max_drafts: [R] the most drafts each request may get this step. Returns R int arrays of at most that many
    ids each (fewer is fine, none gives a verify request of width 1).
    """

    def propose(self, request_ids: Sequence[int], contexts: Sequence[np.ndarray], max_drafts: Sequence[int]
                ) -> list[np.ndarray]: ...


class DraftBlock(Protocol):
    """What :meth:`ConditionedDrafter.draft` returns (``dspark_kernels.drafter.DraftOutput``)."""

    @property
    def tokens(self) -> np.ndarray:
        """[R, B] int64 drafts d_1 .. d_B of each request (B = the config's dspark_block_size)."""

    @property
    def confidence(self) -> np.ndarray:
        """[R, B] float32 the confidence head's raw logit (no sigmoid) for each draft."""


@runtime_checkable
class ConditionedDrafter(Protocol):
    """A drafter that conditions on the target model (the DSpark drafter).

    observe(request_ids, positions, features): the rows each request committed since its last observe, in
    order: positions[i] [n_i] int64 contiguous absolute positions, features[i] [n_i, T * D] float32 the target
    features of those rows (the mean of each target layer's output hc streams unless the loop was told
    otherwise). draft(request_ids, anchors [R] int64, anchor_positions [R] int64): a block of drafts after each
    request's anchor (the last generated token, not yet committed, at its anchor position). release(request_ids):
    the requests are finished; the drafter drops their state. attach(tables): the persistent tables of the
    allocator the steps are built on (``BlockAllocator.persistent``), called before the first observe: the DSpark
    drafter's window lives in their ``ori`` pool (spec 5.10), so the loop observes a step's committed rows and
    drafts for a request before that request's next step is built.
    """

    def attach(self, tables: PersistentTables) -> None: ...

    def observe(self, request_ids: Sequence[int], positions: Sequence[np.ndarray],
                features: Sequence[np.ndarray]) -> None: ...

    def draft(self, request_ids: Sequence[int], anchors: np.ndarray, anchor_positions: np.ndarray
              ) -> DraftBlock: ...

    def release(self, request_ids: Sequence[int]) -> None: ...


def draft_widths(confidence: np.ndarray, K: int, threshold: float | None = None, min_drafts: int = 1
                 ) -> np.ndarray:
    """[R] int64 drafts to verify per request: ``K`` (fixed width), or with a ``threshold`` the adaptive width.

    Adaptive rule (DeepSeek's DSpark paper, vLLM's adaptive verification): drafts are kept from the first while
    their raw confidence logit is >= ``threshold`` (the first draft below it ends the run: a later draft is only
    accepted if every earlier one is), at least ``min_drafts`` and at most ``K``. confidence: [R, B] float raw
    logits (no sigmoid: a threshold t on the logit is sigmoid(t) on the probability; t = 0 is p = 0.5).

    >>> draft_widths(np.array([[2.0, 0.5, -1.0, 3.0], [-2.0, 1.0, 1.0, 1.0]]), 4, threshold=0.0).tolist()
    [2, 1]
    """
    confidence = np.asarray(confidence, dtype=np.float64)
    rows = confidence.shape[0]
    if threshold is None:
        return np.full(rows, K, np.int64)
    kept = np.cumprod(confidence[:, :K] >= threshold, axis=1).sum(axis=1)
    widths: np.ndarray = np.clip(kept, min(min_drafts, K), K).astype(np.int64)
    return widths


@attrs.define
class ReplayDrafter:
    """Replays a known token stream per request (``streams[id]``: the whole sequence, prompt included): its drafts
    are the stream's next tokens after the context, so every draft is right when the stream is the target's
    greedy continuation."""

    streams: Mapping[int, np.ndarray]

    def propose(self, request_ids: Sequence[int], contexts: Sequence[np.ndarray], max_drafts: Sequence[int]
                ) -> list[np.ndarray]:
        return [np.asarray(self.streams[int(r)], dtype=np.int64)[len(c): len(c) + int(k)]
                for r, c, k in zip(request_ids, contexts, max_drafts, strict=True)]


@attrs.define
class RandomDrafter:
    """Uniformly random drafts from a seeded generator (almost always rejected: the worst case)."""

    vocab_size: int
    seed: int = 0
    _rng: np.random.Generator = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def propose(self, request_ids: Sequence[int], contexts: Sequence[np.ndarray], max_drafts: Sequence[int]
                ) -> list[np.ndarray]:
        return [self._rng.integers(0, self.vocab_size, int(k)) for k in max_drafts]


@attrs.define
class FixedHitsDrafter:
    """Right on exactly the first ``hits`` drafts of each block and wrong on the rest: replays ``streams`` for
    ``hits`` tokens, then proposes the stream's token + 1 (mod ``vocab_size``), which the target rejects."""

    streams: Mapping[int, np.ndarray]
    hits: int
    vocab_size: int

    def propose(self, request_ids: Sequence[int], contexts: Sequence[np.ndarray], max_drafts: Sequence[int]
                ) -> list[np.ndarray]:
        out = []
        for r, c, k in zip(request_ids, contexts, max_drafts, strict=True):
            right = np.asarray(self.streams[int(r)], dtype=np.int64)[len(c): len(c) + int(k)]
            wrong = np.arange(right.size) >= self.hits
            out.append(np.where(wrong, (right + 1) % self.vocab_size, right))
        return out


# ---------------------------------------------------------------------------------------------- results
@attrs.frozen(eq=False)
class VerifyOutput:
    """One verify request's result in one step."""

    request_id: int
    position: int
    """Position of the anchor (the request's cached length before the step)."""
    width: int
    """Rows verified: the anchor and ``width - 1`` drafts."""
    accepted: int
    """Rows committed, ``1 + len(accepted_tokens)``: the anchor and the accepted drafts."""
    accepted_tokens: np.ndarray
    """[accepted - 1] int64 the drafts accepted (generated tokens)."""
    bonus: int
    """The target's greedy token after the last accepted row (generated; the next anchor)."""
    target_hidden: np.ndarray | None
    """[accepted, T * D] float32 DSpark target features of the accepted rows only, in the reduction the loop feeds
    its drafter (the mean of the hc streams by default; None without target layers)."""


@attrs.frozen(eq=False)
class StepRecord:
    """What one dispatch held and what it kept."""

    batch: StepRows
    """The step's rows and request record: the full-form batch, or the persistent step itself (its own
    :class:`~dspark_kernels.model.plan.StepRows`; no full form is made per step)."""
    prefill_ids: tuple[int, ...]
    """Requests that sent a prefill chunk."""
    verify: tuple[VerifyOutput, ...]
    accepted: np.ndarray
    """[R] int64 rows committed per request of the batch (all rows of a prefill chunk)."""
    seconds: float = 0.0
    """Wall time of the step: drafting, build, forward, acceptance, commit and the drafter's observe."""

    @property
    def mixed(self) -> bool:
        """Prefill chunks and verify requests in the same dispatch."""
        return bool(self.prefill_ids) and bool(self.verify)


@attrs.frozen(eq=False)
class GenerateResult:
    """Tokens generated per request and the acceptance statistics of the run."""

    tokens: dict[int, np.ndarray]
    """request id -> [max_new_tokens] int64 generated tokens (fewer only at the position limit)."""
    accepted_lengths: dict[int, list[int]]
    """request id -> tokens each of its verify steps generated (accepted drafts + the bonus)."""
    steps: list[StepRecord]
    caches: ModelCaches
    allocator: BlockAllocator
    margins: dict[int, np.ndarray] | None = None
    """(plain decoding only) request id -> [n] top-2 logit margin at each generated token."""
    logit_scales: dict[int, np.ndarray] | None = None
    """(plain decoding only) request id -> [n] max |logit| of the row each token was chosen from (the scale of
    an fp32 summation-order difference in that row)."""

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens per verify step over every request (1.0 = no draft ever accepted; NaN without steps)."""
        lengths = [n for v in self.accepted_lengths.values() for n in v]
        return float(np.mean(lengths)) if lengths else float("nan")

    def _verified(self) -> tuple[np.ndarray, np.ndarray]:
        """([S] drafts verified, [S] drafts accepted) of every verify request of the run."""
        outputs = [v for step in self.steps for v in step.verify]
        return (np.array([v.width - 1 for v in outputs], np.int64),
                np.array([v.accepted - 1 for v in outputs], np.int64))

    @property
    def acceptance_by_position(self) -> np.ndarray:
        """[D] float64: entry i - 1 is the fraction of the verify requests that verified a draft i whose draft i
        was accepted (D = the widest verify request's drafts; draft i is accepted only if drafts 1..i-1 were)."""
        drafted, accepted = self._verified()
        positions = np.arange(1, int(drafted.max(initial=0)) + 1)
        tried = (drafted[None, :] >= positions[:, None]).sum(axis=1)
        kept = (accepted[None, :] >= positions[:, None]).sum(axis=1)
        fraction: np.ndarray = kept / np.maximum(tried, 1)
        return fraction

    @property
    def verify_rows_per_token(self) -> float:
        """Rows the verify steps computed per token they generated: 1.0 when every draft is accepted, K + 1 when
        none is (NaN without verify steps)."""
        drafted, accepted = self._verified()
        return float((drafted + 1).sum() / (accepted + 1).sum()) if drafted.size else float("nan")

    @property
    def step_seconds(self) -> np.ndarray:
        """[steps] float64 wall time of every step (prefill, mixed and verify steps alike)."""
        return np.array([s.seconds for s in self.steps], np.float64)

    def summary(self) -> dict[str, Any]:
        """The run's figures as plain JSON values: steps (all, mixed, verify requests), tokens generated, mean
        accepted length, per-position acceptance, verify rows per generated token, wall time per step (mean and
        max) and in total; NaN figures (no verify step) become None."""
        seconds = self.step_seconds

        def number(x: float) -> float | None:
            return None if math.isnan(x) else float(x)

        return {"steps": len(self.steps), "mixed_steps": sum(s.mixed for s in self.steps),
                "verify_requests": int(self._verified()[0].size),
                "tokens": int(sum(t.size for t in self.tokens.values())),
                "mean_accepted_length": number(self.mean_accepted_length),
                "acceptance_by_position": [float(a) for a in self.acceptance_by_position],
                "verify_rows_per_token": number(self.verify_rows_per_token),
                "seconds_per_step": number(float(seconds.mean())) if seconds.size else None,
                "max_step_seconds": float(seconds.max()) if seconds.size else None,
                "seconds": float(seconds.sum())}


def rejected_rows(batch: StepRows, accepted: np.ndarray) -> np.ndarray:
    """[P] bool: group rows the step wrote at positions its requests did not commit (rows beyond each request's
    ``accepted`` count); their cache rows must never be read before the request's next step rewrites them."""
    mask = np.zeros(batch.padded_rows, bool)
    mask[batch.requests.uncommitted_rows(accepted)] = True
    return mask


# ---------------------------------------------------------------------------------------------- forward
@attrs.frozen(eq=False)
class _Forward:
    """logit_rows [M] int32 (-1 inactive), sampled [M] int64, logits [M, V] fp32; target_hidden and
    target_hidden_hc_head [P, T*D] fp32 (the mean and the hc_head reductions) or None."""

    logit_rows: np.ndarray
    sampled: np.ndarray
    logits: np.ndarray
    target_hidden: np.ndarray | None
    target_hidden_hc_head: np.ndarray | None = None

    def features(self, reduction: FeatureReduction) -> np.ndarray | None:
        """The target features in ``reduction``."""
        return self.target_hidden if reduction == "mean" else self.target_hidden_hc_head


@attrs.define
class _Runner:
    """Runs one step's forward in a TP mode on the chosen table form and keeps ``caches`` current.

    tables: ``"persistent"``: steps come from ``BatchBuilder.build_step()`` and the kernels read the persistent
    tables through a mirror the runner keeps (``mirror``, loaded once from the allocator's tables and advanced by
    each step's delta before its forward, as a device table is; a distributed group keeps one per rank process
    instead); ``"full"``: ``build()`` batches with their own tables."""

    weights: ModelWeights
    caches: ModelCaches
    mode: TpMode
    backend: BackendName
    precision: str
    allocator: BlockAllocator
    tables: TableForm = "persistent"
    stages: Backend = attrs.field(init=False)
    """The backend's stages (its acceptance stage runs after each forward)."""
    mirror: PersistentTables | None = attrs.field(init=False, default=None)
    """The host mirror of the persistent tables (single and threads modes)."""
    group: Any = attrs.field(init=False, default=None)
    """The distributed mode's :class:`~dspark_kernels.model.tp.RankGroup` (persistent form), started at the first
    step."""
    drafter: tuple[Any, ModelWeights, str] | None = attrs.field(init=False, default=None)
    """(DrafterRecipe, target weights, feature reduction) of a DSpark drafter that runs in the group's rank processes
    (:func:`_drafter_in_ranks`); attached when the group starts."""

    def __attrs_post_init__(self) -> None:
        self.stages = resolve_backend(self.backend, self.precision)
        if self.tables == "persistent":
            self.mirror = self.allocator.persistent.copy()

    def build(self, builder: BatchBuilder) -> PackedBatch | PersistentStep:
        """The queued requests' step in the runner's table form."""
        return builder.build_step() if self.tables == "persistent" else builder.build()

    def forward(self, step: PackedBatch | PersistentStep) -> tuple[StepRows, _Forward]:
        """The step's rows (:class:`StepRows`: never a persistent step's full form) and its forward at its own logit
        rows; ``caches`` hold its writes afterwards. A persistent step is validated once, by the mirror's
        ``apply`` (:func:`~dspark_abi.persistent.check_step`'s incremental proof); the forward then checks only
        that its slots are current, O(R)."""
        tokens = step.token_ids
        if tokens is None:   # the loop always gives token ids; a batch without them cannot be verified
            raise ABIError([Issue("array.missing", "token_ids", "a step of the loop needs token ids",
                                  expected="[P] int64", actual="None")])
        from dspark_kernels.model import tp

        if self.mode == "distributed" and isinstance(step, PersistentStep):
            return self._distributed_step(step, tokens)
        tables = None
        if isinstance(step, PersistentStep) and self.mirror is not None:
            self.mirror.grow(self.allocator.persistent.slots)
            self.mirror.apply(step)             # the delta, before the forward reads the tables
            tables = self.mirror
        if self.mode == "single":
            from dspark_kernels.api import prefill

            res = prefill(step, tokens, self.weights, self.caches, tables=tables, backend=self.backend,
                          precision=self.precision)
            return res.batch, _Forward(res.logit_rows, res.sampled, res.logits, res.target_hidden,
                                       res.target_hidden_hc_head)
        source = PlanSource.of(step, tables)    # once per step, for every rank: the step's own rows
        if self.mode == "threads":
            result = tp.run_tp_inprocess(source, tokens, self.weights, self.caches, precision=self.precision,
                                         backend=self.backend)[0].result
        else:   # the full form (a persistent step runs on the rank processes' mirrors: _distributed_step)
            ranks = tp.launch(tp.DistributedJob(step, tokens, self.weights, self.caches,
                                                precision=self.precision, backend=self.backend))
            self._take_caches(ranks[0].caches)
            result = ranks[0].result
        return source.batch, _Forward(result.logit_rows, result.sampled, result.logits, result.target_hidden,
                                      result.target_hidden_hc_head)

    def _distributed_step(self, step: PersistentStep, tokens: np.ndarray) -> tuple[StepRows, _Forward]:
        """A persistent step on the rank processes: each applies the delta to its own mirror (its one check); the
        host keeps the step's own rows."""
        from dspark_kernels.model import tp

        if self.group is None:
            self.group = tp.RankGroup(step.policy.tp_size, self.allocator.persistent, attention=self.backend,
                                      precision=self.precision)
            if self.drafter is not None:
                self.group.attach_drafter(*self.drafter)
        batch = step
        ranks = self.group.run(tp.DistributedJob(step, tokens, self.weights, self.caches, precision=self.precision,
                                                 backend=self.backend), self.allocator.persistent.slots)
        self._take_caches(ranks[0].caches)
        r = ranks[0].result
        return batch, _Forward(r.logit_rows, r.sampled, r.logits, r.target_hidden, r.target_hidden_hc_head)

    def _take_caches(self, written: ModelCaches) -> None:
        for name, array in self.caches.arrays().items():      # the rank processes wrote their own copies
            array[...] = written.arrays()[name]

    def close(self) -> None:
        """Stop the distributed mode's rank processes, if any."""
        if self.group is not None:
            self.group.close()
            self.group = None


@attrs.define
class _GroupDrafter:
    """The caller's side of a DSpark drafter that runs in the distributed runner's rank processes (a
    :class:`ConditionedDrafter`): every rank holds its own drafter (TP over the group, ``tp_mode="distributed"``)
    and its last step's target features, so observe sends only which rows each request committed (its positions;
    ``features`` must be None) and draft returns rank 0's ``DraftOutput``. Errors a rank's drafter raises
    (``drafter.gap``, ...) arrive as raised, nothing written."""

    runner: _Runner

    def _group(self) -> Any:
        if self.runner.group is None:   # no step ran yet: no request was observed
            raise ABIError([Issue("drafter.unknown_request", "request_ids", "no step has run on the TP group yet",
                                  expected="a step before the drafter is used", actual="no group",
                                  fix="observe the request's prompt (its target features) first")])
        return self.runner.group

    def attach(self, tables: PersistentTables) -> None:
        """Nothing to attach here: each rank attaches its drafter to its own mirror of the persistent tables,
        which equals the allocator's after every step. So ``tables`` must be the runner's allocator's
        (``config.mismatch`` otherwise: the ranks could not mirror other tables)."""
        if tables is not self.runner.allocator.persistent:
            raise ABIError([Issue("config.mismatch", "tables", "a drafter in the TP group's rank processes reads the "
                                  "ranks' mirrors of the loop allocator's persistent tables", expected="the "
                                  "allocator's persistent tables", actual="other tables",
                                  fix="attach allocator.persistent")])

    def observe(self, request_ids: Sequence[int], positions: Sequence[np.ndarray],
                features: Sequence[np.ndarray] | None = None) -> None:
        """The rows each request committed in the last step (``positions[i]``: contiguous, from its first row's
        position); their features are the ranks' own (``features`` None; arrays are refused: they would be
        ignored)."""
        pos = [np.asarray(p, np.int64).reshape(-1) for p in positions]
        issues = [] if features is None else [
            Issue("config.invalid", "features", "the drafter runs in the rank processes, which hold the step's "
                  "target features", expected=None, actual=f"{len(features)} arrays", fix="pass features=None")]
        issues += [Issue("positions.not_contiguous", "positions", "a request's committed rows are contiguous",
                         index=i, request=int(r), expected="start, start + 1, ...", actual=p.tolist())
                   for i, (r, p) in enumerate(zip(request_ids, pos, strict=True))
                   if p.size == 0 or np.any(np.diff(p) != 1)]
        if issues:
            raise ABIError(issues)
        self._group().drafter_observe(request_ids, [int(p[0]) for p in pos], [p.size for p in pos])

    def draft(self, request_ids: Sequence[int], anchors: np.ndarray, anchor_positions: np.ndarray) -> DraftBlock:
        out: DraftBlock = self._group().drafter_draft(request_ids, anchors, anchor_positions)
        return out

    def release(self, request_ids: Sequence[int]) -> None:
        self._group().drafter_release(request_ids)


def _drafter_in_ranks(runner: _Runner, drafter: ConditionedDrafter | None, reduction: FeatureReduction
                      ) -> ConditionedDrafter | None:
    """The drafter the loop talks to: a :class:`_GroupDrafter` when the steps run on a distributed rank group
    (persistent tables) and ``drafter`` is a DSpark drafter that knows how it was made (``recipe``): its copies
    then run in the rank processes and target features never leave them. Otherwise ``drafter`` itself, in the
    calling process (other drafters, the full table form, single and threads modes)."""
    from dspark_kernels.drafter import DSparkDrafter

    if (runner.mode != "distributed" or runner.tables != "persistent" or not isinstance(drafter, DSparkDrafter)
            or drafter.recipe is None):
        return drafter
    runner.drafter = (drafter.recipe, drafter.target, reduction)
    return _GroupDrafter(runner)


def _advance_group_drafter(drafter: _GroupDrafter, committed: list[tuple[int, int, int, int]],
                           finished: Callable[[int], bool], observed: set[int]) -> None:
    """:func:`_advance_drafter` for a drafter in the rank processes: the committed rows go as positions alone (the
    ranks hold the features), then the finished requests are released."""
    going = [c for c in committed if not finished(c[0])]
    if going:
        drafter.observe([i for i, *_ in going], [np.arange(p, p + n, dtype=np.int64) for _, p, _, n in going])
        observed.update(i for i, *_ in going)
    done = sorted(i for i, *_ in committed if finished(i) and i in observed)
    if done:
        drafter.release(done)
        observed.difference_update(done)


def _runner(config: ModelConfig, weights: ModelWeights, caches: ModelCaches | None, allocator: BlockAllocator | None,
            lengths: Sequence[int], tp_mode: TpMode, backend: BackendName, precision: str, slack: int,
            tables: TableForm = "persistent") -> tuple[_Runner, BlockAllocator]:
    issues = backend_issues(backend, precision) if precision in PRECISIONS else [
        Issue("config.invalid", "precision", "unknown precision", expected=list(PRECISIONS), actual=repr(precision))]
    if tp_mode not in TP_MODES:
        issues.append(Issue("config.invalid", "tp_mode", "unknown TP mode", expected=list(TP_MODES),
                            actual=repr(tp_mode)))
    if tables not in TABLE_FORMS:
        issues.append(Issue("config.invalid", "tables", "unknown table form", expected=list(TABLE_FORMS),
                            actual=repr(tables)))
    if issues:
        raise ABIError(issues)
    if allocator is None:
        allocator = BlockAllocator(config, pool_blocks_for(config, list(lengths), slack=slack))
    if caches is None:
        caches = ModelCaches.allocate(config, allocator.pool_blocks, precision=precision)
    return _Runner(weights, caches, tp_mode, backend, precision, allocator, tables), allocator


def _check_counts(values: Mapping[str, tuple[object, int]]) -> None:
    """``config.invalid`` for every argument that is not an int of at least its minimum (before any work)."""
    issues = [Issue("config.invalid", name, f"{name} must be an integer >= {low}", expected=f">= {low}",
                    actual=repr(value))
              for name, (value, low) in values.items()
              if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low]
    if issues:
        raise ABIError(issues)


def _prompts(prompts: Sequence[Sequence[int] | np.ndarray], cached: Sequence[int] | None, vocab: int,
             limit: int) -> tuple[list[np.ndarray], list[int]]:
    arrays = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    done = [0] * len(arrays) if cached is None else [int(c) for c in cached]
    issues = [Issue("token_ids.range", "prompts", "prompt tokens must be vocabulary ids", index=i,
                    expected=f"[0, {vocab})", actual=[int(a.min()), int(a.max())])
              for i, a in enumerate(arrays) if a.size and (a.min() < 0 or a.max() >= vocab)]
    issues += [Issue("geometry.rows", "prompts", "every prompt needs at least one new token", index=i,
                     expected=">= 1 token", actual=0) for i, a in enumerate(arrays) if a.size == 0]
    if len(done) != len(arrays):
        issues.append(Issue("geometry.rows", "cached", "one cached length per prompt", expected=len(arrays),
                            actual=len(done)))
    else:
        issues += [Issue("positions.out_of_range", "prompts", "the prompt does not fit the model's positions",
                         index=i, expected=f"cached + prompt tokens <= max_position_embeddings = {limit}",
                         actual=c + a.size, fix=f"shorten the prompt to at most {limit - c} tokens")
                   for i, (a, c) in enumerate(zip(arrays, done, strict=True)) if c + a.size > limit]
    if issues:
        raise ABIError(issues)
    return arrays, done


# ---------------------------------------------------------------------------------------------- start-up checks
#: vLLM #41834: K = 7 drafts on a checkpoint trained with dspark_block_size = 5 accepted 4.4 % of drafts (mean
#: accepted length 1.31) against 34.7 % (2.74) at K = 5: drafts past the trained block are noise.
BLOCK_SIZE_EVIDENCE = "vLLM #41834: K = 7 on a block-5 checkpoint accepted 4.4 % of drafts, 34.7 % at K = 5"
#: The prefix of the DSpark drafter's tensors in a checkpoint (shards 46-48 of DeepSeek-V4-Flash-DSpark).
DRAFTER_PREFIX = "mtp."
#: How to run without the DSpark drafter (the fix of a checkpoint without its tensors).
WITHOUT_SPECULATION = ("run without the DSpark drafter: a test drafter (dspark generate --drafter replay or "
                       "--drafter random) or plain greedy decoding (speculative.greedy_decode)")


def checkpoint_drafter_issues(folder: str | Path, config: ModelConfig | None = None) -> list[Issue]:
    """The DSpark drafter's tensors in the checkpoint in ``folder``: ``array.missing`` when it holds no ``mtp.*``
    tensor at all (the message names what is missing and how to run without speculation); with ``config``, every
    missing, mis-shaped or mis-stored drafter tensor (``DrafterWeights.from_safetensors``'s issues: shapes, FP8 /
    FP4 formats and their block scales)."""
    from dspark_kernels.model.drafter_weights import DrafterWeights
    from dspark_kernels.model.shard_index import read_header

    shards = sorted(Path(folder).glob("*.safetensors"))
    names = [n for shard in shards for n in read_header(shard)[0]]
    if any(n.startswith(DRAFTER_PREFIX) for n in names):
        if config is None:
            return []
        try:
            DrafterWeights.from_safetensors(folder, config)
        except ABIError as exc:
            return list(exc.issues)
        return []
    return [Issue("array.missing", f"{DRAFTER_PREFIX}*", f"the checkpoint holds no DSpark drafter tensors "
                  f"({DRAFTER_PREFIX}*: main_proj, the draft stages, the Markov and confidence heads; shards 46-48 "
                  "of DeepSeek-V4-Flash-DSpark)", expected=f"{DRAFTER_PREFIX}* tensors",
                  actual=f"{len(names)} tensors in {len(shards)} shard(s), none {DRAFTER_PREFIX}*",
                  fix=WITHOUT_SPECULATION)]


def check_deployment(config: ModelConfig, weights: ModelWeights, drafter: Drafter | ConditionedDrafter, K: int, *,
                     adaptive: float | None = None, min_drafts: int = 1, features: str = "mean",
                     allow_hc_head: bool = False, checkpoint: str | Path | None = None) -> list[Issue]:
    """Every problem of a speculative deployment, before the first step: one coded :class:`Issue` each, [] when
    the deployment is sound. Nothing is computed or changed.

    * the target's layers: the checkpoint's weights are of ``config`` (``config.mismatch``); a conditioned drafter
      needs target layers (``config.invalid``) and its own config must name the same target layers, block size,
      hidden size and vocabulary (``config.mismatch``);
    * ``K`` drafts per step not above ``dspark_block_size`` (``verify.drafts``; drafts past the trained block
      are noise: :data:`BLOCK_SIZE_EVIDENCE`), ``min_drafts`` within ``[0, K]`` and a finite ``adaptive``
      threshold (``config.invalid``); an adaptive width needs a conditioned drafter (its confidence head);
    * the drafter's ``main_proj`` (``weights.main_proj``, when the drafter has it) of shape [D, T * D]
      (``array.shape``); its window (``window_cache.window``, when it has a window cache) the ``ori`` pool's
      ``sliding_window`` (``config.invalid``): the window lives in the target's ``ori`` pool, which keeps the last
      ``sliding_window`` positions of each request mapped between its steps (spec 5.10), so a wider window would
      read unmapped rows and a narrower one would not be the window the drafter was trained on;
    * with ``checkpoint`` (a folder): its drafter tensors present, of the right shapes and stored formats
      (:func:`checkpoint_drafter_issues`);
    * the noise token a vocabulary id (``token_ids.range``);
    * the feature reduction: ``"mean"`` (DeepSeek's, what the drafter was trained on); ``"hc_head"`` (upstream
      pypto-lib's) only with ``allow_hc_head=True`` (``config.invalid``).
    A drafter may add its own checks (weights present, shapes and formats) through a ``deployment_issues(config)
    -> list[Issue]`` method.
    """
    issues: list[Issue] = []
    conditioned = isinstance(drafter, ConditionedDrafter)
    block = config.dspark_block_size
    if not conditioned and not isinstance(drafter, Drafter):
        issues.append(Issue("config.invalid", "drafter", "the drafter has neither propose() nor observe(), draft() "
                            "and release()", expected="a Drafter or a ConditionedDrafter",
                            actual=type(drafter).__name__))
    if weights.config != config:
        issues.append(Issue("config.mismatch", "weights", "the weights were built for another model config",
                            expected=config.name, actual=weights.config.name,
                            fix="load the weights with the config the loop runs"))
    if conditioned and not config.dspark_target_layers:
        issues.append(Issue("config.invalid", "dspark_target_layers", "a drafter that conditions on the target "
                            "needs target layers (dspark_target_layer_ids)", expected="a non-empty list",
                            actual="[]", fix="use a DSpark config (e.g. tiny-dspark, flash-dspark)"))
    drafter_config = getattr(drafter, "config", None)
    if conditioned and isinstance(drafter_config, ModelConfig):
        for key in ("dspark_target_layers", "dspark_block_size", "hidden_size", "vocab_size"):
            if getattr(drafter_config, key) != getattr(config, key):
                issues.append(Issue("config.mismatch", key, "the drafter was built for other target features",
                                    expected=getattr(config, key), actual=getattr(drafter_config, key),
                                    fix="build the drafter from the target's config and checkpoint"))
    if isinstance(K, int | np.integer) and not isinstance(K, bool) and block < K:
        issues.append(Issue("verify.drafts", "K", f"more drafts per verify request than the checkpoint's "
                            f"dspark_block_size ({BLOCK_SIZE_EVIDENCE})", expected=f"<= {block}", actual=int(K),
                            fix=f"verify at most K = {block} drafts per step"))
    if isinstance(K, int | np.integer) and not (0 <= min_drafts <= max(int(K), 0)):
        issues.append(Issue("config.invalid", "min_drafts", "min_drafts must lie in [0, K]", expected=f"[0, {K}]",
                            actual=min_drafts))
    if adaptive is not None:
        if not isinstance(adaptive, float | int | np.floating) or not math.isfinite(float(adaptive)):
            issues.append(Issue("config.invalid", "adaptive", "the adaptive width's threshold is a finite raw "
                                "confidence logit", expected="a finite float", actual=repr(adaptive)))
        if not conditioned:
            issues.append(Issue("config.invalid", "adaptive", "an adaptive width needs a drafter with a "
                                "confidence head (a ConditionedDrafter)", expected="a ConditionedDrafter",
                                actual=type(drafter).__name__, fix="use a fixed K with this drafter"))
    main_proj = getattr(getattr(drafter, "weights", None), "main_proj", None)
    want = (config.hidden_size, len(config.dspark_target_layers) * config.hidden_size)
    if conditioned and isinstance(main_proj, np.ndarray) and main_proj.shape != want:
        issues.append(Issue("array.shape", "mtp.0.main_proj.weight", "the drafter's main_proj does not take the "
                            "target's features", expected=list(want), actual=list(main_proj.shape),
                            fix="load the drafter of the target's checkpoint"))
    window = getattr(getattr(drafter, "window_cache", None), "window", None)
    if conditioned and isinstance(window, int) and window != config.sliding_window:
        issues.append(Issue("config.invalid", "window_cache.window", "the drafter's window is not the window the "
                            "target's ori pool keeps (its sliding_window): the window lives in that pool",
                            expected=config.sliding_window, actual=window,
                            fix="build the drafter from the target's config (its sliding_window)"))
    if checkpoint is not None:
        issues += checkpoint_drafter_issues(checkpoint, config)
    noise = config.dspark_noise_token_id
    if not 0 <= noise < config.vocab_size:
        issues.append(Issue("token_ids.range", "dspark_noise_token_id", "the drafter's noise token is not a "
                            "vocabulary id", expected=f"[0, {config.vocab_size})", actual=noise,
                            fix="use the dspark_noise_token_id of the checkpoint's config.json"))
    if features not in FEATURE_REDUCTIONS:
        issues.append(Issue("config.invalid", "features", "unknown target feature reduction",
                            expected=list(FEATURE_REDUCTIONS), actual=repr(features)))
    elif features == "hc_head" and conditioned and not allow_hc_head:
        issues.append(Issue("config.invalid", "features", "the drafter would be fed the hc_head reduction of the "
                            "target features; the checkpoint's drafter was trained on their mean (DeepSeek's "
                            "h.mean(dim=2))", expected="mean", actual="hc_head",
                            fix="feed the mean (the default), or pass allow_hc_head=True (dspark generate "
                            "--allow-hc-head) to feed hc_head knowingly"))
    own = getattr(drafter, "deployment_issues", None)
    if conditioned and callable(own):
        issues += list(own(config))
    return issues


# ---------------------------------------------------------------------------------------------- loops
def generate(prompts: Sequence[Sequence[int] | np.ndarray], weights: ModelWeights,
             drafter: Drafter | ConditionedDrafter, max_new_tokens: int, K: int, *, adaptive: float | None = None,
             min_drafts: int = 1, features: FeatureReduction = "mean", allow_hc_head: bool = False,
             tp: int = 1, tp_mode: TpMode = "single", backend: BackendName = "reference", precision: str = "fp32",
             prefill_chunk: int = 16, cached: Sequence[int] | None = None,
             allocator: BlockAllocator | None = None, caches: ModelCaches | None = None, slack: int = 8,
             on_step: Callable[[StepRecord, ModelCaches], None] | None = None,
             tables: TableForm = "persistent") -> GenerateResult:
    """Greedy speculative decoding of ``prompts`` (request ids 0..n-1) with ``drafter``, up to ``max_new_tokens``
    each, verifying at most ``K`` drafts per request and step.

    Every step is one dispatch: the next prefill chunk (at most ``prefill_chunk`` tokens) of each request still
    in prefill, and a verify request for every other unfinished request (its anchor and up to ``K`` drafts,
    fewer near ``max_new_tokens`` or the position limit). tp / tp_mode: the TP group size and how its ranks run
    (:data:`TP_MODES`); backend / precision as :func:`dspark_kernels.prefill`.
    In ``"distributed"`` mode on the persistent form a ``DSparkDrafter`` with a ``recipe`` (made by ``random`` or
    ``from_checkpoint``) runs in the rank processes (TP over the group): each rank keeps its step's target
    features, the loop sends only which rows were committed, ``VerifyOutput.target_hidden`` is None and the
    ``drafter`` object itself is never called. Other drafters, a DSpark drafter built from weights in memory and
    the full table form keep the drafter in this process, fed the features each step returns.

    drafter: a :class:`Drafter` (``propose`` from the token contexts) or a :class:`ConditionedDrafter` (the
    DSpark drafter): it is attached to the allocator's persistent tables first (its window lives in their ``ori``
    pool, spec 5.10); after every commit it observes the target features of the committed rows of every request
    that will draft again (all rows of a prefill chunk, the anchor and accepted drafts of a verify request), in
    the ``features`` reduction (``"mean"``; ``"hc_head"`` only with ``allow_hc_head=True``); before each step is
    built it drafts a block per verifying request (one packed call); finished requests are released (also when
    the loop fails). adaptive: verify each request's drafts while their raw confidence logit is >= this threshold, at
    least ``min_drafts`` and at most ``K`` (:func:`draft_widths`); None: always ``K`` (fewer near the ends).
    :func:`check_deployment` runs first: any issue raises :class:`ABIError` before anything is computed.
    cached / allocator / caches: requests whose first ``cached[i]`` tokens are already in ``caches`` (the
    allocator knows them; a conditioned drafter observes only the rows this loop computes); default fresh pools
    sized for the prompts and ``slack`` blocks more per pool.
    on_step(record, caches) runs after each commit (tests plant garbage in rejected rows there).
    tables: the block-table form of the steps (:data:`TABLE_FORMS`): ``"persistent"`` (default; every step is
    ``build_step()``'s, the kernels read the persistent tables, ``StepRecord.batch`` is the step's own rows) or
    ``"full"``; both give the same tokens.
    """
    cfg = weights.config
    _check_counts({"max_new_tokens": (max_new_tokens, 1), "K": (K, 0), "prefill_chunk": (prefill_chunk, 1),
                   "tp": (tp, 1), "min_drafts": (min_drafts, 0)})
    issues = check_deployment(cfg, weights, drafter, K, adaptive=adaptive, min_drafts=min_drafts,
                              features=features, allow_hc_head=allow_hc_head)
    if cached is not None and any(cached) and isinstance(drafter, ConditionedDrafter):
        issues.append(Issue("config.invalid", "cached", "a drafter that conditions on the target observes every "
                            "committed row from position 0; rows cached before the loop were never shown to it",
                            expected="no cached rows", actual=[int(c) for c in cached],
                            fix="prefill the whole prompt in the loop (cached=None)"))
    if issues:   # refused up front, not at the first step with drafts
        raise ABIError(issues)
    tokens, done = _prompts(prompts, cached, cfg.vocab_size, cfg.max_position_embeddings)
    runner, alloc = _runner(cfg, weights, caches, allocator, [t.size + max_new_tokens + K + 1 for t in tokens],
                            tp_mode, backend, precision, slack, tables)
    conditioned = drafter if isinstance(drafter, ConditionedDrafter) else None
    conditioned = _drafter_in_ranks(runner, conditioned, features)
    if conditioned is not None:     # its window lives in the allocator's ori pool: current after every commit
        conditioned.attach(alloc.persistent)
    builder = BatchBuilder(cfg, PaddingPolicy(tp_size=tp), alloc)
    generated: list[list[int]] = [[] for _ in tokens]
    fed = [0] * len(tokens)                       # prompt tokens sent so far (done[i] counts cached positions)
    lengths: dict[int, list[int]] = {i: [] for i in range(len(tokens))}
    limit = cfg.max_position_embeddings
    steps: list[StepRecord] = []
    observed: set[int] = set()                    # requests the conditioned drafter holds state for

    def finished(i: int) -> bool:
        return bool(generated[i]) and (len(generated[i]) >= max_new_tokens or done[i] >= limit)

    try:
        while True:
            t0 = time.perf_counter()
            pre = [i for i, t in enumerate(tokens) if fed[i] < t.size]
            live = [i for i in range(len(tokens)) if generated[i] and not finished(i)]
            if not pre and not live:
                break
            chunks = {i: min(prefill_chunk, tokens[i].size - fed[i]) for i in pre}
            for i in pre:
                final = fed[i] + chunks[i] == tokens[i].size
                builder.add(i, num_cached=done[i], num_new=chunks[i],
                            token_ids=tokens[i][fed[i]: fed[i] + chunks[i]], logits="last" if final else "none")
            room = [min(K, max_new_tokens - len(generated[i]) - 1, limit - done[i] - 1) for i in live]
            drafts = _drafts(drafter, conditioned, live, tokens, generated, done, room, K, adaptive, min_drafts,
                             cfg)
            verify_inputs = [np.concatenate([[generated[i][-1]], d]) for i, d in zip(live, drafts, strict=True)]
            for i, ids in zip(live, verify_inputs, strict=True):
                builder.add_verify(i, num_cached=done[i], token_ids=ids)
            step = runner.build(builder)
            batch, out = runner.forward(step)
            logit_rows, sampled, target = out.logit_rows, out.sampled, out.features(features)
            order = {int(r): k for k, r in enumerate(batch.requests.ids)}
            starts = np.asarray(batch.query_start_loc[:-1], dtype=np.int64)
            width = np.array([ids.size for ids in verify_inputs], np.int64)
            v_starts = np.array([starts[order[i]] for i in live], np.int64)
            outcome = _accept(runner.stages, verify_inputs, width, sampled, logit_rows, v_starts, batch.padded_rows)
            accepted = np.array([chunks.get(int(r), 0) for r in batch.requests.ids], np.int64)
            accepted[[order[i] for i in live]] = outcome.accepted
            builder.commit(step, accepted=accepted)
            # the committed rows per request: (request, first position, first group row, rows)
            committed = [(i, done[i], int(starts[order[i]]), chunks[i]) for i in pre]
            # results: the final prefill chunks sample the first generated token; verify requests keep their prefix
            last_row = {int(r): k for k, r in enumerate(logit_rows) if r >= 0}
            for i in pre:
                done[i] += chunks[i]
                fed[i] += chunks[i]
                if fed[i] == tokens[i].size:
                    generated[i].append(int(sampled[last_row[int(starts[order[i]]) + chunks[i] - 1]]))
            outputs = []
            for k, i in enumerate(live):
                m, anchor = int(outcome.matched[k]), done[i]
                kept = verify_inputs[k][1: 1 + m]
                generated[i] += [*kept.tolist(), int(outcome.bonus[k])]
                done[i] += m + 1
                lengths[i].append(m + 1)
                committed.append((i, anchor, int(v_starts[k]), m + 1))
                rows = slice(int(v_starts[k]), int(v_starts[k]) + m + 1)
                outputs.append(VerifyOutput(request_id=i, position=anchor, width=int(width[k]), accepted=m + 1,
                                            accepted_tokens=kept, bonus=int(outcome.bonus[k]),
                                            target_hidden=None if target is None else target[rows].copy()))
            if isinstance(conditioned, _GroupDrafter):   # the rank processes hold the features
                _advance_group_drafter(conditioned, committed, finished, observed)
            elif conditioned is not None and target is not None:
                _advance_drafter(conditioned, committed, target, finished, observed)
            steps.append(StepRecord(batch=batch, prefill_ids=tuple(pre), verify=tuple(outputs), accepted=accepted,
                                    seconds=time.perf_counter() - t0))
            if on_step is not None:
                on_step(steps[-1], runner.caches)
    except BaseException:
        if conditioned is not None and observed:   # a failed step must not leave the drafter holding state
            with contextlib.suppress(Exception):     # the step's own error is the one to report
                conditioned.release(sorted(observed))
        raise
    finally:
        runner.close()
    return GenerateResult(tokens={i: np.asarray(g[:max_new_tokens], np.int64) for i, g in enumerate(generated)},
                          accepted_lengths=lengths, steps=steps, caches=runner.caches, allocator=alloc)


def _drafts(drafter: Drafter | ConditionedDrafter, conditioned: ConditionedDrafter | None, live: list[int],
            tokens: list[np.ndarray], generated: list[list[int]], done: list[int], room: list[int], K: int,
            adaptive: float | None, min_drafts: int, config: ModelConfig) -> list[np.ndarray]:
    """The drafts of the step's verifying requests ``live``: at most ``room[k]`` each (int64). A conditioned
    drafter drafts (one packed call) for the requests with room for a draft whose block of ``dspark_block_size``
    rows fits before the position limit; the others verify their anchor alone."""
    if not live:
        return []
    if conditioned is not None:
        # a block that fits before the position limit, for requests that may still take a draft
        limit = config.max_position_embeddings
        asks = [k for k, i in enumerate(live) if room[k] > 0 and done[i] + config.dspark_block_size <= limit]
        out = [np.zeros(0, np.int64) for _ in live]
        if asks:
            block = conditioned.draft([live[k] for k in asks], np.array([generated[live[k]][-1] for k in asks],
                                                                         np.int64),
                                      np.array([done[live[k]] for k in asks], np.int64))
            widths = np.minimum(draft_widths(block.confidence, K, adaptive, min_drafts),
                                np.asarray(room, np.int64)[asks])
            drafted = np.asarray(block.tokens, dtype=np.int64)
            for j, (k, w) in enumerate(zip(asks, widths, strict=True)):
                out[k] = drafted[j, : int(w)]
        return out
    if not isinstance(drafter, Drafter):      # refused by check_deployment before the first step
        raise TypeError(f"{type(drafter).__name__} is not a Drafter")
    context = [np.concatenate([tokens[i], np.asarray(generated[i], np.int64)]) for i in live]
    return [np.asarray(d, np.int64).reshape(-1)[:k]
            for d, k in zip(drafter.propose(live, context, room), room, strict=True)]


def _advance_drafter(drafter: ConditionedDrafter, committed: list[tuple[int, int, int, int]], target: np.ndarray,
                     finished: Callable[[int], bool], observed: set[int]) -> None:
    """Hand the drafter the target features of the rows the step committed, for the requests that draft again,
    in one packed observe(); release the requests that finished. committed: (request, first position, first
    group row, rows) per request of the step."""
    going = [c for c in committed if not finished(c[0])]
    if going:
        drafter.observe([i for i, *_ in going], [np.arange(p, p + n, dtype=np.int64) for _, p, _, n in going],
                        [target[row: row + n] for _, _, row, n in going])
        observed.update(i for i, *_ in going)
    done = sorted(i for i, *_ in committed if finished(i) and i in observed)
    if done:
        drafter.release(done)
        observed.difference_update(done)


def _accept(stage: Backend, inputs: list[np.ndarray], widths: np.ndarray, sampled: np.ndarray,
            logit_rows: np.ndarray, starts: np.ndarray, padded_rows: int) -> Acceptance:
    """The backend's acceptance stage over the step's verify requests (padded [R, max width] inputs)."""
    if not inputs:
        empty = np.zeros(0, np.int64)
        return Acceptance(accepted=empty, matched=empty, bonus=empty)
    padded = np.full((len(inputs), int(widths.max())), -1, np.int64)
    padded[np.arange(padded.shape[1])[None, :] < widths[:, None]] = np.concatenate(inputs)
    greedy = greedy_matrix(sampled, logit_rows, starts, widths, padded_rows)
    return stage.accept(padded, greedy, widths)


def greedy_decode(prompts: Sequence[Sequence[int] | np.ndarray], weights: ModelWeights, max_new_tokens: int, *,
                  tp: int = 1, tp_mode: TpMode = "single", backend: BackendName = "reference",
                  precision: str = "fp32",
                  cached: Sequence[int] | None = None, allocator: BlockAllocator | None = None,
                  caches: ModelCaches | None = None, slack: int = 8, tables: TableForm = "persistent"
                  ) -> GenerateResult:
    """Plain greedy decoding, the golden reference of :func:`generate`: each prompt prefilled in one chunk, then
    one token per request and step (a prefill chunk of one token with logits at its row). Also returns each
    generated token's top-2 logit margin (``margins``), which says where an fp32 summation-order difference
    could flip a greedy choice. tables: the block-table form of the steps, as :func:`generate`'s."""
    cfg = weights.config
    _check_counts({"max_new_tokens": (max_new_tokens, 1), "tp": (tp, 1)})
    tokens, done = _prompts(prompts, cached, cfg.vocab_size, cfg.max_position_embeddings)
    runner, alloc = _runner(cfg, weights, caches, allocator, [t.size + max_new_tokens for t in tokens],
                            tp_mode, backend, precision, slack, tables)
    builder = BatchBuilder(cfg, PaddingPolicy(tp_size=tp), alloc)
    generated: list[list[int]] = [[] for _ in tokens]
    margins: list[list[float]] = [[] for _ in tokens]
    scales: list[list[float]] = [[] for _ in tokens]
    steps: list[StepRecord] = []
    inputs = list(tokens)
    with contextlib.closing(runner):
        while True:
            live = [i for i in range(len(tokens)) if len(generated[i]) < max_new_tokens
                    and done[i] + inputs[i].size <= cfg.max_position_embeddings]
            if not live:
                break
            _greedy_step(runner, builder, live, inputs, done, generated, margins, scales, steps)
    return GenerateResult(tokens={i: np.asarray(g, np.int64) for i, g in enumerate(generated)},
                          accepted_lengths={i: [] for i in range(len(tokens))}, steps=steps, caches=runner.caches,
                          allocator=alloc, margins={i: np.asarray(m) for i, m in enumerate(margins)},
                          logit_scales={i: np.asarray(m) for i, m in enumerate(scales)})


def _greedy_step(runner: _Runner, builder: BatchBuilder, live: list[int], inputs: list[np.ndarray], done: list[int],
                 generated: list[list[int]], margins: list[list[float]], scales: list[list[float]],
                 steps: list[StepRecord]) -> None:
    """One step of :func:`greedy_decode`: one chunk (the prompt, then the last token) per live request."""
    for i in live:
        builder.add(i, num_cached=done[i], num_new=inputs[i].size, token_ids=inputs[i])
    step = runner.build(builder)
    batch, result = runner.forward(step)
    builder.commit(step)
    by_row = {int(r): k for k, r in enumerate(result.logit_rows) if r >= 0}
    starts = np.asarray(batch.query_start_loc[1:], dtype=np.int64) - 1
    for k, i in enumerate(live):
        j = by_row[int(starts[k])]
        top2 = np.partition(result.logits[j], -2)[-2:]
        generated[i].append(int(result.sampled[j]))
        margins[i].append(float(top2[1] - top2[0]))
        scales[i].append(float(np.abs(result.logits[j]).max()))
        done[i] += inputs[i].size
        inputs[i] = np.array([generated[i][-1]], np.int64)
    steps.append(StepRecord(batch=batch, prefill_ids=tuple(live), verify=(),
                            accepted=np.diff(np.asarray(batch.query_start_loc, np.int64))))
