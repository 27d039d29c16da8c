"""Functions the pypto tests run in a child process (see dspark_kernels.pypto.isolate).

Each takes and returns plain numpy data, so the parent test never imports torch or pypto.
"""

import numpy as np


def lowering_many(cases: list[tuple[np.ndarray, list[tuple[int, int]]]]) -> list[list[np.ndarray]]:
    """Per (query_start_loc, [(local_base, L), ...]) case, the kernel's ids for each window."""
    from dspark_kernels.pypto.lowering import run_lowering

    return [[run_lowering(qsl, base, rows).values[-1] for base, rows in windows] for qsl, windows in cases]


def projections_many(cases: list[tuple]) -> list[list[np.ndarray]]:
    """Per (x_local, x_full, prepared weights, cos/sin local, cos/sin full, heads, eps): [q, qr_q, qr_scale, kv]."""
    from dspark_kernels.pypto.projections import run_query, run_shared_kv

    out = []
    for x_local, x_full, w, cos_local, sin_local, cos_full, sin_full, heads, eps in cases:
        q = run_query(x_local, w.wq_a, w.q_norm, w.wq_b, w.wq_b_scale, cos_local, sin_local, heads, eps)
        kv = run_shared_kv(x_full, w.wkv, w.kv_norm, cos_full, sin_full, eps)
        out.append([v.astype(np.float32) for v in q.values[-3:]] + [kv.values[-1].astype(np.float32)[:, 0]])
    return out


def shared_kv_slices(x: np.ndarray, wkv: np.ndarray, kv_norm: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                     eps: float) -> tuple[np.ndarray, int]:
    """(kv [P, D] of the shared kv kernel, the number of K slices its product was split into)."""
    from dspark_kernels.pypto.projections import KV_K_L0, KV_K_SLICES, _k_slices, run_shared_kv, tile

    kv = run_shared_kv(x, wkv, kv_norm, cos, sin, eps).values[-1][:, 0].astype(np.float32)
    hidden = x.shape[1]
    return kv, len(_k_slices(hidden, tile(hidden, KV_K_L0), KV_K_SLICES))


def scatter_many(cases: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """New pools after ``pool[slots] = values`` for each (pool, values, slots)."""
    from dspark_kernels.pypto.paged import run_scatter

    return [run_scatter(pool, values, slots).values[0] for pool, values, slots in cases]


def window_many(cases: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, bool]]) -> list[np.ndarray]:
    """Window rows for each (positions, request_ids, ori_table, window, ring = the ori PoolLayout's is_ring)."""
    from dspark_kernels.pypto.window import run_window

    return [run_window(pos, req, table, window, ring=ring).values[-1] for pos, req, table, window, ring in cases]


def ring_columns_many(cases: list[tuple[np.ndarray, int]]) -> list[np.ndarray]:
    """Per (pages [rows, cols] int32, width): ``_ops.ring_column`` of every page, traced in a kernel (int32)."""
    from dspark_kernels.pypto.runtime import Out, launch

    return [launch(_ring_column_kernel(*pages.shape, width), [pages, Out(pages.shape, np.int32, "columns")])
            .values[-1] for pages, width in cases]


def _ring_column_kernel(rows: int, cols: int, width: int):
    from dspark_kernels.pypto._ops import ring_column
    from dspark_kernels.pypto.runtime import kernel, pypto

    @kernel
    def ring_columns(pages: pypto.Tensor([rows, cols], pypto.DT_INT32),
                     out: pypto.Tensor([rows, cols], pypto.DT_INT32)):
        _sizes = (rows, cols, width)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(16, cols)
        out[:] = pypto.cast(ring_column(pypto.cast(pages, pypto.DT_FP32), width), pypto.DT_INT32)

    return ring_columns


def o_proj_many(cases: list[tuple]) -> list[np.ndarray]:
    """Per (attn [T, H*D], prepared weights): the kernel's out [T, X] as float32."""
    from dspark_kernels.pypto.o_proj import run_o_proj

    return [run_o_proj(attn, w.wo_a, w.wo_b, w.wo_b_scale, w.wo_a.shape[0]).values[-1].astype(np.float32)
            for attn, w in cases]


def unwritten_output() -> None:
    """A kernel that writes half of its output: the runtime must raise KernelOutputError."""
    from dspark_kernels.pypto.runtime import Out, kernel, launch, pypto

    @kernel
    def half(x: pypto.Tensor([8, 16], pypto.DT_FP32), out: pypto.Tensor([16, 16], pypto.DT_FP32)):
        pypto.set_vec_tile_shapes(8, 16)
        pypto.assemble(pypto.add(x, 1.0), [0, 0], out)

    launch(half, [np.zeros((8, 16), np.float32), Out((16, 16), np.float32, "out")])


