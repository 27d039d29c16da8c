"""The value classes of a layer's non-attention weights and of the head, as :class:`ModelWeights` builds them
and the reference stages (``hyper_connections``, ``moe``, ``head``) read them.

:class:`HcWeights` (one hyper-connection mixer), :class:`MoEWeights` (one layer's FFN) and :class:`HeadWeights`
(hc_head mixer, final norm and LM head). Checkpoint names are in :mod:`dspark_kernels.model.weight_specs`.
"""

from __future__ import annotations

import attrs
import numpy as np


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


@attrs.frozen
class MoEWeights:
    """One layer's FFN weights, [out, in] layouts as in the checkpoint, fp32 arrays (bf16 values for real models).

    gate_w: [E, D]. gate_bias: [E] (learned-gate layers) or None. tid2eid: [V, K] int (hash layers) or None.
    w1, w3: [E, I, D]; w2: [E, D, I] (stacked ``ffn.experts.{e}.w*``).
    shared_w1, shared_w3: [S*I, D]; shared_w2: [D, S*I], or None when ``n_shared_experts == 0``.
    """

    gate_w: np.ndarray
    gate_bias: np.ndarray | None
    tid2eid: np.ndarray | None
    w1: np.ndarray
    w2: np.ndarray
    w3: np.ndarray
    shared_w1: np.ndarray | None = None
    shared_w2: np.ndarray | None = None
    shared_w3: np.ndarray | None = None


@attrs.frozen
class HeadWeights:
    """hc_head mixer, final norm ``norm.weight`` [D] and LM head ``head.weight`` [V, D] (fp32 arrays)."""

    hc: HcWeights
    norm: np.ndarray
    head: np.ndarray
