"""The greedy speculative loop: prefill, then build -> forward -> accept -> commit, one dispatch per step.

Each step packs, for every unfinished request, either its next prefill chunk (logits at the last row of the final
chunk only) or a verify request ``[anchor, d_1 .. d_k]`` whose drafts come from a :class:`Drafter`; prefill chunks
of other requests ride in the same dispatches as the verify requests (mixed steps). After the forward, the
acceptance stage (:func:`dspark_kernels.model.accept.accept_greedy`) keeps each verify request's longest agreeing
prefix plus the bonus token, and ``BatchBuilder.commit(batch, accepted=...)`` advances every request by exactly
the rows it keeps. Rows written for rejected drafts are rewritten by the request's next step before any read.

Greedy only: the loop yields exactly the tokens of plain greedy decoding (:func:`greedy_decode`, one token per
step); temperature sampling is out of scope.

Drafters shipped here are test and demo drafters (the DSpark drafter model is not part of this module):
:class:`ReplayDrafter` (replays a known token stream: always right), :class:`RandomDrafter` (seeded uniform ids)
and :class:`FixedHitsDrafter` (right on exactly the first ``hits`` drafts of each block).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs
import numpy as np

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, Issue, ModelConfig, PackedBatch, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_kernels.model.accept import Acceptance, greedy_matrix
from dspark_kernels.model.backends import Backend, BackendName, backend_issues, resolve_backend
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.numerics import PRECISIONS
from dspark_kernels.model.weights import ModelWeights

__all__ = [
    "TP_MODES",
    "Drafter",
    "FixedHitsDrafter",
    "GenerateResult",
    "RandomDrafter",
    "ReplayDrafter",
    "StepRecord",
    "VerifyOutput",
    "generate",
    "greedy_decode",
    "rejected_rows",
]

TpMode = Literal["single", "threads", "distributed"]
#: How a step's forward runs a TP group: one process ("single"), one thread per rank, one process per rank.
TP_MODES: tuple[TpMode, ...] = ("single", "threads", "distributed")


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
    """[accepted, T * D] float32 DSpark target features of the accepted rows only (None without target layers)."""


@attrs.frozen(eq=False)
class StepRecord:
    """What one dispatch held and what it kept."""

    batch: PackedBatch
    prefill_ids: tuple[int, ...]
    """Requests that sent a prefill chunk."""
    verify: tuple[VerifyOutput, ...]
    accepted: np.ndarray
    """[R] int64 rows committed per request of the batch (all rows of a prefill chunk)."""

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


def rejected_rows(batch: PackedBatch, accepted: np.ndarray) -> np.ndarray:
    """[P] bool: group rows the step wrote at positions its requests did not commit (rows beyond each request's
    ``accepted`` count); their cache rows must never be read before the request's next step rewrites them."""
    mask = np.zeros(batch.padded_rows, bool)
    mask[batch.requests.uncommitted_rows(accepted)] = True
    return mask


# ---------------------------------------------------------------------------------------------- forward
@attrs.frozen(eq=False)
class _Forward:
    """logit_rows [M] int32 (-1 inactive), sampled [M] int64, logits [M, V] fp32, target_hidden [P, T*D] or None."""

    logit_rows: np.ndarray
    sampled: np.ndarray
    logits: np.ndarray
    target_hidden: np.ndarray | None


@attrs.define
class _Runner:
    """Runs one batch's forward in a TP mode and keeps ``caches`` current."""

    weights: ModelWeights
    caches: ModelCaches
    mode: TpMode
    backend: BackendName
    precision: str
    stages: Backend = attrs.field(init=False)
    """The backend's stages (its acceptance stage runs after each forward)."""

    def __attrs_post_init__(self) -> None:
        self.stages = resolve_backend(self.backend, self.precision)

    def forward(self, batch: PackedBatch) -> _Forward:
        """The forward of ``batch`` at its own logit rows; ``caches`` hold its writes afterwards."""
        tokens = batch.token_ids
        if tokens is None:   # the loop always gives token ids; a batch without them cannot be verified
            raise ABIError([Issue("array.missing", "token_ids", "a step of the loop needs token ids",
                                  expected="[P] int64", actual="None")])
        if self.mode == "single":
            from dspark_kernels.api import prefill

            res = prefill(batch, tokens, self.weights, self.caches, backend=self.backend, precision=self.precision)
            return _Forward(res.logit_rows, res.sampled, res.logits, res.target_hidden)
        from dspark_kernels.model import tp

        if self.mode == "threads":
            result = tp.run_tp_inprocess(batch, tokens, self.weights, self.caches, precision=self.precision,
                                         backend=self.backend)[0].result
        else:
            ranks = tp.launch(tp.DistributedJob(batch, tokens, self.weights, self.caches,
                                                precision=self.precision, backend=self.backend))
            for name, array in self.caches.arrays().items():      # the rank processes wrote their own copies
                array[...] = ranks[0].caches.arrays()[name]
            result = ranks[0].result
        return _Forward(result.logit_rows, result.sampled, result.logits, result.target_hidden)


