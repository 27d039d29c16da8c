"""The paged-cache layout derived from a `ModelConfig`: the seven pools, their pages and tables.

Each pool is addressed by a *logical index*: the absolute token position for ``ori`` and the
three state pools, the compressed-entry index ``c`` for ``csa_cmp``, ``idx`` and ``hca_cmp``.
Logical page ``i // page_size`` sits in a table *column*: for the compressed pools the page itself,
for the four *ring* pools (``ori`` and the state pools, read only a bounded reach back) the page
modulo the table's width. The column holds a physical block (``-1`` = unmapped); the physical row is
``block * page_size + i % page_size``. At the 1.0 width (every page of the context) the modulo is the
identity, so 1.0 tables are ring tables too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol

import attrs
import numpy as np

from dspark_abi._base import cdiv, expand_ranges

PoolName = Literal["ori", "csa_cmp", "hca_cmp", "idx", "csa_state", "csa_inner_state", "hca_state"]

#: The seven paged pools, in ABI order (block tables and slot mappings use the same order).
POOL_NAMES: tuple[PoolName, ...] = ("ori", "csa_cmp", "hca_cmp", "idx", "csa_state", "csa_inner_state", "hca_state")

#: Rows per page of every KV-like pool (ori, csa_cmp, hca_cmp, idx).
KV_PAGE_SIZE = 32
#: Rows per page of the ratio-4 state pools (main and indexer-inner).
RATIO4_STATE_PAGE_SIZE = 2
#: Rows per page of the ratio-128 state pool.
RATIO128_STATE_PAGE_SIZE = 8
#: Positions of state that must survive between calls: the window reach of each compressor.
RATIO4_STATE_LEN = 8
RATIO128_STATE_LEN = 128

#: Upstream's group capacity: the token all-gather window of one TP group holds this many rows. The one home of
#: the number: the default ``PaddingPolicy.token_cap`` and :data:`MAX_CHUNK_TOKENS` are this constant.
GROUP_CAPACITY = 8192
#: Longest chunk one request may add in one call (the group capacity): with the reach it fixes the width of the
#: ring tables.
MAX_CHUNK_TOKENS = GROUP_CAPACITY

#: Rows per page of each pool (fixed by the ABI, the same for every configuration).
PAGE_SIZES: dict[PoolName, int] = {
    "ori": KV_PAGE_SIZE, "csa_cmp": KV_PAGE_SIZE, "hca_cmp": KV_PAGE_SIZE, "idx": KV_PAGE_SIZE,
    "csa_state": RATIO4_STATE_PAGE_SIZE, "csa_inner_state": RATIO4_STATE_PAGE_SIZE,
    "hca_state": RATIO128_STATE_PAGE_SIZE,
}
#: Largest row count of a pool: block ids (int32 tables) and every slot ``block * page_size + offset``
#: must fit int32, the index type of the kernels' scatter and gather.
MAX_POOL_ROWS = 2**31 - 1
#: Largest block count of each pool: ``MAX_POOL_ROWS // page_size``.
MAX_POOL_BLOCKS: dict[PoolName, int] = {p: MAX_POOL_ROWS // s for p, s in PAGE_SIZES.items()}


@attrs.frozen
class PoolLayout:
    """Geometry of one paged pool.

    Attributes:
        name: The pool's name (one of :data:`POOL_NAMES`).
        page_size: Rows per physical block.
        table_width: Widest block table accepted: logical pages covering every position < max positions
            (the 1.0 width).
        ratio: 0 for per-token pools (logical index = position); 4 or 128 for compressed-entry pools.
        is_state: True for the compressor state rings (only ``state_len`` positions must survive a call).
        state_len: Positions before a chunk that the compressor reads back (state pools only, else 0).
        reach: Positions before a chunk a call reads in a ring pool (W - 1 for ori, ``state_len`` for the
            state pools); 0 for the compressed pools, which read their whole history.
        ring_width: Columns of the ring table the allocator keeps and the builder emits: pages of the longest
            live range (``reach + MAX_CHUNK_TOKENS`` positions) plus one for alignment, at most
            ``table_width``. Equal to ``table_width`` for the compressed pools.
        row_shape: Shape of one physical row of the cache tensor(s) behind this pool.
        row_dtype: Element dtype of the main cache tensor ('bfloat16', 'int8', 'float32').
    """

    name: PoolName
    page_size: int
    table_width: int
    ratio: int
    is_state: bool
    state_len: int
    row_shape: tuple[int, ...]
    row_dtype: str
    reach: int
    ring_width: int

    @property
    def is_ring(self) -> bool:
        """True for ori and the state pools: tables addressed modulo their width."""
        return not self.ratio


class LayoutSource(Protocol):
    """The settings :meth:`CacheLayout.from_config` reads (a :class:`~dspark_abi.config.ModelConfig`)."""

    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def index_head_dim(self) -> int: ...


@attrs.frozen(eq=False)
class PoolColumns:
    """The seven pools' constants as [7, 1] int64 columns (pools in ABI order), so that one numpy call computes a
    formula for all pools of a step at once ([7, R] results, pool-major): over a step's R requests numpy's per-call
    overhead, not the element count, is the cost, and a loop over the pools multiplies it by seven.

    Attributes (each [7, 1]): page_size; divisor (the ratio, 1 for the per-token pools, so ``logical // divisor``
    is a compressed entry count or the position itself); reach (0 for the compressed pools); ring (bool);
    ring_width.
    """

    page_size: np.ndarray
    divisor: np.ndarray
    reach: np.ndarray
    ring: np.ndarray
    ring_width: np.ndarray
    #: [7, 1] bool: the pool's reach is the sliding window's (ori)
    windowed: np.ndarray
    #: log2 of ``page_size`` / of ``divisor`` ([7, 1]), None unless each is a power of two (the ABI's are): a shift
    #: by a column is one vector pass, numpy's integer division by a column is ten times slower than by a scalar
    page_shift: np.ndarray | None
    divisor_shift: np.ndarray | None

    @classmethod
    def of(cls, pools: Iterator[PoolLayout]) -> PoolColumns:
        rows = list(pools)

        def col(values: list[int] | list[bool], dtype: type = np.int64) -> np.ndarray:
            a: np.ndarray = np.array(values, dtype=dtype).reshape(-1, 1)
            a.flags.writeable = False
            return a

        def shifts(values: list[int]) -> np.ndarray | None:
            exact = all(v > 0 and v & (v - 1) == 0 for v in values)
            return col([v.bit_length() - 1 for v in values]) if exact else None

        sizes, divisors = [pl.page_size for pl in rows], [pl.ratio or 1 for pl in rows]
        return cls(page_size=col(sizes), divisor=col(divisors),
                   reach=col([pl.reach if pl.is_ring else 0 for pl in rows]),
                   ring=col([pl.is_ring for pl in rows], bool), ring_width=col([pl.ring_width for pl in rows]),
                   windowed=col([pl.is_ring and not pl.is_state for pl in rows], bool),
                   page_shift=shifts(sizes), divisor_shift=shifts(divisors))

    def live_ranges(self, start: np.ndarray, end: np.ndarray, window: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """([7, R], [7, R]) int64 :func:`live_range` of every pool, its formula spelled with the columns (the pools'
        own reach, ``W - 1`` for ori, or ``window - 1`` for it when given; tests/abi/test_pool_columns.py checks the
        two agree)."""
        reach = self.reach if window is None else np.where(self.windowed, window - 1, self.reach)
        lo = np.maximum(start - reach, 0)
        lo *= self.ring                                  # the compressed pools read their whole history
        return lo, end // self.divisor if self.divisor_shift is None else end >> self.divisor_shift

    def page_spans(self, start: np.ndarray, end: np.ndarray, window: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """([7, R], [7, R]) :func:`page_span` of every pool's :meth:`live_ranges`."""
        return page_span(*self.live_ranges(start, end, window), self.page_size, shift=self.page_shift)


