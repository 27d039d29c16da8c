"""TP group execution: every rank runs its view of the batch; the per-layer all-gathers are the only exchange.

* In-process (:func:`run_tp_inprocess`): one thread per rank, each with its own cache replica and plan, one
  cache of prepared weights shared by all; all-gathers through shared memory. Any machine, no extra dependency.
* Multi-process (:func:`launch`): one process per rank on ``torch.distributed`` (backend ``gloo`` on CPU,
  ``hccl`` on Ascend with ``device="npu"``); the all-gathers are real collectives. Processes are started with
  ``torch.multiprocessing`` spawn, or by ``torchrun`` calling :func:`run_rank` in each process.
* A serving loop's group (:class:`RankGroup`): rank processes that live across steps, with the weights, the
  caches and a mirror of the persistent tables resident in each; a step ships only itself and its inputs.

All run the attention of every layer on the chosen ``backend`` ('reference' or 'pypto', as
:func:`dspark_kernels.prefill`); the pypto backend runs each layer's kernels in a child process
(:mod:`dspark_kernels.pypto.isolate`), so threads and rank processes never share a pypto runtime.

torch is imported only inside the distributed functions, never when this module is imported.
"""

from __future__ import annotations

import hashlib
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from dspark_abi import ABIError, Issue, PackedBatch
from dspark_abi.persistent import PersistentStep, PersistentTables
from dspark_kernels.model.backends import Backend, resolve_backend
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.forward import ForwardOptions, ForwardResult, RankContext, run_forward
from dspark_kernels.model.layer import AllGather
from dspark_kernels.model.plan import PlanSource
from dspark_kernels.model.prepared import PreparedWeightsCache
from dspark_kernels.model.weights import ModelWeights

#: Seconds a rank waits for its peers at one all-gather before giving up (a peer failed or hung).
GATHER_TIMEOUT_S = 600.0


@attrs.frozen(eq=False)
class RankResult:
    """One rank's forward result and its (replicated) caches after the call (None for a :class:`RankGroup`
    step: the group keeps its caches in its rank processes, :meth:`RankGroup.caches` fetches them)."""

    rank: int
    result: ForwardResult
    caches: ModelCaches | None


class ThreadGroup:
    """In-process all-gather for ``tp_size`` ranks running as threads (rank-major concatenation)."""

    def __init__(self, tp_size: int, timeout: float = GATHER_TIMEOUT_S):
        self.tp_size = tp_size
        self._slots: list[np.ndarray | None] = [None] * tp_size
        self._barrier = threading.Barrier(tp_size, timeout=timeout)

    def gatherer(self, rank: int) -> AllGather:
        def all_gather(local: np.ndarray) -> np.ndarray:
            self._slots[rank] = np.array(local, copy=True)
            self._barrier.wait()  # every rank has published
            out = np.concatenate([part for part in self._slots if part is not None])
            self._barrier.wait()  # every rank has read before the next gather overwrites
            return out

        return all_gather

    def abort(self) -> None:
        """Release the peers of a failed rank (they raise BrokenBarrierError instead of waiting)."""
        self._barrier.abort()


