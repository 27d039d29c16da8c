"""`BatchBuilder`: serving code adds requests and gets a validated `PackedBatch`.

>>> from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
>>> from dspark_abi.presets import TINY
>>> alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
>>> builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2), alloc)
>>> builder.add(0, num_cached=126, num_new=3)
>>> builder.add(1, num_cached=30, num_new=4)
>>> batch = builder.build()
>>> batch.query_start_loc.tolist(), batch.positions.tolist()
([0, 3, 7], [126, 127, 128, 30, 31, 32, 33, 0])
>>> batch.rank(0).local_request_ids.tolist(), batch.rank(1).local_request_ids.tolist()
([0, 0, 0, 1], [1, 1, 1, -1])

A built batch changes nothing yet: the serving loop runs the forward, then commits the step, which advances every
request by all its rows (an uncommitted batch can simply be dropped and the step built again).

>>> alloc.knows(0)
False
>>> builder.commit(batch)
>>> alloc.cached_tokens(0), alloc.cached_tokens(1)
(129, 34)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np

from dspark_abi.allocator import BlockAllocator, StepPlan
from dspark_abi.batch import PackedBatch, SlotMappings
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_abi.incremental import Proposal, StepValidator
from dspark_abi.layout import POOL_NAMES, physical_rows, verify_headroom, written_logical
from dspark_abi.persistent import DeltaCells, PersistentStep, check_step, step_widths, written_slots
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import SLOT_FIELDS, TABLE_FIELDS
from dspark_abi.requests import BatchRequests, implied_logit_rows
from dspark_abi.validation import EMPTY_BATCH_FIX


@attrs.frozen
class StepRequests:
    """The checked requests of one step, as arrays: :meth:`BatchBuilder.build` checks what was queued and works
    on these exact copies only.

    Attributes:
        ids: [R] int64 serving request ids, unique.
        cached: [R] int64 tokens of each request already in the caches (its first new position).
        new: [R] int64 new tokens of each request in this step (>= 0).
        token_ids: [N] int64 token ids of the new tokens, request after request, or None when the step gives none.
        verify_width: [R] int32 0 for a prefill chunk, its row count for a verify request.
        logit_mode: [R] int8 output intent: 0 none, 1 last row, 2 every row (a verify request).
    """

    ids: np.ndarray
    cached: np.ndarray
    new: np.ndarray
    token_ids: np.ndarray | None = None
    verify_width: np.ndarray | None = None
    logit_mode: np.ndarray | None = None

    @property
    def declares_intent(self) -> bool:
        """The step needs ABI 1.2's ``verify_widths`` / ``logit_mode``: it holds a verify request or a chunk that
        asks for no logits."""
        return self.verify_width is not None and self.logit_mode is not None and bool(
            (self.verify_width > 0).any() or (self.logit_mode == 0).any())


@attrs.frozen(eq=False)
class _Built:
    """What committing one built batch needs: the batch (weakly: a dropped batch is forgotten), its allocator
    plan and its step validator's proposal (None without a validator)."""

    batch: weakref.ref[PackedBatch] | weakref.ref[PersistentStep]
    plan: StepPlan
    proposal: Proposal | None


@attrs.frozen
class _Many:
    """One add_many() call, its arguments as given (copied)."""

    request_ids: Any
    num_cached: Any
    num_new: Any
    token_ids: Any
    logits: Any = "last"
    verify: bool = False        # add_verify_many(): verify requests (num_new holds their widths)


_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)
_COUNT = (0, 2**63 - 1)

#: Fixes of the builder issues whose generic ``builder.request`` hint is not the exact fix.
_ID_FIX = "pass request_id as an integer within int64 (a Python or numpy integer, not bool, float or str)"
_IDS_FIX = ("pass token_ids as a list or 1-D numpy array of integers (no floats, bools, strings or masked "
            "arrays), one id per new token")
_MANY_FIX = ("pass add_many() 1-D integer arrays (or lists) of one entry per request: request_ids within int64, "
             "num_cached and num_new >= 0")
_LOGITS_FIX = "pass logits='last' (a final prefill chunk: logits at its last row) or logits='none' (an earlier chunk)"
#: Output intent of a queued request: add(logits=...) or a verify request.
_MODE = {"none": 0, "last": 1, "verify": 2}
_ROWS_FIX = ("pass logit_rows='last', None, or a list / 1-D numpy array of int32 group rows in [0, N) "
             "(-1 for an inactive entry)")


#: One queue entry's requests: ids, cached, new, "all three exact" and "the id exact" (duplicates are named even
#: when the counts are not exact), each [k].
_Part = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _bad(issues: list[Issue], i: int, arg: str, msg: str, expected: Any, actual: Any, fix: str | None = None) -> None:
    """A ``builder.request`` issue of request ``i`` (its place in the queue)."""
    issues.append(Issue("builder.request", arg, msg, index=i, request=i, expected=expected, actual=actual, fix=fix))


