"""Host time per step of the serving loop on both block-table forms: full (``build()``) and persistent
(``build_step()``, the kernels read the persistent tables through a mirror advanced by each step's delta).

Two measurements, medians over the steps, one process, both forms on the same sequence of steps:

* **metadata**: a verify loop of R requests at deep, ragged contexts (TINY heads at the real 1M-position depth),
  every step ``1 + K`` rows per request and a random accepted count: queue, build, the kernels' host work that
  precedes any layer (for the persistent form: the mirror's ``apply``, the step's one proof, and the plan source:
  the step's own rows, its slots and generations checked, O(R); no full form), the whole group's
  :class:`~dspark_kernels.model.plan.BatchPlan`, commit. No forward runs.
* **loop**: ``generate`` on TINY_DSPARK (random drafter, mixed prefill + verify steps, single process): the
  wall time of whole steps, forward included (``StepRecord.seconds``).
* **distributed** (``--distributed``): ``generate(..., tp=2, tp_mode="distributed")`` (one process per rank, a
  :class:`~dspark_kernels.model.tp.RankGroup` across the steps) on TINY_DSPARK and on :data:`WIDE` (twice the
  layers, four times the hidden size): the median wall time per step (the first step, which starts the group, is
  left out), and the bytes per step a group that shipped its weights and caches with every step moved across the
  process boundary, at these sizes and at FLASH's for a typical pool.

    python benchmarks/bench_loop.py                         # R = 64, contexts up to 200,000, 20 steps
    python benchmarks/bench_loop.py --requests 256 --max-context 1000000 --steps 10
    python benchmarks/bench_loop.py --distributed           # only the distributed loop
"""

from __future__ import annotations

import argparse
import pickle
import time

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.presets import FLASH, TINY_1M, TINY_DSPARK
from dspark_kernels.memory import cache_bytes, format_bytes, weight_bytes
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.plan import PlanSource
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.speculative import RandomDrafter, generate

#: drafts per verify request (the DSpark block size of the TINY_DSPARK preset)
K = TINY_DSPARK.dspark_block_size
#: TINY heads at the real 1,048,576-position depth, verifying up to K drafts
DEEP = TINY_1M.model_copy(update={"name": "tiny-1m-dspark", "dspark_target_layers": TINY_DSPARK.dspark_target_layers,
                                  "dspark_block_size": K})


def metadata_step_ms(form: str, requests: int, max_context: int, steps: int, tp: int, seed: int
                     ) -> dict[str, list[float]]:
    """Milliseconds of host metadata per verify step in ``form``, by part: ``step`` (queue and build; for the
    persistent form also the mirror's ``apply`` and the plan source, what a forward derives first),
    ``plan`` (the whole group's :class:`~dspark_kernels.model.plan.BatchPlan`), ``commit``, and ``total``."""
    rng = np.random.default_rng(seed)
    contexts = rng.integers(max_context // 2, max_context, requests).astype(np.int64)
    ids = list(range(requests))
    alloc = BlockAllocator(DEEP, pool_blocks_for(DEEP, [int(c) + (K + 1) * (steps + 1) for c in contexts], slack=8))
    alloc.commit(alloc.plan(ids, contexts, contexts))           # deep histories, no compute
    builder = BatchBuilder(DEEP, PaddingPolicy(tp_size=tp), alloc)
    mirror = alloc.persistent.copy()
    accepted_rng = np.random.default_rng(seed + 1)
    out: dict[str, list[float]] = {"step": [], "plan": [], "commit": [], "total": []}
    for _ in range(steps):
        accepted = accepted_rng.integers(1, K + 2, requests)
        tokens = np.zeros(requests * (K + 1), np.int64)
        t0 = time.perf_counter()
        builder.add_verify_many(ids, contexts, np.full(requests, K + 1), tokens)
        if form == "full":
            step = builder.build()
            source = PlanSource.of(step)
        else:
            step = builder.build_step()
            mirror.grow(alloc.persistent.slots)
            mirror.apply(step)                                   # the device mirror: the delta alone
            source = PlanSource.of(step, mirror)
        t1 = time.perf_counter()
        source.plan()
        t2 = time.perf_counter()
        builder.commit(step, accepted=accepted)
        t3 = time.perf_counter()
        for part, ms in (("step", t1 - t0), ("plan", t2 - t1), ("commit", t3 - t2), ("total", t3 - t0)):
            out[part].append(ms * 1e3)
        contexts += accepted
    return out


def loop_step_ms(form: str, seed: int) -> list[float]:
    """Milliseconds per step of ``generate`` (forward included) in ``form``."""
    weights = ModelWeights.random(TINY_DSPARK, seed=seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, TINY_DSPARK.vocab_size, n) for n in (5, 23, 40, 9)]
    result = generate(prompts, weights, RandomDrafter(TINY_DSPARK.vocab_size, seed=1), 12, K, prefill_chunk=8,
                      tables=form)  # type: ignore[arg-type]
    return [s * 1e3 for s in result.step_seconds.tolist()]


