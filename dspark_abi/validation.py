"""`validate_arrays`: every ABI rule, vectorized, reporting every violation (not only the first).

Checks run in two levels. ``level="shape"``: presence, dtypes, ranks, row counts, table widths
and ``query_start_loc`` values (O(R + P)). ``level="full"`` (default) adds positions, padding rows,
slot/table agreement, write uniqueness and bounds, read coverage, isolation and state rings; its
cost is O(P + pages the call touches), independent of the table widths.
Deep checks only run once the shapes are consistent, so one mistake does not cascade.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import ml_dtypes
import numpy as np

from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue, ValidationReport
from dspark_abi.fields import BATCH_FIELDS, BY_NAME, SLOT_FIELDS, TABLE_FIELDS, FieldSpec
from dspark_abi.layout import POOL_NAMES
from dspark_abi.lowering import query_start_loc_issues
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import PoolBlocks
from dspark_abi.rules import check_deep

Level = Literal["shape", "full"]
#: The declaration of the hidden rows, a side input (checked here, not carried by the batch).
HIDDEN = BY_NAME["hidden"]
#: Per batch field, what the shape level checks, read from its declaration once: (declaration, numpy dtype,
#: rank, the symbol of its row count when one-dimensional: "P" rows or "R" entries, else None).
_SHAPE_RULES = tuple((f, np.dtype(f.dtype), f.ndim, f.shape[0] if f.ndim == 1 and f.shape[0] in ("P", "R") else None)
                     for f in BATCH_FIELDS)
#: query_start_loc's, checked first: it defines the geometry the other fields' row counts are checked against.
_QSL_RULE = next(r for r in _SHAPE_RULES if r[0].name == "query_start_loc")

#: Fix of ``qsl.token_count`` when N = 0 (the generic hint, "split the batch", is for N > token_cap).
EMPTY_BATCH_FIX = ("add at least one request with new tokens (num_new >= 1): an empty batch has nothing to prefill; "
                   "for a TP group idle in this dispatch set PaddingPolicy(allow_inactive=True)")


def subclass_issue(name: str, value: np.ndarray) -> Issue:
    """The issue of an ndarray subclass given for an ABI array (its mask or matrix semantics would be lost)."""
    return Issue("array.dtype", name, "must be a plain numpy.ndarray, not an ndarray subclass: a masked array's "
                 "mask would be ignored, a matrix indexes differently", expected="numpy.ndarray",
                 actual=type(value).__name__,
                 fix="pass a plain numpy.ndarray: fill masked entries explicitly (e.g. -1 slots) and convert with "
                     "np.asarray(x.filled(...)) or np.asarray(matrix)")


def validate_arrays(arrays: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                    pool_blocks: Any, *, hidden: Any = None, level: Level = "full") -> ValidationReport:
    """Validate a packed batch given as flat ABI arrays; never raises for bad data, never mutates.

    arrays: ``query_start_loc``, ``positions``, ``<pool>_block_table`` x7, ``<pool>_slot_mapping`` x7,
    optional ``request_ids``, ``token_ids``, ``logit_rows``. hidden: optional [P, ...] float rows of the
    input hidden state (padding rows must be zero).
    """
    issues: list[Issue] = []
    try:
        blocks = PoolBlocks.from_mapping(pool_blocks)
    except ABIError as exc:
        issues.extend(exc.issues)
        blocks = None

    qsl = _array(arrays, *_QSL_RULE[:3], issues)
    geometry = _check_qsl(qsl, policy, issues) if qsl is not None else None
    n_req = len(qsl) - 1 if qsl is not None and qsl.ndim == 1 and len(qsl) >= 2 else None
    rows = geometry[1] if geometry else None
    # presence, dtype, rank and row count of every declared field, in ABI order (a table's request count and width
    # are R11's and R12's, reported between the required and the optional fields, as ever)
    count = {"P": rows, "R": n_req, None: None}
    got = {f.name: _array(arrays, f, dtype, ndim, issues, rows=count[symbol])
           for f, dtype, ndim, symbol in _SHAPE_RULES if f.required and f is not _QSL_RULE[0]}
    positions = got["positions"]
    tables = {p: got[TABLE_FIELDS[p]] for p in POOL_NAMES}
    slots = {p: got[SLOT_FIELDS[p]] for p in POOL_NAMES}
    layout = config.layout
    for p, t in tables.items():
        if t is None or t.ndim != 2:
            continue
        if n_req is not None and t.shape[0] != n_req:
            issues.append(Issue("tables.request_count", TABLE_FIELDS[p],
                                "dim 0 must equal R = len(query_start_loc) - 1", expected=n_req, actual=t.shape[0]))
        if not 1 <= t.shape[1] <= layout.pools[p].table_width:
            issues.append(Issue("tables.width", TABLE_FIELDS[p],
                                f"width must be between 1 and {config.name}'s full table width",
                                expected=f"1..{layout.pools[p].table_width}", actual=t.shape[1],
                                fix=f"give {TABLE_FIELDS[p]} at most {layout.pools[p].table_width} columns (ring "
                                    f"width {layout.pools[p].ring_width} for ring pools, the widest live range for "
                                    "compressed pools)"))
    got |= {f.name: _array(arrays, f, dtype, ndim, issues, rows=count[symbol])
            for f, dtype, ndim, symbol in _SHAPE_RULES if not f.required}
    request_ids, token_ids, logit_rows = got["request_ids"], got["token_ids"], got["logit_rows"]
    hidden_arr = None
    if isinstance(hidden, np.ndarray) and type(hidden) is not np.ndarray:
        issues.append(subclass_issue("hidden", hidden))
    elif hidden is not None:
        hidden_arr = np.asarray(hidden)
        if not (np.issubdtype(hidden_arr.dtype, np.floating) or hidden_arr.dtype == ml_dtypes.bfloat16):
            issues.append(Issue("array.dtype", "hidden", "hidden rows must be floating point",
                                expected="float32 / bfloat16", actual=str(hidden_arr.dtype)))
            hidden_arr = None
        elif hidden_arr.ndim < HIDDEN.ndim:     # its declared [P, ...]: at least a feature axis
            issues.append(Issue("array.shape", "hidden", f"hidden rows must be {HIDDEN.shape_text()} with a feature "
                                "axis", expected=HIDDEN.shape_text(), actual=list(hidden_arr.shape)))
            hidden_arr = None
        elif rows is not None and hidden_arr.shape[0] != rows:
            issues.append(Issue("geometry.rows", "hidden", "needs P rows", expected=rows, actual=hidden_arr.shape[0]))
            hidden_arr = None

    if request_ids is not None and request_ids.shape == (n_req,):
        uniq, counts = np.unique(request_ids, return_counts=True)
        if (counts > 1).any():
            dup = int(uniq[counts > 1][0])
            at = np.flatnonzero(request_ids == dup)
            issues.append(Issue("request_ids.duplicate", "request_ids", f"id {dup} is used by several requests",
                                index=int(at[1]), request=int(at[1]), expected="unique", actual=at.tolist(),
                                count=int((counts > 1).sum())))

    if level == "shape" or issues or geometry is None or blocks is None or qsl is None or positions is None:
        return ValidationReport(tuple(issues))
    # no issue so far: every required array is present and well-formed (the filters only narrow the types)
    check_deep(issues, config=config, policy=policy, blocks=blocks, qsl=qsl, n_tokens=geometry[0],
               n_rows=geometry[1], positions=positions, tables={p: t for p, t in tables.items() if t is not None},
               slots={p: s for p, s in slots.items() if s is not None}, token_ids=token_ids,
               logit_rows=logit_rows, hidden=hidden_arr)
    return ValidationReport(tuple(issues))


def _array(arrays: Mapping[str, Any], spec: FieldSpec, dtype: np.dtype[Any], ndim: int, issues: list[Issue], *,
           rows: int | None = None) -> np.ndarray | None:
    """Fetch one field, check its declared dtype / rank and its row count; None when absent or unusable."""
    name = spec.name
    if name not in arrays or arrays[name] is None:
        if spec.required:
            issues.append(Issue("array.missing", name, "required field is absent", expected="present",
                                actual="missing"))
        return None
    a = arrays[name]
    if not isinstance(a, np.ndarray):
        issues.append(Issue("array.dtype", name, "must be a numpy array", expected=spec.dtype,
                            actual=type(a).__name__))
        return None
    if type(a) is not np.ndarray:  # a masked array hides entries from every rule; a matrix breaks indexing
        issues.append(subclass_issue(name, a))
        return None
    if a.dtype != dtype:
        issues.append(Issue("array.dtype", name, "wrong dtype", expected=spec.dtype, actual=a.dtype.name))
        return None
    if a.ndim != ndim:
        code = "qsl.shape" if name == "query_start_loc" else "array.shape"
        issues.append(Issue(code, name, f"must have {ndim} dimension(s)", expected=ndim, actual=a.ndim))
        return None
    if rows is not None and a.shape[0] != rows:
        issues.append(Issue("geometry.rows", name, "row count must match the geometry", expected=rows,
                            actual=a.shape[0]))
        return None
    return a


def _check_qsl(qsl: np.ndarray, policy: PaddingPolicy, issues: list[Issue]) -> tuple[int, int] | None:
    """Check query_start_loc values; return (N, P) when they define a usable geometry."""
    if qsl.size < 2:
        issues.append(Issue("qsl.shape", "query_start_loc", "needs at least 2 entries (one request)",
                            expected=">= 2", actual=int(qsl.size)))
        return None
    order = query_start_loc_issues(qsl)
    issues += order
    ok = not order
    n = int(qsl[-1])
    inactive = n == 0 and policy.allow_inactive and ok            # qsl all zero: an idle group
    if not inactive and not 1 <= n <= policy.token_cap:
        issues.append(Issue("qsl.token_count", "query_start_loc", "N = query_start_loc[-1] out of range",
                            index=len(qsl) - 1, expected=f"1..{policy.token_cap}", actual=n,
                            fix=EMPTY_BATCH_FIX if n < 1 else None))
        ok = False
    if not policy.allow_empty_requests and not inactive:
        empty = np.flatnonzero(np.diff(qsl.astype(np.int64)) == 0)
        if empty.size:
            issues.append(Issue("qsl.empty_request", "query_start_loc", "zero-length request not allowed by policy",
                                index=int(empty[0]) + 1, request=int(empty[0]), expected="> 0 tokens", actual=0,
                                count=int(empty.size)))
    return (n, policy.padded_rows(n)) if ok else None
