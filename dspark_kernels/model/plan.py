"""`BatchPlan`: every fact the kernels derive from a validated `PackedBatch`, derived once per batch and rank.

A forward builds one plan before its first layer (one per rank of a TP group) and hands it to every layer,
stage and backend, which read it instead of taking ``rank: int`` and re-deriving per layer:

======================  ==========================================================================================
field                   what, and where it comes from
======================  ==========================================================================================
``rank``                None (the whole TP group) or the TP rank whose query rows this plan covers
``row_start/row_stop``  the query rows: ``[0, P)``, or the rank's ``[r*L, (r+1)*L)``
``positions``           [P] int64 positions of all group rows (the KV side covers them all)
``request``             [P] int32 ``batch.row_request``: the ABI's one row-ownership array, shared, not recomputed
``tables[pool]``        [R_t, W_t] int32 block table of each pool the kernels read (default ``batch.tables``; a
                        serving loop may hand its persistent tables: one row per request slot, any width)
``table_row``           [P] int32 row of ``tables[pool]`` each group row reads (default ``request``; the request's
                        slot with persistent tables); -1 on padding rows. Every kernel table lookup is
                        ``tables[pool][table_row[rows], column]``, column from the table's own width
                        (:func:`dspark_abi.layout.table_column`): no kernel assumes ``R_t == R`` or a width
``run_*``               the group rows ``[qsl[r], qsl[r+1])`` of every non-empty request: ``batch.requests.runs()``
                        (:meth:`runs_in` clips them to a row range)
``boundaries[m]``       [B] int64 live rows that close a ratio-m window, m = 4 and 128 (they write entry
                        ``(p+1)/m - 1``: :func:`~dspark_kernels.model.geometry.boundary_rows`)
``visible[m]``          [P] int64 entries a row sees, ``(p+1) // m`` (:func:`dspark_abi.layout.visible_entries`),
                        0 on padding rows
``window``              [rows, W] int64 physical ``ori`` rows of each query row's sliding window, oldest first
                        (:func:`window_key_rows`); -1 = none
``entry_rows_in``       [hi - lo, V] int64 physical rows of every visible compressed entry of query rows
                        ``[lo, hi)`` through their request's table, for ``hca_cmp`` (HCA's dense entries) and
                        ``idx`` (the lightning indexer's candidates), V their widest count
                        (:func:`visible_entry_rows`): derived per call, for the row tile a kernel reads, never for
                        the whole batch (at 1M positions a row sees up to 262,144 ``idx`` entries: [rows, V] of
                        every query row would be gigabytes, and the plan would cost seconds)
``state_windows[pool]`` the boundary rows of each compressor state pool (``csa_state``, ``csa_inner_state``,
                        ``hca_state``) and the state rows [B, span] of their windows (:class:`StateWindows`)
``rope[kind]``          RoPE cos / sin [P, rd/2] at the positions, per layer kind of the schedule, in the
                        plan's precision (CSA and HCA share the compressed frequencies, so one object)
``window_rope[m]``      RoPE cos / sin [P, rd/2] at the ratio-m window starts (compressor entries)
======================  ==========================================================================================

The lookups (``window``, ``entry_rows``, ``state_windows``) are the same for every layer: each layer of either
backend reads them here, and only the layer kinds of the config's schedule get theirs. A plan serves one
precision (its RoPE rows are that precision's values). It is immutable and pickles (the pypto backend ships it
to its kernel processes).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Protocol

import attrs
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig, PackedBatch, PaddingPolicy, PoolBlocks
from dspark_abi.batch import SlotMappings
from dspark_abi.config import LayerKind
from dspark_abi.layout import POOL_NAMES, physical_rows, visible_entries
from dspark_abi.persistent import PersistentStep, PersistentTables
from dspark_abi.requests import BatchRequests
from dspark_kernels.model.geometry import (
    INDEX_RATIO,
    boundary_rows,
    window_start_positions,
    window_state_rows,
)
from dspark_kernels.model.numerics import Precision, check_precision
from dspark_kernels.model.rope import rope_at

#: One request's contiguous rows inside a row range: ``(start, stop, request)``, start < stop.
Run = tuple[int, int, int]


def compress_ratios(config: ModelConfig) -> tuple[int, ...]:
    """The compress ratios of the ABI's compressed pools (4 and 128), ascending."""
    return tuple(sorted({pl.ratio for pl in config.layout if pl.ratio}))


