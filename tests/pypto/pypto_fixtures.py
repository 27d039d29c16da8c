"""Packed TINY batches shared by the pypto tests (numpy only; no torch, no pypto).

``packed_batch()``: TP 2, three requests: 3 tokens after 126 cached (crosses a 32-row page, position 127 is a
ratio-4 and ratio-128 boundary), 4 tokens after 30 cached (crosses the rank boundary: rows 3..6 with L = 5)
and 2 fresh tokens; N = 9, P = 10, one padding row.
"""

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.presets import TINY
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.numerics import bf16_round

CONFIG = TINY
SEED = 20261130


def packed_batch(tp_size: int = 2):
    builder = BatchBuilder(CONFIG, PaddingPolicy(tp_size=tp_size), BlockAllocator(CONFIG, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=126, num_new=3)
    builder.add(1, num_cached=30, num_new=4)
    builder.add(2, num_cached=0, num_new=2)
    return builder.build()


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
    return builder.build()


def attention_core_inputs(batch, layer: int, rank: int, seed: int, key_tile: int) -> dict:
    """Reference-side inputs of the stage-6 kernel for one rank's rows (numpy only).

    Keys are random bf16 pools; CSA rows pick a random ``min(topk, visible)`` subset of their request's
    visible entries (a top-k shaped selection, -1 after it); HCA rows use every visible entry.
    """
    from dspark_abi.layout import physical_rows
    from dspark_kernels.model.rope import rope_at
    from dspark_kernels.reference.window import window_rows

    rng = np.random.default_rng([seed, layer, rank])
    c = CONFIG
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
        table, ratio_arg, columns = batch.tables["csa_cmp"], 0, None
    else:
        columns = max(1, int(visible.max()))
        col = np.arange(columns)[None, :]
        entries = np.where(col < visible[:, None], col, -1)
        table, ratio_arg = batch.tables["hca_cmp"], ratio
    pool_rows = batch.pool_blocks["ori"] * 32
    cos, sin = rope_at(c, kind, pos, "a2a3")
    return {
        "positions": pos, "request": req, "table": table, "entries": entries, "ratio": ratio_arg,
        "columns": columns, "cmp_rows": physical_rows(table, req, entries, 32),
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
    return builder.build()
