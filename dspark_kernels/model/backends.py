"""The attention backends a forward runs its layers' attention with: the protocol and resolution by name.

A backend may also bring the layer's hyper-connection stages (:class:`HyperConnectionStages`: ``hc_pre`` and
``hc_post``, the pypto backend's kernels); a backend without them runs the numpy reference's
(:func:`hc_stages`).

=============  ==============================================  ==========================================
name           backend                                         precisions
=============  ==============================================  ==========================================
``reference``  :func:`dspark_kernels.reference.attention.attend`  ``fp32``, ``a2a3``
``pypto``      :class:`dspark_kernels.pypto.PyptoAttention`    ``a2a3`` (the numerics its kernels implement)
=============  ==============================================  ==========================================
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.model.numerics import Precision
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
    precision=...)`` returns an object with ``x_mixed`` [T, D], ``post`` [T, hc] and ``comb`` [T, hc, hc];
    ``hc_post(out, x_hc, post, comb, precision=...)`` returns [T, hc, D] fp32."""

    def hc_pre(self, x_hc: np.ndarray, weights: Any, config: ModelConfig, *, precision: Precision) -> Any: ...

    def hc_post(self, out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray, *,
                precision: Precision) -> np.ndarray: ...


def hc_stages(attention: object) -> tuple[Any, Any]:
    """(hc_pre, hc_post) a layer runs with this attention backend: its own when it has them, else the reference's."""
    if isinstance(attention, HyperConnectionStages):
        return attention.hc_pre, attention.hc_post
    from dspark_kernels.reference.hyper_connections import hc_post, hc_pre

    return hc_pre, hc_post


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
