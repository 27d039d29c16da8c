"""The value-level ABI rules (positions, padding, slots vs tables, writes, coverage, isolation).

Called by :func:`dspark_abi.validation.validate_arrays` once shapes and dtypes are known to be right.
Every rule is a vectorized mask over tokens or over the pages the call touches; each violated rule
yields one :class:`Issue` naming the first offender and the number of offenders.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np

from dspark_abi.config import ModelConfig
from dspark_abi.errors import Issue
from dspark_abi.layout import (
    POOL_NAMES,
    PoolLayout,
    PoolName,
    live_pages,
    physical_rows,
    table_column,
    touched_pages,
    verify_headroom,
    written_logical,
)
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import SLOT_FIELDS, TABLE_FIELDS, PoolBlocks
from dspark_abi.requests import implied_logit_rows, owner_of_rows


def _flag(issues: list[Issue], code: str, field: str, mask: np.ndarray, message: str, *,
          index_of: np.ndarray | None = None, request_of: np.ndarray | None = None,
          expected: np.ndarray | Any = None, actual: np.ndarray | Any = None) -> None:
    """Append one issue for the first True of ``mask`` (with the count of all)."""
    if not mask.any():             # the common case, about 5x cheaper than finding the hits
        return
    hits = np.flatnonzero(mask)
    if hits.size == 0:
        return
    k = int(hits[0])

    def pick(v: Any) -> Any:
        return v[k].item() if isinstance(v, np.ndarray) else v

    index = int(index_of[k]) if index_of is not None else k
    request = int(request_of[k]) if request_of is not None else None
    issues.append(Issue(code, field, message, index=index, request=request, expected=pick(expected),
                        actual=pick(actual), count=int(hits.size)))


def check_deep(issues: list[Issue], *, config: ModelConfig, policy: PaddingPolicy, blocks: PoolBlocks,
               qsl: np.ndarray, n_tokens: int, n_rows: int, positions: np.ndarray,
               tables: Mapping[PoolName, np.ndarray], slots: Mapping[PoolName, np.ndarray],
               token_ids: np.ndarray | None, logit_rows: np.ndarray | None, hidden: np.ndarray | None,
               verify_widths: np.ndarray | None = None, logit_mode: np.ndarray | None = None) -> None:
    """Append an issue for every value-level rule the batch breaks (shapes and dtypes are known to be right)."""
    row_request, pos, start, end, live, ok_req = check_tokens(
        issues, config=config, policy=policy, qsl=qsl, n_tokens=n_tokens, n_rows=n_rows, positions=positions,
        slots=slots, token_ids=token_ids, logit_rows=logit_rows, hidden=hidden, verify_widths=verify_widths,
        logit_mode=logit_mode, ring_widths={p: t.shape[1] for p, t in tables.items()})
    layout = config.layout
    for pool in POOL_NAMES:
        pl = layout.pools[pool]
        if not _check_width(issues, pl, tables[pool], start, np.where(ok_req, end, start), config.sliding_window):
            continue
        args = (pl, blocks[pool], tables[pool], start, end, ok_req, config.sliding_window)
        # the common case (every live page mapped, in range, its block used once) is decided with a few array
        # passes; only a batch that fails it pays for the exact per-page reports and the owner map
        owners = None if _pages_unshared(*args) else _check_pages(issues, *args)
        _check_slots(issues, pl, blocks[pool], tables[pool], slots[pool][:n_tokens], pos, row_request, live,
                     owners, partial(_check_pages, [], *args))


def check_tokens(issues: list[Issue], *, config: ModelConfig, policy: PaddingPolicy, qsl: np.ndarray, n_tokens: int,
                 n_rows: int, positions: np.ndarray, slots: Mapping[PoolName, np.ndarray],
                 token_ids: np.ndarray | None, logit_rows: np.ndarray | None, hidden: np.ndarray | None,
                 verify_widths: np.ndarray | None = None, logit_mode: np.ndarray | None = None,
                 ring_widths: Mapping[PoolName, int] | None = None, row_request: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The O(R + P) token rules of :func:`check_deep` (positions, padding rows, token ids, logit rows), shared with
    :class:`dspark_abi.incremental.StepValidator`. Returns what the pool rules need: ``row_request`` [N],
    ``pos`` [N] int64, ``start`` / ``end`` [R], ``live`` [N] (tokens of requests fit for the slot rules) and
    ``ok_req`` [R] (non-empty requests whose positions satisfy R14-R16).

    ``row_request``: [N] the request owning each row, when the caller already holds it derived from this very
    ``qsl`` (only a builder's own step, ``check_step(derived=True)``: one request record wrote both its ``qsl`` and
    its ``StepArrays.row_request``); None derives it here. Every rule still compares the step's own arrays."""

    n, max_pos = n_tokens, config.max_position_embeddings
    starts_row = qsl[:-1].astype(np.int64)
    lengths: np.ndarray = np.diff(qsl.astype(np.int64))
    n_req = lengths.size
    if row_request is None:
        row_request = owner_of_rows(starts_row, qsl[1:], 0, n).astype(np.int64)    # [N]
    pos = positions[:n].astype(np.int64)                                           # [N]
    nonempty = lengths > 0
    start = np.zeros(n_req, dtype=np.int64)
    start[nonempty] = pos[starts_row[nonempty]]
    end = start + lengths
    expected_pos = start[row_request] + (np.arange(n) - starts_row[row_request])

    _flag(issues, "positions.negative", "positions", pos < 0, "live positions must be >= 0",
          request_of=row_request, expected=">= 0", actual=pos)
    _flag(issues, "positions.not_contiguous", "positions", pos != expected_pos,
          "positions inside a request must be start, start+1, ...", request_of=row_request,
          expected=expected_pos, actual=pos)
    _flag(issues, "positions.out_of_range", "positions", pos >= max_pos,
          f"positions must be < max_position_embeddings={max_pos}", request_of=row_request,
          expected=f"< {max_pos}", actual=pos)
    token_ok = (pos >= 0) & (pos < max_pos) & (pos == expected_pos)
    request_ok = np.bincount(row_request[~token_ok], minlength=n_req) == 0
    live = request_ok[row_request]                                                 # tokens fit for slot rules

    _check_padding(issues, policy, max_pos, n, n_rows, positions, slots, token_ids, hidden)
    if token_ids is not None:
        tid = token_ids[:n]
        _flag(issues, "token_ids.range", "token_ids", (tid < 0) | (tid >= config.vocab_size),
              f"token ids must be in [0, {config.vocab_size})", request_of=row_request,
              expected=f"0..{config.vocab_size - 1}", actual=tid)
    if logit_rows is not None:
        _flag(issues, "logits.range", "logit_rows", (logit_rows != -1) & ((logit_rows < 0) | (logit_rows >= n)),
              f"logit rows must be -1 or in [0, N={n})", expected=f"-1 or 0..{n - 1}" if n else "-1 (no live row)",
              actual=logit_rows)
    check_verify(issues, config=config, qsl=qsl, start=start, logit_rows=logit_rows, verify_widths=verify_widths,
                 logit_mode=logit_mode, ring_widths=ring_widths or {})

    return row_request, pos, start, end, live, request_ok & nonempty