@attrs.frozen
class CacheLayout:
    """All seven pools of a config. ``pools[name]`` gives a :class:`PoolLayout`; iterating yields them in ABI order.

    Attributes:
        pools: Pool name -> :class:`PoolLayout`.
        max_positions: ``max_position_embeddings`` of the config (the tables cover positions below it).
        sliding_window: Window W of the ori pool: a token reads positions ``[p - W + 1, p]``.
    """

    pools: dict[str, PoolLayout]
    max_positions: int
    sliding_window: int
    #: The pools' constants as columns (derived from ``pools`` once, with the layout).
    columns: PoolColumns = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "columns", PoolColumns.of(self.pools[n] for n in POOL_NAMES))

    @classmethod
    def from_config(cls, config: LayoutSource) -> CacheLayout:
        """The layout of a model config (``ModelConfig.layout`` calls this)."""
        mp = config.max_position_embeddings
        d, di = config.head_dim, config.index_head_dim

        def kv(name: PoolName, ratio: int, row: tuple[int, ...], dtype: str) -> PoolLayout:
            width = cdiv(cdiv(mp, ratio) if ratio else mp, KV_PAGE_SIZE)
            reach = 0 if ratio else config.sliding_window - 1
            ring = ring_width_for(width, KV_PAGE_SIZE, reach) if not ratio else width
            return PoolLayout(name, KV_PAGE_SIZE, width, ratio, False, 0, row, dtype, reach, ring)

        def state(name: PoolName, page: int, slen: int, row: tuple[int, ...]) -> PoolLayout:
            width = cdiv(mp, page)
            return PoolLayout(name, page, width, 0, True, slen, row, "float32", slen,
                              ring_width_for(width, page, slen))

        pools = [
            kv("ori", 0, (d,), "bfloat16"),
            kv("csa_cmp", 4, (d,), "bfloat16"),
            kv("hca_cmp", 128, (d,), "bfloat16"),
            kv("idx", 4, (di,), "int8"),
            # state rows hold [kv | score]; ratio 4 keeps two overlapping halves of each
            state("csa_state", RATIO4_STATE_PAGE_SIZE, RATIO4_STATE_LEN, (4 * d,)),
            state("csa_inner_state", RATIO4_STATE_PAGE_SIZE, RATIO4_STATE_LEN, (4 * di,)),
            state("hca_state", RATIO128_STATE_PAGE_SIZE, RATIO128_STATE_LEN, (2 * d,)),
        ]
        return cls({p.name: p for p in pools}, mp, config.sliding_window)

    def __iter__(self) -> Iterator[PoolLayout]:
        return (self.pools[n] for n in POOL_NAMES)

    def read_range(self, pool: PoolName, start: int, end: int) -> tuple[int, int]:
        """Logical indices ``[lo, hi)`` a request with new positions ``[start, end)`` reads or writes.

        ori: the window of the first new token up to the last, ``[start - W + 1, end)``;
        compressed pools: every visible entry, ``[0, end // ratio)``;
        state pools: the carried history plus the chunk, ``[start - state_len, end)``.
        Lower bounds are clamped at 0. An empty chunk (start == end) touches nothing.
        """
        if end <= start:
            return (0, 0)
        lo, hi = live_range(self.pools[pool], np.asarray(start, np.int64), np.asarray(end, np.int64),
                            self.sliding_window)
        return (int(lo), int(hi))


