"""`prefill(...)`: the typed entry point. Validate everything, run the forward, return typed results.

Guarantees: a malformed batch, input, weights or caches raise :class:`ABIError` listing every issue
before anything is read or written; and if a backend fails half-way, every cache row the call may have
written is restored, so caches and inputs are bit-for-bit as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from dspark_abi import ABIError, Issue, PackedBatch
from dspark_abi.persistent import PersistentStep, PersistentTables
from dspark_abi.rules import padding_hidden_issues, padding_token_issues
from dspark_kernels.model.backends import BACKENDS, BackendName, backend_issues, resolve_backend
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.forward import ForwardOptions, ForwardResult, run_forward
from dspark_kernels.model.numerics import PRECISIONS
from dspark_kernels.model.plan import PlanSource, StepRows
from dspark_kernels.model.prepared import PreparedWeightsCache
from dspark_kernels.model.weights import ModelWeights

__all__ = ["BACKENDS", "BackendName", "PrefillResult", "RequestOutput", "prefill"]


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
    """Greedy next token from its last row, when that row was among the call's logit rows (the batch's
    ``requests.logit_row`` unless ``prefill(logit_rows=...)`` chose others)."""
    target_hidden: np.ndarray | None = None
    """[n_i, T * D] float32 DSpark drafter features of its rows (``PrefillResult.target_hidden``), or None."""


@attrs.frozen(eq=False)
class PrefillResult:
    """Outputs of one prefill call.

    hidden: [P, D] float32 final-norm hidden rows (padding rows zero).
    x_hc: [P, hc, D] float32 residual streams after the last layer run.
    logit_rows: [M] int32 group rows sampled (-1 inactive); logits: [M, V] float32; sampled: [M] int64 (-1 inactive).
    target_hidden: [P, T * D] float32 (bf16 values with precisions a2a3 and deepseek) or None: the DSpark drafter's
    target hidden features as DeepSeek defines them, T = len(config.dspark_target_layers); slice k of a row is the
    **mean of the hc residual streams** after layer ``dspark_target_layers[k]`` (DeepSeek's ``h.mean(dim=2)``;
    zero where that layer was not run, and on padding rows). Rank r's share is rows ``[r * L, (r + 1) * L)``.
    target_hidden_hc_head: the same rows with ``hc_head`` of the streams instead of their mean: upstream
    pypto-lib's ``dspark_target_hidden`` (rank r's share ``dspark_target_hidden[r]``), for comparison with it; not
    what the drafter was trained on (docs/checkpoints.md section 6).
    batch: the rows the call ran (:class:`~dspark_kernels.model.plan.StepRows`): the :class:`PackedBatch` itself,
    or the persistent step itself (its own rows and request record; its full form is ``step.to_full(tables)``, not
    made by the call).
    """

    batch: StepRows
    hidden: np.ndarray
    x_hc: np.ndarray
    logit_rows: np.ndarray
    logits: np.ndarray
    sampled: np.ndarray
    target_hidden: np.ndarray | None = None
    target_hidden_hc_head: np.ndarray | None = None

    @property
    def requests(self) -> list[RequestOutput]:
        """Per-request views (hidden rows, positions, sampled token), read from the batch's request record."""
        record, out = self.batch.requests, []
        by_row = {int(r): int(s) for r, s in zip(self.logit_rows, self.sampled, strict=True) if r >= 0}
        for i in range(record.count):
            rows = record.rows(i)
            out.append(RequestOutput(
                index=i, request_id=int(record.ids[i]), rows=rows,
                positions=self.batch.positions[rows], hidden=self.hidden[rows],
                sampled=by_row.get(int(rows.stop) - 1) if rows.stop > rows.start else None,
                target_hidden=None if self.target_hidden is None else self.target_hidden[rows]))
        return out


