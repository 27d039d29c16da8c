"""Benchmarks of the numpy reference attention (`dspark_kernels.reference.attention`).

Prints three figures, all measured in the same run:

1. Achieved GFLOP/s of one CSA and one HCA layer at FLASH head sizes (N new tokens from position 0, random
   weights) next to numpy's own matmul GFLOP/s ([N, hidden] @ [hidden, hidden]); target >= 50%.
   FLOPs are the useful ones of the math (projections, compressors, indexer scores over visible entries,
   QK and PV over each query's own keys, o-projection), not the work the implementation happens to do.
2. Packing pays: 32 requests of 64 new tokens in one packed call vs one call per request (target >= 2x),
   and 32 ragged requests (2, 6, ..., 126 new tokens, mean 64) packed vs padded to the longest (every
   request computed with 126 rows, as a dense [R, S_max] batch would).
3. Peak memory of one N = 8192 FLASH-size CSA layer beyond weights, caches and the input rows
   (tracemalloc, which sees numpy's buffers); the design bound is about 2 GiB.

    python benchmarks/bench_kernels.py            # default figures (~2-3 minutes on 2 cores)
    python benchmarks/bench_kernels.py --quick    # smoke run (< 30 s)
    python benchmarks/bench_kernels.py --threads 1 --cpu-time   # single-threaded BLAS, CPU-time clock

Every figure is the best of a few interleaved rounds (see ``best_interleaved``). On a machine shared with
other work, ``--threads 1 --cpu-time`` gives the most repeatable ratios: one BLAS thread and the
process's own CPU time, which other processes cannot inflate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, PoolBlocks
from dspark_abi.config import ModelConfig
from dspark_abi.presets import FLASH, TINY
from dspark_kernels import AttentionWeights, LayerCaches, attention
from dspark_kernels.model.prepared import PreparedWeightsCache

CONFIGS = {"flash": FLASH, "tiny": TINY}
GIB = 1 << 30
_WEIGHTS: dict[tuple[str, int], AttentionWeights] = {}
#: The prepared weights of every layer timed, kept by the benchmark (the caller owns the cache).
PREPARED = PreparedWeightsCache()
#: The clock every figure uses: wall time, or the process's CPU time with --cpu-time.
CLOCK: Callable[[], float] = time.perf_counter
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def weights_for(config: ModelConfig, layer: int, precision: str) -> AttentionWeights:
    """Random weights of one layer, made once per run (FLASH layers take seconds to draw)."""
    key = (config.name, layer)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = AttentionWeights.random(config, layer, seed=0)
    PREPARED.get(_WEIGHTS[key], precision)  # derive the a2a3 weights outside any timing
    return _WEIGHTS[key]


def layer_of(config: ModelConfig, kind: str) -> int:
    return next(i for i in range(config.num_layers) if config.layer_kind(i) == kind)


def pools_for(config: ModelConfig, tokens: int, requests: int = 1) -> PoolBlocks:
    """Pool sizes that hold ``requests`` requests of ``tokens`` positions from position 0 (with slack)."""
    per = tokens + 32 * requests

    def blocks(page: int, ratio: int = 1) -> int:
        return -(-per // (page * ratio)) + 2 * requests

    return PoolBlocks(ori=blocks(32), csa_cmp=blocks(32, 4), hca_cmp=blocks(32, 128), idx=blocks(32, 4),
                      csa_state=blocks(2), csa_inner_state=blocks(2), hca_state=blocks(8))


def make_batch(config: ModelConfig, lengths: Sequence[int], requests: int | None = None) -> PackedBatch:
    alloc = BlockAllocator(config, pools_for(config, max(lengths) * len(lengths), requests or len(lengths)),
                           capacity=len(lengths))
    builder = BatchBuilder(config, PaddingPolicy(), alloc)
    for rid, n in enumerate(lengths):
        builder.add(rid, 0, n)
    return builder.build()


def hidden(batch: PackedBatch, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((batch.padded_rows, batch.config.hidden_size),
                                                    dtype=np.float32)
    x[batch.row_request < 0] = 0
    return x


def attention_flops(batch: PackedBatch, layer: int) -> int:
    """Useful FLOPs of one attention call over all rows of ``batch`` (2 per multiply-add)."""
    c = batch.config
    live = batch.row_request >= 0
    n = int(live.sum())
    p = batch.positions[live].astype(np.int64)
    x, h, d, q, ro, g = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_lora_rank, c.o_groups
    ratio = c.compress_ratios[layer]
    per_token = x * q + q * h * d + x * d + h * d * ro + g * ro * x           # q, kv, o-proj
    keys = np.minimum(c.sliding_window, p + 1)
    if ratio:
        coff = 2 if ratio == 4 else 1
        per_token += 2 * x * coff * d                                          # compressor wkv + wgate
    if ratio == 4:
        hi, di = c.index_n_heads, c.index_head_dim
        per_token += 2 * x * 2 * di + q * hi * di + hi * di * di + x * hi     # idx compressor, idx q, Hadamard
        visible = (p + 1) // 4
        keys = keys + np.minimum(c.index_topk, visible)
        scores = int((visible * hi * di).sum())
    elif ratio == 128:
        keys = keys + (p + 1) // 128
        scores = 0
    else:
        scores = 0
    return 2 * (n * per_token + scores + int((2 * h * d * keys).sum()))


def attention_call(batch: PackedBatch, layer: int, weights: AttentionWeights, precision: str) -> Callable[[], float]:
    """A closure timing one attention call over ``batch`` on fresh zero caches (allocated outside the timing)."""
    x = hidden(batch)

    def run() -> float:
        caches = LayerCaches.allocate(batch.config, layer, batch.pool_blocks, precision)
        start = CLOCK()
        attention(batch, layer, x, weights, caches, precision=precision, prepared=PREPARED)
        return CLOCK() - start

    return run


def matmul_call(rows: int, width: int) -> Callable[[], float]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, width), dtype=np.float32)
    b = rng.standard_normal((width, width), dtype=np.float32)

    def run() -> float:
        start = CLOCK()
        a @ b
        return CLOCK() - start

    return run


def best_interleaved(cases: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Best wall time of each case over ``repeats`` rounds that run every case once, in turn.

    Interleaving keeps the cases' measurements close in time, so load from other processes on a shared
    machine affects all of them alike; the best round of each is its least-disturbed run.
    """
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeats):
        for name, run in cases.items():
            best[name] = min(best[name], run())
    return best


