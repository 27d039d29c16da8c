"""Stage 6: upstream's sparse attention core, over window + compressed keys with the attention sink.

Kernel arguments (T query rows = the rank's L local rows; H heads, D head_dim = the latent key/value
width, W window, K compressed columns, rd rope dims; all shapes static per call):

* ``q``          [T, H, D] bf16 in: queries after RoPE (stage 2).
* ``window_rows`` [T, W] int32 in: physical ``ori`` rows of each query's window (stage 3), -1 = none.
* ``cmp_rows``   [T, K] int32 in: physical rows of the compressed pool (``csa_cmp`` rows of the top-k
  entries, or every visible ``hca_cmp`` entry; :func:`dspark_kernels.pypto.entry_rows.run_entry_rows`), -1 = none.
  Absent (K = 0) on SWA layers.
* ``ori``        [Ro, D] bf16 in: the ``ori`` pool; ``cmp`` [Rc, D] bf16 in: the compressed pool.
* ``sink``       [1, H] fp32 in: per-head sink logit.
* ``cos``, ``sin`` [T, rd/2] bf16 in: the layer's RoPE table at each query's own position.
* ``o``          [T, H, D] bf16 out: attention output after inverse RoPE; rows without keys (padding) 0.

Math (one softmax over the union of window and compressed keys, K = V = the gathered latent rows):
``s = (q . k) * scale`` in fp32; online softmax over key tiles (:func:`key_blocks`: one shared tile when
every key fits, else the window's tiles, then the compressed columns'): ``m' = max(m, max s)``,
``p = exp(s - m')`` (0 on missing keys, see ``_attend``),
``l = l e^(m - m') + sum p``, ``acc = acc e^(m - m') + bf16(p) @ k``; finally
``o = acc / (l + e^(sink - m))`` (the sink is in the denominator only, never in the max), inverse RoPE on
the last rd dims at the query's position, bf16. Keys are gathered in the kernel with ``index_select``
on the pools (rows -1 are replaced by row 0 and masked out of the softmax).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_kernels.pypto._ops import MASKED_SCORE, MIN_COLUMNS
from dspark_kernels.pypto.projections import rope_heads
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto

BF16 = ml_dtypes.bfloat16
#: Start of the running maximum. Real logits are q.k * D^-0.5 with RMS-normalised q and keys (|logit| is of
#: order sqrt(D) times the kv_norm weights, ~23 at D = 512), so the floor never wins against a real key and
#: the maximum is exact; it would only matter for norm weights in the hundreds. A missing key's logit bias is
#: :data:`~dspark_kernels.pypto._ops.MASKED_SCORE`: ``e^(MASKED_SCORE - m)`` is exactly 0 for any m >= this floor.
RUNNING_MAX_FLOOR = -1e4
#: Key columns per online-softmax step. Cost model, FLASH heads, T = 32 rows, 128 window + 512 top-k keys:
#: 387k cycles with 128-key tiles (5 steps), 301k with 256 (3 steps), 258k with 512, 243k with one 640-key
#: pass (T = 128: 1.165M with 128, 0.731M with 256, 0.703M in one pass). 256 keys x 512 bf16 = 256 KB per
#: query stay within the 512 KB L1 next to q (64 KB); larger tiles rely on the cost model's view of L1, which
#: has not been checked against hardware.
DEFAULT_KEY_TILE = 256
#: Vector tiles over [T, H, n] / [T, H, D] are (1, head_tile, VEC_COLUMNS) fp32 = 32 KB with head_tile 32:
#: 301k -> 275k cycles against (1, 64, 128) at the same UB footprint (the kernel factory's other defaults:
#: cube M tile 64 = the heads of one query, K panel 512 = D in L1; 16 x 16 M tiles or 128-deep K panels
#: cost 10-40 % more).
VEC_COLUMNS = 256


Segment = tuple[str, int, int]


def key_blocks(window: int, compressed: int, tile: int) -> tuple[tuple[Segment, ...], ...]:
    """Static key tiles of at most ``tile`` columns: the window's, then the compressed columns'.

    Each tile is a tuple of segments ``(source, first column, columns)``, source "window" or "cmp". When every
    key fits one tile, window and compressed keys share it (one softmax pass); otherwise the compressed columns
    start a fresh tile (a concat per tile costs more than the extra step in pypto's cost model).
    """
    if window + compressed <= tile:
        return ((("window", 0, window),) + ((("cmp", 0, compressed),) if compressed else ()),)
    blocks = [(("window", c, min(tile, window - c)),) for c in range(0, window, tile)]
    blocks += [(("cmp", c, min(tile, compressed - c)),) for c in range(0, compressed, tile)]
    return tuple(blocks)


@lru_cache(maxsize=16)
def sparse_attention_kernel(rows: int, heads: int, dim: int, window: int, compressed: int, ori_rows: int,
                            cmp_rows_n: int, rope: int, scale: float, tile: int = DEFAULT_KEY_TILE,
                            head_tile: int = 32, cube_m: int = 64, k_l0: int = 128, k_l1: int = 512) -> Any:
    """The jit kernel for one geometry (module docstring); ``compressed == 0`` builds the SWA variant."""
    blocks = key_blocks(window, compressed, tile)
    k_cols = max(compressed, 1)
    cmp_n = max(cmp_rows_n, 1)
    tm = cube_m
    tk = min(dim, k_l0)
    tn = min(max(tile, 16), 256)  # L0B: tk * tn * 2 B <= 64 KB

    @kernel
    def sparse_attention(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            q: pypto.Tensor([rows, heads, dim], pypto.DT_BF16),
            window_rows: pypto.Tensor([rows, window], pypto.DT_INT32),
            cmp_rows: pypto.Tensor([rows, k_cols], pypto.DT_INT32),
            ori: pypto.Tensor([ori_rows, dim], pypto.DT_BF16),
            cmp: pypto.Tensor([cmp_n, dim], pypto.DT_BF16),
            sink: pypto.Tensor([1, heads], pypto.DT_FP32),
            cos: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            sin: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            o: pypto.Tensor([rows, heads, dim], pypto.DT_BF16)):
        _sizes = (rows, heads, dim, window, k_cols, ori_rows, cmp_n, rope)  # closure capture for annotations
        pypto.set_cube_tile_shapes([tm, tm], [tk, max(tk, min(k_l1, dim))], [tn, tn])
        out = _attend(q, window_rows, cmp_rows, ori, cmp, sink, blocks, scale, head_tile)             # [T, H, D]
        nope, roped = rope_heads(out, cos, sin, rows, heads, dim, rope, inverse=True)
        pypto.assemble(pypto.cast(nope, pypto.DT_BF16), [0, 0, 0], o)
        pypto.assemble(pypto.cast(roped, pypto.DT_BF16), [0, 0, dim - rope], o)

    return sparse_attention


def _attend(q: Any, window_rows: Any, cmp_rows: Any, ori: Any, cmp: Any, sink: Any,
            blocks: tuple[tuple[Segment, ...], ...], scale: float, head_tile: int) -> Any:
    """Online softmax with sink over the key tiles ``blocks``; returns fp32 [T, H, D] (traced, plain Python).

    The running maximum starts at RUNNING_MAX_FLOOR, far below any real logit but far above MASKED_SCORE, so
    a missing key's ``e^(s - m)`` is exactly 0 without a separate mask multiply, real keys see the true
    maximum, and a row without any key keeps ``l = 0`` (its output is set to 0).
    """
    rows, heads, dim = q.shape
    pypto.set_vec_tile_shapes(1, head_tile, VEC_COLUMNS)
    m = pypto.full([rows, heads, 1], RUNNING_MAX_FLOOR, pypto.DT_FP32)
    lsum = pypto.full([rows, heads, 1], 0.0, pypto.DT_FP32)
    acc = pypto.full([rows, heads, dim], 0.0, pypto.DT_FP32)
    for block in blocks:
        biases, gathered = [], []
        for source, first, cols in block:
            index_src, pool = (window_rows, ori) if source == "window" else (cmp_rows, cmp)
            pypto.set_vec_tile_shapes(16, 128)
            idx = pypto.cast(pypto.view(index_src, [rows, cols], [0, first]), pypto.DT_FP32)      # [T, n]
            present = pypto.ge(idx, 0.0)
            safe = pypto.cast(pypto.where(present, idx, 0.0), pypto.DT_INT32)
            biases.append(pypto.where(present, 0.0, MASKED_SCORE))                                  # [T, n]
            pypto.set_vec_tile_shapes(1, head_tile, VEC_COLUMNS)
            gathered.append(pypto.index_select(pool, 0, safe))                                      # [T, n, D]
        cols = sum(segment[2] for segment in block)
        pypto.set_vec_tile_shapes(16, 128)
        bias = biases[0] if len(biases) == 1 else pypto.concat(biases, 1)
        pypto.set_vec_tile_shapes(1, head_tile, VEC_COLUMNS)
        keys = gathered[0] if len(gathered) == 1 else pypto.concat(gathered, 1)
        s = pypto.mul(pypto.matmul(q, keys, pypto.DT_FP32, b_trans=True), scale)                   # [T, H, n]
        s = pypto.add(s, pypto.expand_clone(pypto.reshape(bias, [rows, 1, cols]), [rows, heads, cols]))
        m_new = pypto.maximum(m, pypto.amax(s, -1, keepdim=True))                                  # [T, H, 1]
        p = pypto.exp(pypto.sub(s, m_new))
        alpha = pypto.exp(pypto.sub(m, m_new))
        lsum = pypto.add(pypto.mul(lsum, alpha), pypto.sum(p, -1, keepdim=True))
        pv = pypto.matmul(pypto.cast(p, pypto.DT_BF16), keys, pypto.DT_FP32)                        # [T, H, D]
        acc = pypto.add(pypto.mul(acc, alpha), pv)
        m = m_new
    sink3 = pypto.expand_clone(pypto.reshape(sink, [1, heads, 1]), [rows, heads, 1])
    denom = pypto.add(lsum, pypto.exp(pypto.sub(sink3, m)))
    return pypto.where(pypto.gt(lsum, 0.0), pypto.div(acc, denom), 0.0)


def run_sparse_attention(q: np.ndarray, window_rows: np.ndarray, cmp_rows: np.ndarray | None, ori: np.ndarray,
                         cmp: np.ndarray | None, sink: np.ndarray, cos: np.ndarray, sin: np.ndarray, *,
                         scale: float, tile: int = DEFAULT_KEY_TILE, **tiles: int) -> LaunchResult:
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
    k = sparse_attention_kernel(rows, heads, dim, window, compressed, len(ori), len(cmp), 2 * cos.shape[1],
                                float(scale), tile, **tiles)
    return launch(k, [q.astype(BF16), np.asarray(window_rows, np.int32), np.asarray(cmp_rows, np.int32),
                      ori.astype(BF16), cmp.astype(BF16), np.asarray(sink, np.float32).reshape(1, heads),
                      cos.astype(BF16), sin.astype(BF16), Out((rows, heads, dim), BF16, "o")])
