"""`BatchRequests`: the requests of one packed batch as one record, and every per-request fact derived from it.

A request of a step is its serving id, the position it starts at, the contiguous group rows it owns (its span of
``query_start_loc``), what it asks of the step's outputs and how far its cache may advance once the step is
committed. The record is built once per batch (by :class:`~dspark_abi.BatchBuilder`, or from the batch's arrays
by :meth:`BatchRequests.from_arrays`), travels as ``PackedBatch.requests`` and ``RankView.requests``, and is the
one place row ownership, request starts, runs of rows, per-request logit rows and per-request result rows are
derived from. Since ABI 1.2 a request is a prefill chunk or a verify request (``verify_width``) and says which of its
rows produce logits (``logit_mode``).

>>> import numpy as np
>>> req = BatchRequests.from_arrays(np.array([0, 3, 3, 7], np.int32), np.array([126, 127, 128, 30, 31, 32, 33, 0]),
...                                 None, np.array([2, 6], np.int32))
>>> req.row_request(8).tolist(), req.starts.tolist(), req.logit_row.tolist()
([0, 0, 0, 2, 2, 2, 2, -1], [126, -1, 30], [2, -1, 6])
>>> req.owner_in(4, 4).tolist()
[2, 2, 2, -1]
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from dspark_abi._base import expand_ranges


def _readonly(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` over an immutable ``bytes`` buffer: no one can write it or make it writeable again."""
    return np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=a.dtype).reshape(a.shape)