def check_verify(issues: list[Issue], *, config: ModelConfig, qsl: np.ndarray, start: np.ndarray,
                 logit_rows: np.ndarray | None, verify_widths: np.ndarray | None, logit_mode: np.ndarray | None,
                 ring_widths: Mapping[PoolName, int]) -> None:
    """The rules of verify requests and output intent (spec 1.2, section 5.8), O(R + G).

    verify_widths [R] int32: 0 = prefill chunk, w = verify request of its w rows, 1 <= w <= 1 + K, starting after
    at least one committed token, within the position limit; every ring table at least as wide as the headroom of
    the widest one. logit_mode [R] int8: 0 or 1 for a prefill chunk, 2 for a verify request; ``logit_rows`` then
    equals :func:`~dspark_abi.requests.implied_logit_rows`."""
    lengths = np.diff(qsl.astype(np.int64))
    request = np.arange(lengths.size)
    width = None if verify_widths is None else verify_widths.astype(np.int64)
    if width is not None:
        verify = width > 0
        cap, max_pos = config.max_verify_width, config.max_position_embeddings
        _flag(issues, "verify.width", "verify_widths", (width < 0) | (verify & (width != lengths)),
              "verify_widths must be 0 (a prefill chunk) or the verify request's row count", request_of=request,
              expected=lengths, actual=width)
        _flag(issues, "verify.drafts", "verify_widths", verify & (width > cap),
              f"a verify request holds its anchor and at most dspark_block_size={config.dspark_block_size} drafts",
              request_of=request, expected=f"<= {cap}", actual=width)
        _flag(issues, "verify.no_anchor", "positions", verify & (width == lengths) & (start <= 0),
              "a verify request's anchor must follow at least one committed token (its first position >= 1)",
              index_of=qsl[:-1].astype(np.int64), request_of=request, expected=">= 1", actual=start)
        _flag(issues, "verify.position_limit", "verify_widths", verify & (start + width > max_pos),
              f"a verify request's rows must stay below max_position_embeddings={max_pos}", request_of=request,
              expected=f"<= {max_pos}", actual=start + width)
        widest = int(np.where(verify & (width == lengths), width, 0).max(initial=0))
        pools = config.layout.pools             # looked up once: the layout is a cached derivation, not free
        for pool, columns in ring_widths.items():
            need = verify_headroom(pools[pool], widest)
            if columns < need:
                issues.append(Issue(
                    "verify.ring_headroom", TABLE_FIELDS[pool], f"ring table has {columns} columns, fewer than the "
                    f"headroom of a {widest}-row verify request (reach {pools[pool].reach} + {widest} "
                    "positions): a rejected draft's row could alias a row the next step reads",
                    expected=f">= {need}", actual=columns,
                    fix=f"give {TABLE_FIELDS[pool]} at least {need} columns"))
    if logit_mode is None:
        return
    mode = logit_mode.astype(np.int64)
    allowed = np.where(width > 0, mode == 2, (mode == 0) | (mode == 1)) if width is not None else mode <= 1
    _flag(issues, "logits.intent", "logit_mode", ~allowed | (mode < 0),
          "logit_mode must be 2 (every row) for a verify request and 0 (none) or 1 (last row) for a prefill chunk",
          request_of=request, expected=np.where(width > 0, 2, 1) if width is not None else "0 or 1", actual=mode)
    if ((mode < 0) | (mode > 2)).any():
        return
    want = implied_logit_rows(qsl[:-1], qsl[1:], mode)
    if logit_rows is None:
        issues.append(Issue("logits.intent", "logit_rows", "logit_mode needs the logit_rows it implies",
                            expected=want.size, actual="missing"))
    elif logit_rows.shape != want.shape or not np.array_equal(logit_rows, want):
        common = min(want.size, logit_rows.size)
        diff = np.flatnonzero(logit_rows[:common] != want[:common])
        first = int(diff[0]) if diff.size else common
        issues.append(Issue("logits.intent", "logit_rows", "logit_rows must list, request after request, -1 for "
                            "intent 0, the last row for intent 1 and every row for intent 2",
                            index=first, expected=want.tolist() if want.size <= 16 else f"{want.size} entries",
                            actual=logit_rows.tolist() if logit_rows.size <= 16 else f"{logit_rows.size} entries"))


