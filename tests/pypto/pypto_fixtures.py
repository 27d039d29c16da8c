"""Packed TINY batches shared by the pypto tests (numpy only; no torch, no pypto).

``packed_batch()``: TP 2, three requests: 3 tokens after 126 cached (crosses a 32-row page, position 127 is a
ratio-4 and ratio-128 boundary), 4 tokens after 30 cached (crosses the rank boundary: rows 3..6 with L = 5)
and 2 fresh tokens; N = 9, P = 10, one padding row.

``ring_batch()``: the same heads at 1,048,576 positions (``tiny-1m``): ring tables (ori, state pools) far
narrower than the positions' pages, so their columns are pages modulo the width, and trimmed compressed
tables. :func:`rewidth` re-lays a ring table at another width (same blocks), :func:`uncorrected_ring_rows`
emulates a lookup whose fp32 column skips the off-by-one correction (what the comparison must tell apart).
"""

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.layout import table_column, touched_pages
from dspark_abi.presets import TINY, TINY_1M
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.numerics import bf16_round

CONFIG = TINY
SEED = 20261130


def packed_batch(tp_size: int = 2):
    builder = BatchBuilder(CONFIG, PaddingPolicy(tp_size=tp_size), BlockAllocator(CONFIG, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=126, num_new=3)
    builder.add(1, num_cached=30, num_new=4)
    builder.add(2, num_cached=0, num_new=2)
    batch = builder.build()
    builder.commit(batch)
    return batch


def hidden_rows(batch, seed: int = SEED) -> np.ndarray:
    """[P, X] bf16-valued float32 attention input; padding rows 0."""
    rng = np.random.default_rng(seed)
    x = bf16_round(rng.standard_normal((batch.padded_rows, CONFIG.hidden_size)).astype(np.float32))
    x[batch.row_request < 0] = 0
    return x


def random_history(caches: LayerCaches, rng: np.random.Generator) -> None:
    """Fill every pool with random contents, so window, compressed, idx and state reads carry data."""
    for name, array in caches.arrays().items():
        if array.dtype == np.int8:
            array[...] = rng.integers(-127, 128, array.shape)
        elif name == "idx_scale":
            array[...] = rng.uniform(1e-3, 2e-2, array.shape)
        elif name.endswith("state"):
            array[...] = rng.standard_normal(array.shape)
        else:
            array[...] = bf16_round(rng.standard_normal(array.shape).astype(np.float32) * 0.5)


def long_batch(tp_size: int = 2):
    """TP 2: 3 tokens after 400 cached, 4 after 254 (crosses the rank boundary and position 255, an HCA
    boundary), 2 fresh; N = 9, P = 10, one padding row. Rows see up to 3 HCA and 100 CSA entries."""
    builder = BatchBuilder(CONFIG, PaddingPolicy(tp_size=tp_size), BlockAllocator(CONFIG, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=400, num_new=3)
    builder.add(1, num_cached=254, num_new=4)
    builder.add(2, num_cached=0, num_new=2)
    batch = builder.build()
    builder.commit(batch)
    return batch


def attention_core_inputs(batch, layer: int, rank: int, seed: int, key_tile: int) -> dict:
    """Reference-side inputs of the stage-6 kernel for one rank's rows (numpy only).

    Keys are random bf16 pools; CSA rows pick a random ``min(topk, visible)`` subset of their request's
    visible entries (a top-k shaped selection, -1 after it); HCA rows use every visible entry.
    """
    from dspark_abi.layout import physical_rows
    from dspark_kernels.model.rope import rope_at
    from dspark_kernels.reference.window import window_rows

    rng = np.random.default_rng([seed, layer, rank])
    c = batch.config
    kind = c.layer_kind(layer)
    view = batch.rank(rank)
    pos, req = view.positions.astype(np.int64), view.local_request_ids.astype(np.int64)
    rows = len(pos)
    ratio = c.compress_ratios[layer]
    visible = np.where(req >= 0, (pos + 1) // ratio, 0)
    if kind == "csa":
        entries = np.full((rows, c.index_topk), -1, np.int64)
        for t in range(rows):  # test data: a random top-k-shaped selection per row
            n = min(c.index_topk, int(visible[t]))
            entries[t, :n] = rng.permutation(int(visible[t]))[:n]
        pool, ratio_arg, columns = "csa_cmp", 0, None
    else:
        columns = max(1, int(visible.max()))
        col = np.arange(columns)[None, :]
        entries = np.where(col < visible[:, None], col, -1)
        pool, ratio_arg = "hca_cmp", ratio
    table, ring = batch.tables[pool], c.layout.pools[pool].is_ring
    pool_rows = batch.pool_blocks["ori"] * 32
    cos, sin = rope_at(c, kind, pos, "a2a3")
    return {
        "positions": pos, "request": req, "table": table, "entries": entries, "ratio": ratio_arg,
        "columns": columns, "ring": ring, "cmp_rows": physical_rows(table, req, entries, 32, ring=ring),
        "window": window_rows(pos, req, batch.tables["ori"], c.sliding_window),
        "q": bf16_round(rng.standard_normal((rows, c.num_attention_heads, c.head_dim)).astype(np.float32)),
        "ori": bf16_round(rng.standard_normal((pool_rows, c.head_dim)).astype(np.float32)),
        "cmp": bf16_round(rng.standard_normal((batch.pool_blocks[f"{kind}_cmp"] * 32, c.head_dim))
                          .astype(np.float32)),
        "sink": rng.standard_normal(c.num_attention_heads).astype(np.float32), "cos": cos, "sin": sin,
        "scale": c.softmax_scale, "key_tile": key_tile,
    }


#: Tie tolerance of the top-k comparison (upstream's indexer test): a swap is allowed when the missing
#: entry's score exceeds its replacement's by at most TOPK_TIE_ATOL + TOPK_TIE_RTOL * |score|.
TOPK_TIE_ATOL, TOPK_TIE_RTOL = 5e-6, 1e-5


def assert_topk_sets_match(got: np.ndarray, want: np.ndarray, scores: np.ndarray) -> None:
    """Top-k rows [T, k] (-1 padded) equal as sets up to ties; scores [T, C] recomputed from the reference inputs.

    Checks per row: the prefix contract (selected entries first, then -1), no duplicates, the same count, and
    every swapped-in entry scoring within the tie tolerance of every swapped-out one.
    """
    assert got.shape == want.shape
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        n = int((w >= 0).sum())
        assert (g[:n] >= 0).all() and (g[n:] == -1).all(), f"row {t}: prefix contract {g} vs {w}"
        assert len(set(g[:n].tolist())) == n, f"row {t}: duplicate entries {g}"
        missing = sorted(set(w[:n].tolist()) - set(g[:n].tolist()))
        extra = sorted(set(g[:n].tolist()) - set(w[:n].tolist()))
        if missing:
            worst_missing = max(scores[t, m] for m in missing)
            best_extra = min(scores[t, e] for e in extra)
            tol = TOPK_TIE_ATOL + TOPK_TIE_RTOL * abs(worst_missing)
            assert worst_missing - best_extra <= tol, f"row {t}: {missing} replaced by {extra} beyond the tie tolerance"


def compressor_batch(tp_size: int = 2):
    """TP 2: 8 tokens after 124 cached (ratio-4 boundaries 127 and 131, ratio-128 boundary 127, windows that
    began in the previous chunk), 7 after 250 (boundaries 251, 255; crosses the rank boundary), 4 fresh
    (boundary 3: entry 0 has no previous window); N = 19, P = 20, one padding row."""
    builder = BatchBuilder(CONFIG, PaddingPolicy(tp_size=tp_size), BlockAllocator(CONFIG, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=124, num_new=8)
    builder.add(1, num_cached=250, num_new=7)
    builder.add(2, num_cached=0, num_new=4)
    batch = builder.build()
    builder.commit(batch)
    return batch


#: TINY heads at the real depth: ring widths ori 258 (32-row pages), state pools 4101 / 1041 columns.
RING_CONFIG = TINY_1M
#: Blocks of every pool of ``ring_batch`` (request 0 holds 2297 csa_cmp / idx pages of its 73k entries).
RING_BLOCKS = 2560


def ring_batch(tp_size: int = 2, cached: tuple[int, int] = (293_884, 20_000)):
    """``tiny-1m``, TP 2: 8 tokens after ``cached[0]``, 5 after ``cached[1]``, 4 fresh (boundary 3); N = 17, P = 18,
    one padding row. The allocator maps only the reach of the ring pools; compressed tables are trimmed.

    Default: request 0 at 293,884 (35 turns of tiny-1m's 258-column ori ring width; page 9184 starts at position
    293,888: boundaries 293,887 (ratio 4 and 128) and 293,891), request 1 at 20,000 (beyond 16,384; crosses the rank
    boundary; boundary 20,003). :data:`SHALLOW_RING` (9,084 and 8,300) is past one turn of the ori ring width (8,256
    positions) and of the ratio-4 state rings (8,202), with at most 2,273 visible ratio-4 entries (an indexer that
    runs). The builder trims the ring tables to the step's live pages (ori 2, csa_state 8, hca_state 18 columns),
    which the tables' modulo then wraps many times.
    """
    builder = BatchBuilder(RING_CONFIG, PaddingPolicy(tp_size=tp_size),
                           BlockAllocator(RING_CONFIG, PoolBlocks.uniform(RING_BLOCKS)))
    builder.add(0, num_cached=cached[0], num_new=8)
    builder.add(1, num_cached=cached[1], num_new=5)
    builder.add(2, num_cached=0, num_new=4)
    batch = builder.build()
    builder.commit(batch)
    return batch


#: ``ring_batch(cached=SHALLOW_RING)``: one ring turn deep (whole layers, CSA indexer included).
SHALLOW_RING = (9_084, 8_300)


def request_spans(batch) -> tuple[np.ndarray, np.ndarray]:
    """([R] first new position, [R] one past the last) of each request of ``batch``."""
    qsl = np.asarray(batch.query_start_loc, np.int64)
    lengths = np.diff(qsl)
    starts = np.where(lengths > 0, np.asarray(batch.positions, np.int64)[np.minimum(qsl[:-1], qsl[-1] - 1)], 0)
    return starts, starts + lengths


def rewidth(batch, pool: str, width: int) -> np.ndarray:
    """``batch``'s ring table of ``pool`` re-laid at ``width`` columns: every page the call touches keeps its
    block, now in column ``page % width`` (a valid ring table while ``width`` >= the live pages)."""
    pl = batch.config.layout.pools[pool]
    table = np.asarray(batch.tables[pool])
    starts, ends = request_spans(batch)
    req, page = touched_pages(pl, starts, ends, batch.config.sliding_window)
    assert np.unique(req * width + page % width).size == req.size, f"{width} columns wrap a live range onto itself"
    out = np.full((table.shape[0], width), -1, np.int32)
    out[req, page % width] = table[req, table_column(pl, page, table.shape[1])]
    return out


def uncorrected_column(page: np.ndarray, width: int) -> np.ndarray:
    """``page - floor(fp32(page) * fp32(1 / width)) * width`` without the off-by-one correction (int64)."""
    page = np.asarray(page, np.int64)
    q = np.floor(page.astype(np.float32) * np.float32(1.0 / width)).astype(np.int64)
    return page - q * width


def uncorrected_ring_rows(table: np.ndarray, request: np.ndarray, logical: np.ndarray, page_size: int) -> np.ndarray:
    """Physical rows a ring lookup would return with :func:`uncorrected_column`: the flattened entry
    ``request * width + column`` then lands in a neighbouring column or request row (-1 beyond the table)."""
    table = np.asarray(table)
    width = table.shape[1]
    logical = np.asarray(logical, np.int64)
    req = np.asarray(request, np.int64).reshape(-1, *([1] * (logical.ndim - 1)))
    entry = req * width + uncorrected_column(logical // page_size, width)
    ok = (req >= 0) & (logical >= 0) & (entry >= 0) & (entry < table.size)
    block = np.where(ok, table.reshape(-1)[np.where(ok, entry, 0)], -1)
    return np.where(block >= 0, block * page_size + logical % page_size, -1)


def correction_width(pages: np.ndarray, at_least: int, limit: int = 400) -> int:
    """Smallest width >= ``at_least`` for which :func:`uncorrected_column` is wrong on one of ``pages``."""
    pages = np.unique(np.asarray(pages, np.int64))
    for width in range(max(3, at_least), limit):
        if (uncorrected_column(pages, width) != pages % width).any():
            return width
    raise AssertionError(f"no width in [{at_least}, {limit}) needs the correction on these pages")
