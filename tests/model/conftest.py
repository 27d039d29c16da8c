"""Shared helpers of the layer/forward tests: TINY batches built step by step through the real builder, and the
one FLASH-dimension checkpoint of the session."""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PackedBatch, PaddingPolicy, PoolBlocks
from dspark_abi.presets import FLASH, TINY
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.synthetic import short_schedule, write_checkpoint
from dspark_kernels.model.weights import ModelWeights

#: Physical blocks per pool: enough for every request mix below (~200 tokens per request, 4 requests).
POOL_BLOCKS = PoolBlocks.uniform(256)
MAX_TOKENS = 512
#: FLASH dimensions with one SWA, one CSA and one HCA layer: the configuration of :func:`flash_checkpoint`.
FLASH_3L = short_schedule(FLASH, name="flash-3l")


def tokens_of(request_id: int) -> np.ndarray:
    """The (fixed, seeded) prompt of a request id."""
    return np.random.default_rng(1000 + request_id).integers(0, TINY.vocab_size, MAX_TOKENS)


class Session:
    """One allocator + caches + weights; ``step`` builds a batch of (request, cached, new) and runs it."""

    def __init__(self, *, tp: int = 1, precision: str = "fp32", weights: ModelWeights | None = None,
                 pad_position: str = "zero", config: ModelConfig = TINY):
        self.config = config
        self.policy = PaddingPolicy(tp_size=tp, pad_position=pad_position)
        self.alloc = BlockAllocator(config, POOL_BLOCKS)
        self.caches = ModelCaches.allocate(config, POOL_BLOCKS, precision=precision)
        self.weights = weights or (tiny_weights() if config == TINY else ModelWeights.random(config, 0))
        self.precision = precision

    def batch(self, requests: Sequence[tuple[int, int, int]]) -> PackedBatch:
        bb = BatchBuilder(self.config, self.policy, self.alloc)
        for rid, cached, new in requests:
            bb.add(rid, num_cached=cached, num_new=new, token_ids=tokens_of(rid)[cached:cached + new])
        batch = bb.build()
        bb.commit(batch)
        return batch


_WEIGHTS: dict[int, ModelWeights] = {}


def tiny_weights(seed: int = 0) -> ModelWeights:
    """Random TINY weights, built once per seed for the whole session (layers kept)."""
    if seed not in _WEIGHTS:
        _WEIGHTS[seed] = ModelWeights.random(TINY, seed)
    return _WEIGHTS[seed]


@pytest.fixture
def weights() -> ModelWeights:
    return tiny_weights()


@pytest.fixture(scope="session")
def flash_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The FLASH_3L checkpoint in the shipped format, written once for the whole session (12.8 GB on disk, about
    a minute to write) and removed at its end: every test that needs FLASH-size weights on disk shares it."""
    root = write_checkpoint(tmp_path_factory.mktemp("flash") / FLASH_3L.name, FLASH_3L, seed=0)
    yield root
    shutil.rmtree(root, ignore_errors=True)