def _check_padding(issues: list[Issue], policy: PaddingPolicy, max_pos: int, n: int, n_rows: int,
                   positions: np.ndarray, slots: Mapping[PoolName, np.ndarray], token_ids: np.ndarray | None,
                   hidden: np.ndarray | None) -> None:
    pad = np.arange(n, n_rows)
    if pad.size == 0:
        return
    want = policy.padding_positions(int(positions[n - 1]) if n else -1, pad.size)
    got = positions[n:].astype(np.int64)
    _flag(issues, "padding.position", "positions", got != want,
          f"padding rows take positions by policy pad_position={policy.pad_position!r}", index_of=pad,
          expected=want, actual=got)
    _flag(issues, "positions.out_of_range", "positions", (got < 0) | (got >= max_pos),
          f"padding positions must lie in every RoPE table, [0, {max_pos}); use pad_position='zero' near the "
          "end of the context", index_of=pad, expected=f"0..{max_pos - 1}", actual=got)
    for p in POOL_NAMES:
        s = slots[p][n:]
        _flag(issues, "padding.slot", SLOT_FIELDS[p], s != policy.pad_slot, "padding rows must not write",
              index_of=pad, expected=policy.pad_slot, actual=s)
    if token_ids is not None:
        padding_token_issues(issues, policy, n, token_ids)
    if hidden is not None:
        padding_hidden_issues(issues, n, hidden)


