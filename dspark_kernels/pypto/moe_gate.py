"""The gate of the A2/A3 MoE (upstream's ``gate``): deferred ffn RMSNorm, sqrtsoftplus, top-k or hash routing and
the rows' W8A8 activations. Shapes and symbols as in :mod:`dspark_kernels.pypto.moe`.

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

Importing this module imports neither torch nor pypto.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

from dspark_kernels.model.numerics import bf16_round
from dspark_kernels.pypto.moe_routed import CUBE_CORES, L0_BYTES, L1_BYTES, _pow2_floor, _pypto

T = TypeVar("T")
BF16 = ml_dtypes.bfloat16

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
