"""Prefill throughput of the full forward (reference backend): does packing many requests cost anything?

For each config (TINY, DEMO) and N new tokens, three ways to prefill the same N tokens from empty caches:

* ``one request``  : one request of N tokens, one call;
* ``16 packed``    : 16 requests of N/16 tokens packed into one call;
* ``16 calls``     : the same 16 requests, one call each.

Prints tokens/s of each and the packing cost ``time(16 packed) / time(one request) - 1`` (target <= 10%).
Random weights (DEMO: one random set per layer kind, so the model fits in memory) are materialised before
timing; every timed run starts from freshly allocated, zeroed caches (allocation is not timed). Best of
``--repeats`` runs.

    PYTHONPATH=. python benchmarks/bench_prefill.py            # TINY N=2048, DEMO N=512
    PYTHONPATH=. python benchmarks/bench_prefill.py --quick    # TINY N=512, DEMO N=64, one repeat
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.config import ModelConfig
from dspark_abi.presets import DEMO, TINY
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.forward import ForwardOptions, run_forward
from dspark_kernels.model.prepared import PreparedWeightsCache
from dspark_kernels.model.weights import ModelWeights

REQUESTS = 16


def _pool_blocks(n_tokens: int) -> PoolBlocks:
    # every pool holds all N tokens' pages plus one partial page per request, with slack
    return PoolBlocks.uniform(max(64, n_tokens // 2 + 4 * REQUESTS))


def _time_calls(config: ModelConfig, weights: ModelWeights, calls: Sequence[Sequence[tuple[int, int]]],
                precision: str, prepared: PreparedWeightsCache) -> float:
    """Seconds to run ``calls`` (each a list of (request id, new tokens) from position 0) on fresh caches."""
    rng = np.random.default_rng(0)
    total = sum(n for call in calls for _, n in call)
    blocks = _pool_blocks(total)
    alloc = BlockAllocator(config, blocks, capacity=REQUESTS + 1)
    caches = ModelCaches.allocate(config, blocks, precision=precision)
    batches = []
    for call in calls:
        bb = BatchBuilder(config, PaddingPolicy(), alloc)
        for rid, n in call:
            bb.add(rid, num_cached=0, num_new=n, token_ids=rng.integers(0, config.vocab_size, n))
        batches.append(bb.build())
    start = time.perf_counter()
    for b in batches:
        run_forward(b, b.token_ids, weights, caches, ForwardOptions(precision=precision, prepared=prepared))
    return time.perf_counter() - start


def bench(config: ModelConfig, n_tokens: int, repeats: int, precision: str) -> dict[str, float]:
    weights = ModelWeights.random(config, 0, share_layers=config is not TINY)
    for i in range(config.num_layers):  # materialise before timing
        weights.layer(i)
    weights.head()
    weights.embed()
    per = n_tokens // REQUESTS
    scenarios = {
        "one request": [[(0, per * REQUESTS)]],
        "16 packed": [[(r, per) for r in range(REQUESTS)]],
        "16 calls": [[(r, per)] for r in range(REQUESTS)],
    }
    prepared = PreparedWeightsCache()  # the benchmark keeps the prepared weights across its calls
    _time_calls(config, weights, [[(0, min(per, 16))]], precision, prepared)  # warm-up (prepared weights, BLAS)
    best = {name: min(_time_calls(config, weights, calls, precision, prepared) for _ in range(repeats))
            for name, calls in scenarios.items()}
    return {name: per * REQUESTS / t for name, t in best.items()} | {"seconds_one": best["one request"]}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small N, one repeat")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "a2a3"])
    ap.add_argument("--configs", default="tiny,demo", help="comma-separated: tiny,demo")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--tiny-tokens", type=int, default=None, help="N for TINY (default 2048, quick 512)")
    ap.add_argument("--demo-tokens", type=int, default=None, help="N for DEMO (default 512, quick 64)")
    args = ap.parse_args(argv)
    sizes = {"tiny": args.tiny_tokens or (512 if args.quick else 2048),
             "demo": args.demo_tokens or (64 if args.quick else 512)}
    repeats = args.repeats or (1 if args.quick else 2)
    print(f"precision={args.precision} repeats={repeats} requests={REQUESTS}")
    print(f"{'config':6} {'N':>5} {'one request':>14} {'16 packed':>14} {'16 calls':>14} {'packing cost':>13} "
          f"{'packed vs calls':>16}")
    for name in args.configs.split(","):
        config = {"tiny": TINY, "demo": DEMO}[name]
        r = bench(config, sizes[name], repeats, args.precision)
        cost = r["one request"] / r["16 packed"] - 1
        print(f"{name:6} {sizes[name]:>5} {r['one request']:>10.1f} t/s {r['16 packed']:>10.1f} t/s "
              f"{r['16 calls']:>10.1f} t/s {cost:>+12.1%} {r['16 packed'] / r['16 calls']:>15.2f}x", flush=True)


if __name__ == "__main__":
    main()
