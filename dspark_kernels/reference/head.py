"""The model head: hc_head stream reduction, final RMSNorm, LM head over requested rows and greedy sampling.

Math (upstream's head stage; DeepSeek-V4 ``ParallelHead``):
``x_out = rms(hc_head(x_hc), norm_w)`` for every row, ``logits = x_out[rows] @ head_w.T`` (fp32) for the
requested rows only, ``sampled = argmax(logits)`` (first maximum). Rows with index -1 are inactive: their logits
are zero and their sampled id is -1.

Precision ``"a2a3"``: the hc_head output and ``x_out`` are bf16 (upstream's ``hidden_workspace`` and ``x_out``);
logits accumulate in fp32. ``"deepseek"`` is the same (the official ``hc_head`` and ``norm`` return bf16; the
head computes fp32 logits of ``x.float()`` with the fp32-held head weight). Under TP the vocabulary is split
into contiguous shards (rank r owns ``dspark_kernels.model.geometry.vocab_shard(V, TP, r)``); each rank computes
its shard and the logits are all-gathered along the vocabulary.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.config import ModelConfig
from dspark_kernels.model.block_weights import HeadWeights
from dspark_kernels.model.numerics import Precision, check_precision, narrow, rms_norm
from dspark_kernels.reference.hyper_connections import hc_head


def final_hidden(x_hc: np.ndarray, weights: HeadWeights, config: ModelConfig, *,
                 precision: Precision = "fp32") -> np.ndarray:
    """``rms(hc_head(x_hc), norm)``: x_hc [T, hc, D] fp32 -> x_out [T, D] fp32 (bf16 values in a2a3 and deepseek).

    Zero (padding) rows give zero rows.
    """
    check_precision(precision)
    h = hc_head(x_hc, weights.hc, config, precision=precision)
    return narrow(rms_norm(h, weights.norm, config.rms_norm_eps), precision)


def stream_mean(x_hc: np.ndarray, *, precision: Precision = "fp32") -> np.ndarray:
    """The plain mean of the hyper-connection streams: x_hc [T, hc, D] fp32 -> [T, D] fp32 (bf16 values in a2a3
    and deepseek), ``((x_0 + x_1) + ... + x_{hc-1}) / hc`` in fp32 as torch's ``mean(dim=2)`` of bf16 streams adds
    them, rounded to bf16 once. DeepSeek's DSpark target feature of a target layer (``h.mean(dim=2)`` of the
    layer's output, docs/checkpoints.md section 6). Zero (padding) rows give zero rows."""
    check_precision(precision)
    x_hc = np.asarray(x_hc, dtype=np.float32)
    acc = x_hc[:, 0].copy()
    for j in range(1, x_hc.shape[1]):   # the hc streams (4), in order
        acc += x_hc[:, j]
    return narrow(acc * np.float32(1.0 / x_hc.shape[1]), precision)


def logits_for_rows(x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
    """LM-head logits of the requested rows: x_out [T, D], rows [M] int (-1 = inactive), head_w [V', D]
    (the whole head or one vocabulary shard) -> [M, V'] fp32, zero on inactive rows."""
    rows = np.asarray(rows, dtype=np.int64)
    out = np.zeros((rows.size, head_w.shape[0]), dtype=np.float32)
    active = rows >= 0
    if active.any():
        out[active] = x_out[rows[active]] @ head_w.T
    return out


def greedy(logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Greedy ids [M] int64: the first maximum of each active row; -1 where ``rows`` is -1."""
    ids = np.argmax(logits, axis=-1).astype(np.int64) if logits.shape[-1] else np.zeros(len(rows), np.int64)
    return np.where(np.asarray(rows) >= 0, ids, -1)
