"""The persistent form of the block tables (spec 1.3, section 5.9): `PersistentTables` and `PersistentStep`.

A decode-rate serving loop must not copy a request's whole history into every step. In the persistent form the
seven block tables live once, one row ("slot") per request, and are updated in place as a device-resident table
would be; a step carries, instead of ``[R, w]`` tables, each request's slot (``table_slots``), the slot's generation
(``slot_generations``, advanced whenever the slot is released, so a step built against a recycled slot is refused
with ``tables.stale_slot``) and per pool only the cells it maps and releases (rows of (slot, logical page, block)).
Every per-row array (``query_start_loc``, ``positions``, the slot mappings, ...) is the full form's, unchanged.

Proof: :class:`PersistentTables` is proven once, when created or loaded (:meth:`PersistentTables.prove`,
O(slots x width)), and kept proven under deltas: :func:`check_step` checks a step in O(cells it changes + R + rows)
against the invariant (every block held by at most one cell of a pool; each slot holds one run of logical pages
``[first, end)``, every page of it mapped and nothing else; a free slot holds nothing), and
:meth:`PersistentTables.apply` updates tables, runs and block owners in place. ``check_step(level="full")`` is
the stateless check: the tables proven from scratch, then the full validator on :meth:`PersistentStep.to_full`.

Conversions: :meth:`PersistentStep.to_full` gives the 1.x :class:`~dspark_abi.batch.PackedBatch` whose tables are
exactly those ``BatchBuilder.build()`` makes (same widths, same cells), :func:`from_full` the other way;
``to_upstream`` takes the full form.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import attrs
import numpy as np

from dspark_abi._base import expand_ranges, find_in
from dspark_abi.batch import PackedBatch, SlotMappings, StepArrays, _afield, _PerPool, freeze
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue, ValidationReport
from dspark_abi.fields import (
    BATCH_FIELDS,
    MAPPED_SPECS,
    PERSISTENT_FIELDS,
    RELEASED_SPECS,
    SHARED_FIELDS,
    SLOT_SPECS,
    TABLE_FIELDS,
    FieldSpec,
)
from dspark_abi.layout import (
    POOL_NAMES,
    CacheLayout,
    PoolLayout,
    PoolName,
    live_range,
    page_span,
    table_column,
    touched_pages,
    written_logical,
)
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import PoolBlocks
from dspark_abi.requests import BatchRequests
from dspark_abi.rules import _flag, check_tokens
from dspark_abi.validation import validate_arrays

#: (slots or rows, logical pages, blocks), three flat int arrays of one length.
Cells = tuple[np.ndarray, np.ndarray, np.ndarray]
#: (pool index in ABI order, slot, logical page, block): the cells of all seven pools, pool-major, in four arrays
PooledCells = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
#: Keys of (slot, page) cells: slot * _KEY + page (pages and slots are below 2**31).
_KEY = np.int64(2**31)
_EMPTY = np.zeros(0, np.int64)
_NO_RUNS = np.zeros((2, 7, 0), np.int64)


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _find(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index in ``sorted_keys`` of each key, mask of the keys found)."""
    if sorted_keys.size == 0 or keys.size == 0:
        return np.zeros(keys.size, np.int64), np.zeros(keys.size, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.size - 1)
    return at, sorted_keys[at] == keys


# ------------------------------------------------------------------------------------------ step geometry (one home)
def step_widths(layout: CacheLayout, window: int, starts: np.ndarray, ends: np.ndarray, *, fixed_ring: bool = False,
                ring_floor: Mapping[PoolName, int] | None = None) -> dict[PoolName, int]:
    """pool -> columns of the step's (full-form) table: the most pages a non-empty request's live range spans (at
    least 1); for ring pools ``ring_width`` with ``fixed_ring``, or at least ``ring_floor`` (a verify step's
    headroom, :func:`~dspark_abi.layout.verify_headroom`)."""
    cols = layout.columns                   # the seven pools at once: [7, R] (live_pages's formula)
    first, stop = cols.page_spans(starts, ends, window)
    stop -= first * cols.ring
    stop *= ends > starts
    most = stop.max(axis=1, initial=0).tolist()
    out: dict[PoolName, int] = {}
    for i, pl in enumerate(layout):
        width = max(1, int(most[i]))
        if fixed_ring and pl.is_ring:
            width = pl.ring_width
        elif ring_floor and pl.is_ring:
            width = min(pl.ring_width, max(width, ring_floor.get(pl.name, 0)))
        out[pl.name] = width
    return out


def narrow_tables(layout: CacheLayout, window: int, persistent: Mapping[PoolName, np.ndarray], slots: np.ndarray,
                  starts: np.ndarray, ends: np.ndarray, widths: Mapping[PoolName, int],
                  mapped: Mapping[PoolName, Cells]) -> dict[PoolName, np.ndarray]:
    """pool -> [R, width] int32 full-form tables of a step whose requests sit in ``slots`` of the ``persistent``
    tables, with the step's ``mapped`` cells (slot, page, block) applied (the tables as they are once it is
    committed; the persistent tables may be taken before or after its commit: the cells it releases lie outside
    every live range, the ones it maps are written here either way).

    A ring pool's table holds each live page ``i`` in column ``i % width`` and -1 elsewhere; a compressed pool's is
    the first ``width`` columns of the persistent row. Empty requests read nothing: their ring rows are -1.
    Cost O(R + live pages of the ring pools + R * width of the compressed pools), never O(R * context)."""
    out = {}
    for p in POOL_NAMES:
        pl, full, width = layout.pools[p], persistent[p], widths[p]
        m_slots, m_pages, m_blocks = mapped[p]
        at, found = find_in(slots, m_slots)
        pages, blocks = m_pages[found], m_blocks[found]
        if pl.is_ring:      # re-lay the live pages from the persistent ring width to this step's
            req, page = touched_pages(pl, starts, ends, window)
            table = np.full((slots.size, width), -1, dtype=np.int32)
            table[req, table_column(pl, page, width)] = full[slots[req], table_column(pl, page, full.shape[1])]
            first, _ = page_span(*live_range(pl, starts, ends, window), pl.page_size)
            live = (ends[at] > starts[at]) & (pages >= first[at])               # new pages it reads
        else:
            table = full[:, :width][slots]
            live = (pages >= 0) & (pages < width)                               # empty requests' history
        table[at[live], table_column(pl, pages[live], width)] = blocks[live]
        out[p] = table
    return out