def run_tp_inprocess(batch: PackedBatch | PersistentStep | PlanSource, inputs: np.ndarray, weights: ModelWeights,
                     caches: ModelCaches, *, tables: PersistentTables | None = None, precision: str = "fp32",
                     layers: Sequence[int] | None = None,
                     logit_rows: Sequence[int] | None = None, backend: str = "reference",
                     prepared: PreparedWeightsCache | None = None,
                     on_layer: Callable[[int, int], None] | None = None) -> list[RankResult]:
    """Run every rank's view of ``batch`` in threads; rank 0 writes ``caches``, the others copies of it.

    batch / tables: as :func:`~dspark_kernels.model.forward.run_forward` (a full-form batch, or a persistent step
    with the tables holding its delta); the source is made once for all ranks (:class:`PlanSource`: a step's own
    rows, never its full form).
    backend: 'reference' or 'pypto' attention (see :func:`~dspark_kernels.model.backends.resolve_backend`).
    prepared: the cache of prepared attention weights the ranks share (default: one for this call, kept only if
    ``weights`` keep their layers). on_layer(done, total) is called by rank 0 after each layer. Returns one
    :class:`RankResult` per rank (all results are equal to the whole-group forward). The first failing rank's
    exception is re-raised after all threads stopped.
    """
    attention = resolve_backend(backend, precision)
    cache = PreparedWeightsCache(keep=weights.keep_layers) if prepared is None else prepared
    source = batch if isinstance(batch, PlanSource) else PlanSource.of(batch, tables)
    tp = source.batch.tp_size
    group = ThreadGroup(tp)
    replicas = [caches] + [caches.copy() for _ in range(tp - 1)]
    results: list[Any] = [None] * tp
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            options = ForwardOptions(precision=precision, layers=layers, logit_rows=logit_rows, backend=attention,
                                     prepared=cache, on_layer=on_layer if r == 0 else None)
            results[r] = run_forward(source, inputs, weights, replicas[r], options,
                                     tp=RankContext(r, group.gatherer(r)))
        except BaseException as exc:
            errors.append(exc)
            group.abort()

    threads = [threading.Thread(target=work, args=(r,), name=f"tp-rank-{r}") for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    return [RankResult(r, results[r], replicas[r]) for r in range(tp)]


# ---------------------------------------------------------------------------------------------- distributed
@attrs.frozen(eq=False)
class DistributedJob:
    """Everything a rank process of a one-shot :func:`launch` needs (pickled to each process; random weights
    regenerate there, checkpoint weights stream from their files there).

    batch: a full-form batch, or a persistent step: :func:`launch` then ships ``tables`` (the persistent tables
    holding the step's delta) with it. A :class:`RankGroup` step is a :class:`GroupStep` instead (no weights, no
    caches, no tables: the group's rank processes keep theirs)."""

    batch: PackedBatch | PersistentStep
    inputs: np.ndarray
    weights: ModelWeights
    caches: ModelCaches
    precision: str = "fp32"
    layers: tuple[int, ...] | None = None
    logit_rows: tuple[int, ...] | None = None
    backend: str = "reference"
    """Attention backend of every rank ('reference' or 'pypto', see
    :func:`~dspark_kernels.model.backends.resolve_backend`)."""
    on_layer: Callable[[int, int], None] | None = None
    """Called by rank 0's process after each layer (it must pickle; it runs in that process)."""
    tables: PersistentTables | None = None
    """The persistent tables holding the delta of a persistent ``batch``; None for a full-form batch."""


def torch_all_gather(device: str = "cpu") -> AllGather:
    """An :data:`AllGather` over the default ``torch.distributed`` process group (must be initialised)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()

    def all_gather(local: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(local)).to(device)
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return np.concatenate([p.cpu().numpy() for p in parts])

    return all_gather


def run_rank(job: DistributedJob, *, device: str = "cpu", attention: Backend | None = None) -> RankResult:
    """Run this process's rank of ``job`` in an initialised default process group (e.g. under torchrun).

    attention: the attention backend already resolved (by :func:`launch`); default
    ``resolve_backend(job.backend, job.precision)`` resolved in this process.
    """
    return _run_job(job, job.tables, device=device, attention=attention)


def _run_job(job: DistributedJob, tables: PersistentTables | None, *, device: str, attention: Backend | None
             ) -> RankResult:
    """This process's rank of ``job``, its persistent step (if any) read through ``tables``."""
    if attention is None:
        attention = resolve_backend(job.backend, job.precision)
    options = ForwardOptions(precision=job.precision, layers=job.layers, logit_rows=job.logit_rows,
                             backend=attention)
    return _run_rank_forward(job.batch, job.inputs, job.weights, job.caches, options, job.on_layer, tables,
                             device)


def _run_rank_forward(batch: PackedBatch | PersistentStep, inputs: np.ndarray, weights: ModelWeights,
                      caches: ModelCaches, options: ForwardOptions, on_layer: Callable[[int, int], None] | None,
                      tables: PersistentTables | None, device: str) -> RankResult:
    """This process's rank of one forward in the initialised default process group (``caches`` written in place;
    ``on_layer`` runs on rank 0 only)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tp_size = batch.policy.tp_size
    if dist.get_world_size() != tp_size:
        raise ValueError(f"world size {dist.get_world_size()} differs from the batch's tp_size {tp_size}")
    options = attrs.evolve(options, on_layer=on_layer if rank == 0 else None)
    result = run_forward(batch, inputs, weights, caches, options, tp=RankContext(rank, torch_all_gather(device)),
                         tables=tables)
    return RankResult(rank, result, caches)


def _spawned_rank(rank: int, job: DistributedJob, init_file: str, backend: str, device: str, out: Any,
                  attention: Backend | None = None) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the machine's cores; numpy does the math
    if device == "cuda":  # one GPU per rank (NCCL refuses two ranks on one device)
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=job.batch.policy.tp_size)
    try:
        out.put(run_rank(job, device=device, attention=attention))
    finally:
        dist.destroy_process_group()


def launch(job: DistributedJob, *, backend: str = "gloo", device: str = "cpu",
           timeout: float = GATHER_TIMEOUT_S) -> list[RankResult]:
    """Start ``job.batch.tp_size`` processes (torch.multiprocessing spawn), one per rank, and collect their results.

    backend: a ``torch.distributed`` backend (``gloo`` on CPU, ``nccl`` with ``device="cuda"``: one GPU per rank,
    ``hccl`` on Ascend). ``job.backend`` (the attention backend) is resolved here, once, and shipped to every
    rank. Raises if a rank fails or nothing arrives within ``timeout`` seconds (all processes are then terminated).
    """
    attention = resolve_backend(job.backend, job.precision)
    import torch.multiprocessing as mp

    tp = job.batch.policy.tp_size
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="dspark-tp-")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    procs = mp.start_processes(_spawned_rank, args=(job, init_file, backend, device, out, attention), nprocs=tp,
                               join=False, start_method="spawn")
    results: dict[int, RankResult] = {}
    try:
        waited = 0.0
        while len(results) < tp:
            try:
                r = out.get(timeout=1.0)
                results[r.rank] = r
            except queue.Empty:
                waited += 1.0
                procs.join(timeout=0)  # raises ProcessRaisedException / ProcessExitedException on failure
                if waited > timeout:
                    raise TimeoutError(f"TP ranks did not finish within {timeout} s") from None
        deadline = time.monotonic() + timeout
        while not procs.join(timeout=max(deadline - time.monotonic(), 0.0)):  # returns as each process exits
            if time.monotonic() >= deadline:
                raise TimeoutError(f"TP rank processes did not exit within {timeout} s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        if os.path.exists(init_file):
            os.unlink(init_file)
    return [results[r] for r in range(tp)]


# ---------------------------------------------------------------------------------------------- rank group
@attrs.define
class _RankDrafter:
    """A rank process's DSpark drafter (:meth:`RankGroup.attach_drafter`) and its last step's target features,
    which the drafter observes from (they never leave the process)."""

    drafter: Any
    """The rank's ``dspark_kernels.drafter.DSparkDrafter`` (typed loosely: the model layer never imports the
    drafter module, which imports the backends)."""
    reduction: str
    step: PackedBatch | PersistentStep | None = None
    features: np.ndarray | None = None
    """[P, T * D] float32 the last step's target features in ``reduction``."""

    def keep(self, step: PackedBatch | PersistentStep, result: ForwardResult) -> ForwardResult:
        """Keep the step's features here; the result returned to the caller carries none."""
        self.step = step
        self.features = result.target_hidden if self.reduction == "mean" else result.target_hidden_hc_head
        return attrs.evolve(result, target_hidden=None, target_hidden_hc_head=None)

    def observe(self, request_ids: np.ndarray, first: np.ndarray, counts: np.ndarray) -> None:
        """The drafter observes each request's ``counts[i]`` committed rows of the last step, from position
        ``first[i]`` (its first row's): ``commit.accepted`` for rows that are not the request's in that step."""
        step, feats = self.step, self.features
        if step is None or feats is None:
            raise ABIError([Issue("commit.accepted", "request_ids", "no step with target features ran on this group "
                                  "since the drafter was attached", expected="a step before observe", actual="none",
                                  fix="observe the rows of a step after running it")])
        order = {int(r): k for k, r in enumerate(step.requests.ids)}
        starts = np.asarray(step.query_start_loc, np.int64)
        issues = []
        rows: list[int] = []
        for i, (r, p, n) in enumerate(zip(request_ids.tolist(), first.tolist(), counts.tolist(), strict=True)):
            k = order.get(r)
            if k is None or not 1 <= n <= starts[k + 1] - starts[k] or int(step.positions[starts[k]]) != p:
                issues.append(Issue("commit.accepted", "counts", "the observed rows are not the first rows of the "
                                    "request in the group's last step", index=i, request=r,
                                    expected=None if k is None else [int(step.positions[starts[k]]),
                                                                     int(starts[k + 1] - starts[k])],
                                    actual=[p, n], fix="observe the committed rows of the step just run"))
            else:
                rows.append(int(starts[k]))
        if issues:
            raise ABIError(issues)
        self.drafter.observe([int(r) for r in request_ids],
                             [np.arange(p, p + n, dtype=np.int64) for p, n in zip(first.tolist(), counts.tolist(),
                                                                                   strict=True)],
                             [feats[row: row + n] for row, n in zip(rows, counts.tolist(), strict=True)])


