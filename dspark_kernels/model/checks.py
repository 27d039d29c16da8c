"""Checks both backends run before any cache is touched: the attention inputs, pool arrays, window coverage.

The batch itself is a validated :class:`dspark_abi.PackedBatch` (its construction checks every ABI rule:
slots agree with tables, writes are unique and in bounds, reads are mapped, state rings do not alias).
What remains is that x, the weights and the caches belong to that batch, config and layer
(:func:`check_attention_inputs`, run by ``attention`` and ``attention_pypto``; a forward checks the same facts
for all its layers at once), and that a ratio-128 window a compressor pools is fully mapped
(:func:`coverage_issues`, run by both backends' compressors before they write).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark_abi import ABIError, Issue, PackedBatch
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.caches import LayerCaches, pool_array_issues
from dspark_kernels.model.geometry import OVERLAP_RATIO


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
    issues += batch.policy.rank_issues(rank, whole_group=True)  # the one statement of the rank bounds
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


def coverage_issues(positions: np.ndarray, request: np.ndarray, boundaries: np.ndarray, state_rows: np.ndarray,
                    ratio: int, field: str) -> list[Issue]:
    """Issues (``coverage.unmapped``) for non-overlapping windows with unmapped state slots; [] if covered.

    boundaries [B] / state_rows [B, slots]: :func:`~dspark_kernels.model.geometry.window_state_rows`. The
    ratio-4 compressor tolerates missing slots (score -inf); the ratio-128 one requires full history.
    """
    if ratio == OVERLAP_RATIO:
        return []
    bad = np.flatnonzero((state_rows < 0).any(axis=1))
    if bad.size == 0:
        return []
    t = int(boundaries[bad[0]])
    return [Issue("coverage.unmapped", field, f"the ratio-{ratio} window of row {t} (position "
                  f"{int(positions[t])}) has unmapped state rows", index=t, request=int(request[t]),
                  expected="every window position mapped", actual=int((state_rows[bad[0]] < 0).sum()),
                  count=int(bad.size))]
