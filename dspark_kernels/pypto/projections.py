"""Stage 2: q and shared-kv projections with RMSNorm and RoPE (upstream's pre-attention projections).

``query`` kernel (T = the rank's L local rows; X hidden, Q q_lora_rank, H heads, D head_dim, rd rope dims):

* ``x``          [T, X] bf16 in: attention input (after attn_norm); padding rows 0.
* ``wq_a``       [Q, X] bf16 in; ``q_norm`` [1, Q] fp32 in (bf16 values).
* ``wq_b``       [H*D, Q] int8 in; ``wq_b_scale`` [1, H*D] fp32 in (per output channel).
* ``cos``, ``sin`` [T, rd/2] bf16 in: the layer's main RoPE table at each row's position.
* ``q``          [T, H*D] bf16 out (heads concatenated; :func:`run_query` returns it as [T, H, D]);
  ``qr_q`` [T, Q] int8 out and ``qr_scale`` [T, 1] fp32 out (reused by the indexer).

Math: ``qr = rms(x @ wq_a.T, q_norm)`` (fp32 accumulation); ``(qr_q, qr_scale) = int8q(qr)``;
``q = (qr_q @ wq_b.T as int32) * qr_scale * wq_b_scale``; unweighted RMS per head; RoPE on the last rd dims
of every head (interleaved pairs); bf16.

``shared_kv`` kernel (all P group rows): ``x`` [P, X] bf16, ``wkv`` [D, X] bf16, ``kv_norm`` [1, D] fp32,
``cs`` [P, rd] bf16 in (each row's cos | sin, joined by :func:`run_shared_kv`); ``kv`` [P, D] bf16 out =
bf16(rope(rms(x @ wkv.T, kv_norm))) (:func:`run_shared_kv` returns it as [P, 1, D]). ``x @ wkv.T`` is
accumulated in fp32 per K slice and the slices' partials are added in slice order (a summation order of
its own: see KV_K_SLICES).

``linear_norm`` kernel: the shared kv kernel without RoPE (the same cube tiles, K slices and epilogue),
``out`` [P, D] bf16 = bf16(rms(x @ w.T, norm)) of ``x`` [P, X] bf16, ``w`` [D, X] bf16, ``norm`` [1, D] fp32:
the DSpark drafter's ``main_x`` (X = T*D target features, ``main_proj``, ``main_norm``). Its K is split only as
far as one wave of cube tasks allows (:func:`linear_norm_slices`: a wide D has enough output tiles unsplit).

Tiles were chosen with pypto's A2/A3 cost model (``benchmarks/bench_pypto.py``, FLASH sizes, P = 512, L = 128);
the cycles behind each choice sit next to the constants below.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np

from dspark_kernels.pypto._ops import int8_rows, rms_norm, rope_rows, tile
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto

BF16 = ml_dtypes.bfloat16
#: Cube K steps (L0A/L0B hold 64 KB: k 256 x n 128 bf16) and the K panel kept in L1 (A and B reused across the
#: K loop). History: shared kv 262k cycles with 128^3 tiles and (16, 64) vector tiles -> 187k with the 1024-deep
#: panel -> 124k with (64, 128) vector tiles and 256-deep steps; q path 1380k -> 628k with the same choices.
K_L0_CAP = 256
K_L1_CAP = 1024
#: ``x @ wq_a.T`` ([L, X] x [Q, X]^T): output tiles of 64 columns give 16 cube tasks for the 24 cube cores
#: (8 with 128: 37k cycles each, 16 with 64: 30k). pypto's L1-reuse merge is switched off for the q path
#: (``cube_l1_reuse_setting`` {-1: 1}): it put 6 of the 8 tiles of this product, which share x, into one
#: task of 203k cycles on one core (628k -> 466k for the whole kernel).
WQ_A_COLUMNS = 64
#: ``qr_q @ wq_b.T`` (int8, [L, Q] x [H*D, Q]^T): 256-column output tiles (L0B: k 256 x n 256 int8 = 64 KB):
#: 128 tasks of 11.6k cycles instead of 256 of 8.1k (369k -> 312k).
WQ_B_TILES = ([128, 128], [256, 1024], [256, 256])
#: Vector tiles of the [rows, Q] (q path) and [rows, D] (shared kv) stages hold whole rows: the RMS and int8
#: reductions then run in one tile (with (64, 128) tiles each row's sum went through pair-sum tasks:
#: q path 466k -> 369k, shared kv 124k -> 72k with the 2-D epilogue below). At most this many fp32 elements
#: (64 KB of the 192 KB UB).
ROW_TILE_ELEMENTS = 16384
#: Shared kv, ``x @ wkv.T`` ([P, X] x [D, X]^T), in pypto's cost model: a cube task copies its K panels from
#: global memory at ~96 B/cycle plus ~1.4k cycles per copy, one copy after another, and the scheduler spends
#: a few hundred cycles on every task it issues and retires. 128 x 128 output tiles over all of X: 16 tasks
#: of 37k cycles (2 MB each; 72.0k in all). Split over K into KV_K_SLICES slices of whole K steps (FLASH:
#: 1280, 1408, 1408, added in the epilogue) with 128 x KV_COLUMNS output tiles: 24 tasks, one per cube core,
#: of 21k-23k (1 MB each): 67.5k. Tried: 2 slices, 16 tasks of 32k (75.0k); 256 x 128 tiles (68.6k); more
#: than 24 tasks run in two rounds (108k-123k, and 110.9k for 6 slices of 128 x 128 tiles).
KV_K_SLICES = 3
#: Cube cores of A2/A3 (``cube_core_cnt`` of pypto's ``A2A3.ini``): one wave of cube tasks.
CUBE_CORES = 24
#: Output tile columns (L0B k 128 x n 256 bf16 = 64 KB, L0C 128 x 256 fp32 = 128 KB) and the K step.
KV_COLUMNS = 256
KV_K_L0 = 128
#: K steps per L1 panel: (128 + 256) x 640 x 2 B = 480 KB of the 512 KB L1, 4 copies per 1280-deep slice
#: (512-deep panels: 6 copies, 68.1k vs 67.5k).
KV_K_L1_STEPS = 5
#: Shared kv epilogue: each tile of 16 whole rows is one task (``sg_set_scope`` ids from KV_SCOPE on) that
#: sums the slices' partials, then RMS, RoPE, bf16 and both stores (67.5k -> 65.2k; the RoPE index tables
#: join these tasks instead of two of their own). The partials sit side by side in one [P, slices * D]
#: buffer, so a tile's partials are one copy instead of three (65.2k -> 61.7k). A tile holds at most this many
#: fp32 elements (96 KB of the 192 KB UB; 32 rows do not fit); 16 tasks of two 16-row tiles: 69.2k, 20-row
#: tiles 66.4k, 8-row tiles (64 tasks) 71.6k.
KV_TILE_ELEMENTS = 24576
KV_SCOPE = 1
#: Rows of a q-path epilogue tile over one head ([rows, D], 64 KB fp32 at D = 512; 16 rows: 238k). The epilogue
#: (dequant, per-head RMS, RoPE, bf16) runs per head on [L, D] views of the int32 product: each head waits only
#: for its own two output tiles, so it overlaps ``qr_q @ wq_b.T`` (a [L, H, D] reshape put a barrier after the
#: whole product: 306k -> 231k).
VEC_ROWS = 32


def _row_tile(rows: int, cols: int, elements: int = ROW_TILE_ELEMENTS) -> tuple[int, int]:
    """A vector tile of whole rows: as many rows (a power of two, <= rows) as ``elements`` allows."""
    r = 1
    while r * 2 <= rows and r * 2 * cols <= elements:
        r *= 2
    return r, cols


def _no_l1_merge() -> None:
    pypto.set_pass_options(cube_l1_reuse_setting={-1: 1})


@lru_cache(maxsize=16)
def query_kernel(rows: int, hidden: int, q_rank: int, heads: int, dim: int, rope: int, eps: float) -> Any:
    """The q-path jit kernel for one geometry."""
    tm, tk = tile(rows, 128), tile(max(hidden, q_rank), K_L0_CAP)
    tk_l1 = tile(max(hidden, q_rank), K_L1_CAP)
    tn = tile(q_rank, WQ_A_COLUMNS)
    vec_rows, vec_cols = _row_tile(rows, q_rank)

    @kernel
    def query(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            x: pypto.Tensor([rows, hidden], pypto.DT_BF16),
            wq_a: pypto.Tensor([q_rank, hidden], pypto.DT_BF16),
            q_norm: pypto.Tensor([1, q_rank], pypto.DT_FP32),
            wq_b: pypto.Tensor([heads * dim, q_rank], pypto.DT_INT8),
            wq_b_scale: pypto.Tensor([1, heads * dim], pypto.DT_FP32),
            cos: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            sin: pypto.Tensor([rows, rope // 2], pypto.DT_BF16),
            q: pypto.Tensor([rows, heads * dim], pypto.DT_BF16),
            qr_q: pypto.Tensor([rows, q_rank], pypto.DT_INT8),
            qr_scale: pypto.Tensor([rows, 1], pypto.DT_FP32)):
        _sizes = (rows, hidden, q_rank, heads, dim, rope)  # closure capture: the annotations read these
        _no_l1_merge()
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk_l1], [tn, tn])
        pypto.set_vec_tile_shapes(vec_rows, vec_cols)
        qr = rms_norm(pypto.matmul(x, wq_a, pypto.DT_FP32, b_trans=True), q_norm, eps)     # [T, Q]
        qr_i8, qr_dq = int8_rows(qr)
        pypto.set_cube_tile_shapes(*WQ_B_TILES)
        wide = pypto.matmul(qr_i8, wq_b, pypto.DT_INT32, b_trans=True)                     # [T, H*D] int32
        _query_heads(wide, qr_dq, wq_b_scale, cos, sin, q, heads, eps)
        # storing into an output hands the tensor over, so outputs are written after their last use
        qr_q[:] = qr_i8
        qr_scale[:] = qr_dq

    return query


def _query_heads(wide: Any, qr_dq: Any, wq_b_scale: Any, cos: Any, sin: Any, q: Any, heads: int, eps: float) -> None:
    """Dequant, per-head RMS and RoPE of ``wide`` [T, H*D] int32 into ``q`` [T, H*D], one head at a time
    (traced, plain Python: a loop over heads in the kernel body would be re-parsed)."""
    rows, dim = wide.shape[0], wide.shape[1] // heads
    pypto.set_vec_tile_shapes(min(rows, VEC_ROWS), dim)
    for h in range(heads):
        head = pypto.cast(pypto.view(wide, [rows, dim], [0, h * dim]), pypto.DT_FP32)
        head = rms_norm(pypto.mul(pypto.mul(head, qr_dq), pypto.view(wq_b_scale, [1, dim], [0, h * dim])), None, eps)
        _store_roped(head, cos, sin, q, h * dim)


def _store_roped(v: Any, cos: Any, sin: Any, out: Any, column: int) -> None:
    """bf16 of ``v`` [rows, D] fp32 with RoPE on its last rd dims, stored at ``out[:, column:column + D]``."""
    rows, dim = v.shape
    rope = 2 * cos.shape[1]
    tail = rope_rows(pypto.view(v, [rows, rope], [0, dim - rope]), cos, sin)
    pypto.assemble(pypto.cast(pypto.view(v, [rows, dim - rope], [0, 0]), pypto.DT_BF16), [0, column], out)
    pypto.assemble(pypto.cast(tail, pypto.DT_BF16), [0, column + dim - rope], out)


def _k_slices(hidden: int, step: int, parts: int) -> list[int]:
    """K slice widths for a product split over K: whole ``step``s as even as possible (smaller slices first)."""
    steps = -(-hidden // step)
    parts = min(parts, steps)
    widths = [(steps // parts + (i >= parts - steps % parts)) * step for i in range(parts)]
    widths[-1] -= sum(widths) - hidden  # a partial last step
    return widths


@lru_cache(maxsize=16)
def shared_kv_kernel(rows: int, hidden: int, dim: int, rope: int, eps: float) -> Any:
    """The kv-path jit kernel for one geometry (``cs`` [P, rd] bf16: each row's cos | sin)."""
    tm, tk, tn, widths, tk_l1, vec_rows = _linear_norm_tiles(rows, hidden, dim, KV_K_SLICES)

    @kernel
    def shared_kv(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            x: pypto.Tensor([rows, hidden], pypto.DT_BF16),
            wkv: pypto.Tensor([dim, hidden], pypto.DT_BF16),
            kv_norm: pypto.Tensor([1, dim], pypto.DT_FP32),
            cs: pypto.Tensor([rows, rope], pypto.DT_BF16),
            kv: pypto.Tensor([rows, dim], pypto.DT_BF16)):
        _sizes = (rows, hidden, dim, rope)  # closure capture: the annotations read these
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk_l1], [tn, tn])
        partials = _k_partials(x, wkv, widths)
        _kv_rows(partials, len(widths), kv_norm, cs, kv, vec_rows, eps)

    return shared_kv