def window_key_rows(positions: np.ndarray, table_row: np.ndarray, ori_table: np.ndarray, window: int,
                    page_size: int) -> np.ndarray:
    """[T, W] int64 physical ``ori`` rows of every query's sliding window, oldest first (the ori pool is a ring).

    positions, table_row: [T] int (table_row: the ``ori_table`` row each query reads, -1 = padding row);
    ori_table [R_t, width] int32. With ``v = min(W, p + 1)``,
    column k < v holds the row of key position ``p + 1 - v + k``; columns >= v, padding rows and unmapped pages
    hold -1. Isolation comes from reading the query's own request's table row; causality from keys <= p.
    """
    p = np.asarray(positions, dtype=np.int64)[:, None]                   # (T, 1)
    k = np.arange(window, dtype=np.int64)[None, :]                       # (1, W)
    visible = np.minimum(window, p + 1)                                  # (T, 1)
    key_pos = np.where(k < visible, p + 1 - visible + k, -1)             # (T, W)
    rows = physical_rows(ori_table, table_row, key_pos, page_size, ring=True)
    return np.where(k < visible, rows, -1)


def visible_entry_rows(visible: np.ndarray, table_row: np.ndarray, table: np.ndarray, page_size: int) -> np.ndarray:
    """[T, Vmax] int64 physical rows of the compressed entries ``c < visible[t]`` through each row's own table row
    (visible: [T] counts, 0 on padding rows; table_row [T], -1 on padding rows; Vmax = max(visible)); -1 beyond a
    row's count or unmapped."""
    c = np.arange(int(np.max(visible, initial=0)), dtype=np.int64)[None, :]             # (1, Vmax)
    return physical_rows(table, table_row, np.where(c < np.asarray(visible)[:, None], c, -1), page_size, ring=False)


class StepRows(Protocol):
    """What the kernels read of a step besides its block tables, in either form: a full-form
    :class:`~dspark_abi.PackedBatch` and a :class:`~dspark_abi.persistent.PersistentStep` both satisfy it (their
    geometry and ``row_request`` come from one base, :class:`~dspark_abi.batch.StepArrays`). Every array is the
    full form's (spec 4.1): query_start_loc [R+1] int32, positions [P] int32, the seven [P] int64 slot mappings,
    token_ids [P] int64 | None, logit_rows [M] int32 | None, request_ids [R] int64, verify_widths [R] int32 | None,
    logit_mode [R] int8 | None; ``row_request`` [P] int32 (-1 on padding rows); ``requests`` the per-request
    record."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def policy(self) -> PaddingPolicy: ...
    @property
    def pool_blocks(self) -> PoolBlocks: ...
    @property
    def query_start_loc(self) -> np.ndarray: ...
    @property
    def positions(self) -> np.ndarray: ...
    @property
    def slots(self) -> SlotMappings: ...
    @property
    def requests(self) -> BatchRequests: ...
    @property
    def token_ids(self) -> np.ndarray | None: ...
    @property
    def logit_rows(self) -> np.ndarray | None: ...
    @property
    def request_ids(self) -> np.ndarray | None: ...
    @property
    def verify_widths(self) -> np.ndarray | None: ...
    @property
    def logit_mode(self) -> np.ndarray | None: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def padded_rows(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def row_request(self) -> np.ndarray: ...


class PersistentRows:
    """Deprecated since 1.3 (removed in the next minor version): a :class:`~dspark_abi.persistent.PersistentStep`
    is its own :class:`StepRows` (``row_request``, ``tp_size``, ``padded_rows``, ...), so ``PersistentRows.of(step)``
    and ``PersistentRows(step)`` return ``step`` itself, with a DeprecationWarning."""

    def __new__(cls, step: PersistentStep, row_request: np.ndarray | None = None) -> PersistentStep:  # type: ignore[misc]
        return _persistent_rows_deprecated(step)

    @classmethod
    def of(cls, step: PersistentStep) -> PersistentStep:
        return _persistent_rows_deprecated(step)


def _persistent_rows_deprecated(step: PersistentStep) -> PersistentStep:
    """``step``, warning at the caller of :class:`PersistentRows` (two frames up)."""
    warnings.warn("dspark_kernels.model.plan.PersistentRows is deprecated: a PersistentStep is its own StepRows, "
                  "pass the step", DeprecationWarning, stacklevel=3)
    return step


def _table_issues(batch: StepRows, tables: Mapping[str, np.ndarray] | None,
                  request_table_row: np.ndarray | None, read: Mapping[str, np.ndarray]) -> list[Issue]:
    """``array.shape`` issues of a plan's own ``tables`` (None: the batch's own, not checked) and request rows
    (checked against ``read``, the tables the plan reads)."""
    issues = []
    if tables is not None:
        for pool in POOL_NAMES:
            table = tables.get(pool)
            if table is None or np.ndim(table) != 2 or np.asarray(table).dtype != np.int32:
                issues.append(Issue("array.shape", f"tables.{pool}", "a plan's tables need every pool of the batch",
                                    expected="[R_t, W_t] int32", actual=None if table is None else
                                    f"{np.shape(table)} {np.asarray(table).dtype}"))
    if request_table_row is not None:
        rows = np.asarray(request_table_row)
        count = min((np.shape(t)[0] for t in read.values() if np.ndim(t) == 2), default=0)
        if rows.shape != (batch.num_requests,) or rows.dtype.kind not in "iu":
            issues.append(Issue("array.shape", "request_table_row", "one table row per request",
                                expected=[batch.num_requests], actual=list(rows.shape)))
        elif rows.size and not (int(rows.min()) >= 0 and int(rows.max()) < count):
            issues.append(Issue("array.shape", "request_table_row", "every request's row must exist in the tables",
                                expected=f"[0, {count})", actual=[int(rows.min()), int(rows.max())]))
    return issues


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@attrs.frozen(eq=False)
class RopeRows:
    """RoPE cos and sin, each [P, rd/2] float32 (bf16 values in a2a3), one row per group row."""

    cos: np.ndarray
    sin: np.ndarray

    def rows(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) of group rows ``[lo, hi)``."""
        return self.cos[lo:hi], self.sin[lo:hi]


