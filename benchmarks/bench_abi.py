"""Host metadata costs of one serving step at the model's real depth, and at upstream's 16K fixture depth.

    python benchmarks/bench_abi.py            # both scenarios, 15 repeats
    python benchmarks/bench_abi.py --quick    # 3 repeats (smoke run)

Scenario "1m": FLASH at 1,048,576 positions, N = 8192 new tokens over R = 64 continuing requests (ragged chunks,
ragged cached contexts up to 1M), TP = 4. Scenario "16k": FLASH_16K, N = 8192 over R = 512 requests.
A "build" figure is one whole step of the serving loop's metadata: build (plan, assemble, validate) plus the
commit that advances the allocator after the forward. Every figure is a median of repeated runs in this one
process, printed beside the memory-bandwidth floor of the bytes it must write (those bytes / a large np.copyto's
bandwidth measured in the same run), so the ratios stay meaningful on a noisy shared machine even when the absolute
numbers drift.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PaddingPolicy, validate
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.incremental import StepValidator
from dspark_abi.layout import POOL_NAMES
from dspark_abi.lowering import lower_local_request_ids, nested_scan_local_request_ids
from dspark_abi.presets import FLASH, FLASH_16K


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
    ap.add_argument("--scenario", choices=["1m", "16k", "both"], default="both")
    args = ap.parse_args()
    repeat = 3 if args.quick else 15
    bw = bandwidth()
    print(f"memory bandwidth (np.copyto of 256 MiB): {bw / 1e9:.1f} GB/s")
    if args.scenario in ("1m", "both"):
        scenario("1m", FLASH, 8192, 64, 4, repeat, bw)
        allocator_construction(FLASH, 256, repeat, bw)
        held_blocks(FLASH, 8192)
    if args.scenario in ("16k", "both"):
        scenario("16k", FLASH_16K, 8192, 512, 4, repeat, bw)


if __name__ == "__main__":
    main()