def _copy(value: Any) -> Any:
    """A copy of a queued argument that keeps its type (an ndarray subclass stays one, so build() can refuse it)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    return list(value) if isinstance(value, list | tuple) else value


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _exact_int(value: Any, lo: int, hi: int) -> int | None:
    """``value`` as a Python int when it is a Python or numpy integer (not bool) in ``[lo, hi]``, else None."""
    if type(value) is int:  # the common case first (bool is a subclass of int, not int itself)
        return value if lo <= value <= hi else None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):  # np.bool_ is no np.integer
        return None
    v = int(value)
    return v if lo <= v <= hi else None


def _int_vector(value: Any, lo: int, hi: int) -> tuple[np.ndarray | None, str]:
    """(int64 array, "") for a 1-D sequence of integers in ``[lo, hi]``, else (None, what is wrong with it).

    Nothing is truncated or wrapped: floats, bools, strings, nested or masked input are refused.
    """
    if isinstance(value, np.ndarray):
        if type(value) is not np.ndarray:
            return None, f"a {type(value).__name__} (an ndarray subclass)"
        if value.dtype.kind not in "iu":
            return None, f"a {value.dtype} array"
        if value.ndim != 1:
            return None, f"an array of shape {value.shape}"
        # two reductions decide (numpy compares with Python ints exactly); the offender is looked for only then
        if value.size and (value.min() < lo or value.max() > hi):
            i = int(np.flatnonzero((value < lo) | (value > hi))[0])
            return None, f"element [{i}] = {value[i]} outside [{lo}, {hi}]"
        return value.astype(np.int64), ""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        return None, _short(value)
    for i, x in enumerate(value):
        if isinstance(x, bool | np.bool_) or not isinstance(x, int | np.integer):
            return None, f"{_short(value)}: element [{i}] is {_short(x, 30)}"
        if not lo <= int(x) <= hi:
            return None, f"{_short(value)}: element [{i}] = {x} outside [{lo}, {hi}]"
    return np.array([int(x) for x in value], dtype=np.int64), ""


class BatchBuilder:
    """Collects the requests of one step (prefill chunks and verify requests) and builds its metadata.

    ``build()`` plans pages through the allocator (all or nothing), derives slots from tables and
    positions, pads to the TP geometry per policy and validates; it changes no allocator state. After the
    forward, ``commit(batch, accepted=None)`` advances every request of the step by its committed rows (all rows
    of a prefill chunk, the accepted count of a verify request; the allocator maps the step's pages and recycles
    the ring pages out of reach). A batch that is never committed can be dropped: the same step can be built
    again. For chunked prefill, add the same request id in a later step with ``num_cached`` advanced by the tokens
    of its earlier, committed chunks; it keeps its tables. :meth:`add_verify` queues a verify request (spec 5.8).
    """

    def __init__(self, config: ModelConfig, policy: PaddingPolicy, allocator: BlockAllocator, *,
                 validator: StepValidator | None = None, ring_width: Literal["step", "fixed"] = "step"):
        """validator: a serving loop's :class:`~dspark_abi.incremental.StepValidator`, which then validates each
        step at the cost of what it changes instead of the full stateless validation (same verdicts). It checks
        :meth:`build`'s batches; :meth:`build_step`'s are checked against the persistent tables
        (:func:`~dspark_abi.persistent.check_step`), and committing one resets the validator (:meth:`commit`).

        ring_width: "step" makes the four ring tables as narrow as the step's widest live range (the fewest
        bytes per step); "fixed" gives them ``PoolLayout.ring_width`` columns every step (static shapes for
        kernels compiled ahead of time). Compressed tables always span the step's widest live range."""
        if allocator.config != config:
            raise ABIError([Issue("config.mismatch", "allocator", "allocator was built for another config",
                                  expected=config.name, actual=allocator.config.name)])
        if validator is not None and (validator.config != config or validator.policy != policy):
            raise ABIError([Issue("config.mismatch", "validator", "the step validator was built for another "
                                  "config or policy", expected=(config.name, policy.tp_size),
                                  actual=(validator.config.name, validator.policy.tp_size),
                                  fix="give the builder a StepValidator(config, policy, pool_blocks) of its own")])
        self.config, self.policy, self.allocator, self.validator = config, policy, allocator, validator
        self.fixed_ring = ring_width == "fixed"
        # add() / add_verify() arguments as given (with the intent: "last", "none" or "verify") / add_many() calls
        self._pending: list[tuple[Any, Any, Any, Any, Any] | _Many] = []
        self._built: dict[int, _Built] = {}          # id(batch) -> its commit, for the batches not committed yet
        # batches committed (to report a 2nd commit)
        self._committed: dict[int, weakref.ref[PackedBatch] | weakref.ref[PersistentStep]] = {}

    def add(self, request_id: int, num_cached: int, num_new: int, token_ids: Sequence[int] | np.ndarray | None = None,
            *, logits: Literal["last", "none"] = "last") -> None:
        """Queue one prefill chunk for the next :meth:`build` (checked there, all requests at once).

        request_id, num_cached and num_new must be Python or numpy integers (not bool, float or str);
        token_ids a 1-D integer sequence of ``num_new`` ids. They are copied, not converted: a wrong type is
        reported by ``build()``, never truncated.

        logits: the chunk's output intent: "last" (a final chunk: the logits of its last row, the next token) or
        "none" (an earlier chunk of a longer prompt: no logits).
        """
        self._pending.append((request_id, num_cached, num_new, _copy(token_ids), logits))

    def add_verify(self, request_id: int, num_cached: int, token_ids: Sequence[int] | np.ndarray) -> None:
        """Queue one verify request: ``token_ids = [anchor, d_1, ..., d_k]``, the anchor (the input after the last
        committed token) at position ``num_cached`` (the first position not yet cached) and the k drafts at the
        following positions. Its width ``1 + k`` may be 1 (no drafts this step) up to ``1 + K``, K the config's
        ``dspark_block_size``; ``num_cached`` must be >= 1 (``verify.no_anchor``). The step produces logits at
        every row of the request; :meth:`commit` then takes its accepted count (1..width).

        >>> from dspark_abi import BlockAllocator, PaddingPolicy, PoolBlocks
        >>> from dspark_abi.presets import TINY_DSPARK
        >>> alloc = BlockAllocator(TINY_DSPARK, PoolBlocks.uniform(64))
        >>> builder = BatchBuilder(TINY_DSPARK, PaddingPolicy(), alloc)
        >>> builder.add(0, num_cached=0, num_new=4, token_ids=[5, 6, 7, 8])
        >>> builder.commit(builder.build())
        >>> builder.add_verify(0, num_cached=4, token_ids=[9, 10, 11])     # anchor 9, drafts 10 and 11
        >>> builder.add(1, num_cached=0, num_new=2, token_ids=[3, 4], logits="none")
        >>> batch = builder.build()
        >>> batch.requests.verify_width.tolist(), batch.logit_mode.tolist(), batch.logit_rows.tolist()
        ([3, 0], [2, 0], [0, 1, 2, -1])
        >>> builder.commit(batch, accepted=[2, 2])      # the anchor and the first draft
        >>> alloc.cached_tokens(0), alloc.cached_tokens(1)
        (6, 2)
        """
        self._pending.append((request_id, num_cached, None, _copy(token_ids), "verify"))

    def add_many(self, request_ids: Sequence[int] | np.ndarray, num_cached: Sequence[int] | np.ndarray,
                 num_new: Sequence[int] | np.ndarray, token_ids: Sequence[int] | np.ndarray | None = None, *,
                 logits: Literal["last", "none"] = "last") -> None:
        """Queue many prefill chunks at once from 1-D integer arrays of equal length (the form a serving engine
        keeps them in); ``build()`` checks them vectorized, like :meth:`add`'s. token_ids: None, or one flat 1-D
        integer array of ``sum(num_new)`` ids, request after request. logits: the output intent of every chunk of
        the call, as :meth:`add` takes it. The arguments are copied.

        >>> from dspark_abi import BlockAllocator, PaddingPolicy, PoolBlocks
        >>> from dspark_abi.presets import TINY
        >>> builder = BatchBuilder(TINY, PaddingPolicy(), BlockAllocator(TINY, PoolBlocks.uniform(64)))
        >>> builder.add_many([7, 8], num_cached=[0, 40], num_new=[3, 2])
        >>> builder.build().positions.tolist()
        [0, 1, 2, 40, 41]
        """
        self._pending.append(_Many(_copy(request_ids), _copy(num_cached), _copy(num_new), _copy(token_ids), logits))

    def add_verify_many(self, request_ids: Sequence[int] | np.ndarray, num_cached: Sequence[int] | np.ndarray,
                        widths: Sequence[int] | np.ndarray, token_ids: Sequence[int] | np.ndarray) -> None:
        """Queue many verify requests at once from 1-D integer arrays (the engine's form; checked vectorized by
        ``build()``, like :meth:`add_verify`'s one by one): request r has ``widths[r]`` rows (its anchor, then
        ``widths[r] - 1`` drafts) after ``num_cached[r]`` committed tokens; ``token_ids`` holds ``sum(widths)`` ids,
        request after request. The arguments are copied.

        >>> from dspark_abi import BlockAllocator, PaddingPolicy, PoolBlocks
        >>> from dspark_abi.presets import TINY_DSPARK
        >>> builder = BatchBuilder(TINY_DSPARK, PaddingPolicy(), BlockAllocator(TINY_DSPARK, PoolBlocks.uniform(64)))
        >>> builder.add_many([0, 1], [0, 0], [5, 3], [1, 2, 3, 4, 5, 6, 7, 8])
        >>> builder.commit(builder.build())
        >>> builder.add_verify_many([0, 1], [5, 3], [2, 1], [9, 10, 11])
        >>> builder.build().requests.verify_width.tolist()
        [2, 1]
        """
        self._pending.append(_Many(_copy(request_ids), _copy(num_cached), _copy(widths), _copy(token_ids),
                                   "verify", verify=True))

    def clear(self) -> None:
        """Drop the queued requests."""
        self._pending.clear()

    def build(self, *, logit_rows: str | Sequence[int] | None = "last") -> PackedBatch:
        """Validated batch of the queued requests; clears the queue on success. Allocates nothing: pass the
        batch to :meth:`commit` once its forward ran.

        logit_rows: 'last' follows each request's output intent (``add(logits=...)``: the last row of a final
        chunk, none of an earlier one, -1 for empty requests; every row of a verify request); None leaves them
        out, or an explicit list of group rows (both only for steps without verify requests, as in ABI 1.1; they
        override the chunks' ``logits=`` intent).
        A step with a verify request or a ``logits="none"`` chunk carries ``verify_widths`` and ``logit_mode``.
        On any error nothing is planned and the queue is kept, so the caller can fix and retry.
        """
        step, rows = self._check_specs(list(self._pending), logit_rows)
        plan = self.allocator.plan(step.ids.tolist(), step.cached, step.cached + step.new)   # all rows, drafts too
        proposals: list[Proposal | None] = []
        batch = self._assemble(step, plan, rows, proposals)
        self._forget_dropped()
        self._built[id(batch)] = _Built(weakref.ref(batch), plan, proposals[0] if proposals else None)
        self._pending.clear()
        return batch

    def build_step(self, *, logit_rows: str | Sequence[int] | None = "last") -> PersistentStep:
        """The queued requests' step in the persistent form (spec 5.9): what :meth:`build` gives, but instead of
        copying ``[R, w]`` block tables it carries each request's slot in the allocator's persistent tables
        (:attr:`BlockAllocator.persistent`), the slots' generations and the cells the step maps and releases.
        Checked against the persistent tables incrementally (O(cells changed + R + rows)); ``commit(step)``
        writes the delta into them in place. ``step.to_full(alloc.persistent)`` is exactly :meth:`build`'s batch.

        >>> from dspark_abi import BlockAllocator, PaddingPolicy, PoolBlocks
        >>> from dspark_abi.presets import TINY
        >>> alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
        >>> builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
        >>> builder.add(0, num_cached=0, num_new=40)
        >>> step = builder.build_step()
        >>> step.table_slots.tolist(), step.mapped.ori.tolist()      # slot, page, block
        ([0], [[0, 0, 0], [0, 1, 1]])
        >>> builder.commit(step)
        >>> alloc.persistent.table("ori")[0, :3].tolist()
        [0, 1, -1]
        """
        step, rows = self._check_specs(list(self._pending), logit_rows)
        with self.allocator.lock:       # the plan and the persistent tables it is checked against stay one state
            plan = self.allocator.plan(step.ids.tolist(), step.cached, step.cached + step.new)
            built = self._assemble_step(step, plan, rows)
        self._forget_dropped()
        self._built[id(built)] = _Built(weakref.ref(built), plan, None)
        self._pending.clear()
        return built

    def commit(self, batch: PackedBatch | PersistentStep, accepted: Sequence[int] | np.ndarray | None = None
               ) -> None:
        """Advance every request of ``batch`` (built by this builder) by its committed rows: the allocator maps the
        step's pages, recycles the ring pages out of reach and counts the rows as cached; the builder's step
        validator takes the step as the baseline of the next one (a persistent step, which carries no tables to
        compare with, makes it forget its baseline: the next :meth:`build` is checked in full once, then
        incrementally again). Call it after the batch's forward.

        accepted: None (every row of every request) or one integer per request, in batch order: a prefill chunk's
        row count, or for a verify request its accepted count 1..width (the anchor is a real token, always kept).
        A request advances by exactly that many positions. Nothing a later step reads is freed: the pages mapped
        for rejected drafts stay mapped and the request's next step rewrites their rows before any query reads
        them (spec section 5.8.3).

        Raises ``commit.accepted`` for malformed counts and ``alloc.stale_plan`` for a batch this builder did not
        build, one committed already, or one another commit or release on the allocator overtook (build the step
        again); in every case nothing changes."""
        built = self._built.get(id(batch))
        if built is None or built.batch() is not batch:
            done = self._committed.get(id(batch))
            twice = done is not None and done() is batch
            raise ABIError([Issue(
                "alloc.stale_plan", "batch",
                "the batch was committed already" if twice else "the batch was not built by this builder",
                expected="a batch this builder built and did not commit yet",
                actual="a committed batch" if twice else "a batch of another builder or made from arrays",
                fix="commit each built batch once, with the builder that built it" if twice else
                    "commit a batch with the BatchBuilder whose build() made it")])
        plan = built.plan
        if accepted is not None:
            counts = _accepted_counts(batch.requests, accepted)
            plan = attrs.evolve(plan, ends=batch.requests.first_position + counts)
        self.allocator.commit(plan)                  # alloc.stale_plan when another commit or release overtook it
        if isinstance(batch, PersistentStep):        # the allocator's tables now hold exactly this step's delta
            self.allocator.persistent._hold(batch)
        del self._built[id(batch)]
        self._forget_dropped()
        self._committed[id(batch)] = built.batch
        if self.validator is not None:
            if isinstance(batch, PersistentStep):
                # a persistent step carries no [R, w] tables to compare the next step's cells with (making them is
                # the full form's cost): the validator forgets its baseline instead of keeping one older than the
                # allocator, and checks the next build() against none (in full once, O(live pages))
                self.validator.reset()
            elif built.proposal is not None:
                self.validator.accept(built.proposal)

    def _forget_dropped(self) -> None:
        """Forget the batches nobody holds any more (they cannot be committed)."""
        for book in (self._built, self._committed):
            for key in [k for k, v in book.items() if (v.batch if isinstance(v, _Built) else v)() is None]:
                del book[key]

    # ------------------------------------------------------------------ internals
    def _check_specs(self, queued: list[tuple[Any, Any, Any, Any, Any] | _Many], logit_rows: Any
                     ) -> tuple[StepRequests, str | np.ndarray | None]:
        """Exact copies of the queued requests and of ``logit_rows``; raises every problem at once.

        Four phases: each queue entry converted (:meth:`_convert_many`, :meth:`_convert_one`), the values of the
        exact requests (:meth:`_check_values`), the step as a whole (:meth:`_check_step`), the logit rows
        (:meth:`_check_logit_rows`). Scalars from add() are converted one by one (they are Python objects);
        everything else is checked on arrays, so an add_many() step costs no Python per request."""
        issues: list[Issue] = []
        # per queue entry: ids, cached, new, all three exact, the id exact (duplicates are named even then)
        parts: list[_Part] = []
        token_parts: list[Any] = []
        modes: list[int] = []                                     # per queue entry: the intent of its requests
        index = 0                                                 # a request's index: its place in the queue
        for entry in queued:
            part, tokens = (self._convert_many(entry, index, issues) if isinstance(entry, _Many) else
                            self._convert_one(entry, index, issues))
            parts.append(part)
            token_parts.append(tokens)
            kind = entry.logits if isinstance(entry, _Many) else entry[4]
            many_verify = isinstance(entry, _Many) and entry.verify
            known = isinstance(kind, str) and kind in _MODE and \
                (not isinstance(entry, _Many) or (kind == "verify") == many_verify)
            if isinstance(entry, _Many) and entry.verify and entry.token_ids is None:
                _bad(issues, index, "token_ids", "verify requests need their token ids [anchor, drafts...]",
                     "1-D integer sequence", "None", _IDS_FIX)
            if not known:
                _bad(issues, index, "logits", f"logits must be 'last' or 'none', got {_short(kind)}",
                     "'last' or 'none'", _short(kind), _LOGITS_FIX)
            modes.append(_MODE[kind] if known else 1)
            index += part[0].size

        ids, cached, new, exact, id_exact = (np.concatenate([p[k] for p in parts]) if parts else
                                             np.zeros(0, np.int64) for k in range(5))
        exact, id_exact = exact.astype(bool), id_exact.astype(bool)
        mode = np.repeat(np.array(modes, np.int8), [p[0].size for p in parts])  # one array, not one per add()
        verify = mode == _MODE["verify"]
        self._check_values(issues, ids, cached, new, exact, id_exact, verify)
        self._check_verify(issues, cached, new, exact, verify)
        self._check_step(issues, ids, new, exact, token_parts)
        rows = self._check_logit_rows(issues, logit_rows)
        if verify.any() and not (isinstance(rows, str) and rows == "last"):
            issues.append(Issue("builder.request", "logit_rows", "a step with verify requests produces the logits "
                                "its requests' intent implies (every row of a verify request)",
                                expected="'last'", actual=_short(logit_rows),
                                fix="build(logit_rows='last') (the default) and choose each chunk's logits with "
                                    "add(..., logits='last' | 'none')"))
        if issues:
            raise ABIError(issues)
        tokens = None
        if token_parts and token_parts[0] is not None:
            tokens = np.concatenate([t for t in token_parts if isinstance(t, np.ndarray)])
        if not isinstance(rows, str):     # None or explicit rows (prefill-only steps): the 1.1 form, no intent fields
            return StepRequests(ids, cached, new, tokens), rows
        width = np.where(verify, new, 0).astype(np.int32)
        return StepRequests(ids, cached, new, tokens, width, mode), rows

    @staticmethod
    def _convert_many(entry: _Many, index: int, issues: list[Issue]) -> tuple[_Part, Any]:
        """One add_many() entry as arrays (zeros where unusable) and its token ids, vectorized."""
        vectors = []
        for arg, value, bounds in (("request_ids", entry.request_ids, _INT64),
                                   ("num_cached", entry.num_cached, _COUNT),
                                   ("num_new", entry.num_new, _COUNT)):
            vec, problem = _int_vector(value, *bounds)
            if vec is None:
                issues.append(Issue("builder.request", arg, f"{arg} must be a 1-D sequence of integers "
                                    f"in [{bounds[0]}, {bounds[1]}], got {problem}", index=index,
                                    expected="1-D integer sequence", actual=problem, fix=_MANY_FIX))
            vectors.append(vec)
        sizes = {v.size for v in vectors if v is not None}
        if len(sizes) > 1:
            issues.append(Issue("builder.request", "add_many", "request_ids, num_cached and num_new must "
                                "have one entry per request", index=index, expected="equal lengths",
                                actual=sorted(sizes), fix=_MANY_FIX))
        count = max(sizes, default=0)
        exact = np.full(count, len(sizes) == 1 and all(v is not None for v in vectors))
        ids, cached, new = (v if v is not None and v.size == count else np.zeros(count, np.int64)
                            for v in vectors)
        tids = None
        if entry.token_ids is not None:
            tids, problem = _int_vector(entry.token_ids, *_INT64)
            if tids is None:
                _bad(issues, index, "token_ids", f"token_ids must be a 1-D sequence of integers, got {problem}",
                     "1-D integer sequence", problem, _IDS_FIX)
            elif exact.all() and tids.size != int(new.sum()):
                _bad(issues, index, "token_ids", f"token_ids must hold one id per new token: {tids.size} ids "
                     f"for sum(num_new)={int(new.sum())}", int(new.sum()), tids.size,
                     f"pass exactly sum(num_new)={int(new.sum())} token_ids, request after request")
        part = (ids, cached, new, exact, np.full(count, vectors[0] is not None))
        return part, entry.token_ids if tids is None else tids

    @staticmethod
    def _convert_one(entry: tuple[Any, Any, Any, Any, Any], index: int, issues: list[Issue]) -> tuple[_Part, Any]:
        """One add() or add_verify() entry (Python scalars, converted one by one) as one-element arrays, and its
        token ids (a verify request's row count is its token count)."""
        request_id, num_cached, num_new, token_ids, kind = entry
        if kind == "verify":
            tids, problem = (None, "None") if token_ids is None else _int_vector(token_ids, *_INT64)
            if tids is None:
                _bad(issues, index, "token_ids", f"a verify request's token_ids must be a 1-D sequence of integers "
                     f"[anchor, drafts...], got {problem}", "1-D integer sequence", problem, _IDS_FIX)
                token_ids = np.zeros(0, np.int64)         # reported: the step still counts the request
            num_new = 0 if tids is None else int(tids.size)
        rid = _exact_int(request_id, *_INT64)
        if rid is None:
            _bad(issues, index, "request_id", f"request_id must be an integer within int64, got "
                 f"{_short(request_id)}", "int64 integer", _short(request_id), _ID_FIX)
        cached_i, new_i = _exact_int(num_cached, *_COUNT), _exact_int(num_new, *_COUNT)
        for arg, value, exact_i in (("num_cached", num_cached, cached_i), ("num_new", num_new, new_i)):
            if exact_i is None:
                _bad(issues, index, arg, f"{arg} must be an integer >= 0, got {_short(value)}", "integer >= 0",
                     _short(value))
        tids = None
        if token_ids is not None:
            tids, problem = _int_vector(token_ids, *_INT64)
            if tids is None:
                _bad(issues, index, "token_ids", f"token_ids must be a 1-D sequence of integers, got {problem}",
                     "1-D integer sequence", problem, _IDS_FIX)
            elif new_i is not None and tids.shape != (new_i,):
                _bad(issues, index, "token_ids", f"token_ids must hold one id per new token: {tids.size} ids for "
                     f"num_new={new_i}", (new_i,), tids.shape, f"pass exactly num_new={new_i} token_ids")
        ok = rid is not None and cached_i is not None and new_i is not None
        part = (np.array([rid or 0], np.int64), np.array([cached_i or 0], np.int64),
                np.array([new_i or 0], np.int64), np.array([ok]), np.array([rid is not None]))
        return part, token_ids if tids is None else tids

    def _check_step(self, issues: list[Issue], ids: np.ndarray, new: np.ndarray, exact: np.ndarray,
                    token_parts: list[Any]) -> None:
        """The rules of the step as a whole: its token count and token ids for all requests or none."""
        if exact.all():
            total = int(new.sum())
            inactive = total == 0 and ids.size > 0 and self.policy.allow_inactive
            if not inactive and (ids.size == 0 or not 1 <= total <= self.policy.token_cap):
                issues.append(Issue("qsl.token_count", "requests", "a batch needs 1..token_cap new tokens",
                                    expected=f"1..{self.policy.token_cap}", actual=total,
                                    fix=EMPTY_BATCH_FIX if total < 1 else None))
        if len({t is None for t in token_parts}) > 1:
            issues.append(Issue("builder.request", "token_ids", "give token ids for every request or none",
                                expected="all or none", actual="some",
                                fix="pass token_ids to every add() or add_many() of the step, or to none"))

    @staticmethod
    def _check_logit_rows(issues: list[Issue], logit_rows: Any) -> str | np.ndarray | None:
        """``logit_rows`` as given ('last' or None) or as an int32 array (None with an issue when unusable)."""
        if logit_rows is None or (isinstance(logit_rows, str) and logit_rows == "last"):
            rows: str | np.ndarray | None = logit_rows
            return rows
        vec, problem = _int_vector(logit_rows, *_INT32)
        if vec is None:
            issues.append(Issue("builder.request", "logit_rows", "logit_rows must be 'last', None or a 1-D "
                                f"sequence of int32 group rows, got {problem}", expected="'last', None or "
                                "int32 rows", actual=problem, fix=_ROWS_FIX))
            return None
        return vec.astype(np.int32)

    def _check_values(self, issues: list[Issue], ids: np.ndarray, cached: np.ndarray, new: np.ndarray,
                      exact: np.ndarray, id_exact: np.ndarray, verify: np.ndarray) -> None:
        """The rules on the values of the exactly-typed requests, vectorized (loops run over offenders only)."""
        max_pos, chunk_cap = self.config.max_position_embeddings, self.allocator.max_chunk_tokens

        def each(mask: np.ndarray, arg: str, msg: Any, expected: Any, actual: Any, fix: Any) -> None:
            for i in np.flatnonzero(mask).tolist():
                issues.append(Issue("builder.request", arg, msg(i), index=i, request=i, expected=expected(i),
                                    actual=actual(i), fix=fix(i)))

        order = np.argsort(ids, kind="stable")
        repeat = np.zeros(ids.size, dtype=bool)                   # a later request with an earlier one's id
        ordered, valid = ids[order], id_exact[order]
        repeat[order[1:]] = (ordered[1:] == ordered[:-1]) & valid[1:] & valid[:-1]
        each(repeat, "request_id", lambda i: f"request_id {ids[i]} is already in this step", lambda i: "unique id",
             lambda i: int(ids[i]),
             lambda i: f"add request {ids[i]} once per step (queue its later tokens as the next step's chunk)")
        past = exact & ~verify & ((cached > max_pos) | (new > max_pos - np.minimum(cached, max_pos)))  # > max
        each(past, "num_new", lambda i: f"context num_cached + num_new = {int(cached[i]) + int(new[i])} would "
             f"exceed max_position_embeddings={max_pos}", lambda i: f"<= {max_pos}",
             lambda i: int(cached[i]) + int(new[i]),
             lambda i: f"stop the request at max_position_embeddings={max_pos}: at most "
                       f"num_new={max(0, max_pos - int(cached[i]))} after num_cached={cached[i]}")
        each(exact & (new > chunk_cap), "num_new", lambda i: f"num_new={new[i]} is longer than the {chunk_cap} "
             "tokens one request may add in one step (the ring tables hold reach + that many positions)",
             lambda i: f"<= {chunk_cap}", lambda i: int(new[i]),
             lambda i: f"split the request into chunks of at most {chunk_cap} tokens over several steps")
        if not self.policy.allow_empty_requests:
            each(exact & ~verify & (new == 0), "num_new", lambda i: "zero-length request not allowed by policy",
                 lambda i: "> 0", lambda i: 0, lambda i: "drop the request from this step or set "
                                        "PaddingPolicy(allow_empty_requests=True)")
        have = self.allocator.cached_tokens_of(ids)      # -1 for a request the allocator does not know
        each(exact & (have >= 0) & (cached != have), "num_cached",
             lambda i: f"request {ids[i]} continues after {have[i]} cached tokens, got num_cached={cached[i]}",
             lambda i: int(have[i]), lambda i: int(cached[i]),
             lambda i: f"pass num_cached={have[i]} (the tokens its committed chunks cached); if an earlier "
                       f"chunk of request {ids[i]} was built but not committed yet, commit it first "
                       "(builder.commit(batch) after its forward)")

    def _check_verify(self, issues: list[Issue], cached: np.ndarray, new: np.ndarray, exact: np.ndarray,
                      verify: np.ndarray) -> None:
        """The rules of the verify requests (their row count is their width), vectorized over offenders."""
        cap, k, max_pos = self.config.max_verify_width, self.config.dspark_block_size, \
            self.config.max_position_embeddings
        mine = exact & verify
        for i in np.flatnonzero(mine & (new == 0)).tolist():
            issues.append(Issue("verify.width", "token_ids", "a verify request needs at least its anchor token",
                                index=i, request=i, expected=f"1..{cap} tokens", actual=0,
                                fix="pass token_ids=[anchor, drafts...] with the anchor first"))
        for i in np.flatnonzero(mine & (new > cap)).tolist():
            issues.append(Issue("verify.drafts", "token_ids", f"{int(new[i]) - 1} drafts, more than the config's "
                                f"dspark_block_size={k}", index=i, request=i, expected=f"<= {cap} tokens "
                                f"(anchor + {k} drafts)", actual=int(new[i]),
                                fix=f"verify at most {k} drafts per step (fewer is fine)"))
        for i in np.flatnonzero(mine & (cached == 0)).tolist():
            issues.append(Issue("verify.no_anchor", "num_cached", "a verify request needs at least one committed "
                                "token before its anchor", index=i, request=i, expected=">= 1", actual=0))
        for i in np.flatnonzero(mine & (new >= 1) & (cached + np.maximum(new, 1) > max_pos)).tolist():
            issues.append(Issue("verify.position_limit", "token_ids", f"rows at positions {int(cached[i])}.."
                                f"{int(cached[i] + new[i]) - 1} reach max_position_embeddings={max_pos}", index=i,
                                request=i, expected=f"num_cached + width <= {max_pos}",
                                actual=int(cached[i] + new[i]),
                                fix=f"verify at most {max(0, max_pos - int(cached[i]))} tokens after "
                                    f"num_cached={int(cached[i])}"))

    def _assemble_step(self, step: StepRequests, plan: StepPlan, logit_rows: str | np.ndarray | None
                       ) -> PersistentStep:
        """The persistent form: slots read from the persistent tables with the plan's delta, no table copied."""
        layout, policy, persistent = self.config.layout, self.policy, self.allocator.persistent
        requests, qsl, n, p_rows, row_request, pos, positions, token_ids, rows = self._rows(step, logit_rows)
        starts, ends = step.cached, step.cached + step.new
        widest = int(step.verify_width.max(initial=0)) if step.verify_width is not None else 0
        floor = {pl.name: verify_headroom(pl, widest) for pl in layout} if widest else None
        widths = step_widths(layout, self.config.sliding_window, starts, ends, fixed_ring=self.fixed_ring,
                             ring_floor=floor)
        written = written_slots(layout, persistent, plan.rows[row_request], pos, plan.map_cells, plan.release_cells)
        slots = {}
        for p in POOL_NAMES:
            s = np.full(p_rows, policy.pad_slot, dtype=np.int64)
            s[:n] = written[p]
            slots[p] = s
        table_slots = plan.rows.astype(np.int32)
        built = PersistentStep(
            config=self.config, policy=policy, pool_blocks=self.allocator.pool_blocks, query_start_loc=qsl,
            positions=positions, slots=SlotMappings(**slots), table_slots=table_slots,
            slot_generations=persistent.generations[plan.rows],
            table_widths=np.array([widths[p] for p in POOL_NAMES], np.int32),
            mapped=DeltaCells.from_pooled(plan.map_pooled), released=DeltaCells.from_pooled(plan.release_pooled),
            request_ids=step.ids, token_ids=token_ids, logit_rows=rows,
            verify_widths=requests.verify_width if step.declares_intent else None,
            logit_mode=requests.logit_mode if step.declares_intent else None, requests=requests)
        check_step(built, persistent, derived=True).raise_if_invalid()
        return built

    def _rows(self, step: StepRequests, logit_rows: str | np.ndarray | None) -> tuple[
            BatchRequests, np.ndarray, int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None,
            np.ndarray | None]:
        """The per-row arrays both forms share: (requests, query_start_loc [R+1], N, P, row_request [N] intp,
        pos [N] int64, positions [P] int32, token_ids [P] int64 | None, logit rows | None)."""
        policy = self.policy
        starts, lengths = step.cached, step.new
        intent = step.declares_intent
        requests = BatchRequests.from_step(step.ids, starts, lengths, logit_rows,
                                           step.verify_width if intent else None,
                                           step.logit_mode if intent else None)
        qsl = np.zeros(lengths.size + 1, dtype=np.int32)
        qsl[1:] = requests.row_end
        n = int(qsl[-1])
        p_rows = policy.padded_rows(n)
        # [N] the batch's own row_request, as intp once: every gather below indexes with it (7 pools)
        row_request = requests.row_request(p_rows)[:n].astype(np.intp)
        pos = starts[row_request] + (np.arange(n) - qsl[:-1][row_request])             # [N]
        positions = np.empty(p_rows, dtype=np.int32)
        positions[:n] = pos
        positions[n:] = policy.padding_positions(pos[-1] if n else 0, p_rows - n)
        token_ids = None
        if step.token_ids is not None:
            token_ids = np.full(p_rows, policy.pad_token_id, dtype=np.int64)
            token_ids[:n] = step.token_ids
        # 'last' (a str): the rows each request's intent implies
        rows = implied_logit_rows(requests.row_start, requests.row_end, requests.logit_mode) \
            if isinstance(logit_rows, str) else logit_rows
        return requests, qsl, n, p_rows, row_request, pos, positions, token_ids, rows

    def _assemble(self, step: StepRequests, plan: StepPlan, logit_rows: str | np.ndarray | None,
                  proposals: list[Proposal | None]) -> PackedBatch:
        layout, policy = self.config.layout, self.policy
        starts, lengths = step.cached, step.new
        intent = step.declares_intent
        requests, qsl, n, p_rows, row_request, pos, positions, token_ids, rows = self._rows(step, logit_rows)

        # tables as narrow as the step's widest live range: O(R * pages used), not O(R * max positions)
        widest = int(step.verify_width.max(initial=0)) if step.verify_width is not None else 0
        floor = {pl.name: verify_headroom(pl, widest) for pl in layout} if widest else None
        tables = self.allocator.step_tables(plan, starts, starts + lengths, fixed_ring=self.fixed_ring,
                                            ring_floor=floor)
        slots = {}
        for p in POOL_NAMES:
            pl = layout.pools[p]
            s = np.full(p_rows, policy.pad_slot, dtype=np.int64)
            s[:n] = physical_rows(tables[p], row_request, written_logical(pl, pos), pl.page_size, ring=pl.is_ring)
            slots[p] = s

        arrays = {"query_start_loc": qsl, "positions": positions, "request_ids": step.ids}
        if intent:
            arrays |= {"verify_widths": requests.verify_width, "logit_mode": requests.logit_mode}
        arrays |= {TABLE_FIELDS[p]: t for p, t in tables.items()} | {SLOT_FIELDS[p]: v for p, v in slots.items()}
        arrays |= {k: v for k, v in (("token_ids", token_ids), ("logit_rows", rows)) if v is not None}
        # validated on these private arrays (numpy memory, fast to gather from), then frozen: copied once
        check = None
        if self.validator is not None:
            validator = self.validator

            def check(arrays: Any) -> Any:          # the step becomes the validator's baseline on commit only
                report, proposal = validator.propose(arrays)
                proposals.append(proposal)
                return report

        return PackedBatch.from_arrays(arrays, self.config, policy, self.allocator.pool_blocks, validator=check,
                                       requests=requests)