@attrs.frozen(eq=False)
class StateWindows:
    """One compressor's windows over the group rows: ``boundaries`` [B] int64, the live rows that close a window
    (ascending); ``rows`` [B, span] int64, the physical state rows each pools, -1 = missing slot
    (:func:`~dspark_kernels.model.geometry.window_state_rows`)."""

    boundaries: np.ndarray
    rows: np.ndarray


@attrs.frozen(eq=False)
class CompressorState:
    """One compressor's state addressing: its ring, where each group row writes and how windows are read back.

    pool: [S, 2*coff*d] float32 state rows (``[kv | score]``), **mutated** by the compressor.
    slots: [P] int64 state row each group row writes (-1 = no write: padding rows).
    table: [R_t, W] int32 block table of the state pool (-1 = unmapped); table_row: [P] int32 the row of it each
    group row reads (-1 on padding rows; the request for a batch's own tables, :attr:`BatchPlan.table_row`).
    page_size: state rows per block; ring: the table is a ring table (``PoolLayout.is_ring``, True for every
    state pool). windows: the plan's boundary rows and window state rows of this pool, or None (looked up from
    ``table`` by :meth:`window_rows`).
    """

    pool: np.ndarray
    slots: np.ndarray
    table: np.ndarray
    table_row: np.ndarray
    page_size: int
    ring: bool = True
    windows: StateWindows | None = None

    def window_rows(self, positions: np.ndarray, ratio: int) -> tuple[np.ndarray, np.ndarray]:
        """(boundary rows [B] int64, their windows' state rows [B, span] int64, -1 = missing slot): the plan's
        ``windows`` when given, else :func:`~dspark_kernels.model.geometry.window_state_rows`."""
        if self.windows is not None:
            return self.windows.boundaries, self.windows.rows
        return window_state_rows(positions, self.table_row, self.table, ratio, self.page_size)


@attrs.frozen(eq=False)
class IndexKeyPools:
    """The lightning indexer's key cache of one layer: ``keys`` [rows, dI] (int8 in a2a3, float32 in fp32 and
    deepseek) and their dequant ``scales`` [rows] float32 (1.0 in fp32 and deepseek)."""

    keys: np.ndarray
    scales: np.ndarray


#: The compressed pool whose visible entries a layer kind reads through the plan's ``entry_rows``.
ENTRY_POOLS: dict[LayerKind, str] = {"csa": "idx", "hca": "hca_cmp"}


