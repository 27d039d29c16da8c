"""The DSpark drafter's window cache (:class:`DrafterRings`): per draft stage, a ring of ``window`` key rows per
request, written at absolute positions (slot ``position % window``).

Arrays (S draft stages, C request slots, W = ``sliding_window`` (128 on V4-Flash), D = ``head_dim``):

==========  ===============  =======  ================================================================
field       shape            dtype    meaning (padding)
==========  ===============  =======  ================================================================
``rings``   [S, C, W, D]     float32  stage s's key row of request slot c at ring slot p % W (0 unwritten)
``last``    [C]              int64    last committed position written for the slot (-1 = none / free)
==========  ===============  =======  ================================================================

Sized by :func:`dspark_kernels.memory.drafter_ring_bytes` (``nbytes`` equals it for the slots allocated).
A request gets a slot on its first :meth:`observe`; :meth:`release` frees it. Rows are checked before any is
written: a request's rows must continue its history (first position = last + 1, then ascending by one; a new
request starts at 0), else ``drafter.gap`` and nothing changes. Only the last W rows of a call reach the ring
(earlier ones would be overwritten in the same call), so a prompt longer than the window leaves the last W rows,
each at its own ``position % W`` (absolute positions, never call-local ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig


class DrafterRings:
    """The drafter's window cache of one process (every rank of a TP group holds the same rings)."""

    def __init__(self, config: ModelConfig, capacity: int = 4):
        self.config = config
        self.window = config.sliding_window
        self.rings = np.zeros((config.n_mtp_layers, capacity, self.window, config.head_dim), np.float32)
        self.last = np.full(capacity, -1, np.int64)
        self.slot_of: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return int(self.rings.nbytes + self.last.nbytes)

    # ------------------------------------------------------------------ checks
    def slots(self, request_ids: Sequence[int], *, field: str = "request_ids") -> np.ndarray:
        """[R] int64 slots of known requests; ``drafter.unknown_request`` for any other id."""
        missing = [(i, int(r)) for i, r in enumerate(request_ids) if int(r) not in self.slot_of]
        if missing:
            raise ABIError([Issue("drafter.unknown_request", field, "the drafter has no committed rows of this "
                                  "request", index=i, request=r, expected="a request observed before",
                                  actual=r, fix="observe the request's prompt (its target features) first")
                            for i, r in missing])
        return np.array([self.slot_of[int(r)] for r in request_ids], dtype=np.int64)

    def gap_issues(self, request_ids: Sequence[int], positions: Sequence[np.ndarray]) -> list[Issue]:
        """``drafter.gap`` issues of rows that do not continue each request's history."""
        issues = []
        seen: set[int] = set()
        for i, (rid, pos) in enumerate(zip(request_ids, positions, strict=True)):
            rid = int(rid)
            if rid in seen:
                issues.append(Issue("drafter.gap", "request_ids", "a request appears twice in one call", index=i,
                                    request=rid, expected="distinct ids", actual=rid,
                                    fix="pass each request's rows once, in one array"))
                continue
            seen.add(rid)
            slot = self.slot_of.get(rid)
            start = int(self.last[slot]) + 1 if slot is not None else 0
            if pos.size and (pos[0] != start or np.any(np.diff(pos) != 1)):
                issues.append(Issue("drafter.gap", "positions", "committed rows must continue the request's "
                                    "history without a gap", index=i, request=rid,
                                    expected=f"{start}, {start + 1}, ...", actual=pos[:4].tolist(),
                                    fix="observe every committed row once, in position order"))
        return issues

    # ------------------------------------------------------------------ writes
    def admit(self, request_ids: Sequence[int]) -> np.ndarray:
        """[R] slots of ``request_ids``, new requests given free slots (the rings grow when full)."""
        for rid in request_ids:
            if int(rid) in self.slot_of:
                continue
            free = np.flatnonzero(self.last < 0)
            free = free[~np.isin(free, list(self.slot_of.values()))]
            if free.size == 0:
                self._grow()
                free = np.flatnonzero(self.last < 0)
                free = free[~np.isin(free, list(self.slot_of.values()))]
            self.slot_of[int(rid)] = int(free[0])
        return np.array([self.slot_of[int(r)] for r in request_ids], dtype=np.int64)

    def write(self, stage: int, slots: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
        """Stage ``stage``'s keys rows [N, D] at positions [N] of request slots [N] (the rows already checked;
        within a call only each slot's last ``window`` rows are kept, in position order)."""
        self.rings[stage, slots, positions % self.window] = rows

    def advance(self, slots: np.ndarray, last: np.ndarray) -> None:
        self.last[slots] = last

    def release(self, request_ids: Sequence[int]) -> None:
        slots = self.slots(request_ids)
        self.rings[:, slots] = 0
        self.last[slots] = -1
        for rid in request_ids:
            self.slot_of.pop(int(rid), None)

    def _grow(self) -> None:
        capacity = 2 * self.rings.shape[1]
        rings = np.zeros((*self.rings.shape[:1], capacity, *self.rings.shape[2:]), np.float32)
        rings[:, : self.rings.shape[1]] = self.rings
        last = np.full(capacity, -1, np.int64)
        last[: self.last.size] = self.last
        self.rings, self.last = rings, last