def bench_gflops(config: ModelConfig, tokens: int, precision: str, repeats: int) -> list[dict[str, Any]]:
    rows = []
    mm_rows, width = min(tokens, 1024), config.hidden_size
    for kind in ("csa", "hca"):
        layer = layer_of(config, kind)
        weights = weights_for(config, layer, precision)
        batch = make_batch(config, [tokens])
        best = best_interleaved({"matmul": matmul_call(mm_rows, width),
                                 "attention": attention_call(batch, layer, weights, precision)}, repeats)
        mm = 2 * mm_rows * width * width / best["matmul"] / 1e9
        seconds = best["attention"]
        flops = attention_flops(batch, layer)
        rows.append({"kind": kind, "layer": layer, "tokens": tokens, "seconds": seconds, "gflop": flops / 1e9,
                     "gflops": flops / seconds / 1e9, "matmul_gflops": mm,
                     "fraction": flops / seconds / 1e9 / mm})
        print(f"  {kind.upper()} layer {layer}: N={tokens}  {flops / 1e9:8.1f} GFLOP in {seconds:6.2f} s = "
              f"{flops / seconds / 1e9:6.1f} GFLOP/s; numpy matmul {mm:6.1f} GFLOP/s -> "
              f"{100 * flops / seconds / 1e9 / mm:5.1f}%", flush=True)
    return rows


def ragged_lengths(requests: int, mean: int) -> list[int]:
    """Evenly spread lengths with the given mean, e.g. 32 requests of mean 64 -> 2, 6, ..., 126."""
    step = 2 * mean // requests
    first = mean - step * (requests - 1) // 2
    return [max(1, first + step * i) for i in range(requests)]


