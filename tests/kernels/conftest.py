"""Helpers of the reference-kernel tests: batches from the ABI builder, hidden rows, caches, comparisons."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, PoolBlocks
from dspark_abi.presets import TINY
from dspark_kernels import AttentionWeights, LayerCaches

#: Pool sizes that hold a few TINY requests of a few hundred tokens (state pools hold whole chunks).
TINY_POOLS = PoolBlocks(ori=96, csa_cmp=16, hca_cmp=8, idx=16, csa_state=1024, csa_inner_state=1024, hca_state=256)


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """Normwise relative error max|a - e| / max|e| (0 for two empty or two zero arrays)."""
    scale = float(np.abs(expected).max(initial=0.0))
    diff = float(np.abs(actual.astype(np.float64) - expected).max(initial=0.0))
    return diff / scale if scale > 0 else diff


def sequence(request_id: int, length: int, config=TINY, seed: int = 0) -> np.ndarray:
    """Deterministic post-norm hidden rows [length, hidden] of one request (O(1) entries)."""
    rng = np.random.default_rng([seed, request_id])
    return rng.standard_normal((length, config.hidden_size), dtype=np.float32)


def hidden_rows(batch: PackedBatch, seqs: dict[int, np.ndarray]) -> np.ndarray:
    """x [P, hidden]: row i of request r at position p is seqs[request_id][p]; padding rows zero."""
    x = np.zeros((batch.padded_rows, batch.config.hidden_size), dtype=np.float32)
    live = np.flatnonzero(batch.row_request >= 0)
    for i in live:  # test helper: a plain loop is the clearest statement
        rid = int(batch.request_ids[batch.row_request[i]])
        x[i] = seqs[rid][batch.positions[i]]
    return x


def build(alloc: BlockAllocator, requests: Sequence[tuple[int, int, int]], tp: int = 1,
          pad_position: str = "zero", config=TINY) -> PackedBatch:
    """Batch of (request_id, num_cached, num_new) requests through the ABI builder (commits to ``alloc``)."""
    bb = BatchBuilder(config, PaddingPolicy(tp_size=tp, pad_position=pad_position), alloc)
    for rid, cached, new in requests:
        bb.add(rid, cached, new)
    batch = bb.build()
    bb.commit(batch)
    return batch


def new_allocator(config=TINY, pools: PoolBlocks = TINY_POOLS) -> BlockAllocator:
    return BlockAllocator(config, pools)


def logical_rows(batch: PackedBatch, request: int, pool: str, logical: np.ndarray) -> np.ndarray:
    """Physical rows of ``logical`` indices of batch request ``request`` in ``pool`` (-1 if unmapped)."""
    pl = batch.config.layout.pools[pool]
    table = batch.tables[pool][request]
    logical = np.asarray(logical, dtype=np.int64)
    page = logical // pl.page_size
    column = page % table.size if pl.is_ring else page    # ring pools (ori, state): the page modulo the width
    block = table[column].astype(np.int64)
    return np.where(block >= 0, block * pl.page_size + logical % pl.page_size, -1)


def written_by(batch: PackedBatch, request: int, pool: str) -> tuple[np.ndarray, np.ndarray]:
    """(logical indices, physical rows) that request ``request`` of ``batch`` writes in ``pool``."""
    rows = np.flatnonzero(batch.row_request == request)
    slots = batch.slots[pool][rows]
    pos = batch.positions[rows].astype(np.int64)
    ratio = batch.config.layout.pools[pool].ratio
    logical = (pos + 1) // ratio - 1 if ratio else pos
    keep = slots >= 0
    return logical[keep], slots[keep]


def clone(alloc: BlockAllocator, caches: LayerCaches) -> tuple[BlockAllocator, LayerCaches]:
    return copy.deepcopy(alloc), caches.copy()


@pytest.fixture(scope="session")
def tiny_weights() -> dict[int, AttentionWeights]:
    """Random TINY weights of every layer (seed 7)."""
    return {layer: AttentionWeights.random(TINY, layer, seed=7) for layer in range(TINY.num_layers)}
