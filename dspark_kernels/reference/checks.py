"""Input checks of :func:`~dspark_kernels.reference.attention.attention`, run before any cache is touched.

The batch itself is a validated :class:`dspark_abi.PackedBatch` (its construction checks every ABI rule:
slots agree with tables, writes are unique and in bounds, reads are mapped, state rings do not alias).
What remains is that x, the weights and the caches belong to that batch, config and layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark_abi.batch import PackedBatch
from dspark_abi.errors import ABIError, Issue
from dspark_kernels.reference.caches import POOLS_BY_KIND, LayerCaches
from dspark_kernels.reference.weights import AttentionWeights


def check_attention_inputs(batch: Any, layer: Any, x: Any, weights: Any, caches: Any, rank: Any,
                           precision: str) -> None:
    """Raise TypeError for objects of the wrong type, ABIError listing every other mismatch; else return."""
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a dspark_abi.PackedBatch, got {type(batch).__name__}")
    if not isinstance(weights, AttentionWeights):
        raise TypeError(f"weights must be an AttentionWeights, got {type(weights).__name__}")
    if not isinstance(caches, LayerCaches):
        raise TypeError(f"caches must be a LayerCaches, got {type(caches).__name__}")
    config = batch.config
    issues: list[Issue] = []
    if not isinstance(layer, int | np.integer) or not 0 <= layer < config.num_layers:
        raise ABIError([Issue("config.mismatch", "layer", f"{config.name} has {config.num_layers} layers",
                              expected=f"0 <= layer < {config.num_layers}", actual=repr(layer))])
    if rank is not None and (not isinstance(rank, int | np.integer) or not 0 <= rank < batch.tp_size):
        issues.append(Issue("rank.index", "rank", f"rank {rank!r} does not exist in a TP-{batch.tp_size} group",
                            expected=f"None or 0 <= rank < {batch.tp_size}", actual=repr(rank)))
    rows = batch.padded_rows
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        issues.append(Issue("array.dtype", "x", "hidden rows must be a float32 numpy array", expected="float32",
                            actual=str(getattr(x, "dtype", type(x).__name__))))
    elif x.shape != (rows, config.hidden_size):
        issues.append(Issue("array.shape", "x", "hidden rows must be [P, hidden_size] (all group rows)",
                            expected=[rows, config.hidden_size], actual=list(x.shape)))
    for what, obj in (("weights", weights), ("caches", caches)):
        if obj.config != config:
            issues.append(Issue("config.mismatch", f"{what}.config", f"{what} were built for another config",
                                expected=config.name, actual=obj.config.name))
        elif obj.layer != layer:
            issues.append(Issue("config.mismatch", f"{what}.layer", f"{what} belong to another layer",
                                expected=int(layer), actual=obj.layer))
    if caches.precision != precision:  # a cache is never continued in another precision's numerics
        issues.append(Issue("config.mismatch", "caches.precision", "caches were allocated for another precision",
                            expected=precision, actual=caches.precision))
    issues += _check_pools(batch, caches)
    if issues:
        raise ABIError(issues)


def _check_pools(batch: PackedBatch, caches: LayerCaches) -> list[Issue]:
    if caches.config != batch.config:
        return []  # reported above
    return pool_array_issues(caches, batch.pool_blocks)


def pool_array_issues(caches: LayerCaches, pool_blocks: Any, field: str = "caches") -> list[Issue]:
    """Issues for every pool of the layer's kind: its block count must be ``pool_blocks[pool]``, its array
    ``[blocks * page_size, *row_shape]`` of the precision's dtype (``idx_scale``: ``[blocks * page_size]``).

    ``field`` prefixes the issue fields (``caches.ori``, or ``caches.layers.3.ori`` for a model's caches).
    Only reads shapes and dtypes, so it is safe to run before any pool is indexed.
    """
    issues = []
    pools = caches.config.layout.pools
    own_blocks = caches.pool_blocks if isinstance(caches.pool_blocks, dict) else {}
    for name in POOLS_BY_KIND[caches.kind]:
        want = pool_blocks[name]
        if own_blocks.get(name) != want:
            issues.append(Issue("config.mismatch", f"{field}.pool_blocks.{name}",
                                "caches and batch disagree on the pool's block count", expected=want,
                                actual=own_blocks.get(name)))
            continue
        shape = (want * pools[name].page_size, *pools[name].row_shape)
        dtype = np.int8 if name == "idx" and caches.precision == "a2a3" else np.float32
        arrays = [(name, getattr(caches, name), shape, dtype)]
        if name == "idx":
            arrays.append(("idx_scale", caches.idx_scale, shape[:1], np.float32))
        for pool, array, expected, expected_dtype in arrays:
            if not isinstance(array, np.ndarray) or array.shape != expected:
                issues.append(Issue("array.shape", f"{field}.{pool}", "pool array does not match its layout",
                                    expected=list(expected), actual=list(getattr(array, "shape", ()))))
            elif array.dtype != expected_dtype:
                issues.append(Issue("array.dtype", f"{field}.{pool}", "pool array has the wrong dtype",
                                    expected=np.dtype(expected_dtype).name, actual=array.dtype.name))
    return issues
