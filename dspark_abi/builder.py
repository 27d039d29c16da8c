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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np

from dspark_abi.allocator import BlockAllocator, StepPlan
from dspark_abi.batch import PackedBatch
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_abi.incremental import StepValidator
from dspark_abi.layout import POOL_NAMES, physical_rows, written_logical
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import SLOT_FIELDS, TABLE_FIELDS
from dspark_abi.validation import EMPTY_BATCH_FIX


@attrs.frozen
class RequestSpec:
    """One checked request of a step: ``num_new`` tokens after ``num_cached`` already in the caches.

    :meth:`BatchBuilder.add` queues the arguments as given; :meth:`BatchBuilder.build` checks them and
    works on these exact copies (Python ints, an int64 token-id array) only.

    Attributes:
        request_id: The serving request id (within int64).
        num_cached: Tokens of the request already in the caches (its first new position).
        num_new: New tokens of the request in this step (>= 0).
        token_ids: [num_new] int64 token ids, or None when the step gives none.
    """

    request_id: int
    num_cached: int
    num_new: int
    token_ids: np.ndarray | None = None


_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)
_COUNT = (0, 2**63 - 1)

#: Fixes of the builder issues whose generic ``builder.request`` hint is not the exact fix.
_ID_FIX = "pass request_id as an integer within int64 (a Python or numpy integer, not bool, float or str)"
_IDS_FIX = ("pass token_ids as a list or 1-D numpy array of integers (no floats, bools, strings or masked "
            "arrays), one id per new token")
