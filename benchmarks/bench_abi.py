"""Host metadata costs of one serving step at the model's real depth, and at upstream's 16K fixture depth.

    python benchmarks/bench_abi.py            # both scenarios, 15 repeats
    python benchmarks/bench_abi.py --quick    # 3 repeats (smoke run)
    python benchmarks/bench_abi.py --scenario persistent    # full vs persistent form only
    python benchmarks/bench_abi.py --against /path/to/other/checkout   # persistent steps: that code vs this one
    python benchmarks/bench_abi.py --phases   # the persistent verify step split by phase, and its call count

Scenario "1m": FLASH at 1,048,576 positions, N = 8192 new tokens over R = 64 continuing requests (ragged chunks,
ragged cached contexts up to 1M), TP = 4. Scenario "16k": FLASH_16K, N = 8192 over R = 512 requests.
Scenario "verify": FLASH-DSpark with K = 7 drafts (upstream's S = 8 lanes), R = 256 verify requests of 8 rows at
ragged contexts up to 1M, TP = 4, alone and with 64 prefill rows of another request mixed in: build + validation +
commit (with ragged accepted counts), beside the same step built as a 2048-token prefill.
Scenario "persistent": the full form (1.2: build + StepValidator + commit) beside the persistent form (1.3:
build_step, its incremental check, commit writing the delta in place) for those verify steps, the 1m and 16k
prefill steps, and the verify step again with the context and every pool doubled (2M positions): bytes written per
step and time, each beside its bandwidth floor.
A "build" figure is one whole step of the serving loop's metadata: build (plan, assemble, validate) plus the
commit that advances the allocator after the forward. Every figure is a median of repeated runs in this one
process, printed beside the memory-bandwidth floor of the bytes it must write (those bytes / a large np.copyto's
bandwidth measured in the same run), so the ratios stay meaningful on a noisy shared machine even when the absolute
numbers drift.
``--against DIR``: the persistent steps of another checkout's ``dspark_abi`` (a worker process with DIR on its
path, this file's scenarios) beside this one's, in alternating rounds of a few steps each, so both see the same
machine load; each is printed as min / median over all its steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PaddingPolicy, validate
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.incremental import StepValidator
from dspark_abi.layout import POOL_NAMES
from dspark_abi.lowering import lower_local_request_ids, nested_scan_local_request_ids
from dspark_abi.presets import FLASH, FLASH_16K, FLASH_DSPARK


def median_seconds(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    """Median wall time of ``fn(setup())`` (``fn()`` without setup); setup runs outside the timed region."""
    times = []
    for _ in range(repeat):
        arg = setup() if setup else None
        t0 = time.perf_counter()
        fn(arg) if setup else fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(nbytes: int = 256 * 2**20, repeat: int = 7) -> float:
    """Bytes per second one large copy writes on this machine now."""
    src = np.ones(nbytes // 8, dtype=np.int64)
    dst = np.empty_like(src)
    return nbytes / median_seconds(lambda: np.copyto(dst, src), repeat)


def ragged_step(config: ModelConfig, n_tokens: int, n_requests: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(new tokens [R], cached tokens [R]): ragged chunks summing to N after ragged contexts."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n_tokens), n_requests - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [n_tokens]]))
    cached = rng.integers(1, config.max_position_embeddings - lengths)
    return lengths, cached


class Step:
    """A serving loop one step before the measured one: the allocator holds every request's history (mapped by
    an earlier one-token step) and a StepValidator has accepted that step."""

    def __init__(self, config: ModelConfig, n_tokens: int, n_requests: int, tp: int):
        self.config, self.policy = config, PaddingPolicy(tp_size=tp)
        self.lengths, cached = ragged_step(config, n_tokens, n_requests)
        self.cached = cached
        blocks = pool_blocks_for(config, cached + self.lengths, slack=64)
        self.allocator = BlockAllocator(config, blocks, capacity=n_requests)
        ids = list(range(n_requests))
        plan = self.allocator.plan(ids, cached - 1, cached - 1)      # the history, as earlier steps mapped it
        self.allocator.commit(plan)
        self.warm = self.build(self.allocator, np.ones(n_requests, np.int64), cached - 1)
        self.validator = self.primed()

    def primed(self) -> StepValidator:
        """A StepValidator that accepted the warm-up step (the state a serving loop's validator is in)."""
        validator = StepValidator(self.config, self.policy, self.allocator.pool_blocks)
        if not validator.validate(self.warm).ok:
            raise SystemExit("the warm-up step is invalid")
        return validator

    def build(self, allocator: BlockAllocator, lengths: np.ndarray, cached: np.ndarray,
              validator: StepValidator | None = None, *, per_request: bool = False) -> Any:
        builder = BatchBuilder(self.config, self.policy, allocator, validator=validator)
        if per_request:                         # one add() per request, as a Python serving loop would
            for rid, (new, ctx) in enumerate(zip(lengths.tolist(), cached.tolist(), strict=True)):
                builder.add(rid, num_cached=ctx, num_new=new)
        else:                                   # the engine's arrays as they are
            builder.add_many(np.arange(lengths.size), cached, lengths)
        batch = builder.build()
        builder.commit(batch)                   # a step is build + validation + commit (after its forward)
        return batch

    def fresh(self) -> tuple[BlockAllocator, StepValidator]:
        return copy.deepcopy(self.allocator), self.primed()

    def measured(self, validator: bool) -> Any:
        alloc, check = self.fresh()
        return self.build(alloc, self.lengths, self.cached, check if validator else None)


def row(label: str, seconds: float, nbytes: int | None, bw: float, note: str = "") -> None:
    floor = f"{seconds / (nbytes / bw):7.1f}x floor of {nbytes / 2**20:6.2f} MiB" if nbytes else " " * 32
    print(f"  {label:<44} {seconds * 1e3:8.2f} ms  {floor}  {note}")


def scenario(name: str, config: ModelConfig, n_tokens: int, n_requests: int, tp: int, repeat: int, bw: float
             ) -> None:
    step = Step(config, n_tokens, n_requests, tp)
    batch = step.measured(validator=False)
    arrays = batch.to_arrays()
    meta = sum(a.nbytes for a in arrays.values())
    tables = {p: batch.tables[p].shape[1] for p in POOL_NAMES}
    print(f"{name}: {config.name}  N={batch.num_tokens}  R={batch.num_requests}  TP={tp}  "
          f"contexts up to {int(step.cached.max()):,}  metadata {meta / 2**20:.2f} MiB per step")
    print(f"  table widths {tables}")
    if not validate(batch).ok or not step.validator.validate(batch).ok:
        raise SystemExit("the measured step is invalid")

    def incremental(state: tuple[BlockAllocator, StepValidator]) -> None:
        state[1].validate(batch)

    row("build, incremental validation (serving loop)",
        median_seconds(lambda state: step.build(state[0], step.lengths, step.cached, state[1]), repeat, step.fresh),
        meta, bw)
    row("build, full validation", median_seconds(lambda state: step.build(state[0], step.lengths, step.cached),
                                                 repeat, step.fresh), meta, bw)
    row("build, full validation, add() per request",
        median_seconds(lambda state: step.build(state[0], step.lengths, step.cached, per_request=True), repeat,
                       step.fresh), meta, bw)
    row("validate, full (stateless)", median_seconds(lambda: validate(batch), repeat), meta, bw, "(reads)")
    row("validate, incremental", median_seconds(incremental, repeat, step.fresh), meta, bw, "(reads)")
    row("validate, shape level", median_seconds(lambda: validate(batch, level="shape"), repeat), None, bw)

    qsl, local = batch.query_start_loc, batch.local_rows
    bases = [r * local for r in range(tp)]
    t_fast = median_seconds(lambda: [lower_local_request_ids(qsl, b, local) for b in bases], repeat * 4)
    t_nested = median_seconds(lambda: [nested_scan_local_request_ids(qsl, b, local) for b in bases], repeat)
    print(f"  lower_local_request_ids (all ranks) {t_fast * 1e6:8.1f} us; nested O(L*R) scan {t_nested * 1e6:8.1f} us"
          f" ({t_nested / t_fast:.1f}x)")


class VerifyStep:
    """R verify requests of ``width`` rows each at ragged contexts (their history mapped and committed by an earlier
    one-token step), optionally with a prefill chunk of ``mixed`` rows of another request in the same dispatch."""

    def __init__(self, config: ModelConfig, n_requests: int, width: int, mixed: int, tp: int, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.config, self.policy, self.width, self.mixed = config, PaddingPolicy(tp_size=tp), width, mixed
        self.cached = rng.integers(2, config.max_position_embeddings - width, n_requests)
        self.accepted = rng.integers(1, width + 1, n_requests)          # ragged acceptance, as a real step has
        self.tokens = rng.integers(0, config.vocab_size, (n_requests, width))
        self.prefill_at = int(rng.integers(0, config.max_position_embeddings - mixed))
        ends = np.concatenate([self.cached + width, [self.prefill_at + mixed]])
        blocks = pool_blocks_for(config, ends, slack=64)
        self.allocator = BlockAllocator(config, blocks, capacity=n_requests + 1)
        warm = BatchBuilder(config, self.policy, self.allocator)
        warm.add_many(np.arange(n_requests), self.cached - 1, np.ones(n_requests, np.int64))
        warm.add(n_requests, num_cached=max(0, self.prefill_at - 1), num_new=1)
        batch = warm.build()
        warm.commit(batch)
        self.warm = batch

    def fresh(self) -> tuple[BlockAllocator, StepValidator]:
        validator = StepValidator(self.config, self.policy, self.allocator.pool_blocks)
        if not validator.validate(self.warm).ok:
            raise SystemExit("the warm-up step is invalid")
        return copy.deepcopy(self.allocator), validator

    def build(self, allocator: BlockAllocator, validator: StepValidator | None = None, *,
              as_prefill: bool = False) -> Any:
        builder = BatchBuilder(self.config, self.policy, allocator, validator=validator)
        r = self.cached.size
        if as_prefill:                              # the same rows as plain prefill chunks (logits at the last row)
            builder.add_many(np.arange(r), self.cached, np.full(r, self.width), self.tokens.reshape(-1))
        else:                                       # one add_verify() per request: anchor + width - 1 drafts
            for rid, (ctx, ids) in enumerate(zip(self.cached.tolist(), self.tokens, strict=True)):
                builder.add_verify(rid, ctx, ids)
        if self.mixed:
            builder.add(r, num_cached=self.prefill_at, num_new=self.mixed,
                        token_ids=np.zeros(self.mixed, np.int64), logits="none")
        batch = builder.build()
        accepted = None if as_prefill else np.concatenate([self.accepted, [self.mixed] * bool(self.mixed)])
        accepted = None if accepted is None else accepted.astype(np.int64)
        builder.commit(batch, accepted=accepted)    # a step is build + validation + commit (after its forward)
        return batch


def verify_scenario(config: ModelConfig, n_requests: int, width: int, mixed: int, tp: int, repeat: int, bw: float
                    ) -> None:
    step = VerifyStep(config, n_requests, width, mixed, tp)
    batch = step.build(*step.fresh())
    meta = sum(a.nbytes for a in batch.to_arrays().values())
    print(f"verify{' + prefill' if mixed else ''}: {config.name} (K = {config.dspark_block_size})  "
          f"R={n_requests} x {width} rows{f' + {mixed} prefill rows' if mixed else ''}  N={batch.num_tokens}  "
          f"TP={tp}  contexts up to {int(step.cached.max()):,}  metadata {meta / 2**20:.2f} MiB per step")
    print(f"  table widths { {p: batch.tables[p].shape[1] for p in POOL_NAMES} }")
    if not validate(batch).ok:
        raise SystemExit("the measured verify step is invalid")
    row("build, incremental validation, commit", median_seconds(lambda st: step.build(st[0], st[1]), repeat,
                                                                step.fresh), meta, bw)
    row("build, full validation, commit", median_seconds(lambda st: step.build(st[0]), repeat, step.fresh), meta, bw)
    plain = step.build(step.fresh()[0], as_prefill=True)
    plain_meta = sum(a.nbytes for a in plain.to_arrays().values())
    row(f"the same rows as a {plain.num_tokens}-token prefill, full", median_seconds(
        lambda st: step.build(st[0], as_prefill=True), repeat, step.fresh), plain_meta, bw)
    row("validate, full (stateless)", median_seconds(lambda: validate(batch), repeat), meta, bw, "(reads)")


# ------------------------------------------------------------------------------------------------ full vs persistent
class Serving:
    """One step of a serving loop in both forms, from the same allocator state: R requests at ragged contexts up to
    the config's depth (their history mapped and committed by an earlier one-token step), each adding ``rows``
    (verify requests of ``rows`` rows with ``verify``, else prefill chunks of ragged lengths summing to
    ``rows * R``), optionally with a prefill chunk of ``mixed`` rows of another request; pools sized for the
    contexts times ``pool_scale``. The full form's figure is the serving loop of 1.2 (build + StepValidator +
    commit), the persistent form's build_step (+ its incremental check) + commit; both get the requests as arrays
    (add_verify_many / add_many), as an engine holds them."""

    def __init__(self, config: ModelConfig, n_requests: int, rows: int, *, verify: bool, mixed: int = 0, tp: int = 4,
                 pool_scale: int = 1, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.config, self.policy, self.verify, self.mixed = config, PaddingPolicy(tp_size=tp), verify, mixed
        if verify:
            self.lengths = np.full(n_requests, rows, np.int64)
            self.cached = rng.integers(2, config.max_position_embeddings - rows, n_requests)
        else:
            self.lengths, self.cached = ragged_step(config, rows * n_requests, n_requests, seed)
        self.accepted = rng.integers(1, rows + 1, n_requests) if verify else self.lengths
        self.tokens = rng.integers(0, config.vocab_size, int(self.lengths.sum()))
        self.prefill_at = int(rng.integers(0, config.max_position_embeddings - mixed))
        ends = np.concatenate([self.cached + self.lengths, [self.prefill_at + mixed]])
        blocks = pool_blocks_for(config, ends, slack=64)
        blocks = type(blocks)(**{p: blocks[p] * pool_scale for p in POOL_NAMES})
        self.allocator = BlockAllocator(config, blocks, capacity=n_requests + 1)
        warm = BatchBuilder(config, self.policy, self.allocator)
        warm.add_many(np.arange(n_requests), self.cached - 1, np.ones(n_requests, np.int64))
        warm.add(n_requests, num_cached=max(0, self.prefill_at - 1), num_new=1)
        self.warm = warm.build()
        warm.commit(self.warm)

    def fresh(self) -> tuple[BlockAllocator, StepValidator]:
        validator = StepValidator(self.config, self.policy, self.allocator.pool_blocks)
        if not validator.validate(self.warm).ok:
            raise SystemExit("the warm-up step is invalid")
        return copy.deepcopy(self.allocator), validator

    def step(self, state: tuple[BlockAllocator, StepValidator], form: str) -> Any:
        allocator, validator = state
        builder = BatchBuilder(self.config, self.policy, allocator, validator=validator if form == "full" else None)
        r = self.cached.size
        if self.verify:
            builder.add_verify_many(np.arange(r), self.cached, self.lengths, self.tokens)
        else:
            builder.add_many(np.arange(r), self.cached, self.lengths, self.tokens)
        if self.mixed:
            builder.add(r, num_cached=self.prefill_at, num_new=self.mixed,
                        token_ids=np.zeros(self.mixed, np.int64), logits="none")
        built = builder.build() if form == "full" else builder.build_step()
        accepted = np.concatenate([self.accepted, [self.mixed] * bool(self.mixed)]).astype(np.int64)
        builder.commit(built, accepted=accepted)     # a step is build + validation + commit (after its forward)
        return built


def step_bytes(built: Any) -> int:
    """Metadata bytes a step writes (its arrays; the persistent form: per-row arrays, slots and delta)."""
    return int(built.nbytes) if hasattr(built, "table_slots") else sum(a.nbytes for a in built.to_arrays().values())


def forms(label: str, serving: Serving, repeat: int, bw: float, goal_ms: float) -> dict[str, tuple[float, int]]:
    """Both forms of one scenario side by side: median ms of build + validation + commit, bytes per step, each
    beside the bandwidth floor of its bytes."""
    out = {}
    for form in ("full", "persistent"):
        built = serving.step(serving.fresh(), form)
        nbytes = step_bytes(built)
        seconds = median_seconds(lambda st, f=form: serving.step(st, f), repeat, serving.fresh)
        out[form] = (seconds, nbytes)
        row(f"{label}, {form}", seconds, nbytes, bw, f"(goal <= {goal_ms:g} ms)" if form == "persistent" else "")
    return out


def persistent_scenarios(repeat: int, bw: float) -> None:
    """The decode-rate goals: full vs persistent form, and the persistent step's cost when context and pools
    double (it must stay flat)."""
    k7 = FLASH_DSPARK.model_copy(update={"name": "flash-dspark-k7", "dspark_block_size": 7})   # S = 8 lanes
    print("full (1.2: build + StepValidator + commit) vs persistent (1.3: build_step + check + commit), TP = 4:")
    forms("verify R=256 x 8, contexts up to 1M", Serving(k7, 256, 8, verify=True), repeat, bw, 1)
    forms("verify R=256 x 8 + 64 prefill rows", Serving(k7, 256, 8, verify=True, mixed=64), repeat, bw, 1.5)
    forms("prefill 1M, N=8192, R=64", Serving(FLASH, 64, 128, verify=False), repeat, bw, 2)
    forms("prefill 16K, N=8192, R=512", Serving(FLASH_16K, 512, 16, verify=False), repeat, bw, 2)
    k7_2m = k7.model_copy(update={"name": "flash-dspark-k7-2m", "max_position_embeddings": 2 * 1048576})
    print("persistent verify step (R=256 x 8) as context and pools double:")
    for name, config, scale in (("1M context, pools x1", k7, 1), ("2M context, pools x2", k7_2m, 2)):
        serving = Serving(config, 256, 8, verify=True, pool_scale=scale)
        built = serving.step(serving.fresh(), "persistent")
        held = sum(t.nbytes for t in serving.allocator.persistent.tables.values()) / 2**20
        row(f"{name}", median_seconds(lambda st, s=serving: s.step(st, "persistent"), repeat, serving.fresh),
            step_bytes(built), bw, f"(tables {held:.0f} MiB held, not copied)")


def persistent_cases() -> dict[str, tuple[str, Callable[[], Serving]]]:
    """The persistent scenarios by key: (label, a factory of its serving state)."""
    k7 = FLASH_DSPARK.model_copy(update={"name": "flash-dspark-k7", "dspark_block_size": 7})   # S = 8 lanes
    k7_2m = k7.model_copy(update={"name": "flash-dspark-k7-2m", "max_position_embeddings": 2 * 1048576})
    return {
        "verify": ("verify R=256 x 8, contexts up to 1M", lambda: Serving(k7, 256, 8, verify=True)),
        "mixed": ("verify R=256 x 8 + 64 prefill rows", lambda: Serving(k7, 256, 8, verify=True, mixed=64)),
        "prefill1m": ("prefill 1M, N=8192, R=64", lambda: Serving(FLASH, 64, 128, verify=False)),
        "prefill16k": ("prefill 16K, N=8192, R=512", lambda: Serving(FLASH_16K, 512, 16, verify=False)),
        "verify2m": ("verify R=256 x 8, 2M context, pools x2",
                     lambda: Serving(k7_2m, 256, 8, verify=True, pool_scale=2)),
    }


def step_times(serving: Serving, repeat: int) -> list[float]:
    """Seconds of ``repeat`` persistent steps, each from a fresh copy of the state (copied outside the timing)."""
    times = []
    for _ in range(repeat):
        state = serving.fresh()
        t0 = time.perf_counter()
        serving.step(state, "persistent")
        times.append(time.perf_counter() - t0)
    return times


def worker() -> None:
    """``--worker``: answer lines "<case> <repeat>" on stdin with the JSON list of those steps' seconds."""
    cases, made = persistent_cases(), {}
    for line in sys.stdin:
        key, repeat = line.split()
        if key not in made:
            made[key] = cases[key][1]()
        print(json.dumps(step_times(made[key], int(repeat))), flush=True)


def against(other: str, rounds: int, per_round: int, bw: float) -> None:
    """The persistent steps of the checkout ``other`` (before) and of this one (after), alternating rounds."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(other)}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if proc.stdin is None or proc.stdout is None:
        raise SystemExit("could not start the worker")
    print(f"persistent steps, {other} (before) vs this checkout (after), {rounds} alternating rounds of "
          f"{per_round} steps; min / median ms:")
    for key, (label, make) in persistent_cases().items():
        serving = make()
        nbytes = step_bytes(serving.step(serving.fresh(), "persistent"))
        before: list[float] = []
        after: list[float] = []
        for _ in range(rounds):
            proc.stdin.write(f"{key} {per_round}\n")
            proc.stdin.flush()
            before += json.loads(proc.stdout.readline())
            after += step_times(serving, per_round)
        floor = nbytes / bw * 1e3
        b, a = np.array(before) * 1e3, np.array(after) * 1e3
        print(f"  {label:<40} before {b.min():5.2f} / {np.median(b):5.2f}   after {a.min():5.2f} / "
              f"{np.median(a):5.2f}   floor {floor:.3f} ms of {nbytes / 2**10:.0f} KiB")
    proc.stdin.close()
    proc.wait()


def phases(repeat: int) -> None:
    """``--phases``: the persistent verify step at 1M split by phase (each phase timed by a wrapper around its call,
    min / median ms), then cProfile's count of Python function calls in one step."""
    import cProfile
    import pstats

    from dspark_abi import allocator, builder, persistent

    times: dict[str, list[float]] = {}

    class Timed:
        """A wrapper timing each call of ``inner``; ``isinstance(x, wrapper)`` still asks ``inner`` when it is a
        class (the builder's ``commit`` tests its batch against the wrapped ``PersistentStep``)."""

        def __init__(self, inner: Any, label: str) -> None:
            self.inner, self.label = inner, label

        def __call__(self, *args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self.inner(*args, **kw)
            finally:
                times.setdefault(self.label, []).append(time.perf_counter() - t0)

        def __get__(self, obj: Any, owner: Any = None) -> Any:      # wrapping a method: bind like a function
            return self if obj is None else lambda *args, **kw: self(obj, *args, **kw)

        def __instancecheck__(self, obj: Any) -> bool:
            return isinstance(obj, self.inner)

    def timed(owner: Any, name: str, label: str) -> None:
        setattr(owner, name, Timed(getattr(owner, name), label))

    serving = persistent_cases()["verify"][1]()
    profile = cProfile.Profile()                            # before the wrappers, which would add their calls
    profile.runcall(serving.step, serving.fresh(), "persistent")
    calls = pstats.Stats(profile).total_calls
    wrapped = (
            (builder.BatchBuilder, "_check_specs", "queued requests checked (_check_specs)"),
            (allocator.BlockAllocator, "plan", "BlockAllocator.plan"),
            (builder.BatchBuilder, "_rows", "per-row arrays (_rows)"),
            (builder, "step_widths", "step_widths"),
            (builder, "written_slots", "written_slots"),
            (builder, "PersistentStep", "the step frozen (PersistentStep)"),
            (builder, "check_step", "check_step"),
            (persistent, "_delta_issues", "  of which the delta (_delta_issues)"),
            (persistent, "check_tokens", "  of which the token rules (check_tokens)"),
            (builder.BatchBuilder, "commit", "commit"))
    for owner, name, label in wrapped:
        timed(owner, name, label)
    whole = step_times(serving, repeat)
    print(f"persistent verify step at 1M by phase, {repeat} steps, min / median ms:")
    for label, seconds in [*((label, times[label]) for _, _, label in wrapped), ("whole step", whole)]:
        print(f"  {label:<44} {min(seconds) * 1e3:6.3f} / {statistics.median(seconds) * 1e3:6.3f}")
    print(f"  Python function calls in one step (cProfile): {calls:,}")


def allocator_construction(config: ModelConfig, requests: int, repeat: int, bw: float) -> None:
    blocks = pool_blocks_for(config, [config.max_position_embeddings] * requests)
    probe = BlockAllocator(config, blocks, capacity=requests)
    nbytes = sum(t.nbytes for t in probe._tables.values())
    nbytes += sum(f.nbytes for f in probe._free.values())
    row(f"allocator construction, {requests} requests",
        median_seconds(lambda: BlockAllocator(config, blocks, capacity=requests), repeat), nbytes, bw)


def held_blocks(config: ModelConfig, chunk: int) -> None:
    """Blocks one request holds in each ring pool while it grows to the full depth in ``chunk``-token steps."""
    blocks = pool_blocks_for(config, [config.max_position_embeddings])
    alloc = BlockAllocator(config, blocks, capacity=1)
    most = dict.fromkeys(POOL_NAMES, 0)
    for start in range(0, config.max_position_embeddings, chunk):
        plan = alloc.plan([0], np.array([start]), np.array([min(start + chunk, config.max_position_embeddings)]))
        alloc.commit(plan)
        for p, held in alloc.held_blocks(0).items():
            most[p] = max(most[p], held)
    print(f"  blocks held by one request growing to {config.max_position_embeddings:,} positions in {chunk}-token "
          "chunks (most at any step), 1.0 allocator vs now:")
    for pl in config.layout:
        if pl.is_ring:
            # the 1.0 allocator kept every ori page; it recycled the state pools already, in MAXPOS-wide tables
            before = -(-config.max_position_embeddings // pl.page_size) if not pl.is_state else most[pl.name]
            print(f"    {pl.name:<16} {before:>8,} -> {most[pl.name]:>6,} blocks  (bound ceil((reach + chunk) / "
                  f"page) + 1 = {-(-(pl.reach + chunk) // pl.page_size) + 1}; table columns {pl.table_width:,} -> "
                  f"{pl.ring_width:,})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 repeats instead of 15")
    ap.add_argument("--scenario", choices=["1m", "16k", "verify", "persistent", "both", "all"], default="all",
                    help="both = 1m and 16k; all = 1m, 16k, verify and persistent (full vs persistent form)")
    ap.add_argument("--against", metavar="DIR", help="another checkout: its persistent steps beside this one's")
    ap.add_argument("--phases", action="store_true", help="the persistent verify step split by phase, and profiled")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    repeat = 3 if args.quick else 15
    bw = bandwidth()
    print(f"memory bandwidth (np.copyto of 256 MiB): {bw / 1e9:.1f} GB/s")
    if args.against:
        against(args.against, 2 if args.quick else 8, 5, bw)
        return
    if args.phases:
        phases(12 if args.quick else 60)
        return
    if args.scenario in ("1m", "both", "all"):
        scenario("1m", FLASH, 8192, 64, 4, repeat, bw)
        allocator_construction(FLASH, 256, repeat, bw)
        held_blocks(FLASH, 8192)
    if args.scenario in ("16k", "both", "all"):
        scenario("16k", FLASH_16K, 8192, 512, 4, repeat, bw)
    if args.scenario in ("verify", "all"):
        k7 = FLASH_DSPARK.model_copy(update={"name": "flash-dspark-k7", "dspark_block_size": 7})   # S = 8 lanes
        for mixed in (0, 64):
            verify_scenario(k7, 256, 8, mixed, 4, repeat, bw)
    if args.scenario in ("persistent", "all"):
        persistent_scenarios(repeat, bw)


if __name__ == "__main__":
    main()
