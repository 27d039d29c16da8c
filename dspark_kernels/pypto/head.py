"""The model head on A2/A3: hc_head + final RMSNorm, the LM head over the requested rows (one vocabulary shard per
TP rank) and greedy sampling.

Mirrors ``dspark_kernels.reference.head`` in ``precision="a2a3"`` (upstream's hc_head and LM-head stages:
pypto-lib ``models/deepseek_v4_flash_dspark/hc_head.py`` and ``lm_head.py``). T rows, hc streams, X hidden size,
M logit rows, V' the vocabulary rows of one shard (padded to Vp, a multiple of :data:`VOCAB_ALIGN`); every shape
static per call.

``final_hidden`` kernel: x [T, Kp], fn [Hp, Kp], scale / base [1, Hp] fp32 in (the head mixer, zero-padded as
:func:`~dspark_kernels.pypto.hyper_connections.hc_head_args` lays it out), ``norm`` [1, X] fp32 in;
``hidden`` [T, X] bf16 out = ``bf16(rms(bf16(hc_head(x)), norm))``. Zero (padding) rows give zero rows.

``stream_mean`` kernel (the DSpark target features): ``x`` [T, hc*X] fp32 in (x_hc flattened), ``out`` [T, X] bf16
= ``bf16(((x_0 + x_1) + ... + x_{hc-1}) * (1 / hc))``, the reference's ``stream_mean`` in a2a3.

``logits`` kernel: ``x_out`` [T, X] bf16 in, ``rows`` [M] int32 in (group rows, -1 inactive), ``head`` [Vp, X]
bf16 in (one shard of ``head.weight``, pad rows 0); ``logits`` [M, Vp] fp32 out: ``x_out[rows] @ head.T``
(bf16 x bf16 products, fp32 accumulation, as upstream's cube matmul), exactly 0 on inactive rows.

``greedy`` kernel: ``logits`` [M, Vp] fp32 in (pad columns -inf), ``rows`` [M] int32 in; ``ids`` [M, 1] int32 out:
the first maximum's column (``min {v : logits[v] == max}``, the ids as fp32 integers, exact below 2**24),
-1 on inactive rows.

The DSpark drafter's ``markov`` (left-to-right biased first maximum over its B block rows, in one call) and
``confidence`` kernels build on the same scan (:func:`first_max`); their contracts are
:mod:`dspark_kernels.pypto.markov`'s.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from dspark_abi.config import ModelConfig
from dspark_kernels.model.numerics import FP32_EXACT_INT
from dspark_kernels.pypto._ops import MIN_COLUMNS, tile
from dspark_kernels.pypto.hyper_connections import (
    HcMixer,
    bf16_then_norm,
    hc_head_args,
    hc_head_layout,
    hc_head_rows,
    set_hc_head_tiles,
)
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto

BF16 = ml_dtypes.bfloat16
#: Vocabulary rows of a shard are padded to a multiple of this (fp32 logit rows of whole 32-byte blocks).
VOCAB_ALIGN = MIN_COLUMNS
#: Vector tiles of the greedy scan (rows, vocabulary columns) and of its 1-D id ramp.
GREEDY_TILE = (8, 1024)
#: Cube tiles of the LM head: bf16 B operand tk * tn * 2 B <= 64 KB (L0B), k 256 x n 128 as o_proj's.
LM_TK, LM_TN, LM_TK_L1 = 256, 128, 1024
#: Vector tiles of the Markov head's bias add and first-maximum scan (rows, vocabulary columns). FLASH-DSpark,
#: R = 64, 5 block rows: 5,018,082 cycles with (8, 1024), 5,060,831 with (4, 2048); (16, 1024) and (8, 2048)
#: gave no cycle count (their runs ended without one; the cause was not looked into).
MARKOV_TILE = GREEDY_TILE
#: Rows of a confidence-head vector tile (a [rows, D] fp32 tile: 64 KB of the 192 KB UB at D = 4096).
CONFIDENCE_ROWS = 4


class HeadParams(Protocol):
    """What :func:`final_hidden` reads from the head weights (the model's ``HeadWeights``)."""

    @property
    def hc(self) -> HcMixer: ...
    @property
    def norm(self) -> np.ndarray: ...


@lru_cache(maxsize=16)
def final_hidden_kernel(rows: int, hc: int, hidden: int, eps: float, norm_eps: float) -> Any:
    """The hc_head + final-norm jit kernel for one geometry (module docstring)."""
    kp, hp = hc_head_layout(hc, hidden)

    @kernel
    def final_hidden(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
                     x: pypto.Tensor([rows, kp], pypto.DT_FP32), fn: pypto.Tensor([hp, kp], pypto.DT_FP32),
                     scale: pypto.Tensor([1, hp], pypto.DT_FP32), base: pypto.Tensor([1, hp], pypto.DT_FP32),
                     norm: pypto.Tensor([1, hidden], pypto.DT_FP32),
                     out: pypto.Tensor([rows, hidden], pypto.DT_BF16)):
        _sizes = (rows, kp, hp, hidden)  # closure capture: the annotations read these
        set_hc_head_tiles(hp)
        y = hc_head_rows(x, fn, scale, base, rows=rows, hc=hc, hidden=hidden, eps=eps, norm_eps=norm_eps)
        out[:] = pypto.cast(bf16_then_norm(y, norm, norm_eps), pypto.DT_BF16)

    return final_hidden


#: Vector tiles of the stream mean (rows, hidden columns).
MEAN_TILE = (32, 512)


@lru_cache(maxsize=16)
def stream_mean_kernel(rows: int, hc: int, hidden: int) -> Any:
    """The stream-mean jit kernel for one geometry (module docstring)."""

    @kernel
    def stream_mean(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
                    x: pypto.Tensor([rows, hc * hidden], pypto.DT_FP32),
                    out: pypto.Tensor([rows, hidden], pypto.DT_BF16)):
        _sizes = (rows, hc, hidden)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(*MEAN_TILE)
        acc = pypto.view(x, [rows, hidden], [0, 0])
        for j in range(1, hc):  # the streams in order, as the reference adds them
            acc = pypto.add(acc, pypto.view(x, [rows, hidden], [0, j * hidden]))
        out[:] = pypto.cast(pypto.mul(acc, 1.0 / hc), pypto.DT_BF16)

    return stream_mean


def stream_mean(x_hc: np.ndarray) -> np.ndarray:
    """The reference's ``stream_mean(x_hc, precision="a2a3")`` through the kernel: x_hc [T, hc, X] fp32 -> [T, X]
    fp32 holding bf16 values."""
    x_hc = np.asarray(x_hc, dtype=np.float32)
    rows, hc, hidden = x_hc.shape
    if rows == 0:
        return np.zeros((0, hidden), np.float32)
    out = launch(stream_mean_kernel(rows, hc, hidden),
                 [np.ascontiguousarray(x_hc.reshape(rows, hc * hidden)), Out((rows, hidden), BF16, "features")])
    return out.values[-1].astype(np.float32)


@lru_cache(maxsize=16)
def logits_kernel(rows: int, m: int, hidden: int, vocab: int) -> Any:
    """The LM-head jit kernel for one geometry (module docstring); ``vocab`` = Vp."""
    tm, tk, tn, tk_l1 = tile(m, 128), tile(hidden, LM_TK), tile(vocab, LM_TN), tile(hidden, LM_TK_L1)

    @kernel
    def logits(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
               x_out: pypto.Tensor([rows, hidden], pypto.DT_BF16), row_ids: pypto.Tensor([m], pypto.DT_INT32),
               head: pypto.Tensor([vocab, hidden], pypto.DT_BF16), out: pypto.Tensor([m, vocab], pypto.DT_FP32)):
        _sizes = (rows, m, hidden, vocab)  # closure capture: the annotations read these
        pypto.set_cube_tile_shapes([tm, tm], [tk, tk_l1], [tn, tn])
        pypto.set_vec_tile_shapes(64, 128)
        ids = pypto.cast(row_ids, pypto.DT_FP32)
        safe = pypto.cast(pypto.maximum(ids, pypto.full(ids.shape, 0.0, pypto.DT_FP32)), pypto.DT_INT32)
        picked = pypto.index_select(x_out, 0, safe)                                          # [M, X] bf16
        prod = pypto.matmul(picked, head, pypto.DT_FP32, b_trans=True)                       # [M, Vp]
        live = pypto.expand_clone(pypto.ge(pypto.reshape(ids, [m, 1]), 0.0), [m, vocab])
        out[:] = pypto.where(live, prod, 0.0)

    return logits


@lru_cache(maxsize=16)
def greedy_kernel(m: int, vocab: int) -> Any:
    """The greedy jit kernel for one geometry (module docstring); ``vocab`` = Vp."""

    @kernel
    def greedy(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
               logits: pypto.Tensor([m, vocab], pypto.DT_FP32), row_ids: pypto.Tensor([m], pypto.DT_INT32),
               ids: pypto.Tensor([m, 1], pypto.DT_INT32)):
        _sizes = (m, vocab)  # closure capture: the annotations read these
        first = first_max(logits, column_ramp(vocab))                                        # [M, 1]
        live = pypto.ge(pypto.reshape(pypto.cast(row_ids, pypto.DT_FP32), [m, 1]), 0.0)
        ids[:] = pypto.cast(pypto.where(live, first, -1.0), pypto.DT_INT32)

    return greedy


def column_ramp(vocab: int) -> Any:
    """[1, Vp] fp32 column numbers 0 .. Vp - 1 (traced)."""
    pypto.set_vec_tile_shapes(GREEDY_TILE[1])  # arange needs a 1-D tile shape
    return pypto.reshape(pypto.cast(pypto.arange(vocab), pypto.DT_FP32), [1, vocab])


def first_max(values: Any, ramp: Any, tiles: tuple[int, int] = GREEDY_TILE) -> Any:
    """[M, 1] fp32 column of each row's first maximum of ``values`` [M, Vp] fp32 (``ramp``: :func:`column_ramp`;
    ``tiles``: its vector tiles; traced): ``min {v : values[v] == max}``."""
    m, vocab = values.shape
    pypto.set_vec_tile_shapes(*tiles)
    top = pypto.amax(values, -1, keepdim=True)                                              # [M, 1]
    at_top = pypto.ge(pypto.sub(values, top), 0.0)                 # x - max == 0 exactly at the maxima
    columns = pypto.where(at_top, pypto.expand_clone(ramp, [m, vocab]), float(vocab))
    return pypto.amin(columns, -1, keepdim=True)


@lru_cache(maxsize=16)
def markov_kernel(requests: int, vocab: int, table: int, rank: int, steps: int) -> Any:
    """The Markov-head jit kernel for one geometry (:mod:`dspark_kernels.pypto.markov`): ``vocab`` = Vp logit
    columns, ``table`` = V rows of ``w1``, ``steps`` block rows (B, or 1 for one row's step)."""
    tm, tk, tn = tile(requests, 128), tile(rank, LM_TK), tile(vocab, LM_TN)

    @kernel
    def markov(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
               logits: pypto.Tensor([steps * requests, vocab], pypto.DT_FP32),
               anchors: pypto.Tensor([requests], pypto.DT_INT32),
               w1: pypto.Tensor([table, rank], pypto.DT_BF16), w2: pypto.Tensor([vocab, rank], pypto.DT_BF16),
               ids: pypto.Tensor([steps * requests, 1], pypto.DT_INT32)):
        _sizes = (requests, vocab, table, rank, steps)  # closure capture: the annotations read these
        ramp = column_ramp(vocab)
        previous = anchors
        for i in range(steps):  # traced: each row's gather reads the previous row's ids, a tensor of the graph
            pypto.set_vec_tile_shapes(64, rank)
            emb = pypto.index_select(w1, 0, previous)                                        # [R, r] bf16
            pypto.set_cube_tile_shapes([tm, tm], [tk, tk], [tn, tn])
            bias = pypto.matmul(emb, w2, pypto.DT_FP32, b_trans=True)                        # [R, Vp]
            pypto.set_vec_tile_shapes(*MARKOV_TILE)
            biased = pypto.add(pypto.view(logits, [requests, vocab], [i * requests, 0]), bias)
            chosen = pypto.cast(first_max(biased, ramp, MARKOV_TILE), pypto.DT_INT32)        # [R, 1]
            pypto.assemble(chosen, [i * requests, 0], ids)
            previous = pypto.reshape(chosen, [requests])

    return markov


@lru_cache(maxsize=16)
def confidence_kernel(rows: int, hidden: int, table: int, rank: int) -> Any:
    """The confidence-head jit kernel for one geometry (:mod:`dspark_kernels.pypto.markov`)."""

    @kernel
    def confidence(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
                   h: pypto.Tensor([rows, hidden], pypto.DT_FP32),
                   previous: pypto.Tensor([rows], pypto.DT_INT32),
                   w1: pypto.Tensor([table, rank], pypto.DT_BF16),
                   proj: pypto.Tensor([1, hidden + rank], pypto.DT_FP32),
                   out: pypto.Tensor([rows, 1], pypto.DT_FP32)):
        _sizes = (rows, hidden, table, rank)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(CONFIDENCE_ROWS, rank)
        emb = pypto.cast(pypto.index_select(w1, 0, previous), pypto.DT_FP32)                # [M, r]
        tail = pypto.sum(pypto.mul(emb, pypto.view(proj, [1, rank], [0, hidden])), -1, keepdim=True)
        pypto.set_vec_tile_shapes(CONFIDENCE_ROWS, hidden)
        head = pypto.sum(pypto.mul(h, pypto.view(proj, [1, hidden], [0, 0])), -1, keepdim=True)
        out[:] = pypto.add(head, tail)

    return confidence


def run_final_hidden(x_hc: np.ndarray, weights: HeadParams, *, eps: float, norm_eps: float) -> LaunchResult:
    """hc_head + final norm on numpy arrays; ``values[-1]`` = hidden [T, X] bf16.

    x_hc: [T, hc, X] fp32; weights: ``HeadWeights`` (its ``hc`` mixer and ``norm`` [X]); eps: ``hc_eps``;
    norm_eps: ``rms_norm_eps``.
    """
    rows, hc, hidden = np.shape(x_hc)
    jit = final_hidden_kernel(rows, hc, hidden, float(eps), float(norm_eps))
    norm = np.asarray(weights.norm, np.float32).reshape(1, hidden)
    return launch(jit, [*hc_head_args(x_hc, weights.hc), norm, Out((rows, hidden), BF16, "hidden")])


def final_hidden(x_hc: np.ndarray, weights: HeadParams, config: ModelConfig) -> np.ndarray:
    """The reference's ``final_hidden(x_hc, weights, config, precision="a2a3")`` through the kernel:
    x_hc [T, hc, X] fp32 -> [T, X] fp32 holding bf16 values."""
    out = run_final_hidden(x_hc, weights, eps=config.hc_eps, norm_eps=config.rms_norm_eps).values[-1]
    return out.astype(np.float32)


def padded_vocab(v: int) -> int:
    """Vocabulary rows (or logit columns) ``v`` rounded up to :data:`VOCAB_ALIGN`."""
    return -(-v // VOCAB_ALIGN) * VOCAB_ALIGN


def _row_ids(rows: np.ndarray, limit: int) -> np.ndarray:
    """[M] int32 group rows (-1 inactive); ValueError for a row outside [-1, limit)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < -1 or rows.max() >= limit):
        raise ValueError(f"logit rows must be -1 or in [0, {limit}), got {rows.min()}..{rows.max()}")
    return rows.astype(np.int32)


def run_logits(x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> LaunchResult:
    """LM head on numpy arrays; ``values[-1]`` = logits [M, Vp] fp32 (columns past V' are the zero pad rows').

    x_out: [T, X] bf16-valued; rows: [M] group rows or -1; head_w: [V', X] bf16-valued (ValueError otherwise:
    the kernel reads bf16 weights, as upstream's LM head does; checkpoints and ``ModelWeights.random`` hold bf16
    values).
    """
    x_out = np.asarray(x_out, dtype=np.float32)
    t, hidden = x_out.shape
    ids = _row_ids(rows, t)
    head_w = np.asarray(head_w, dtype=np.float32)
    vp = padded_vocab(head_w.shape[0])
    w16 = np.zeros((vp, hidden), BF16)
    w16[: head_w.shape[0]] = head_w.astype(BF16)
    if not np.array_equal(w16[: head_w.shape[0]].astype(np.float32), head_w):
        raise ValueError("the pypto LM head reads head.weight in bf16: its values must be bf16-representable")
    jit = logits_kernel(t, ids.size, hidden, vp)
    return launch(jit, [x_out.astype(BF16), ids, w16, Out((ids.size, vp), np.float32, "logits")])


def logits_for_rows(x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
    """The reference's ``logits_for_rows`` through the kernel: x_out [T, X] (bf16 values), rows [M] int (-1 =
    inactive), head_w [V', X] (the whole head or one vocabulary shard) -> [M, V'] fp32, zero on inactive rows."""
    rows = np.asarray(rows).reshape(-1)
    vocab = np.shape(head_w)[0]
    if rows.size == 0 or vocab == 0:  # nothing to launch (an empty last shard: V < TP * ceil(V / TP))
        _row_ids(rows, np.shape(x_out)[0])
        return np.zeros((rows.size, vocab), np.float32)
    return run_logits(x_out, rows, head_w).values[-1][:, :vocab]


def run_greedy(logits: np.ndarray, rows: np.ndarray) -> LaunchResult:
    """Greedy ids on numpy arrays; ``values[-1]`` = ids [M, 1] int32.

    logits: [M, V] fp32 (finite; V < 2**24); rows: [M] int, -1 = inactive.
    """
    logits = np.asarray(logits, dtype=np.float32)
    m, vocab = logits.shape
    ids = np.asarray(rows, dtype=np.int64).reshape(-1)
    if ids.size != m:
        raise ValueError(f"greedy: logits have {m} rows but rows has {ids.size}")
    if vocab >= FP32_EXACT_INT:
        raise ValueError(f"greedy: {vocab} columns; the kernel's fp32 ids are exact below {FP32_EXACT_INT}")
    vp = padded_vocab(vocab)
    padded = np.full((m, vp), -np.inf, np.float32)
    padded[:, :vocab] = logits
    return launch(greedy_kernel(m, vp), [padded, np.maximum(ids, -1).astype(np.int32), Out((m, 1), np.int32, "ids")])


def greedy(logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The reference's ``greedy`` through the kernel: [M] int64, the first maximum of each active row; -1 where
    ``rows`` is -1."""
    logits = np.asarray(logits, dtype=np.float32)
    rows = np.asarray(rows).reshape(-1)
    if logits.shape[0] == 0 or logits.shape[-1] == 0:  # the reference's id 0 of an empty vocabulary, or no rows
        return np.where(rows >= 0, 0, -1).astype(np.int64)
    return run_greedy(logits, rows).values[-1][:, 0].astype(np.int64)
