"""Rank-local request ownership from ``query_start_loc`` in O(L + R), vectorized."""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark_abi.errors import ABIError, Issue
from dspark_abi.requests import owner_of_rows


def lower_local_request_ids(query_start_loc: Any, local_base: int, local_tokens: int) -> np.ndarray:
    """Request id of each of the ``local_tokens`` rows starting at group row ``local_base``.

    query_start_loc: [R+1] integer, 0-based, non-decreasing (checked here in O(R)).
    Returns [L] int32: ``r`` where ``query_start_loc[r] <= local_base + i < query_start_loc[r+1]``;
    -1 for rows at or beyond N (padding). Zero-length requests own no row.

    Cost O(L + R) (:func:`dspark_abi.requests.owner_of_rows`, the one ownership derivation; a batch's
    ``requests.owner_in`` is the same function on its record).

    >>> lower_local_request_ids(np.array([0, 3, 7], np.int32), 4, 4).tolist()
    [1, 1, 1, -1]
    """
    qsl = np.asarray(query_start_loc)
    _check(qsl, local_base, local_tokens)
    qsl = qsl.astype(np.int64, copy=False)
    return owner_of_rows(qsl[:-1], qsl[1:], local_base, local_tokens)


def query_start_loc_issues(qsl: np.ndarray) -> list[Issue]:
    """Issues of the offsets of a 1-D integer ``query_start_loc`` with R+1 >= 2 entries (empty list = fine).

    The one check of the offsets themselves (used by :func:`dspark_abi.validate` and by the lowering):
    ``qsl.start`` unless ``qsl[0] == 0``, ``qsl.non_monotonic`` at the first decrease. Differences are
    taken in int64, so unsigned offsets cannot wrap.
    """
    issues = []
    if qsl[0] != 0:
        issues.append(Issue("qsl.start", "query_start_loc", "must start at 0", index=0, expected=0,
                            actual=int(qsl[0])))
    drops = np.flatnonzero(np.diff(qsl.astype(np.int64)) < 0)  # signed: an unsigned diff wraps
    if drops.size:
        i = int(drops[0]) + 1
        issues.append(Issue("qsl.non_monotonic", "query_start_loc", "offsets must not decrease", index=i,
                            request=i - 1, expected=f">= {int(qsl[i - 1])}", actual=int(qsl[i]),
                            count=int(drops.size)))
    return issues


def _check(qsl: np.ndarray, base: int, count: int) -> None:
    issues = []
    if qsl.ndim != 1 or qsl.size < 2 or not np.issubdtype(qsl.dtype, np.integer):
        issues.append(Issue("qsl.shape", "query_start_loc", "must be a 1-D integer array with R+1 >= 2 entries",
                            expected="[R+1] int32", actual=f"{qsl.shape} {qsl.dtype}"))
    elif qsl.dtype.kind == "u" and int(qsl.max()) > np.iinfo(np.int64).max:
        issues.append(Issue("qsl.shape", "query_start_loc", "entries must fit int64 (they are token offsets)",
                            expected="[R+1] int32", actual=f"{qsl.dtype} up to {int(qsl.max())}"))
    else:
        issues += query_start_loc_issues(qsl)
    if base < 0 or count < 0:
        issues.append(Issue("geometry.rows", "local_base/local_tokens", "must be non-negative",
                            expected=">= 0", actual=(base, count)))
    if issues:
        raise ABIError(issues)


def nested_scan_local_request_ids(query_start_loc: Any, local_base: int, local_tokens: int) -> np.ndarray:
    """The O(L*R) formulation (every row tested against every request, last match wins).

    Kept as the executable specification for tests and as the baseline of ``benchmarks/bench_abi.py``.
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    rows = local_base + np.arange(local_tokens, dtype=np.int64)[:, None]          # (L, 1)
    hit = (qsl[None, :-1] <= rows) & (rows < qsl[None, 1:])                      # (L, R)
    last = hit.shape[1] - 1 - np.argmax(hit[:, ::-1], axis=1)                     # (L,)
    return np.where(hit.any(axis=1), last, -1).astype(np.int32)
