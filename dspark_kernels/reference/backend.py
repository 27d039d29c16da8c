"""The reference backend (``backend="reference"``): every stage of :class:`~dspark_kernels.model.backends.Backend`
through the numpy reference, in every precision (``fp32``, ``a2a3``, ``deepseek``).

The registry of :mod:`dspark_kernels.model.backends` resolves the name ``"reference"`` to :class:`ReferenceBackend`;
its attention runs the model layer's orchestrator over :class:`~dspark_kernels.reference.attention.ReferenceStages`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dspark_abi import Issue, ModelConfig, PackedBatch
from dspark_kernels.model.accept import Acceptance, accept_greedy
from dspark_kernels.model.backends import HcMix
from dspark_kernels.model.block_weights import HcWeights, HeadWeights, MoEWeights
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.numerics import Precision, narrow, rms_norm
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import PreparedWeights
from dspark_kernels.reference import head, hyper_connections, moe
from dspark_kernels.reference.attention import attend


class ReferenceBackend:
    """The numpy reference's :class:`~dspark_kernels.model.backends.Backend` (stateless; pickles)."""

    def batch_issues(self, batch: PackedBatch, layers: Sequence[int], tables: Mapping[str, np.ndarray] | None = None
                     ) -> list[Issue]:
        """None: the reference computes any valid batch, through any tables that map its pages."""
        return []

    def hc_pre(self, x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision,
               norm: np.ndarray | None = None) -> HcMix:
        """:func:`~dspark_kernels.reference.hyper_connections.hc_pre`, then with ``norm`` the sub-block's RMSNorm."""
        pre = hyper_connections.hc_pre(x_hc, weights, config, precision=precision)
        x_normed = None if norm is None else narrow(rms_norm(pre.x_mixed, norm, config.rms_norm_eps), precision)
        return HcMix(x_mixed=pre.x_mixed, post=pre.post, comb=pre.comb, x_normed=x_normed)

    def attention(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                  caches: LayerCaches) -> np.ndarray:
        """:func:`~dspark_kernels.reference.attention.attend`."""
        return attend(plan, layer, x, weights, caches)

    def hc_post(self, out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray, *,
                precision: Precision) -> np.ndarray:
        """:func:`~dspark_kernels.reference.hyper_connections.hc_post`."""
        return hyper_connections.hc_post(out, x_hc, post, comb, precision=precision)

    def moe(self, x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
            token_ids: np.ndarray | None = None, live: np.ndarray | None = None, precision: Precision
            ) -> np.ndarray:
        """:func:`~dspark_kernels.reference.moe.moe`."""
        return moe.moe(x, weights, config, norm=norm, token_ids=token_ids, live=live, precision=precision)

    def hc_head(self, x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision
                ) -> np.ndarray:
        """:func:`~dspark_kernels.reference.hyper_connections.hc_head`."""
        return hyper_connections.hc_head(x_hc, weights, config, precision=precision)

    def stream_mean(self, x_hc: np.ndarray, *, precision: Precision) -> np.ndarray:
        """:func:`~dspark_kernels.reference.head.stream_mean`."""
        return head.stream_mean(x_hc, precision=precision)

    def final_hidden(self, x_hc: np.ndarray, weights: HeadWeights, config: ModelConfig, *, precision: Precision
                     ) -> np.ndarray:
        """:func:`~dspark_kernels.reference.head.final_hidden`."""
        return head.final_hidden(x_hc, weights, config, precision=precision)

    def logits_for_rows(self, x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
        """:func:`~dspark_kernels.reference.head.logits_for_rows`."""
        return head.logits_for_rows(x_out, rows, head_w)

    def greedy(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """:func:`~dspark_kernels.reference.head.greedy`."""
        return head.greedy(logits, rows)

    def accept(self, tokens: np.ndarray, greedy: np.ndarray, widths: np.ndarray) -> Acceptance:
        """:func:`~dspark_kernels.model.accept.accept_greedy`."""
        return accept_greedy(tokens, greedy, widths)
