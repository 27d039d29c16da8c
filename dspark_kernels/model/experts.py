"""What both MoE backends share about routed experts: grouping a batch's (row, slot) pairs by expert, and the
int8 W8A8 form of the expert weights the a2a3 kernels read.

:class:`ExpertGroups` is host metadata (a stable counting sort of the gate's [T, K] expert ids): each expert then
runs one matmul over all its rows, one Python iteration per expert used, never one per token.

:func:`expert_int8` / :func:`linear_int8`: int8 weights with one float32 dequant scale per output channel, the
format of upstream's a2a3 MoE kernels (hw-native-sys/pypto-lib commit 634e77b,
``models/deepseek_v4_flash_dspark/expert_routed.py`` and ``expert_shared.py``: ``routed_w1`` [E, I, D] int8 with
``routed_w1_scale`` [E, I] fp32, ``shared_w2`` [D, I] int8 with ``shared_w2_scale`` [D]); the rule is
:func:`dspark_kernels.model.quant.quant_int8_channels`. An expert is quantised when a batch routes a token to it
(a streaming :class:`~dspark_kernels.model.block_weights.ExpertStack` reads it then), or its stored int8 values
are used as they are when the checkpoint holds it so (``ExpertStack.int8``).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np

from dspark_abi import ABIError, Issue
from dspark_kernels.model.block_weights import ExpertStack
from dspark_kernels.model.quant import quant_int8_channels


@attrs.frozen(eq=False)
class ExpertGroups:
    """The (row, slot) pairs of a [T, K] expert-id table grouped by expert (pair id ``p = t * K + k``).

    pairs: [T*K] int64, grouped by ascending expert id, in token order within an expert (a stable sort).
    experts: [U] int64, the expert ids that own at least one pair, ascending.
    bounds: [U + 1] int64: ``experts[u]`` owns ``pairs[bounds[u]:bounds[u + 1]]``.
    slots: K. A row picks one expert twice only through a hash table; both pairs are kept.
    """

    pairs: np.ndarray
    experts: np.ndarray
    bounds: np.ndarray
    slots: int

    @classmethod
    def build(cls, expert_ids: np.ndarray, n_experts: int) -> ExpertGroups:
        """Group ``expert_ids`` [T, K] (ints in ``[0, n_experts)``; :func:`check_expert_ids` otherwise)."""
        ids = check_expert_ids(expert_ids, n_experts)
        flat = ids.reshape(-1).astype(np.int64)
        counts = np.bincount(flat, minlength=n_experts)
        experts = np.flatnonzero(counts)
        bounds = np.concatenate([[0], np.cumsum(counts[experts])]).astype(np.int64)
        return cls(pairs=np.argsort(flat, kind="stable"), experts=experts.astype(np.int64), bounds=bounds,
                   slots=int(ids.shape[1]))

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        """(expert id, its pair ids [n_e]) for every expert used, ascending."""
        for u, e in enumerate(self.experts):
            yield int(e), self.pairs[self.bounds[u]:self.bounds[u + 1]]

    def counts(self) -> np.ndarray:
        """[U] int64 pairs per used expert."""
        return np.diff(self.bounds)


def check_expert_ids(expert_ids: np.ndarray, n_experts: int, field: str = "expert_ids") -> np.ndarray:
    """``expert_ids`` ([T, K] or a [V, K] ``tid2eid`` table) as an array, or ABIError: ``array.shape`` for a non-2-D
    or non-integer table, ``config.mismatch`` naming the first id outside ``[0, n_experts)`` and their count."""
    ids = np.asarray(expert_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ABIError([Issue("array.shape", field, "expert ids are a 2-D integer table",
                              expected="[rows, K] int", actual=f"{list(ids.shape)} {ids.dtype}")])
    bad = np.flatnonzero((ids < 0) | (ids >= n_experts))
    if bad.size:
        r, k = divmod(int(bad[0]), ids.shape[1])
        raise ABIError([Issue("config.mismatch", f"{field}[{r}, {k}]",
                              f"expert ids index the layer's {n_experts} routed experts ({bad.size} out of range)",
                              expected=f"[0, {n_experts})", actual=int(ids[r, k]),
                              fix="check tid2eid against n_routed_experts")])
    return ids


def linear_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An [out, in] weight as int8 [out, in] and its [out] float32 per-output-channel dequant scale."""
    return quant_int8_channels(np.asarray(w, dtype=np.float32), axis=-1)


def expert_int8(stack: np.ndarray | ExpertStack, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ``e`` of a stacked [E, out, in] weight as (int8 [out, in], [out] float32 dequant scale).

    The checkpoint's own int8 values and scales when it stores the expert so (``ExpertStack.int8``; re-quantising
    them would move scales an ulp), else :func:`linear_int8` of the float weight, read now.
    """
    stored = stack.int8(e) if isinstance(stack, ExpertStack) else None
    if stored is not None:
        q, scale = stored
        return np.asarray(q).astype(np.int8), np.asarray(scale, dtype=np.float32)
    return linear_int8(stack[e])
