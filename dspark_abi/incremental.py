"""`StepValidator`: validation of a serving loop's steps that re-checks only what each step changes or newly reads.

:func:`dspark_abi.validation.validate_arrays` is stateless and costs O(P + live pages): for a request deep into a
1,048,576-position context the compressed pools alone hold thousands of live pages per request, re-proven every
step although only a handful are new. A :class:`StepValidator` lives as long as the serving loop, remembers what
the last *accepted* step proved, and returns for every input **the same report** as ``validate_arrays`` with its
config, policy and pool blocks: ``ok``, and every issue with its code, field, index, request, expected, actual and
count, in the same order (a pool it cannot settle incrementally is checked with the full validator's own calls).

What runs in full every step (O(R + P), the code of :mod:`dspark_abi.rules`)
    the shape level (``validate_arrays(..., level="shape")``), the token rules (``rules.check_tokens``: positions,
    padding rows, token ids, logit rows), the ``tables.width`` lower bound (``rules._check_width``, O(R)) and every
    slot rule (``rules._check_slots``: range, off-boundary, slot vs table through ``physical_rows``, duplicate
    writes, isolation). The *ring* pools (``ori`` and the state rings) are also checked in full by default
    (``ring_pools="exact"``): their live range is the chunk plus a bounded reach, so nearly all their pages are new
    every step and the full check (O(P + R * reach / page)) is cheaper than the bookkeeping; ``ring_pools=
    "tracked"`` tracks them like the compressed pools (same answers, measured slower).

What is remembered after an accepted step (a rejected step leaves all of it as it was)
    per request id (``request_ids``; the batch index when absent) a small internal *handle* h >= 1, its live page
    run ``[first, stop)`` in each tracked pool, and the step's tables of the tracked pools (references to
    immutable arrays: a frozen ``PackedBatch``'s arrays are kept as they are, a caller's writeable array is copied
    once, on acceptance). Per tracked pool, dense arrays over its blocks (allocated once from ``pool_blocks``):
    ``count[b]`` (live-page references to block b), ``sum[b]`` and ``sumsq[b]`` of their handles. "Every reference
    to b comes from handle w" is exactly ``count*w == sum and count*w*w == sumsq`` (the equality case of
    Cauchy-Schwarz), so a block has a *single owner* ``sum // count`` or is *mixed*.

One step, per tracked pool
    A request whose id was in the last accepted step keeps the pages that are live in both steps **and whose table
    cell is unchanged**: the cells are compared vectorized (compressed pools: the overlapping columns, one dense
    compare of the rows; ring pools: the cell of column ``page % width`` in each step's own table, the widths may
    differ). Those pages were proven mapped, in ``[0, blocks)`` and distinct within the request, so they are not
    checked again. The step's first position need not equal the request's last end: the cell comparison alone
    carries the proof, so a restarted or rolled-back request keeps what is unchanged too.
    Everything else is *fresh*: the pages of new requests, pages that entered a live range, overlap pages whose
    cell changed. Pages that left a live range, changed cells' old blocks and the requests gone from the batch (or
    unfit for the page rules now) leave the per-block state, O(their pages).
    The fresh pages get the coverage and block-range checks, and the in-request alias check. An alias needs two
    references to one block, so only fresh pages whose block now has ``count >= 2`` are looked at (none in the
    common case): they alias when two fresh pages of one request map the block, or when the block's other
    references (the state without the fresh ones, which the last accepted step proved alias-free) are all the
    request's own, or are mixed while the request kept pages of this pool. Isolation: every written block
    (O(P), from the slots) must have no reference or the writer as its single owner.
    What these tests find *suspect* is settled by the full validator's calls for that pool
    (``rules._pages_unshared`` / ``rules._check_pages``, O(its live pages)). A suspicion is a real violation
    except in one case valid serving does not produce: a continuing request's fresh page on a block that several
    other requests share (a shared prefix block read by a *new* request is no suspicion).

Costs of a valid step: O(R + P + fresh pages + departing pages + overlap cells), where the overlap cells are one
vectorized compare of the table cells both steps read (no sort, no gather over them, no per-page or per-request
Python). Blocks shared read-only by several requests (prefix sharing) cost nothing extra, where the full
validator falls back to its exact owner map. Memory: 20 bytes per block of each tracked pool, allocated as the
blocks in use reach them (up to the highest block id referenced, doubling), so a validator over huge pools reserves
nothing up front; if that state cannot grow (``MemoryError``), the validator stops tracking and checks every pool
exactly from then on (the same reports). Pools with more than :data:`MAX_TRACKED_BLOCKS` blocks are not tracked (their
dense arrays would outweigh the pool tables). If the handle sums could ever overflow int64 (or a count int32;
never at realistic sizes) the step is validated in full and the state reset, as after any exception inside a
step. Each call holds the validator's lock, but the steps of one loop must come in order: one validator per
serving loop.

Persistent steps (spec 5.9) carry no ``[R, w]`` tables, so they cannot be a baseline without making their full form:
a loop that commits one between two full-form steps calls :meth:`StepValidator.reset` (``BatchBuilder.commit`` does),
and the next full-form step is checked against no baseline (every page fresh, O(live pages) once).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import numpy as np

from dspark_abi._base import expand_ranges
from dspark_abi.batch import PackedBatch, freeze
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue, ValidationReport
from dspark_abi.layout import POOL_NAMES, PoolLayout, PoolName, live_range, page_span, table_column
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import SLOT_FIELDS, TABLE_FIELDS, PoolBlocks
from dspark_abi.rules import _check_pages, _check_slots, _check_width, _Owners, _pages_unshared, check_tokens
from dspark_abi.validation import validate_arrays

#: Pools with more blocks than this keep no per-block state: they are checked exactly (O(live pages)) every step.
MAX_TRACKED_BLOCKS = 2**26
#: Bound on any ``count * handle**2`` of the per-block state (int64 headroom).
_SUM_LIMIT = 2**62


@attrs.frozen
class StepStats:
    """What the last :meth:`StepValidator.validate` call did past the shape level (for tests and tuning).

    Attributes:
        exact: Pools checked exactly, as ``validate_arrays`` does (O(their live pages)): the untracked pools
            (ring pools by default) and the suspect ones.
        suspect: Tracked pools the incremental tests sent to the exact check (a valid serving step has none).
        fresh: Pool -> fresh pages checked (new pages, changed cells).
        departed: Pool -> references that left the per-block state.
        compared: Pool -> overlap cells compared with the last accepted step.
    """

    exact: tuple[PoolName, ...] = ()
    suspect: tuple[PoolName, ...] = ()
    fresh: dict[PoolName, int] = attrs.field(factory=dict)
    departed: dict[PoolName, int] = attrs.field(factory=dict)
    compared: dict[PoolName, int] = attrs.field(factory=dict)


class _Overflow(Exception):
    """The handle sums of a step could overflow int64: validate it in full and start over."""


class _BlockRefs:
    """count / sum / sumsq of the handles of the live-page references to every block of one pool.

    The arrays cover blocks ``[0, capacity)`` and grow (doubling, at most to the pool's block count) when a block
    beyond them is referenced or looked up, so their memory follows the highest block in use, not the pool's
    size: a validator over the largest legal pools reserves nothing up front. Blocks beyond them have no reference.
    """

    #: Blocks covered by the first allocation.
    FIRST_CAPACITY = 1024

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.count = np.zeros(0, dtype=np.int32)
        self.sum = np.zeros(0, dtype=np.int64)
        self.sumsq = np.zeros(0, dtype=np.int64)
        self.total = 0      # references held (bounds every count)

    def cover(self, blocks: np.ndarray) -> None:
        """Grow the arrays to cover ``blocks`` (each in ``[0, n_blocks)``); MemoryError when that cannot be done."""
        need = int(blocks.max(initial=-1)) + 1
        have = self.count.size
        if need <= have:
            return
        size = min(self.n_blocks, max(need, 2 * have, self.FIRST_CAPACITY))
        grown = [np.zeros(size, dtype=a.dtype) for a in (self.count, self.sum, self.sumsq)]
        for new, old in zip(grown, (self.count, self.sum, self.sumsq), strict=True):
            new[:have] = old
        self.count, self.sum, self.sumsq = grown

    def apply(self, blocks: np.ndarray, handles: np.ndarray, sign: int) -> None:
        """Add (sign 1) or remove (sign -1) one reference per (block, handle) pair."""
        if blocks.size == 0:
            return
        self.cover(blocks)
        np.add.at(self.count, blocks, np.int32(sign))
        np.add.at(self.sum, blocks, sign * handles)
        np.add.at(self.sumsq, blocks, sign * handles * handles)
        self.total += sign * int(blocks.size)

    def owner(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(references, single owner handle or -1 when mixed) of each block; the owner is 0 when unreferenced."""
        self.cover(blocks)
        c = self.count[blocks].astype(np.int64)
        s, q = self.sum[blocks], self.sumsq[blocks]
        h = s // np.maximum(c, 1)
        single = (h * c == s) & (h * h * c == q)
        return c, np.where(single, h, -1)


@attrs.frozen
class _Accepted:
    """What the last accepted step proved: per request its handle, per pool its live page runs and tables."""

    sorted_ids: np.ndarray                           # [R] request ids, ascending
    order: np.ndarray                                # [R] batch index of each sorted id
    handles: np.ndarray                              # [R] int64 handle of each batch index
    first: dict[PoolName, np.ndarray]                # [R] first live page (pool)
    stop: dict[PoolName, np.ndarray]                 # [R] one past the last live page (first == stop: none)
    tables: dict[PoolName, np.ndarray]               # the step's block tables (immutable)


def _expand(owner: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ragged runs -> flat (owner, page) pairs: owner[i] yields lo[i] .. hi[i] - 1 (nothing when hi <= lo)."""
    index, page = expand_ranges(lo, np.maximum(hi - lo, 0))
    return owner[index], page


def _cells(pl: PoolLayout, table: np.ndarray, rows: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """int64 table cells of logical ``pages`` of table ``rows`` (ring pools: column page % width)."""
    cells: np.ndarray = table[rows, table_column(pl, pages, table.shape[1])].astype(np.int64)
    return cells


@attrs.frozen(eq=False)
class Proposal:
    """A step :meth:`StepValidator.propose` accepted but that is not the baseline yet: :meth:`StepValidator.accept`
    makes it the baseline (after the step's commit); any other validation first puts the state back as it was."""

    deltas: tuple[_Delta, ...]
    before: _Accepted | None          # the baseline the step was checked against
    after: _Accepted                  # what the step proved


@attrs.frozen
class _Delta:
    """One pool's change of the per-block state in this step (to undo it when the step is rejected)."""

    pool: PoolName
    removed: tuple[np.ndarray, np.ndarray]
    added: tuple[np.ndarray, np.ndarray]
    compared: int


class StepValidator:
    """Validates the steps of one serving loop incrementally; every report equals ``validate_arrays``'s.

    Construct once per serving loop with the loop's config, policy and pool blocks; call :meth:`validate` on every
    step's batch (or flat arrays) in order; :meth:`reset` forgets everything (e.g. after the caches were rebuilt).
    Only accepted steps (``report.ok``) become the baseline of the next one. A loop that may drop a validated step
    (build, drop, build again) uses :meth:`propose` and :meth:`accept` instead, as ``BatchBuilder`` does: the step
    becomes the baseline only when it is committed. ``ring_pools="tracked"`` keeps state
    for the ring pools too (default ``"exact"``: they are checked in full, which is cheaper). See the module
    docstring for the design and its costs.

        >>> from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy
        >>> from dspark_abi.allocator import pool_blocks_for
        >>> from dspark_abi.presets import TINY
        >>> alloc = BlockAllocator(TINY, pool_blocks_for(TINY, [600, 600]))
        >>> builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2), alloc)
        >>> validator = StepValidator(TINY, builder.policy, alloc.pool_blocks)
        >>> for step in range(3):                  # request 0 in chunks of 200 tokens, request 1 leaves
        ...     builder.add(0, 200 * step, 200)
        ...     if step < 2:
        ...         builder.add(1, 150 * step, 150)
        ...     batch = builder.build()
        ...     report = validator.validate(batch)
        ...     builder.commit(batch)              # the allocator advances once the step's forward ran
        ...     stats = validator.last_stats
        ...     print(report.ok, stats.fresh["csa_cmp"], stats.compared["csa_cmp"], stats.departed["csa_cmp"])
        True 4 0 0
        True 3 4 0
        True 1 4 3
    """

    def __init__(self, config: ModelConfig, policy: PaddingPolicy, pool_blocks: PoolBlocks | Mapping[str, int], *,
                 ring_pools: Literal["exact", "tracked"] = "exact"):
        if ring_pools not in ("exact", "tracked"):
            raise ABIError([Issue("config.invalid", "ring_pools", "ring_pools must be 'exact' or 'tracked'",
                                  expected=["exact", "tracked"], actual=repr(ring_pools),
                                  fix="pass ring_pools='exact' (the default) or ring_pools='tracked'")])
        self.config, self.policy, self.pool_blocks = config, policy, pool_blocks
        self.ring_pools = ring_pools
        self._layout = config.layout
        try:
            self._blocks: PoolBlocks | None = PoolBlocks.from_mapping(pool_blocks)
        except ABIError:
            self._blocks = None        # every step reports the pools.blocks issue (validate_arrays' shape level)
        self._lock = threading.Lock()
        self._refs: dict[PoolName, _BlockRefs] = {}
        self._untracked = False    # True once per-block state could not be allocated (every pool checked exactly)
        self._accepted: _Accepted | None = None
        self._proposal: Proposal | None = None        # the step proposed last, applied to _refs, not accepted
        self.last_stats = StepStats()
        self.reset()

    def reset(self) -> None:
        """Forget every accepted step: the next step is checked as if it were the first."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._accepted = self._proposal = None
        blocks = self._blocks
        ring = self.ring_pools == "tracked"
        self._refs = {} if blocks is None or self._untracked else {
            p: _BlockRefs(blocks[p]) for p in POOL_NAMES
            if blocks[p] <= MAX_TRACKED_BLOCKS and (ring or not self._layout.pools[p].is_ring)}

    @property
    def tracked_pools(self) -> tuple[PoolName, ...]:
        """Pools with per-block state (the others are checked exactly every step)."""
        return tuple(self._refs)

    def validate(self, batch_or_arrays: PackedBatch | Mapping[str, Any], *, hidden: Any = None) -> ValidationReport:
        """Validate one step (a :class:`PackedBatch` or flat ABI arrays, with optional hidden rows).

        Returns the report ``validate_arrays(arrays, config, policy, pool_blocks, hidden=hidden)`` would (this
        validator's config, policy and pool blocks, also for a batch built with others). Never raises for bad
        data, never mutates its input; an accepted step becomes the baseline of the next call.
        """
        report, proposal = self._validate(batch_or_arrays, hidden)
        if proposal is not None:
            self.accept(proposal)
        return report

    def propose(self, batch_or_arrays: PackedBatch | Mapping[str, Any], *, hidden: Any = None
                ) -> tuple[ValidationReport, Proposal | None]:
        """:meth:`validate`'s report, without making the step the baseline: a valid step returns a
        :class:`Proposal` that :meth:`accept` makes the baseline (once the step is committed). Until then the
        baseline stays the last accepted step: the next :meth:`validate` or :meth:`propose` call checks against it
        (a proposal left unaccepted is dropped then)."""
        return self._validate(batch_or_arrays, hidden)

    def accept(self, proposal: Proposal) -> None:
        """Make a proposed step the baseline of the next one. A proposal that is not the latest one (another step
        was validated or proposed since) cannot be applied any more: the validator then forgets every step
        (:meth:`reset`) and validates the next in full, with the same verdicts."""
        with self._lock:
            if proposal is self._proposal:
                self._proposal = None
            else:
                self._drop_proposal()
                self._reset()

    def _drop_proposal(self) -> None:
        """Put the state back as the last accepted step left it (a proposed step was never accepted)."""
        proposal, self._proposal = self._proposal, None
        if proposal is not None:
            self._undo(list(proposal.deltas))
            self._accepted = proposal.before

    def _validate(self, batch_or_arrays: PackedBatch | Mapping[str, Any], hidden: Any
                  ) -> tuple[ValidationReport, Proposal | None]:
        arrays = batch_or_arrays.to_arrays() if isinstance(batch_or_arrays, PackedBatch) else batch_or_arrays
        with self._lock:
            self._drop_proposal()
            shape = validate_arrays(arrays, self.config, self.policy, self.pool_blocks, hidden=hidden, level="shape")
            if not shape.ok or self._blocks is None:
                return shape, None
            try:
                return self._step(arrays, self._blocks, hidden)
            except _Overflow:
                self._reset()
                return validate_arrays(arrays, self.config, self.policy, self.pool_blocks, hidden=hidden), None
            except MemoryError:  # a pool's per-block state cannot grow: check every pool exactly from now on
                self._refs, self._accepted, self._proposal, self._untracked = {}, None, None, True
                return validate_arrays(arrays, self.config, self.policy, self.pool_blocks, hidden=hidden), None

    # ------------------------------------------------------------------ one step (shapes known to be right)
    def _step(self, arrays: Mapping[str, Any], blocks: PoolBlocks, hidden: Any
              ) -> tuple[ValidationReport, Proposal | None]:
        config, window = self.config, self.config.sliding_window
        qsl: np.ndarray = arrays["query_start_loc"]
        n = int(qsl[-1])
        tables: dict[PoolName, np.ndarray] = {p: arrays[TABLE_FIELDS[p]] for p in POOL_NAMES}
        slots: dict[PoolName, np.ndarray] = {p: arrays[SLOT_FIELDS[p]] for p in POOL_NAMES}
        issues: list[Issue] = []
        row_request, pos, start, end, live, ok_req = check_tokens(
            issues, config=config, policy=self.policy, qsl=qsl, n_tokens=n, n_rows=self.policy.padded_rows(n),
            positions=arrays["positions"], slots=slots, token_ids=arrays.get("token_ids"),
            logit_rows=arrays.get("logit_rows"), hidden=None if hidden is None else np.asarray(hidden),
            verify_widths=arrays.get("verify_widths"), logit_mode=arrays.get("logit_mode"),
            ring_widths={p: t.shape[1] for p, t in tables.items()})

        n_req = start.size
        ids = arrays.get("request_ids")
        ids = np.arange(n_req, dtype=np.int64) if ids is None else ids
        match, handles = self._match(ids)
        first: dict[PoolName, np.ndarray] = {}
        stop: dict[PoolName, np.ndarray] = {}
        deltas: list[_Delta] = []
        exact: list[PoolName] = []
        suspects: list[PoolName] = []
        try:
            for p in POOL_NAMES:
                pl, table, n_blocks, slot = self._layout.pools[p], tables[p], blocks[p], slots[p][:n]
                if not _check_width(issues, pl, table, start, np.where(ok_req, end, start), window):
                    continue     # as validate_arrays: no page or slot rule of this pool (the step is rejected)
                refs = self._refs.get(p)
                if refs is not None:
                    span = page_span(*live_range(pl, start, end, window), pl.page_size)
                    first[p], stop[p] = (np.where(ok_req, a, 0) for a in span)
                    delta, suspect = self._pool_delta(pl, refs, table, n_blocks, first[p], stop[p], match, handles)
                    deltas.append(delta)
                    suspect |= self._foreign_suspect(refs, pl, slot, n_blocks, row_request, ok_req, handles)
                    if not suspect:  # proven: no page issue, no foreign write (every written block has no
                        # reference or the writer's alone), which the owner map _check_slots may ask for says
                        _check_slots(issues, pl, n_blocks, table, slot, pos, row_request, live, None,
                                     functools.partial(self._writer_owners, refs, pl, slot, n_blocks, row_request))
                        continue
                    suspects.append(p)
                exact.append(p)   # as validate_arrays does: the same calls, the same issues
                args = (pl, n_blocks, table, start, end, ok_req, window)
                owners = None if _pages_unshared(*args) else _check_pages(issues, *args)
                _check_slots(issues, pl, n_blocks, table, slot, pos, row_request, live, owners,
                             functools.partial(_check_pages, [], *args))
        except BaseException:    # _Overflow, or an error half-way through a pool: start over from nothing
            self._reset()
            raise
        self.last_stats = StepStats(tuple(exact), tuple(suspects), {d.pool: int(d.added[0].size) for d in deltas},
                                    {d.pool: int(d.removed[0].size) for d in deltas},
                                    {d.pool: d.compared for d in deltas})
        if issues:
            self._undo(deltas)
            return ValidationReport(tuple(issues)), None
        order = np.argsort(ids, kind="stable")
        proposal = Proposal(tuple(deltas), self._accepted,
                            _Accepted(ids[order], order, handles, first, stop,
                                      {p: freeze(tables[p], TABLE_FIELDS[p]) for p in self._refs}))
        self._proposal, self._accepted = proposal, proposal.after
        return ValidationReport(()), proposal

    def _match(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([R] batch index of each request in the last accepted step or -1, [R] int64 handles >= 1)."""
        prev = self._accepted
        match = np.full(ids.size, -1, dtype=np.int64)
        if prev is not None and prev.sorted_ids.size:
            at = np.minimum(np.searchsorted(prev.sorted_ids, ids), prev.sorted_ids.size - 1)
            found = prev.sorted_ids[at] == ids
            match[found] = prev.order[at[found]]
        handles = np.zeros(ids.size, dtype=np.int64)
        known = match >= 0
        if prev is not None:
            handles[known] = prev.handles[match[known]]
        fresh = int((~known).sum())
        used = np.zeros(int(handles.max(initial=0)) + fresh + 2, dtype=bool)
        used[0] = True
        used[handles[known]] = True
        handles[~known] = np.flatnonzero(~used)[:fresh]      # the smallest handles no continuing request holds
        return match, handles

    def _pool_delta(self, pl: PoolLayout, refs: _BlockRefs, table: np.ndarray, n_blocks: int, first: np.ndarray,
                    stop: np.ndarray, match: np.ndarray, handles: np.ndarray) -> tuple[_Delta, bool]:
        """Move one pool's per-block state from the last accepted step to this one; True when the fresh pages
        need the exact page check (unmapped, out of range or possibly aliased).

        Three phases: the overlap with the last accepted step (:meth:`_changed_cells`), the references that
        depart (:meth:`_departing`), and the fresh pages, applied to the per-block state (:meth:`_apply_fresh`)."""
        p = pl.name
        prev = self._accepted
        if prev is None:
            p_first = p_stop = p_handles = np.zeros(0, dtype=np.int64)
            p_table = table
        else:
            p_first, p_stop, p_handles, p_table = prev.first[p], prev.stop[p], prev.handles, prev.tables[p]
        known = match >= 0
        j = np.where(known, match, 0)
        o_lo = np.where(known, np.maximum(first, p_first[j] if p_first.size else 0), 0)
        o_hi = np.where(known, np.minimum(stop, p_stop[j] if p_stop.size else 0), 0)
        overlap = known & (o_hi > o_lo)
        o_lo, o_hi = np.where(overlap, o_lo, stop), np.where(overlap, o_hi, stop)   # no overlap: [stop, stop)
        n_compared = int((o_hi - o_lo)[overlap].sum())
        c_req, _page, old, new = self._changed_cells(pl, table, p_table, overlap, o_lo, o_hi, match)
        removed = self._departing(pl, p_table, p_first, p_stop, p_handles, overlap, o_lo, o_hi, match,
                                  old, handles[c_req])
        added, suspect = self._apply_fresh(pl, refs, table, n_blocks, first, stop, o_lo, o_hi, overlap, handles,
                                           c_req, new, removed)
        return _Delta(p, removed, added, n_compared), suspect

    @staticmethod
    def _changed_cells(pl: PoolLayout, table: np.ndarray, p_table: np.ndarray, overlap: np.ndarray,
                       o_lo: np.ndarray, o_hi: np.ndarray, match: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(request, page, old block, new block) of the overlap pages whose table cell changed since the last
        accepted step (unchanged cells keep their proof)."""
        rows = np.flatnonzero(overlap)
        empty = np.zeros(0, dtype=np.int64)
        if pl.is_ring:
            c_req, c_page = _expand(rows, o_lo[rows], o_hi[rows])
            old = _cells(pl, p_table, match[c_req], c_page)
            new = _cells(pl, table, c_req, c_page)
            changed = old != new
            return c_req[changed], c_page[changed], old[changed], new[changed]
        if not rows.size:
            return empty, empty, empty, empty
        width = int(o_hi[rows].max())           # compressed: the overlap is columns [0, o_hi), one dense compare
        cur, before = table[:, :width], p_table[:, :width]
        if rows[-1] == rows.size - 1 and np.array_equal(match[rows], rows):
            cur, before = cur[: rows.size], before[: rows.size]    # same batch order: compare views, no copy
        else:
            cur, before = np.take(cur, rows, axis=0), np.take(before, match[rows], axis=0)
        diff = cur != before                    # cells past a row's overlap may differ (unconstrained there)
        lead = diff.argmax(axis=1)              # each row's first differing column (0 when none)
        inside = diff[np.arange(rows.size), lead] & (lead < o_hi[rows])
        if not inside.any():
            return empty, empty, empty, empty
        sub = np.flatnonzero(inside)
        diff = diff[sub] & (np.arange(width) < o_hi[rows[sub], None])
        at, c_page = np.nonzero(diff)
        c_req, at = rows[sub[at]], sub[at]
        return c_req, c_page, before[at, c_page].astype(np.int64), cur[at, c_page].astype(np.int64)

    @staticmethod
    def _departing(pl: PoolLayout, p_table: np.ndarray, p_first: np.ndarray, p_stop: np.ndarray,
                   p_handles: np.ndarray, overlap: np.ndarray, o_lo: np.ndarray, o_hi: np.ndarray,
                   match: np.ndarray, old: np.ndarray, old_handles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, handles) of the references that leave the per-block state: the previous pages outside this
        step's overlap (whole runs of requests gone or unfit now) and the old blocks of changed cells."""
        keep_lo, keep_hi = p_stop.copy(), p_stop.copy()          # no overlap: keep [stop, stop), all departs
        keep_lo[match[overlap]], keep_hi[match[overlap]] = o_lo[overlap], o_hi[overlap]
        if np.array_equal(keep_lo, p_first) and np.array_equal(keep_hi, p_stop):
            return old, old_handles                              # every previous page kept (the common case)
        prev_idx = np.arange(p_first.size, dtype=np.int64)
        gone_j, gone_page = _expand(np.concatenate([prev_idx, prev_idx]), np.concatenate([p_first, keep_hi]),
                                    np.concatenate([keep_lo, p_stop]))
        return (np.concatenate([_cells(pl, p_table, gone_j, gone_page), old]),
                np.concatenate([p_handles[gone_j], old_handles]))

    def _apply_fresh(self, pl: PoolLayout, refs: _BlockRefs, table: np.ndarray, n_blocks: int, first: np.ndarray,
                     stop: np.ndarray, o_lo: np.ndarray, o_hi: np.ndarray, overlap: np.ndarray, handles: np.ndarray,
                     c_req: np.ndarray, new: np.ndarray, removed: tuple[np.ndarray, np.ndarray]
                     ) -> tuple[tuple[np.ndarray, np.ndarray], bool]:
        """Swap the departing references for the fresh ones (this step's pages outside the overlap and the new
        blocks of changed cells) in ``refs``; ((blocks, handles) added, whether the fresh pages are suspect)."""
        all_req = np.arange(first.size, dtype=np.int64)
        f_req, f_page = _expand(np.concatenate([all_req, all_req]), np.concatenate([first, o_hi]),
                                np.concatenate([o_lo, stop]))
        f_blk = np.concatenate([_cells(pl, table, f_req, f_page), new])
        f_req = np.concatenate([f_req, c_req])
        bad = (f_blk < 0) | (f_blk >= n_blocks)
        suspect = bool(bad.any())
        added_blocks, added_handles = f_blk[~bad], handles[f_req[~bad]]

        h_max = int(handles.max(initial=0))
        total = refs.total + added_blocks.size
        if total >= 2**31 or total * h_max * h_max >= _SUM_LIMIT:
            raise _Overflow
        refs.apply(*removed, -1)
        refs.apply(added_blocks, added_handles, 1)
        shared = refs.count[added_blocks] > 1         # an alias needs two references to one block
        if shared.any():
            kept = overlap[f_req[~bad]]                # requests that kept pages of this pool from the last step
            suspect |= self._alias_suspect(refs, added_blocks[shared], added_handles[shared], kept[shared])
        return (added_blocks, added_handles), suspect

    @staticmethod
    def _alias_suspect(refs: _BlockRefs, blk: np.ndarray, handle: np.ndarray, kept: np.ndarray) -> bool:
        """Whether fresh references (handle, blk) may alias a page of their own request. ``blk`` holds every fresh
        reference to these blocks (all blocks with two references or more); ``kept``: the request kept pages of
        this pool. The kept references (the state without the fresh ones) have no alias among themselves (the
        last accepted step proved them), so an alias is two fresh references of one request, or a fresh one
        meeting kept references that are its own request's alone, or mixed ones when it kept pages (then
        possibly its own: the exact check decides)."""
        order = np.lexsort((handle, blk))
        b, h, k = blk[order], handle[order], kept[order]
        if bool(((b[1:] == b[:-1]) & (h[1:] == h[:-1])).any()):
            return True
        head = np.flatnonzero(np.concatenate(([True], b[1:] != b[:-1])))   # per block: its fresh references
        fresh_count = np.diff(np.append(head, b.size))
        fresh_sum = np.add.reduceat(h, head)
        fresh_sumsq = np.add.reduceat(h * h, head)
        ub = b[head]
        count = refs.count[ub].astype(np.int64) - fresh_count
        s, q = refs.sum[ub] - fresh_sum, refs.sumsq[ub] - fresh_sumsq
        owner = s // np.maximum(count, 1)
        single = (owner * count == s) & (owner * owner * count == q)
        kept_owner = np.repeat(np.where(count > 0, np.where(single, owner, -1), 0), fresh_count)
        return bool((((kept_owner < 0) & k) | (kept_owner == h)).any())

    @staticmethod
    def _written(pl: PoolLayout, slot: np.ndarray, n_blocks: int, row_request: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(block, writer batch index) of every in-range slot a live row writes (the rows isolation covers)."""
        w = np.flatnonzero((slot >= 0) & (slot < n_blocks * pl.page_size))
        return slot[w] // pl.page_size, row_request[w]

    @staticmethod
    def _runs(blk: np.ndarray, writer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first (block, writer) pair of every run of equal consecutive pairs (rows of a page come together)."""
        if blk.size < 2:
            return blk, writer
        start = np.ones(blk.size, dtype=bool)
        start[1:] = (blk[1:] != blk[:-1]) | (writer[1:] != writer[:-1])
        return blk[start], writer[start]

    def _foreign_suspect(self, refs: _BlockRefs, pl: PoolLayout, slot: np.ndarray, n_blocks: int,
                         row_request: np.ndarray, ok_req: np.ndarray, handles: np.ndarray) -> bool:
        """True when some written block is referenced by a live page that is not the writer's."""
        blk, writer = self._runs(*self._written(pl, slot, n_blocks, row_request))
        count, single = refs.owner(blk)
        writer_handle = np.where(ok_req[writer], handles[writer], 0)    # a request unfit for page rules owns none
        return bool(((count > 0) & (single != writer_handle)).any())

    def _writer_owners(self, refs: _BlockRefs, pl: PoolLayout, slot: np.ndarray, n_blocks: int,
                       row_request: np.ndarray) -> _Owners:
        """The owners ``rules._check_slots`` looks written blocks up in, once none is foreign: each referenced
        written block is owned by its writer alone."""
        blk, writer = self._written(pl, slot, n_blocks, row_request)
        refs.cover(blk)
        used = refs.count[blk] > 0
        blk, writer = blk[used], writer[used]
        uniq, at = np.unique(blk, return_index=True)
        owner = writer[at].astype(np.int32)
        return _Owners(uniq, owner, owner, False)

    def _undo(self, deltas: list[_Delta]) -> None:
        """Put the per-block state back as the last accepted step left it."""
        for d in reversed(deltas):
            refs = self._refs[d.pool]
            refs.apply(*d.added, -1)
            refs.apply(*d.removed, 1)
