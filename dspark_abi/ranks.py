"""Per-rank host arrays (leading rank axis) <-> one group batch, with cross-rank consistency checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dspark_abi.errors import ABIError, Issue
from dspark_abi.policy import PaddingPolicy
from dspark_abi.validation import subclass_issue

#: Fields a per-rank entry carries with all P (or R) rows, identical on every rank of the group.
REPLICATED = ("query_start_loc", "positions_full", "request_ids", "logit_rows")
#: Rank-local fields ([TP, L]) and the full field each one slices.
LOCAL = {"positions_local": "positions_full", "token_ids_local": "token_ids"}


def merge_rank_arrays(per_rank: Mapping[str, Any], policy: PaddingPolicy) -> dict[str, np.ndarray]:
    """Check and collapse ``[TP, ...]`` per-rank arrays into flat group arrays (rank 0's copy).

    Replicated fields: ``query_start_loc``, ``positions_full`` (or ``positions``; both only if equal), every
    ``*_block_table`` and ``*_slot_mapping`` (the ``_full`` ones), ``request_ids``, ``logit_rows``.
    Local fields: ``positions_local`` [TP, L] and ``token_ids_local`` [TP, L] must equal rank r's
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
    arrays = {("positions_full" if k == "positions" else k): np.asarray(v) for k, v in per_rank.items()}
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
        merged["positions" if name == "positions_full" else name] = value[0]
    if "token_ids" not in merged and "token_ids_local" in arrays:
        merged["token_ids"] = arrays["token_ids_local"].reshape(-1)
    for local, full in LOCAL.items():
        if local not in arrays:
            continue
        loc = arrays[local]
        source = merged.get("positions" if full == "positions_full" else full)
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
    out = {("positions_full" if k == "positions" else k): np.stack([v] * tp) for k, v in arrays.items()
           if k != "token_ids"}
    out["positions_local"] = np.array(arrays["positions"]).reshape(tp, -1)
    if "token_ids" in arrays:
        out["token_ids_local"] = np.array(arrays["token_ids"]).reshape(tp, -1)
    return out