def _drafter_message(kind: str, payload: Any, held: _RankDrafter | None, mirror: PersistentTables, tp_size: int,
                     rank: int) -> tuple[Any, _RankDrafter | None]:
    """(reply value, the rank's drafter afterwards) of one drafter message; raises :class:`ABIError` with nothing
    changed (the drafter checks before it writes). A new drafter's window lives in the ori pool of the rank's
    mirror, which applies every step before its forward (so it equals the allocator's tables when the drafter
    observes a step's committed rows and drafts before the next one)."""
    if kind == "drafter":
        recipe, weights, reduction = payload   # weights: the rank's resident target weights unless others came
        built = recipe.build(weights, tp=tp_size, tp_mode="distributed")
        built.attach(mirror)
        return None, _RankDrafter(built, reduction)
    if held is None:
        raise ABIError([Issue("config.invalid", "drafter", "no drafter runs in this TP group", expected="a drafter",
                              actual="none", fix="RankGroup.attach_drafter(recipe, target, reduction) first")])
    if kind == "observe":
        held.observe(*payload)
        return None, held
    if kind == "draft":
        out = held.drafter.draft(*payload)
        return (out if rank == 0 else None), held   # every rank computes the same output: one ships it
    held.drafter.release(payload)
    return None, held


#: Messages a rank answers about its drafter: an ABIError they raise is reported and the rank keeps serving.
_DRAFTER_MESSAGES = ("drafter", "observe", "draft", "drafter_release")
#: Seconds the other ranks get to answer once one rank reported a refusal or an error: ranks that agree answer
#: within milliseconds of each other; one that does not answer is waiting in a collective its failed peer never
#: joins, and the group is closed instead of waiting for :data:`GATHER_TIMEOUT_S`.
PEER_ANSWER_GRACE_S = 5.0
#: Seconds :meth:`RankGroup.close` waits for a rank process to stop after a failure before terminating it.
FAILED_STOP_GRACE_S = 1.0


