"""The DSpark drafter's Markov and confidence heads (reference; DeepSeek's ``DSparkBlock`` heads of the
V4-Flash-DSpark release, greedy).

R requests' blocks of B rows, request-major; V vocabulary, r Markov rank, D hidden.

* **Markov head**, left to right over the B rows: row i's previous token is the anchor (i = 0) or row i - 1's
  draft; ``biased = logits[i] + markov_w1[previous] @ markov_w2.T`` [R, V]; the draft is its first maximum.
* **Confidence head**: ``confidence[i] = [h[i] ; markov_w1[previous]] @ proj`` (proj [D + r]), a raw fp32 logit.

Every precision computes these in fp32 (the checkpoint's heads are fp32 on top of the LM head's fp32 logits).
"""

from __future__ import annotations

import numpy as np


def markov_heads(logits: np.ndarray, h: np.ndarray, anchors: np.ndarray, markov_w1: np.ndarray,
                 markov_w2: np.ndarray, confidence: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [R, B] int64, confidence [R, B] float32: zeros without a confidence head).

    logits: [R, B, V] float32 base logits; h: [R, B, D] float32 pre-norm head rows; anchors: [R] int64;
    markov_w1 / markov_w2: [V, r] float32; confidence: [D + r] float32 or None.
    """
    r, b, _ = logits.shape
    tokens = np.empty((r, b), np.int64)
    embeds = np.empty((r, b, markov_w1.shape[1]), np.float32)
    previous = anchors
    for i in range(b):  # left to right: each row's bias depends on the previous row's choice
        embeds[:, i] = markov_w1[previous]                                                 # (R, r)
        biased = logits[:, i] + embeds[:, i] @ markov_w2.T                                 # (R, V)
        previous = tokens[:, i] = np.argmax(biased, axis=-1)
    if confidence is None:
        return tokens, np.zeros((r, b), np.float32)
    joined = np.concatenate([h, embeds], axis=-1)                                          # (R, B, D + r)
    return tokens, (joined @ confidence).astype(np.float32)
