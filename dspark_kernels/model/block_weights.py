"""The value classes of a layer's non-attention weights and of the head, as :class:`ModelWeights` builds them
and the reference stages (``hyper_connections``, ``moe``, ``head``) read them.

:class:`HcWeights` (one hyper-connection mixer), :class:`MoEWeights` (one layer's FFN) and :class:`HeadWeights`
(hc_head mixer, final norm and LM head). Checkpoint names are in :mod:`dspark_kernels.model.weight_specs`.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np

from dspark_abi import ABIError, Issue


@attrs.frozen
class HcWeights:
    """One hyper-connection mixer (``hc_attn_*``, ``hc_ffn_*`` or ``hc_head_*``), all fp32.

    fn: [(2 + hc) * hc, hc * D] for a layer mixer, [hc, hc * D] for the head.
    scale: [3] for a layer mixer (pre, post, comb), [1] for the head.
    base: [(2 + hc) * hc] or [hc].
    """

    fn: np.ndarray
    scale: np.ndarray
    base: np.ndarray


@attrs.frozen(eq=False)
class ExpertStack:
    """One layer's routed-expert matrices of one kind (``w1``, ``w2`` or ``w3``), read per expert on demand.

    ``stack[e]`` is expert e's [out, in] float32 matrix, read from the checkpoint (or generated) now and not
    kept, so a layer holds only the experts its tokens are routed to, one at a time; ``shape`` is the stack's
    [E, out, in], as a stacked array's. ``int8(e)`` is the expert's stored int8 weight with its per-channel
    scale ([out, in] float32 integers, [out] float32) when the checkpoint stores it so (W8A8), else None.
    """

    shape: tuple[int, int, int]
    read: Callable[[int], np.ndarray]
    read_int8: Callable[[int], tuple[np.ndarray, np.ndarray] | None] | None = None

    @property
    def ndim(self) -> int:
        return 3

    def __len__(self) -> int:
        return self.shape[0]

    def _index(self, e: object) -> int:
        if isinstance(e, bool) or not isinstance(e, int | np.integer) or not 0 <= int(e) < self.shape[0]:
            raise ABIError([Issue("config.mismatch", "expert", "expert ids index the layer's routed experts",
                                  expected=f"an int in [0, {self.shape[0]})", actual=repr(e),
                                  fix="index one expert at a time with its id")])
        return int(e)

    def __getitem__(self, e: int) -> np.ndarray:
        return self.read(self._index(e))

    def int8(self, e: int) -> tuple[np.ndarray, np.ndarray] | None:
        return None if self.read_int8 is None else self.read_int8(self._index(e))


@attrs.frozen
class MoEWeights:
    """One layer's FFN weights, [out, in] layouts as in the checkpoint, fp32 arrays (bf16 values for real models).

    gate_w: [E, D]. gate_bias: [E] (learned-gate layers) or None. tid2eid: [V, K] int (hash layers) or None.
    w1, w3: [E, I, D]; w2: [E, D, I] (stacked ``ffn.experts.{e}.w*``): arrays, or :class:`ExpertStack` read per
    expert (streaming weights); index them one expert at a time (``w1[e]``), which both support.
    shared_w1, shared_w3: [S*I, D]; shared_w2: [D, S*I], or None when ``n_shared_experts == 0``.
    fp8_stored: block-relative names (``ffn.experts.w1``, ``ffn.shared_experts.w2``, ...) of the projections stored
    FP8 / FP4 as loaded (a routed stack counts when every expert is); precision ``"deepseek"`` quantises their
    inputs (:func:`dspark_kernels.model.deepseek_numerics.fp8_inputs`). Empty for float weights.
    """

    gate_w: np.ndarray
    gate_bias: np.ndarray | None
    tid2eid: np.ndarray | None
    w1: np.ndarray | ExpertStack
    w2: np.ndarray | ExpertStack
    w3: np.ndarray | ExpertStack
    shared_w1: np.ndarray | None = None
    shared_w2: np.ndarray | None = None
    shared_w3: np.ndarray | None = None
    fp8_stored: frozenset[str] = frozenset()


@attrs.frozen
class HeadWeights:
    """hc_head mixer, final norm ``norm.weight`` [D] and LM head ``head.weight`` [V, D] (fp32 arrays)."""

    hc: HcWeights
    norm: np.ndarray
    head: np.ndarray