# ------------------------------------------------------------------------------------------------ the tables
class PersistentTables:
    """The persistent block tables of the seven pools and the state that keeps them proven.

    Arrays (S slots; ``w_p`` = the pool's ``ring_width``, which for a compressed pool is its full table width):

    - ``table(p)``: [S, w_p] int32, logical page ``j`` of the slot's request in column ``j mod w_p`` (ring) or ``j``
      (compressed); -1 = unmapped.
    - ``runs(p)``: ([S], [S]) int64 ``[first, end)``, the pages a slot holds (one run; empty when ``end <= first``).
    - ``generations``: [S] int64, advanced whenever the slot is released (or recycled).
    - ``holders``: [S] int64 request id of the slot's request; ``in_use`` [S] bool (False: a free slot).

    Storage: the seven tables are views of one flat int32 store, the seven block-owner arrays of another and the
    runs of one [2, 7, S] array, so that a step reads or writes the cells of every pool in one numpy call (a cell
    (pool, slot, page) is one index into the store).

    Readers get read-only views; only :meth:`apply` (a step's delta), :meth:`release` and the owning
    :class:`~dspark_abi.allocator.BlockAllocator` write, in place. A :class:`BlockAllocator` owns one
    (:attr:`BlockAllocator.persistent`); :meth:`from_arrays` loads (and proves) one, e.g. a device mirror."""

    def __init__(self, config: ModelConfig, pool_blocks: PoolBlocks | Mapping[str, int], capacity: int = 16):
        self.config = config
        self.layout = config.layout
        self.pool_blocks = PoolBlocks.from_mapping(pool_blocks)
        widths = [self.layout.pools[p].ring_width for p in POOL_NAMES]
        blocks = [self.pool_blocks[p] for p in POOL_NAMES]
        #: [7] int64 columns of each pool's table, and where each pool's [S, w_p] table starts in ``_flat`` per slot
        #: of S (pool i's table is ``_flat[S * _width_at[i]:][:S * w_i]``)
        self._widths = np.array(widths, np.int64)
        self._width_at = np.cumsum([0, *widths[:-1]], dtype=np.int64)
        #: [S * sum(w_p)] int32 the seven tables in one flat store, pool-major, each row-major (-1 = unmapped), so that
        #: a step reads or writes the cells of all pools in one call (:meth:`_cell`); ``_tables[p]`` are its views
        self._flat = np.full(capacity * int(self._widths.sum()), -1, np.int32)
        #: [sum(B_p)] int32 slot holding each block of each pool, pool-major (-1 = free: the proof that no block is
        #: held twice); ``_owner_at[i]`` where pool i's blocks start, ``_owner[p]`` the views
        self._owners = np.full(sum(blocks), -1, np.int32)
        self._n_blocks = np.array(blocks, np.int64)
        self._owner_at = np.cumsum([0, *blocks[:-1]], dtype=np.int64)
        #: [2, 7, S] int64 the runs (first, end) of every pool and slot: one array, so that a step gathers its slots'
        #: runs of all pools in one call; ``_first[p]`` / ``_end[p]`` are views of its rows (written in place)
        self._runs = np.zeros((2, 7, capacity), np.int64)
        self._tables: dict[PoolName, np.ndarray] = {}
        self._owner: dict[PoolName, np.ndarray] = {}
        self._first: dict[PoolName, np.ndarray] = {}
        self._end: dict[PoolName, np.ndarray] = {}
        self._table_at = np.zeros(7, np.int64)
        self._bind()
        self._generations = np.zeros(capacity, np.int64)
        self._holders = np.full(capacity, -1, np.int64)
        self._in_use = np.zeros(capacity, dtype=bool)
        self._slot_of: dict[int, int] = {}
        #: the step whose delta these tables hold with nothing written since (what a forward may read them for);
        #: advanced by apply and the owning allocator's commit, cleared by every other write
        self._holding: PersistentStep | None = None

    #: the per-pool views of the flat stores, rebound by :meth:`_bind` (never pickled: views would pickle as copies)
    _VIEWS = ("_tables", "_owner", "_first", "_end")

    def _bind(self) -> None:
        """Point the per-pool views ``_tables``, ``_owner``, ``_first``, ``_end`` at the flat stores (the same
        dictionaries, updated in place: the owning allocator aliases them)."""
        slots = self._runs.shape[2]
        self._table_at = slots * self._width_at
        stop = [*self._owner_at.tolist()[1:], self._owners.size]
        for i, p in enumerate(POOL_NAMES):
            at, width = int(self._table_at[i]), int(self._widths[i])
            self._tables[p] = self._flat[at: at + slots * width].reshape(slots, width)
            self._owner[p] = self._owners[int(self._owner_at[i]): stop[i]]
            self._first[p], self._end[p] = self._runs[0, i], self._runs[1, i]

    def _cell(self, pool: np.ndarray, slot: np.ndarray, page: np.ndarray) -> np.ndarray:
        """Index in ``_flat`` of each cell (pool index, slot, logical page): the page's column in its pool's table
        (``page mod w_p``: a compressed page lies below its width). One call for the cells of every pool."""
        width = self._widths[pool]
        at: np.ndarray = self._table_at[pool] + slot * width + page % width
        return at

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied without the per-pool views (rebound to the copied stores by ``__setstate__``)."""
        # ``_holding`` goes along: a step pickled in the same payload (a one-shot launch) stays the one held, while
        # a copy of the tables alone holds a copy of the step, which is no caller's step
        return {k: v for k, v in self.__dict__.items() if k not in self._VIEWS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in self._VIEWS:
            setattr(self, name, {})
        self._bind()

    def __deepcopy__(self, memo: dict[int, Any]) -> PersistentTables:
        """A deep copy of the state that shares the immutable config, layout and pool sizes (a copy of the config
        would be equal but not identical, and every step's config check would then compare it field by field)."""
        for shared in (self.config, self.layout, self.pool_blocks):
            memo.setdefault(id(shared), shared)
        out = self.__class__.__new__(self.__class__)
        out.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return out

    # ------------------------------------------------------------------ reading
    @property
    def slots(self) -> int:
        """S, the slots of every table."""
        return int(self._generations.size)

    def table(self, pool: PoolName) -> np.ndarray:
        """[S, w] int32 read-only view of pool ``pool``'s persistent table."""
        return _readonly(self._tables[pool])

    @property
    def tables(self) -> dict[str, np.ndarray]:
        """pool -> read-only view of its table (what kernels read, ``table_row = table_slots[request]``)."""
        return {p: _readonly(t) for p, t in self._tables.items()}

    def runs(self, pool: PoolName) -> tuple[np.ndarray, np.ndarray]:
        """([S] first, [S] one past the last) logical page each slot holds in ``pool`` (read-only)."""
        return _readonly(self._first[pool]), _readonly(self._end[pool])

    @property
    def generations(self) -> np.ndarray:
        return _readonly(self._generations)

    @property
    def holders(self) -> np.ndarray:
        return _readonly(self._holders)

    @property
    def in_use(self) -> np.ndarray:
        return _readonly(self._in_use)

    def slot_of(self, request_id: int) -> int | None:
        """The slot ``request_id`` holds, or None."""
        return self._slot_of.get(request_id)

    def holds(self, step: PersistentStep) -> bool:
        """Whether these tables hold exactly ``step``'s delta: the last step applied (:meth:`apply`) or committed by
        the owning allocator, with no write since. Only then may a forward read them for ``step``."""
        return self._holding is step

    def current_issues(self, step: PersistentStep) -> list[Issue]:
        """Whether ``step`` was built against these tables' current slots, in O(R) (the id lookup only for slots the
        step claims): ``config.mismatch`` (tables of another config or pools), ``tables.slot`` (a slot out of range
        or shared by two requests), ``tables.stale_slot`` (a slot released or recycled since, held by another
        request, or a request that holds another slot). The first check of :func:`check_step` and
        :meth:`PersistentStep.to_full`, and what a forward checks of a step besides :meth:`holding_issues`."""
        return list(_current(step, self).issues)

    def holding_issues(self, step: PersistentStep) -> list[Issue]:
        """``tables.unapplied`` unless :meth:`holds` ``step`` (O(1))."""
        if self.holds(step):
            return []
        return [Issue("tables.unapplied", "tables", "the persistent tables do not hold this step's delta (it was "
                      "not applied or committed, or the tables changed since)",
                      expected="the tables right after apply(step) or the builder's commit(step)",
                      actual="no step" if self._holding is None else "another step's tables",
                      fix="apply the step to the mirror (tables.apply(step)) or commit it (BatchBuilder.commit) "
                          "right before its forward")]

    def copy(self) -> PersistentTables:
        """An independent copy (tables, runs, owners, generations)."""
        return copy.deepcopy(self)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The state as flat arrays (``<pool>_table``, ``<pool>_first``, ``<pool>_end``, ``slot_generations``,
        ``slot_request_ids``, ``slot_in_use``), the form :meth:`from_arrays` loads."""
        out: dict[str, np.ndarray] = {}
        for p in POOL_NAMES:
            out |= {f"{p}_table": self._tables[p], f"{p}_first": self._first[p], f"{p}_end": self._end[p]}
        return out | {"slot_generations": self._generations, "slot_request_ids": self._holders,
                      "slot_in_use": self._in_use}

    @classmethod
    def from_arrays(cls, config: ModelConfig, pool_blocks: PoolBlocks | Mapping[str, int],
                    arrays: Mapping[str, Any]) -> PersistentTables:
        """Load (copy) tables in the form :meth:`to_arrays` gives and prove them (O(S x width)); raises
        :class:`ABIError` (``tables.persistent``, ``array.*``) listing every violation."""
        issues: list[Issue] = []
        names = [f"{p}_{k}" for p in POOL_NAMES for k in ("table", "first", "end")] + \
            ["slot_generations", "slot_request_ids", "slot_in_use"]
        dtypes = {"table": np.int32, "first": np.int64, "end": np.int64, "slot_generations": np.int64,
                  "slot_request_ids": np.int64, "slot_in_use": np.bool_}
        got: dict[str, np.ndarray] = {}
        for name in names:
            value = arrays.get(name)
            want = np.dtype(dtypes.get(name.rsplit("_", 1)[-1], dtypes.get(name, np.int64)))
            if not isinstance(value, np.ndarray) or type(value) is not np.ndarray or value.dtype != want:
                issues.append(Issue("array.dtype" if value is not None else "array.missing", name,
                                    f"persistent table array {name!r} must be a {want.name} numpy array",
                                    expected=want.name, actual=type(value).__name__ if value is None or not
                                    isinstance(value, np.ndarray) else value.dtype.name))
                continue
            got[name] = np.array(value, copy=True)
        if issues:
            raise ABIError(issues)
        n = got["slot_generations"].shape
        for name, a in got.items():
            want_shape = (n[0], config.layout.pools[name.removesuffix("_table")].ring_width) \
                if name.endswith("_table") else n
            if a.shape != want_shape:
                issues.append(Issue("array.shape", name, "persistent arrays must share the slot axis (tables: "
                                    "[S, ring_width])", expected=list(want_shape), actual=list(a.shape)))
        if issues:
            raise ABIError(issues)
        out = cls(config, pool_blocks, capacity=n[0])
        for p in POOL_NAMES:
            out._tables[p][...] = got[f"{p}_table"]
        out._runs[...] = [[got[f"{p}_{k}"] for p in POOL_NAMES] for k in ("first", "end")]
        out._generations, out._holders, out._in_use = (got["slot_generations"], got["slot_request_ids"],
                                                       got["slot_in_use"])
        out._slot_of = dict(zip(out._holders[out._in_use].tolist(), np.flatnonzero(out._in_use).tolist(),
                                strict=True))
        issues = out.prove()
        if issues:
            raise ABIError(issues)
        for p in POOL_NAMES:                    # proven: every mapped block is held by exactly one cell
            table = out._tables[p]
            held = table >= 0
            out._owner[p][table[held]] = np.nonzero(held)[0].astype(np.int32)
        return out

    def prove(self) -> list[Issue]:
        """Every violation of the invariant (O(S x width), the one full check): blocks in range and held once per
        pool; each slot's mapped cells exactly the columns of its run ``[first, end)`` (a ring run no longer than
        the ring width); free slots hold nothing; holders pairwise distinct."""
        issues: list[Issue] = []
        in_use = self._in_use
        ids = self._holders[in_use]
        if np.unique(ids).size != ids.size:
            issues.append(Issue("tables.persistent", "slot_request_ids", "a request id holds two slots",
                                expected="distinct ids", actual=ids.tolist()))
        for p in POOL_NAMES:
            pl, table = self.layout.pools[p], self._tables[p]
            first, end = self._first[p], self._end[p]
            count = np.where(in_use, np.clip(end - first, 0, None), 0)
            width = table.shape[1]
            bad_run = (first < 0) | (count > width) | (~pl.is_ring & (end > width))
            _flag(issues, "tables.persistent", f"{p}_first", bad_run, "a slot's run must start at a page >= 0 and "
                  "fit the table (a ring run at most its width)", expected=f"<= {width} pages", actual=count)
            count = np.where(bad_run, 0, count)
            expected = np.zeros(table.shape, dtype=bool)
            owner, page = expand_ranges(first, count)
            expected[owner, table_column(pl, page, width)] = True
            mapped = table >= 0
            _flag(issues, "tables.persistent", f"{p}_table", (mapped != expected).reshape(-1),
                  "a slot's mapped cells must be exactly the columns of its run", expected="mapped inside the run, "
                  "-1 outside", actual=table.reshape(-1))
            blocks = table[mapped]
            _flag(issues, "tables.persistent", f"{p}_table", blocks >= self.pool_blocks[p],
                  f"blocks must be < the pool's {self.pool_blocks[p]} blocks", expected=f"< {self.pool_blocks[p]}",
                  actual=blocks)
            held = np.bincount(blocks[blocks < self.pool_blocks[p]], minlength=self.pool_blocks[p])
            _flag(issues, "tables.persistent", f"{p}_table", held > 1, "a block must be held by one cell at most",
                  expected=1, actual=held)
        return issues

    # ------------------------------------------------------------------ writing
    def apply(self, step: PersistentStep) -> None:
        """Apply ``step``'s delta in place (checked first: :func:`check_step`'s incremental proof; raises
        :class:`ABIError` and changes nothing when the step is invalid). Use it on a loaded copy (a device mirror);
        an allocator's own tables advance by ``BatchBuilder.commit``."""
        report, runs = _check(step, self)
        report.raise_if_invalid()
        slots = step.table_slots.astype(np.int64)
        self._write(step.released.pooled(), step.mapped.pooled())
        self._runs[:, :, slots] = runs
        self._claim(slots, step.requests.ids)
        self._holding = step

    def release(self, slot: int) -> None:
        """Free ``slot``: its blocks return to no owner, its run empties and its generation advances (every step
        built against it becomes ``tables.stale_slot``)."""
        self._holding = None
        for p in POOL_NAMES:
            row = self._tables[p][slot]
            self._owner[p][row[row >= 0]] = -1
            row[:] = -1
            self._first[p][slot] = self._end[p][slot] = 0
        self._generations[slot] += 1
        if self._in_use[slot]:
            self._slot_of.pop(int(self._holders[slot]), None)
        self._in_use[slot], self._holders[slot] = False, -1

    def _claim(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Mark ``slots`` held by requests ``ids`` (new holders are few: the dictionary is touched for them only)."""
        fresh = ~self._in_use[slots]
        if fresh.any():
            self._slot_of.update(zip(ids[fresh].tolist(), slots[fresh].tolist(), strict=True))
            self._in_use[slots[fresh]] = True
            self._holders[slots[fresh]] = ids[fresh]

    def _write(self, released: PooledCells, mapped: PooledCells) -> None:
        """Clear the ``released`` cells and free their blocks, then write the ``mapped`` cells and own their blocks
        (each (pool index, slot, page, block), the pools' cells together): one call per store for all pools."""
        r_pool, r_slot, r_page, r_block = released
        self._flat[self._cell(r_pool, r_slot, r_page)] = -1
        self._owners[self._owner_at[r_pool] + r_block] = -1
        m_pool, m_slot, m_page, m_block = mapped
        self._flat[self._cell(m_pool, m_slot, m_page)] = m_block
        self._owners[self._owner_at[m_pool] + m_block] = m_slot

    def _record(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """The owning allocator wrote tables, owners and runs (:meth:`_write`): bring the holders along
        (O(changes)). The tables then hold no step until the builder names the one committed (:meth:`_hold`)."""
        self._holding = None
        self._claim(slots, ids)

    def _hold(self, step: PersistentStep) -> None:
        """The owning allocator just committed ``step``'s delta (``BatchBuilder.commit``)."""
        self._holding = step

    def grow(self, capacity: int) -> None:
        """At least ``capacity`` slots (new slots are free, generation 0)."""
        old = self.slots
        if capacity <= old:
            return
        tables = {p: t for p, t in self._tables.items()}
        self._flat = np.full(capacity * int(self._widths.sum()), -1, np.int32)
        runs = np.zeros((2, 7, capacity), np.int64)
        runs[:, :, :old] = self._runs
        self._runs = runs
        self._bind()
        for p in POOL_NAMES:
            self._tables[p][:old] = tables[p]
        for name, fill in (("_generations", 0), ("_holders", -1), ("_in_use", False)):
            before = getattr(self, name)
            after = np.full(capacity, fill, before.dtype)
            after[:old] = before
            setattr(self, name, after)


# ------------------------------------------------------------------------------------------------ the step
@attrs.frozen
class DeltaCells(_PerPool):
    """Per pool, [M, 3] int32 rows (slot, logical page, block) of the cells a step maps (or releases)."""

    ori: np.ndarray = _afield("ori")
    csa_cmp: np.ndarray = _afield("csa_cmp")
    hca_cmp: np.ndarray = _afield("hca_cmp")
    idx: np.ndarray = _afield("idx")
    csa_state: np.ndarray = _afield("csa_state")
    csa_inner_state: np.ndarray = _afield("csa_inner_state")
    hca_state: np.ndarray = _afield("hca_state")
    # (cells per pool, the [M, 3] array whose consecutive slices the fields are) when made by from_cells
    _joined: tuple[list[int], np.ndarray] | None = attrs.field(init=False, default=None, eq=False, repr=False)
    # pooled()'s arrays, made on first use
    _pooled: PooledCells | None = attrs.field(init=False, default=None, eq=False, repr=False)

    @classmethod
    def from_cells(cls, cells: Mapping[PoolName, Cells]) -> DeltaCells:
        """From pool -> (slots, pages, blocks): the seven pools written into one int32 array, frozen once; each
        pool's field is its (immutable, C-contiguous) slice, so freezing the fields copies nothing more."""
        sizes = [cells[p][0].size for p in POOL_NAMES]
        joined = np.empty((sum(sizes), 3), np.int32)
        for k in range(3):
            np.concatenate([cells[p][k] for p in POOL_NAMES], out=joined[:, k], casting="unsafe")
        frozen = freeze(joined)
        bounds = np.cumsum([0, *sizes]).tolist()
        out = cls(**{p: frozen[bounds[i]:bounds[i + 1]] for i, p in enumerate(POOL_NAMES)})
        object.__setattr__(out, "_joined", (sizes, frozen))      # the fields are its slices: nothing to join again
        return out

    @classmethod
    def from_pooled(cls, cells: PooledCells) -> DeltaCells:
        """From the seven pools' cells as (pool index, slot, page, block), pool-major (the allocator's plan): one
        [M, 3] int32 array written and frozen once, each pool's field its slice; :meth:`pooled` gives read-only
        copies of the four columns (kept, not derived again)."""
        pool, slot, page, block = cells
        joined = np.empty((pool.size, 3), np.int32)
        for k, column in enumerate((slot, page, block)):
            joined[:, k] = column
        frozen = freeze(joined)
        bounds = np.searchsorted(pool, np.arange(8)).tolist()
        out = cls(**{p: frozen[bounds[i]:bounds[i + 1]] for i, p in enumerate(POOL_NAMES)})
        sizes = [bounds[i + 1] - bounds[i] for i in range(7)]
        wide = frozen.astype(np.int64)                 # the columns as the fields hold them, one copy, read-only
        wide.flags.writeable = False
        object.__setattr__(out, "_joined", (sizes, frozen))
        object.__setattr__(out, "_pooled", (_readonly(pool.astype(np.int64)), wide[:, 0], wide[:, 1], wide[:, 2]))
        return out

    def pooled(self) -> PooledCells:
        """(pool index, slot, page, block) int64 of the seven pools' cells, pools in ABI order (one array with a
        pool column, the form the checks read); made once per object (its arrays are read-only)."""
        pooled = self._pooled
        if pooled is None:
            pool, slot, page, block = self._pool_columns()
            pooled = (_readonly(pool), _readonly(slot), _readonly(page), _readonly(block))
            object.__setattr__(self, "_pooled", pooled)
        return pooled

    def _pool_columns(self) -> PooledCells:
        if self._joined is not None:
            sizes, joined = self._joined
        else:
            arrays = [self[p] for p in POOL_NAMES]
            sizes = [a.shape[0] for a in arrays]
            joined = np.concatenate(arrays) if sum(sizes) else np.zeros((0, 3), np.int32)
        wide = joined.astype(np.int64)
        return np.repeat(np.arange(7, dtype=np.int64), sizes), wide[:, 0], wide[:, 1], wide[:, 2]

    def cells(self, pool: str) -> Cells:
        """(slots, pages, blocks) int64 of ``pool``."""
        a = self[pool].astype(np.int64)
        return a[:, 0], a[:, 1], a[:, 2]


@attrs.frozen(eq=True)
class PersistentStep(StepArrays):
    """One step in the persistent form (spec 1.3, section 5.9): the full form's per-row arrays, no block tables,
    each request's slot and slot generation, and per pool the cells the step maps and releases.

    Attributes:
        config, policy, pool_blocks: As :class:`~dspark_abi.batch.PackedBatch`'s.
        query_start_loc: [R+1] int32; positions: [P] int32; slots: the seven [P] int64 slot mappings; request_ids
            [R] int64; token_ids [P] int64 | None; logit_rows [G] int32 | None; verify_widths [R] int32 | None;
            logit_mode [R] int8 | None: exactly the full form's (spec 4.1).
        table_slots: [R] int32 slot of each request in the persistent tables (pairwise distinct).
        slot_generations: [R] int64 generation of that slot the step was built against.
        table_widths: [7] int32 columns of each pool's table in the full form (pools in ABI order).
        mapped: Per pool [M_p, 3] int32 (slot, logical page, block) the step maps.
        released: Per pool [K_p, 3] int32 (slot, logical page, block) the step releases (ring pages out of reach).
        requests: The per-request record (not compared; derived from the arrays when not given).

    It satisfies the kernels' ``StepRows`` (``dspark_kernels.model.plan``) itself, as a ``PackedBatch`` does: the
    geometry (``tp_size``, ``padded_rows``, ``num_requests``, ``num_tokens``) and ``row_request`` [P] int32 (-1 on
    padding rows, derived once from the request record) come from :class:`~dspark_abi.batch.StepArrays`, the
    same home as the full form's.
    """

    # config, policy, pool_blocks, query_start_loc, positions and the keyword-only requests: StepArrays's
    slots: SlotMappings = attrs.field()  # type: ignore[misc]
    table_slots: np.ndarray = _afield("table_slots")
    slot_generations: np.ndarray = _afield("slot_generations")
    table_widths: np.ndarray = _afield("table_widths")
    mapped: DeltaCells = attrs.field()  # type: ignore[misc]
    released: DeltaCells = attrs.field()  # type: ignore[misc]
    request_ids: np.ndarray = _afield("request_ids")
    token_ids: np.ndarray | None = _afield("token_ids", True)
    logit_rows: np.ndarray | None = _afield("logit_rows", True)
    verify_widths: np.ndarray | None = _afield("verify_widths", True)
    logit_mode: np.ndarray | None = _afield("logit_mode", True)

    def __attrs_post_init__(self) -> None:
        given: BatchRequests | None = self.requests
        if given is None:
            object.__setattr__(self, "requests", BatchRequests.from_arrays(
                self.query_start_loc, self.positions, self.request_ids, self.logit_rows, self.verify_widths,
                self.logit_mode))

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                    pool_blocks: Mapping[str, int] | PoolBlocks, tables: PersistentTables | None = None, *,
                    requests: BatchRequests | None = None) -> PersistentStep:
        """Build from flat field names (:data:`~dspark_abi.fields.SHARED_FIELDS` and
        :data:`~dspark_abi.fields.PERSISTENT_FIELDS`). With ``tables``: checked against them first
        (:func:`check_step`), raising :class:`ABIError` with every issue; without: only the shapes are checked."""
        report = _shape_report(arrays, config, policy, pool_blocks)
        report.raise_if_invalid()
        ids = arrays.get("request_ids")
        if ids is None:
            ids = np.arange(len(arrays["query_start_loc"]) - 1, dtype=np.int64)
        step = cls(config=config, policy=policy, pool_blocks=pool_blocks,
                   query_start_loc=arrays["query_start_loc"], positions=arrays["positions"],
                   slots=SlotMappings(**{p: arrays[f.name] for p, f in SLOT_SPECS.items()}),
                   table_slots=arrays["table_slots"], slot_generations=arrays["slot_generations"],
                   table_widths=arrays["table_widths"],
                   mapped=DeltaCells(**{p: arrays[f.name] for p, f in MAPPED_SPECS.items()}),
                   released=DeltaCells(**{p: arrays[f.name] for p, f in RELEASED_SPECS.items()}),
                   request_ids=ids, token_ids=arrays.get("token_ids"), logit_rows=arrays.get("logit_rows"),
                   verify_widths=arrays.get("verify_widths"), logit_mode=arrays.get("logit_mode"),
                   requests=requests)  # type: ignore[arg-type]  # None: derived in __attrs_post_init__
        if tables is not None:
            check_step(step, tables).raise_if_invalid()
        return step

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat field name -> array: the shared fields (ABI order) then the persistent ones."""
        out: dict[str, np.ndarray] = {}
        for f in SHARED_FIELDS:
            value = getattr(self, f.name) if f.family is None else self.slots[f.pool or ""]
            if value is not None:
                out[f.name] = value
        for f in PERSISTENT_FIELDS:
            out[f.name] = getattr(self, f.name) if f.pool is None else \
                (self.mapped if f.name.endswith("_mapped") else self.released)[f.pool]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of metadata the step carries (what a host writes per step)."""
        return sum(a.nbytes for a in self.to_arrays().values())

    @property
    def widths(self) -> dict[PoolName, int]:
        return dict(zip(POOL_NAMES, self.table_widths.tolist(), strict=True))

    def full_tables(self, tables: PersistentTables) -> dict[PoolName, np.ndarray]:
        """pool -> [R, table_widths[p]] int32 tables of the full form (``tables`` as of the step's build or right
        after its commit)."""
        req = self.requests
        starts = req.first_position
        ends = starts + req.lengths
        slots = self.table_slots.astype(np.int64)
        return narrow_tables(self.config.layout, self.config.sliding_window, tables._tables, slots, starts, ends,
                             self.widths, {p: self.mapped.cells(p) for p in POOL_NAMES})

    def to_full(self, tables: PersistentTables) -> PackedBatch:
        """The 1.x :class:`~dspark_abi.batch.PackedBatch` of this step (its tables exactly as ``BatchBuilder.build()``
        makes them), fully validated. ``tables``: as of the step's build or right after its commit (the slot
        generations must be current: ``tables.stale_slot`` otherwise)."""
        _current(self, tables).raise_if_invalid()
        arrays = self.to_arrays()
        shared = {f.name: arrays[f.name] for f in SHARED_FIELDS if f.name in arrays}
        full = shared | {TABLE_FIELDS[p]: t for p, t in self.full_tables(tables).items()}
        ordered = {f.name: full[f.name] for f in BATCH_FIELDS if f.name in full}
        return PackedBatch.from_arrays(ordered, self.config, self.policy, self.pool_blocks, requests=self.requests)

    def to_upstream(self, tables: PersistentTables, **kw: Any) -> dict[str, np.ndarray]:
        """Upstream's ``l3_prefill_fwd`` tensors (frozen-depth tables), through :meth:`to_full`."""
        from dspark_abi.upstream import to_upstream
        return to_upstream(self.to_full(tables), **kw)


# ------------------------------------------------------------------------------------------------ checks
def check_step(step: PersistentStep, tables: PersistentTables, *,
               level: Literal["incremental", "full"] = "incremental", derived: bool = False) -> ValidationReport:
    """Every rule the persistent ``step`` breaks against ``tables`` (as of the step's build, before its commit).

    ``incremental``: O(cells the step changes + R + rows): the tables' kept proof, the step's slots and
    generations, its delta (:func:`_delta_issues`), the token rules of the full form and each live row's slots
    against the cell of its page. ``full``: stateless: the tables proven from scratch (O(S x width)), the delta,
    then the full validator on :meth:`PersistentStep.to_full`'s arrays. Both report no issue for exactly the same
    steps (tests/abi/test_persistent.py). ``derived``: see :func:`_check` (the builder's own steps only)."""
    if level == "full":
        fresh = tables.copy()
        issues = fresh.prove()
        if issues:
            return ValidationReport(tuple(issues))
        report = _current(step, fresh)
        if not report.ok:
            return report
        issues = list(_delta_issues(step, fresh)[0])
        if issues:
            return ValidationReport(tuple(issues))
        arrays = {f.name: a for f in SHARED_FIELDS if (a := step.to_arrays().get(f.name)) is not None}
        arrays |= {TABLE_FIELDS[p]: t for p, t in step.full_tables(fresh).items()}
        return validate_arrays(arrays, step.config, step.policy, step.pool_blocks)
    return _check(step, tables, derived=derived)[0]


def _shape_report(arrays: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                  pool_blocks: Mapping[str, int] | PoolBlocks) -> ValidationReport:
    """Presence, dtypes and shapes of a persistent step's arrays (the full form's shape level, the tables standing
    in as zero-stride arrays of the step's widths), O(R + P)."""
    issues: list[Issue] = []
    widths = arrays.get("table_widths")
    qsl = arrays.get("query_start_loc")
    n_req = len(qsl) - 1 if isinstance(qsl, np.ndarray) and qsl.ndim == 1 and qsl.size >= 1 else 0
    for f in PERSISTENT_FIELDS:
        a = arrays.get(f.name)
        if not isinstance(a, np.ndarray) or type(a) is not np.ndarray:
            issues.append(Issue("array.missing" if a is None else "array.dtype", f.name, "required field of the "
                                "persistent form", expected=f"{f.dtype} {f.shape_text()}", actual=type(a).__name__))
        elif a.dtype != np.dtype(f.dtype):
            issues.append(Issue("array.dtype", f.name, "wrong dtype", expected=f.dtype, actual=a.dtype.name))
        elif a.ndim != f.ndim or (f.shape == ("R",) and a.shape[0] != n_req) or (f.shape == ("7",) and a.size != 7) \
                or (f.ndim == 2 and a.shape[1] != 3):
            issues.append(Issue("array.shape", f.name, f"must be {f.shape_text()}", expected=f.shape_text(),
                                actual=list(a.shape)))
    if issues:
        return ValidationReport(tuple(issues))
    given = widths if isinstance(widths, np.ndarray) else np.ones(7, np.int32)
    fake = {TABLE_FIELDS[p]: np.broadcast_to(np.int32(-1), (n_req, max(int(w), 0)))
            for p, w in zip(POOL_NAMES, given.tolist(), strict=True)}
    shared = {f.name: arrays[f.name] for f in SHARED_FIELDS if f.name in arrays}
    return validate_arrays(shared | fake, config, policy, pool_blocks, level="shape")


def _current(step: PersistentStep, tables: PersistentTables) -> ValidationReport:
    """``tables.slot`` / ``tables.stale_slot``: the step's slots exist, are distinct, carry the slots' current
    generations and are free or held by the same request (O(R); the id lookup only for slots claimed now)."""
    issues: list[Issue] = []
    if (step.config is not tables.config and step.config != tables.config) or \
            (step.pool_blocks is not tables.pool_blocks and step.pool_blocks != tables.pool_blocks):
        return ValidationReport((Issue("config.mismatch", "tables", "the persistent tables were built for another "
                                       "config or other pools", expected=step.config.name,
                                       actual=tables.config.name),))
    slots = step.table_slots.astype(np.int64)
    bad = (slots < 0) | (slots >= tables.slots)
    _flag(issues, "tables.slot", "table_slots", bad, f"slots must be in [0, {tables.slots})",
          expected=f"0..{tables.slots - 1}", actual=slots)
    order = np.sort(slots)
    _flag(issues, "tables.slot", "table_slots", order[1:] == order[:-1], "two requests share a slot",
          expected="distinct slots", actual=order[1:])
    if issues:
        return ValidationReport(tuple(issues))
    gen = tables._generations[slots]
    ids = step.requests.ids
    held = tables._in_use[slots]
    _flag(issues, "tables.stale_slot", "slot_generations", step.slot_generations != gen,
          "the slot was released or recycled since the step was built", request_of=np.arange(slots.size),
          expected=gen, actual=step.slot_generations)
    _flag(issues, "tables.stale_slot", "table_slots", held & (tables._holders[slots] != ids),
          "the slot is held by another request", request_of=np.arange(slots.size), expected=tables._holders[slots],
          actual=ids)
    claims = np.flatnonzero(~held)
    if claims.size:
        elsewhere = np.array([tables._slot_of.get(i, -1) for i in ids[claims].tolist()], np.int64)
        _flag(issues, "tables.stale_slot", "table_slots", elsewhere >= 0, "the request already holds another slot",
              index_of=claims, request_of=claims, expected=elsewhere, actual=slots[claims])
    return ValidationReport(tuple(issues))


#: [2, 7, R] int64 (first, end) of the run each request's slot holds in each pool once the step is applied
Runs = np.ndarray


def _delta_issues(step: PersistentStep, tables: PersistentTables) -> tuple[list[Issue], Runs]:
    """The delta's issues (``delta.mapped``, ``delta.released``) and the [2, 7, R] runs ``[first, end)`` each
    request's slot holds once the step is applied. O(cells changed + R); slots known current (:func:`_current`).

    The seven pools' cells are checked together (one array with a pool column, the per-pool constants gathered by
    it; the table and owner reads one gather each from the tables' flat stores): the rules are the same for every
    pool, and numpy's per-call overhead, not the cells, is the cost of a decode-rate step."""
    issues: list[Issue] = []
    slots = step.table_slots.astype(np.int64)
    n_req = slots.size
    index = np.full(tables.slots, -1, np.int64)      # slot -> its request in the step (slots known in range, distinct)
    index[slots] = np.arange(n_req)
    layout = tables.layout
    now = tables._runs[:, :, slots]                                                 # [2, 7, R]: one gather
    first, end = now[0].reshape(-1), now[1].reshape(-1)                              # [7 * R], pool-major
    width = tables._widths
    ring = layout.columns.ring[:, 0]
    n_blocks = tables._n_blocks

    r_pool, r_slot, r_page, r_block = step.released.pooled()
    r_req, r_in = _in_step(index, r_slot)
    r_run = r_pool * n_req + r_req                                     # index into the [7 * R] runs
    held = r_in & (r_page >= first[r_run]) & (r_page < end[r_run])
    cell = np.full(r_slot.size, -2, np.int64)
    if held.any():
        cell[held] = tables._flat[tables._cell(r_pool[held], r_slot[held], r_page[held])]
    _flag_pools(issues, "delta.released", RELEASED_SPECS, r_pool, ~held | (cell != r_block), "a released cell must "
                "be a page of the step's slot's run holding the block it names", expected=cell, actual=r_block)
    r_keys = _ordered(r_run * _KEY + r_page)[0]
    twice = r_keys[1:] == r_keys[:-1]
    if twice.any():
        _flag_pools(issues, "delta.released", RELEASED_SPECS, r_keys[1:] // _KEY // n_req, twice,
                    "a cell is released twice", expected="distinct cells", actual=r_keys[1:] % _KEY)
    k = np.bincount(r_run[held], minlength=7 * n_req)
    top = _page_bounds(r_run[held], r_page[held], 7 * n_req)[1] - 1
    runs_of = np.repeat(np.arange(7), n_req)
    _flag_pools(issues, "delta.released", RELEASED_SPECS, runs_of, (k > 0) & (top >= first + k), "released pages "
                "must be the front of the slot's run", expected=first + k - 1, actual=top, per_request=n_req)
    after_first = first + k
    freed = _ordered(r_pool[held] * _KEY + r_block[held])[0]          # (pool, block) a held release frees

    m_pool, m_slot, m_page, m_block = step.mapped.pooled()
    m_req, m_in = _in_step(index, m_slot)
    m_run = m_pool * n_req + m_req
    inside = m_in & (m_page >= after_first[m_run]) & (m_page < end[m_run])
    bad = ~m_in | (m_page < 0) | inside | (~ring[m_pool] & (m_page >= width[m_pool]))
    _flag_pools(issues, "delta.mapped", MAPPED_SPECS, m_pool, bad, "a mapped cell must be an unmapped page of a slot "
                "of the step (a compressed page below the table width)", expected="a page outside the run, below "
                "a compressed table's width", actual=m_page)
    in_range = (m_block >= 0) & (m_block < n_blocks[m_pool])
    owner = np.full(m_block.size, -1, np.int64)
    if in_range.any():
        owner[in_range] = tables._owners[tables._owner_at[m_pool[in_range]] + m_block[in_range]]
    taken = owner >= 0
    if taken.any() and freed.size:       # a block the same delta releases may be mapped again (only held ones
        at = np.flatnonzero(taken)       # are looked for among the freed)
        keys = m_pool[at] * _KEY + m_block[at]
        taken[at] = freed[np.minimum(np.searchsorted(freed, keys), freed.size - 1)] != keys
    _flag_pools(issues, "delta.mapped", MAPPED_SPECS, m_pool, ~in_range | taken, "a mapped block must be in the "
                "pool and free (or released by this delta)", expected="a free block", actual=m_block)
    for what, keys in (("cell", m_run * _KEY + m_page), ("block", m_pool * _KEY + m_block)):
        ordered = _ordered(keys)[0]
        twice = ordered[1:] == ordered[:-1]
        if twice.any():         # the offenders' pools and values are worked out only when there are any
            pool_of = ordered[1:] // _KEY // (n_req if what == "cell" else 1)
            _flag_pools(issues, "delta.mapped", MAPPED_SPECS, pool_of, twice, f"a {what} is mapped twice",
                        expected=f"distinct {what}s", actual=ordered[1:] % _KEY)
    ok = ~bad
    count = np.bincount(m_run[ok], minlength=7 * n_req)
    lo, hi = _page_bounds(m_run[ok], m_page[ok], 7 * n_req)
    kept = np.maximum(end - after_first, 0)
    has_run = kept > 0
    new_first = np.where(has_run, np.minimum(after_first, lo), lo)
    new_end = np.where(has_run, np.maximum(end, hi), hi)
    total = kept + count
    grew = count > 0
    broken = grew & ((new_end - new_first != total) | (ring[runs_of] & (total > width[runs_of])))
    _flag_pools(issues, "delta.mapped", MAPPED_SPECS, runs_of, broken, "the slot's pages must form one run after the "
                "step (at most the ring width)", expected=total, actual=new_end - new_first, per_request=n_req)
    runs = np.empty((2, 7, n_req), np.int64)
    np.copyto(runs[0].reshape(-1), np.where(grew, new_first, after_first))
    np.copyto(runs[1].reshape(-1), np.where(grew, new_end, end))
    return issues, runs


def _flag_pools(issues: list[Issue], code: str, specs: Mapping[PoolName, FieldSpec], pool: np.ndarray,
                mask: np.ndarray, message: str, *, expected: Any, actual: Any, per_request: int | None = None) -> None:
    """:func:`_flag` once per pool with offenders, in pool order, naming that pool's field (index: the offender's
    entry of the field; with ``per_request``, ``mask`` is pool-major over [7 * R] and the index is the request)."""
    if not mask.any():
        return
    for i, p in enumerate(POOL_NAMES):
        mine = pool == i
        if not (mask & mine).any():
            continue
        offset = int(np.argmax(mine))            # cells and runs are pool-major: the pool's first entry
        hits = mask & mine
        index = np.arange(mask.size) - offset
        _flag(issues, code, specs[p].name, hits, message, index_of=index,
              request_of=index if per_request is not None else None, expected=expected, actual=actual)


def _in_step(index: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([M] batch index of each ``wanted`` slot (0 where absent), [M] mask of the slots of the step); ``index``:
    [S] the request of each slot in the step, -1 for the others (a gather, no search)."""
    inside = (wanted >= 0) & (wanted < index.size)
    at = index[np.where(inside, wanted, 0)] if index.size else np.zeros(wanted.size, np.int64)
    found = inside & (at >= 0)
    return np.where(found, at, 0), found


def _page_bounds(req: np.ndarray, page: np.ndarray, n_req: int) -> tuple[np.ndarray, np.ndarray]:
    """([R] least page, [R] one past the greatest page) of each request's cells (int64 max and -1 without cells);
    one reduceat over the runs of a request-major list (the plan's order), ufunc.at otherwise."""
    lo = np.full(n_req, np.iinfo(np.int64).max, np.int64)
    hi = np.full(n_req, -1, np.int64)
    if req.size == 0:
        return lo, hi
    if bool((req[1:] >= req[:-1]).all()):
        head = np.flatnonzero(np.concatenate(([True], req[1:] != req[:-1])))
        lo[req[head]] = np.minimum.reduceat(page, head)
        hi[req[head]] = np.maximum.reduceat(page, head) + 1
    else:
        np.minimum.at(lo, req, page)
        np.maximum.at(hi, req, page + 1)
    return lo, hi


def written_slots(layout: CacheLayout, tables: PersistentTables, row_slot: np.ndarray, pos: np.ndarray,
                  mapped: Mapping[PoolName, Cells], released: Mapping[PoolName, Cells]) -> dict[PoolName, np.ndarray]:
    """pool -> [N] int64 slot mapping of rows at positions ``pos`` whose requests sit in slots ``row_slot``: the
    physical row each writes once the delta (``mapped``, ``released``: pool -> (slots, pages, blocks)) is applied to
    ``tables``, -1 where it writes nothing or its page is unmapped. The one home of a persistent step's slots
    (``build_step`` derives them, ``check_step`` re-derives them). A page the slot holds is read from the table (and
    looked up among the released cells), any other among the mapped cells; a pool without such cells skips the
    search, and only rows at or below their slot's highest released page look among its released cells (measured:
    one pass over all pools, [7, N] arrays with a pool key, is slower: at N in the thousands the elements, not
    the calls, cost, and the per-pool pass skips what a pool does not need).
    O(N + E log(cells changed) + S) for E distinct (slot, page) runs of rows, no table copied.

    Rows are looked up per run of consecutive rows writing one page of one slot (a request's rows are consecutive:
    a page of 32 rows is one lookup, not 32), then each row takes its run's block."""
    out = {}
    slots = tables.slots
    n = row_slot.size
    runs_of: dict[tuple[int, int], _Runs] = {}     # pools of one geometry (csa_cmp / idx, the two ratio-4 state
    for p in POOL_NAMES:                           # pools) share their rows' pages and runs
        pl, table = layout.pools[p], tables._tables[p]
        width = table.shape[1]
        geometry = runs_of.get((pl.ratio, pl.page_size))
        if geometry is None:
            geometry = runs_of[(pl.ratio, pl.page_size)] = _Runs.of(pl, row_slot, pos)
        at_w, offset, run, e_slot, e_page = geometry
        result = np.full(n, -1, np.int64)
        if run.size:
            held = (e_page >= tables._first[p][e_slot]) & (e_page < tables._end[p][e_slot])
            flat = e_slot * width + table_column(pl, np.where(held, e_page, 0), width)    # one gather, flattened
            block = np.where(held, np.take(table.reshape(-1), flat), -1).astype(np.int64)
            for (c_slot, c_page, c_block), rows, is_map in ((released[p], held, False), (mapped[p], ~held, True)):
                if c_slot.size and not is_map and c_slot.min() >= 0 and c_slot.max() < slots:
                    top = np.full(slots, -1, np.int64)          # each slot's highest released page: the runs above
                    np.maximum.at(top, c_slot, c_page)          # it (all of them in a valid step) skip the search
                    rows = rows & (e_page <= top[e_slot])
                if c_slot.size and rows.any():
                    at = np.flatnonzero(rows)
                    ordered, order = _ordered(c_slot * _KEY + c_page)
                    found, hit = _find(ordered, e_slot[at] * _KEY + e_page[at])
                    cell = found[hit] if order is None else order[found[hit]]
                    block[at[hit]] = c_block[cell] if is_map else -1
            row_block = block[run]
            slot = np.where(row_block >= 0, row_block * pl.page_size + offset, -1)
            if at_w is None:
                result = slot
            else:
                result[at_w] = slot
        out[p] = result
    return out


class _Runs(NamedTuple):
    """The rows of :func:`written_slots` that write a pool of one geometry (ratio, page size), grouped in runs of
    consecutive rows writing one page of one slot."""

    at_w: np.ndarray | None     # [W] the writing rows (None: every row writes)
    offset: np.ndarray          # [W] each writing row's offset in its page
    run: np.ndarray             # [W] its run
    slot: np.ndarray            # [E] each run's slot
    page: np.ndarray            # [E] and logical page

    @classmethod
    def of(cls, pl: PoolLayout, row_slot: np.ndarray, pos: np.ndarray) -> _Runs:
        logical = written_logical(pl, pos)
        writes = logical >= 0
        at_w = None if bool(writes.all()) else np.flatnonzero(writes)       # the per-token pools: every row
        lg, sl = (logical, row_slot) if at_w is None else (logical[at_w], row_slot[at_w])
        page = lg // pl.page_size
        if page.size == 0:
            return cls(at_w, page, page, page, page)
        change = np.empty(page.size, dtype=bool)          # a new run: another page or another slot
        change[0] = True
        np.not_equal(page[1:], page[:-1], out=change[1:])
        change[1:] |= sl[1:] != sl[:-1]
        head = np.flatnonzero(change)
        length = np.empty(head.size, np.int64)          # rows per run; a cumsum of the change mask is slower
        np.subtract(head[1:], head[:-1], out=length[:-1])
        length[-1] = page.size - head[-1]
        run = np.repeat(np.arange(head.size), length)
        return cls(at_w, lg - page * pl.page_size, run, sl[head], page[head])


def _ordered(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(``keys`` ascending, the sorting permutation or None when they already were: a plan lists its cells
    request-major, pages ascending, so the common case costs one comparison pass instead of a sort)."""
    if keys.size < 2 or bool((keys[1:] >= keys[:-1]).all()):
        return keys, None
    order = np.argsort(keys, kind="stable")
    return keys[order], order


def _check(step: PersistentStep, tables: PersistentTables, *, derived: bool = False) -> tuple[ValidationReport, Runs]:
    """The incremental proof (:func:`check_step`) and the runs after the step.

    derived: the step was just assembled by ``BatchBuilder.build_step`` under the allocator's lock, its arrays in
    their declared dtypes and its slot mappings read from these very tables and delta by :func:`written_slots` (the
    one home of that lookup), its ``query_start_loc`` and row owners written from one request record: the shapes, the
    per-row slot lookups and the rows' owners are not derived again (the full form's builder
    skips re-validating the arrays it validated the same way). The slots, generations, delta, token rules and
    coverage are checked either way."""
    if not derived:
        shape = _shape_report(step.to_arrays(), step.config, step.policy, step.pool_blocks)
        if not shape.ok:
            return shape, _NO_RUNS
    report = _current(step, tables)
    if not report.ok:
        return report, _NO_RUNS
    issues, runs = _delta_issues(step, tables)
    qsl, n = step.query_start_loc, step.num_tokens
    widths = step.widths
    row_request, pos, start, end, live, ok_req = check_tokens(
        issues, config=step.config, policy=step.policy, qsl=qsl, n_tokens=n, n_rows=step.positions.size,
        positions=step.positions, slots={p: s for p, s in step.slots.items()}, token_ids=step.token_ids,
        logit_rows=step.logit_rows, hidden=None, verify_widths=step.verify_widths, logit_mode=step.logit_mode,
        ring_widths=widths, row_request=step.row_request[:n] if derived else None)
    if issues:      # a malformed delta or token rule: the rows' cells are not worth looking up
        return ValidationReport(tuple(issues)), runs
    window = step.config.sliding_window
    layout = tables.layout
    slots = step.table_slots.astype(np.int64)
    rows = np.flatnonzero(live)
    req = row_request[rows]
    row_slot = slots[req]
    request = np.arange(slots.size)
    nonempty = ok_req & (end > start)
    cols = layout.columns                   # the seven pools' pages at once, [7, R]
    lo_all, hi_all = cols.page_spans(start, end, window)
    need_all = np.where(nonempty, hi_all - lo_all * cols.ring, 0)
    too_narrow = need_all > step.table_widths.astype(np.int64).reshape(7, 1)
    first_all, end_all = runs
    uncovered_all = nonempty & ((lo_all < first_all) | (hi_all > end_all))
    narrow_any: list[bool] = np.logical_or.reduce(too_narrow, axis=1).tolist()      # per pool
    uncovered_any: list[bool] = np.logical_or.reduce(uncovered_all, axis=1).tolist()
    derived_slots: dict[PoolName, np.ndarray] | None = None
    for i, p in enumerate(POOL_NAMES):
        pl = layout.pools[p]
        lo, hi = lo_all[i], hi_all[i]
        if narrow_any[i]:                   # the full form's tables.width (a ring must not wrap onto itself)
            _flag(issues, "tables.width", TABLE_FIELDS[p], too_narrow[i], f"table_widths gives {widths[p]} "
                  "columns, fewer than the pages the request's live range needs", request_of=request,
                  expected=need_all[i], actual=widths[p])
            continue
        if uncovered_any[i]:
            _flag(issues, "coverage.unmapped", TABLE_FIELDS[p], uncovered_all[i], "a page the request reads or writes "
                  "in this call is not held by its slot", request_of=request, expected=np.stack([lo, hi], 1),
                  actual=np.stack([first_all[i], end_all[i]], 1))
        if derived:
            continue
        if derived_slots is None:
            derived_slots = written_slots(layout, tables, row_slot, pos[rows],
                                          {q: step.mapped.cells(q) for q in POOL_NAMES},
                                          {q: step.released.cells(q) for q in POOL_NAMES})
        want = derived_slots[p]
        writes = written_logical(pl, pos[rows]) >= 0
        got = step.slots[p][rows]
        field = SLOT_SPECS[p].name
        _flag(issues, "slots.off_boundary", field, ~writes & (got != -1), "set only on ratio boundaries",
              index_of=rows, request_of=req, expected=-1, actual=got)
        wrong = writes & (got != want)
        _flag(issues, "slots.mismatch", field, wrong, "slot must be the persistent table's cell of "
              "the row's page (block * page_size + offset)", index_of=rows, request_of=req, expected=want, actual=got)
        if wrong.any():     # R30 follows from R29 and the block ownership, unless R29 fails: then look for it
            written = np.sort(got[got >= 0])
            _flag(issues, "writes.duplicate", field, written[1:] == written[:-1], "two live rows write one "
                  "physical row", expected="distinct rows", actual=written[1:])
    return ValidationReport(tuple(issues)), runs


# ------------------------------------------------------------------------------------------------ full -> persistent
def from_full(batch: PackedBatch, tables: PersistentTables) -> PersistentStep:
    """The persistent form of a full-form ``batch`` against ``tables`` as of before the step: each request keeps the
    slot it holds (a new one takes the lowest free slot), the delta is what the batch's tables add to the slots'
    runs (and the ring pages below each live range that the slots still hold, released). ``to_full`` of the result
    gives ``batch`` back. Raises :class:`ABIError` (``delta.*``, ``tables.*``) when the batch's tables disagree with
    ``tables`` (a live cell holding another block than the slot's). Cost O(R * width), off the hot path."""
    ids = batch.requests.ids
    known = np.array([tables._slot_of.get(i, -1) for i in ids.tolist()], np.int64)
    fresh = np.flatnonzero(known < 0)
    free = np.flatnonzero(~tables._in_use)
    if free.size < fresh.size:
        raise ABIError([Issue("tables.slot", "table_slots", "the persistent tables have too few free slots",
                              expected=f">= {fresh.size} free slots", actual=int(free.size),
                              fix="grow the tables (PersistentTables.grow)")])
    slots = known.copy()
    slots[fresh] = free[: fresh.size]
    starts = batch.requests.first_position
    ends = starts + batch.requests.lengths
    window = batch.config.sliding_window
    mapped: dict[PoolName, Cells] = {}
    released: dict[PoolName, Cells] = {}
    for p in POOL_NAMES:
        pl, step_table = batch.config.layout.pools[p], batch.tables[p]
        width = step_table.shape[1]
        first, end = tables._first[p][slots], tables._end[p][slots]
        if pl.is_ring:
            req, page = touched_pages(pl, starts, ends, window)
            lo, _ = page_span(*live_range(pl, starts, ends, window), pl.page_size)
            count = np.where(ends > starts, np.clip(np.minimum(lo, end) - first, 0, None), 0)
            r_req, r_page = expand_ranges(first, count)
            r_block = tables._tables[p][slots[r_req], table_column(pl, r_page, tables._tables[p].shape[1])]
            released[p] = (slots[r_req], r_page, r_block.astype(np.int64))
        else:
            req, page = np.nonzero(step_table >= 0)
            req, page = req.astype(np.int64), page.astype(np.int64)
            released[p] = (_EMPTY, _EMPTY, _EMPTY)
        block = step_table[req, table_column(pl, page, width)].astype(np.int64)
        has = block >= 0
        req, page, block = req[has], page[has], block[has]
        new = (page < first[req]) | (page >= end[req])
        if pl.is_ring:                  # pages released above are remapped only when the batch maps them anew
            new |= np.isin(slots[req] * _KEY + page, released[p][0] * _KEY + released[p][1])
        mapped[p] = (slots[req[new]], page[new], block[new])
    req_rec = batch.requests
    step = PersistentStep(
        config=batch.config, policy=batch.policy, pool_blocks=batch.pool_blocks,
        query_start_loc=batch.query_start_loc, positions=batch.positions, slots=batch.slots,
        table_slots=slots.astype(np.int32), slot_generations=tables._generations[slots],
        table_widths=np.array([batch.tables[p].shape[1] for p in POOL_NAMES], np.int32),
        mapped=DeltaCells.from_cells(mapped), released=DeltaCells.from_cells(released),
        request_ids=ids, token_ids=batch.token_ids, logit_rows=batch.logit_rows,
        verify_widths=batch.verify_widths, logit_mode=batch.logit_mode, requests=req_rec)
    check_step(step, tables).raise_if_invalid()
    return step


__all__ = [
    "DeltaCells",
    "PersistentStep",
    "PersistentTables",
    "check_step",
    "from_full",
    "narrow_tables",
    "step_widths",
    "written_slots",
]