@attrs.frozen(eq=False)
class BatchPlan:
    """What the kernels read of one batch for one rank (or the whole group); see the module table.

    Build with :meth:`build`. The mappings are keyed by ratio (4, 128) or layer kind and must not be changed.
    """

    batch: StepRows
    rank: int | None
    precision: Precision
    row_start: int
    row_stop: int
    positions: np.ndarray
    request: np.ndarray
    tables: dict[str, np.ndarray]
    table_row: np.ndarray
    run_starts: np.ndarray
    run_stops: np.ndarray
    run_requests: np.ndarray
    boundaries: dict[int, np.ndarray]
    visible: dict[int, np.ndarray]
    window: np.ndarray
    state_windows: dict[str, StateWindows]
    rope: dict[LayerKind, RopeRows]
    window_rope: dict[int, RopeRows]

    @classmethod
    def build(cls, batch: StepRows, *, rank: int | None = None, precision: str = "fp32",
              tables: Mapping[str, np.ndarray] | None = None, request_table_row: np.ndarray | None = None
              ) -> BatchPlan:
        """The plan of ``batch`` (validated: a :class:`PackedBatch`, or the :class:`StepRows` of a persistent
        step) for ``rank`` (None = the whole group) in ``precision``.

        tables / request_table_row: the block tables the kernels read (every pool, each [R_t, W_t] int32, mapping
        at least the pages the batch's own tables map) and the [R] row of them each request reads; default a
        :class:`PackedBatch`'s own tables, row r for request r (rows without tables must name theirs).
        Raises :class:`ABIError` ``rank.index`` for a rank outside the group, ``array.shape`` for tables or rows
        that do not fit, ``array.missing`` for rows without tables, ValueError for an unknown precision.
        """
        prec = check_precision(precision)
        if tables is None and not isinstance(batch, PackedBatch):
            raise ABIError([Issue("array.missing", "tables", "a step's rows carry no block tables",
                                  expected="pool -> [R_t, W_t] int32", actual=None,
                                  fix="plan a persistent step with PlanSource.of(step, tables).plan()")])
        read = dict(batch.tables.items()) if isinstance(batch, PackedBatch) and tables is None else tables or {}
        return cls._derive(batch, rank, prec, read, request_table_row,
                           _table_issues(batch, tables, request_table_row, read))

    @classmethod
    def _derive(cls, batch: StepRows, rank: int | None, prec: Precision, tables: Mapping[str, np.ndarray],
                request_table_row: np.ndarray | None, issues: list[Issue]) -> BatchPlan:
        """The plan of ``batch``'s rows reading ``tables`` (every pool) at ``request_table_row`` (None: row r for
        request r); raises ``issues`` (the tables') with the rank's first."""
        issues = batch.policy.rank_issues(rank, whole_group=True) + issues
        if issues:
            raise ABIError(issues)
        if rank is None:
            lo, hi = 0, batch.padded_rows
        else:
            rank = int(rank)
            lo, hi = batch.policy.rank_rows(rank, batch.num_tokens)
        config = batch.config
        positions = _frozen(batch.positions.astype(np.int64))
        request = batch.row_request                   # the batch's request record owns the rows and the runs
        if request_table_row is None:
            table_row = request
        else:
            slot = np.asarray(request_table_row, dtype=np.int32)
            table_row = _frozen(np.where(request >= 0, slot[np.maximum(request, 0)], -1).astype(np.int32))
        tables = dict(tables)
        run_starts, run_stops, run_requests = batch.requests.runs()
        ratios = compress_ratios(config)
        boundaries = {m: _frozen(boundary_rows(positions, request, m)) for m in ratios}
        visible = {m: _frozen(np.where(request >= 0, visible_entries(positions, m), 0)) for m in ratios}
        kinds: dict[LayerKind, int] = {config.layer_kind(i): m for i, m in enumerate(config.compress_ratios)}
        rope: dict[LayerKind, RopeRows] = {}
        for kind in sorted(kinds):  # the compressed kinds share one frequency table (dspark_kernels.model.rope)
            twin = next((rows for k, rows in rope.items() if (k == "swa") == (kind == "swa")), None)
            rope[kind] = twin or RopeRows(*(_frozen(a) for a in rope_at(config, kind, positions, prec)))
        window_rope = {m: RopeRows(*(_frozen(a) for a in rope_at(config, kind, window_start_positions(positions, m),
                                                                 prec)))
                       for kind, m in kinds.items() if m}
        pools = config.layout.pools
        window = _frozen(window_key_rows(positions[lo:hi], table_row[lo:hi], tables["ori"], config.sliding_window,
                                         pools["ori"].page_size))
        compressors = [(f"{kind}_state", m) for kind, m in kinds.items() if m]
        compressors += [("csa_inner_state", INDEX_RATIO)] if "csa" in kinds else []
        state_windows = {pool: StateWindows(*(_frozen(a) for a in window_state_rows(
            positions, table_row, tables[pool], m, pools[pool].page_size, boundaries[m]))) for pool, m in compressors}
        return cls(batch=batch, rank=rank, precision=prec, row_start=lo, row_stop=hi, positions=positions,
                   request=request, tables=tables, table_row=table_row, run_starts=_frozen(run_starts),
                   run_stops=_frozen(run_stops), run_requests=_frozen(run_requests), boundaries=boundaries,
                   visible=visible, window=window, state_windows=state_windows, rope=rope,
                   window_rope=window_rope)

    @classmethod
    def from_step(cls, step: PersistentStep, tables: PersistentTables, *, rank: int | None = None,
                  precision: str = "fp32") -> BatchPlan:
        """The plan of a persistent step (spec 5.9): the kernels read ``tables`` (the persistent tables, every slot,
        read-only views) at ``table_row = table_slots[request]``. ``tables`` must hold the step's delta, as a device
        mirror does after ``tables.apply(step)`` (or the allocator's own tables after ``commit``). The per-row arrays
        and the request record are the step's own (the step is the plan's ``batch``); no full form is made.
        Raises :class:`ABIError` as :meth:`build` and as :meth:`PlanSource.of` (``tables.stale_slot``, ...)."""
        return PlanSource.of(step, tables).plan(rank=rank, precision=precision)


    # ------------------------------------------------------------------ geometry
    @property
    def config(self) -> ModelConfig:
        return self.batch.config

    @property
    def query_rows(self) -> slice:
        """The query rows ``[row_start, row_stop)`` as a slice of the group rows."""
        return slice(self.row_start, self.row_stop)

    @property
    def query_request(self) -> np.ndarray:
        """[rows] int32 request of each query row (a view of ``batch.row_request``); -1 on padding rows."""
        return self.request[self.row_start:self.row_stop]

    @property
    def query_table_row(self) -> np.ndarray:
        """[rows] int32 ``table_row`` of each query row; -1 on padding rows."""
        return self.table_row[self.row_start:self.row_stop]

    def compressor_state(self, pool: str, ring: np.ndarray) -> CompressorState:
        """The :class:`CompressorState` of state pool ``pool`` (e.g. ``"csa_state"``) over ``ring``, the layer's
        array of that pool: the batch's slots, the plan's table, table rows and windows."""
        pl = self.config.layout.pools[pool]
        return CompressorState(pool=ring, slots=self.batch.slots[pool], table=self.tables[pool],
                               table_row=self.table_row, page_size=pl.page_size, ring=pl.is_ring,
                               windows=self.state_windows[pool])

    def query_slice(self, lo: int, hi: int) -> slice:
        """Group rows ``[lo, hi)`` (inside the query rows) as a slice of the per-query-row arrays."""
        return slice(lo - self.row_start, hi - self.row_start)

    def window_in(self, lo: int, hi: int) -> np.ndarray:
        """[hi - lo, W] int64 ``window`` rows of group query rows ``[lo, hi)``."""
        return self.window[self.query_slice(lo, hi)]

    def entry_rows_in(self, pool: str, lo: int, hi: int) -> np.ndarray:
        """[hi - lo, V] int64 physical rows of every visible entry of compressed pool ``pool`` (``idx``,
        ``hca_cmp``, ``csa_cmp``) of group query rows ``[lo, hi)`` through their table rows, V = their widest visible
        count; -1 beyond a row's count, unmapped or on padding rows (:func:`visible_entry_rows`). Derived per call:
        O((hi - lo) x V), the size of what the caller then gathers, never O(rows x context) for the whole batch."""
        pl = self.config.layout.pools[pool]
        return visible_entry_rows(self.visible[pl.ratio][lo:hi], self.table_row[lo:hi], self.tables[pool],
                                  pl.page_size)

    @property
    def entry_rows(self) -> dict[str, np.ndarray]:
        """pool -> [rows, Vmax] :meth:`entry_rows_in` of every query row, for the compressed pools the schedule's
        layer kinds read (:data:`ENTRY_POOLS`). Derived on each access, O(rows x Vmax) memory: for inspection and
        tests; kernels read :meth:`entry_rows_in` per row tile."""
        kinds = {self.config.layer_kind(i) for i in range(len(self.config.compress_ratios))}
        return {pool: self.entry_rows_in(pool, self.row_start, self.row_stop)
                for kind, pool in ENTRY_POOLS.items() if kind in kinds}

    def runs_in(self, lo: int, hi: int) -> list[Run]:
        """The runs of group rows ``[lo, hi)``: ``(start, stop, request)`` relative to ``lo``, ascending.

        O(log R + runs): the requests overlapping the range, clipped to it; padding rows belong to no run.
        """
        first = int(np.searchsorted(self.run_stops, lo, side="right"))
        last = int(np.searchsorted(self.run_starts, hi, side="left"))
        return [(max(int(s), lo) - lo, min(int(e), hi) - lo, int(r)) for s, e, r in
                zip(self.run_starts[first:last], self.run_stops[first:last], self.run_requests[first:last],
                    strict=True)]