def prefill(batch: PackedBatch | PersistentStep, inputs: np.ndarray, weights: ModelWeights, caches: ModelCaches, *,
            tables: PersistentTables | None = None, backend: BackendName = "reference", precision: str = "fp32",
            layers: Sequence[int] | None = None,
            logit_rows: Sequence[int] | np.ndarray | None = None, prepared: PreparedWeightsCache | None = None,
            on_layer: Callable[[int, int], None] | None = None) -> PrefillResult:
    """Run a packed prefill of ``batch`` for the whole TP group on one process.

    batch: a full-form :class:`PackedBatch`, or a :class:`~dspark_abi.persistent.PersistentStep` (the persistent
    form, ``BatchBuilder.build_step()``) with ``tables``: the persistent tables holding the step's delta (a device
    mirror after ``mirror.apply(step)``, or ``allocator.persistent`` after ``builder.commit(step)``); the kernels then
    read those tables at each request's slot and the step's own rows, with the results of the full form bit for
    bit; no full form is made (the step's slots and generations are checked, O(R): its delta was proven by
    ``apply`` or the commit). ``PrefillResult.batch`` is the step's rows (for the per-request views).

    inputs: [P] int64 token ids (embedded here) or [P, D] / [P, hc, D] float32 hidden rows; padding rows
    must be zero. weights: :class:`ModelWeights` (random, in-memory or lazily read safetensors).
    caches: :class:`ModelCaches` allocated with the batch's pool block counts; written in place.
    backend: 'reference' (numpy, default) or 'pypto' (every stage through pypto kernels; needs the
    ``pypto`` extra and ``precision="a2a3"``, the numerics those kernels implement).
    precision: 'fp32' (exact, default), 'a2a3' (the a2a3 kernels' bf16/int8 numerics) or 'deepseek' (what
    DeepSeek's official inference computes: bf16 activations, FP8 / FP4 fake quantisation of the KV and the
    indexer, FP8-GEMM activation quantisation; :mod:`dspark_kernels.model.numerics`).
    layers: distinct int layer indices to run (default all); logit_rows: group rows to sample (default
    batch.logit_rows). Layers, caches (every pool array of the layers run, shape and dtype) and, for the pypto
    backend, the range of the kernels' fp32 indices are checked before anything is read or written.
    prepared: a cache of prepared attention weights to reuse across calls (default: one for this call).
    For one rank's view of a TP group see :mod:`dspark_kernels.model.tp`.
    """
    if not isinstance(batch, PackedBatch | PersistentStep):
        raise ABIError([Issue("array.missing", "batch", "prefill needs a PackedBatch or a PersistentStep (build it "
                              "with BatchBuilder)", expected="PackedBatch | PersistentStep",
                              actual=type(batch).__name__)])
    source = PlanSource.of(batch, tables)   # a step: its own rows and the tables the kernels read
    rows = source.batch
    issues = _check(rows, inputs, weights, backend)
    if precision not in PRECISIONS:
        issues.append(Issue("config.invalid", "precision", "unknown precision", expected=list(PRECISIONS),
                            actual=repr(precision)))
    elif backend in BACKENDS:
        issues += backend_issues(backend, precision)  # a precision the backend cannot compute
    resolved = None if backend_issues(backend, precision) else resolve_backend(backend, precision)
    run, layer_issues = _layers(rows, layers)
    issues += layer_issues
    if run is not None:
        # every check that keeps the snapshot and the layers from indexing a pool out of bounds, before any read
        if not isinstance(caches, ModelCaches):
            issues.append(Issue("config.mismatch", "caches", "caches must be a ModelCaches",  # type: ignore[unreachable]  # runtime guard
                                expected="ModelCaches", actual=type(caches).__name__))
        elif precision in PRECISIONS:
            issues += caches.issues_for(rows, precision, run)
        if resolved is not None:
            issues += resolved.batch_issues(rows, run, source.read_tables())   # e.g. the pypto fp32 index range
    if issues or run is None or resolved is None:
        raise ABIError(issues)
    snapshot = _snapshot_written_rows(rows, caches, run)
    try:
        options = ForwardOptions(precision=precision, layers=run, logit_rows=logit_rows, backend=resolved,
                                 prepared=prepared, on_layer=on_layer, caches_checked=True)
        result: ForwardResult = run_forward(source, inputs, weights, caches, options)
    except BaseException:
        _restore(caches, snapshot)  # nothing half-written survives a failed call
        raise
    return PrefillResult(batch=rows, hidden=result.hidden, x_hc=result.x_hc, logit_rows=result.logit_rows,
                         logits=result.logits, sampled=result.sampled, target_hidden=result.target_hidden,
                         target_hidden_hc_head=result.target_hidden_hc_head)


