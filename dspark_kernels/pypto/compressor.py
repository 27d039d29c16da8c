"""Stage 4 (and the indexer's key compressor of stage 5): upstream's ratio-4 and ratio-128 KV compressors.

Three steps, each a kernel; every write happens through a slot mapping:

1. ``state_rows_kernel`` (all P group rows): ``[kv | score]`` rows, ``kv = x @ wkv.T`` and
   ``score = x @ wgate.T + ape[p % m]`` (bf16 inputs, fp32 accumulation). They go to the state ring through
   the state slot mapping with the stage-3 scatter kernel (``paged.run_scatter``; -1 = no write).
2. ``pool_kernel`` (the B boundary rows, ``(p + 1) % m == 0``; the host lists them from the positions, the
   same metadata the slot mappings are built from): each row reads its window back from the ring **by
   absolute position** through its request's state table, so a window begun in an earlier chunk continues
   from the state the previous call wrote. Ratio 4 reads 8 slots (the A halves of the previous window
   p-7..p-4, the B halves of the current p-3..p; a missing slot, e.g. before position 0 or on an unmapped
   page, is excluded); ratio 128 reads the 128 slots p-127..p. Per channel,
   ``pooled = sum_s softmax_s(score) * kv``, then ``rms_norm(pooled, norm)`` and RoPE on the last rd dims at
   the window start ``p + 1 - m``; bf16.
   The indexer variant (``hadamard`` given) continues: ``z = bf16(bf16(y) @ hadamard)`` and ``int8q(z)``.
3. The entries go to ``csa_cmp`` / ``hca_cmp`` (or ``idx`` + ``idx_scale``) through the compressed slot
   mapping of the boundary rows, with the scatter kernel again.

``pool_kernel`` arguments (B boundary rows; S state-pool rows of width 2*coff*d; R table rows; width = the state
table's own columns, a ring table: page ``i // page`` in column ``(i // page) % width``; all shapes static per
call): ``window`` [B, span] int32, the window's absolute positions p-span+1..p (negative: before the
sequence; :func:`~dspark_kernels.model.geometry.window_positions`), ``request_ids`` [B, 1] int32; ``state_table``
[R * width] int32 flattened; ``state`` [S, 2*coff*d] fp32 (after step 1); ``norm`` [1, d] fp32 (bf16 values);
``cos``, ``sin`` [B, rd/2] bf16 at the window start; out ``entries`` [B, d] bf16, or with ``hadamard``
[d, d] bf16 in: out ``idx`` [B, d] int8 and ``idx_scale`` [B, 1] fp32.

The window's state rows (``_window_state_rows``) are fp32 index arithmetic, exact below 2**24, with the ring
column computed in-kernel and exactly (:func:`~dspark_kernels.pypto._ops.ring_column`): ``run_pool`` and
``compress_into`` raise ``ABIError`` ``kernel.index_range`` before any kernel runs (and before the ring is
written) when R * width, a pool row, a position or a ring quotient would reach it (:mod:`.index_guard`).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_abi import ABIError
from dspark_kernels.model.checks import coverage_issues
from dspark_kernels.model.geometry import OVERLAP_RATIO, coff, window_positions, window_span
from dspark_kernels.model.plan import CompressorState, RopeRows
from dspark_kernels.model.prepared import PreparedCompressor
from dspark_kernels.pypto._ops import MASKED_SCORE, int8_rows, rms_norm, rope_rows, table_rows, tile
from dspark_kernels.pypto.index_guard import check_table, table_issues
from dspark_kernels.pypto.paged import run_scatter
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto

BF16 = ml_dtypes.bfloat16
# Pooling kernels tuned with pypto's cost model (benchmarks/bench_pypto.py, FLASH, P = 512), cycles of
# (ratio 4 | indexer keys | ratio 128): 491,716 | 527,443 | 312,912 as first written; 103,937 | 88,805 | 223,214
# with 2-D RoPE on the entries; 90,640 | 87,292 | 50,897 with whole-row entry tiles, whole-window ratio-128
# tiles and per-tile table lookups (``_ops.table_rows``); 88,349 | 82,912 | 50,897 with the window positions
# from the host (the in-kernel ``arange`` was a task of its own); 76,824 | 77,090 | 48,606 without the
# concat of the ratio-4 halves; 71,155 | 67,662 | 46,905 with lookup tiles of the pooling tiles' rows. The
# model charges ~1.4k cycles per copy into a core's buffer and ~0.4k of scheduler time per dependency between
# tasks, so each step removed tasks or copies rather than arithmetic.
#: Vector tiles (boundary rows, slots, channels) of the gathered windows [B, slots, d] per ratio. Ratio 4 (128
#: boundary rows): (4, 8, 128) 77k, (8, 8, 128) 79k, (4, 8, 256) 87k, (2, 8, 512) 94k, (16, 8, 128) 97k; ratio
#: 128 (4 rows): a whole window per tile (the softmax over 128 slots in tiles of 8 was a chain of 16 partial
#: reductions): (1, 128, 64) 106k, (4, 128, 16) 108k, (1, 128, 128) 126k, (1, 64, 128) 146k, (1, 8, 128) 223k
#: (those at the second step above).
POOL_TILES = {4: (4, 8, 128), 128: (1, 128, 64)}
#: Elements of the vector tiles of the pooled entries [B, d] (whole rows: RMSNorm, RoPE, casts). Under the
#: window's 3-D tiles RoPE cast cos/sin in [1, 16]-element pieces (187k of ratio 4's 492k cycles); ratio 4 with
#: (16, 128) rows 104k, then (16, 512) 91k against (8, 512) 95k.
ENTRY_TILE_ELEMENTS = 8192


@lru_cache(maxsize=16)
def state_rows_kernel(rows: int, hidden: int, width: int, ratio: int) -> Any:
    """``[kv | score]`` [P, 2*width] fp32 of every group row (``width`` = coff * d)."""
    tm, tk, tn = tile(rows, 128), tile(hidden, 128), tile(width, 128)

    @kernel
    def state_rows(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            x: pypto.Tensor([rows, hidden], pypto.DT_BF16),
            wkv: pypto.Tensor([width, hidden], pypto.DT_BF16),
            wgate: pypto.Tensor([width, hidden], pypto.DT_BF16),
            ape: pypto.Tensor([ratio, width], pypto.DT_FP32),
            positions: pypto.Tensor([rows], pypto.DT_INT32),
            out: pypto.Tensor([rows, 2 * width], pypto.DT_FP32)):
        _sizes = (rows, hidden, width, ratio)  # closure capture: the annotations read these
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk], [tn, tn])
        pypto.set_vec_tile_shapes(rows)
        p = pypto.cast(positions, pypto.DT_FP32)
        phase = pypto.cast(pypto.sub(p, pypto.mul(pypto.floor(pypto.mul(p, 1.0 / ratio)), float(ratio))),
                           pypto.DT_INT32)                                                  # p % m (m a power of 2)
        pypto.set_vec_tile_shapes(16, 128)
        kv = pypto.matmul(x, wkv, pypto.DT_FP32, b_trans=True)                                # [P, coff*d]
        score = pypto.add(pypto.matmul(x, wgate, pypto.DT_FP32, b_trans=True), pypto.index_select(ape, 0, phase))
        pypto.assemble(kv, [0, 0], out)
        pypto.assemble(score, [0, width], out)

    return state_rows


def _window_state_rows(window: Any, request_ids: Any, table: Any, width: int, page: int, ring: bool,
                       tile_rows: int) -> tuple[Any, Any]:
    """([B, span] fp32 physical state rows of the window positions [B, span] through each row's table, -1 =
    missing; [B, span] fp32 slot of each column within its window, 0..span-1).

    ring: the state table is a ring table (``PoolLayout.is_ring``, True for the state pools). tile_rows: the
    pooling tiles' rows; equal row tiles put the lookups in the pooling tasks themselves (16-row lookup tiles
    under 4-row pooling tiles: ratio 4 77k -> 71k cycles, the indexer keys 77k -> 68k; ratio 128, 1 row: 49k -> 47k).
    """
    rows, span = window.shape
    pypto.set_vec_tile_shapes(tile_rows, span)
    slot_pos = pypto.cast(window, pypto.DT_FP32)                                               # p - span + 1 + k
    slot = pypto.sub(slot_pos, pypto.expand_clone(pypto.view(slot_pos, [rows, 1], [0, 0]), [rows, span]))  # k
    request = pypto.expand_clone(pypto.cast(request_ids, pypto.DT_FP32), [rows, span])
    return (table_rows(table, request, slot_pos, pypto.ge(slot_pos, 0.0), width=width, page=page, ring=ring),
            slot)


def _pooled(state: Any, rows_f: Any, slot: Any, ratio: int, dim: int) -> Any:
    """Per-channel softmax pooling of the gathered window: [B, d] fp32.

    Ratio 4 pools the A halves (kv ``[:d]``, score ``[2d:3d]``) of the previous window's slots (0..3) and the B
    halves (``[d:2d]``, ``[3d:]``) of the current window's (4..7): both halves are views of the same gathered
    rows, chosen per slot with ``where`` (a concat of the halves went through global memory: 8 extra copies out
    and in per task).
    """
    b, span = rows_f.shape
    present = pypto.ge(rows_f, 0.0)
    safe = pypto.cast(pypto.where(present, rows_f, 0.0), pypto.DT_INT32)
    # per slot: 0 = missing, 1 = live (first half / ratio 128), 2 = live in the current window (ratio 4)
    code = pypto.where(present, pypto.add(pypto.cast(pypto.ge(slot, float(span // 2)), pypto.DT_FP32), 1.0), 0.0)
    vec = POOL_TILES.get(ratio, POOL_TILES[OVERLAP_RATIO])
    pypto.set_vec_tile_shapes(vec[0], min(span, vec[1]), vec[2])
    slots = pypto.index_select(state, 0, safe)                                                 # [B, span, 2*coff*d]
    code3 = pypto.expand_clone(pypto.reshape(code, [b, span, 1]), [b, span, dim])
    live3 = pypto.gt(code3, 0.5)
    if ratio == OVERLAP_RATIO:
        current = pypto.gt(code3, 1.5)
        kv = pypto.where(current, pypto.view(slots, [b, span, dim], [0, 0, dim]),
                         pypto.view(slots, [b, span, dim], [0, 0, 0]))
        score = pypto.where(current, pypto.view(slots, [b, span, dim], [0, 0, 3 * dim]),
                            pypto.view(slots, [b, span, dim], [0, 0, 2 * dim]))
    else:
        kv = pypto.view(slots, [b, span, dim], [0, 0, 0])
        score = pypto.view(slots, [b, span, dim], [0, 0, dim])
    score = pypto.where(live3, score, MASKED_SCORE)
    top = pypto.amax(score, 1, keepdim=True)                                                   # [B, 1, d]
    e = pypto.where(live3, pypto.exp(pypto.sub(score, top)), 0.0)
    total = pypto.maximum(pypto.sum(e, 1, keepdim=True), float(np.finfo(np.float32).tiny))
    pooled = pypto.sum(pypto.mul(pypto.div(e, total), kv), 1, keepdim=True)                   # [B, 1, d]
    return pypto.reshape(pooled, [b, dim])


@lru_cache(maxsize=16)
def pool_kernel(rows: int, requests: int, width: int, state_rows_n: int, dim: int, ratio: int, page: int,
                rope: int, eps: float, indexer: bool, *, ring: bool) -> Any:
    """Window pooling of B boundary rows (module docstring); ``indexer`` adds Hadamard + int8 outputs; ``ring``:
    the state table is a ring table (``PoolLayout.is_ring``)."""
    span, halves = window_span(ratio), coff(ratio)

    def entries_of(window: Any, request_ids: Any, state_table: Any, state: Any, norm: Any, cos: Any,
                   sin: Any) -> tuple[Any, Any]:
        tile_rows = POOL_TILES.get(ratio, POOL_TILES[OVERLAP_RATIO])[0]
        rows_f, slot = _window_state_rows(window, request_ids, state_table, width, page, ring, tile_rows)
        pooled = _pooled(state, rows_f, slot, ratio, dim)
        pypto.set_vec_tile_shapes(max(1, min(rows, ENTRY_TILE_ELEMENTS // dim)), dim)
        y = rms_norm(pooled, norm, eps)
        return (pypto.view(y, [rows, dim - rope], [0, 0]),
                rope_rows(pypto.view(y, [rows, rope], [0, dim - rope]), cos, sin))

    if not indexer:
        @kernel
        def compressor_pool(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
                window: pypto.Tensor([rows, span], pypto.DT_INT32),
                request_ids: pypto.Tensor([rows, 1], pypto.DT_INT32),
                state_table: pypto.Tensor([requests * width], pypto.DT_INT32),
                state: pypto.Tensor([state_rows_n, 2 * halves * dim], pypto.DT_FP32),
                norm: pypto.Tensor([1, dim], pypto.DT_FP32),
                cos: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
                sin: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
                entries: pypto.Tensor([rows, dim], pypto.DT_BF16)):
            _sizes = (rows, requests, width, state_rows_n, halves, dim, rope, span)  # closure capture for annotations
            nope, roped = entries_of(window, request_ids, state_table, state, norm, cos, sin)
            pypto.assemble(pypto.cast(nope, pypto.DT_BF16), [0, 0], entries)
            pypto.assemble(pypto.cast(roped, pypto.DT_BF16), [0, dim - rope], entries)

        return compressor_pool

    tn = tile(dim, 128)

    @kernel
    def index_key_pool(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            window: pypto.Tensor([rows, span], pypto.DT_INT32),
            request_ids: pypto.Tensor([rows, 1], pypto.DT_INT32),
            state_table: pypto.Tensor([requests * width], pypto.DT_INT32),
            state: pypto.Tensor([state_rows_n, 2 * halves * dim], pypto.DT_FP32),
            norm: pypto.Tensor([1, dim], pypto.DT_FP32),
            cos: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            sin: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            hadamard: pypto.Tensor([dim, dim], pypto.DT_BF16),
            idx: pypto.Tensor([rows, dim], pypto.DT_INT8),
            idx_scale: pypto.Tensor([rows, 1], pypto.DT_FP32)):
        _sizes = (rows, requests, width, state_rows_n, halves, dim, rope, span)  # closure capture for annotations
        pypto.set_cube_tile_shapes([16, 16], [tn, tn], [tn, tn])
        nope, roped = entries_of(window, request_ids, state_table, state, norm, cos, sin)
        y = pypto.cast(pypto.concat([nope, roped], -1), pypto.DT_BF16)                          # [B, d]
        z = pypto.matmul(y, hadamard, pypto.DT_FP32)                                             # [B, d]
        z_q, z_scale = int8_rows(pypto.cast(pypto.cast(z, pypto.DT_BF16), pypto.DT_FP32))
        idx[:] = z_q
        idx_scale[:] = z_scale

    return index_key_pool


def run_state_rows(x: np.ndarray, wkv: np.ndarray, wgate: np.ndarray, ape: np.ndarray,
                   positions: np.ndarray) -> LaunchResult:
    """``values[-1]`` = [P, 2*coff*d] fp32 ``[kv | score]`` rows; x [P, X], wkv/wgate [coff*d, X], ape [m, coff*d]."""
    rows, hidden = x.shape
    width = wkv.shape[0]
    k = state_rows_kernel(rows, hidden, width, ape.shape[0])
    return launch(k, [x.astype(BF16), wkv.astype(BF16), wgate.astype(BF16), np.asarray(ape, np.float32),
                      np.asarray(positions, np.int32), Out((rows, 2 * width), np.float32, "state_rows")])


def run_pool(positions: np.ndarray, request_ids: np.ndarray, state_table: np.ndarray, state: np.ndarray,
             norm: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, ratio: int, page: int, eps: float, ring: bool,
             hadamard: np.ndarray | None = None) -> LaunchResult:
    """Pool the windows of B boundary rows (positions, request_ids [B]; cos/sin [B, rd/2] at the window start).

    ring: ``config.layout.pools[state pool].is_ring`` (True: columns are pages modulo the table's width).

    ``values[-1]`` = entries [B, d] bf16; with ``hadamard``: ``values[-2:]`` = idx [B, d] int8, idx_scale [B, 1].
    """
    rows = len(positions)
    table = np.asarray(state_table, np.int32)
    check_table("state_table", table, page, positions, ring=ring)  # fp32 window rows exact, before any kernel
    dim = norm.shape[-1]
    k = pool_kernel(rows, table.shape[0], table.shape[1], state.shape[0], dim, ratio, page, 2 * cos.shape[1],
                    float(eps), hadamard is not None, ring=ring)
    window = window_positions(positions, ratio).astype(np.int32)  # [B, span]; the kernel looks each one up
    args = [window, np.asarray(request_ids, np.int32).reshape(-1, 1),
            table.reshape(-1), np.asarray(state, np.float32), np.asarray(norm, np.float32).reshape(1, -1),
            cos.astype(BF16), sin.astype(BF16)]
    if hadamard is None:
        return launch(k, [*args, Out((rows, dim), BF16, "entries")])
    return launch(k, [*args, np.asarray(hadamard).astype(BF16), Out((rows, dim), np.int8, "idx"),
                      Out((rows, 1), np.float32, "idx_scale")])


def compress_into(x: np.ndarray, positions: np.ndarray, request: np.ndarray, state: CompressorState,
                  weights: PreparedCompressor, start: RopeRows, *, eps: float, hadamard: np.ndarray | None = None
                  ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """One compressor over a TP group's rows through pypto; **mutates** ``state.pool`` (the ring).

    x [P, X] (bf16 values); positions, request [P] (-1 padding); state: the state ring [rows, 2*coff*d] float32
    and its addressing (:class:`~dspark_kernels.model.plan.CompressorState`: slots, the table read at each row's
    ``table_row``, ring = ``PoolLayout.is_ring``, True in the ABI: page ``i // page_size`` in column
    ``(i // page_size) % width``; the coverage check reads it as a ring table too; its windows, looked up when
    None; the pooling kernel looks the rows up again in-kernel); weights: a ``PreparedCompressor`` (a2a3); start:
    RoPE cos / sin [P, rd/2] at each row's window start.
    Returns (boundary rows b [B] int64, outputs):
    outputs = (entries [B, d] float32 bf16 values,) or, with ``hadamard``, (idx [B, d] int8, idx_scale [B]).
    Raises ABIError ``coverage.unmapped`` before any write if a ratio-128 window is not mapped, and
    ``kernel.index_range`` if the pooling kernel's fp32 indices would round.
    """
    ratio, page_size = weights.ratio, state.page_size
    b, state_rows = state.window_rows(positions, ratio)
    issues = coverage_issues(positions, np.asarray(request), b, state_rows, ratio, "state_table")
    issues += table_issues("state_table", state.table, page_size, positions, ring=state.ring)
    if issues:
        raise ABIError(issues)
    rows = run_state_rows(x, weights.wkv, weights.wgate, weights.ape, positions).values[-1]
    state.pool[...] = run_scatter(state.pool, rows, state.slots).values[0]
    if b.size == 0:
        d = weights.dim
        return b, ((np.zeros((0, d), np.int8), np.zeros(0, np.float32)) if hadamard is not None
                   else (np.zeros((0, d), np.float32),))
    result = run_pool(np.asarray(positions)[b], np.asarray(state.table_row)[b], state.table, state.pool,
                      weights.norm, start.cos[b], start.sin[b], ratio=ratio, page=page_size, eps=eps,
                      ring=state.ring, hadamard=hadamard)
    if hadamard is not None:
        return b, (result.values[-2], result.values[-1][:, 0])
    return b, (result.values[-1].astype(np.float32),)
