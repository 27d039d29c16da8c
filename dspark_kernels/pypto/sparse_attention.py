"""Stage 6: upstream's sparse attention core, over window + compressed keys with the attention sink.

Kernel arguments (T query rows = the rank's L local rows; H heads, D head_dim = the latent key/value
width, W window, K compressed columns, rd rope dims; all shapes static per call):

* ``q``           [T*H, D] bf16 in: queries after RoPE (stage 2); query t's heads are rows t*H .. t*H + H - 1.
* ``window_rows`` [T, W] int32 in: physical ``ori`` rows of each query's window (stage 3), a missing key as row 0.
* ``cmp_rows``    [T, K] int32 in: physical rows of the compressed pool (``csa_cmp`` rows of the top-k entries,
  or every visible ``hca_cmp`` entry; :func:`dspark_kernels.pypto.entry_rows.run_entry_rows`), a missing key as
  row 0. [T, 1] zeros on SWA layers (K = 0).
* ``key_bias``    [T, W + K] fp32 in: 0 where the key exists, :data:`~dspark_kernels.pypto._ops.MASKED_SCORE`
  where the stage's row was -1 (columns: the window's, then the compressed ones).
* ``ori``         [Ro, D] bf16 in: the ``ori`` pool; ``cmp`` [Rc, D] bf16 in: the compressed pool.
* ``sink``        [H, 1] fp32 in: per-head sink logit.
* ``page_table``  [1, MIN_COLUMNS] int32 in: zeros. ``gather_in_l1`` reads rows through a paged block table;
  the rows here are physical already, so each pool is one page (page size = its row count) at block 0.
* ``rope_cs``     [T, rd] bf16 in: ``cos | sin`` of the layer's RoPE table at each query's own position.
* ``o``           [T*H, D] bf16 out: attention output after inverse RoPE; rows without keys (padding) 0.

:func:`run_sparse_attention` takes the stage's arrays (q and o [T, H, D], -1 for a missing key) and prepares
these (flattening, row 0 plus ``key_bias`` for a missing key, ``cos | sin``).

Math (one softmax over the union of window and compressed keys, K = V = the gathered latent rows):
``s = (q . k) * scale`` in fp32; online softmax over key tiles (:func:`key_blocks`: one shared tile when
every key fits, else the window's tiles, then the compressed columns'): ``m' = max(m, max s)``,
``p = exp(s - m')`` (0 on missing keys, see ``_attend_query``),
``l = l e^(m - m') + sum p``, ``acc = acc e^(m - m') + bf16(p) @ k``; finally
``o = acc / (l + e^(sink - m))`` (the sink is in the denominator only, never in the max), inverse RoPE on
the last rd dims at the query's position, bf16.

Structure (chosen with pypto's A2/A3 cost model, ``benchmarks/bench_pypto.py``, FLASH heads, L = 128): one
``pypto.loop`` iteration per query, and per query and key tile one cube task for ``q . k`` whose keys are
gathered straight into L1 (``pypto.experimental.gather_in_l1``), one vector task for the softmax, one cube
task for ``p @ k`` (the keys gathered again), then one vector task for the division, inverse RoPE and store.
The model's span follows its task and dependency counts (its AICPU resolves every dependency in 390 cycles and
polls each core in 240), so the kernel is built for few tasks with one consumer each: 4 tasks and 3
dependencies per query in one pass. The batched form it replaces ([T, H, D] x [T, n, D] products over all
queries, keys gathered into global memory by vector tasks) took 1,034 tasks and 3,567 dependencies on the HCA
case (357,553 cycles, 7.3x of the roofline) and 730,614 cycles (5.6x) on the CSA case; this one 142,855
(2.9x) and 321,927 (2.4x).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_kernels.pypto._ops import MASKED_SCORE, MIN_COLUMNS, rope_rows
from dspark_kernels.pypto.runtime import LaunchResult, Out, launch, pypto, stitched_kernel

BF16 = ml_dtypes.bfloat16
#: Start of the running maximum. Real logits are q.k * D^-0.5 with RMS-normalised q and keys (|logit| is of
#: order sqrt(D) times the kv_norm weights, ~23 at D = 512), so the floor never wins against a real key and
#: the maximum is exact; it would only matter for norm weights in the hundreds. A missing key's logit bias is
#: :data:`~dspark_kernels.pypto._ops.MASKED_SCORE`: ``e^(MASKED_SCORE - m)`` is exactly 0 for any m >= this floor.
RUNNING_MAX_FLOOR = -1e4
#: Key columns per online-softmax step (:func:`key_blocks`). FLASH's CSA set (128 window + 512 top-k keys) is
#: one pass; 128 rows of a deep HCA query (128 + 2296 entries) cost 1.16M cycles in tiles of 1024 and 1.24M in
#: tiles of 640 (the batched predecessor, 256-key tiles with the fp32 accumulator in global memory: 2.08M).
DEFAULT_KEY_TILE = 1024
#: Cube tiles of ``q . k`` (M = one query's heads; the K panel is all of D, so q is copied into L1 once: four
#: 128-deep copies cost 398k cycles against 388k at an early stage, HCA) and of ``p @ k``. The key tile stays at
#: 128 columns: with 256 the L1 gathers no longer align with the window's 128 rows and become tasks of their
#: own (307k -> 349k).
QK_TILES = ([64, 64], [128, 512], [128, 128])
PV_TILES = ([64, 64], [128, 128], [256, 256])
#: pypto's breadth merge of same-shaped cube subgraphs (``cube_nbuffer_setting``): the 128-key tiles of one
#: ``q . k`` and the two 256-column halves of one ``p @ k`` run as one task each (1,280 -> 1,024 tasks, 307k
#: -> 234k cycles on the HCA case before the other merges).
CUBE_MERGE = 2
#: Softmax vector tiles hold whole key rows (a reduction split over tiles costs a task per part) and at most
#: this many fp32 elements (40 KB of the 192 KB UB): 64 heads x 160 keys (HCA), 16 x 640 (CSA); the head tiles of
#: one query are merged into one task (``vec_nbuffer_setting``; CSA 4 tasks -> 1: 441k -> 357k cycles).
SOFTMAX_TILE_ELEMENTS = 10240
#: Vector tile of the final division and store over [H, D] (64 KB fp32): 143k cycles against 200k with (32, 512)
#: (HCA).
FINAL_TILE = (64, 256)
#: ``sg_set_scope`` id of the final vector ops: one task per query instead of one per column tile plus the RoPE
#: table broadcasts (1,024 -> 640 tasks, 234k -> 162k cycles on the HCA case).
FINAL_SCOPE = 1


Segment = tuple[str, int, int]


def key_blocks(window: int, compressed: int, tile: int) -> tuple[tuple[Segment, ...], ...]:
    """Static key tiles of at most ``tile`` columns: the window's, then the compressed columns'.

    Each tile is a tuple of segments ``(source, first column, columns)``, source "window" or "cmp". When every
    key fits one tile, window and compressed keys share it (one softmax pass); otherwise the compressed columns
    start a fresh tile, so every tile's columns are contiguous in ``key_bias``.
    """
    if window + compressed <= tile:
        return ((("window", 0, window),) + ((("cmp", 0, compressed),) if compressed else ()),)
    blocks = [(("window", c, min(tile, window - c)),) for c in range(0, window, tile)]
    blocks += [(("cmp", c, min(tile, compressed - c)),) for c in range(0, compressed, tile)]
    return tuple(blocks)


def _softmax_rows(heads: int, cols: int) -> int:
    """Head rows of a softmax vector tile over ``cols`` keys: whole rows, at most SOFTMAX_TILE_ELEMENTS."""
    rows = heads
    while rows > 8 and rows * cols > SOFTMAX_TILE_ELEMENTS:
        rows //= 2
    return rows


@lru_cache(maxsize=16)
def sparse_attention_kernel(rows: int, heads: int, dim: int, window: int, compressed: int, ori_rows: int,
                            cmp_rows_n: int, rope: int, scale: float, tile: int = DEFAULT_KEY_TILE) -> Any:
    """The jit kernel for one geometry (module docstring); ``compressed == 0`` builds the SWA variant."""
    blocks = key_blocks(window, compressed, tile)
    k_cols = max(compressed, 1)
    cmp_n = max(cmp_rows_n, 1)

    @stitched_kernel(rows)
    def sparse_attention(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            q: pypto.Tensor([rows * heads, dim], pypto.DT_BF16),
            window_rows: pypto.Tensor([rows, window], pypto.DT_INT32),
            cmp_rows: pypto.Tensor([rows, k_cols], pypto.DT_INT32),
            key_bias: pypto.Tensor([rows, window + k_cols], pypto.DT_FP32),
            ori: pypto.Tensor([ori_rows, dim], pypto.DT_BF16),
            cmp: pypto.Tensor([cmp_n, dim], pypto.DT_BF16),
            sink: pypto.Tensor([heads, 1], pypto.DT_FP32),
            page_table: pypto.Tensor([1, MIN_COLUMNS], pypto.DT_INT32),
            rope_cs: pypto.Tensor([rows, rope], pypto.DT_BF16),
            o: pypto.Tensor([rows * heads, dim], pypto.DT_BF16)):
        _sizes = (rows, heads, dim, window, k_cols, ori_rows, cmp_n, rope)  # closure capture for annotations
        for t in pypto.loop(rows):
            _query(t, q, (window_rows, cmp_rows, key_bias, ori, cmp, page_table), sink, rope_cs, o, blocks, scale)

    return sparse_attention


def _query(t: Any, q: Any, keys: tuple[Any, ...], sink: Any, rope_cs: Any, o: Any,
           blocks: tuple[tuple[Segment, ...], ...], scale: float) -> None:
    """Query t's attention, inverse RoPE and store (traced, plain Python); ``keys`` = the kernel's window_rows,
    cmp_rows, key_bias, ori, cmp and page_table."""
    window_rows, cmp_rows, key_bias, ori, cmp, page_table = keys
    heads, dim = q.shape[0] // window_rows.shape[0], q.shape[1]
    rope = rope_cs.shape[1]
    pools = {"window": (window_rows, ori, 0), "cmp": (cmp_rows, cmp, window_rows.shape[1])}
    out = _attend_query(t, pypto.view(q, [heads, dim], [t * heads, 0]), pools, key_bias, page_table, sink,
                        blocks, scale)                                                             # [H, D]
    # still in the final scope: the inverse RoPE and both stores join the division's task
    cs = pypto.cast(pypto.view(rope_cs, [1, rope], [t, 0]), pypto.DT_FP32)  # one copy of the row (HCA: 145k -> 143k)
    tail = rope_rows(pypto.view(out, [heads, rope], [0, dim - rope]), pypto.view(cs, [1, rope // 2], [0, 0]),
                     pypto.view(cs, [1, rope // 2], [0, rope // 2]), inverse=True)
    pypto.assemble(pypto.cast(pypto.view(out, [heads, dim - rope], [0, 0]), pypto.DT_BF16), [t * heads, 0], o)
    pypto.assemble(pypto.cast(tail, pypto.DT_BF16), [t * heads, dim - rope], o)
    pypto.set_pass_options(sg_set_scope=-1)


def _gathered(t: Any, block: tuple[Segment, ...], pools: dict[str, tuple[Any, Any, int]], page_table: Any,
              transposed: bool) -> Any:
    """The block's key rows [n, D] of query t, gathered into L1 as the B operand (transposed for ``q . k``)."""
    parts = []
    for source, first, cols in block:
        rows_in, pool, _ = pools[source]
        parts.append(pypto.experimental.gather_in_l1(pool, pypto.view(rows_in, [1, cols], [t, first]), page_table,
                                                     pool.shape[0], pool.shape[1], True, transposed))
    if len(parts) == 1:
        return parts[0]
    keys = pypto.tensor([sum(cols for _, _, cols in block), parts[0].shape[1]], pypto.DT_BF16, "keys")
    offset = 0
    for part, (_, _, cols) in zip(parts, block, strict=True):
        pypto.assemble(part, [offset, 0], keys)
        offset += cols
    return keys


