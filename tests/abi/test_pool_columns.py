"""The seven-pool code paths of the decode-rate step: the pools' constants as columns give each pool's own formula
(``PoolColumns.live_ranges`` is ``live_range`` pool by pool), a delta's pool column is the concatenation of its
pools, and the allocator's array lookups of request ids (cached tokens, rows) follow commits and releases."""

from __future__ import annotations

import copy
import pickle

import attrs
import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.layout import POOL_NAMES, PoolColumns, live_range, page_span
from dspark_abi.persistent import DeltaCells, check_step
from dspark_abi.presets import FLASH, TINY, TINY_1M


@pytest.mark.parametrize("config", [TINY, TINY_1M, FLASH], ids=lambda c: c.name)
def test_live_ranges_of_all_pools_are_each_pools_live_range(config):
    rng = np.random.default_rng(0)
    starts = rng.integers(0, config.max_position_embeddings, 200)
    ends = np.minimum(starts + rng.integers(0, 9000, 200), config.max_position_embeddings)
    ends[:20] = starts[:20]                                  # empty requests too
    starts[20:30] = 0
    odd = {p: attrs.evolve(pl, page_size=pl.page_size + 1, ratio=pl.ratio + 1 if pl.ratio else 0)
           for p, pl in config.layout.pools.items()}           # no power of two: the divisions, not shifts
    for pools, cols in ((config.layout.pools, config.layout.columns),
                        (odd, PoolColumns.of(odd[p] for p in POOL_NAMES))):
        assert (cols.page_shift is None) == (pools is odd)
        _agree(config, pools, cols, starts, ends)


def _agree(config, pools, cols, starts, ends):
    for window in (None, config.sliding_window, 7):
        lo, hi = cols.live_ranges(starts, ends, window)
        first, stop = cols.page_spans(starts, ends, window)
        assert lo.shape == hi.shape == (7, starts.size)
        for i, p in enumerate(POOL_NAMES):
            pl = pools[p]
            want = live_range(pl, starts, ends, config.sliding_window if window is None else window)
            assert np.array_equal(lo[i], want[0]) and np.array_equal(hi[i], want[1]), (p, window)
            want_pages = page_span(*want, pl.page_size)
            assert np.array_equal(first[i], want_pages[0]) and np.array_equal(stop[i], want_pages[1]), (p, window)


def test_pooled_cells_are_the_pools_in_order():
    rng = np.random.default_rng(1)
    cells = {p: tuple(rng.integers(0, 1000, n) for _ in range(3)) for p, n in zip(POOL_NAMES, [3, 0, 5, 1, 0, 2, 4],
                                                                                strict=True)}
    made = DeltaCells.from_cells(cells)
    by_hand = DeltaCells(**{p: np.stack(cells[p], axis=1).astype(np.int32).reshape(-1, 3) for p in POOL_NAMES})
    assert made == by_hand
    for delta in (made, by_hand):                            # the kept joined array and the concatenation
        pool, slot, page, block = delta.pooled()
        assert pool.tolist() == [i for i, p in enumerate(POOL_NAMES) for _ in range(len(cells[p][0]))]
        for k, got in enumerate((slot, page, block)):
            assert got.dtype == np.int64
            assert got.tolist() == [v for p in POOL_NAMES for v in cells[p][k].tolist()]
    assert not made.ori.flags.writeable and made.ori.flags.c_contiguous


def test_request_lookups_follow_commits_and_releases():
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(256), capacity=2)
    builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
    cached: dict[int, int] = {}
    rng = np.random.default_rng(2)
    for step in range(12):
        ids = [i for i in range(6) if rng.random() < 0.7] or [0]
        news = rng.integers(1, 40, len(ids))
        for rid, new in zip(ids, news.tolist(), strict=True):
            builder.add(rid, num_cached=cached.get(rid, 0), num_new=new)
        built = builder.build_step() if step % 2 else builder.build()
        builder.commit(built)
        for rid, new in zip(ids, news.tolist(), strict=True):
            cached[rid] = cached.get(rid, 0) + new
        if step % 3 == 2:                                    # a released id is unknown, its row reused later
            gone = sorted(cached)[0]
            alloc.release(gone)
            del cached[gone]
        probe = [9, *sorted(cached), 7]
        got = alloc.cached_tokens_of(probe)
        assert got.tolist() == [-1, *[cached[r] for r in sorted(cached)], -1]
        assert alloc._cached == cached
        assert all(alloc.cached_tokens(r) == c for r, c in cached.items())
    assert alloc.cached_tokens_of([2**70, *sorted(cached)]).tolist() == [-1, *[cached[r] for r in sorted(cached)]]


@pytest.mark.parametrize("clone", ["pickle", "deepcopy", "copy"])
def test_a_copied_mirror_keeps_following_the_allocator(clone):
    """A mirror pickled (as for a rank process), deep-copied or copied keeps its runs in one array: applying steps
    to it keeps it equal to the allocator's tables and every later step checks clean against it."""
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(512), capacity=4)   # the mirror keeps its slot count
    builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
    builder.add(0, num_cached=0, num_new=50)
    builder.commit(builder.build_step())
    tables = alloc.persistent
    mirror = {"pickle": lambda: pickle.loads(pickle.dumps(tables)), "deepcopy": lambda: copy.deepcopy(tables),
              "copy": tables.copy}[clone]()
    cached = {0: 50}
    for step in range(6):
        for rid in (0, 1, 2):
            builder.add(rid, num_cached=cached.get(rid, 0), num_new=37 + 11 * step)
        built = builder.build_step()
        assert check_step(built, mirror).ok
        builder.commit(built)
        mirror.apply(built)
        for rid in (0, 1, 2):
            cached[rid] = cached.get(rid, 0) + 37 + 11 * step
        got, want = mirror.to_arrays(), tables.to_arrays()
        assert all(np.array_equal(got[k], want[k]) for k in want)
