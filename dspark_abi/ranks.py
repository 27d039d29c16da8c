"""Per-rank host arrays (leading rank axis) <-> one group batch, with cross-rank consistency checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dspark_abi.errors import ABIError, Issue
from dspark_abi.fields import BATCH_FIELDS
from dspark_abi.policy import PaddingPolicy
from dspark_abi.validation import subclass_issue

#: Fields a per-rank entry carries with all their rows, identical on every rank of the group (per-rank form names).
REPLICATED: tuple[str, ...] = tuple(f.per_rank_name for f in BATCH_FIELDS if f.scope == "replicated")
#: Rank-local fields ([TP, L]) and the full field each one slices (per-rank form names).
LOCAL: dict[str, str] = {f.local: f.per_rank_name for f in BATCH_FIELDS if f.local is not None}
#: Flat field name -> its name in the per-rank form, where the two differ (``positions`` -> ``positions_full``).
_PER_RANK_NAME: dict[str, str] = {f.name: f.per_rank_name for f in BATCH_FIELDS if f.per_rank_name != f.name}
_FLAT_NAME: dict[str, str] = {v: k for k, v in _PER_RANK_NAME.items()}
#: Flat names of the fields a per-rank entry carries only as rank slices (``token_ids``: ``token_ids_local``).
_ONLY_LOCAL = frozenset(f.name for f in BATCH_FIELDS if f.scope == "rank_local")


def merge_rank_arrays(per_rank: Mapping[str, Any], policy: PaddingPolicy) -> dict[str, np.ndarray]:
    """Check and collapse ``[TP, ...]`` per-rank arrays into flat group arrays (rank 0's copy).

    Replicated fields (:data:`REPLICATED`, from the field declarations): ``query_start_loc``, ``positions_full``
    (or ``positions``; both only if equal), every ``*_block_table`` and ``*_slot_mapping`` (the ``_full`` ones),
    ``request_ids``, ``logit_rows``.
    Local fields (:data:`LOCAL`): ``positions_local`` [TP, L] and ``token_ids_local`` [TP, L] must equal rank r's
    rows ``[r*L, (r+1)*L)`` of ``positions_full`` / ``token_ids`` (``token_ids`` may be given only locally).
    """
    tp = policy.tp_size
    issues: list[Issue] = [subclass_issue(k, v) for k, v in per_rank.items()
                           if isinstance(v, np.ndarray) and type(v) is not np.ndarray]
    if issues:  # np.asarray would silently drop a mask
        raise ABIError(issues)
    if "positions" in per_rank and "positions_full" in per_rank:  # two names of one field: they must agree
        alias, full_positions = np.asarray(per_rank["positions"]), np.asarray(per_rank["positions_full"])
        if alias.shape != full_positions.shape:
            issues.append(_positions_twice(None, f"shape {alias.shape}, positions_full {full_positions.shape}", 1))
        elif not np.array_equal(alias, full_positions):
            differ = np.flatnonzero((alias != full_positions).reshape(-1))
            row = int(differ[0]) % full_positions.shape[-1] if full_positions.ndim else None
            issues.append(_positions_twice(row, f"{differ.size} entries differ", int(differ.size)))
    arrays = {_PER_RANK_NAME.get(k, k): np.asarray(v) for k, v in per_rank.items()}
    merged: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        if name in LOCAL:
            continue
        if value.ndim < 1 or value.shape[0] != tp:
            issues.append(Issue("array.shape", name, "needs a leading rank axis of size TP", index=0,
                                expected=tp, actual=value.shape[0] if value.ndim else "scalar"))
            continue
        differs = [r for r in range(1, tp) if not np.array_equal(value[r], value[0])]
        if differs:
            r = differs[0]
            at = np.flatnonzero((value[r] != value[0]).reshape(-1))
            issues.append(Issue("rank.replicated_mismatch", name, f"rank {r} differs from rank 0",
                                index=int(at[0]) if at.size else None, expected="identical on every rank",
                                actual=f"ranks {differs}", count=len(differs)))
        merged[_FLAT_NAME.get(name, name)] = value[0]
    for local, full in LOCAL.items():    # a rank-local field given only as rank slices: their concatenation
        flat = _FLAT_NAME.get(full, full)
        if flat in _ONLY_LOCAL and flat not in merged and local in arrays:
            merged[flat] = arrays[local].reshape(-1)
    for local, full in LOCAL.items():
        if local not in arrays:
            continue
        loc = arrays[local]
        source = merged.get(_FLAT_NAME.get(full, full))
        if source is None or loc.ndim != 2 or loc.shape[0] != tp:
            if source is not None:
                issues.append(Issue("array.shape", local, "needs shape [TP, L]", expected=f"[{tp}, L]",
                                    actual=loc.shape))
            continue
        if loc.shape[1] * tp != source.shape[0]:
            issues.append(Issue("geometry.rows", local, "L * TP must equal the full row count P",
                                expected=source.shape[0] // tp, actual=loc.shape[1]))
            continue
        wrong = np.flatnonzero(loc.reshape(-1) != source)
        if wrong.size:
            i = int(wrong[0])
            issues.append(Issue("rank.local_mismatch", local, f"rank {i // loc.shape[1]} row {i % loc.shape[1]} "
                                "differs from its slice of the full field", index=i, expected=source[i].item(),
                                actual=loc.reshape(-1)[i].item(), count=int(wrong.size)))
    if issues:
        raise ABIError(issues)
    return merged


def _positions_twice(row: int | None, actual: str, count: int) -> Issue:
    return Issue("rank.replicated_mismatch", "positions", "positions and positions_full name the same replicated "
                 "field but differ", index=row, expected="equal to positions_full", actual=actual, count=count,
                 fix="pass the full positions once, as positions_full (or as positions)")


def split_rank_arrays(arrays: Mapping[str, np.ndarray], policy: PaddingPolicy) -> dict[str, np.ndarray]:
    """The inverse: group arrays -> per-rank host arrays with a leading rank axis."""
    tp = policy.tp_size
    out = {_PER_RANK_NAME.get(k, k): np.stack([v] * tp) for k, v in arrays.items() if k not in _ONLY_LOCAL}
    out |= {f.local: np.array(arrays[f.name]).reshape(tp, -1) for f in BATCH_FIELDS
            if f.local is not None and f.name in arrays}
    return out
