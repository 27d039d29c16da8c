"""The attention backends a forward runs its layers' attention with: the protocol and resolution by name.

A backend may also bring the layer's hyper-connection stages (:class:`HyperConnectionStages`: ``hc_pre`` with the
sub-block's RMSNorm fused, and ``hc_post``, the pypto backend's kernels) and the head's (:class:`HeadStages`:
``hc_head``, ``final_hidden``, ``logits_for_rows``, ``greedy``) and the MoE FFN (:class:`MoEStage`); a backend
without them runs the numpy reference's (:func:`hc_stages`, :func:`head_stages`, :func:`moe_stage`).

=============  ==============================================  ==========================================
name           backend                                         precisions
=============  ==============================================  ==========================================
``reference``  :func:`dspark_kernels.reference.attention.attend`  ``fp32``, ``a2a3``, ``deepseek``
``pypto``      :class:`dspark_kernels.pypto.PyptoAttention`    ``a2a3`` (the numerics its kernels implement)
=============  ==============================================  ==========================================
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.numerics import Precision, narrow, rms_norm
from dspark_kernels.model.plan import BatchPlan
from dspark_kernels.model.prepared import PreparedWeights

Backend = Literal["reference", "pypto"]
#: The backend names, in the order help texts list them.
BACKENDS: tuple[Backend, ...] = ("reference", "pypto")
#: The precision the pypto kernels compute.
PYPTO_PRECISION: Precision = "a2a3"


class AttentionBackend(Protocol):
    """One layer's attention over a plan's batch: ``(plan, layer, x, weights, caches) -> out``.

    plan: the batch's :class:`BatchPlan` (its ``precision`` is the one ``weights`` were prepared in).
    x: [P, hidden] float32 post-attn_norm rows of all group rows (padding rows zero). weights: the layer's
    :class:`PreparedWeights`. caches: the layer's :class:`LayerCaches`, **written in place** (every group row's
    writes). Returns [rows, hidden] float32 for the plan's query rows (zero on padding rows). The inputs are
    checked by the caller (:func:`dspark_kernels.model.checks.check_attention_inputs` or the forward's checks).
    """

    def __call__(self, plan: BatchPlan, layer: int, x: np.ndarray, weights: PreparedWeights,
                 caches: LayerCaches, /) -> np.ndarray: ...


@runtime_checkable
class HyperConnectionStages(Protocol):
    """A backend's hyper-connection stages, with the reference's signatures
    (:func:`dspark_kernels.reference.hyper_connections.hc_pre` / ``hc_post``): ``hc_pre(x_hc, weights, config,
    precision=..., norm=None)`` returns an object with ``x_mixed`` [T, D], ``post`` [T, hc] and ``comb``
    [T, hc, hc], and with ``norm`` [D] (the sub-block's ``attn_norm`` / ``ffn_norm``) also ``x_normed`` [T, D] =
    ``narrow(rms_norm(x_mixed, norm, rms_norm_eps), precision)``, the sub-block's input (a backend fuses it);
    ``hc_post(out, x_hc, post, comb, precision=...)`` returns [T, hc, D] fp32."""

    def hc_pre(self, x_hc: np.ndarray, weights: Any, config: ModelConfig, *, precision: Precision,
               norm: np.ndarray | None = None) -> Any: ...

    def hc_post(self, out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray, *,
                precision: Precision) -> np.ndarray: ...


def hc_stages(attention: object) -> tuple[Any, Any]:
    """(hc_pre, hc_post) a layer runs with this attention backend: its own when it has them, else the reference's
    (hc_pre with the numpy RMSNorm of :func:`reference_hc_pre`)."""
    if isinstance(attention, HyperConnectionStages):
        return attention.hc_pre, attention.hc_post
    from dspark_kernels.reference.hyper_connections import hc_post

    return reference_hc_pre, hc_post


@attrs.frozen(eq=False)
class NormedHcPre:
    """hc_pre's outputs (the reference's ``HcPre`` fields) and the sub-block's input: x_mixed [T, D], post
    [T, hc], comb [T, hc, hc] fp32; x_normed [T, D] fp32, ``narrow(rms_norm(x_mixed, norm), precision)``."""

    x_mixed: np.ndarray
    post: np.ndarray
    comb: np.ndarray
    x_normed: np.ndarray


def reference_hc_pre(x_hc: np.ndarray, weights: Any, config: ModelConfig, *, precision: Precision,
                     norm: np.ndarray | None = None) -> Any:
    """The reference's ``hc_pre`` and, with ``norm``, the sub-block's RMSNorm after it (:class:`NormedHcPre`)."""
    from dspark_kernels.reference.hyper_connections import hc_pre

    pre = hc_pre(x_hc, weights, config, precision=precision)
    if norm is None:
        return pre
    x_normed = narrow(rms_norm(pre.x_mixed, norm, config.rms_norm_eps), precision)
    return NormedHcPre(x_mixed=pre.x_mixed, post=pre.post, comb=pre.comb, x_normed=x_normed)


@runtime_checkable
class HeadStages(Protocol):
    """A backend's head stages, with the reference's signatures: ``hc_head``
    (:func:`dspark_kernels.reference.hyper_connections.hc_head`, also the DSpark target features),
    ``final_hidden``, ``logits_for_rows`` and ``greedy`` (:mod:`dspark_kernels.reference.head`)."""

    def hc_head(self, x_hc: np.ndarray, weights: Any, config: ModelConfig, *, precision: Precision
                ) -> np.ndarray: ...

    def final_hidden(self, x_hc: np.ndarray, weights: Any, config: ModelConfig, *, precision: Precision
                     ) -> np.ndarray: ...

    def logits_for_rows(self, x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray: ...

    def greedy(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray: ...


def head_stages(attention: object) -> HeadStages:
    """The head stages a forward runs with this attention backend: its own when it has them, else the reference's."""
    return attention if isinstance(attention, HeadStages) else ReferenceHead()


class ReferenceHead:
    """The numpy reference's head stages (:class:`HeadStages`), imported when called."""

    def hc_head(self, x_hc: np.ndarray, weights: Any, config: ModelConfig, *, precision: Precision) -> np.ndarray:
        from dspark_kernels.reference.hyper_connections import hc_head

        return hc_head(x_hc, weights, config, precision=precision)

    def final_hidden(self, x_hc: np.ndarray, weights: Any, config: ModelConfig, *, precision: Precision
                     ) -> np.ndarray:
        from dspark_kernels.reference.head import final_hidden

        return final_hidden(x_hc, weights, config, precision=precision)

    def logits_for_rows(self, x_out: np.ndarray, rows: np.ndarray, head_w: np.ndarray) -> np.ndarray:
        from dspark_kernels.reference.head import logits_for_rows

        return logits_for_rows(x_out, rows, head_w)

    def greedy(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
        from dspark_kernels.reference.head import greedy

        return greedy(logits, rows)


@runtime_checkable
class MoEStage(Protocol):
    """A backend's MoE FFN, with the reference's signature (:func:`dspark_kernels.reference.moe.moe`):
    ``moe(x, weights, config, norm=..., token_ids=..., live=..., precision=...)`` -> [T, D] fp32, where x holds
    hc_pre's ``x_mixed`` rows and ``norm`` the layer's ``ffn_norm`` (the stage applies the RMSNorm itself)."""

    def moe(self, x: np.ndarray, weights: Any, config: ModelConfig, *, norm: np.ndarray | None = None,
            token_ids: np.ndarray | None = None, live: np.ndarray | None = None, precision: Precision
            ) -> np.ndarray: ...


def moe_stage(attention: object) -> Any:
    """The MoE FFN a layer runs with this attention backend: its own when it has one, else the reference's."""
    if isinstance(attention, MoEStage):
        return attention.moe
    from dspark_kernels.reference.moe import moe

    return moe


def backend_issues(backend: object, precision: object) -> list[Issue]:
    """``config.invalid`` issues of a backend name and the precision asked of it (empty = resolvable)."""
    if backend not in BACKENDS:
        return [Issue("config.invalid", "backend", "unknown backend", expected=list(BACKENDS), actual=backend)]
    if backend == "pypto" and precision != PYPTO_PRECISION:
        return [Issue("config.invalid", "precision", "the pypto backend computes the a2a3 kernels' numerics",
                      expected=PYPTO_PRECISION, actual=precision)]
    return []


def resolve_backend(backend: str, precision: str) -> AttentionBackend:
    """The :class:`AttentionBackend` of ``backend`` for layers computed in ``precision``.

    'pypto' imports :mod:`dspark_kernels.pypto` now (not pypto itself: its kernels run in child processes); the
    result pickles, so a launcher can resolve it once for all ranks. Raises :class:`ABIError`
    (``config.invalid``) for an unknown backend or a precision it cannot compute.
    """
    issues = backend_issues(backend, precision)
    if issues:
        raise ABIError(issues)
    if backend == "pypto":
        from dspark_kernels import pypto

        return pypto.PyptoAttention()
    from dspark_kernels.reference.attention import attend

    return attend