_ROWS_FIX = ("pass logit_rows='last', None, or a list / 1-D numpy array of int32 group rows in [0, N) "
             "(-1 for an inactive entry)")


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
        outside = np.flatnonzero((value < lo) | (value > hi))  # numpy compares with Python ints exactly
        if outside.size:
            i = int(outside[0])
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
    """Collects the requests of one prefill step and builds its metadata.

    ``build()`` maps pages through the allocator (all or nothing), derives slots from tables and
    positions, pads to the TP geometry per policy, validates, and only then commits the allocation.
    For chunked prefill, add the same request id in a later step with ``num_cached`` advanced by the
    tokens of its earlier chunks; it keeps its tables.
    """

    def __init__(self, config: ModelConfig, policy: PaddingPolicy, allocator: BlockAllocator, *,
                 validator: StepValidator | None = None, ring_width: Literal["step", "fixed"] = "step"):
        """validator: a serving loop's :class:`~dspark_abi.incremental.StepValidator`, which then validates each
        step at the cost of what it changes instead of the full stateless validation (same verdicts).

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
        self._pending: list[tuple[Any, Any, Any, Any]] = []  # add()'s arguments as given, checked by build()

    def add(self, request_id: int, num_cached: int, num_new: int, token_ids: Sequence[int] | np.ndarray | None = None
            ) -> None:
        """Queue one request for the next :meth:`build` (checked there, all requests at once).

        request_id, num_cached and num_new must be Python or numpy integers (not bool, float or str);
        token_ids a 1-D integer sequence of ``num_new`` ids. They are copied, not converted: a wrong type is
        reported by ``build()``, never truncated.
        """
        if isinstance(token_ids, np.ndarray):
            token_ids = token_ids.copy()           # keeps a subclass, so build() can refuse it
        elif isinstance(token_ids, list):
            token_ids = list(token_ids)
        self._pending.append((request_id, num_cached, num_new, token_ids))

    def clear(self) -> None:
        """Drop the queued requests."""
        self._pending.clear()

    def build(self, *, logit_rows: str | Sequence[int] | None = "last") -> PackedBatch:
        """Validated batch of the queued requests; clears the queue on success.

        logit_rows: 'last' samples the last new token of every non-empty request (-1 for empty ones),
        None leaves them out, or an explicit list of group rows.
        On any error nothing is allocated and the queue is kept, so the caller can fix and retry.
        """
        specs, rows = self._check_specs(list(self._pending), logit_rows)
        ids = [s.request_id for s in specs]
        starts = np.array([s.num_cached for s in specs], dtype=np.int64)
        lengths = np.array([s.num_new for s in specs], dtype=np.int64)
        plan = self.allocator.plan(ids, starts, starts + lengths)
        batch = self._assemble(specs, starts, lengths, plan, rows)
        self.allocator.commit(plan)
        self._pending.clear()
        return batch

    # ------------------------------------------------------------------ internals
    def _check_specs(self, queued: list[tuple[Any, Any, Any, Any]], logit_rows: Any
                     ) -> tuple[list[RequestSpec], str | np.ndarray | None]:
        """Exact copies of the queued requests and of ``logit_rows``; raises every problem at once."""
        issues: list[Issue] = []
        seen: set[int] = set()
        max_pos = self.config.max_position_embeddings
        chunk_cap = self.allocator.max_chunk_tokens
        specs: list[RequestSpec] = []
        news: list[int | None] = []  # one per queued request (None: not an exact count)

        def bad(i: int, arg: str, msg: str, expected: Any, actual: Any, fix: str | None = None) -> None:
            issues.append(Issue("builder.request", arg, msg, index=i, request=i, expected=expected,
                                actual=actual, fix=fix))

        for i, (request_id, num_cached, num_new, token_ids) in enumerate(queued):  # the input is a list of requests
            rid = _exact_int(request_id, *_INT64)
            if rid is None:
                bad(i, "request_id", f"request_id must be an integer within int64, got {_short(request_id)}",
                    "int64 integer", _short(request_id), _ID_FIX)
            elif rid in seen:
                bad(i, "request_id", f"request_id {rid} is already in this step", "unique id", rid,
                    f"add request {rid} once per step (queue its later tokens as the next step's chunk)")
            else:
                seen.add(rid)
            cached, new = _exact_int(num_cached, *_COUNT), _exact_int(num_new, *_COUNT)
            news.append(new)
            for arg, value, exact in (("num_cached", num_cached, cached), ("num_new", num_new, new)):
                if exact is None:
                    bad(i, arg, f"{arg} must be an integer >= 0, got {_short(value)}", "integer >= 0", _short(value))
            if cached is not None and new is not None:
                if cached + new > max_pos:
                    bad(i, "num_new", f"context num_cached + num_new = {cached + new} would exceed "
                        f"max_position_embeddings={max_pos}", f"<= {max_pos}", cached + new,
                        f"stop the request at max_position_embeddings={max_pos}: at most "
                        f"num_new={max(0, max_pos - cached)} after num_cached={cached}")
                if new > chunk_cap:
                    bad(i, "num_new", f"num_new={new} is longer than the {chunk_cap} tokens one request may add in "
                        "one step (the ring tables hold reach + that many positions)", f"<= {chunk_cap}", new,
                        f"split the request into chunks of at most {chunk_cap} tokens over several steps")
                if new == 0 and not self.policy.allow_empty_requests:
                    bad(i, "num_new", "zero-length request not allowed by policy", "> 0", 0,
                        "drop the request from this step or set PaddingPolicy(allow_empty_requests=True)")
            if rid is not None and cached is not None and self.allocator.knows(rid):
                have = self.allocator.cached_tokens(rid)
                if cached != have:
                    bad(i, "num_cached", f"request {rid} continues after {have} cached tokens, got "
                        f"num_cached={cached}", have, cached,
                        f"pass num_cached={have} (the tokens its earlier chunks cached) or release request {rid} "
                        "first")
            tids = None
            if token_ids is not None:
                tids, problem = _int_vector(token_ids, *_INT64)
                if tids is None:
                    bad(i, "token_ids", f"token_ids must be a 1-D sequence of integers, got {problem}",
                        "1-D integer sequence", problem, _IDS_FIX)
                elif new is not None and tids.shape != (new,):
                    bad(i, "token_ids", f"token_ids must hold one id per new token: {tids.size} ids for "
                        f"num_new={new}", (new,), tids.shape, f"pass exactly num_new={new} token_ids")
            if rid is not None and cached is not None and new is not None:  # else an issue was recorded
                specs.append(RequestSpec(rid, cached, new, tids))
        if all(v is not None for v in news):
            total = sum(v for v in news if v is not None)
            if not news or not 1 <= total <= self.policy.token_cap:
                issues.append(Issue("qsl.token_count", "requests", "a batch needs 1..token_cap new tokens",
                                    expected=f"1..{self.policy.token_cap}", actual=total,
                                    fix=EMPTY_BATCH_FIX if total < 1 else None))
        with_ids = {token_ids is None for *_, token_ids in queued}
        if len(with_ids) > 1:
            issues.append(Issue("builder.request", "token_ids", "give token ids for every request or none",
                                expected="all or none", actual="some",
                                fix="pass token_ids to every add() of the step, or to none"))
        rows: str | np.ndarray | None = logit_rows
        if not (logit_rows is None or (isinstance(logit_rows, str) and logit_rows == "last")):
            vec, problem = _int_vector(logit_rows, *_INT32)
            if vec is None:
                issues.append(Issue("builder.request", "logit_rows", "logit_rows must be 'last', None or a 1-D "
                                    f"sequence of int32 group rows, got {problem}", expected="'last', None or "
                                    "int32 rows", actual=problem, fix=_ROWS_FIX))
            rows = None if vec is None else vec.astype(np.int32)
        if issues:
            raise ABIError(issues)
        return specs, rows

    def _assemble(self, specs: list[RequestSpec], starts: np.ndarray, lengths: np.ndarray, plan: StepPlan,
                  logit_rows: str | np.ndarray | None) -> PackedBatch:
        layout, policy = self.config.layout, self.policy
        qsl = np.zeros(len(specs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=qsl[1:])
        n = int(qsl[-1])
        p_rows = policy.padded_rows(n)
        row_request = np.repeat(np.arange(len(specs)), lengths)                        # [N]
        pos = starts[row_request] + (np.arange(n) - qsl[:-1][row_request])             # [N]
        positions = np.empty(p_rows, dtype=np.int32)
        positions[:n] = pos
        positions[n:] = 0 if policy.pad_position == "zero" else pos[-1] + 1 + np.arange(p_rows - n)

        # tables as narrow as the step's widest live range: O(R * pages used), not O(R * max positions)
        tables = self.allocator.step_tables(plan, starts, starts + lengths, fixed_ring=self.fixed_ring)
        slots = {}
        for p in POOL_NAMES:
            pl = layout.pools[p]
            s = np.full(p_rows, -1, dtype=np.int64)
            s[:n] = physical_rows(tables[p], row_request, written_logical(pl, pos), pl.page_size, ring=pl.is_ring)
            slots[p] = s

        token_ids = None
        if specs and specs[0].token_ids is not None:
            token_ids = np.full(p_rows, policy.pad_token_id, dtype=np.int64)
            token_ids[:n] = np.concatenate([s.token_ids for s in specs if s.token_ids is not None])
        # a str is "last" (anything else was refused by _check_specs)
        rows = np.where(lengths > 0, qsl[1:] - 1, -1).astype(np.int32) if isinstance(logit_rows, str) else logit_rows
        arrays = {"query_start_loc": qsl, "positions": positions, "request_ids": request_ids_of(specs)}
        arrays |= {TABLE_FIELDS[p]: t for p, t in tables.items()} | {SLOT_FIELDS[p]: v for p, v in slots.items()}
        arrays |= {k: v for k, v in (("token_ids", token_ids), ("logit_rows", rows)) if v is not None}
        # validated on these private arrays (numpy memory, fast to gather from), then frozen: copied once
        check = None if self.validator is None else self.validator.validate
        return PackedBatch.from_arrays(arrays, self.config, policy, self.allocator.pool_blocks, validator=check)


def request_ids_of(specs: list[RequestSpec]) -> np.ndarray:
    """[R] int64 serving ids of checked requests."""
    return np.array([s.request_id for s in specs], dtype=np.int64)