def padding_token_issues(issues: list[Issue], policy: PaddingPolicy, n: int, token_ids: np.ndarray) -> None:
    """``padding.token_id`` when a padding row (rows ``n..P-1`` of ``token_ids`` [P]) has another id than the
    policy's ``pad_token_id`` (the one statement of the rule: the validator and ``prefill``'s input check)."""
    t = token_ids[n:]
    _flag(issues, "padding.token_id", "token_ids", t != policy.pad_token_id, "padding token ids per policy",
          index_of=np.arange(n, n + t.size), expected=policy.pad_token_id, actual=t)


def padding_hidden_issues(issues: list[Issue], n: int, hidden: np.ndarray) -> None:
    """``padding.hidden`` when a padding row (rows ``n..P-1`` of ``hidden`` [P, ...]) is not all zero."""
    pad = hidden.shape[0] - n
    if pad <= 0:
        return
    nonzero = np.any(hidden[n:].reshape(pad, -1) != 0, axis=1)
    _flag(issues, "padding.hidden", "hidden", nonzero, "padding rows of the hidden state must be zero",
          index_of=np.arange(n, n + pad), expected=0.0, actual="nonzero row")


def _check_width(issues: list[Issue], pl: PoolLayout, table: np.ndarray, start: np.ndarray, end: np.ndarray,
                 window: int) -> bool:
    """False (with a ``tables.width`` issue) when the table is too narrow for the pages this call uses: a ring
    table narrower than a request's live range would wrap onto itself, a trimmed compressed table must reach
    the last live page."""
    need = live_pages(pl, start, end, window)
    short = need > table.shape[1]
    if not short.any():
        return True
    kind = "live pages of the request's range (a ring table must not wrap onto itself)" if pl.is_ring else \
        "columns up to the request's last live page"
    _flag(issues, "tables.width", TABLE_FIELDS[pl.name], short,
          f"table has {table.shape[1]} columns, fewer than the {kind}", request_of=np.arange(short.size),
          expected=need, actual=table.shape[1])
    return False


