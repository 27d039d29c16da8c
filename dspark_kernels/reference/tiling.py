"""Row tiling helpers of the reference stages: fixed-size tiles inside a range, and request runs of bare rows.

The attention hands its stages the runs of its plan (:meth:`~dspark_kernels.model.plan.BatchPlan.runs_in`,
the batch's request record); :func:`request_runs` serves a stage called on bare arrays only (a
test, a benchmark), where no batch exists to take the runs from.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dspark_kernels.model.plan import Run


def request_runs(request: np.ndarray) -> list[Run]:
    """Maximal runs of equal request id: ``[(start, stop, request), ...]`` over ``request`` [T] (-1 included).

    Packed rows of one request are contiguous, so a run is a request's rows inside the given range. For stages
    called without a plan (see the module docstring).
    """
    request = np.asarray(request)
    if request.size == 0:
        return []
    cuts = np.flatnonzero(request[1:] != request[:-1]) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [request.size]])
    return [(int(a), int(b), int(request[a])) for a, b in zip(starts, stops, strict=True)]


def tiles(start: int, stop: int, size: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` cut into consecutive ``(lo, hi)`` tiles of at most ``size`` rows."""
    for lo in range(start, stop, max(1, size)):
        yield lo, min(lo + max(1, size), stop)
