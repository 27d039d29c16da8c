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

from dspark_abi._base import expand_ranges, find_in
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_abi.layout import (
    MAX_CHUNK_TOKENS,
    POOL_NAMES,
    PoolName,
    page_span,
    table_column,
)
from dspark_abi.persistent import PersistentTables, PooledCells, narrow_tables, step_widths
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
        runs: [2, 7, R] int64 those runs, pools in ABI order (``mapped``'s arrays are its views).
        map_pooled, release_pooled: The same cells as ``map_cells`` / ``release_cells``, the seven pools in four
            flat arrays (pool index, rows, pages, blocks), pool-major: what the commit writes in one call each.
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
    runs: np.ndarray
    map_pooled: PooledCells
    release_pooled: PooledCells
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
        #: [S] int64 tokens cached by the request holding each row (an array: a step writes R of them at once)
        self._cached_rows = np.zeros(capacity, np.int64)
        #: (holders ascending, their rows) of the in-use rows and the generation it was sorted at (see _rows_of)
        self._index: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._index_generation = -1
        self._spare_rows: list[int] = list(range(capacity - 1, -1, -1))
        self._lock = threading.RLock()
        self._generation = 0          # advanced by every commit and release; plans record it
        self._token = object()        # identifies this allocator's plans
        narrow = any(pl.ring_width < pl.table_width for pl in self.layout if pl.is_ring)
        self._max_chunk_tokens = MAX_CHUNK_TOKENS if narrow else config.max_position_embeddings

    def _alias_persistent(self) -> None:
        """The allocator writes the persistent tables' own dictionaries (one home for tables and runs)."""
        self._tables = self._persistent._tables
        self._first, self._end = self._persistent._first, self._persistent._end

    @property
    def _cached(self) -> dict[int, int]:
        """Request id -> tokens cached (a snapshot, for inspection; the state is the per-row array)."""
        return {r: int(self._cached_rows[row]) for r, row in self._row_of.items()}

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
            for name in ("_free", "_top", "_persistent", "_row_of", "_cached_rows", "_index", "_spare_rows"):
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
        return self._max_chunk_tokens

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

    def cached_tokens_of(self, request_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[R] int64 cached tokens of each request, -1 for one this allocator does not know (one lock, no raise)."""
        with self._lock:
            try:
                ids = np.asarray(request_ids, np.int64).reshape(-1)
            except (OverflowError, TypeError, ValueError):      # not all int64 ids: one by one
                row_of = self._row_of
                return np.array([self._cached_rows[row_of[r]] if r in row_of else -1 for r in request_ids], np.int64)
            rows = self._rows_of(ids)
            return np.where(rows >= 0, self._cached_rows[rows], -1)

    def _rows_of(self, ids: np.ndarray) -> np.ndarray:
        """[R] int64 row of each request id, -1 for one this allocator does not know: one search among the holders
        of the rows (sorted once per generation: every commit and release advances it), no Python per request."""
        if self._index_generation != self._generation:
            held = np.flatnonzero(self._persistent._in_use)
            holders = self._persistent._holders[held]
            order = np.argsort(holders, kind="stable")
            self._index = (holders[order], held[order])
            self._index_generation = self._generation
        keys, rows = self._index
        if keys.size == 0 or ids.size == 0:
            return np.full(ids.size, -1, np.int64)
        at = np.minimum(np.searchsorted(keys, ids), keys.size - 1)
        return np.where(keys[at] == ids, rows[at], -1)

    def cached_tokens(self, request_id: int) -> int:
        """Tokens of ``request_id`` whose caches earlier steps wrote (its next start position)."""
        with self._lock:
            if request_id not in self._row_of:
                raise ABIError([_unknown(request_id)])
            return int(self._cached_rows[self._row_of[request_id]])

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
                        at, found = find_in(rows, cell_rows)
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
        """The seven pools planned together: every per-request formula on [7, R] arrays with the pools' constants
        as columns (:class:`~dspark_abi.layout.PoolColumns`), cells pool-major in flat arrays; only the table
        reads and the free stacks go pool by pool (each pool has its own). Cost O(R + cells), no history."""
        rows = self._rows_of(np.asarray(request_ids, np.int64).reshape(-1))
        fresh = rows < 0                                        # requests new in this step
        new_ids = tuple(np.asarray(request_ids, np.int64)[fresh].tolist()) if fresh.any() else ()
        if len(new_ids) > len(self._spare_rows):
            self._grow(len(self._row_of) + len(new_ids))
        if new_ids:         # provisional rows: the ones the commit pops from the spare stack, in that order
            rows[fresh] = self._spare_rows[::-1][:len(new_ids)]
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        n_req = rows.size
        cols = self.layout.columns
        held_first, held_end = self._persistent._runs[:, :, rows]                # [7, R] the runs held now
        first = np.where(fresh, 0, held_first)
        end = np.where(fresh, 0, held_end)
        lo, hi = cols.live_ranges(starts, ends)
        a, b = page_span(lo, hi, cols.page_size, shift=cols.page_shift)          # [7, R] the live pages

        # release: the ring pages below the live range that earlier steps mapped (out of reach from now on)
        keep_from = np.maximum(starts - cols.reach, 0)
        keep_from = keep_from // cols.page_size if cols.page_shift is None else keep_from >> cols.page_shift
        count = np.minimum(keep_from, held_end) - held_first
        count *= (ends > starts) & ~fresh & cols.ring & (count > 0)
        r_owner, r_page = expand_ranges(held_first.reshape(-1), count.reshape(-1))
        r_pool, r_req = np.divmod(r_owner, n_req) if n_req else (r_owner, r_owner)
        persistent = self._persistent          # the seven tables' cells in one gather from its flat store
        r_block = persistent._flat[persistent._cell(r_pool, rows[r_req], r_page)].astype(np.int64)
        kept = r_block >= 0
        r_pool, r_rows, r_page, r_block = r_pool[kept], rows[r_req[kept]], r_page[kept], r_block[kept]

        # map: the live pages outside the held run (only those are enumerated, never the whole history)
        below = np.maximum(np.minimum(b, first) - a, 0)                       # [a, min(b, first)): before the run
        start_above = np.maximum(a, end)
        above = np.maximum(b - start_above, 0)                                # [max(a, end), b): past the run
        m_owner, m_page = expand_ranges(start_above.reshape(-1), above.reshape(-1))
        if below.any():                          # rare: pages before the run; request-major, pages ascending
            owner_lo, page_lo = expand_ranges(a.reshape(-1), below.reshape(-1))
            order = np.argsort(np.concatenate([owner_lo, m_owner]), kind="stable")
            m_owner, m_page = np.concatenate([owner_lo, m_owner])[order], np.concatenate([page_lo, m_page])[order]
        m_pool, m_req = np.divmod(m_owner, n_req) if n_req else (m_owner, m_owner)
        m_rows = rows[m_req]
        m_block = np.empty(m_pool.size, np.int32)

        # runs after the step: a ring run's front is released as the request advances (or starts there when new)
        has = hi > lo
        runs = np.empty((2, 7, n_req), np.int64)         # [2, 7, R] after the step; mapped[p] are its views
        np.copyto(runs[1], np.where(has, np.maximum(end, b), end))
        after_first, after_end = runs
        after_first[...] = np.where(cols.ring & has & (fresh | (end <= first)), a,
                                    np.where(cols.ring & has & (ends > starts), np.maximum(first, a), first))

        r_count = np.bincount(r_pool, minlength=7).tolist()
        m_bounds = np.searchsorted(m_pool, np.arange(8)).tolist()
        short: list[Issue] = []
        map_cells: dict[PoolName, Cells] = {}
        release_cells: dict[PoolName, Cells] = {}
        mapped: dict[PoolName, tuple[np.ndarray, np.ndarray]] = {}
        r_at = 0
        for i, p in enumerate(POOL_NAMES):
            need = m_bounds[i + 1] - m_bounds[i]
            available = self._top[p] + r_count[i]
            if need > available:
                short.append(Issue("alloc.exhausted", f"pool_blocks.{p}",
                                   f"pool {p!r} has {available} free blocks, this step needs {need}",
                                   expected=f">= {need} free", actual=available))
            if short:
                r_at += r_count[i]
                continue
            released = slice(r_at, r_at + r_count[i])
            r_at += r_count[i]
            release_cells[p] = (r_rows[released], r_page[released], r_block[released])
            # blocks are assigned in plan order: released blocks are reused first, then the free stack
            recycled, top = r_block[released].astype(np.int32), self._top[p]
            reused = recycled[:need]
            cells = slice(m_bounds[i], m_bounds[i + 1])
            m_block[m_bounds[i]: m_bounds[i] + reused.size] = reused
            m_block[m_bounds[i] + reused.size: m_bounds[i + 1]] = self._free[p][top - (need - reused.size): top][::-1]
            map_cells[p] = (m_rows[cells], m_page[cells], m_block[cells])
            mapped[p] = (after_first[i], after_end[i])
        if short:
            raise ABIError(short)
        return StepPlan(tuple(request_ids), new_ids, rows, map_cells, release_cells, ends, mapped, runs=runs,
                        map_pooled=(m_pool, m_rows, m_page, m_block), release_pooled=(r_pool, r_rows, r_page, r_block),
                        owner=self._token, generation=self._generation)

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
        for p in POOL_NAMES:                              # the free stacks: each pool has its own
            r_blocks, m_count = plan.release_cells[p][2], plan.map_cells[p][2].size
            top = self._top[p]                            # push the released blocks, then pop the mapped ones
            self._free[p][top: top + r_blocks.size] = r_blocks[::-1]
            self._top[p] = top + r_blocks.size - m_count
        # tables and block owners of all seven pools: one write each in the persistent tables' flat stores
        self._persistent._write(plan.release_pooled, plan.map_pooled)
        self._persistent._runs[:, :, plan.rows] = plan.runs
        self._cached_rows[plan.rows] = plan.ends
        self._persistent._record(plan.rows, np.array(plan.request_ids, np.int64))

    def release(self, request_id: int) -> None:
        """Return every block of ``request_id`` to the free lists and forget it."""
        with self._lock:
            if request_id not in self._row_of:
                raise ABIError([_unknown(request_id)])
            self._release(request_id)
            self._generation += 1

    def _release(self, request_id: int) -> None:
        row = self._row_of.pop(request_id)
        self._cached_rows[row] = 0
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
        self._cached_rows = np.concatenate([self._cached_rows, np.zeros(new - old, np.int64)])
        self._spare_rows = list(range(new - 1, old - 1, -1)) + self._spare_rows


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
