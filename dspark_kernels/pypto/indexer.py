"""Stage 5: lightning indexer queries, scores and top-k (upstream's lightning indexer; keys: ``compressor``).

Kernel arguments (T query rows = the rank's L local rows; Q q_lora_rank, X hidden, HI/dI indexer heads/dim,
rd rope dims, C candidate columns, k = index_topk, Ri idx-pool rows; shapes static per call):

The host repeats the per-row inputs once per head, so the query runs as [T*HI, dI] rows (row t*HI + h) with a
single reshape of the projection's output and no 3-D tiles:

* ``qr_q`` [T, Q] int8 in, ``qr_scale`` [T*HI, 1] fp32 in: the int8 low-rank query of stage 2 (scale repeated).
* ``wq_b`` [HI*dI, Q] int8, ``wq_b_scale`` [T*HI, dI] fp32 in: ``indexer.wq_b``, its per-output-channel scale
  as [HI, dI] tiled T times.
* ``x`` [T, X] bf16 in; ``weights_proj`` [HI, X] bf16 in.
* ``cos``, ``sin`` [T*HI, rd/2] bf16 in: compressed-layer RoPE at each row's own position (repeated).
* ``hadamard`` [dI, dI] bf16 in: Sylvester Hadamard / sqrt(dI).
* ``idx`` [Ri, dI] int8, ``idx_scale`` [Ri] fp32 in: the idx cache (written by the indexer compressor first,
  so a boundary row sees its own new entry).
* ``candidates`` [T, C] int32 in: physical idx rows of entries ``c < (p + 1) // 4`` through the row's own
  request table (``entry_rows.run_entry_rows`` with ratio 4), a non-candidate (invisible, unmapped, padding;
  -1 in :func:`run_indexer`'s input) as row 0; ``key_bias`` [T, C] fp32 in: 0, or MASKED_SCORE there.
* ``page_table`` [1, MIN_COLUMNS] int32 in: zeros (``gather_in_l1`` reads the idx pool as one page, as
  ``sparse_attention`` does).
* ``top`` [T, k] int32 out: logical entries of the k best scores, best first; -1 after ``min(k, candidates)``.

Math: ``q = rope((qr_q @ wq_b.T) * qr_scale * wq_b_scale)`` per head, bf16; ``q = bf16(q) @ hadamard``;
``(q_i8, q_dq) = int8q(q)`` per (row, head); ``w = (x @ weights_proj.T) * index_weight_scale``;
``score[c] = idx_scale[c] * sum_h w[h] * relu(q_dq[h] * <q_i8[h], idx[c]>)`` (int32 dot products), computed
as ``sum_h (q_dq[h] * w[h]) * relu(<q_i8[h], idx[c]>)`` (q_dq > 0; the products round differently, by ~1 ulp); top-k
over the candidates with pypto's ``topk`` (in rounds of <= 128 for k > 128). Ties may come out in any order (the
reference takes the lower entry first); callers compare selections as sets with a tie tolerance.

Top-k at any candidate count (:func:`_tiled_select`): pypto's sort holds one vector tile of scores and its sorted
copies in the vector core's unified buffer, SORT_BYTES_PER_COLUMN bytes per column, next to the row's k selected
columns, against UB_BYTES, so at most :func:`max_sort_columns` columns sort at once (9,728 for k = 512; 16,384
candidates, a 65,536-deep request, need 327,680 B). Rows wider than S = SORT_TILE_COLUMNS (the cost model's
choice within that bound) are scored in ``n = ceil(C / S)`` column tiles of equal width (:func:`sort_tiles`:
16,384 candidates as 4 tiles of 4,096); each tile keeps its best ``kw = ceil(k / 32) * 32`` columns (values and
fp32 column numbers), and the winners are merged by top-k over their concatenation, up to S // kw tiles per merge
(8 for k = 512), as a tree until one remains. The k best of the row are among the tile winners (a column beaten
by kw >= k others of its own tile is beaten by k overall), so the selection is the single pass's, up to the order
of ties.

Structure: the query side runs batched over [T*HI, dI] rows; then one ``pypto.loop`` iteration per
ROW_BLOCK rows, each row's candidate keys gathered straight into L1 (``pypto.experimental.gather_in_l1``):
one cube task for the block's dot products and one vector task per row for the head sum, scale, mask and
top-k (the attention core's pattern: few tasks with one consumer each).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
import math
from functools import lru_cache
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from dspark_abi import ModelConfig
from dspark_kernels.model.plan import IndexKeyPools, RopeRows
from dspark_kernels.model.prepared import PreparedWeights
from dspark_kernels.pypto._ops import MASKED_SCORE, MIN_COLUMNS, int8_rows, rope_rows, tile
from dspark_kernels.pypto.runtime import LaunchResult, Out, launch, pypto, stitched_kernel

BF16 = ml_dtypes.bfloat16
#: Largest k pypto 0.2.0's ``topk`` supports.
TOPK_MAX_K = 128
#: pypto's sort needs tiles whose last axis is a multiple of 32 elements.
SORT_ALIGN = 32
#: Unified buffer of one A2/A3 vector core in bytes: ``ub_size`` of pypto 0.2.0's ``lib/configs/A2A3.ini``.
UB_BYTES = 196_608
#: Unified-buffer bytes pypto 0.2.0's sort (``BITSORT``) takes per fp32 column of its tile, from its pass log:
#: ``OP BITSORT in/output total size [327680] exceeds MEM_UB size [196608]`` for a 16,384-column tile (the
#: scores, their sorted copy with column numbers, and the merge buffer: 20 B per column).
SORT_BYTES_PER_COLUMN = 20
#: Widest sort tile the kernel uses (<= :func:`max_sort_columns`), chosen with pypto's cost model
#: (benchmarks/bench_pypto.py ``--round``: FLASH, L = 96 rows, 16,384 candidates, k = 512): 2 tiles of 8,192
#: 981,439 cycles, 3 x 5,472 907,176, 4 x 4,096 839,542, 5 x 3,296 958,802, 6 x 2,752 918,622, 8 x 2,048 853,409,
#: 16 x 1,024 1,200,393.
SORT_TILE_COLUMNS = 4096
# Tiles and merging chosen with pypto's cost model (benchmarks/bench_pypto.py, FLASH, L = 128 rows, 1024
# candidates; roofline 15.0k cycles). The model charges ~1.4k cycles per copy into a core's buffer whatever its
# size, ~0.4k of AICPU time per dependency between tasks, and its AICPUs take 3-10k cycles from a task's end
# to its consumer's start, so few, large tasks won throughout. The batched form (keys gathered per row into
# [T, C, dI] in global memory, [T, HI, C] scores, reshapes to [T, HI, dI] around RoPE) went 1,528,753 -> 257,650
# cycles by tiling. Then: a per-row loop with keys gathered into L1 and the row's vector work in one scope,
# 283,226 (the loop's tasks waited on the batched candidate tasks: their ~400 consumers were resolved while the
# query side waited) -> 253,133 with the loop reading only kernel inputs besides q (host-built key_bias, idx
# scales gathered per row) -> 226,265 with the whole loop in one stitch (rows + 1 functions: with ``rows`` the
# last row ran in a second stitch, +27k) -> 210,615 in blocks of 2 rows (215,301 with one vector task per
# block) -> 205,918 with RoPE over [T*HI, rd] (cos / sin repeated per head) instead of [T, HI, rd] ->
# 187,039 (12.5x) with the dequant after the reshape, fused with RoPE into one task per tile. What remains: the
# loop moves each row's [HI, C] int32 dots (256 KB) through global memory (its vector task is 90% copy-in) and
# starts only when q_i8 is complete (~90k). Per-head views of the projection (no reshape; 383k-422k: each view
# of the [T, HI*dI] product made its producer a hub) were slower; gathering keys once per group of rows in the
# batched form failed in pypto 0.2.0's scheduler ("Spill all buffer failed ... L0C_COPY_TO_L1").
#: Vector tile of the query rows [T*HI, dI] (dequant + RoPE, int8): (32, 128) 268.6k, (64, 128) 259.1k,
#: (128, 128) 258.3k in the batched form.
QUANT_TILE = (128, 128)
#: Vector tile of the head weights [T, HI] (the batched form's (32, 512) projection tile, clamped; (128, 128)
#: fails in pypto's scheduler: ``RetireOp failed! COPY_OUT``).
HEAD_W_TILE = (32, 512)
#: Same-structure cube subgraphs merged per task (pass option ``cube_nbuffer_setting``) on the query side:
#: 307k cycles unmerged, 269k in pairs, 284k in fours (batched form).
CUBE_MERGE = 2
#: Rows per loop iteration: their dot products (two 512-column halves each) are one cube task. 1: 226,265
#: cycles, 2: 210,615, 4: 225,985, 8: 245,423 (merging only pairs at 4: 220,487).
ROW_BLOCK = 2
#: Vector tile of one row's [HI, C] head sum: (64, 256) 187.0k, (64, 128) 202.1k; (64, 512) and (32, 1024)
#: fail in pypto's scheduler (``RetireOp failed! ASSEMBLE``), (32, 512) did not finish compiling in 10 minutes.
HEAD_SUM_TILE = (64, 256)
#: ``sg_set_scope`` id of a row's vector work (head sum, scale, mask, top-k, store): one task per row.
ROW_SCOPE = 1


def _select(score: Any, topk: int, rounds: int) -> tuple[Any, Any]:
    """Top-k (values, int32 columns) of score [T, C] fp32, best first, in ``rounds`` pypto ``topk`` calls.

    pypto 0.2.0's ``topk`` accepts k <= 128 (``The k should less than or equal to128``) and its ``argsort``
    over several tiles cannot be costed (``No pipe type ... opcode=TWOTILEMRGSORT``). So k = 512 (FLASH) takes
    the best k / rounds columns per round and masks them out before the next round: the rounds come out in
    descending order, so their concatenation is the sorted top-k.
    """
    if rounds == 1:
        best: tuple[Any, Any] = pypto.topk(score, topk, -1, True)
        return best
    per_round = topk // rounds
    values, picked = [], []
    for _ in range(rounds):
        v, i = pypto.topk(score, per_round, -1, True)
        values.append(v)
        picked.append(i)
        score = pypto.scatter(score, 1, i, MASKED_SCORE)
    return pypto.concat(values, -1), pypto.concat(picked, -1)


def max_sort_columns(topk: int) -> int:
    """Widest column tile one row's top-k sorts in pypto 0.2.0: ``(UB_BYTES - 4 * k) / SORT_BYTES_PER_COLUMN``
    rounded down to SORT_ALIGN; the 4 * k bytes are the row's k int32 columns being assembled into ``top``, resident
    in the buffer while the sort runs. 9,728 for k = 512: at L = 2 rows a single tile of 9,728 compiled, one of
    9,760 did not (the scheduler's ``Spill all buffer failed`` on MEM_UB beside that 2,048-byte row), nor 9,824
    (UB_BYTES / 20 rounded down: the sort alone fits)."""
    return (UB_BYTES - 4 * topk) // SORT_BYTES_PER_COLUMN // SORT_ALIGN * SORT_ALIGN


def _rounds_for(k: int, rounds: int) -> int:
    """``rounds`` when it splits k into topk calls pypto accepts, else as few as k allows (ceil(k / 128))."""
    return rounds if rounds and k % rounds == 0 and k // rounds <= TOPK_MAX_K else -(-k // TOPK_MAX_K)


def tile_winners(topk: int) -> int:
    """Columns kw each sort tile passes to the merge: k rounded up to SORT_ALIGN (the concatenated winners are
    sorted again, so their width must stay a multiple of it)."""
    return -(-topk // SORT_ALIGN) * SORT_ALIGN


def sort_tiles(columns: int, topk: int, tile_columns: int = 0) -> tuple[int, int, int]:
    """(tiles n, tile width W, merge fan-in) of the top-k over ``columns`` candidates.

    The widest sort is ``S = tile_columns`` or SORT_TILE_COLUMNS (at least two tiles' winners 2 * kw, at most
    :func:`max_sort_columns`) columns: one tile of every column when they fit (C rounded up to SORT_ALIGN), else
    ``n = ceil(C / S)`` tiles of ``W = max(kw, ceil(C / n))`` rounded up to SORT_ALIGN (the host pads the
    candidates to n * W with non-candidates); each merge sorts the winners of up to ``S // kw`` tiles (kw:
    :func:`tile_winners`). A small ``tile_columns`` (a multiple of SORT_ALIGN from 2 * kw to max_sort_columns)
    runs the tiled top-k and its merge tree on few candidates. ValueError for a tile_columns outside that range,
    or a k too large to merge two tiles' winners when the candidates need more than one tile.
    """
    kw = tile_winners(topk)
    widest_sort = max_sort_columns(topk)
    if tile_columns and (tile_columns % SORT_ALIGN or not 2 * kw <= tile_columns <= widest_sort):
        raise ValueError(f"tile_columns={tile_columns} (topk={topk}) must be a multiple of {SORT_ALIGN} between two "
                         f"tiles' winners ({2 * kw}) and the widest sort ({widest_sort})")
    widest = tile_columns or min(max(SORT_TILE_COLUMNS, 2 * kw), widest_sort)
    columns = max(columns, topk)
    n = -(-columns // widest)
    if n > 1 and widest < 2 * kw:
        raise ValueError(f"topk={topk}: {columns} candidates need several sort tiles, and two tiles' {kw} winners "
                         f"exceed the widest sort ({widest_sort} columns)")
    share = -(-columns // n)  # columns per tile before alignment
    width = -(-share // SORT_ALIGN) * SORT_ALIGN
    return n, max(width, kw) if n > 1 else width, widest // kw


def _tiled_select(score: Any, topk: int, rounds: int, width: int, fan_in: int) -> tuple[Any, Any]:
    """Top-k (values, fp32 columns) of score [1, n * W] in column tiles of W = ``width``, merged ``fan_in`` tiles'
    winners at a time (module docstring; :func:`sort_tiles`), best first; one tile is the single pass of
    :func:`_select`."""
    columns = score.shape[1]
    if columns == width:
        values, picked = _select(score, topk, rounds)
        return values, pypto.cast(picked, pypto.DT_FP32)
    kw = tile_winners(topk)
    values, ids = [], []
    for lo in range(0, columns, width):
        v, i = _select(pypto.view(score, [1, width], [0, lo]), kw, _rounds_for(kw, rounds))
        values.append(v)
        ids.append(pypto.add(pypto.cast(i, pypto.DT_FP32), float(lo)))  # exact: columns < 2**24
    while len(values) > 1:
        last = len(values) <= fan_in  # the final merge keeps k, the others kw
        keep, keep_rounds = (topk, rounds) if last else (kw, _rounds_for(kw, rounds))
        merged_v, merged_i = [], []
        for g in range(0, len(values), fan_in):
            group_v, group_i = values[g:g + fan_in], ids[g:g + fan_in]
            if len(group_v) == 1:
                merged_v += group_v
                merged_i += group_i
                continue
            v, p = _select(pypto.concat(group_v, -1), keep, keep_rounds)
            merged_v.append(v)
            merged_i.append(pypto.gather(pypto.concat(group_i, -1), 1, p))
        values, ids = merged_v, merged_i
    return values[0], ids[0]


@lru_cache(maxsize=16)
def indexer_kernel(rows: int, q_rank: int, hidden: int, heads: int, dim: int, rope: int, columns: int,
                   topk: int, pool_rows: int, weight_scale: float, rounds: int = 0, width: int = 0,
                   fan_in: int = 2) -> Any:
    """The jit kernel for one geometry (module docstring); ``rounds``: see :func:`_select` (0 = as few as k allows);
    ``width``, ``fan_in``: the sort tiles' width W (columns a multiple of it; 0 = every column in one tile) and the
    tiles merged per sort (:func:`sort_tiles`)."""
    rounds = rounds or -(-topk // TOPK_MAX_K)
    width = width or columns
    block = math.gcd(rows, ROW_BLOCK)
    tm, tn = tile(rows, 128), tile(dim, 128)
    if tm == 64:  # an M tile of 64 here ends the process with SIGSEGV in pypto 0.2.0 (seen for 64 <= T < 128)
        tm = 32
    # cube tiles ([M L0, L1], [K L0, L1], [N L0, L1]); L0A/L0B hold 64 KB, L0C 128 KB
    q_cube = ([tm, tm], [tile(q_rank, 256), tile(q_rank, 1024)], [tile(heads * dim, 256)] * 2)  # int8 wq_b
    w_cube = ([min(tm, 32)] * 2, [tile(hidden, 256), tile(hidden, 1024)], [tile(heads, 64)] * 2)  # 4 M tasks
    h_cube = ([tm, tm], [tn, tn], [tn, tn])                                                     # Hadamard
    d_cube = ([tile(heads, 64)] * 2, [tn, tn], [tile(columns, 512)] * 2)                        # q . keys
    quant = tuple(min(t, n) for t, n in zip(QUANT_TILE, (rows * heads, dim), strict=True))
    head_sum = tuple(min(t, n) for t, n in zip(HEAD_SUM_TILE, (heads, columns), strict=True))

    @stitched_kernel(rows // block + 1)
    def lightning_indexer(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            qr_q: pypto.Tensor([rows, q_rank], pypto.DT_INT8),
            qr_scale: pypto.Tensor([rows * heads, 1], pypto.DT_FP32),
            wq_b: pypto.Tensor([heads * dim, q_rank], pypto.DT_INT8),
            wq_b_scale: pypto.Tensor([rows * heads, dim], pypto.DT_FP32),
            x: pypto.Tensor([rows, hidden], pypto.DT_BF16),
            weights_proj: pypto.Tensor([heads, hidden], pypto.DT_BF16),
            cos: pypto.Tensor([rows * heads, rope // 2], pypto.DT_BF16),
            sin: pypto.Tensor([rows * heads, rope // 2], pypto.DT_BF16),
            hadamard: pypto.Tensor([dim, dim], pypto.DT_BF16),
            idx: pypto.Tensor([pool_rows, dim], pypto.DT_INT8),
            idx_scale: pypto.Tensor([pool_rows], pypto.DT_FP32),
            candidates: pypto.Tensor([rows, columns], pypto.DT_INT32),
            key_bias: pypto.Tensor([rows, columns], pypto.DT_FP32),
            page_table: pypto.Tensor([1, MIN_COLUMNS], pypto.DT_INT32),
            top: pypto.Tensor([rows, topk], pypto.DT_INT32)):
        _sizes = (rows, q_rank, hidden, heads, dim, rope, columns, topk, pool_rows)  # closure capture
        pypto.set_pass_options(cube_nbuffer_setting={-1: CUBE_MERGE})
        pypto.set_cube_tile_shapes(*q_cube)
        pypto.set_vec_tile_shapes(min(rows, HEAD_W_TILE[0]), min(heads, HEAD_W_TILE[1]))
        wide = pypto.matmul(qr_q, wq_b, pypto.DT_INT32, b_trans=True)                            # [T, HI*dI]
        pypto.set_cube_tile_shapes(*w_cube)
        head_w = pypto.mul(pypto.matmul(x, weights_proj, pypto.DT_FP32, b_trans=True), weight_scale)  # [T, HI]
        head_w = pypto.reshape(head_w, [rows * heads, 1])                                        # [T*HI, 1]
        pypto.set_vec_tile_shapes(*quant)
        # dequant after the reshape: it joins RoPE's task (before it, its own 64 tasks: 206k -> 187k)
        q2 = pypto.cast(pypto.reshape(wide, [rows * heads, dim]), pypto.DT_FP32)                # [T*HI, dI]
        q2 = pypto.mul(pypto.mul(q2, qr_scale), wq_b_scale)
        roped = rope_rows(pypto.view(q2, [rows * heads, rope], [0, dim - rope]), cos, sin)
        q2 = pypto.cast(pypto.concat([pypto.view(q2, [rows * heads, dim - rope], [0, 0]), roped], -1),
                        pypto.DT_BF16)
        pypto.set_cube_tile_shapes(*h_cube)
        rotated = pypto.matmul(q2, hadamard, pypto.DT_FP32)                                     # [T*HI, dI]
        q_i8, q_dq = int8_rows(rotated)                                                          # [T*HI, dI], [T*HI, 1]
        # relu(q_dq * dot) = q_dq * relu(dot) (q_dq = amax / 127 > 0): one factor per (row, head), formed next to
        # q_dq (formed in a later step, its [T, HI, C] broadcast was written out to memory: 70-160k cycles)
        head_w = pypto.mul(q_dq, head_w)                                                         # [T*HI, 1]
        for b in pypto.loop(rows // block):
            _rows_top(b, block, q_i8, head_w, (candidates, key_bias, idx, idx_scale, page_table), top,
                      (d_cube, head_sum, topk, rounds, width, fan_in))

    return lightning_indexer


def _rows_top(b: Any, block: int, q_i8: Any, head_w: Any, keys_in: tuple[Any, ...], top: Any,
              shapes: tuple[Any, ...]) -> None:
    """Scores and top-k of rows b*block .. b*block + block - 1 into ``top`` (traced, plain Python).

    ``keys_in``: the kernel's candidates, key_bias, idx, idx_scale and page_table; ``shapes``: the dot products'
    cube tiles, the head-sum vector tile, k, the selection rounds, the sort tiles' width and merge fan-in. The loop
    reads nothing else the kernel computes but q_i8 and head_w: every extra producer would be a dependency of each
    iteration.
    """
    candidates, key_bias, idx, idx_scale, page_table = keys_in
    d_cube, head_sum, topk, rounds, width, fan_in = shapes
    rows, columns = candidates.shape
    heads, dim = q_i8.shape[0] // rows, q_i8.shape[1]
    pypto.set_pass_options(cube_nbuffer_setting={-1: CUBE_MERGE * block})  # the block's dots: one cube task
    pypto.set_cube_tile_shapes(*d_cube)
    dots = []
    for r in range(block):
        t = b * block + r
        keys = pypto.experimental.gather_in_l1(idx, pypto.view(candidates, [1, columns], [t, 0]), page_table,
                                               idx.shape[0], dim, True, True)               # [C, dI] in L1
        dots.append(pypto.matmul(pypto.view(q_i8, [heads, dim], [t * heads, 0]), keys, pypto.DT_INT32,
                                 b_trans=True))                                              # [HI, C]
    for r in range(block):
        t = b * block + r
        pypto.set_pass_options(sg_set_scope=ROW_SCOPE)
        pypto.set_vec_tile_shapes(*head_sum)
        relu = pypto.relu(pypto.cast(dots[r], pypto.DT_FP32))  # exact: |dot| <= 127 * 127 * dI < 2**24
        score = pypto.sum(pypto.mul(relu, pypto.view(head_w, [heads, 1], [t * heads, 0])), 0, keepdim=True)
        pypto.set_vec_tile_shapes(1, width)
        key_scale = pypto.index_select(idx_scale, 0, pypto.view(candidates, [1, columns], [t, 0]))
        # a non-candidate: score * idx_scale[0] + MASKED_SCORE rounds to MASKED_SCORE (|score * scale| << 1e22)
        score = pypto.add(pypto.mul(score, key_scale), pypto.view(key_bias, [1, columns], [t, 0]))   # [1, C]
        values, picked = _tiled_select(score, topk, rounds, width, fan_in)
        chosen = pypto.gt(values, MASKED_SCORE * 0.5)
        pypto.assemble(pypto.cast(pypto.where(chosen, picked, -1.0), pypto.DT_INT32),
                       [t, 0], top)
        pypto.set_pass_options(sg_set_scope=-1)  # a new scope per row: one vector task each


@attrs.frozen(eq=False)
class IndexerWeights:
    """The lightning indexer's query-side weights of one CSA layer (a2a3).

    wq_b [HI*dI, q] int8 with its per-channel dequant scale [HI*dI] float32; weights_proj [HI, X] (bf16 values);
    hadamard [dI, dI] (bf16 values); heads = HI; weight_scale = ``index_weight_scale`` (scales the head weights).
    """

    wq_b: np.ndarray
    wq_b_scale: np.ndarray
    weights_proj: np.ndarray
    hadamard: np.ndarray
    heads: int
    weight_scale: float

    @classmethod
    def of(cls, w: PreparedWeights, config: ModelConfig) -> "IndexerWeights":
        """The indexer weights of a layer's prepared a2a3 weights; ValueError if the layer has no indexer."""
        if w.idx_wq_b is None or w.idx_wq_b_scale is None or w.idx_weights_proj is None or w.idx_hadamard is None:
            raise ValueError("the a2a3 weights of this layer lack the indexer (wq_b, its scale, weights_proj, "
                             "Hadamard)")
        return cls(w.idx_wq_b, w.idx_wq_b_scale, w.idx_weights_proj, w.idx_hadamard, config.index_n_heads,
                   config.index_weight_scale)