@attrs.frozen(eq=False)
class BatchRequests:
    """The R requests of one batch, in batch order (request ``r`` owns group rows ``[row_start[r], row_end[r])``).

    Attributes:
        ids: [R] int64 serving request ids (``request_ids``; 0..R-1 when the batch gives none).
        first_position: [R] int64 tokens of the request cached before the step, i.e. the position of its first
            new row. A builder knows it for every request; read from arrays, an empty request (no row) has -1.
        row_start: [R] int32 first group row of the request (``query_start_loc[r]``).
        row_end: [R] int32 one past its last group row (``query_start_loc[r + 1]``); equal to ``row_start`` for an
            empty request.
        logit_row: [R] int32 output intent: the group row whose logits are the request's next-token output (its
            last row, when that row is among the batch's ``logit_rows``); -1 = the request asks for no output.
        commit_rows: [R] int64 the most rows the request's cache may advance by when the step is committed, from
            ``first_position``: all its rows (``row_end - row_start``). A prefill chunk commits exactly that; a
            verify request commits its accepted count, 1 to this (``BatchBuilder.commit(batch, accepted)``).
        verify_width: [R] int32 0 for a prefill chunk, w >= 1 for a verify request of w rows (its anchor, then
            w - 1 drafts): the ``verify_widths`` field, all 0 when the batch carries none (a 1.1 batch).
        logit_mode: [R] int8 output intent: 0 none, 1 the last row (a final prefill chunk), 2 every row (a
            verify request): the ``logit_mode`` field; without it, 1 where ``logit_row`` >= 0, else 0.
    """

    ids: np.ndarray
    first_position: np.ndarray
    row_start: np.ndarray
    row_end: np.ndarray
    logit_row: np.ndarray
    commit_rows: np.ndarray
    verify_width: np.ndarray
    logit_mode: np.ndarray
    _owners: dict[int, np.ndarray] = attrs.field(factory=dict, init=False, repr=False)   # P -> row_request(P)

    # ------------------------------------------------------------------ construction (the only two ways)
    @classmethod
    def from_step(cls, ids: np.ndarray, cached: np.ndarray, new: np.ndarray, logit_rows: np.ndarray | str | None,
                  verify_width: np.ndarray | None = None, logit_mode: np.ndarray | None = None) -> BatchRequests:
        """The builder's record: ids [R], cached [R] and new [R] tokens of each request, and the batch's logit
        rows ('last': every non-empty request asks for the logits of its last row). verify_width [R] / logit_mode
        [R]: the step's verify widths and output intent (None: all prefill chunks, intent from ``logit_rows``)."""
        row_end = np.empty(new.size, dtype=np.int32)
        np.cumsum(new, out=row_end)
        row_start = row_end - new.astype(np.int32)
        return cls._made(np.asarray(ids, np.int64), np.asarray(cached, np.int64), row_start, row_end, logit_rows,
                         verify_width, logit_mode)

    @classmethod
    def from_arrays(cls, query_start_loc: np.ndarray, positions: np.ndarray, request_ids: np.ndarray | None,
                    logit_rows: np.ndarray | None, verify_widths: np.ndarray | None = None,
                    logit_mode: np.ndarray | None = None) -> BatchRequests:
        """The record of a batch given as (validated) ABI arrays."""
        qsl = np.asarray(query_start_loc)
        row_start, row_end = qsl[:-1].astype(np.int32), qsl[1:].astype(np.int32)
        live = row_end > row_start
        first = np.full(row_start.size, -1, dtype=np.int64)
        first[live] = np.asarray(positions)[row_start[live]]
        ids = np.arange(row_start.size, dtype=np.int64) if request_ids is None else np.asarray(request_ids, np.int64)
        return cls._made(ids, first, row_start, row_end, logit_rows, verify_widths, logit_mode)

    @classmethod
    def _made(cls, ids: np.ndarray, first: np.ndarray, row_start: np.ndarray, row_end: np.ndarray,
              logit_rows: np.ndarray | str | None, verify_width: np.ndarray | None = None,
              logit_mode: np.ndarray | None = None) -> BatchRequests:
        last = row_end.astype(np.int64) - 1
        asks = row_end > row_start
        if logit_mode is not None:                   # the declared intent (1.2): authoritative
            asks &= np.asarray(logit_mode) >= 1
        elif logit_rows is None:
            asks[:] = False
        elif not isinstance(logit_rows, str):        # a str is the 'last' policy: every non-empty request asks
            asks &= np.isin(last, np.asarray(logit_rows))
        logit_row = np.where(asks, last, -1).astype(np.int32)
        mode = (asks.astype(np.int8) if logit_mode is None else np.asarray(logit_mode, np.int8))
        width = (np.zeros(row_start.size, np.int32) if verify_width is None else np.asarray(verify_width, np.int32))
        commit = (row_end - row_start).astype(np.int64)
        # private read-only copies: a caller's array mutated later changes nothing here
        return cls(*(_readonly(a) for a in (ids, first, row_start, row_end, logit_row, commit, width, mode)))

    def agrees_with(self, query_start_loc: np.ndarray, positions: np.ndarray, request_ids: np.ndarray | None,
                    logit_rows: np.ndarray | None, verify_widths: np.ndarray | None = None,
                    logit_mode: np.ndarray | None = None) -> bool:
        """Whether this record is the one :meth:`from_arrays` derives from these arrays (the first positions of
        empty requests aside, which the arrays do not carry). O(R + M)."""
        other = BatchRequests.from_arrays(query_start_loc, positions, request_ids, logit_rows, verify_widths,
                                          logit_mode)
        live = other.first_position >= 0
        return (self.ids.shape == other.ids.shape and np.array_equal(self.ids, other.ids)
                and np.array_equal(self.row_start, other.row_start) and np.array_equal(self.row_end, other.row_end)
                and np.array_equal(self.first_position[live], other.first_position[live])
                and np.array_equal(self.logit_row, other.logit_row)
                and np.array_equal(self.verify_width, other.verify_width)
                and np.array_equal(self.logit_mode, other.logit_mode))

    # ------------------------------------------------------------------ derived, in one place
    @property
    def count(self) -> int:
        """R."""
        return int(self.ids.size)

    @property
    def lengths(self) -> np.ndarray:
        """[R] int64 rows (new tokens) of each request."""
        lengths: np.ndarray = self.row_end.astype(np.int64) - self.row_start
        return lengths

    @property
    def nonempty(self) -> np.ndarray:
        """[R] bool: the request owns at least one row."""
        return self.row_end > self.row_start

    @property
    def starts(self) -> np.ndarray:
        """[R] int64 first new position of each request; -1 for empty requests."""
        starts: np.ndarray = np.where(self.nonempty, self.first_position, -1)
        return starts

    @property
    def is_verify(self) -> np.ndarray:
        """[R] bool: the request is a verify request (``verify_width > 0``)."""
        verify: np.ndarray = self.verify_width > 0
        return verify

    @property
    def logit_row_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """([R] int64 first, [R] int64 one past the last) group row whose logits the step produces for each
        request: every row for intent 2, the last row for intent 1, none (first == last) for intent 0."""
        start, end = self.row_start.astype(np.int64), self.row_end.astype(np.int64)
        lo = np.where(self.logit_mode == 2, start, np.where(self.logit_mode == 1, end - 1, end))
        lo = np.minimum(lo, end)                     # an empty request produces nothing, whatever its intent
        return np.where(end > start, lo, end), end

    @property
    def logit_entries(self) -> np.ndarray:
        """[R+1] int64 offsets into ``logit_rows`` (and so into the step's logits output): request r's entries
        are ``[logit_entries[r], logit_entries[r + 1])`` (one -1 entry for intent 0; see :func:`implied_logit_rows`).
        Meaningful for a batch whose ``logit_rows`` follow the intent (every 1.2 batch that carries
        ``logit_mode``, and every builder batch)."""
        counts = _entry_counts(self.row_start, self.row_end, self.logit_mode)
        out = np.zeros(counts.size + 1, dtype=np.int64)
        np.cumsum(counts, out=out[1:])
        return out

    def uncommitted_rows(self, accepted: np.ndarray) -> np.ndarray:
        """[M] int64 group rows a commit with ``accepted`` [R] rows per request leaves uncommitted (the rejected
        drafts: rows ``row_start[r] + accepted[r] .. row_end[r] - 1``), request after request. Their cache rows hold
        content the next step rewrites before any read (spec 5.8.2): a test may plant garbage in every row they
        wrote (their slots) and check it never reaches an output. O(R + M).

        >>> r = BatchRequests.from_step(np.array([5, 6]), np.array([9, 20]), np.array([4, 2]), "last")
        >>> r.uncommitted_rows(np.array([1, 2])).tolist()
        [1, 2, 3]
        """
        start = self.row_start.astype(np.int64) + np.asarray(accepted, np.int64)
        rows: np.ndarray = expand_ranges(start, np.clip(self.row_end.astype(np.int64) - start, 0, None))[1]
        return rows

    def owner_in(self, lo: int, count: int) -> np.ndarray:
        """[count] int32 request owning each of the group rows ``[lo, lo + count)``; -1 on rows no request owns
        (padding). O(count + R), see :func:`owner_of_rows`."""
        return owner_of_rows(self.row_start, self.row_end, lo, count)

    def row_request(self, padded_rows: int) -> np.ndarray:
        """[P] int32 request owning each group row; -1 on padding rows. Derived once per record and P (read-only):
        the builder and the batch it builds share one array."""
        owners = self._owners.get(padded_rows)
        if owners is None:
            owners = _readonly(self.owner_in(0, padded_rows))
            self._owners[padded_rows] = owners
        return owners

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """([K] int64 first row, [K] int64 one past the last row, [K] int64 request) of every non-empty request."""
        live = self.nonempty
        return (self.row_start[live].astype(np.int64), self.row_end[live].astype(np.int64),
                np.flatnonzero(live).astype(np.int64))

    def rows(self, r: int) -> slice:
        """Group rows of request ``r`` as a slice (a per-request result view reads its rows with it)."""
        return slice(int(self.row_start[r]), int(self.row_end[r]))

    def __repr__(self) -> str:
        return f"BatchRequests(R={self.count}, ids={_short(self.ids)}, rows={_short(self.lengths)})"