def ring_width_for(table_width: int, page_size: int, reach: int, chunk: int = MAX_CHUNK_TOKENS) -> int:
    """Columns a ring table needs so that a live range of ``reach + chunk`` positions never wraps onto itself:
    such a range spans at most ``ceil((reach + chunk) / page) + 1`` pages. Never more than ``table_width``."""
    return min(table_width, cdiv(reach + chunk, page_size) + 1)


def verify_headroom(pl: PoolLayout, width: int) -> int:
    """Columns a ring table needs for a verify request of ``width`` rows (0 for a compressed pool): THE headroom of
    the rejection invariant (spec section 5.8.3). A verify request reads ``reach`` positions before its anchor and
    writes ``width`` rows; the rows of its rejected drafts must not share a physical row with any position the
    request's next step reads, so the ring must hold ``reach + width`` positions without wrapping: at most
    ``ceil((reach + width) / page) + 1`` pages (:func:`ring_width_for` with ``chunk = width``)."""
    if not pl.is_ring or width <= 0:
        return 0
    return ring_width_for(pl.table_width, pl.page_size, pl.reach, width)


def page_span(lo: np.ndarray | int, hi: np.ndarray | int, page_size: np.ndarray | int, *,
              shift: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(first page, one past the last page) of the logical range ``[lo, hi)`` in pages of ``page_size``:
    ``(lo // S, (hi - 1) // S + 1)``, and ``(0, 0)`` where the range is empty (hi <= lo). Elementwise, int64
    (``page_size`` an int, or ``PoolColumns.page_size`` for [7, R] ranges; ``shift``: ``log2(page_size)``, when
    given the divisions are spelled as shifts, the same floor for a power of two).

    The one home of a live range's page span (allocator, validators, upstream checks and layouts call it).

    >>> [a.tolist() for a in page_span(np.array([0, 31, 64, 5]), np.array([1, 33, 64, 5]), 32)]
    [[0, 0, 0, 0], [1, 2, 0, 0]]
    """
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    has = hi > lo
    first = lo // page_size if shift is None else lo >> shift    # new arrays, then updated in place: the fewest
    first *= has                                                  # passes and allocations
    stop = hi - 1
    if shift is None:
        stop //= page_size
    else:
        stop >>= shift
    stop += 1
    stop *= has
    return first, stop


def live_pages(pl: PoolLayout, start: np.ndarray, end: np.ndarray, window: int) -> np.ndarray:
    """[R] int64 logical pages each request's live range spans (0 for an empty request).

    The narrowest table a batch may carry for pool ``pl`` has ``max(live_pages)`` columns for a ring
    pool; for a compressed pool its columns must reach the last live page, ``max(ceil(hi / page))``.
    """
    start = np.asarray(start, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    first, stop = page_span(*live_range(pl, start, end, window), pl.page_size)
    if pl.is_ring:
        stop -= first
    stop *= end > start
    return stop


def table_column(pl: PoolLayout, page: np.ndarray, width: int) -> np.ndarray:
    """Table column of logical ``page`` in a table of ``width`` columns: ``page % width`` for a ring pool,
    the page itself for a compressed pool (whose table must then be wide enough)."""
    page = np.asarray(page)
    return page - (page // width) * width if pl.is_ring else page


def live_range(pl: PoolLayout, start: np.ndarray, end: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized :meth:`CacheLayout.read_range` over requests (no special case for empty requests)."""
    if pl.ratio:
        return np.zeros_like(start), end // pl.ratio
    reach = pl.state_len if pl.is_state else window - 1
    return np.maximum(0, start - reach), end


# ---------------------------------------------------------------------------------------------------- addressing
# The one home of the pool addressing formulas. Builder, validator, allocator, kernels and test strategies call
# these; the hand-written conformance vectors stay independent of them (they are the oracle).


def written_logical(pl: PoolLayout, positions: np.ndarray) -> np.ndarray:
    """[T] int64 logical index each position writes in pool ``pl``, -1 where it writes nothing.

    Per-token pools: the position itself. Compressed pools: entry ``(p + 1) // ratio - 1`` on ratio
    boundaries (``(p + 1) % ratio == 0``), else -1. Liveness (padding rows) is the caller's mask.
    """
    p = np.asarray(positions, dtype=np.int64)
    if not pl.ratio:
        return p
    entries = (p + 1) // pl.ratio
    return np.where(entries * pl.ratio == p + 1, entries - 1, -1)


def visible_entries(positions: np.ndarray, ratio: int) -> np.ndarray:
    """[T] int64 compressed entries a query at each position sees: ``c < (p + 1) // ratio``, so this count."""
    return (np.asarray(positions, dtype=np.int64) + 1) // ratio


def physical_rows(table: np.ndarray, request: np.ndarray, logical: np.ndarray, page_size: int, *, ring: bool
                  ) -> np.ndarray:
    """The slot formula: physical rows of logical indices, each looked up in its own request's table row.

    table: [R, width] int block table (-1 = unmapped). request: [T] int request per row (-1 = none).
    logical: [T] or [T, K] int logical indices (negative = none). ring: the table is a ring table
    (``PoolLayout.is_ring``): page ``i // page_size`` sits in column ``(i // page_size) % width``.
    Returns int64 of ``logical``'s shape: ``table[request, column] * page_size + logical % page_size``, or -1
    where the request is -1, the logical index is negative or (not ring) beyond the table, or the page is
    unmapped. -1 is never used as an index (it never wraps to the last row).
    """
    request = np.asarray(request, dtype=np.int64)
    logical = np.asarray(logical, dtype=np.int64)
    req = request.reshape(request.shape + (1,) * (logical.ndim - request.ndim))    # broadcast over K
    width = table.shape[1]
    if table.size == 0:
        return np.full(logical.shape, -1, dtype=np.int64)
    # floor division by a scalar is fast in numpy and % is not: offsets and the ring modulo as x - (x // d) * d
    page = logical // page_size
    offset = logical - page * page_size
    if ring:
        page -= (page // width) * width
    ok = (req >= 0) & (logical >= 0) & (page < width)
    flat = np.where(ok, req * width + page, 0)                 # one gather from the flattened table
    block = np.where(ok, np.take(table.reshape(-1), flat), -1).astype(np.int64, copy=False)
    return np.where(block >= 0, block * page_size + offset, -1)


def touched_pages(pl: PoolLayout, start: np.ndarray, end: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(request, page) of every logical page that requests with new positions ``[start, end)`` read or write.

    start, end: [R] int. Returns two flat int64 arrays, requests ascending and pages ascending within each
    request; empty requests (start == end) touch nothing. Cost O(R + touched pages).
    """
    start = np.asarray(start, dtype=np.int64)
    end = np.asarray(end, dtype=np.int64)
    first, stop = page_span(*live_range(pl, start, end, window), pl.page_size)
    count = (stop - first) * (end > start)     # an empty request's first page is never read: it owns no page
    return expand_ranges(first, count)
