"""The DSpark drafter's window cache (:class:`DrafterWindow`): S more layers of the target's ``ori`` pool (spec
section 5.10).

Stage s's key row of a committed position q of a request lives at q's ``ori`` slot: the request's ``ori`` row of
the persistent tables the drafter is attached to (:meth:`DrafterWindow.attach`; the allocator's
``BlockAllocator.persistent`` or a mirror of them), page ``q div 32`` in column ``(q div 32) mod RW``
(:func:`~dspark_abi.layout.physical_rows`, ring addressing). No table, field or pool of its own: the ``ori`` pool's
page size, blocks and recycling address it, as engines address MTP / draft layers through the target's block
tables. The ``ori`` pool keeps every position a draft reads mapped between a request's steps (spec 5.10): a
drafter observes a step's committed rows and drafts for a request before that request's next step is built.

Arrays (S draft stages, N = ``pool_blocks.ori * 32`` ``ori`` rows, D = ``head_dim``):

==========  ===============  =======  ================================================================
field       shape            dtype    meaning (padding)
==========  ===============  =======  ================================================================
``keys``    [S, N, D]        float32  stage s's window key of the position whose ``ori`` slot is n (0 unwritten)
``last``    {request: int}            last committed position observed per request (absent = none / released)
==========  ===============  =======  ================================================================

Sized by :func:`dspark_kernels.memory.drafter_window_bytes` (``nbytes`` equals it). Rows are checked before any is
written or read: a request's rows must continue its history (``drafter.gap``, R72), a drafted request must have been
observed (``drafter.unknown_request``, R73), and every row written or read must lie in a page of the request's
current ``ori`` run in the attached tables (``drafter.unmapped``, R75); on any error nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_abi.layout import physical_rows
from dspark_abi.persistent import PersistentTables

#: The fix of every observe / draft without tables, or whose rows left the request's ``ori`` run.
ATTACH_FIX = ("attach the tables the request's steps are built on (drafter.attach(allocator.persistent)) and "
              "observe / draft before the request's next step is built")


class DrafterWindow:
    """The drafter's window cache of one process, backed by the ``ori`` pool of the attached persistent tables
    (every rank of a TP group reads the same rows)."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.window = config.sliding_window
        self.stages = config.n_mtp_layers
        self.tables: PersistentTables | None = None
        self.keys = np.zeros((self.stages, 0, config.head_dim), np.float32)
        self.last: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes)

    @property
    def page_size(self) -> int:
        return self.config.layout.pools["ori"].page_size

    # ------------------------------------------------------------------ tables
    def attach(self, tables: PersistentTables) -> None:
        """Back the window by ``tables``' ``ori`` pool. The first attach (or one with nothing observed) allocates
        ``keys`` [S, pool_blocks.ori * 32, D] (zeros); tables of another ``ori`` geometry (``config.mismatch``) or,
        with requests observed, of another ``ori`` block count or that do not hold an observed request's last
        position in its ``ori`` run (another allocator's tables, a stale mirror) are refused, nothing changes."""
        if tables is self.tables:
            return
        issues = []
        ori, mine = tables.layout.pools["ori"], self.config.layout.pools["ori"]
        if ori != mine or tables.config.sliding_window != self.window:
            issues.append(Issue("config.mismatch", "tables", "the tables' ori pool is not the one the drafter's "
                                "window lives in (another page size, width or window)",
                                expected=[mine.page_size, mine.ring_width, self.window],
                                actual=[ori.page_size, ori.ring_width, tables.config.sliding_window],
                                fix="attach the persistent tables of the allocator the target's steps use"))
        blocks = int(tables.pool_blocks.ori)
        if self.last and self.tables is not None and blocks * self.page_size != self.keys.shape[1]:
            issues.append(Issue("config.mismatch", "pool_blocks.ori", "the drafter holds observed rows in an ori "
                                "pool of another block count", expected=self.keys.shape[1] // self.page_size,
                                actual=blocks, fix="release every observed request before attaching other tables"))
        if not issues and self.last and self.tables is not None:
            issues += self._holding_issues(tables)
        if issues:
            raise ABIError(issues)
        if not self.last or self.keys.shape[1] != blocks * self.page_size:
            self.keys = np.zeros((self.stages, blocks * self.page_size, self.config.head_dim), np.float32)
        self.tables = tables

    def _holding_issues(self, tables: PersistentTables) -> list[Issue]:
        """``config.mismatch`` for every observed request whose last observed position is not in its current ``ori``
        run in ``tables`` (tables that are not a copy of the ones the rows were written through: another
        allocator's, or a mirror behind them), O(requests observed)."""
        ids = list(self.last)
        slots = np.array([-1 if (s := tables.slot_of(r)) is None else s for r in ids], np.int64)
        last = np.array([self.last[r] for r in ids], np.int64)
        first, end = tables.runs("ori")
        page = last // self.page_size
        held = slots >= 0
        inside = held & (page >= first[np.maximum(slots, 0)]) & (page < end[np.maximum(slots, 0)])
        return [Issue("config.mismatch", "tables", "the tables do not hold the ori pages of a request the drafter "
                      "observed through its current tables", index=i, request=ids[i],
                      expected=f"position {int(last[i])} in the request's ori run",
                      actual="no slot" if not held[i] else
                      f"pages [{int(first[slots[i]])}, {int(end[slots[i]])}) hold positions "
                      f"[{int(first[slots[i]]) * self.page_size}, {int(end[slots[i]]) * self.page_size})",
                      fix="attach a copy of the tables the request's steps were built on (or release the requests "
                          "first)")
                for i in np.flatnonzero(~inside).tolist()]

    def _attached(self, field: str) -> PersistentTables:
        if self.tables is None:
            raise ABIError([Issue("drafter.unmapped", field, "the drafter's window lives in the ori pool of "
                                  "persistent tables, and none are attached", expected="attached tables",
                                  actual="none", fix="drafter.attach(allocator.persistent) before observe / draft")])
        return self.tables

    def rows_of(self, request_ids: Sequence[int], owner: np.ndarray, positions: np.ndarray, field: str,
                what: str) -> np.ndarray:
        """[N] int64 ``ori`` rows of ``positions`` [N] of requests ``request_ids[owner]`` (owner [N] int), checked:
        ``drafter.unmapped`` (R75) for every request with a row outside its current ``ori`` run (or without a slot),
        one issue per request (vectorized over the rows)."""
        tables = self._attached(field)
        ids = [int(r) for r in request_ids]
        found = [tables.slot_of(r) for r in ids]
        slots = np.array([-1 if s is None else s for s in found], np.int64)
        first, end = tables.runs("ori")
        page = positions // self.page_size
        slot = slots[owner]
        held = slot >= 0
        inside = held & (page >= first[slot]) & (page < end[slot])
        bad = np.zeros(len(ids), bool)
        np.logical_or.at(bad, owner, ~inside)
        if bad.any():
            lo = np.full(len(ids), np.iinfo(np.int64).max)
            hi = np.full(len(ids), -1)
            np.minimum.at(lo, owner, positions)
            np.maximum.at(hi, owner, positions)
            raise ABIError([Issue(
                "drafter.unmapped", field, f"the drafter {what} rows outside the request's ori pages", index=i,
                request=ids[i], expected="no ori slot in the tables" if slots[i] < 0 else
                f"positions in pages [{int(first[slots[i]])}, {int(end[slots[i]])}) (the request's ori run)",
                actual=f"positions [{int(lo[i])}, {int(hi[i])}]", fix=ATTACH_FIX)
                for i in np.flatnonzero(bad).tolist()])
        return physical_rows(tables.table("ori"), slot, positions, self.page_size, ring=True)

    # ------------------------------------------------------------------ checks
    def check_known(self, request_ids: Sequence[int], *, field: str = "request_ids") -> np.ndarray:
        """[R] int64 last observed position of known requests; ``drafter.unknown_request`` for any other id."""
        missing = [(i, int(r)) for i, r in enumerate(request_ids) if int(r) not in self.last]
        if missing:
            raise ABIError([Issue("drafter.unknown_request", field, "the drafter has no committed rows of this "
                                  "request", index=i, request=r, expected="a request observed before",
                                  actual=r, fix="observe the request's prompt (its target features) first")
                            for i, r in missing])
        return np.array([self.last[int(r)] for r in request_ids], dtype=np.int64)

    def gap_issues(self, request_ids: Sequence[int], positions: Sequence[np.ndarray]) -> list[Issue]:
        """``drafter.gap`` issues of rows that do not continue each request's history (vectorized over the rows;
        only the requests at fault are visited, to describe them)."""
        ids = np.array([int(r) for r in request_ids], dtype=np.int64)
        lengths = np.array([p.size for p in positions], dtype=np.int64)
        _, first = np.unique(ids, return_index=True)
        repeated = np.ones(ids.size, bool)
        repeated[first] = False
        start = np.array([self.last.get(r, -1) + 1 for r in ids.tolist()], dtype=np.int64)
        flat = np.concatenate([np.asarray(p, np.int64) for p in positions]) if ids.size else np.zeros(0, np.int64)
        owner = np.repeat(np.arange(ids.size), lengths)
        offset = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)   # row index in its request
        wrong = np.zeros(ids.size, bool)
        np.logical_or.at(wrong, owner, flat != start[owner] + offset)
        issues = [Issue("drafter.gap", "request_ids", "a request appears twice in one call", index=i,
                        request=int(ids[i]), expected="distinct ids", actual=int(ids[i]),
                        fix="pass each request's rows once, in one array") for i in np.flatnonzero(repeated).tolist()]
        issues += [Issue("drafter.gap", "positions", "committed rows must continue the request's history without a "
                         "gap", index=i, request=int(ids[i]), expected=f"{start[i]}, {start[i] + 1}, ...",
                         actual=np.asarray(positions[i])[:4].tolist(),
                         fix="observe every committed row once, in position order")
                   for i in np.flatnonzero(wrong & ~repeated).tolist()]
        return issues

    # ------------------------------------------------------------------ reads
    def window_positions(self, at: np.ndarray) -> np.ndarray:
        """[R, W] int64 the position each ring slot j holds for anchors ``at`` [R]: the q in ``[at - W, at)`` with
        ``q mod W = j`` (negative: none, the slot is a zero row)."""
        w = self.window
        j = np.arange(w, dtype=np.int64)
        positions: np.ndarray = at[:, None] - w + (j[None, :] - at[:, None]) % w
        return positions

    def window_rows(self, request_ids: Sequence[int], at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(``ori`` rows [R, W] int64 of every ring slot, -1 for a slot before position 0; mask [R, W] of the slots
        that hold a position), checked by :meth:`rows_of` (``drafter.unmapped``)."""
        q = self.window_positions(at)
        real = q >= 0
        owner = np.broadcast_to(np.arange(at.size)[:, None], q.shape)
        rows = np.full(q.shape, -1, np.int64)
        rows[real] = self.rows_of(request_ids, owner[real], q[real], "anchor_positions", "would read")
        return rows, real

    def gather(self, rows: np.ndarray, real: np.ndarray) -> np.ndarray:
        """[S, R, W, D] float32 every stage's window of :meth:`window_rows`, in ring-slot order (slot j holds the
        position q = j mod W of the window), zero rows where no position is held."""
        out = self.keys[:, np.where(real, rows, 0)]                                       # (S, R, W, D)
        out[:, ~real] = 0.0
        return out

    # ------------------------------------------------------------------ writes
    def write(self, stage: int, rows: np.ndarray, keys: np.ndarray) -> None:
        """Stage ``stage``'s key rows [N, D] at ``ori`` rows [N] (checked by :meth:`rows_of`)."""
        self.keys[stage, rows] = keys

    def advance(self, request_ids: Sequence[int], last: np.ndarray) -> None:
        self.last.update(zip((int(r) for r in request_ids), last.tolist(), strict=True))

    def release(self, request_ids: Sequence[int]) -> None:
        """Forget requests (``drafter.unknown_request`` for an id not observed; nothing changes then). Their rows
        stay in the pool's blocks: the allocator hands the blocks on, and every row a later draft reads was written
        by an observe after its page was mapped (spec 5.10)."""
        self.check_known(request_ids)
        for rid in request_ids:
            self.last.pop(int(rid), None)
