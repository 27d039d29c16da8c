"""`BlockAllocator`: the serving side's free lists and per-request tables of the seven pools.

It persists across steps. Each step maps every page a request reads or writes in that call
(window, compressed history, state history) and recycles the pages of the four ring pools (``ori`` and
the state pools) that fell out of their reach, so a request holds at most ``ring_width`` blocks of each
ring pool whatever its context length. Ring tables are ``ring_width`` columns wide (page ``i`` in column
``i % ring_width``); the compressed pools' tables cover the whole context, and a step gets them trimmed
to its widest live range. A step is all or nothing: if any pool is short, :class:`ABIError`
``alloc.exhausted`` is raised and no table or free list changes.

Thread safety: every public method is atomic (one re-entrant lock, :attr:`BlockAllocator.lock`). A step
is two calls, :meth:`~BlockAllocator.plan` (in ``BatchBuilder.build``) then :meth:`~BlockAllocator.commit` (in
``BatchBuilder.commit``, after the step's forward); a plan that another commit or release overtook is refused
with ``alloc.stale_plan`` (nothing changes), see the class docstring.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from dspark_abi._base import expand_ranges
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_abi.layout import (
    MAX_CHUNK_TOKENS,
    POOL_NAMES,
    PoolLayout,
    PoolName,
    live_range,
    page_span,
    table_column,
)
from dspark_abi.persistent import PersistentTables, narrow_tables, step_widths
from dspark_abi.pools import PoolBlocks

Cells = tuple[np.ndarray, np.ndarray, np.ndarray]


@attrs.frozen
class StepPlan:
    """What one step would change: per pool, the table cells to map and the cells to release.

    Attributes:
        request_ids: The step's request ids, in batch order.
        new_ids: Those the allocator did not know before the step.
        rows: [R] allocator table row of each request (provisional for new ones until the commit).
        map_cells: Pool -> (rows, logical pages, blocks) the step maps.
        release_cells: Pool -> (rows, logical pages, blocks) the step releases (ring pages out of reach).
        ends: [R] cached tokens of each request after the step.
        mapped: Pool -> ([R] first, [R] one past the last) logical page each request holds after the step.
        owner: Token of the allocator that made the plan.
        generation: The allocator's generation the plan was made on.
    """

    request_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    rows: np.ndarray
    map_cells: dict[PoolName, Cells]
    release_cells: dict[PoolName, Cells]
    ends: np.ndarray
    mapped: dict[PoolName, tuple[np.ndarray, np.ndarray]]
    owner: object = None
    generation: int = -1


class BlockAllocator:
    """Free lists and per-request block tables of all seven pools.

    pool_blocks: physical blocks per pool (``PoolBlocks`` or a mapping pool -> int). Blocks are handed
    out lowest id first, so runs are deterministic.

    **Threads.** One allocator may be shared by several threads (e.g. one ``BatchBuilder`` each). Every
    public method (``plan``, ``commit``, ``release``, ``free_blocks``, ``knows``, ``cached_tokens``,
    ``table_rows``) runs under :attr:`lock`, a re-entrant lock, so none sees or leaves a half-made change.
    A step is *two* calls, ``plan`` then ``commit``: ``BatchBuilder.build`` plans, assembles and validates the
    batch, ``BatchBuilder.commit(batch)`` commits its plan once the forward ran. Each commit and release
    advances a generation counter; ``commit`` refuses a plan made on an older generation, or by another
    allocator, with :class:`ABIError` ``alloc.stale_plan`` and changes nothing (build the step again). To make
    a whole step atomic, hold the lock from build to commit. Threads must not share one request id (nor one
    ``BatchBuilder``, whose queue is not locked).
    """

    def __init__(self, config: ModelConfig, pool_blocks: PoolBlocks | Mapping[str, int], *, capacity: int = 16):
        self.config = config
        self.layout = config.layout
        self.pool_blocks = PoolBlocks.from_mapping(pool_blocks)
        # free stacks hold ids in descending order so that popping from the end yields ascending ids
        # free stacks: ``_free[p][:_top[p]]`` holds the free ids, in descending order so that popping from the top
        # yields ascending ids; pushing and popping touch only the blocks moved, never the whole pool
        self._top: dict[str, int] = {p: self.pool_blocks[p] for p in POOL_NAMES}
        self._free: dict[str, np.ndarray] = {p: np.arange(self.pool_blocks[p] - 1, -1, -1, dtype=np.int32)
                                             for p in POOL_NAMES}
        # the tables, one row ("slot") per request, live in the persistent form (spec 5.9) and are written in place;
        # the logical pages a request holds are always one run [first, end) (ring pools recycle its front)
        self._persistent = PersistentTables(config, self.pool_blocks, capacity)
        self._alias_persistent()
        self._row_of: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self._spare_rows: list[int] = list(range(capacity - 1, -1, -1))
        self._lock = threading.RLock()
        self._generation = 0          # advanced by every commit and release; plans record it
        self._token = object()        # identifies this allocator's plans

    def _alias_persistent(self) -> None:
        """The allocator writes the persistent tables' own dictionaries (one home for tables and runs)."""
        self._tables = self._persistent._tables
        self._first, self._end = self._persistent._first, self._persistent._end

    @property
    def persistent(self) -> PersistentTables:
        """The persistent block tables (spec 5.9): one row per request slot, updated in place by every commit and
        release; readers get read-only views. Steps of ``BatchBuilder.build(form="persistent")`` refer to them."""
        return self._persistent

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every method takes; hold it around ``plan`` .. ``commit`` (from
        ``BatchBuilder.build()`` to ``BatchBuilder.commit(batch)``) to make a whole step atomic with respect to
        other threads."""
        return self._lock

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockAllocator:
        """An independent snapshot (free lists, tables, cached counts) with its own lock and plan identity:
        plans made on the original are stale for the copy and vice versa."""
        with self._lock:
            clone = copy.copy(self)
            for name in ("_free", "_top", "_persistent", "_row_of", "_cached", "_spare_rows"):
                setattr(clone, name, copy.deepcopy(getattr(self, name), memo))
            clone._alias_persistent()
        clone._lock = threading.RLock()
        clone._token = object()
        return clone

    # ------------------------------------------------------------------ queries
    @property
    def max_chunk_tokens(self) -> int:
        """Most new tokens one request may add in one step: a longer chunk would wrap a ring table onto itself
        (unlimited, i.e. ``max_position_embeddings``, when every ring table is as wide as the context)."""
        narrow = any(pl.ring_width < pl.table_width for pl in self.layout if pl.is_ring)
        return MAX_CHUNK_TOKENS if narrow else self.config.max_position_embeddings

    def held_blocks(self, request_id: int) -> dict[PoolName, int]:
        """Pool -> blocks ``request_id`` holds now (bounded by ``ring_width`` in the ring pools)."""
        with self._lock:
            if request_id not in self._row_of:
                raise ABIError([_unknown(request_id)])
            row = self._row_of[request_id]
            return {p: int((self._tables[p][row] >= 0).sum()) for p in POOL_NAMES}

    def free_blocks(self, pool: str) -> int:
        with self._lock:
            return self._top[pool]

    def knows(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self._row_of

    def cached_tokens_of(self, request_ids: Sequence[int]) -> np.ndarray:
        """[R] int64 cached tokens of each request, -1 for one this allocator does not know (one lock, no raise)."""
        with self._lock:
            get = self._cached.get
            return np.array([get(r, -1) for r in request_ids], dtype=np.int64)

    def cached_tokens(self, request_id: int) -> int:
        """Tokens of ``request_id`` whose caches earlier steps wrote (its next start position)."""
        with self._lock:
            if request_id not in self._cached:
                raise ABIError([_unknown(request_id)])
            return self._cached[request_id]

    def table_rows(self, request_ids: Sequence[int], plan: StepPlan | None = None) -> dict[PoolName, np.ndarray]:
        """pool -> [R, width] int32 copy of the block tables of ``request_ids`` (in that order): the allocator's
        own tables, ``ring_width`` columns for ring pools and ``table_width`` for compressed pools (a step's
        narrower tables come from :meth:`step_tables`).

        With ``plan`` (made by :meth:`plan` on this allocator, not yet committed): the tables as they will be
        once it is committed, its releases and new mappings applied; ``request_ids`` may then name the plan's
        new requests too. This is how :class:`~dspark_abi.builder.BatchBuilder` gets a step's tables. A plan
        another commit or release overtook raises ``alloc.stale_plan``.
        """
        with self._lock:
            if plan is not None:
                self._check_current(plan)
            planned = {} if plan is None else dict(zip(plan.request_ids, plan.rows.tolist(), strict=True))
            unknown = [i for i, r in enumerate(request_ids) if r not in self._row_of and r not in planned]
            if unknown:
                raise ABIError([_unknown(request_ids[unknown[0]], index=unknown[0], count=len(unknown))])
            rows = np.array([self._row_of.get(r, planned.get(r)) for r in request_ids], dtype=np.int64)
            tables = {p: self._tables[p][rows] for p in POOL_NAMES}
            if plan is not None:  # the step's tables = current rows - this plan's releases + its new mappings
                for p in POOL_NAMES:
                    pl, table = self.layout.pools[p], tables[p]
                    r_rows, r_pages, _ = plan.release_cells[p]
                    m_rows, m_pages, m_blocks = plan.map_cells[p]
                    for cell_rows, pages, blocks in ((r_rows, r_pages, None), (m_rows, m_pages, m_blocks)):
                        at, found = _positions(rows, cell_rows)
                        column = table_column(pl, pages[found], pl.ring_width)
                        table[at, column] = -1 if blocks is None else blocks[found]
            return tables

    def step_tables(self, plan: StepPlan, starts: np.ndarray, ends: np.ndarray, *, fixed_ring: bool = False,
                    ring_floor: Mapping[PoolName, int] | None = None) -> dict[PoolName, np.ndarray]:
        """pool -> [R, width] int32 tables of the step ``plan`` was made for (requests with new positions
        ``[starts, ends)``), as they will be once it is committed, each as narrow as the step allows.

        The width is the most pages any non-empty request's live range spans (at least 1), or for the ring
        pools with ``fixed_ring`` their ``ring_width`` (the same shape every step); ``ring_floor`` gives ring pools
        a least width (a verify step's headroom, :func:`~dspark_abi.layout.verify_headroom`). A ring pool's table
        holds each live page ``i`` in column ``i % width`` and -1 elsewhere; a compressed pool's table is the
        first ``width`` columns of the allocator's. Empty requests read nothing: their ring rows are -1.
        Cost O(R + live pages of the ring pools + R * width of the compressed pools), never O(R * context).
        """
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        window = self.config.sliding_window
        with self._lock:
            self._check_current(plan)
            widths = step_widths(self.layout, window, starts, ends, fixed_ring=fixed_ring, ring_floor=ring_floor)
            return narrow_tables(self.layout, window, self._tables, plan.rows, starts, ends, widths, plan.map_cells)

    # ------------------------------------------------------------------ planning
    def plan(self, request_ids: Sequence[int], starts: np.ndarray, ends: np.ndarray) -> StepPlan:
        """Compute the mappings a step needs; raises ``alloc.exhausted`` (changing nothing) if short.

        The plan is valid until the next commit or release on this allocator (see the class docstring)."""
        with self._lock:
            return self._plan(request_ids, starts, ends)

    def _plan(self, request_ids: Sequence[int], starts: np.ndarray, ends: np.ndarray) -> StepPlan:
        new_ids = tuple(r for r in request_ids if r not in self._row_of)
        if len(new_ids) > len(self._spare_rows):
            self._grow(len(self._row_of) + len(new_ids))
        spare = iter(reversed(self._spare_rows))
        provisional = {r: next(spare) for r in new_ids}
        rows = np.array([self._row_of.get(r, provisional.get(r)) for r in request_ids], dtype=np.int64)
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        to_map: dict[PoolName, tuple[np.ndarray, np.ndarray]] = {}
        release_cells: dict[PoolName, Cells] = {}
        mapped: dict[PoolName, tuple[np.ndarray, np.ndarray]] = {}
        short: list[Issue] = []
        fresh = np.isin(rows, list(provisional.values()))      # rows of requests new in this step
        for p in POOL_NAMES:
            pl = self.layout.pools[p]
            released = self._plan_release(pl, rows, starts, ends, fresh)
            cells = self._plan_map(pl, rows, starts, ends, fresh)
            available = self._top[p] + released[0].size
            if cells[0].size > available:
                short.append(Issue("alloc.exhausted", f"pool_blocks.{p}",
                                   f"pool {p!r} has {available} free blocks, this step needs {cells[0].size}",
                                   expected=f">= {cells[0].size} free", actual=available))
                continue
            to_map[p], release_cells[p] = cells, released
            mapped[p] = self._mapped_after(pl, rows, starts, ends, fresh)
        if short:
            raise ABIError(short)
        # blocks are assigned in plan order: released blocks are reused first, then the free stack
        map_cells: dict[PoolName, Cells] = {}
        for p in POOL_NAMES:
            r_rows, r_pages = to_map[p]
            recycled, top = release_cells[p][2].astype(np.int32), self._top[p]
            reused = recycled[: r_rows.size]
            popped = self._free[p][top - (r_rows.size - reused.size): top][::-1]
            map_cells[p] = (r_rows, r_pages, np.concatenate([reused, popped]))
        return StepPlan(tuple(request_ids), new_ids, rows, map_cells, release_cells, ends, mapped,
                        owner=self._token, generation=self._generation)

    def _plan_map(self, pl: PoolLayout, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                  fresh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, pages) of the pages the step touches that are not mapped yet (empty requests keep their
        live range mapped too), requests in batch order and pages ascending within each.

        Cost O(R + pages mapped now): the pages a request already holds are one run ``[first, end)``, so only
        the parts of its live range outside that run are enumerated, never its whole history."""
        a, b = page_span(*live_range(pl, starts, ends, self.config.sliding_window), pl.page_size)
        first = np.where(fresh, 0, self._first[pl.name][rows])
        end = np.where(fresh, 0, self._end[pl.name][rows])
        below = np.clip(np.minimum(b, first) - a, 0, None)          # [a, min(b, first)): before the held run
        start_above = np.maximum(a, end)
        above = np.clip(b - start_above, 0, None)                   # [max(a, end), b): past the held run
        owner, page = expand_ranges(start_above, above)
        if below.any():                                             # rare: pages before the run, request-major order
            owner_lo, page_lo = expand_ranges(a, below)
            owner = np.concatenate([owner_lo, owner])
            page = np.concatenate([page_lo, page])
            order = np.argsort(owner, kind="stable")
            owner, page = owner[order], page[order]
        return rows[owner], page

    def _plan_release(self, pl: PoolLayout, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                      fresh: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ring pages below the step's live range that earlier steps mapped (out of reach from now on)."""
        if not pl.is_ring:
            return (np.empty(0, np.int64),) * 3
        first, end = self._first[pl.name][rows], self._end[pl.name][rows]
        keep_from = np.maximum(0, starts - pl.reach) // pl.page_size
        count = np.where((ends > starts) & ~fresh, np.clip(np.minimum(keep_from, end) - first, 0, None), 0)
        owner, page = expand_ranges(first, count)
        blocks = self._tables[pl.name][rows[owner], table_column(pl, page, pl.ring_width)].astype(np.int64)
        mapped = blocks >= 0
        return rows[owner][mapped], page[mapped], blocks[mapped]

    def _mapped_after(self, pl: PoolLayout, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                      fresh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([R] first, [R] one past the last) logical page each request holds once the step is committed."""
        lo, hi = live_range(pl, starts, ends, self.config.sliding_window)
        has = hi > lo
        first = np.where(fresh, 0, self._first[pl.name][rows])
        end = np.where(fresh, 0, self._end[pl.name][rows])
        new_first, new_end = page_span(lo, hi, pl.page_size)
        if pl.is_ring:  # the run's front is released when the request advances (or starts there when new)
            first = np.where(has & (fresh | (end <= first)), new_first,
                             np.where(has & (ends > starts), np.maximum(first, new_first), first))
        end = np.where(has, np.maximum(end, new_end), end)
        return first, end

    # ------------------------------------------------------------------ mutation
    def commit(self, plan: StepPlan) -> None:
        """Apply a plan made by :meth:`plan` on this allocator's current state.

        Raises ``alloc.stale_plan`` (changing nothing) if the plan was made by another allocator or if a
        commit or release happened on this one since the plan was made."""
        with self._lock:
            self._check_current(plan)
            self._commit(plan)
            self._generation += 1

    def _check_current(self, plan: StepPlan) -> None:
        """Raise ``alloc.stale_plan`` unless ``plan`` was made by this allocator on its current state."""
        if plan.owner is not self._token or plan.generation != self._generation:
            foreign = plan.owner is not self._token
            raise ABIError([Issue(
                "alloc.stale_plan", "plan",
                "the plan was made by another allocator" if foreign else
                "the allocator changed between plan and commit (another step was committed or a request "
                "released)",
                expected=f"a plan of this allocator's generation {self._generation}",
                actual="another allocator's plan" if foreign else f"a plan of generation {plan.generation}")])

    def _commit(self, plan: StepPlan) -> None:
        for r in plan.new_ids:
            self._row_of[r] = self._spare_rows.pop()
        for p in POOL_NAMES:
            pl = self.layout.pools[p]
            width = pl.ring_width
            r_rows, r_pages, r_blocks = plan.release_cells[p]
            self._tables[p][r_rows, table_column(pl, r_pages, width)] = -1
            m_rows, m_pages, m_blocks = plan.map_cells[p]
            top = self._top[p]                            # push the released blocks, then pop the mapped ones
            self._free[p][top: top + r_blocks.size] = r_blocks[::-1]
            self._top[p] = top + r_blocks.size - m_blocks.size
            self._tables[p][m_rows, table_column(pl, m_pages, width)] = m_blocks
            self._first[p][plan.rows], self._end[p][plan.rows] = plan.mapped[p]
        for r, end in zip(plan.request_ids, plan.ends.tolist(), strict=True):
            self._cached[r] = int(end)
        self._persistent._record(plan.rows, np.array(plan.request_ids, np.int64), plan.map_cells,
                                 plan.release_cells)

    def release(self, request_id: int) -> None:
        """Return every block of ``request_id`` to the free lists and forget it."""
        with self._lock:
            if request_id not in self._row_of:
                raise ABIError([_unknown(request_id)])
            self._release(request_id)
            self._generation += 1

    def _release(self, request_id: int) -> None:
        row = self._row_of.pop(request_id)
        self._cached.pop(request_id, None)
        for p in POOL_NAMES:
            table_row = self._tables[p][row]
            held = table_row[table_row >= 0]
            top = self._top[p]
            self._free[p][top: top + held.size] = np.sort(held)[::-1]
            self._top[p] = top + held.size
        self._persistent.release(row)       # clears the row and its run, advances the slot's generation
        self._spare_rows.append(row)

    def _grow(self, needed: int) -> None:  # called by plan, under the lock
        old = self._persistent.slots
        new = max(needed, 2 * old)
        self._persistent.grow(new)
        self._spare_rows = list(range(new - 1, old - 1, -1)) + self._spare_rows


def _positions(rows: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index in ``rows`` of each ``wanted`` allocator row found there, mask of the wanted rows found)."""
    if rows.size == 0 or wanted.size == 0:
        return np.empty(0, np.int64), np.zeros(wanted.size, dtype=bool)
    order = np.argsort(rows, kind="stable")
    at = order[np.minimum(np.searchsorted(rows, wanted, sorter=order), rows.size - 1)]
    found = rows[at] == wanted
    return at[found], found


def _unknown(request_id: object, *, index: int | None = None, count: int = 1) -> Issue:
    return Issue("alloc.unknown_request", "request_id" if index is None else "request_ids",
                 "request is not allocated", index=index, expected="a request added earlier",
                 actual=request_id, count=count)


def pool_blocks_for(config: ModelConfig, contexts: Sequence[int], *, slack: int = 8) -> PoolBlocks:
    """Blocks per pool that hold every page of requests with these final context lengths at once
    (a convenient upper bound for demos and tests; serving code sizes pools from its memory budget)."""
    ctx = np.asarray(contexts, dtype=np.int64)
    need = {}
    for pl in config.layout:
        logical = ctx // pl.ratio if pl.ratio else ctx
        pages = np.minimum(-(-logical // pl.page_size), pl.ring_width)   # a request holds a ring width at most
        need[pl.name] = int(pages.sum()) + len(ctx) + slack
    return PoolBlocks(**need)