def run_indexer(low_rank: tuple[np.ndarray, np.ndarray], x: np.ndarray, weights: IndexerWeights, rope: RopeRows,
                keys: IndexKeyPools, candidates: np.ndarray, *, topk: int, rounds: int = 0,
                tile_columns: int = 0) -> LaunchResult:
    """Top-k entries [T, k] int32 (``values[-1]``) of T query rows.

    low_rank: the attention's low-rank query (qr_q [T, q] int8, qr_scale [T, 1] float32); x [T, X] (bf16
    values); rope: cos / sin [T, rd/2] at the rows' positions; keys: the idx pool [rows, dI] int8 and idx_scale
    [rows]; candidates [T, C] int physical idx rows (-1 = none); ``rounds`` of topk calls (k divisible by it;
    0 = ceil(k / 128)); ``tile_columns``: the widest sort tile (0 = SORT_TILE_COLUMNS; smaller
    to run the tiled top-k on few candidates), see :func:`sort_tiles`.
    """
    qr_q, qr_scale = low_rank
    cos, sin = rope.cos, rope.sin
    heads, hadamard = weights.heads, weights.hadamard
    idx, idx_scale = keys.keys, keys.scales
    if rounds and topk % rounds:
        raise ValueError(f"topk={topk} must be divisible by rounds={rounds}")
    rows, q_rank = qr_q.shape
    candidates = np.asarray(candidates, np.int32)
    # topk needs at least k columns, the sort tiles equal widths, multiples of 32: pad with non-candidates
    tiles, width, fan_in = sort_tiles(candidates.shape[1], topk, tile_columns)
    columns = tiles * width
    if candidates.shape[1] < columns:
        pad = np.full((rows, columns - candidates.shape[1]), -1, np.int32)
        candidates = np.concatenate([candidates, pad], axis=1)
    dim = hadamard.shape[0]
    k = indexer_kernel(rows, q_rank, x.shape[1], heads, dim, 2 * cos.shape[1], candidates.shape[1], topk,
                       idx.shape[0], float(weights.weight_scale), rounds, width, fan_in)
    per_head = [np.repeat(np.asarray(v, np.float32).reshape(rows, -1), heads, axis=0) for v in (qr_scale, cos, sin)]
    channel_scale = np.tile(np.asarray(weights.wq_b_scale, np.float32).reshape(heads, dim), (rows, 1))
    key_bias = np.where(candidates >= 0, np.float32(0), np.float32(MASKED_SCORE))
    return launch(k, [np.asarray(qr_q).astype(np.int8), per_head[0], np.asarray(weights.wq_b).astype(np.int8),
                      channel_scale, x.astype(BF16), weights.weights_proj.astype(BF16), per_head[1].astype(BF16),
                      per_head[2].astype(BF16),
                      np.asarray(hadamard).astype(BF16), np.asarray(idx).astype(np.int8),
                      np.asarray(idx_scale, np.float32).reshape(-1), np.maximum(candidates, 0), key_bias,
                      np.zeros((1, MIN_COLUMNS), np.int32), Out((rows, topk), np.int32, "top")])