@attrs.frozen(eq=False)
class GroupStep:
    """One step of a :class:`RankGroup`: only what changes per step (pickled to each rank process). The group's
    rank processes keep their weights, caches (written in place), prepared weights and mirror of the persistent
    tables across steps, so a step carries none of them.

    batch: a persistent step (each rank applies its delta to its own mirror first) or a full-form batch.
    inputs: [P] int64 token ids or [P, hc, D] / [P, D] float32 hidden rows, as
    :func:`~dspark_kernels.model.forward.run_forward`'s."""

    batch: PackedBatch | PersistentStep
    inputs: np.ndarray
    layers: tuple[int, ...] | None = None
    logit_rows: tuple[int, ...] | None = None
    on_layer: Callable[[int, int], None] | None = None
    """Called by rank 0's process after each layer (it must pickle; it runs in that process)."""


def caches_digest(caches: ModelCaches) -> bytes:
    """A digest of every pool of ``caches`` (names, shapes, dtypes, bytes): equal caches give equal digests, so
    the ranks of a group compare their replicas without shipping them."""
    h = hashlib.blake2b(digest_size=16)
    for name, array in sorted(caches.arrays().items()):
        h.update(f"{name}{array.shape}{array.dtype}".encode())
        h.update(np.ascontiguousarray(array).data)
    return h.digest()