def _runner(config: ModelConfig, weights: ModelWeights, caches: ModelCaches | None, allocator: BlockAllocator | None,
            lengths: Sequence[int], tp_mode: TpMode, backend: BackendName, precision: str, slack: int
            ) -> tuple[_Runner, BlockAllocator]:
    issues = backend_issues(backend, precision) if precision in PRECISIONS else [
        Issue("config.invalid", "precision", "unknown precision", expected=list(PRECISIONS), actual=repr(precision))]
    if tp_mode not in TP_MODES:
        issues.append(Issue("config.invalid", "tp_mode", "unknown TP mode", expected=list(TP_MODES),
                            actual=repr(tp_mode)))
    if issues:
        raise ABIError(issues)
    if allocator is None:
        allocator = BlockAllocator(config, pool_blocks_for(config, list(lengths), slack=slack))
    if caches is None:
        caches = ModelCaches.allocate(config, allocator.pool_blocks, precision=precision)
    return _Runner(weights, caches, tp_mode, backend, precision), allocator


def _check_counts(values: Mapping[str, tuple[object, int]]) -> None:
    """``config.invalid`` for every argument that is not an int of at least its minimum (before any work)."""
    issues = [Issue("config.invalid", name, f"{name} must be an integer >= {low}", expected=f">= {low}",
                    actual=repr(value))
              for name, (value, low) in values.items()
              if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low]
    if issues:
        raise ABIError(issues)


def _prompts(prompts: Sequence[Sequence[int] | np.ndarray], cached: Sequence[int] | None, vocab: int
             ) -> tuple[list[np.ndarray], list[int]]:
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
    if issues:
        raise ABIError(issues)
    return arrays, done


