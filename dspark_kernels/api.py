"""`prefill(...)`: the typed entry point. Validate everything, run the forward, return typed results.

Guarantees: a malformed batch, input, weights or caches raise :class:`ABIError` listing every issue
before anything is read or written; and if a backend fails half-way, every cache row the call may have
written is restored, so caches and inputs are bit-for-bit as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import numpy as np

from dspark_abi import validate
from dspark_abi.batch import PackedBatch
from dspark_abi.errors import ABIError, Issue
from dspark_kernels.forward import ForwardResult, run_forward
from dspark_kernels.model_caches import ModelCaches
from dspark_kernels.model_weights import ModelWeights

Backend = Literal["reference", "pypto"]
BACKENDS: tuple[str, ...] = ("reference", "pypto")


@attrs.frozen(eq=False)
class RequestOutput:
    """One request's share of a prefill result."""

    index: int
    """Position of the request in the batch (0..R-1)."""
    request_id: int
    rows: slice
    """Its group rows ``[query_start_loc[i], query_start_loc[i+1])``."""
    positions: np.ndarray
    """[n_i] int32 positions of its new tokens."""
    hidden: np.ndarray
    """[n_i, D] float32 final hidden rows."""
    sampled: int | None
    """Greedy next token from its last row, when that row was among the logit rows."""


@attrs.frozen(eq=False)
class PrefillResult:
    """Outputs of one prefill call.

    hidden: [P, D] float32 final-norm hidden rows (padding rows zero).
    x_hc: [P, hc, D] float32 residual streams after the last layer run.
    logit_rows: [M] int32 group rows sampled (-1 inactive); logits: [M, V] float32; sampled: [M] int64 (-1 inactive).
    """

    batch: PackedBatch
    hidden: np.ndarray
    x_hc: np.ndarray
    logit_rows: np.ndarray
    logits: np.ndarray
    sampled: np.ndarray

    @property
    def requests(self) -> list[RequestOutput]:
        """Per-request views (hidden rows, positions, sampled token)."""
        qsl, out = self.batch.query_start_loc, []
        by_row = {int(r): int(s) for r, s in zip(self.logit_rows, self.sampled, strict=True) if r >= 0}
        for i in range(self.batch.num_requests):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            out.append(RequestOutput(
                index=i, request_id=int(self.batch.request_ids[i]), rows=slice(lo, hi),
                positions=self.batch.positions[lo:hi], hidden=self.hidden[lo:hi],
                sampled=by_row.get(hi - 1) if hi > lo else None))
        return out


def prefill(batch: PackedBatch, inputs: np.ndarray, weights: ModelWeights, caches: ModelCaches, *,
            backend: Backend = "reference", precision: str = "fp32", layers: Sequence[int] | None = None,
            logit_rows: Sequence[int] | np.ndarray | None = None,
            on_layer: Callable[[int, int], None] | None = None) -> PrefillResult:
    """Run a packed prefill of ``batch`` for the whole TP group on one process.

    inputs: [P] int64 token ids (embedded here) or [P, D] / [P, hc, D] float32 hidden rows; padding rows
    must be zero. weights: :class:`ModelWeights` (random, in-memory or lazily read safetensors).
    caches: :class:`ModelCaches` allocated with the batch's pool block counts; written in place.
    backend: 'reference' (numpy, default) or 'pypto' (attention stages through pypto kernels; needs the
    ``pypto`` extra and ``precision="a2a3"``, the numerics those kernels implement).
    precision: 'fp32' (exact, default) or 'a2a3' (the a2a3 kernels' bf16/int8 numerics).
    layers: layer indices to run (default all); logit_rows: group rows to sample (default batch.logit_rows).
    For one rank's view of a TP group see :mod:`dspark_kernels.tp`.
    """
    issues = _check(batch, inputs, weights, backend)
    if backend == "pypto" and precision != "a2a3":
        issues.append(Issue("config.invalid", "precision", "the pypto backend computes the a2a3 kernels' numerics",
                            expected="a2a3", actual=precision))
    if issues:
        raise ABIError(issues)
    attention_fn = None
    if backend == "pypto":
        from dspark_kernels.pypto import attention_pypto

        def attention_fn(b, layer, x, w, c, *, precision, rank):  # type: ignore[no-untyped-def]
            return attention_pypto(b, layer, x, w, c, rank=rank)
    n_layers = batch.config.num_layers
    run = list(range(n_layers)) if layers is None else sorted({i for i in layers if 0 <= i < n_layers})
    snapshot = _snapshot_written_rows(batch, caches, run)
    try:
        result: ForwardResult = run_forward(batch, inputs, weights, caches, precision=precision, layers=layers,
                                            logit_rows=logit_rows, on_layer=on_layer, attention_fn=attention_fn)
    except BaseException:
        _restore(caches, snapshot)  # nothing half-written survives a failed call
        raise
    return PrefillResult(batch=batch, hidden=result.hidden, x_hc=result.x_hc, logit_rows=result.logit_rows,
                         logits=result.logits, sampled=result.sampled)


def _check(batch: PackedBatch, inputs: np.ndarray, weights: ModelWeights, backend: str) -> list[Issue]:
    if not isinstance(batch, PackedBatch):
        return [Issue("array.missing", "batch", "prefill needs a PackedBatch (build it with BatchBuilder)",
                      expected="PackedBatch", actual=type(batch).__name__)]
    issues: list[Issue] = []
    if backend not in BACKENDS:
        issues.append(Issue("config.invalid", "backend", "unknown backend", expected=list(BACKENDS), actual=backend))
    arr = np.asarray(inputs)
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            issues.append(Issue("array.dtype", "hidden", "hidden rows must be finite", expected="finite",
                                actual="NaN or inf"))
        elif arr.ndim >= 2 and arr.shape[0] == batch.padded_rows:
            issues += validate(batch, hidden=arr).issues  # padding rows must be zero
    elif arr.dtype.kind in "iu" and arr.shape == (batch.padded_rows,) and batch.padded_rows > batch.num_tokens:
        pad = arr[batch.num_tokens:]
        if (pad != batch.policy.pad_token_id).any():
            issues.append(Issue("padding.token_id", "token_ids", "padding rows must carry the policy's pad id",
                                index=batch.num_tokens + int(np.flatnonzero(pad != batch.policy.pad_token_id)[0]),
                                expected=batch.policy.pad_token_id, actual="other ids"))
    if isinstance(weights, ModelWeights) and weights.config == batch.config:
        issues += weights.validate().issues
    return issues


def _snapshot_written_rows(batch: PackedBatch, caches: ModelCaches, layers: list[int]
                           ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(array, rows, saved rows) for every cache row the call may write (its slot-mapped rows)."""
    saved = []
    for i in layers:
        for name, array in caches[i].arrays().items():
            pool = "idx" if name == "idx_scale" else name
            rows = batch.slots[pool]
            rows = rows[rows >= 0]
            saved.append((array, rows, array[rows].copy()))
    return saved


def _restore(caches: ModelCaches, saved: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    for array, rows, values in saved:
        array[rows] = values
