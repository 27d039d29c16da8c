"""Geometry both backends share: the two compress ratios' roles, boundary rows and their windows, and the LM
head's vocabulary shards under TP (:func:`vocab_shard`).

A live token at position p closes a ratio-m window when ``(p + 1) % m == 0`` (it writes compressed entry
``j = (p + 1) / m - 1``, :func:`dspark_abi.layout.written_logical`); entry j's window starts at ``j * m``. The
ratio-4 (CSA) compressor reads two overlapping windows (8 state slots, :data:`OVERLAP_RATIO`), the ratio-128
(HCA) one its own 128 slots. Entries are visible to a query at position p while ``c < (p + 1) // m``
(:func:`dspark_abi.layout.visible_entries`). The lightning indexer scores the ratio-4 entries
(:data:`INDEX_RATIO`).

Every function here is the one kernels-side statement of its rule: the :class:`~dspark_kernels.model.plan.BatchPlan`
derives a batch's boundary rows with :func:`boundary_rows` once, and the stages fall back to it only when they
are called on bare arrays.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.layout import physical_rows

#: Ratio of the overlapping (CSA) compressor: 8 state slots, the previous and the current window. Any other
#: ratio (128, HCA) reads its own window only.
OVERLAP_RATIO = 4
#: Compression ratio of the lightning indexer's entries (the CSA ratio-4 entries, pool ``idx``).
INDEX_RATIO = 4


def coff(ratio: int) -> int:
    """Halves per compressor row: 2 for the overlapping ratio (A and B halves), else 1."""
    return 2 if ratio == OVERLAP_RATIO else 1


def window_span(ratio: int) -> int:
    """State slots a boundary row pools: ``2 * ratio`` for the overlapping ratio, else ``ratio``."""
    return coff(ratio) * ratio


def boundary_rows(positions: np.ndarray, request: np.ndarray, ratio: int) -> np.ndarray:
    """[B] int64: live rows (request >= 0) whose position closes a ratio-``ratio`` window, ascending."""
    p = np.asarray(positions, dtype=np.int64)
    return np.flatnonzero((np.asarray(request) >= 0) & ((p + 1) % ratio == 0)).astype(np.int64)


def window_start_positions(positions: np.ndarray, ratio: int) -> np.ndarray:
    """[T] int64: ``p + 1 - ratio`` on boundary positions, else 0 (upstream's ``*_cmp_freqs`` positions)."""
    p = np.asarray(positions, dtype=np.int64)
    return np.where((p + 1) % ratio == 0, p + 1 - ratio, 0)


def window_positions(boundary_positions: np.ndarray, ratio: int) -> np.ndarray:
    """[B, span] absolute positions the boundary tokens at ``boundary_positions`` [B] pool (negative = before
    the sequence): ``p - span + 1 .. p``, span = :func:`window_span`."""
    span = window_span(ratio)
    p = np.asarray(boundary_positions, dtype=np.int64)
    return p[:, None] - span + 1 + np.arange(span, dtype=np.int64)[None, :]


def window_state_rows(positions: np.ndarray, request: np.ndarray, state_table: np.ndarray, ratio: int,
                      page_size: int, boundaries: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Boundary rows and the physical state rows of their windows.

    boundaries: the boundary rows if already known (a plan's), else derived with :func:`boundary_rows`.
    Returns (boundary row indices [B] int64, state rows [B, span] int64 with -1 for missing slots); the slots
    are 8 (ratio 4: previous then current window) or ``ratio``.
    """
    b = boundary_rows(positions, request, ratio) if boundaries is None else np.asarray(boundaries, np.int64)
    pos = window_positions(np.asarray(positions, dtype=np.int64)[b], ratio)
    return b, physical_rows(state_table, np.asarray(request)[b], pos, page_size, ring=True)


def vocab_shard_width(vocab: int, tp_size: int) -> int:
    """Vocabulary rows of every LM-head shard but possibly the last: ``ceil(V / TP)``."""
    return -(-vocab // tp_size)


def vocab_shard(vocab: int, tp_size: int, rank: int) -> slice:
    """Rank ``rank``'s contiguous vocabulary rows of the LM head: :func:`vocab_shard_width` each, the last shard
    possibly shorter (or empty when ``V < (TP - 1) * width``)."""
    width = vocab_shard_width(vocab, tp_size)
    return slice(min(rank * width, vocab), min((rank + 1) * width, vocab))