def sparse_attention_many(cases: list[tuple]) -> list[np.ndarray]:
    """Per (q, window_rows, cmp_rows, ori, cmp, sink, cos, sin, scale, key_tile): the kernel's o as float32."""
    from dspark_kernels.pypto.sparse_attention import run_sparse_attention

    return [run_sparse_attention(q, win, cmp_rows, ori, cmp, sink, cos, sin, scale=scale, tile=tile).values[-1]
            .astype(np.float32) for q, win, cmp_rows, ori, cmp, sink, cos, sin, scale, tile in cases]


def entry_rows_many(cases: list[tuple]) -> list[np.ndarray]:
    """Per (positions, request_ids, table, entries or None, ratio, columns, ring = the table's PoolLayout.is_ring):
    physical rows [T, K] int32."""
    from dspark_kernels.pypto.entry_rows import run_entry_rows

    return [run_entry_rows(pos, req, table, entries, ring=ring, ratio=ratio, columns=columns).values[-1]
            for pos, req, table, entries, ratio, columns, ring in cases]


def compress_many(cases: list[tuple]) -> list[tuple]:
    """Per compress_into argument tuple (x, positions, request, slots, table, state, weights, cos, sin, page,
    eps, hadamard, ring = the state PoolLayout's is_ring): (boundary rows, outputs, state pool after the call)."""
    from dspark_kernels.model.plan import CompressorState, RopeRows
    from dspark_kernels.pypto.compressor import compress_into

    out = []
    for x, pos, req, slots, table, state, weights, cos, sin, page, eps, hadamard, ring in cases:
        state = state.copy()
        addressing = CompressorState(pool=state, slots=slots, table=table, table_row=req, page_size=page, ring=ring)
        b, values = compress_into(x, pos, req, addressing, weights, RopeRows(cos, sin), eps=eps, hadamard=hadamard)
        out.append((b, values, state))
    return out


def indexer_many(cases: list[tuple]) -> list[np.ndarray]:
    """Per (positions, request, idx_table, lrq_q, lrq_scale, prepared weights, x, cos, sin, idx, idx_scale, heads,
    topk, weight_scale, rounds, ring = the idx PoolLayout's is_ring): candidates through the entry-rows kernel,
    then the indexer's top-k [T, k]."""
    from dspark_kernels.model.plan import IndexKeyPools, RopeRows
    from dspark_kernels.pypto.entry_rows import run_entry_rows
    from dspark_kernels.pypto.indexer import IndexerWeights, run_indexer

    out = []
    for pos, req, table, qr_q, qr_scale, w, x, cos, sin, idx, idx_scale, heads, topk, weight_scale, rounds, ring \
            in cases:
        columns = max(1, int(np.where(req >= 0, (pos + 1) // 4, 0).max()))
        candidates = run_entry_rows(pos, req, table, None, ring=ring, ratio=4, columns=columns).values[-1]
        weights = IndexerWeights(w.idx_wq_b, w.idx_wq_b_scale, w.idx_weights_proj, w.idx_hadamard, heads,
                                 weight_scale)
        out.append(run_indexer((qr_q, qr_scale), x, weights, RopeRows(cos, sin), IndexKeyPools(idx, idx_scale),
                               candidates, topk=topk, rounds=rounds).values[-1])
    return out


def indexer_direct(cases: list[tuple]) -> list[tuple[np.ndarray, tuple[int, int, int]]]:
    """Per (low_rank, x, prepared weights, heads, weight_scale, RopeRows, IndexKeyPools, candidates [T, C]
    (-1 = none), topk, rounds, tile_columns): (the indexer's top-k [T, k] on host-built candidates, its
    ``sort_tiles`` (tiles, width, fan-in))."""
    from dspark_kernels.pypto.indexer import IndexerWeights, run_indexer, sort_tiles

    out = []
    for low_rank, x, w, heads, weight_scale, rope, keys, candidates, topk, rounds, tile_columns in cases:
        weights = IndexerWeights(w.idx_wq_b, w.idx_wq_b_scale, w.idx_weights_proj, w.idx_hadamard, heads,
                                 weight_scale)
        top = run_indexer(low_rank, x, weights, rope, keys, candidates, topk=topk, rounds=rounds,
                          tile_columns=tile_columns).values[-1]
        out.append((top, sort_tiles(candidates.shape[1], topk, tile_columns)))
    return out


def sort_tile_plans(cases: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], int, int]]:
    """Per (columns, topk, tile_columns): (``indexer.sort_tiles``, ``max_sort_columns(topk)``,
    ``tile_winners(topk)``)."""
    from dspark_kernels.pypto.indexer import max_sort_columns, sort_tiles, tile_winners

    return [(sort_tiles(c, k, w), max_sort_columns(k), tile_winners(k)) for c, k, w in cases]