class _Owners:
    """Which requests use each physical block of one pool among their live pages: (min, max) batch index.

    Built from the live pages only, so its size is O(live pages) whatever the pool size: per-block arrays
    when the pool is not much larger than the pages the call touches, else the sorted used blocks.
    """

    def __init__(self, used: np.ndarray, lo: np.ndarray, hi: np.ndarray, dense: bool):
        self.used, self.lo, self.hi, self.dense = used, lo, hi, dense

    def lookup(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) owner request of each block in ``[0, pool blocks)``; -1 for blocks no live page uses."""
        if self.dense:
            return self.lo[blocks], self.hi[blocks]
        if self.used.size == 0:
            none = np.full(blocks.shape, -1, dtype=np.int32)
            return none, none
        at = np.minimum(np.searchsorted(self.used, blocks), self.used.size - 1)
        found = self.used[at] == blocks
        return np.where(found, self.lo[at], -1), np.where(found, self.hi[at], -1)


def _dense(n_blocks: int, n_pages: int) -> bool:
    """Per-block owner arrays only when the pool is within a constant factor of the live pages (O(pages))."""
    return n_blocks <= 4 * n_pages + 4096


def _owners(n_blocks: int, n_req: int, blk: np.ndarray, req: np.ndarray) -> tuple[_Owners, np.ndarray | None]:
    """Owners of the mapped live pages ``(blk, req)``, and a mask of the pages that repeat the block of an
    earlier live page of the same request (None when there is none: no alias to report)."""
    dense = _dense(n_blocks, blk.size)
    if dense and (blk.size == 0 or np.bincount(blk, minlength=n_blocks).max() <= 1):
        owner = np.full(n_blocks, -1, dtype=np.int32)      # fast path: every used block has one owner
        owner[blk] = req
        return _Owners(blk, owner, owner, True), None
    if blk.size == 0:                                      # no mapped live page (sparse path)
        return _Owners(blk, req, req, False), None
    width = max(n_req, 1)
    key = blk * width + req                                # by block, then request
    ordered = np.sort(key)
    alias = None
    if (ordered[1:] == ordered[:-1]).any():                # rare: name the repeating pages, in page order
        order = np.argsort(key, kind="stable")
        alias = np.zeros(key.size, dtype=bool)
        alias[order[1:]] = key[order[1:]] == key[order[:-1]]
    b = ordered // width
    first = np.flatnonzero(np.concatenate(([True], b[1:] != b[:-1])))
    last = np.concatenate((first[1:], [b.size])) - 1
    used = b[first]
    lo = (ordered[first] - used * width).astype(np.int32)  # smallest and largest request using the block:
    hi = (ordered[last] - used * width).astype(np.int32)   # shared read-only pages are legal, writes are not
    if not dense:
        return _Owners(used, lo, hi, False), alias
    owner_min = np.full(n_blocks, -1, dtype=np.int32)
    owner_max = np.full(n_blocks, -1, dtype=np.int32)
    owner_min[used], owner_max[used] = lo, hi
    return _Owners(used, owner_min, owner_max, True), alias


def _pages_unshared(pl: PoolLayout, n_blocks: int, table: np.ndarray, start: np.ndarray, end: np.ndarray,
                    use: np.ndarray, window: int) -> bool:
    """True when every live page of the requests in ``use`` maps a block in ``[0, n_blocks)`` and no block is
    used by two live pages (then coverage, block range, aliasing and, for slots that match the tables,
    isolation all hold). False means: run :func:`_check_pages` for the exact reports.

    A compressed pool's live pages are the columns ``[0, count)`` of each row, read as one masked rectangle
    when that is not much larger than the pages; a ring pool's are gathered page by page. O(live pages).
    """
    count = live_pages(pl, start, np.where(use, end, start), window)
    rows, width = table.shape
    if not pl.is_ring and rows * width <= 4 * int(count.sum()) + 4096:
        blk = table[np.arange(width)[None, :] < count[:, None]]
    else:
        req, page = touched_pages(pl, start, np.where(use, end, start), window)
        blk = table[req, table_column(pl, page, width)]
    if blk.size == 0:
        return True
    if int(blk.min()) < 0 or int(blk.max()) >= n_blocks:
        return False
    if _dense(n_blocks, blk.size):   # distinct iff marking every used block marks blk.size of them
        used = np.zeros(n_blocks, dtype=np.uint8)
        used[blk.astype(np.int64)] = 1
        return int(np.count_nonzero(used)) == blk.size
    ordered = np.sort(blk)
    return not bool((ordered[1:] == ordered[:-1]).any())


def _check_pages(issues: list[Issue], pl: PoolLayout, n_blocks: int, table: np.ndarray, start: np.ndarray,
                 end: np.ndarray, use: np.ndarray, window: int) -> _Owners:
    """Coverage, block range, in-request aliasing; return the (min, max) owner request of every used block.

    Only the requests in ``use`` are checked. Cost O(live pages) in time and memory (never O(pool blocks)).
    """
    name = TABLE_FIELDS[pl.name]
    req, page = touched_pages(pl, start, np.where(use, end, start), window)   # a request not in use: empty
    blk = table[req, table_column(pl, page, table.shape[1])].astype(np.int64)
    _flag(issues, "coverage.unmapped", name, blk == -1,
          f"page read or written by this call is unmapped (logical {pl.name} indices [lo, hi) of the request)",
          index_of=page, request_of=req, expected="mapped block", actual=blk)
    _flag(issues, "tables.block_range", name, (blk < -1) | (blk >= n_blocks),
          f"block ids must be -1 or in [0, {n_blocks})", index_of=page, request_of=req,
          expected=f"-1..{n_blocks - 1}", actual=blk)
    mapped = (blk >= 0) & (blk < n_blocks)
    req_m, blk_m = req[mapped].astype(np.int32), blk[mapped]
    owners, alias = _owners(n_blocks, int(start.size), blk_m, req_m)
    if alias is not None:  # some request maps one block on two live pages: name the second one
        code = "state.ring_alias" if pl.is_state else "tables.alias"
        _flag(issues, code, name, alias, "two live logical pages of one request map to the same block",
              index_of=page[mapped], request_of=req_m, expected="distinct blocks", actual=blk_m)
    return owners


def _check_slots(issues: list[Issue], pl: PoolLayout, n_blocks: int, table: np.ndarray, slot: np.ndarray,
                 pos: np.ndarray, row_request: np.ndarray, live: np.ndarray, owners: _Owners | None,
                 owners_of: Callable[[], _Owners]) -> None:
    """Slot rules R27-R31. ``owners`` None: the pool's live pages are unshared (:func:`_pages_unshared`), so a
    write whose slot matches its request's table cannot be foreign; ``owners_of`` computes the owner map when
    some written slot is not such a write."""
    name, ps = SLOT_FIELDS[pl.name], pl.page_size
    n_rows = n_blocks * ps
    out_of_range = (slot < -1) | (slot >= n_rows)
    _flag(issues, "slots.range", name, out_of_range, f"slots must be -1 or in [0, {n_rows})",
          request_of=row_request, expected=f"-1..{n_rows - 1}", actual=slot)
    logical = written_logical(pl, pos)                             # -1: the token writes nothing here
    if pl.ratio:
        _flag(issues, "slots.off_boundary", name, live & (logical < 0) & (slot != -1),
              f"only tokens with (p+1) % {pl.ratio} == 0 write this pool", request_of=row_request, expected=-1,
              actual=slot)
    writes = live & (logical >= 0)
    every = bool(writes.all())                                     # per-token pool, no bad request: no gather
    w = np.arange(slot.size) if every else np.flatnonzero(writes)
    expected = physical_rows(table, row_request if every else row_request[w], logical if every else logical[w],
                             ps, ring=pl.is_ring)
    slot_w = slot if every else slot[w]
    ok_blk = (expected >= 0) & (expected < n_rows)                 # unmapped / bad blocks already reported
    matches = np.zeros(slot.size, dtype=bool)
    matches[w] = ok_blk & (slot_w == expected)
    _flag(issues, "slots.mismatch", name, ok_blk & (slot_w != expected) & ~out_of_range[w],
          "slot must equal table[request, column of logical // page] * page_size + logical % page_size",
          index_of=w, request_of=row_request[w], expected=expected, actual=slot_w)

    written = np.flatnonzero((slot >= 0) & ~out_of_range)
    if owners is None and matches[written].all():
        # every write lands in its writer's own live page, at its own logical index, and no block serves two
        # live pages: rows are distinct (a request's logical indices are) and none is foreign
        return
    rows = slot[written]
    ordered = np.sort(rows)
    if (ordered[1:] == ordered[:-1]).any():  # rare: find which token repeats a row, for the report
        order = np.argsort(rows, kind="stable")
        dup = np.zeros(rows.size, dtype=bool)
        dup[order[1:]] = rows[order[1:]] == rows[order[:-1]]
        _flag(issues, "writes.duplicate", name, dup, "two live tokens write the same physical row",
              index_of=written, request_of=row_request[written], expected="unique rows", actual=rows)

    if owners is None:
        owners = owners_of()
    wblk, writer_req = rows // ps, row_request[written]
    lo, hi = owners.lookup(wblk)
    foreign = (hi >= 0) & ((lo != writer_req) | (hi != writer_req))
    other = np.where(lo != writer_req, lo, hi)
    _flag(issues, "isolation.foreign_write", name, foreign,
          "written block lies in a page another request uses in this call", index_of=written,
          request_of=writer_req, expected="block owned by the writer only",
          actual=np.char.add("also used by request ", other.astype(str)) if foreign.any() else None)