# ---------------------------------------------------------------------------------------------- loops
def generate(prompts: Sequence[Sequence[int] | np.ndarray], weights: ModelWeights, drafter: Drafter,
             max_new_tokens: int, K: int, *, tp: int = 1, tp_mode: TpMode = "single",
             backend: BackendName = "reference", precision: str = "fp32", prefill_chunk: int = 16,
             cached: Sequence[int] | None = None,
             allocator: BlockAllocator | None = None, caches: ModelCaches | None = None, slack: int = 8,
             on_step: Callable[[StepRecord, ModelCaches], None] | None = None) -> GenerateResult:
    """Greedy speculative decoding of ``prompts`` (request ids 0..n-1) with ``drafter``, up to ``max_new_tokens``
    each, verifying at most ``K`` drafts per request and step.

    Every step is one dispatch: the next prefill chunk (at most ``prefill_chunk`` tokens) of each request still
    in prefill, and a verify request for every other unfinished request (its anchor and up to ``K`` drafts,
    fewer near ``max_new_tokens`` or the position limit). tp / tp_mode: the TP group size and how its ranks run
    (:data:`TP_MODES`); backend / precision as :func:`dspark_kernels.prefill`.
    cached / allocator / caches: requests whose first ``cached[i]`` tokens are already in ``caches`` (the
    allocator knows them); default fresh pools sized for the prompts and ``slack`` blocks more per pool.
    on_step(record, caches) runs after each commit (tests plant garbage in rejected rows there).
    """
    cfg = weights.config
    _check_counts({"max_new_tokens": (max_new_tokens, 1), "K": (K, 0), "prefill_chunk": (prefill_chunk, 1),
                   "tp": (tp, 1)})
    if isinstance(K, int) and cfg.dspark_block_size < K:   # refused up front, not at the first step with drafts
        raise ABIError([Issue("verify.drafts", "K", "more drafts per verify request than the config's "
                              "dspark_block_size", expected=f"<= {cfg.dspark_block_size}", actual=K,
                              fix=f"verify at most K = {cfg.dspark_block_size} drafts per step")])
    tokens, done = _prompts(prompts, cached, cfg.vocab_size)
    runner, alloc = _runner(cfg, weights, caches, allocator, [t.size + max_new_tokens + K + 1 for t in tokens],
                            tp_mode, backend, precision, slack)
    builder = BatchBuilder(cfg, PaddingPolicy(tp_size=tp), alloc)
    generated: list[list[int]] = [[] for _ in tokens]
    fed = [0] * len(tokens)                       # prompt tokens sent so far (done[i] counts cached positions)
    lengths: dict[int, list[int]] = {i: [] for i in range(len(tokens))}
    limit = cfg.max_position_embeddings
    steps: list[StepRecord] = []
    while True:
        pre = [i for i, t in enumerate(tokens) if fed[i] < t.size]
        live = [i for i in range(len(tokens)) if generated[i] and len(generated[i]) < max_new_tokens
                and done[i] < limit]
        if not pre and not live:
            break
        chunks = {i: min(prefill_chunk, tokens[i].size - fed[i]) for i in pre}
        for i in pre:
            final = fed[i] + chunks[i] == tokens[i].size
            builder.add(i, num_cached=done[i], num_new=chunks[i], token_ids=tokens[i][fed[i]: fed[i] + chunks[i]],
                        logits="last" if final else "none")
        room = [min(K, max_new_tokens - len(generated[i]) - 1, limit - done[i] - 1) for i in live]
        context = [np.concatenate([tokens[i], np.asarray(generated[i], np.int64)]) for i in live]
        drafts = drafter.propose(live, context, room) if live else []
        verify_inputs = [np.concatenate([[generated[i][-1]], np.asarray(d, np.int64).reshape(-1)[:k]])
                         for i, d, k in zip(live, drafts, room, strict=True)]
        for i, ids in zip(live, verify_inputs, strict=True):
            builder.add_verify(i, num_cached=done[i], token_ids=ids)
        batch = builder.build()
        out = runner.forward(batch)
        logit_rows, sampled, features = out.logit_rows, out.sampled, out.target_hidden
        order = {int(r): k for k, r in enumerate(batch.requests.ids)}
        starts = np.asarray(batch.query_start_loc[:-1], dtype=np.int64)
        width = np.array([ids.size for ids in verify_inputs], np.int64)
        v_starts = np.array([starts[order[i]] for i in live], np.int64)
        outcome = _accept(runner.stages, verify_inputs, width, sampled, logit_rows, v_starts, batch.padded_rows)
        accepted = np.array([chunks.get(int(r), 0) for r in batch.requests.ids], np.int64)
        accepted[[order[i] for i in live]] = outcome.accepted
        builder.commit(batch, accepted=accepted)
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
            rows = slice(int(v_starts[k]), int(v_starts[k]) + m + 1)
            outputs.append(VerifyOutput(request_id=i, position=anchor, width=int(width[k]), accepted=m + 1,
                                        accepted_tokens=kept,
                                        bonus=int(outcome.bonus[k]),
                                        target_hidden=None if features is None else features[rows].copy()))
        steps.append(StepRecord(batch=batch, prefill_ids=tuple(pre), verify=tuple(outputs), accepted=accepted))
        if on_step is not None:
            on_step(steps[-1], runner.caches)
    return GenerateResult(tokens={i: np.asarray(g[:max_new_tokens], np.int64) for i, g in enumerate(generated)},
                          accepted_lengths=lengths, steps=steps, caches=runner.caches, allocator=alloc)


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
                  caches: ModelCaches | None = None, slack: int = 8) -> GenerateResult:
    """Plain greedy decoding, the golden reference of :func:`generate`: each prompt prefilled in one chunk, then
    one token per request and step (a prefill chunk of one token with logits at its row). Also returns each
    generated token's top-2 logit margin (``margins``), which says where an fp32 summation-order difference
    could flip a greedy choice."""
    cfg = weights.config
    _check_counts({"max_new_tokens": (max_new_tokens, 1), "tp": (tp, 1)})
    tokens, done = _prompts(prompts, cached, cfg.vocab_size)
    runner, alloc = _runner(cfg, weights, caches, allocator, [t.size + max_new_tokens for t in tokens],
                            tp_mode, backend, precision, slack)
    builder = BatchBuilder(cfg, PaddingPolicy(tp_size=tp), alloc)
    generated: list[list[int]] = [[] for _ in tokens]
    margins: list[list[float]] = [[] for _ in tokens]
    scales: list[list[float]] = [[] for _ in tokens]
    steps: list[StepRecord] = []
    inputs = list(tokens)
    while True:
        live = [i for i in range(len(tokens)) if len(generated[i]) < max_new_tokens
                and done[i] + inputs[i].size <= cfg.max_position_embeddings]
        if not live:
            break
        for i in live:
            builder.add(i, num_cached=done[i], num_new=inputs[i].size, token_ids=inputs[i])
        batch = builder.build()
        result = runner.forward(batch)
        builder.commit(batch)
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
    return GenerateResult(tokens={i: np.asarray(g, np.int64) for i, g in enumerate(generated)},
                          accepted_lengths={i: [] for i in range(len(tokens))}, steps=steps, caches=runner.caches,
                          allocator=alloc, margins={i: np.asarray(m) for i, m in enumerate(margins)},
                          logit_scales={i: np.asarray(m) for i, m in enumerate(scales)})
