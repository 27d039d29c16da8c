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
        """``drafter.gap`` issues of rows that do not continue each request's history (vectorized over the rows;
        only the requests at fault are visited, to describe them)."""
        ids = np.array([int(r) for r in request_ids], dtype=np.int64)
        lengths = np.array([p.size for p in positions], dtype=np.int64)
        _, first = np.unique(ids, return_index=True)
        repeated = np.ones(ids.size, bool)
        repeated[first] = False
        start = np.array([self.last[self.slot_of[r]] + 1 if r in self.slot_of else 0 for r in ids.tolist()],
                         dtype=np.int64)
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

    # ------------------------------------------------------------------ writes
    def admit(self, request_ids: Sequence[int]) -> np.ndarray:
        """[R] slots of ``request_ids``, new requests given free slots (the rings grow when full)."""
        new = [int(r) for r in request_ids if int(r) not in self.slot_of]
        while len(new) > self.last.size - len(self.slot_of):
            self._grow()
        taken = set(self.slot_of.values())
        free = (slot for slot in range(self.last.size) if slot not in taken)
        self.slot_of |= dict(zip(new, free, strict=False))
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