def _attend_query(t: Any, qt: Any, pools: dict[str, tuple[Any, Any, int]], key_bias: Any, page_table: Any,
                  sink: Any, blocks: tuple[tuple[Segment, ...], ...], scale: float) -> Any:
    """Online softmax with sink for query t (``qt`` [H, D]); returns fp32 [H, D] (traced, plain Python).

    Leaves the final scope (:data:`FINAL_SCOPE`) open: the caller's inverse RoPE and stores join its task.
    The running maximum starts at RUNNING_MAX_FLOOR, far below any real logit but far above MASKED_SCORE, so
    a missing key's ``e^(s - m)`` is exactly 0 without a separate mask multiply, real keys see the true
    maximum, and a query without any key keeps ``l = 0`` (its output is set to 0).
    """
    heads = qt.shape[0]
    widest = max(sum(cols for _, _, cols in block) for block in blocks)
    merge = heads // _softmax_rows(heads, widest)
    pypto.set_pass_options(cube_nbuffer_setting={-1: CUBE_MERGE}, **({"vec_nbuffer_setting": {-1: merge}}
                                                                     if merge > 1 else {}))
    m = lsum = denom = None
    pvs, alphas = [], []
    for b, block in enumerate(blocks):
        cols = sum(n for _, _, n in block)
        source, first, _ = block[0]
        pypto.set_cube_tile_shapes(*QK_TILES)
        s = pypto.matmul(qt, _gathered(t, block, pools, page_table, True), pypto.DT_FP32, b_trans=True)  # [H, n]
        # reductions need 32-byte tile rows; a tile may be wider than its block (e.g. 16 window + 71 HCA keys)
        pypto.set_vec_tile_shapes(_softmax_rows(heads, cols), -(-cols // MIN_COLUMNS) * MIN_COLUMNS)
        bias = pypto.view(key_bias, [1, cols], [t, pools[source][2] + first])                           # [1, n]
        s = pypto.add(pypto.mul(s, scale), bias)
        top = pypto.amax(s, -1, keepdim=True)                                                          # [H, 1]
        m_new = pypto.maximum(top, RUNNING_MAX_FLOOR) if m is None else pypto.maximum(m, top)
        p = pypto.exp(pypto.sub(s, m_new))
        if m is None:
            lsum = pypto.sum(p, -1, keepdim=True)
        else:
            alphas.append(pypto.exp(pypto.sub(m, m_new)))
            lsum = pypto.add(pypto.mul(lsum, alphas[-1]), pypto.sum(p, -1, keepdim=True))
        m = m_new
        if b == len(blocks) - 1:  # the denominator joins the last softmax task
            denom = pypto.add(lsum, pypto.exp(pypto.sub(sink, m)))
        pypto.set_cube_tile_shapes(*PV_TILES)
        pvs.append(pypto.matmul(pypto.cast(p, pypto.DT_BF16), _gathered(t, block, pools, page_table, False),
                                pypto.DT_FP32))                                                        # [H, D]
    pypto.set_pass_options(sg_set_scope=FINAL_SCOPE)
    pypto.set_vec_tile_shapes(*FINAL_TILE)
    acc = pvs[0]
    for pv, alpha in zip(pvs[1:], alphas, strict=True):
        acc = pypto.add(pypto.mul(acc, alpha), pv)
    return pypto.where(pypto.gt(lsum, 0.0), pypto.div(acc, denom), 0.0)


def run_sparse_attention(q: np.ndarray, window_rows: np.ndarray, cmp_rows: np.ndarray | None, ori: np.ndarray,
                         cmp: np.ndarray | None, sink: np.ndarray, cos: np.ndarray, sin: np.ndarray, *,
                         scale: float, tile: int = DEFAULT_KEY_TILE) -> LaunchResult:
    """Run the kernel on numpy arrays (float inputs holding bf16 values); ``values[-1]`` = o [T, H, D] bf16.

    window_rows / cmp_rows: [T, W] / [T, K] int (-1 = none; cmp_rows None on SWA layers); ori / cmp: pools
    [rows, D]; sink [H]; cos / sin [T, rd/2].
    """
    rows, heads, dim = q.shape
    window = window_rows.shape[1]
    if cmp_rows is None or cmp is None or cmp_rows.shape[1] == 0:
        cmp_rows, cmp, compressed = np.full((rows, 1), -1, np.int32), np.zeros((1, dim), np.float32), 0
    else:
        cmp_rows = np.asarray(cmp_rows)
        if cmp_rows.shape[1] < MIN_COLUMNS:  # rows under 32 bytes cannot be tiled: pad with missing keys
            cmp_rows = np.concatenate([cmp_rows, np.full((rows, MIN_COLUMNS - cmp_rows.shape[1]), -1)], axis=1)
        compressed = cmp_rows.shape[1]
    for name, idx, pool in (("window_rows", window_rows, ori), ("cmp_rows", cmp_rows, cmp)):
        bad = np.flatnonzero((np.asarray(idx) < -1) | (np.asarray(idx) >= len(pool)))
        if bad.size:
            raise ValueError(f"{name} holds {bad.size} rows outside [-1, {len(pool)}); first flat index {bad[0]}")
    keys = np.concatenate([np.asarray(window_rows), cmp_rows], axis=1)                              # [T, W + K]
    key_bias = np.where(keys >= 0, np.float32(0), np.float32(MASKED_SCORE)).astype(np.float32)
    k = sparse_attention_kernel(rows, heads, dim, window, compressed, len(ori), len(cmp), 2 * cos.shape[1],
                                float(scale), tile)
    result = launch(k, [q.astype(BF16).reshape(rows * heads, dim), np.maximum(window_rows, 0).astype(np.int32),
                        np.maximum(cmp_rows, 0).astype(np.int32), key_bias, ori.astype(BF16), cmp.astype(BF16),
                        np.asarray(sink, np.float32).reshape(heads, 1), np.zeros((1, MIN_COLUMNS), np.int32),
                        np.concatenate([cos, sin], axis=1).astype(BF16), Out((rows * heads, dim), BF16, "o")])
    return LaunchResult((*result.values[:-1], result.values[-1].reshape(rows, heads, dim)), result.cycles)