@attrs.define
class _Resident:
    """What a rank process of a :class:`RankGroup` keeps across steps: the weights (built once there, their layers
    kept when ``keep_layers``), the prepared attention weights, the caches (written in place by every step) and the
    mirror of the persistent tables."""

    weights: ModelWeights
    caches: ModelCaches
    prepared: PreparedWeightsCache
    mirror: PersistentTables
    options: ForwardOptions
    """The group's precision and attention backend (fixed at its start)."""

    def run(self, step: GroupStep, slots: int, device: str) -> RankResult:
        """The rank's forward of ``step``; the result carries no caches (they stay here)."""
        self.mirror.grow(slots)
        tables = None
        if isinstance(step.batch, PersistentStep):
            self.mirror.apply(step.batch)         # the step's delta alone: never the whole tables
            tables = self.mirror
        options = attrs.evolve(self.options, layers=step.layers, logit_rows=step.logit_rows)
        done = _run_rank_forward(step.batch, step.inputs, self.weights, self.caches, options, step.on_layer,
                                 tables, device)
        return RankResult(done.rank, done.result, None)

    def set_caches(self, caches: ModelCaches) -> None:
        """Overwrite the resident pools in place with ``caches`` (same layout; refused with nothing written)."""
        mine, theirs = self.caches.arrays(), caches.arrays()
        if set(mine) != set(theirs) or any(a.shape != theirs[n].shape or a.dtype != theirs[n].dtype
                                           for n, a in mine.items()):
            raise ABIError([Issue("config.mismatch", "caches", "the caches do not have the group's pools",
                                  expected=sorted(mine), actual=sorted(theirs),
                                  fix="pass caches allocated for the group's config, pools and precision")])
        for name, array in mine.items():
            array[...] = theirs[name]


