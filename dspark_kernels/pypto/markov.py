"""The DSpark drafter's Markov and confidence heads on A2/A3: the same contract as
:func:`dspark_kernels.reference.markov.markov_heads` (R requests' blocks of B rows, V vocabulary padded to Vp, r
Markov rank, D hidden; every shape static per call).

``markov`` kernel, all B block rows in one call, left to right inside the kernel (the previous row's draft is a
tensor of the graph, so no row goes back to the host): ``logits`` [B*R, Vp] fp32 in, row-block-major (row
``i*R + k`` = request k's block row i; pad columns -inf), ``anchors`` [R] int32 in, ``w1`` [V, r] bf16 in
(``markov_w1``), ``w2`` [Vp, r] bf16 in (``markov_w2``, pad rows 0); ``ids`` [B*R, 1] int32 out, the same order.
Row i: ``emb = w1[previous]`` (a row gather), ``biased = logits_i + emb @ w2.T`` (bf16 products, fp32
accumulation, as the LM head's cube matmul), the first maximum's column (the greedy kernel's scan,
:func:`dspark_kernels.pypto.head.first_max`). ``steps`` = 1 is one block row's step.

``confidence`` kernel: ``h`` [M, D] fp32 in (the pre-norm head rows), ``previous`` [M] int32 in (each row's
previous token), ``w1`` [V, r] bf16 in, ``proj`` [1, D + r] fp32 in; ``out`` [M, 1] fp32 =
``sum(h * proj[:D]) + sum(w1[previous] * proj[D:])`` (fp32 products and row sums: a summation order of its own).

The heads' weights are read in bf16 (the values :class:`~dspark_kernels.model.drafter_weights.DrafterWeights`
holds; ValueError otherwise); the reference computes the same products in fp32, so the two differ by fp32
summation orders only. Importing this module imports neither torch nor pypto.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dspark_kernels.model.numerics import FP32_EXACT_INT, bf16_round
from dspark_kernels.pypto.isolate import run_isolated

if TYPE_CHECKING:
    from dspark_kernels.pypto.runtime import LaunchResult


def _bf16_values(name: str, w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if not np.array_equal(bf16_round(w), w):
        raise ValueError(f"the pypto Markov heads read {name} in bf16: its values must be bf16-representable")
    return w


def run_markov(logits: np.ndarray, anchors: np.ndarray, markov_w1: np.ndarray, markov_w2: np.ndarray,
               steps: int | None = None) -> LaunchResult:
    """The Markov kernel on numpy arrays: logits [R, B, V] fp32, anchors [R] int (the previous token of block row
    0); ``values[-1]`` = ids [steps*R, 1] int32, row-block-major (``steps`` default B; 1: block row 0's step)."""
    import ml_dtypes

    from dspark_kernels.pypto.head import markov_kernel, padded_vocab
    from dspark_kernels.pypto.runtime import Out, launch

    r, b, v = logits.shape
    steps = b if steps is None else steps
    if v >= FP32_EXACT_INT:
        raise ValueError(f"markov: {v} columns; the kernel's fp32 ids are exact below {FP32_EXACT_INT}")
    vp = padded_vocab(v)
    rank = markov_w1.shape[1]
    rows = np.full((steps, r, vp), -np.inf, np.float32)
    rows[:, :, :v] = np.asarray(logits, np.float32)[:, :steps].transpose(1, 0, 2)
    w2 = np.zeros((vp, rank), ml_dtypes.bfloat16)
    w2[:v] = _bf16_values("markov_w2", markov_w2).astype(ml_dtypes.bfloat16)
    w1 = _bf16_values("markov_w1", markov_w1).astype(ml_dtypes.bfloat16)
    result: LaunchResult = launch(markov_kernel(r, vp, v, rank, steps),
                                  [rows.reshape(steps * r, vp), np.asarray(anchors, np.int32).reshape(r), w1, w2,
                                   Out((steps * r, 1), np.int32, "ids")])
    return result


def run_confidence(h: np.ndarray, previous: np.ndarray, markov_w1: np.ndarray, proj: np.ndarray) -> LaunchResult:
    """The confidence kernel on numpy arrays: h [M, D] fp32, previous [M] int, proj [D + r]; ``values[-1]`` =
    [M, 1] fp32."""
    import ml_dtypes

    from dspark_kernels.pypto.head import confidence_kernel
    from dspark_kernels.pypto.runtime import Out, launch

    m, hidden = h.shape
    rank = markov_w1.shape[1]
    w1 = _bf16_values("markov_w1", markov_w1).astype(ml_dtypes.bfloat16)
    result: LaunchResult = launch(confidence_kernel(m, hidden, w1.shape[0], rank),
                                  [np.ascontiguousarray(h, np.float32), np.asarray(previous, np.int32).reshape(m),
                                   w1, np.asarray(proj, np.float32).reshape(1, hidden + rank),
                                   Out((m, 1), np.float32, "confidence")])
    return result


def markov_heads(logits: np.ndarray, h: np.ndarray, anchors: np.ndarray, markov_w1: np.ndarray,
                 markov_w2: np.ndarray, confidence: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The reference's ``markov_heads`` through the two kernels: (tokens [R, B] int64, confidence [R, B] float32)."""
    r, b, _ = logits.shape
    if r == 0:
        return np.zeros((0, b), np.int64), np.zeros((0, b), np.float32)
    ids = run_markov(logits, anchors, markov_w1, markov_w2).values[-1].reshape(b, r).T.astype(np.int64)  # (R, B)
    if confidence is None:
        return ids, np.zeros((r, b), np.float32)
    previous = np.concatenate([np.asarray(anchors, np.int64).reshape(r, 1), ids[:, :-1]], axis=1)      # (R, B)
    conf = run_confidence(h.reshape(r * b, -1), previous.reshape(-1), markov_w1, confidence).values[-1]
    return ids, conf.reshape(r, b)


def markov_heads_isolated(logits: np.ndarray, h: np.ndarray, anchors: np.ndarray, markov_w1: np.ndarray,
                          markov_w2: np.ndarray, confidence: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`markov_heads` in a child process (only arrays travel)."""
    out: tuple[np.ndarray, np.ndarray] = run_isolated(markov_heads, logits, h, anchors, markov_w1, markov_w2,
                                                      confidence)
    return out
