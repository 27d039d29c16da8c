"""The MoE FFN on A2/A3: gate (deferred ffn RMSNorm, sqrtsoftplus, top-k or hash routing, W8A8 activations),
routed experts grouped by expert, shared expert, combine (upstream's ``gate``, ``expert_routed``,
``expert_shared`` and ``combine``, hw-native-sys/pypto-lib commit 634e77b, ``models/deepseek_v4_flash_dspark/``).

Mirrors :func:`dspark_kernels.reference.moe.moe` with ``precision="a2a3"`` op for op (the numerics are stated
there). T = the live rows (the host drops padding rows and returns zeros for them), D hidden, E experts
(padded to Ep, a multiple of 8), K slots (padded to Kp, a multiple of 8 columns), I the expert width, SI the shared
expert's width, U the experts the batch uses. Three kernels per layer: the gate, the routed experts (one call per
at most :data:`MAX_TILES_PER_CALL` tiles) and the shared expert + combine.

The kernels live one per module, their names importable from here: :mod:`~dspark_kernels.pypto.moe_gate`
(``gate``), :mod:`~dspark_kernels.pypto.moe_routed` (``routed``) and :mod:`~dspark_kernels.pypto.moe_shared` (the
shared expert + ``combine``); this module holds the host side: the grouping between the calls, the launchers of
the experts and the stage entry (:func:`run_moe`, :func:`moe`).

Between the calls the host groups the (row, slot) pairs by expert (:class:`~dspark_kernels.model.experts.ExpertGroups`:
metadata, a stable counting sort of ``ids``), pads each expert's rows to whole tiles of :data:`PAIR_TILE` and
quantises the U experts used (:func:`~dspark_kernels.model.experts.expert_int8`). The expert count per tile is
data the grouping produces, so the gate and the experts cannot be one call in pypto 0.2.0 (static shapes per
call; on an NPU the tile count would be a dynamic dim read from the counts, upstream's ``recv_expert_count``).

Importing this module imports neither torch nor pypto: the kernels are built in the process that runs them
(``run`` below).
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from collections.abc import Callable
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_kernels.model.block_weights import MoEWeights
from dspark_kernels.model.experts import ExpertGroups, check_expert_ids, expert_int8, linear_int8
from dspark_kernels.model.numerics import bf16_round
from dspark_kernels.pypto.moe_gate import (
    GATE_M,
    GATE_ROW_ELEMENTS,
    GATE_SCORE_ROWS,
    _direct,
    gate_kernel,
    launch_gate,
)
from dspark_kernels.pypto.moe_routed import (
    CUBE_CORES,
    CUBE_K,
    CUBE_M,
    CUBE_N,
    EXPERT_K_PANEL,
    L0_BYTES,
    L1_BYTES,
    MAX_TILES_PER_CALL,
    PAIR_TILE,
    VEC_COLS,
    VEC_ROWS,
    routed_kernel,
)
from dspark_kernels.pypto.moe_shared import combine_kernel

__all__ = ["CUBE_CORES", "CUBE_K", "CUBE_M", "CUBE_N", "EXPERT_K_PANEL", "GATE_M", "GATE_ROW_ELEMENTS",
           "GATE_SCORE_ROWS", "L0_BYTES", "L1_BYTES", "MAX_TILES_PER_CALL", "PAIR_TILE", "VEC_COLS", "VEC_ROWS",
           "ExpertTiles", "Int8Experts", "MoEResult", "combine_kernel", "gate_kernel", "launch_experts", "launch_gate",
           "moe", "routed_kernel", "run_moe"]

BF16 = ml_dtypes.bfloat16


@attrs.frozen(eq=False)
class ExpertTiles:
    """The gate's (row, slot) pairs grouped by expert and padded to whole :data:`PAIR_TILE`-row tiles (host metadata).

    pair_rows: [NT*TR] int32 row of each padded slot (pad 0); pair_w: [NT*TR, 1] fp32 routing weight (pad 0);
    tile_expert: [NT] int32, each tile's index into ``experts``; experts: [U] int64 expert ids used, ascending;
    slot_pos: [K*T] int32, the padded slot of pair (t, k) at ``k*T + t``.
    """

    pair_rows: np.ndarray
    pair_w: np.ndarray
    tile_expert: np.ndarray
    experts: np.ndarray
    slot_pos: np.ndarray

    @classmethod
    def build(cls, ids: np.ndarray, weights: np.ndarray, n_experts: int) -> "ExpertTiles":
        """From the gate's ids [T, K] and weights [T, K]."""
        t, k = ids.shape
        groups = ExpertGroups.build(ids, n_experts)
        counts = groups.counts()                                                             # (U,)
        per = -(-counts // PAIR_TILE)                                                        # tiles per expert
        first_slot = (np.cumsum(per) - per) * PAIR_TILE                                      # (U,)
        rank = np.arange(t * k) - np.repeat(groups.bounds[:-1], counts)                      # rank in the group
        where = np.repeat(first_slot, counts) + rank                                         # (T*K,) sorted pairs
        n = int(per.sum()) * PAIR_TILE
        pair_rows = np.zeros(n, np.int32)
        pair_rows[where] = groups.pairs // k
        pair_w = np.zeros((n, 1), np.float32)
        pair_w[where, 0] = np.asarray(weights, np.float32).reshape(-1)[groups.pairs]
        slot = np.empty(t * k, np.int64)
        slot[groups.pairs] = where                                                           # by pair id t*K + k
        return cls(pair_rows=pair_rows, pair_w=pair_w,
                   tile_expert=np.repeat(np.arange(len(counts)), per).astype(np.int32), experts=groups.experts,
                   slot_pos=slot.reshape(t, k).T.reshape(-1).astype(np.int32))


@attrs.frozen(eq=False)
class Int8Experts:
    """The used experts' int8 weights stacked (host weight preparation): w1, w3 [U*I, D] with [U, I] scales,
    w2 [U*D, I] with [U, D] scales; the shared expert's s1, s3 [SI, D] / [1, SI], s2 [D, SI] / [1, D], or None."""

    w1: np.ndarray
    w1_scale: np.ndarray
    w3: np.ndarray
    w3_scale: np.ndarray
    w2: np.ndarray
    w2_scale: np.ndarray
    shared: tuple[np.ndarray, ...] | None

    @classmethod
    def build(cls, weights: MoEWeights, experts: np.ndarray) -> "Int8Experts":
        """Quantise (or read the stored int8 of) each used expert once, and the shared expert."""
        stacks = {}
        for name in ("w1", "w3", "w2"):
            parts = [expert_int8(getattr(weights, name), int(e)) for e in experts]  # one read per used expert
            stacks[name] = (np.concatenate([q for q, _ in parts]), np.stack([s for _, s in parts]))
        shared: list[np.ndarray] = []
        if weights.shared_w1 is not None and weights.shared_w3 is not None and weights.shared_w2 is not None:
            for w in (weights.shared_w1, weights.shared_w3, weights.shared_w2):
                q, s = linear_int8(w)
                shared += [q, s.reshape(1, -1)]
        return cls(*stacks["w1"], *stacks["w3"], *stacks["w2"], shared=tuple(shared) if shared else None)


def launch_experts(x_q: np.ndarray, x_scale: np.ndarray, tiles: ExpertTiles, w: Int8Experts, *, slots: int,
                   limit: float, tiles_per_call: int = MAX_TILES_PER_CALL) -> tuple[np.ndarray, int | None]:
    """The routed experts kernel (one call per ``tiles_per_call`` tiles at most) and the combine kernel on numpy
    arrays: (out [T, D] bf16, cycles of all the calls; None outside sim mode)."""
    from dspark_kernels.pypto.runtime import Out, launch

    rows, hidden = x_q.shape
    used = len(tiles.experts)
    inter = w.w1.shape[0] // used
    x_scale = np.asarray(x_scale, np.float32).reshape(rows, 1)
    n = len(tiles.tile_expert)
    calls = -(-n // max(1, tiles_per_call))
    bounds = (np.arange(calls + 1) * n) // calls  # balanced: no short last call
    parts, cycles = [], []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        pick = slice(lo * PAIR_TILE, hi * PAIR_TILE)
        result = launch(routed_kernel(rows, hidden, inter, used, hi - lo, float(limit)),
                        [x_q, x_scale, tiles.pair_rows[pick], tiles.pair_w[pick], tiles.tile_expert[lo:hi],
                         w.w1, w.w1_scale, w.w3, w.w3_scale, w.w2, w.w2_scale,
                         Out(((hi - lo) * PAIR_TILE, hidden), BF16, "pairs")])
        parts.append(result.values[-1])
        cycles.append(result.cycles)
    shared_args: list[np.ndarray]
    if w.shared is None:
        shared_args = [np.zeros((1, hidden), np.int8), np.zeros((1, 1), np.float32), np.zeros((1, hidden), np.int8),
                       np.zeros((1, 1), np.float32), np.zeros((hidden, 1), np.int8), np.zeros((1, hidden), np.float32)]
        width = 0
    else:
        shared_args = list(w.shared)
        width = w.shared[0].shape[0]
    pairs = np.concatenate(parts)
    result = launch(combine_kernel(rows, hidden, len(pairs), slots, width, float(limit)),
                    [x_q, x_scale, *shared_args, pairs, tiles.slot_pos, Out((rows, hidden), BF16, "out")])
    cycles.append(result.cycles)
    return result.values[-1], None if None in cycles else sum(c for c in cycles if c is not None)


# ---------------------------------------------------------------------------------------------- host entry
@attrs.frozen(eq=False)
class MoEResult:
    """out: [T, D] fp32 holding bf16 values (padding rows 0); ids, weights: [T_live, K] routing of the live rows;
    cycles: the cost model's (gate, experts) cycles (None when no row is live or outside sim mode)."""

    out: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    cycles: tuple[int | None, int | None]


def run_moe(x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
            token_ids: np.ndarray | None = None, live: np.ndarray | None = None,
            run: Callable[..., Any] | None = None, tiles_per_call: int = MAX_TILES_PER_CALL) -> MoEResult:
    """The reference's ``moe(x, weights, config, norm=, token_ids=, live=, precision="a2a3")`` through the kernels.

    ``run(func, *args, **kwargs)`` executes each kernel launcher (``run_isolated``: a child process per call;
    None: in this process); the grouping and the expert weights are prepared in this process. ``tiles_per_call``:
    expert tiles per routed-experts call (:func:`launch_experts`). Raises
    :class:`ABIError` for a scoring function other than ``sqrtsoftplus``, missing or out-of-range token ids on a
    hash layer, or ``tid2eid`` ids outside the experts.
    """
    run = _direct if run is None else run
    moe = config.moe
    if moe.scoring_func != "sqrtsoftplus":
        raise ABIError([Issue("config.invalid", "moe.scoring_func", "the pypto MoE gate computes sqrtsoftplus scores",
                              expected="sqrtsoftplus", actual=moe.scoring_func, fix="use the reference backend")])
    x = np.asarray(x, dtype=np.float32)
    out = np.zeros(x.shape, np.float32)
    rows = np.arange(x.shape[0]) if live is None else np.flatnonzero(live)
    k = moe.num_experts_per_tok
    if rows.size == 0:
        return MoEResult(out, np.zeros((0, k), np.int64), np.zeros((0, k), np.float32), (None, None))
    ids_live = None
    if weights.tid2eid is not None:
        check_expert_ids(weights.tid2eid, int(weights.gate_w.shape[0]), "tid2eid")
        ids_live = _hash_token_ids(token_ids, rows, int(weights.tid2eid.shape[0]))
    x_q, x_scale, ids, w, gate_cycles = run(
        launch_gate, bf16_round(x[rows]), norm, np.asarray(weights.gate_w, np.float32), weights.gate_bias,
        weights.tid2eid, ids_live, slots=k, eps=config.rms_norm_eps, route_scale=moe.routed_scaling_factor,
        renormalise=moe.norm_topk_prob)
    tiles = ExpertTiles.build(ids, w, weights.w1.shape[0])
    y, expert_cycles = run(launch_experts, x_q, x_scale, tiles, Int8Experts.build(weights, tiles.experts),
                           slots=k, limit=float(moe.swiglu_limit), tiles_per_call=tiles_per_call)
    out[rows] = np.asarray(y, dtype=np.float32)
    return MoEResult(out, ids, w, (gate_cycles, expert_cycles))


def moe(x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
        token_ids: np.ndarray | None = None, live: np.ndarray | None = None,
        run: Callable[..., Any] | None = None) -> np.ndarray:
    """[T, D] fp32 (bf16 values): :func:`run_moe`'s output rows."""
    return run_moe(x, weights, config, norm=norm, token_ids=token_ids, live=live, run=run).out


def _hash_token_ids(token_ids: np.ndarray | None, rows: np.ndarray, vocab: int) -> np.ndarray:
    if token_ids is None:
        raise ABIError([Issue("token_ids.range", "token_ids", "a hash-routed layer (tid2eid) needs the rows' token ids",
                              expected="[T] int", actual=None, fix="pass token_ids")])
    ids = np.asarray(token_ids, dtype=np.int64)[rows]
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        i = int(bad[0])
        raise ABIError([Issue("token_ids.range", f"token_ids[{int(rows[i])}]",
                              f"token ids index tid2eid's {vocab} rows ({bad.size} out of range)",
                              expected=f"[0, {vocab})", actual=int(ids[i]), fix="token ids must be vocabulary ids")])
    result: np.ndarray = ids
    return result