def _group_rank(rank: int, tp_size: int, init_file: str, backend: str, device: str, inboxes: Any, out: Any,
                tables: dict[str, np.ndarray], config: Any, pool_blocks: Any, attention: Backend | None,
                precision: str, weights: ModelWeights, caches: ModelCaches | None) -> None:
    """One rank process of a :class:`RankGroup`: it loads its weights, caches and mirror of the persistent tables
    once (``caches`` None: fresh zero pools of ``pool_blocks``), then per message applies a step's delta to its
    mirror (as a device table is updated) and runs its rank of the step on its resident weights and caches; with
    a drafter attached, it keeps the step's target features and answers the drafter's observe / draft / release."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    resident = _Resident(
        weights, ModelCaches.allocate(config, pool_blocks, precision=precision) if caches is None else caches,
        PreparedWeightsCache(keep=weights.keep_layers),
        PersistentTables.from_arrays(config, pool_blocks, tables),   # proven once, then kept by deltas
        ForwardOptions(precision=precision, backend=attention))
    held: _RankDrafter | None = None
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=tp_size)
    try:
        while True:
            kind, payload = inboxes[rank].get()
            if kind == "stop":
                return
            if kind in _DRAFTER_MESSAGES:
                if kind == "drafter" and payload[1] is None:   # the drafter's target: the resident weights
                    payload = (payload[0], resident.weights, payload[2])
                try:
                    value, held = _drafter_message(kind, payload, held, resident.mirror, tp_size, rank)
                    out.put((kind, rank, value))
                except ABIError as exc:   # checked before anything was written: the rank keeps serving
                    out.put(("refused", rank, exc))
                except Exception as exc:  # reported to the caller, which stops the group
                    out.put(("error", rank, exc))
                    return
                continue
            try:
                if kind == "mirror":
                    out.put(("mirror", rank, resident.mirror.to_arrays()))
                elif kind == "release":
                    resident.mirror.release(int(payload))
                    out.put(("released", rank, None))
                elif kind == "caches":            # rank 0 ships its pools, every rank its digest
                    out.put(("caches", rank, (resident.caches if rank == 0 else None,
                                              caches_digest(resident.caches))))
                elif kind == "set_caches":
                    try:
                        resident.set_caches(payload)
                    except ABIError as exc:   # other pools: refused with nothing written, the rank keeps serving
                        out.put(("refused", rank, exc))
                        continue
                    out.put(("set_caches", rank, None))
                else:
                    step, slots = payload
                    done = resident.run(step, slots, device)
                    if held is not None:          # the features stay here, for the drafter's observe
                        done = RankResult(done.rank, held.keep(step.batch, done.result), None)
                    out.put(("result", rank, done))
            except Exception as exc:  # reported to the caller, which stops the group
                out.put(("error", rank, exc))
                return
    finally:
        dist.destroy_process_group()


class RankGroup:
    """``tp_size`` rank processes on ``torch.distributed`` that live across steps (a serving loop's TP group).

    Everything that does not change per step is shipped once, when the group starts, and stays resident in each
    rank process, as it would on a device: ``weights`` (pickled as their description: random weights regenerate,
    checkpoint weights stream from their files; each rank builds its layers once and keeps them and their
    prepared attention weights when ``weights.keep_layers``), ``caches`` (the caller's pools as of the start, or
    None for fresh zero pools of the tables' block counts; each rank writes its own copy in place at every step)
    and the persistent tables (each rank's mirror is loaded once and advanced by ``PersistentTables.apply(step)``
    for every persistent step it runs, as a device-resident table would be). :meth:`run` ships one
    :class:`GroupStep` (the step, its delta and its inputs) and returns every rank's :class:`RankResult`, which
    carries no caches; :meth:`caches` fetches rank 0's caches (and checks that every rank's replica equals them by
    digest); :meth:`set_caches` overwrites every rank's caches; :meth:`release` frees a slot the allocator
    released on every mirror; :meth:`mirrors` returns each rank's mirror (``to_arrays()``). ``slots``: the
    allocator's slot count, sent with each step (the mirror grows as the allocator's tables do). Use as a context
    manager (:meth:`close` stops the processes).

    The DSpark drafter can run in the group too (:meth:`attach_drafter`): each rank builds its own
    ``DSparkDrafter(tp=tp_size, tp_mode="distributed")`` from a picklable recipe, keeps its last step's target
    features (the steps' results then carry none: features never cross a process boundary), and answers
    :meth:`drafter_observe` (which rows of that step each request committed), :meth:`drafter_draft` (rank 0's
    ``DraftOutput``) and :meth:`drafter_release`. An :class:`~dspark_abi.ABIError` a drafter raises (e.g.
    ``drafter.gap``; the drafter checks before it writes, identically on every rank) reaches the caller as raised
    and the group keeps serving.

    Failures: any other error of a rank stops the group at once and is raised (the other ranks may be waiting in
    a collective their failed peer never joins: they are terminated, not waited for); so is a refusal some ranks
    give and others do not answer within ``peer_grace`` seconds, or give differently. A stopped group refuses
    further calls (``RuntimeError``); its caches are lost (fetch them before a step that may fail, if needed).
    """

    def __init__(self, tp_size: int, tables: PersistentTables, weights: ModelWeights,
                 caches: ModelCaches | None = None, *, backend: str = "gloo", device: str = "cpu",
                 attention: str = "reference", precision: str = "fp32", timeout: float = GATHER_TIMEOUT_S,
                 peer_grace: float = PEER_ANSWER_GRACE_S):
        import torch.multiprocessing as mp

        resolved = resolve_backend(attention, precision)
        self.tp_size, self.timeout, self.peer_grace = tp_size, timeout, peer_grace
        self.closed = False
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(tp_size)]
        self._out = ctx.Queue()
        fd, self._init_file = tempfile.mkstemp(prefix="dspark-tp-group-")
        os.close(fd)
        os.unlink(self._init_file)  # the file store creates it
        self._procs = mp.start_processes(
            _group_rank, args=(tp_size, self._init_file, backend, device, self._inboxes, self._out,
                               tables.to_arrays(), tables.config, tables.pool_blocks, resolved, precision, weights,
                               caches),
            nprocs=tp_size, join=False, start_method="spawn")

    def run(self, step: GroupStep, slots: int) -> list[RankResult]:
        """Every rank's result of ``step`` (a step the ranks' mirrors have not applied yet); no caches in them."""
        self._send("job", (step, slots))
        return self._collect("result")

    def caches(self) -> ModelCaches:
        """Rank 0's caches as of the last step (one transfer of every pool); raises ``RuntimeError`` (and stops
        the group) when another rank's replica differs from them (compared by digest, nothing else shipped)."""
        self._send("caches", None)
        answers = self._collect("caches")
        first, digest = answers[0]
        differ = [r for r, (_, d) in enumerate(answers) if d != digest]
        if differ:
            self.close(grace=FAILED_STOP_GRACE_S)
            raise RuntimeError(f"the caches of TP ranks {differ} differ from rank 0's: the replicas diverged")
        written: ModelCaches = first
        return written

    def set_caches(self, caches: ModelCaches) -> None:
        """Overwrite every rank's caches with ``caches`` (one transfer of every pool per rank), e.g. after the
        caller changed the copy :meth:`caches` returned. ``config.mismatch`` (nothing written) for other pools."""
        self._send("set_caches", caches)
        self._collect("set_caches")

    def release(self, slot: int) -> None:
        """Release ``slot`` on every rank's mirror, as the allocator released it (``BlockAllocator.release``): its
        generation advances there too, so the mirrors stay equal to the allocator's tables."""
        self._send("release", slot)
        self._collect("released")

    def attach_drafter(self, recipe: Any, target: ModelWeights | None = None, reduction: str = "mean") -> None:
        """Every rank builds ``recipe``'s drafter (a ``dspark_kernels.drafter.DrafterRecipe``; typed loosely, as
        the model layer never imports the drafter) on ``target`` (default: the group's resident weights, nothing
        shipped; TP over the group, ``tp_mode="distributed"``) and from the next step on keeps that step's target
        features in ``reduction`` for it (the mean of the hc streams, or ``"hc_head"``); the steps' results carry
        no features any more."""
        self._send("drafter", (recipe, target, reduction))
        self._collect("drafter")

    def drafter_observe(self, request_ids: Sequence[int], first: Sequence[int], counts: Sequence[int]) -> None:
        """The ranks' drafters observe ``counts[i]`` committed rows of request ``request_ids[i]`` of the last step,
        from position ``first[i]`` (the request's first row in that step), their features from the ranks' copies
        (``commit.accepted`` for rows that are not the request's first rows in it; the drafter's own errors, e.g.
        ``drafter.gap``, as it raises them; nothing written on any of them)."""
        self._send("observe", (np.asarray(request_ids, np.int64).reshape(-1), np.asarray(first, np.int64).reshape(-1),
                               np.asarray(counts, np.int64).reshape(-1)))
        self._collect("observe")

    def drafter_draft(self, request_ids: Sequence[int], anchors: np.ndarray, anchor_positions: np.ndarray) -> Any:
        """The ranks' packed draft (``DSparkDrafter.draft``) of the requests, TP over the group: rank 0's
        ``DraftOutput``."""
        self._send("draft", ([int(r) for r in request_ids], np.asarray(anchors), np.asarray(anchor_positions)))
        return self._collect("draft")[0]

    def drafter_release(self, request_ids: Sequence[int]) -> None:
        """The ranks' drafters forget the requests (``DSparkDrafter.release``)."""
        self._send("drafter_release", [int(r) for r in request_ids])
        self._collect("drafter_release")

    def _send(self, kind: str, payload: Any) -> None:
        if self.closed:
            raise RuntimeError("the TP rank group is stopped (a rank failed, or it was closed)")
        for box in self._inboxes:
            box.put((kind, payload))

    def mirrors(self) -> list[dict[str, np.ndarray]]:
        """Each rank's mirror of the persistent tables, as ``PersistentTables.to_arrays()``."""
        self._send("mirror", None)
        return self._collect("mirror")

    def _collect(self, kind: str) -> list[Any]:
        """Every rank's answer to one message. Refusals (a drafter's ABIError) raise rank 0's error once every rank
        answered: all refused alike, so the group stays usable; ranks that disagree stop it. An error, a rank that
        exits, a refusal the other ranks do not answer within ``peer_grace`` seconds (they wait in a collective)
        and the group ``timeout`` stop the group at once and raise."""
        got: dict[int, Any] = {}
        refused: dict[int, BaseException] = {}   # ABIErrors
        deadline = time.monotonic() + self.timeout
        grace_end: float | None = None          # set by the first refusal
        while len(got) + len(refused) < self.tp_size:
            now = time.monotonic()
            wait = min(1.0, max((deadline if grace_end is None else min(deadline, grace_end)) - now, 0.01))
            try:
                what, rank, value = self._out.get(timeout=wait)
            except queue.Empty:
                try:
                    self._procs.join(timeout=0)  # raises ProcessRaisedException / ProcessExitedException on failure
                except Exception:
                    self.close(grace=FAILED_STOP_GRACE_S)
                    raise
                now = time.monotonic()
                if grace_end is not None and now > grace_end:   # the others wait in a collective: stop them
                    self.close(grace=FAILED_STOP_GRACE_S)
                    raise refused[min(refused)] from None
                if now > deadline:
                    self.close(grace=FAILED_STOP_GRACE_S)
                    raise TimeoutError(f"TP ranks did not answer within {self.timeout} s") from None
                continue
            if what == "error":
                self.close(grace=FAILED_STOP_GRACE_S)
                raise value
            if what == "refused":
                refused[rank] = value
                if grace_end is None:
                    grace_end = time.monotonic() + self.peer_grace
            elif what == kind:
                got[rank] = value
        if refused:
            if got:   # the ranks' drafters disagree: their replicated state can no longer be trusted
                self.close(grace=FAILED_STOP_GRACE_S)
            raise refused[min(refused)]
        return [got[r] for r in range(self.tp_size)]

    def close(self, grace: float = 10.0) -> None:
        """Stop the rank processes (terminating any that do not exit within ``grace`` seconds, e.g. one waiting in
        a collective a failed peer never joins). Idempotent."""
        if not self.closed:
            self.closed = True
            for box in self._inboxes:
                box.put(("stop", None))
        deadline = time.monotonic() + grace
        for p in self._procs.processes:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.terminate()
                p.join(timeout=grace)
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
