"""Packed TINY batches shared by the pypto tests (numpy only; no torch, no pypto).

``packed_batch()``: TP 2, three requests: 3 tokens after 126 cached (crosses a 32-row page, position 127 is a
ratio-4 and ratio-128 boundary), 4 tokens after 30 cached (crosses the rank boundary: rows 3..6 with L = 5)
and 2 fresh tokens; N = 9, P = 10, one padding row.
"""

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.presets import TINY
from dspark_kernels.reference.numerics import bf16_round

CONFIG = TINY
SEED = 20261130


def packed_batch(tp_size: int = 2):
    builder = BatchBuilder(CONFIG, PaddingPolicy(tp_size=tp_size), BlockAllocator(CONFIG, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=126, num_new=3)
    builder.add(1, num_cached=30, num_new=4)
    builder.add(2, num_cached=0, num_new=2)
    return builder.build()


def hidden_rows(batch, seed: int = SEED) -> np.ndarray:
    """[P, X] bf16-valued float32 attention input; padding rows 0."""
    rng = np.random.default_rng(seed)
    x = bf16_round(rng.standard_normal((batch.padded_rows, CONFIG.hidden_size)).astype(np.float32))
    x[batch.row_request < 0] = 0
    return x
