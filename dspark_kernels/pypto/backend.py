"""The pypto backend (``backend="pypto"``): every stage of :class:`~dspark_kernels.model.backends.Backend` through
the pypto kernels, in the numerics they implement (``a2a3``).

The registry of :mod:`dspark_kernels.model.backends` resolves the name ``"pypto"`` to :class:`PyptoBackend`. Its
attention runs the model layer's orchestrator over :class:`~dspark_kernels.pypto.attention.PyptoStages` in one
child process per layer (``isolate``, the default: pypto leaks ~23 MB per kernel call and can end the process on
some errors); the hyper-connection, MoE and head stages run their kernels in child processes too. Importing this
module imports neither torch nor pypto.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import attrs
import numpy as np

from dspark_abi import Issue, ModelConfig, PackedBatch
from dspark_kernels.model.accept import Acceptance, accept_greedy
from dspark_kernels.model.backends import PYPTO_PRECISION as PRECISION
from dspark_kernels.model.backends import HcMix
from dspark_kernels.model.block_weights import HcWeights, HeadWeights, MoEWeights
from dspark_kernels.model.caches import POOLS_BY_KIND, LayerCaches
from dspark_kernels.model.numerics import Precision
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import PreparedWeights
from dspark_kernels.pypto.attention import attend_in_process
from dspark_kernels.pypto.index_guard import index_range_issues
from dspark_kernels.pypto.isolate import run_isolated

T = TypeVar("T")


@attrs.define(eq=False)
class PyptoBackend:
    """The pypto kernels' :class:`~dspark_kernels.model.backends.Backend` (a2a3). isolate: False runs pypto in
    this process. It keeps no per-plan state (the batch's lookups are the plan's): one instance serves any number
    of plans (the ranks of an in-process TP group share one)."""

    isolate: bool = True

    def batch_issues(self, batch: PackedBatch, layers: Sequence[int], tables: Mapping[str, np.ndarray] | None = None
                     ) -> list[Issue]:
        """``kernel.index_range`` issues of the kernels' fp32 indices over ``layers``: every table the layers read
        (R_t * its column count: the batch's own [R, w] tables, or ``tables``, e.g. the persistent [S, w_p] tables
        of a persistent step), every block of its pool (blocks * page_size, not only the blocks mapped now, so a
        geometry fails on its first call) and the positions."""
        cfg = batch.config
        issues = []
        top = int(batch.positions.max(initial=0))
        read = dict(batch.tables.items()) if tables is None else tables
        for pool in sorted({p for i in layers for p in POOLS_BY_KIND[cfg.layer_kind(i)]}):
            pl = cfg.layout.pools[pool]
            table = read[pool]  # the kernels flatten the table they read, its own rows and columns (R_t * W_t)
            issues += index_range_issues(f"{pool}_block_table", requests=table.shape[0],
                                         width=table.shape[1], page=pl.page_size,
                                         max_block=batch.pool_blocks[pool] - 1, max_position=top, ring=pl.is_ring)
        return issues + index_range_issues("positions", requests=0, width=1, page=1, max_block=-1,
                                           max_position=top)

    def hc_pre(self, x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision,
               norm: np.ndarray | None = None) -> HcMix:
        """The reference's ``hc_pre`` in a2a3 numerics, through :mod:`dspark_kernels.pypto.hyper_connections`;
        with ``norm`` [D] the sub-block's RMSNorm of ``x_mixed`` is fused into the kernel (``x_normed``)."""
        _check_precision(precision)
        return HcMix(*self._run(_hc_pre, x_hc, weights, config, norm))

    def attention(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                  caches: LayerCaches) -> np.ndarray:
        """:func:`~dspark_kernels.pypto.attention.attend_in_process`, in a child process when isolated (its
        caches are copied back in place)."""
        if plan.precision != PRECISION or weights.precision != PRECISION:
            raise ValueError(f"the pypto kernels compute {PRECISION}, not plan {plan.precision} / weights "
                             f"{weights.precision}")
        if not self.isolate:
            return attend_in_process(plan, layer, x, weights, caches)
        out, updated = run_isolated(_attention_and_caches, plan, layer, x, weights, caches)
        for name, array in caches.arrays().items():
            array[...] = updated[name]
        result: np.ndarray = out
        return result

    def hc_post(self, out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray, *,
                precision: Precision) -> np.ndarray:
        """The reference's ``hc_post`` in a2a3 numerics, through :mod:`dspark_kernels.pypto.hyper_connections`."""
        _check_precision(precision)
        return self._run(_hc_post, out, x_hc, post, comb)

    def moe(self, x: np.ndarray, weights: MoEWeights, config: ModelConfig, *, norm: np.ndarray | None = None,
            token_ids: np.ndarray | None = None, live: np.ndarray | None = None, precision: Precision
            ) -> np.ndarray:
        """The reference's ``moe`` in a2a3 numerics, through :mod:`dspark_kernels.pypto.moe`: its gate and experts
        kernels run in child processes (when isolated); the grouping by expert and the experts' int8 weights are
        prepared in this process, so only arrays travel."""
        _check_precision(precision)
        from dspark_kernels.pypto.moe import moe

        return moe(x, weights, config, norm=norm, token_ids=token_ids, live=live,
                   run=run_isolated if self.isolate else None)

    def hc_head(self, x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, *, precision: Precision
                ) -> np.ndarray:
        """The reference's ``hc_head`` in a2a3 numerics (the DSpark target features): [T, D] fp32 (bf16 values)."""
        _check_precision(precision)
        return self._run(_hc_head, x_hc, weights, config)

    def stream_mean(self, x_hc: np.ndarray, *, precision: Precision) -> np.ndarray:
        """The reference head's ``stream_mean`` (DeepSeek's DSpark target feature) in a2a3: [T, D] bf16 values."""
        _check_precision(precision)
        return self._run(_stream_mean, x_hc)

    def final_hidden(self, x_hc: np.ndarray, weights: HeadWeights, config: ModelConfig, *, precision: Precision
                     ) -> np.ndarray:
        """The reference's ``final_hidden`` (hc_head + final RMSNorm) in a2a3 numerics: [T, D] fp32 (bf16 values)."""
        _check_precision(precision)
        return self._run(_final_hidden, x_hc, weights, config)

    def logits_for_rows(self, x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
        """The reference's ``logits_for_rows`` (``head_w``: the whole head or this rank's vocabulary shard)."""
        return self._run(_logits_for_rows, x_out, rows, head_w)

    def greedy(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The reference's ``greedy``: [M] int64 first-maximum ids, -1 on inactive rows."""
        return self._run(_greedy, logits, rows)

    def accept(self, tokens: np.ndarray, greedy: np.ndarray, widths: np.ndarray) -> Acceptance:
        """The shared acceptance stage (:func:`~dspark_kernels.model.accept.accept_greedy`): integer work on
        the ids ``greedy`` returned, on the host (no kernel)."""
        return accept_greedy(tokens, greedy, widths)

    def _run(self, func: Callable[..., T], *args: object) -> T:
        return run_isolated(func, *args) if self.isolate else func(*args)

    def __call__(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                 caches: LayerCaches) -> np.ndarray:
        """Deprecated (one minor version): the attention stage, :meth:`attention`."""
        return self.attention(plan, layer, x, weights, caches)


def _check_precision(precision: str) -> None:
    if precision != PRECISION:
        raise ValueError(f"the pypto kernels compute {PRECISION}, not {precision}")


def _attention_and_caches(plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                          caches: LayerCaches) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """In the kernel process: the layer's output rows and every cache array (they travel back)."""
    out = attend_in_process(plan, layer, x, weights, caches)
    return out, caches.arrays()


def _hc_pre(x_hc: np.ndarray, weights: HcWeights, config: ModelConfig, norm: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """In the kernel process: hc_pre's arrays (plain arrays travel back; the kernel module stays in the child)."""
    from dspark_kernels.pypto.hyper_connections import hc_pre

    result = hc_pre(x_hc, weights, config, norm=norm)
    return result.x_mixed, result.post, result.comb, result.x_normed


def _hc_post(out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    from dspark_kernels.pypto.hyper_connections import hc_post

    return hc_post(out, x_hc, post, comb)


def _hc_head(x_hc: np.ndarray, weights: HcWeights, config: ModelConfig) -> np.ndarray:
    from dspark_kernels.pypto.hyper_connections import hc_head

    return hc_head(x_hc, weights, config)


def _stream_mean(x_hc: np.ndarray) -> np.ndarray:
    from dspark_kernels.pypto.head import stream_mean

    return stream_mean(x_hc)


def _final_hidden(x_hc: np.ndarray, weights: HeadWeights, config: ModelConfig) -> np.ndarray:
    from dspark_kernels.pypto.head import final_hidden

    return final_hidden(x_hc, weights, config)


def _logits_for_rows(x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
    from dspark_kernels.pypto.head import logits_for_rows

    return logits_for_rows(x_out, rows, head_w)


def _greedy(logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    from dspark_kernels.pypto.head import greedy

    return greedy(logits, rows)
