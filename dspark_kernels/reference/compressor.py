"""Stage 4 (reference): KV compressors, ratio 4 (CSA, overlapping windows) and ratio 128 (HCA), with their state
rings; and stage 5's key compressor of the lightning indexer (:func:`compress_index_keys`).

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

Indexer keys (CSA, all group rows): the ratio-4 compressor at ``index_head_dim`` (own weights and state pool),
then the Hadamard rotation ``z = y @ Hd`` (Sylvester / sqrt(dI)). fp32 stores z exactly (scale 1.0); a2a3 rounds
z to bf16 (y already bf16, Hd bf16) and stores ``int8q(z)``: int8 row + float32 dequant scale.

deepseek (the official ``Compressor.forward``): projections, state and pooling in fp32 as above; the pooled entry
is rounded to bf16 before its RMSNorm, the norm output and the roped entry are bf16; then the main compressors
FP8-fake-quantise the non-RoPE dims (:func:`~dspark_kernels.model.deepseek_numerics.kv_fake_quant`) and the
indexer's rotates and FP4-fake-quantises all dI dims
(:func:`~dspark_kernels.model.deepseek_numerics.index_fake_quant`), stored as float32 with scale 1.0.

A compressor's state addressing is one :class:`~dspark_kernels.model.plan.CompressorState`: a forward's comes from
its plan (the plan's table, table rows and windows of the state pool); built on bare arrays without ``windows``,
the stage looks the windows up (:func:`~dspark_kernels.model.geometry.window_state_rows`).
"""

from __future__ import annotations

import numpy as np

from dspark_abi import ABIError
from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.checks import coverage_issues
from dspark_kernels.model.geometry import OVERLAP_RATIO
from dspark_kernels.model.numerics import Precision, bf16_round, int8_quantize, linear, narrow, rms_norm
from dspark_kernels.model.plan import CompressorState, IndexKeyPools, RopeRows
from dspark_kernels.model.prepared import PreparedCompressor, PreparedWeights
from dspark_kernels.model.rope import apply_rope
from dspark_kernels.reference.paged import gather_rows, scatter_rows
from dspark_kernels.reference.tiling import tiles

#: Boundary tokens pooled per step (bounds the [tokens, slots, d] gathers).
POOL_TILE = 512


def compress(x: np.ndarray, positions: np.ndarray, request: np.ndarray, state: CompressorState,
             weights: PreparedCompressor, start: RopeRows, *, eps: float, precision: Precision,
             rotate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Run one compressor over a TP group's rows; writes the state ring, returns the new entries.

    x: [P, X] float32 hidden rows (bf16 values in a2a3); positions [P]; request [P] (-1 padding);
    state: the state ring (**mutated**: the ``[kv | score]`` rows of every live token) and its addressing
    (:class:`~dspark_kernels.model.plan.CompressorState`; a plan's from
    :meth:`~dspark_kernels.model.plan.BatchPlan.compressor_state`); start: RoPE cos / sin [P, rd/2] at each row's
    window start (:func:`~dspark_kernels.model.geometry.window_start_positions`). rotate: the indexer's key
    compressor (official ``Compressor(rotate=True)``): no FP8 KV fake quant in deepseek
    (:func:`compress_index_keys` rotates instead).
    Returns (boundary rows [B] int64 into the P rows, entries [B, d] float32; bf16 values in a2a3 and deepseek,
    FP8-fake-quantised non-RoPE dims in deepseek unless ``rotate``).
    Raises ABIError ``coverage.unmapped`` (before writing anything) if a ratio-128 window is not mapped.
    """
    ratio, d = weights.ratio, weights.dim
    request = np.asarray(request)
    b, rows = state.window_rows(positions, ratio)
    issues = coverage_issues(positions, request, b, rows, ratio, "state_table")
    if issues:
        raise ABIError(issues)
    live = np.flatnonzero(request >= 0)
    p_live = np.asarray(positions, dtype=np.int64)[live]
    x_live = x[live]
    kv = linear(x_live, weights.wkv)                                                 # (n, coff*d)
    score = linear(x_live, weights.wgate) + weights.ape[p_live % ratio]             # (n, coff*d)
    scatter_rows(state.pool, np.asarray(state.slots)[live], np.concatenate([kv, score], axis=1))

    entries = np.empty((b.size, d), dtype=np.float32)
    for lo, hi in tiles(0, b.size, POOL_TILE):
        slots, valid = gather_rows(state.pool, rows[lo:hi])                         # (B, slots, 2*coff*d)
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
        if precision == "deepseek":  # kv.to(bf16) before the norm, whose output is bf16 too
            pooled = narrow(rms_norm(narrow(pooled, precision), weights.norm, eps), precision)
        else:
            pooled = rms_norm(pooled, weights.norm, eps)
        entries[lo:hi] = pooled
    roped = narrow(apply_rope(entries, start.cos[b], start.sin[b]), precision)
    if precision == "deepseek" and not rotate:
        roped = ds.kv_fake_quant(roped, 2 * start.cos.shape[-1])
    return b.astype(np.int64), roped


def compress_index_keys(x: np.ndarray, positions: np.ndarray, request: np.ndarray, state: CompressorState,
                        w: PreparedWeights, start: RopeRows, *, eps: float, precision: Precision
                        ) -> tuple[np.ndarray, IndexKeyPools]:
    """Indexer compressor over a TP group's rows; **mutates** the inner state ring (``state.pool``).

    x [P, X]; positions, request [P]; state: the ``csa_inner_state`` ring and its addressing ([rows, 4*dI]);
    start: RoPE [P, rd/2] at each row's window start. Returns (boundary rows b [B] int64, their keys
    [B, dI] (int8 in a2a3, float32 in fp32 and deepseek) and scales [B] float32): the caller writes them to the
    idx and idx_scale pools through the idx slots of rows b, as the pypto backend's
    :func:`~dspark_kernels.pypto.compressor.compress_into` returns them.
    """
    if w.idx_compressor is None or w.idx_hadamard is None:
        raise ValueError("compress_index_keys needs CSA weights (indexer compressor and Hadamard)")
    b, y = compress(x, positions, request, state, w.idx_compressor, start, eps=eps, precision=precision, rotate=True)
    z = ds.index_fake_quant(y) if precision == "deepseek" else y @ w.idx_hadamard     # (B, dI)
    if precision != "a2a3":
        return b, IndexKeyPools(z, np.ones(b.size, dtype=np.float32))
    z_q, z_scale = int8_quantize(bf16_round(z))
    return b, IndexKeyPools(z_q.astype(np.int8), z_scale)