def _entry_counts(row_start: np.ndarray, row_end: np.ndarray, logit_mode: np.ndarray) -> np.ndarray:
    """[R] int64 entries of ``logit_rows`` per request: its row count (at least 1) for intent 2, else 1."""
    lengths = np.asarray(row_end, np.int64) - np.asarray(row_start, np.int64)
    counts: np.ndarray = np.where(np.asarray(logit_mode) == 2, np.maximum(lengths, 1), 1)
    return counts


def implied_logit_rows(row_start: np.ndarray, row_end: np.ndarray, logit_mode: np.ndarray) -> np.ndarray:
    """[G] int32 the ``logit_rows`` an output intent implies: THE rule (the builder writes it, the validator checks
    it, code ``logits.intent``). Request after request: intent 0 -> ``[-1]``; 1 -> ``[last row]``; 2 -> every row
    of the request, in order. An empty request contributes ``[-1]``. O(R + G).

    >>> implied_logit_rows(np.array([0, 3, 4]), np.array([3, 4, 7]), np.array([1, 0, 2])).tolist()
    [2, -1, 4, 5, 6]
    """
    start, end = np.asarray(row_start, np.int64), np.asarray(row_end, np.int64)
    mode = np.asarray(logit_mode)
    counts = _entry_counts(start, end, mode)
    # entry k of request r is first[r] + k with k = 0 unless its intent is 2 (every row: start + k), so the whole
    # list is one ramp arange(G) shifted per request by (its first entry's value - its offset in the list): the
    # per-request values are worked out on [R] arrays and only the ramp and one repeat are [G]
    first = np.where(end > start, np.where(mode == 2, start, np.where(mode == 1, end - 1, -1)), -1)
    shift = first - (np.cumsum(counts) - counts)
    rows: np.ndarray = (np.repeat(shift, counts) + np.arange(int(counts.sum()))).astype(np.int32)
    return rows


def owner_of_rows(row_start: np.ndarray, row_end: np.ndarray, lo: int, count: int) -> np.ndarray:
    """[count] int32 request owning each group row ``lo .. lo + count - 1``, -1 where none does: THE row-ownership
    derivation (``BatchRequests.owner_in`` and :func:`dspark_abi.lowering.lower_local_request_ids` call it).

    row_start / row_end: [R] integer rows of each request, contiguous from row 0 (``query_start_loc`` split).
    Cost O(count + R): each request's rows are clipped to the window and written as one run (``np.repeat``),
    instead of testing every row against every request (upstream's O(count * R) nested scan).
    """
    hi = lo + count
    starts, stops = np.asarray(row_start, np.int64), np.asarray(row_end, np.int64)
    if lo:                          # a window after row 0 (a rank's rows): clip every request to it
        starts, stops = np.clip(starts, lo, hi), np.clip(stops, lo, hi)
    owned = np.repeat(np.arange(starts.size, dtype=np.int32), stops - starts)
    if owned.size >= count:         # from row 0, no padding row in the window
        return owned[:count]
    out = np.full(count, -1, dtype=np.int32)
    out[: owned.size] = owned       # the rows start at 0 and are contiguous: the owned rows lead the window
    return out


def _short(a: Any) -> str:
    values = np.asarray(a).tolist()
    return repr(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"