#: A larger TINY-DSpark the 2-core machine affords: twice the layers (8), four times the hidden size (512).
WIDE = TINY_DSPARK.model_validate({**TINY_DSPARK.model_dump(), "name": "wide-dspark", "hidden_size": 512,
                                   "compress_ratios": (0, 4, 128, 4, 0, 4, 128, 4)})
#: The pool of a typical FLASH serving batch for the bytes figure: 8 requests of 8K tokens.
FLASH_LENGTHS = [8192] * 8


def distributed_step_ms(config_name: str, seed: int) -> tuple[list[float], dict[str, int]]:
    """Milliseconds per step of ``generate`` with TP 2 in rank processes on ``config_name`` (TINY_DSPARK or
    WIDE), and the bytes one step moved when weights and caches crossed the process boundary with every step."""
    config = {"tiny-dspark": TINY_DSPARK, "wide-dspark": WIDE}[config_name]
    weights = ModelWeights.random(config, seed=seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, config.vocab_size, n) for n in (5, 23, 40, 9)]
    new_tokens = 12
    alloc = BlockAllocator(config, pool_blocks_for(config, [p.size + new_tokens + K + 1 for p in prompts], slack=8))
    caches = ModelCaches.allocate(config, alloc.pool_blocks)
    result = generate(prompts, weights, RandomDrafter(config.vocab_size, seed=1), new_tokens, K, prefill_chunk=8,
                      tp=2, tp_mode="distributed", allocator=alloc, caches=caches)
    tp = 2
    sizes = {"caches": cache_bytes(config, alloc.pool_blocks), "weights_built": weight_bytes(config),
             "weights_pickled": len(pickle.dumps(weights))}
    sizes["per_step"] = 2 * tp * sizes["caches"] + tp * sizes["weights_pickled"]
    return [s * 1e3 for s in result.step_seconds.tolist()[1:]], sizes


def print_distributed(seed: int) -> None:
    """The distributed loop's step times and the bytes per step that stay in the rank processes."""
    print("generate(tp=2, tp_mode='distributed'), whole steps after the first (median ms; bytes per step a group "
          "that ships weights and caches every step moves: caches to and from each rank, the weights' pickled "
          "description to each rank, which rebuilds every layer)")
    for name in ("tiny-dspark", "wide-dspark"):
        ms, sizes = distributed_step_ms(name, seed)
        print(f"  {name:<12} {float(np.median(ms)):8.1f} ms/step over {len(ms)} steps   caches "
              f"{format_bytes(sizes['caches'])}, weights {format_bytes(sizes['weights_built'])} built "
              f"({format_bytes(sizes['weights_pickled'])} pickled): {format_bytes(sizes['per_step'])} per step "
              f"+ {format_bytes(2 * sizes['weights_built'])} rebuilt")
    flash = cache_bytes(FLASH, pool_blocks_for(FLASH, FLASH_LENGTHS, slack=8))
    print(f"  FLASH, {len(FLASH_LENGTHS)} requests x {FLASH_LENGTHS[0]} tokens: caches {format_bytes(flash)}, "
          f"{format_bytes(2 * 2 * flash)} per step at TP 2 (to and from each rank), "
          f"{format_bytes(2 * 8 * flash)} at TP 8; weights {format_bytes(weight_bytes(FLASH))} in fp32 when kept "
          "(built once per rank now)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="verify requests per step (R)")
    parser.add_argument("--max-context", type=int, default=200_000, help="contexts drawn in [max/2, max)")
    parser.add_argument("--steps", type=int, default=20, help="steps measured per form")
    parser.add_argument("--tp", type=int, default=4, help="TP group size of the padding policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-loop", action="store_true", help="skip the generate() measurement")
    parser.add_argument("--distributed", action="store_true",
                        help="only the distributed loop (TP 2 rank processes) on TINY_DSPARK and WIDE")
    args = parser.parse_args()
    if args.distributed:
        print_distributed(args.seed)
        return
    print(f"metadata per verify step: R = {args.requests} x {K + 1} rows, contexts in "
          f"[{args.max_context // 2}, {args.max_context}), TP = {args.tp}, {args.steps} steps (median ms)")
    meta = {form: {part: float(np.median(v)) for part, v in metadata_step_ms(
        form, args.requests, args.max_context, args.steps, args.tp, args.seed).items()}
        for form in ("full", "persistent")}
    print(f"  {'part':<8} {'full':>10} {'persistent':>11} {'ratio':>6}")
    for part in ("step", "plan", "commit", "total"):
        full, pers = meta["full"][part], meta["persistent"][part]
        print(f"  {part:<8} {full:>10.2f} {pers:>11.2f} {pers / full:>6.2f}")
    if not args.no_loop:
        loop = {form: float(np.median(loop_step_ms(form, args.seed))) for form in ("full", "persistent")}
        print("generate() on TINY_DSPARK, whole steps with the forward (median ms)")
        print(f"  full {loop['full']:.2f} ms   persistent {loop['persistent']:.2f} ms   "
              f"persistent / full = {loop['persistent'] / loop['full']:.2f}")


if __name__ == "__main__":
    main()