@attrs.frozen(eq=False)
class PlanSource:
    """What a forward plans over, in either form: the one place a :class:`~dspark_abi.PackedBatch` or a
    :class:`~dspark_abi.persistent.PersistentStep` with its tables becomes the plans of the whole group and of
    each rank (the row split of a rank view is the batch policy's, the same for both forms).

    batch: the :class:`StepRows` every stage reads (per-row arrays, slot mappings, request record): the batch or the
    persistent step itself (never a step's full form: its narrow tables are not rebuilt per step). tables: pool ->
    the table the kernels read: [S, w_p] int32 (the persistent tables, read-only views) or the batch's own [R, w].
    request_table_row: [R] int32 row of ``tables`` each request reads (the step's ``table_slots``) or None (row r
    for request r). step: the persistent step, or None for a batch."""

    batch: StepRows
    tables: Mapping[str, np.ndarray]
    request_table_row: np.ndarray | None = None
    step: PersistentStep | None = None

    @classmethod
    def of(cls, batch: PackedBatch | PersistentStep, tables: PersistentTables | None = None) -> PlanSource:
        """The source of ``batch`` (a full-form batch, ``tables`` None) or of a persistent step with the persistent
        tables holding its delta (a device mirror after ``tables.apply(step)``, or the allocator's after
        ``commit``). A step is checked in O(R) only: its slots and generations current in ``tables``
        (``tables.slot``, ``tables.stale_slot``); its delta was proven once, by ``apply`` or the builder's commit
        (:func:`~dspark_abi.persistent.check_step`), and its narrow tables are not rebuilt.
        Raises :class:`ABIError`: ``array.missing`` (a step without tables), ``config.invalid`` (tables with a
        full-form batch, or tables of another config), ``tables.slot`` / ``tables.stale_slot``,
        ``tables.unapplied`` (tables that do not hold the step's delta:
        not applied or committed, or written since)."""
        if isinstance(batch, PersistentStep):
            if not isinstance(tables, PersistentTables):
                raise ABIError([Issue("array.missing", "tables", "a persistent step is read through its persistent "
                                      "tables", expected="PersistentTables holding the step's delta",
                                      actual=type(tables).__name__, fix="pass tables=allocator.persistent after "
                                      "commit, or a mirror after mirror.apply(step)")])
            issues = tables.current_issues(batch)        # O(R): the step was built against these slots
            if issues:
                raise ABIError(issues)
            issues = tables.holding_issues(batch)        # O(1): its delta, proven by apply or commit, is what they hold
            if issues:
                raise ABIError(issues)
            return cls(batch=batch, tables=tables.tables, request_table_row=batch.table_slots, step=batch)
        if tables is not None:
            raise ABIError([Issue("config.invalid", "tables", "persistent tables go with a PersistentStep; a "
                                  "PackedBatch carries its own tables", expected="None",
                                  actual=type(tables).__name__)])
        return cls(batch=batch, tables=dict(batch.tables.items()))

    def table_issues(self) -> list[Issue]:
        """``array.shape`` issues of the tables the plans read (none for a batch's own or a step's tables)."""
        return _table_issues(self.batch, self.tables, self.request_table_row, self.tables)

    def read_tables(self) -> Mapping[str, np.ndarray]:
        """pool -> the table the kernels read: the persistent tables, or the batch's own."""
        return self.tables

    def plan(self, *, rank: int | None = None, precision: str = "fp32") -> BatchPlan:
        """The :class:`BatchPlan` of ``rank`` (None = the whole group) in ``precision``."""
        return BatchPlan.build(self.batch, rank=rank, precision=precision, tables=self.tables,
                               request_table_row=self.request_table_row)