def linear_norm_slices(rows: int, hidden: int, dim: int) -> int:
    """K slices of the linear + norm kernel: as many (up to :data:`KV_K_SLICES`) as keep the output tiles times
    the slices within one wave of :data:`CUBE_CORES` cube tasks (a wide D has enough output tiles alone)."""
    tiles = -(-rows // tile(rows, 128)) * -(-dim // tile(dim, KV_COLUMNS))
    return max(1, min(KV_K_SLICES, CUBE_CORES // tiles))


@lru_cache(maxsize=16)
def linear_norm_kernel(rows: int, hidden: int, dim: int, eps: float, slices: int) -> Any:
    """The shared kv kernel without RoPE, for one geometry: ``out`` [P, D] bf16 = bf16(rms(x @ w.T, norm)) of
    ``x`` [P, X] bf16, ``w`` [D, X] bf16, ``norm`` [1, D] fp32 (the drafter's ``main_x``: X = T*D)."""
    tm, tk, tn, widths, tk_l1, vec_rows = _linear_norm_tiles(rows, hidden, dim, slices)

    @kernel
    def linear_norm(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
            x: pypto.Tensor([rows, hidden], pypto.DT_BF16),
            w: pypto.Tensor([dim, hidden], pypto.DT_BF16),
            norm: pypto.Tensor([1, dim], pypto.DT_FP32),
            out: pypto.Tensor([rows, dim], pypto.DT_BF16)):
        _sizes = (rows, hidden, dim)  # closure capture: the annotations read these
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk_l1], [tn, tn])
        partials = _k_partials(x, w, widths)
        _kv_rows(partials, len(widths), norm, None, out, vec_rows, eps)

    return linear_norm


def _linear_norm_tiles(rows: int, hidden: int, dim: int, slices: int
                       ) -> tuple[int, int, int, list[int], int, int]:
    """(cube tiles m, k, n, the K slices' widths, the L1 panel depth, the epilogue's rows per tile) of the shared
    kv and linear + norm kernels."""
    tk = tile(hidden, KV_K_L0)
    widths = _k_slices(hidden, tk, slices)
    tk_l1 = tk * max(1, min(KV_K_L1_STEPS, min(widths) // tk))
    return (tile(rows, 128), tk, tile(dim, KV_COLUMNS), widths, tk_l1,
            _row_tile(rows, len(widths) * dim, KV_TILE_ELEMENTS)[0])


def _k_partials(x: Any, wkv: Any, widths: list[int]) -> Any:
    """``x @ wkv.T`` of each K slice (fp32), side by side: [P, slices * D] (traced, plain Python)."""
    rows, dim = x.shape[0], wkv.shape[0]
    if len(widths) == 1:
        return pypto.matmul(x, wkv, pypto.DT_FP32, b_trans=True)
    partials = pypto.tensor([rows, len(widths) * dim], pypto.DT_FP32, "kv_partials")
    k0 = 0
    for i, width in enumerate(widths):
        part = pypto.matmul(pypto.view(x, [rows, width], [0, k0]), pypto.view(wkv, [dim, width], [0, k0]),
                            pypto.DT_FP32, b_trans=True)
        pypto.assemble(part, [0, i * dim], partials)
        k0 += width
    return partials


def _kv_rows(partials: Any, slices: int, kv_norm: Any, cs: Any | None, kv: Any, vec_rows: int, eps: float) -> None:
    """Per tile of ``vec_rows`` rows, one task: the sum of the K slices' partials (fp32, in slice order),
    weighted RMS, RoPE (none when ``cs`` is None), bf16 into ``kv`` (traced, plain Python)."""
    rows, dim = kv.shape
    for g, r0 in enumerate(range(0, rows, vec_rows)):
        n = min(vec_rows, rows - r0)
        pypto.set_pass_options(sg_set_scope=KV_SCOPE + g)
        pypto.set_vec_tile_shapes(vec_rows, slices * dim)
        # one copy of the tile's partials (a view per slice would be a copy each); the + 0 makes it a tile
        block = pypto.add(pypto.view(partials, [n, slices * dim], [r0, 0]), 0.0)
        pypto.set_vec_tile_shapes(vec_rows, dim)
        v = pypto.view(block, [n, dim], [0, 0])
        for i in range(1, slices):
            v = pypto.add(v, pypto.view(block, [n, dim], [0, i * dim]))
        v = rms_norm(v, kv_norm, eps)
        if cs is None:
            pypto.assemble(pypto.cast(v, pypto.DT_BF16), [r0, 0], kv)
            continue
        rope = cs.shape[1]
        pypto.set_vec_tile_shapes(vec_rows, rope)
        c = pypto.cast(pypto.view(cs, [n, rope], [r0, 0]), pypto.DT_FP32)  # one copy of cos | sin
        pypto.set_vec_tile_shapes(vec_rows, dim)
        tail = rope_rows(pypto.view(v, [n, rope], [0, dim - rope]), pypto.view(c, [n, rope // 2], [0, 0]),
                         pypto.view(c, [n, rope // 2], [0, rope // 2]))
        pypto.assemble(pypto.cast(pypto.view(v, [n, dim - rope], [0, 0]), pypto.DT_BF16), [r0, 0], kv)
        pypto.assemble(pypto.cast(tail, pypto.DT_BF16), [r0, dim - rope], kv)
    pypto.set_pass_options(sg_set_scope=-1)


def run_query(x: np.ndarray, wq_a: np.ndarray, q_norm: np.ndarray, wq_b_q: np.ndarray, wq_b_scale: np.ndarray,
              cos: np.ndarray, sin: np.ndarray, heads: int, eps: float) -> LaunchResult:
    """q path on numpy arrays (float inputs holding bf16 / int8 values); ``values[-3:]`` = q [T, H, D], qr_q,
    qr_scale."""
    rows, hidden = x.shape
    q_rank = wq_a.shape[0]
    dim = wq_b_q.shape[0] // heads
    rope = 2 * cos.shape[1]
    k = query_kernel(rows, hidden, q_rank, heads, dim, rope, float(eps))
    result = launch(k, [x.astype(BF16), wq_a.astype(BF16), np.asarray(q_norm, np.float32).reshape(1, -1),
                        wq_b_q.astype(np.int8), np.asarray(wq_b_scale, np.float32).reshape(1, -1),
                        cos.astype(BF16), sin.astype(BF16), Out((rows, heads * dim), BF16, "q"),
                        Out((rows, q_rank), np.int8, "qr_q"), Out((rows, 1), np.float32, "qr_scale")])
    q, qr_q, qr_scale = result.values[-3:]
    return LaunchResult((*result.values[:-3], q.reshape(rows, heads, dim), qr_q, qr_scale), result.cycles)


def run_shared_kv(x: np.ndarray, wkv: np.ndarray, kv_norm: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                  eps: float) -> LaunchResult:
    """kv path on numpy arrays; ``values[-1]`` = kv [P, 1, D] bf16."""
    rows, hidden = x.shape
    dim = wkv.shape[0]
    k = shared_kv_kernel(rows, hidden, dim, 2 * cos.shape[1], float(eps))
    cs = np.concatenate([cos, sin], axis=1).astype(BF16)  # [P, rd]: one copy per epilogue tile
    result = launch(k, [x.astype(BF16), wkv.astype(BF16), np.asarray(kv_norm, np.float32).reshape(1, -1), cs,
                        Out((rows, dim), BF16, "kv")])
    return LaunchResult((*result.values[:-1], result.values[-1].reshape(rows, 1, dim)), result.cycles)


def run_linear_norm(x: np.ndarray, w: np.ndarray, norm: np.ndarray, eps: float) -> LaunchResult:
    """Linear + RMSNorm on numpy arrays (x [P, X], w [D, X] bf16-valued; norm [D]); ``values[-1]`` = [P, D] bf16."""
    rows, hidden = x.shape
    dim = w.shape[0]
    k = linear_norm_kernel(rows, hidden, dim, float(eps), linear_norm_slices(rows, hidden, dim))
    return launch(k, [x.astype(BF16), w.astype(BF16), np.asarray(norm, np.float32).reshape(1, -1),
                      Out((rows, dim), BF16, "out")])