def bench_packing(config: ModelConfig, requests: int, mean_new: int, precision: str,
                  repeats: int) -> dict[str, Any]:
    layer = layer_of(config, "csa")
    weights = weights_for(config, layer, precision)

    def call(lengths: Sequence[int]) -> Callable[[], float]:
        return attention_call(make_batch(config, lengths), layer, weights, precision)

    uniform = [mean_new] * requests
    ragged = ragged_lengths(requests, mean_new)
    singles = [call([n]) for n in uniform]
    best = best_interleaved({"packed": call(uniform), "one_each": lambda: sum(run() for run in singles),
                             "ragged": call(ragged), "padded": call([max(ragged)] * requests)}, repeats)
    packed, one_each, packed_ragged, padded = best["packed"], best["one_each"], best["ragged"], best["padded"]
    out = {"requests": requests, "new_tokens": mean_new, "packed_s": packed, "one_call_each_s": one_each,
           "speedup_vs_one_each": one_each / packed, "ragged_lengths": [min(ragged), max(ragged)],
           "ragged_packed_s": packed_ragged, "padded_to_longest_s": padded, "speedup_vs_padded": padded / packed_ragged}
    print(f"  {requests} requests x {mean_new} new tokens (CSA layer {layer}): packed {packed:6.2f} s, "
          f"one call each {one_each:6.2f} s -> packed is {one_each / packed:4.2f}x faster", flush=True)
    print(f"  {requests} ragged requests ({min(ragged)}..{max(ragged)} new tokens, mean "
          f"{sum(ragged) / requests:.0f}): packed {packed_ragged:6.2f} s, padded to the longest {padded:6.2f} s "
          f"-> packed is {padded / packed_ragged:4.2f}x faster", flush=True)
    return out


def bench_memory(config: ModelConfig, tokens: int, precision: str) -> dict[str, Any]:
    layer = layer_of(config, "csa")
    weights = weights_for(config, layer, precision)
    batch = make_batch(config, [tokens])
    x = hidden(batch)
    caches = LayerCaches.allocate(config, layer, batch.pool_blocks, precision)
    cache_bytes = sum(a.nbytes for a in caches.arrays().values())
    tracemalloc.start()
    start = CLOCK()
    attention(batch, layer, x, weights, caches, precision=precision, prepared=PREPARED)
    seconds = CLOCK() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"  CSA layer {layer}, N={tokens}: peak {peak / GIB:5.2f} GiB beyond weights, caches "
          f"({cache_bytes / GIB:4.2f} GiB) and x ({x.nbytes / GIB:4.2f} GiB); {seconds:5.1f} s", flush=True)
    return {"tokens": tokens, "peak_gib": peak / GIB, "cache_gib": cache_bytes / GIB, "seconds": seconds}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run in well under 30 s")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="flash", help="head sizes (default flash)")
    ap.add_argument("--precision", choices=["fp32", "a2a3"], default="fp32")
    ap.add_argument("--threads", type=int, help="BLAS threads (re-runs the script with the thread variables set)")
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time instead of wall time")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.threads is not None and os.environ.get(BLAS_THREAD_VARS[0]) != str(args.threads):
        # BLAS reads its thread count when numpy loads it: start again with the variables set
        env = dict(os.environ, **dict.fromkeys(BLAS_THREAD_VARS, str(args.threads)))
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env)
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    config = CONFIGS[args.config]
    tokens, repeats, requests, mean_new, mem_tokens = (128, 1, 4, 16, 256) if args.quick else (1024, 3, 32, 64, 8192)
    threads = os.environ.get(BLAS_THREAD_VARS[0], "default")
    print(f"reference attention, {config.name} head sizes, precision {args.precision}"
          f"{' (quick)' if args.quick else ''}; BLAS threads {threads}, clock "
          f"{'cpu' if args.cpu_time else 'wall'}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
          flush=True)
    print("GFLOP/s:", flush=True)
    figures: dict[str, Any] = {"config": config.name, "precision": args.precision, "quick": args.quick,
                               "blas_threads": threads, "clock": "cpu" if args.cpu_time else "wall"}
    figures["gflops"] = bench_gflops(config, tokens, args.precision, repeats)
    print("packing:", flush=True)
    figures["packing"] = bench_packing(config, requests, mean_new, args.precision, min(repeats, 2))
    print("memory:", flush=True)
    figures["memory"] = bench_memory(config, min(mem_tokens, config.max_position_embeddings), args.precision)
    figures["load_average_end"] = os.getloadavg()[0]
    print(f"load average at the end: {figures['load_average_end']:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


if __name__ == "__main__":
    main()
