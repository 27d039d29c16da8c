"""KV compressors: ratio 4 (CSA, overlapping windows) and ratio 128 (HCA), with their state rings.

Per live token t at position p (all rows of the TP group), in float32:
``kv_t = x_t @ wkv.T`` and ``score_t = x_t @ wgate.T + ape[p % m]`` (the learned bias goes on the gate
logits only), each [coff*d]. Every live token writes ``[kv_t | score_t]`` to its state row through the
state slot mapping. Then every boundary token ((p + 1) % m == 0, entry ``j = (p + 1) / m - 1``) reads its
window back **by absolute position** through its request's state table, after the scatter, so a window
begun in an earlier chunk continues from the ring:

* ratio 128 (coff 1): the 128 slots p-127..p, kv = row[:d], score = row[d:]. Every slot must be mapped.
* ratio 4 (coff 2): 8 slots; the A halves (kv row[:d], score row[2d:3d]) of the previous window p-7..p-4
  and the B halves (kv row[d:2d], score row[3d:]) of the current window p-3..p. Missing slots (entry 0's
  absent previous window, unmapped rows) get score -inf and contribute nothing.

``pooled[e] = sum_s softmax_s(score[s, e]) * kv[s, e]`` per channel e; then ``rms_norm(pooled, norm)`` and RoPE
on the last rd dims at the window start ``j * m = p + 1 - m`` with the compressed-layer frequencies;
the a2a3 kernels round the result to bf16. Entry j covers positions ``j*m - (m if ratio 4 else 0)`` ..
``j*m + m - 1`` and is visible to queries at positions ``>= j*m + m - 1``.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.errors import ABIError, Issue
from dspark_kernels.reference.numerics import Precision, linear, narrow, rms_norm
from dspark_kernels.reference.paged import gather_rows, physical_rows, scatter_rows
from dspark_kernels.reference.prepared import PreparedCompressor
from dspark_kernels.reference.rope import apply_rope
from dspark_kernels.reference.tiling import tiles

#: Ratio of the overlapping (CSA) compressor; any other ratio is non-overlapping.
OVERLAP_RATIO = 4
#: Boundary tokens pooled per step (bounds the [tokens, slots, d] gathers).
POOL_TILE = 512


def boundary_mask(positions: np.ndarray, request: np.ndarray, ratio: int) -> np.ndarray:
    """[T] bool: live rows whose position closes a compression window ((p + 1) % ratio == 0)."""
    p = np.asarray(positions, dtype=np.int64)
    return (np.asarray(request) >= 0) & ((p + 1) % ratio == 0)


def window_start_positions(positions: np.ndarray, ratio: int) -> np.ndarray:
    """[T] int64: ``p + 1 - ratio`` on boundary positions, else 0 (upstream's ``*_cmp_freqs`` positions)."""
    p = np.asarray(positions, dtype=np.int64)
    return np.where((p + 1) % ratio == 0, p + 1 - ratio, 0)


def _window_positions(p: np.ndarray, ratio: int) -> np.ndarray:
    """[B, slots] absolute positions read by boundary tokens at ``p`` [B] (negative = before the sequence)."""
    span = 2 * ratio if ratio == OVERLAP_RATIO else ratio
    return p[:, None] - span + 1 + np.arange(span, dtype=np.int64)[None, :]          # (B, slots)


def window_state_rows(positions: np.ndarray, request: np.ndarray, state_table: np.ndarray, ratio: int,
                      page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Boundary rows and the physical state rows of their windows.

    Returns (boundary row indices [B] int64, state rows [B, slots] int64 with -1 for missing slots);
    slots are 8 (ratio 4: previous then current window) or ``ratio``.
    """
    b = np.flatnonzero(boundary_mask(positions, request, ratio))
    pos = _window_positions(np.asarray(positions, dtype=np.int64)[b], ratio)
    return b, physical_rows(state_table, np.asarray(request)[b], pos, page_size)


def check_window_coverage(positions: np.ndarray, request: np.ndarray, state_table: np.ndarray, ratio: int,
                          page_size: int, field: str) -> list[Issue]:
    """Issues (``coverage.unmapped``) for non-overlapping windows with unmapped state slots; [] if covered.

    The ratio-4 compressor tolerates missing slots (score -inf); the ratio-128 one requires full history.
    """
    if ratio == OVERLAP_RATIO:
        return []
    b, rows = window_state_rows(positions, request, state_table, ratio, page_size)
    bad = np.flatnonzero((rows < 0).any(axis=1))
    if bad.size == 0:
        return []
    t = int(b[bad[0]])
    return [Issue("coverage.unmapped", field, f"the ratio-{ratio} window of row {t} (position "
                  f"{int(positions[t])}) has unmapped state rows", index=t, request=int(request[t]),
                  expected="every window position mapped", actual=int((rows[bad[0]] < 0).sum()),
                  count=int(bad.size))]


def compress(x: np.ndarray, positions: np.ndarray, request: np.ndarray, state_slots: np.ndarray,
             state_table: np.ndarray, state_pool: np.ndarray, weights: PreparedCompressor,
             cos: np.ndarray, sin: np.ndarray, *, page_size: int, eps: float,
             precision: Precision) -> tuple[np.ndarray, np.ndarray]:
    """Run one compressor over a TP group's rows; writes the state ring, returns the new entries.

    x: [P, X] float32 hidden rows (bf16 values in a2a3); positions [P]; request [P] (-1 padding);
    state_slots: [P] int64 state-pool row of each token (-1 = no write); state_table: [R, width] int32;
    state_pool: [rows, 2*coff*d] float32, **mutated** (the ``[kv | score]`` rows of every live token);
    cos, sin: [P, rd/2] RoPE at each row's window start (:func:`window_start_positions`).
    Returns (boundary rows [B] int64 into the P rows, entries [B, d] float32; bf16 values in a2a3).
    Raises ABIError ``coverage.unmapped`` (before writing anything) if a ratio-128 window is not mapped.
    """
    ratio, d = weights.ratio, weights.dim
    request = np.asarray(request)
    issues = check_window_coverage(positions, request, state_table, ratio, page_size, "state_table")
    if issues:
        raise ABIError(issues)
    live = np.flatnonzero(request >= 0)
    p_live = np.asarray(positions, dtype=np.int64)[live]
    x_live = x[live]
    kv = linear(x_live, weights.wkv)                                                 # (n, coff*d)
    score = linear(x_live, weights.wgate) + weights.ape[p_live % ratio]             # (n, coff*d)
    scatter_rows(state_pool, np.asarray(state_slots)[live], np.concatenate([kv, score], axis=1))

    b, rows = window_state_rows(positions, request, state_table, ratio, page_size)
    entries = np.empty((b.size, d), dtype=np.float32)
    for lo, hi in tiles(0, b.size, POOL_TILE):
        slots, valid = gather_rows(state_pool, rows[lo:hi])                         # (B, slots, 2*coff*d)
        if ratio == OVERLAP_RATIO:
            half = ratio  # previous window -> A halves, current window -> B halves
            kv_s = np.concatenate([slots[:, :half, :d], slots[:, half:, d:2 * d]], axis=1)          # (B, 8, d)
            sc_s = np.concatenate([slots[:, :half, 2 * d:3 * d], slots[:, half:, 3 * d:]], axis=1)  # (B, 8, d)
        else:
            kv_s, sc_s = slots[:, :, :d], slots[:, :, d:]                                           # (B, m, d)
        sc_s = np.where(valid[:, :, None], sc_s, -np.inf)
        top = sc_s.max(axis=1, keepdims=True)                                       # (B, 1, d)
        top = np.where(np.isfinite(top), top, 0.0)
        e = np.exp(sc_s - top)                                                      # (B, slots, d)
        weight = e / np.maximum(e.sum(axis=1, keepdims=True), np.finfo(np.float32).tiny)  # softmax over slots
        pooled = (weight * kv_s).sum(axis=1)                                        # (B, d)
        entries[lo:hi] = rms_norm(pooled, weights.norm, eps)
    roped = apply_rope(entries, cos[b], sin[b])
    return b.astype(np.int64), narrow(roped, precision)