def _layers(batch: StepRows, layers: Sequence[int] | None) -> tuple[list[int] | None, list[Issue]]:
    """The layer indices to run (None if ``layers`` is unusable) and the issues of ``layers``."""
    n = batch.config.num_layers
    if layers is None:
        return list(range(n)), []
    expected = f"a sequence of distinct int layer indices in [0, {n})"
    if isinstance(layers, str | bytes) or not isinstance(layers, Sequence | np.ndarray | set | frozenset):
        return None, [Issue("config.invalid", "layers", "layers must be a sequence of layer indices",
                            expected=expected, actual=repr(layers))]
    values = list(layers)
    bad = [i for i, v in enumerate(values) if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer)]
    if bad:
        return None, [Issue("config.invalid", "layers", "layer indices must be integers", index=bad[0],
                            expected=expected, actual=repr(values[bad[0]]), count=len(bad))]
    run = [int(v) for v in values]
    if any(not 0 <= i < n for i in run) or len(set(run)) != len(run):
        return None, [Issue("config.mismatch", "layers", "layers must be distinct indices of the config's schedule",
                            expected=f"distinct values in [0, {n})", actual=run)]
    return run, []


def _check(batch: StepRows, inputs: np.ndarray, weights: ModelWeights, backend: str) -> list[Issue]:
    issues: list[Issue] = []
    if backend not in BACKENDS:
        issues += backend_issues(backend, None)
    arr = np.asarray(inputs)
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            issues.append(Issue("array.dtype", "hidden", "hidden rows must be finite", expected="finite",
                                actual="NaN or inf"))
        elif arr.ndim >= 2 and arr.shape[0] == batch.padded_rows:
            issues += _padding_hidden_issues(batch, arr)
    elif arr.dtype.kind in "iu" and arr.shape == (batch.padded_rows,):
        padding_token_issues(issues, batch.policy, batch.num_tokens, arr)    # the policy's rule, as validated
    if not isinstance(weights, ModelWeights):
        issues.append(Issue("config.mismatch", "weights", "weights must be a ModelWeights",  # type: ignore[unreachable]  # runtime guard
                            expected="ModelWeights", actual=type(weights).__name__))
    elif weights.config == batch.config:
        issues += weights.validate().issues
    return issues


def _padding_hidden_issues(batch: StepRows, hidden: np.ndarray) -> list[Issue]:
    """``padding.hidden`` for the first padding row of ``hidden`` [P, ...] that is not all zero (with the count):
    the ABI validator's own rule; the batch itself is already valid, so nothing else is re-validated."""
    issues: list[Issue] = []
    padding_hidden_issues(issues, batch.num_tokens, hidden)
    return issues


def _snapshot_written_rows(batch: StepRows, caches: ModelCaches, layers: list[int]
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


def __getattr__(name: str) -> object:
    """``Backend`` (deprecated for one minor version): the backend-name literal, now :data:`BackendName` (the model
    layer's ``Backend`` is the backend protocol)."""
    if name == "Backend":
        import warnings

        warnings.warn("dspark_kernels.api.Backend is deprecated: use BackendName", DeprecationWarning, stacklevel=2)
        return BackendName
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
