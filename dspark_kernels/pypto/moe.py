"""The MoE FFN on A2/A3: gate (deferred ffn RMSNorm, sqrtsoftplus, top-k or hash routing, W8A8 activations),
routed experts grouped by expert, shared expert, combine (upstream's ``gate``, ``expert_routed``,
``expert_shared`` and ``combine``, hw-native-sys/pypto-lib commit 634e77b, ``models/deepseek_v4_flash_dspark/``).

Mirrors :func:`dspark_kernels.reference.moe.moe` with ``precision="a2a3"`` op for op (the numerics are stated
there). T = the live rows (the host drops padding rows and returns zeros for them), D hidden, E experts
(padded to Ep, a multiple of 8), K slots (padded to Kp, a multiple of 8 columns), I the expert width, SI the shared
expert's width, U the experts the batch uses. Three kernels per layer: the gate, the routed experts (one call per
at most :data:`MAX_TILES_PER_CALL` tiles) and the shared expert + combine:

``gate`` kernel:

* ``x`` [T, D] bf16 in: hc_pre's ``x_mixed`` rows (with ``norm``), else rows already normalised.
* ``norm`` [1, D] fp32 in: bf16(``ffn_norm``) (all ones and unused without a norm).
* ``gate_w`` [Ep, D] fp32 in, pad rows 0; ``bias`` [1, Ep] fp32 in: ``gate_bias``, pad columns
  :data:`~dspark_kernels.pypto._ops.MASKED_SCORE` (never chosen); 0 on hash layers.
* hash layers only: ``tid2eid`` [V, Kp] int32 in (pad columns 0) and ``token_ids`` [T] int32 in.
* ``x_q`` [T, D] int8 out and ``x_scale`` [T, 1] fp32 out: the rows' W8A8 activations (inv_rms folded into the
  scale); ``ids`` [T, Kp] int32 out (pad columns -1) and ``weights`` [T, Kp] fp32 out (pad columns 0).

Top-k runs as K rounds of "first maximum" (``amax``, then the lowest expert id holding it, then that column
masked): ties go to the lower expert id exactly as the reference's stable sort, independent of ``pypto.topk``'s
tie order.

Between the calls the host groups the (row, slot) pairs by expert (:class:`~dspark_kernels.model.experts.ExpertGroups`:
metadata, a stable counting sort of ``ids``), pads each expert's rows to whole tiles of :data:`PAIR_TILE` and
quantises the U experts used (:func:`~dspark_kernels.model.experts.expert_int8`). The expert count per tile is
data the grouping produces, so the gate and the experts cannot be one call in pypto 0.2.0 (static shapes per
call; on an NPU the tile count would be a dynamic dim read from the counts, upstream's ``recv_expert_count``).

``routed`` kernel (NT tiles of TR = :data:`PAIR_TILE` pair rows: all the tiles, or one call's share of them):

* ``x_q`` [T, D] int8, ``x_scale`` [T, 1] fp32 in (the gate's).
* ``pair_rows`` [NT*TR] int32 in: the row of each padded pair slot (pad 0); ``pair_w`` [NT*TR, 1] fp32 in: its
  routing weight (pad 0, so a pad slot computes zeros); ``tile_expert`` [NT] int32 in: each tile's expert, an
  index into the stacks below.
* ``w1``, ``w3`` [U*I, D] int8 and ``w1_scale``, ``w3_scale`` [U, I] fp32 in; ``w2`` [U*D, I] int8 and
  ``w2_scale`` [U, D] fp32 in (the used experts stacked, per-output-channel scales).
* ``pairs`` [NT*TR, D] bf16 out: each padded pair slot's weighted expert output (upstream's ``recv_y``; pad 0).

``combine`` kernel (the host concatenates the routed calls' ``pairs``: NP = all the tiles' pair slots):

* ``x_q``, ``x_scale`` in as above.
* ``s1``, ``s3`` [SI, D] int8, ``s1_scale``, ``s3_scale`` [1, SI] fp32; ``s2`` [D, SI] int8, ``s2_scale`` [1, D]
  fp32 in: the shared expert (absent when the layer has none).
* ``pairs`` [NP, D] bf16 in; ``slot_pos`` [K*T] int32 in: the padded slot of pair (t, k) at ``k*T + t``.
* ``out`` [T, D] bf16 out: ``bf16(shared + pairs[slot_pos[0]] + pairs[slot_pos[1]] + ...)``.

The per-tile loop reads each tile's expert from ``tile_expert`` and views that expert's rows of the stacks at
that offset (a runtime view offset), gathers its pair rows with ``index_select`` and writes its bf16 outputs
into ``pairs``, which the combine gathers back per slot. ``pairs`` is a kernel output because gathering from a
kernel-internal ``pypto.tensor`` buffer ends the 0.2.0 compiler with SIGSEGV. Importing this module imports
neither torch nor pypto: the kernels are built in the process that runs them (``run`` below).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar

import attrs
import ml_dtypes
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_kernels.model.block_weights import MoEWeights
from dspark_kernels.model.experts import ExpertGroups, check_expert_ids, expert_int8, linear_int8
from dspark_kernels.model.numerics import bf16_round

T = TypeVar("T")
BF16 = ml_dtypes.bfloat16
#: Pair rows per expert tile: the cube's 16-row fractal. Each expert's pairs are padded to whole tiles.
PAIR_TILE = 16
#: Expert tiles per routed-experts call. At FLASH sizes (D = 4096, I = 2048) the cost model's device simulation
#: of 242 tiles in one call (L = 128 rows) fails its workspace allocation (F74001 "Slab alloc null") and never
#: returns; 128 tiles ran (16.1M cycles), so longer lists run as several calls.
MAX_TILES_PER_CALL = 128
#: Vector tile (rows, columns) of the experts kernels (the gate's are below).
VEC_ROWS, VEC_COLS = 16, 128
#: Cube tile caps: M rows, K depth and N columns. L0A / L0B hold 64 KB each: an int8 [256, 128] B tile is 32 KB,
#: an fp32 one (the gate's weights) 128 KB, so the K depth shrinks with the operand width (:func:`_cube`).
CUBE_M, CUBE_K, CUBE_N = 128, 256, 128
L0_BYTES = 64 * 1024
#: A2/A3's L1 (512 KB) and cube cores per die (``A2A3.ini``; the cost model: 24 AIC, 48 AIV).
L1_BYTES = 512 * 1024
CUBE_CORES = 24
#: K panel of the expert products kept in L1 (A and B panels together within :data:`L1_BYTES`, single-buffered).
#: The cost model charges each copy into a core's buffer ~1.4k cycles, so a 256-deep panel (one copy per K step)
#: priced the FLASH experts (D = 4096, I = 2048; cycles of the routed calls + combine, L = 16 / L = 128):
#: 9,381,132 / 29,841,516 -> 1024-deep 4,576,068 at L = 16 -> 2048-deep 3,999,813 / 12,580,159; 4096-deep
#: panels spill L1 (17,342,099 at L = 16). At 2048 deep: 64-column N tiles 6,235,599, 256-column 11,696,681;
#: 512-deep L0 steps 3,955,478 / 12,449,201 (1 %: not taken), 128-deep 4,030,970. Also tried: every tile of a
#: routed call in flight (``stitched_kernel``): 3,914,895 / 12,401,701 (1.4 %: not taken); pypto's L1-reuse
#: merge off: no change. Exact either way: int8 products accumulate in int32.
EXPERT_K_PANEL = 2048
# The gate's tiles were chosen with pypto's cost model (benchmarks/bench_pypto.py --stages moe_gate, FLASH:
# D = 4096, Ep = 256, top-6; roofline 7.5k cycles), L = 128 / L = 16: 415,657 / 457,873 cycles with (16, 128)
# vector tiles everywhere and (128, 128, 128) cube tiles -> 259k at L = 128 with whole 4-row tiles before the
# matmul (was 256 + 215 + 41 tasks) -> 233k with whole [16, Ep] score tiles -> 102k with cube tiles of
# (32, 256 deep over a 1024-deep L1 panel, 64) and [4, Ep] score tiles -> 90.6k with relu -> 88.9k without the
# arange task -> 87.2k with 48-column N tiles -> 87.1k with in-task column indices; L = 16: 61.0k. The model
# charges each copy into a core's buffer ~1.4k cycles plus ~95 B/cycle, so a gate cube task costs about its
# operand bytes ((tm + tn) * D * 4)
# and the span is one wave of at most CUBE_CORES tasks: (128, 128) tiles were 2 tasks of 137k, (64, 64) 8 of
# 36k, (32, 64) 16 of 30k, (32, 48) 24 of 27k; (32, 32) with a 2048-deep panel is 32 tasks (two waves, 101k in
# all), and panels beyond L1 spill (214k). What remains is mostly fixed: ~9.4k to start the kernel, ~6k to end
# it, ~3-5k per hand-over between the vector, cube and vector stages, and the scheduler's ~200 cycles per task
# started. Tried and slower: merging vector tasks (vec_nbuffer_setting: no change or worse), cube merging (2:
# 179k at 150k), cube_l1_reuse_setting (2: no gain), 2-row pre tiles (no spill, but 64 tasks: 96.9k at 93.5k),
# [2, Ep] or [8, Ep] score tiles (129k / 95k at 88.9k; [8, Ep] 94.4k at 87.1k: the products regroup into an
# extra vector stage), bias and host column indices copied as one [2, Ep] tile (a task of its own: 91.8k at
# 87.2k).
#: fp32 elements of a gate vector tile before the matmul: whole rows (the RMS and int8 reductions run in one task),
#: 4 rows at D = 4096 (8 rows overflow the 192 KB UB).
GATE_ROW_ELEMENTS = 16384
#: Rows of a score / top-k tile (whole Ep rows): at L = 128, (16, 256) 29k cycles per task, (8, 256) 18k, (4, 256)
#: 12.7k (32 tasks, one wave on the 48 vector cores), (2, 256) two waves.
GATE_SCORE_ROWS = 4
#: Largest M tile of the gate's cube (a row block's x rows are copied once per N tile, the weights once per M tile).
GATE_M = 32


def _padded(n: int) -> int:
    """Expert and slot columns padded to a multiple of ``MIN_COLUMNS`` (int32 / fp32 rows of >= 32 bytes)."""
    from dspark_kernels.pypto._ops import MIN_COLUMNS

    return -(-n // MIN_COLUMNS) * MIN_COLUMNS


def _direct(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- traced helpers
def _pypto() -> Any:
    from dspark_kernels.pypto.runtime import pypto

    return pypto


def _cube(m: int, k: int, n: int, operand_bytes: int = 1) -> None:
    """Cube tiles of an [m, k] x [n, k]^T product whose operands take ``operand_bytes`` per element: both
    operand tiles fit L0A / L0B (an fp32 [256, 128] tile, 128 KB, fails to compile at FLASH's hidden size), and
    both K panels (:data:`EXPERT_K_PANEL` deep at most) fit L1."""
    from dspark_kernels.pypto._ops import tile

    tm, tn = tile(m, CUBE_M), tile(n, CUBE_N)
    tk = tile(k, min(CUBE_K, L0_BYTES // (max(tm, tn) * operand_bytes)))
    panel = max(tk, tile(k, min(EXPERT_K_PANEL, L1_BYTES // ((tm + tn) * operand_bytes))))
    _pypto().set_cube_tile_shapes([tm, tm], [tk, panel], [tn, tn])


def _pow2_floor(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def _gate_cube(rows: int, hidden: int, experts: int) -> None:
    """Cube tiles of the gate's fp32 [T, D] x [Ep, D]^T product (module constants above: :data:`GATE_M`)."""
    from dspark_kernels.pypto._ops import tile

    tm = tile(rows, GATE_M)
    m_tiles = -(-rows // tm)
    tn = 16
    while m_tiles * -(-experts // tn) > CUBE_CORES and tn < experts:
        tn += 16
    tk = tile(hidden, L0_BYTES // (max(tm, tn) * 4))
    panel = tk
    while panel * 2 <= hidden and (tm + tn) * panel * 2 * 4 <= L1_BYTES:
        panel *= 2
    _pypto().set_cube_tile_shapes([tm, tm], [tk, panel], [tn, tn])


def _first_max_rounds(biased: Any, scores: Any, iota: Any, slots: int) -> tuple[list[Any], list[Any]]:
    """K rounds of (lowest expert id holding the row's maximum, its unbiased score), that expert then masked."""
    from dspark_kernels.pypto._ops import MASKED_SCORE

    pypto = _pypto()
    experts = float(iota.shape[1])
    ids, vals = [], []
    for _ in range(slots):
        top = pypto.amax(biased, -1, keepdim=True)                                          # [T, 1]
        idx = pypto.amin(pypto.where(pypto.eq(biased, top), iota, experts), -1, keepdim=True)
        pick = pypto.eq(iota, idx)                                                          # [T, Ep]
        ids.append(idx)
        vals.append(pypto.sum(pypto.where(pick, scores, 0.0), -1, keepdim=True))
        biased = pypto.where(pick, MASKED_SCORE, biased)
    return ids, vals


def _hash_rounds(chosen: Any, scores: Any, iota: Any, slots: int) -> tuple[list[Any], list[Any]]:
    """(expert id, its score) of each slot of the rows' ``tid2eid`` rows ``chosen`` [T, Kp] int32."""
    pypto = _pypto()
    rows = chosen.shape[0]
    ids, vals = [], []
    for k in range(slots):
        idx = pypto.cast(pypto.view(chosen, [rows, 1], [0, k]), pypto.DT_FP32)             # [T, 1]
        ids.append(idx)
        vals.append(pypto.sum(pypto.where(pypto.eq(iota, idx), scores, 0.0), -1, keepdim=True))
    return ids, vals


def _route_weights(vals: list[Any], renormalise: bool, scale: float) -> list[Any]:
    """``v / (v_0 + v_1 + ...) * scale`` (sum in slot order) or ``v * scale``, per slot.

    (A plain helper: the kernel parser evaluates a list comprehension without the module's names.)
    """
    pypto = _pypto()
    if renormalise:
        total = vals[0]
        for v in vals[1:]:
            total = pypto.add(total, v)
        vals = [pypto.div(v, total) for v in vals]
    return [pypto.mul(v, scale) for v in vals]


def _columns(parts: list[Any], iota: Any, pad: float) -> Any:
    """[T, width] fp32 whose column k is ``parts[k]`` [T, 1], ``pad`` beyond them; ``iota`` [T, width] fp32:
    column indices."""
    pypto = _pypto()
    rows, width = iota.shape
    col = iota
    out = pypto.full([rows, width], pad, pypto.DT_FP32)
    for k, part in enumerate(parts):
        out = pypto.where(pypto.eq(col, float(k)), pypto.expand_clone(part, [rows, width]), out)
    return out


def _w8a8(x_q: Any, x_scale: Any, w_q: Any, w_scale: Any) -> Any:
    """``(x_q @ w_q.T in int32) * x_scale (per row) * w_scale (per column)``: fp32."""
    pypto = _pypto()
    _cube(x_q.shape[0], x_q.shape[1], w_q.shape[0])
    acc = pypto.cast(pypto.matmul(x_q, w_q, pypto.DT_INT32, b_trans=True), pypto.DT_FP32)
    return pypto.mul(pypto.mul(acc, x_scale), w_scale)


def _swiglu(gate: Any, up: Any, limit: float) -> Any:
    """``gate * (1 / (1 + exp(-gate))) * up`` after the clamp (``limit`` 0: none)."""
    pypto = _pypto()
    if limit > 0:
        gate = pypto.minimum(gate, pypto.full(gate.shape, limit, pypto.DT_FP32))
        up = pypto.maximum(pypto.minimum(up, pypto.full(up.shape, limit, pypto.DT_FP32)),
                           pypto.full(up.shape, -limit, pypto.DT_FP32))
    sig = pypto.div(pypto.full(gate.shape, 1.0, pypto.DT_FP32), pypto.add(pypto.exp(pypto.neg(gate)), 1.0))
    return pypto.mul(pypto.mul(gate, sig), up)


def _down(h: Any, row_w: Any, w_q: Any, w_scale: Any) -> Any:
    """w2: h re-quantised per row, ``(h_q @ w_q.T in int32) * (h_scale * row_w) * w_scale``: fp32."""
    from dspark_kernels.pypto._ops import int8_rows

    pypto = _pypto()
    h_q, h_scale = int8_rows(h)
    row = h_scale if row_w is None else pypto.mul(h_scale, row_w)
    _cube(h_q.shape[0], h_q.shape[1], w_q.shape[0])
    acc = pypto.cast(pypto.matmul(h_q, w_q, pypto.DT_INT32, b_trans=True), pypto.DT_FP32)
    return pypto.mul(pypto.mul(acc, row), w_scale)


# ---------------------------------------------------------------------------------------------- kernels
@lru_cache(maxsize=16)
def gate_kernel(rows: int, hidden: int, experts: int, slots: int, vocab: int, normed: bool, eps: float,
                route_scale: float, renormalise: bool) -> Any:
    """The gate jit kernel for one geometry; ``vocab`` 0 = a learned-gate layer, else the hash table's rows."""
    from dspark_kernels.pypto._ops import int8_rows
    from dspark_kernels.pypto.runtime import kernel, pypto

    ep, kp = _padded(experts), _padded(slots)
    hashed = vocab > 0
    table_rows = max(vocab, 1)
    pre_rows = _pow2_floor(min(rows, max(1, GATE_ROW_ELEMENTS // hidden)))

    @kernel
    def gate(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
             x: pypto.Tensor([rows, hidden], pypto.DT_BF16), norm: pypto.Tensor([1, hidden], pypto.DT_FP32),
             gate_w: pypto.Tensor([ep, hidden], pypto.DT_FP32), bias: pypto.Tensor([1, ep], pypto.DT_FP32),
             tid2eid: pypto.Tensor([table_rows, kp], pypto.DT_INT32),
             token_ids: pypto.Tensor([rows], pypto.DT_INT32),
             x_q: pypto.Tensor([rows, hidden], pypto.DT_INT8), x_scale: pypto.Tensor([rows, 1], pypto.DT_FP32),
             ids: pypto.Tensor([rows, kp], pypto.DT_INT32), weights: pypto.Tensor([rows, kp], pypto.DT_FP32)):
        _sizes = (rows, hidden, ep, kp, table_rows)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(pre_rows, hidden)  # whole rows: each row's reductions in one task
        xf = pypto.cast(x, pypto.DT_FP32)
        if normed:  # deferred RMSNorm: xg = x * norm, inv_rms rides the logits and the int8 scale
            ssq = pypto.sum(pypto.mul(xf, xf), -1, keepdim=True)                               # [T, 1]
            inv = pypto.div(pypto.full(ssq.shape, 1.0, pypto.DT_FP32),
                            pypto.sqrt(pypto.add(pypto.mul(ssq, 1.0 / hidden), eps)))
            xg = pypto.mul(xf, norm)
        else:
            xg = xf
        q8, dq = int8_rows(xg)
        _gate_cube(rows, hidden, ep)
        logits = pypto.matmul(xg, gate_w, pypto.DT_FP32, b_trans=True)                        # [T, Ep]
        pypto.set_vec_tile_shapes(min(rows, GATE_SCORE_ROWS), ep)  # whole rows: the top-k rounds in one task
        if normed:
            logits = pypto.mul(logits, inv)
            dq = pypto.mul(dq, inv)
        x_q[:] = q8
        x_scale[:] = dq
        # relu, not maximum(logits, 0): the model prices that binary maximum at ~5k cycles per tile (12.7k -> 9.4k
        # per score task)
        softplus = pypto.add(pypto.relu(logits),
                             pypto.log1p(pypto.exp(pypto.neg(pypto.abs(logits)))))
        scores = pypto.sqrt(softplus)
        # column indices j = cumsum(1) - 1 (exact: integers below 2**24) inside each score task: an arange is a task
        # of its own with one dependency per score task (90.6k cycles), indices from the host one more copy per
        # score task (88.9k, 87.2k with today's cube tiles), this 87.1k
        iota = pypto.sub(pypto.cumsum(pypto.full([rows, ep], 1.0, pypto.DT_FP32), -1), 1.0)
        if hashed:
            picked, vals = _hash_rounds(pypto.index_select(tid2eid, 0, token_ids), scores, iota, slots)
        else:
            picked, vals = _first_max_rounds(pypto.add(scores, bias), scores, iota, slots)
        col = pypto.view(iota, [rows, kp], [0, 0])  # one iota for both outputs (each used to copy its own)
        ids[:] = pypto.cast(_columns(picked, col, -1.0), pypto.DT_INT32)
        weights[:] = _columns(_route_weights(vals, renormalise, route_scale), col, 0.0)

    return gate


@lru_cache(maxsize=16)
def routed_kernel(rows: int, hidden: int, inter: int, used: int, tiles: int, limit: float) -> Any:
    """The routed experts jit kernel for one geometry: ``tiles`` expert tiles into their ``pairs`` rows."""
    from dspark_kernels.pypto.runtime import kernel, pypto

    tr = PAIR_TILE

    @kernel
    def routed(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
               x_q: pypto.Tensor([rows, hidden], pypto.DT_INT8), x_scale: pypto.Tensor([rows, 1], pypto.DT_FP32),
               pair_rows: pypto.Tensor([tiles * tr], pypto.DT_INT32),
               pair_w: pypto.Tensor([tiles * tr, 1], pypto.DT_FP32),
               tile_expert: pypto.Tensor([tiles], pypto.DT_INT32),
               w1: pypto.Tensor([used * inter, hidden], pypto.DT_INT8),
               w1_scale: pypto.Tensor([used, inter], pypto.DT_FP32),
               w3: pypto.Tensor([used * inter, hidden], pypto.DT_INT8),
               w3_scale: pypto.Tensor([used, inter], pypto.DT_FP32),
               w2: pypto.Tensor([used * hidden, inter], pypto.DT_INT8),
               w2_scale: pypto.Tensor([used, hidden], pypto.DT_FP32),
               pairs: pypto.Tensor([tiles * tr, hidden], pypto.DT_BF16)):
        _sizes = (rows, hidden, inter, used, tiles)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(VEC_ROWS, VEC_COLS)
        for i in pypto.loop(tiles):
            e = tile_expert[i]
            pick = pypto.view(pair_rows, [tr], [i * tr])
            xt, xs = pypto.index_select(x_q, 0, pick), pypto.index_select(x_scale, 0, pick)   # [TR, D], [TR, 1]
            gate = _w8a8(xt, xs, pypto.view(w1, [inter, hidden], [e * inter, 0]),
                         pypto.view(w1_scale, [1, inter], [e, 0]))
            up = _w8a8(xt, xs, pypto.view(w3, [inter, hidden], [e * inter, 0]),
                       pypto.view(w3_scale, [1, inter], [e, 0]))
            y = _down(_swiglu(gate, up, limit), pypto.view(pair_w, [tr, 1], [i * tr, 0]),
                      pypto.view(w2, [hidden, inter], [e * hidden, 0]), pypto.view(w2_scale, [1, hidden], [e, 0]))
            pypto.assemble(pypto.cast(y, pypto.DT_BF16), [i * tr, 0], pairs)

    return routed


@lru_cache(maxsize=16)
def combine_kernel(rows: int, hidden: int, pair_slots: int, slots: int, shared: int, limit: float) -> Any:
    """The shared expert + combine jit kernel for one geometry; ``shared`` 0 = no shared expert."""
    from dspark_kernels.pypto.runtime import kernel, pypto

    si = max(shared, 1)

    @kernel
    def combine(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
                x_q: pypto.Tensor([rows, hidden], pypto.DT_INT8), x_scale: pypto.Tensor([rows, 1], pypto.DT_FP32),
                s1: pypto.Tensor([si, hidden], pypto.DT_INT8), s1_scale: pypto.Tensor([1, si], pypto.DT_FP32),
                s3: pypto.Tensor([si, hidden], pypto.DT_INT8), s3_scale: pypto.Tensor([1, si], pypto.DT_FP32),
                s2: pypto.Tensor([hidden, si], pypto.DT_INT8), s2_scale: pypto.Tensor([1, hidden], pypto.DT_FP32),
                pairs: pypto.Tensor([pair_slots, hidden], pypto.DT_BF16),
                slot_pos: pypto.Tensor([slots * rows], pypto.DT_INT32),
                out: pypto.Tensor([rows, hidden], pypto.DT_BF16)):
        _sizes = (rows, hidden, pair_slots, slots, si)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(VEC_ROWS, VEC_COLS)
        if shared > 0:
            h = _swiglu(_w8a8(x_q, x_scale, s1, s1_scale), _w8a8(x_q, x_scale, s3, s3_scale), limit)
            acc = pypto.cast(pypto.cast(_down(h, None, s2, s2_scale), pypto.DT_BF16), pypto.DT_FP32)
        else:
            acc = pypto.full([rows, hidden], 0.0, pypto.DT_FP32)
        for k in range(slots):  # slot order, as the reference adds them
            back = pypto.index_select(pairs, 0, pypto.view(slot_pos, [rows], [k * rows]))       # [T, D]
            acc = pypto.add(acc, pypto.cast(back, pypto.DT_FP32))
        out[:] = pypto.cast(acc, pypto.DT_BF16)

    return combine


# ---------------------------------------------------------------------------------------------- launchers
def launch_gate(x: np.ndarray, norm: np.ndarray | None, gate_w: np.ndarray, bias: np.ndarray | None,
                tid2eid: np.ndarray | None, token_ids: np.ndarray | None, *, slots: int, eps: float,
                route_scale: float, renormalise: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                int | None]:
    """The gate kernel on numpy arrays: (x_q [T, D] int8, x_scale [T] fp32, ids [T, K] int64, weights [T, K]
    fp32, cycles). x: [T, D] bf16-valued; norm: [D] or None; gate_w: [E, D]; bias: [E] or None (hash layers:
    ``tid2eid`` [V, K] and ``token_ids`` [T] instead)."""
    from dspark_kernels.pypto._ops import MASKED_SCORE
    from dspark_kernels.pypto.runtime import Out, launch

    rows, hidden = x.shape
    experts = gate_w.shape[0]
    ep, kp = _padded(experts), _padded(slots)
    w = np.zeros((ep, hidden), np.float32)
    w[:experts] = gate_w
    b = np.zeros((1, ep), np.float32)
    if tid2eid is None:
        b[0, experts:] = MASKED_SCORE
        if bias is not None:
            b[0, :experts] = bias
        table, ids_in = np.zeros((1, kp), np.int32), np.zeros(rows, np.int32)
    else:
        table = np.zeros((tid2eid.shape[0], kp), np.int32)
        table[:, :slots] = tid2eid
        ids_in = np.asarray(token_ids, dtype=np.int64).astype(np.int32)
    norm_row = np.ones((1, hidden), np.float32) if norm is None else bf16_round(norm).reshape(1, hidden)
    jit = gate_kernel(rows, hidden, experts, slots, 0 if tid2eid is None else table.shape[0], norm is not None,
                      float(eps), float(route_scale), bool(renormalise))
    result = launch(jit, [np.asarray(x, np.float32).astype(BF16), norm_row, w, b, table, ids_in,
                          Out((rows, hidden), np.int8, "x_q"), Out((rows, 1), np.float32, "x_scale"),
                          Out((rows, kp), np.int32, "ids"), Out((rows, kp), np.float32, "weights")])
    x_q, x_scale, ids, weights = result.values[-4:]
    return x_q, x_scale[:, 0], ids[:, :slots].astype(np.int64), weights[:, :slots], result.cycles


@attrs.frozen(eq=False)
class ExpertTiles:
    """The gate's (row, slot) pairs grouped by expert and padded to whole :data:`PAIR_TILE`-row tiles (host metadata).

    pair_rows: [NT*TR] int32 row of each padded slot (pad 0); pair_w: [NT*TR, 1] fp32 routing weight (pad 0);
    tile_expert: [NT] int32, each tile's index into ``experts``; experts: [U] int64 expert ids used, ascending;
    slot_pos: [K*T] int32, the padded slot of pair (t, k) at ``k*T + t``.
    """

    pair_rows: np.ndarray
    pair_w: np.ndarray
    tile_expert: np.ndarray
    experts: np.ndarray
    slot_pos: np.ndarray

    @classmethod
    def build(cls, ids: np.ndarray, weights: np.ndarray, n_experts: int) -> "ExpertTiles":
        """From the gate's ids [T, K] and weights [T, K]."""
        t, k = ids.shape
        groups = ExpertGroups.build(ids, n_experts)
        counts = groups.counts()                                                             # (U,)
        per = -(-counts // PAIR_TILE)                                                        # tiles per expert
        first_slot = (np.cumsum(per) - per) * PAIR_TILE                                      # (U,)
        rank = np.arange(t * k) - np.repeat(groups.bounds[:-1], counts)                      # rank in the group
        where = np.repeat(first_slot, counts) + rank                                         # (T*K,) sorted pairs
        n = int(per.sum()) * PAIR_TILE
        pair_rows = np.zeros(n, np.int32)
        pair_rows[where] = groups.pairs // k
        pair_w = np.zeros((n, 1), np.float32)
        pair_w[where, 0] = np.asarray(weights, np.float32).reshape(-1)[groups.pairs]
        slot = np.empty(t * k, np.int64)
        slot[groups.pairs] = where                                                           # by pair id t*K + k
        return cls(pair_rows=pair_rows, pair_w=pair_w,
                   tile_expert=np.repeat(np.arange(len(counts)), per).astype(np.int32), experts=groups.experts,
                   slot_pos=slot.reshape(t, k).T.reshape(-1).astype(np.int32))


@attrs.frozen(eq=False)
class Int8Experts:
    """The used experts' int8 weights stacked (host weight preparation): w1, w3 [U*I, D] with [U, I] scales,
    w2 [U*D, I] with [U, D] scales; the shared expert's s1, s3 [SI, D] / [1, SI], s2 [D, SI] / [1, D], or None."""

    w1: np.ndarray
    w1_scale: np.ndarray
    w3: np.ndarray
    w3_scale: np.ndarray
    w2: np.ndarray
    w2_scale: np.ndarray
    shared: tuple[np.ndarray, ...] | None

    @classmethod
    def build(cls, weights: MoEWeights, experts: np.ndarray) -> "Int8Experts":
        """Quantise (or read the stored int8 of) each used expert once, and the shared expert."""
        stacks = {}
        for name in ("w1", "w3", "w2"):
            parts = [expert_int8(getattr(weights, name), int(e)) for e in experts]  # one read per used expert
            stacks[name] = (np.concatenate([q for q, _ in parts]), np.stack([s for _, s in parts]))
        shared: list[np.ndarray] = []
        if weights.shared_w1 is not None and weights.shared_w3 is not None and weights.shared_w2 is not None:
            for w in (weights.shared_w1, weights.shared_w3, weights.shared_w2):
                q, s = linear_int8(w)
                shared += [q, s.reshape(1, -1)]
        return cls(*stacks["w1"], *stacks["w3"], *stacks["w2"], shared=tuple(shared) if shared else None)


def launch_experts(x_q: np.ndarray, x_scale: np.ndarray, tiles: ExpertTiles, w: Int8Experts, *, slots: int,
                   limit: float, tiles_per_call: int = MAX_TILES_PER_CALL) -> tuple[np.ndarray, int | None]:
    """The routed experts kernel (one call per ``tiles_per_call`` tiles at most) and the combine kernel on numpy
    arrays: (out [T, D] bf16, cycles of all the calls; None outside sim mode)."""
    from dspark_kernels.pypto.runtime import Out, launch

    rows, hidden = x_q.shape
    used = len(tiles.experts)
    inter = w.w1.shape[0] // used
    x_scale = np.asarray(x_scale, np.float32).reshape(rows, 1)
    n = len(tiles.tile_expert)
    calls = -(-n // max(1, tiles_per_call))
    bounds = (np.arange(calls + 1) * n) // calls  # balanced: no short last call
    parts, cycles = [], []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        pick = slice(lo * PAIR_TILE, hi * PAIR_TILE)
        result = launch(routed_kernel(rows, hidden, inter, used, hi - lo, float(limit)),
                        [x_q, x_scale, tiles.pair_rows[pick], tiles.pair_w[pick], tiles.tile_expert[lo:hi],
                         w.w1, w.w1_scale, w.w3, w.w3_scale, w.w2, w.w2_scale,
                         Out(((hi - lo) * PAIR_TILE, hidden), BF16, "pairs")])
        parts.append(result.values[-1])
        cycles.append(result.cycles)
    shared_args: list[np.ndarray]
    if w.shared is None:
        shared_args = [np.zeros((1, hidden), np.int8), np.zeros((1, 1), np.float32), np.zeros((1, hidden), np.int8),
                       np.zeros((1, 1), np.float32), np.zeros((hidden, 1), np.int8), np.zeros((1, hidden), np.float32)]
        width = 0
    else:
        shared_args = list(w.shared)
        width = w.shared[0].shape[0]
    pairs = np.concatenate(parts)
    result = launch(combine_kernel(rows, hidden, len(pairs), slots, width, float(limit)),
                    [x_q, x_scale, *shared_args, pairs, tiles.slot_pos, Out((rows, hidden), BF16, "out")])
    cycles.append(result.cycles)
    return result.values[-1], None if None in cycles else sum(c for c in cycles if c is not None)


# ---------------------------------------------------------------------------------------------- host entry
@attrs.frozen(eq=False)
class MoEResult:
    """out: [T, D] fp32 holding bf16 values (padding rows 0); ids, weights: [T_live, K] routing of the live rows;
    cycles: the cost model's (gate, experts) cycles (None when no row is live or outside sim mode)."""

    out: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    cycles: tuple[int | None, int | None]


def run_moe(x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
            token_ids: np.ndarray | None = None, live: np.ndarray | None = None,
            run: Callable[..., Any] | None = None, tiles_per_call: int = MAX_TILES_PER_CALL) -> MoEResult:
    """The reference's ``moe(x, weights, config, norm=, token_ids=, live=, precision="a2a3")`` through the kernels.

    ``run(func, *args, **kwargs)`` executes each kernel launcher (``run_isolated``: a child process per call;
    None: in this process); the grouping and the expert weights are prepared in this process. ``tiles_per_call``:
    expert tiles per routed-experts call (:func:`launch_experts`). Raises
    :class:`ABIError` for a scoring function other than ``sqrtsoftplus``, missing or out-of-range token ids on a
    hash layer, or ``tid2eid`` ids outside the experts.
    """
    run = _direct if run is None else run
    moe = config.moe
    if moe.scoring_func != "sqrtsoftplus":
        raise ABIError([Issue("config.invalid", "moe.scoring_func", "the pypto MoE gate computes sqrtsoftplus scores",
                              expected="sqrtsoftplus", actual=moe.scoring_func, fix="use the reference backend")])
    x = np.asarray(x, dtype=np.float32)
    out = np.zeros(x.shape, np.float32)
    rows = np.arange(x.shape[0]) if live is None else np.flatnonzero(live)
    k = moe.num_experts_per_tok
    if rows.size == 0:
        return MoEResult(out, np.zeros((0, k), np.int64), np.zeros((0, k), np.float32), (None, None))
    ids_live = None
    if weights.tid2eid is not None:
        check_expert_ids(weights.tid2eid, int(weights.gate_w.shape[0]), "tid2eid")
        ids_live = _hash_token_ids(token_ids, rows, int(weights.tid2eid.shape[0]))
    x_q, x_scale, ids, w, gate_cycles = run(
        launch_gate, bf16_round(x[rows]), norm, np.asarray(weights.gate_w, np.float32), weights.gate_bias,
        weights.tid2eid, ids_live, slots=k, eps=config.rms_norm_eps, route_scale=moe.routed_scaling_factor,
        renormalise=moe.norm_topk_prob)
    tiles = ExpertTiles.build(ids, w, weights.w1.shape[0])
    y, expert_cycles = run(launch_experts, x_q, x_scale, tiles, Int8Experts.build(weights, tiles.experts),
                           slots=k, limit=float(moe.swiglu_limit), tiles_per_call=tiles_per_call)
    out[rows] = np.asarray(y, dtype=np.float32)
    return MoEResult(out, ids, w, (gate_cycles, expert_cycles))


def moe(x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
        token_ids: np.ndarray | None = None, live: np.ndarray | None = None,
        run: Callable[..., Any] | None = None) -> np.ndarray:
    """[T, D] fp32 (bf16 values): :func:`run_moe`'s output rows."""
    return run_moe(x, weights, config, norm=norm, token_ids=token_ids, live=live, run=run).out


def _hash_token_ids(token_ids: np.ndarray | None, rows: np.ndarray, vocab: int) -> np.ndarray:
    if token_ids is None:
        raise ABIError([Issue("token_ids.range", "token_ids", "a hash-routed layer (tid2eid) needs the rows' token ids",
                              expected="[T] int", actual=None, fix="pass token_ids")])
    ids = np.asarray(token_ids, dtype=np.int64)[rows]
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        i = int(bad[0])
        raise ABIError([Issue("token_ids.range", f"token_ids[{int(rows[i])}]",
                              f"token ids index tid2eid's {vocab} rows ({bad.size} out of range)",
                              expected=f"[0, {vocab})", actual=int(ids[i]), fix="token ids must be vocabulary ids")])
    return ids