def _accepted_counts(requests: BatchRequests, accepted: Any) -> np.ndarray:
    """[R] int64 rows each request of a step commits: ``accepted`` checked against the step (raises
    ``commit.accepted`` with every offender; nothing is changed)."""
    count = requests.count
    vec, problem = _int_vector(accepted, *_INT64)
    if vec is None or vec.shape != (count,):
        actual = problem if vec is None else f"{vec.size} counts"
        raise ABIError([Issue("commit.accepted", "accepted", f"accepted must be None or one integer per request "
                              f"({count}), got {actual}", expected=f"{count} integers", actual=actual)])
    rows, width = requests.commit_rows, requests.verify_width.astype(np.int64)
    verify = width > 0
    issues = []
    for i in np.flatnonzero(~verify & (vec != rows)).tolist():
        issues.append(Issue("commit.accepted", "accepted", "a prefill chunk commits all its rows", index=i,
                            request=i, expected=int(rows[i]), actual=int(vec[i]),
                            fix=f"pass accepted[{i}] = {int(rows[i])} (the chunk's row count)"))
    for i in np.flatnonzero(verify & ((vec < 1) | (vec > width))).tolist():
        issues.append(Issue("commit.accepted", "accepted", "a verify request commits 1 (its anchor) up to its "
                            "width: no more rows than the step verified", index=i, request=i,
                            expected=f"1..{int(width[i])}", actual=int(vec[i]),
                            fix="commit the accepted prefix: the anchor plus the drafts the target agreed with"))
    if issues:
        raise ABIError(issues)
    return vec
