"""The paged-cache layout derived from a `ModelConfig`: the seven pools, their pages and tables.

Each pool is addressed by a *logical index*: the absolute token position for ``ori`` and the
three state pools, the compressed-entry index ``c`` for ``csa_cmp``, ``idx`` and ``hca_cmp``.
A block table row maps logical page ``i // page_size`` to a physical block (``-1`` = unmapped);
the physical row is ``block * page_size + i % page_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs
import numpy as np

from dspark_abi._base import cdiv

if TYPE_CHECKING:
    from dspark_abi.config import ModelConfig

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


@attrs.frozen
class PoolLayout:
    """Geometry of one paged pool."""

    name: PoolName
    page_size: int
    """Rows per physical block."""
    table_width: int
    """Columns of this pool's block table: logical pages covering every position < max positions."""
    ratio: int
    """0 for per-token pools (logical index = position); 4 or 128 for compressed-entry pools."""
    is_state: bool
    """True for the compressor state rings (only ``state_len`` positions must survive a call)."""
    state_len: int
    """Positions before a chunk that the compressor reads back (state pools only, else 0)."""
    row_shape: tuple[int, ...]
    """Shape of one physical row of the cache tensor(s) behind this pool."""
    row_dtype: str
    """Element dtype of the main cache tensor ('bfloat16', 'int8', 'float32')."""

    def logical_index(self, position: int) -> int:
        """Logical index written by the token at ``position`` (-1 when it writes nothing here)."""
        if self.ratio == 0:
            return position
        return (position + 1) // self.ratio - 1 if (position + 1) % self.ratio == 0 else -1


@attrs.frozen
class CacheLayout:
    """All seven pools of a config. ``pools[name]`` gives a :class:`PoolLayout`."""

    pools: dict[str, PoolLayout]
    max_positions: int
    sliding_window: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> CacheLayout:
        mp = config.max_position_embeddings
        d, di = config.head_dim, config.index_head_dim

        def kv(name: PoolName, ratio: int, row: tuple[int, ...], dtype: str) -> PoolLayout:
            width = cdiv(cdiv(mp, ratio) if ratio else mp, KV_PAGE_SIZE)
            return PoolLayout(name, KV_PAGE_SIZE, width, ratio, False, 0, row, dtype)

        def state(name: PoolName, page: int, slen: int, row: tuple[int, ...]) -> PoolLayout:
            return PoolLayout(name, page, cdiv(mp, page), 0, True, slen, row, "float32")

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

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.pools[n] for n in POOL_NAMES)

    def read_range(self, pool: PoolName, start: int, end: int) -> tuple[int, int]:
        """Logical indices ``[lo, hi)`` a request with new positions ``[start, end)`` reads or writes.

        ori: the window of the first new token up to the last, ``[start - W + 1, end)``;
        compressed pools: every visible entry, ``[0, end // ratio)``;
        state pools: the carried history plus the chunk, ``[start - state_len, end)``.
        Lower bounds are clamped at 0. An empty chunk (start == end) touches nothing.
        """
        if end <= start:
            return (0, 0)
        lo, hi = live_range(self.pools[pool], np.int64(start), np.int64(end), self.sliding_window)
        return (int(lo), int(hi))


def live_range(pl: PoolLayout, start: np.ndarray, end: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized :meth:`CacheLayout.read_range` over requests (no special case for empty requests)."""
    if pl.ratio:
        return np.zeros_like(start), end // pl.ratio
    reach = pl.state_len if pl.is_state else window - 1
    return np.maximum(0, start - reach), end
