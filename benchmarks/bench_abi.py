"""ABI costs at serving scale: builder, full validation, and the O(L+R) lowering vs the nested scan.

    python benchmarks/bench_abi.py            # N = 8192, R = 512, TP = 4, FLASH config
    python benchmarks/bench_abi.py --quick    # smaller repeat counts (smoke run)

All timings are medians of repeated runs in this one process, printed side by side, so the
ratios are meaningful on a noisy shared machine even when the absolute numbers drift.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks, validate
from dspark_abi.lowering import lower_local_request_ids, nested_scan_local_request_ids
from dspark_abi.presets import FLASH


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_step(n_tokens: int, n_requests: int, tp: int, seed: int = 0):
    """A serving step: R requests with ragged new-token counts summing to N, each after a ragged context."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n_tokens), n_requests - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [n_tokens]]))
    cached = rng.integers(0, FLASH.max_position_embeddings - lengths.max() - 1, n_requests)
    cached = np.minimum(cached, FLASH.max_position_embeddings - lengths)
    return lengths.tolist(), cached.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeat = 3 if args.quick else 15
    lengths, cached = make_step(args.tokens, args.requests, args.tp)
    policy = PaddingPolicy(tp_size=args.tp)
    # pools big enough for every request's touched pages (window, compressed history, state history)
    blocks = PoolBlocks(**{pl.name: args.requests * (pl.table_width if not pl.is_state else
                                                     (pl.state_len + max(lengths)) // pl.page_size + 2) + 64
                           for pl in FLASH.layout})

    # the allocator persists across serving steps: create them outside the timed region
    allocators = [BlockAllocator(FLASH, blocks, capacity=args.requests) for _ in range(repeat + 1)]

    def build():
        builder = BatchBuilder(FLASH, policy, allocators.pop())
        for rid, (new, ctx) in enumerate(zip(lengths, cached, strict=True)):
            builder.add(rid, num_cached=ctx, num_new=new)
        return builder.build()

    batch = build()
    report = validate(batch)
    if not report.ok:
        raise SystemExit(str(report))
    t_build = median_seconds(build, repeat)
    t_copy = median_seconds(lambda: [t.copy() for _, t in batch.tables.items()], repeat)
    t_validate = median_seconds(lambda: validate(batch), repeat)
    t_shape = median_seconds(lambda: validate(batch, level="shape"), repeat)
    table_mb = sum(t.nbytes for _, t in batch.tables.items()) / 2**20

    qsl, local = batch.query_start_loc, batch.local_rows
    bases = [r * local for r in range(args.tp)]
    t_fast = median_seconds(lambda: [lower_local_request_ids(qsl, b, local) for b in bases], repeat * 4)
    t_nested = median_seconds(lambda: [nested_scan_local_request_ids(qsl, b, local) for b in bases], repeat)

    def python_scan():  # the scalar double loop a kernel without vector ops would run, on one rank
        ids = [-1] * local
        q = qsl.tolist()
        for i in range(local):
            for r in range(len(q) - 1):
                if q[r] <= bases[-1] + i < q[r + 1]:
                    ids[i] = r
        return ids

    t_python = median_seconds(python_scan, 1) * args.tp

    print(f"FLASH  N={batch.num_tokens}  R={batch.num_requests}  TP={args.tp}  P={batch.padded_rows}  "
          f"L={local}  block tables={table_mb:.1f} MiB")
    print(f"builder (incl. validation)       median {t_build * 1e3:8.2f} ms")
    print(f"  of which copying the tables    median {t_copy * 1e3:8.2f} ms  (the ABI's [R, width] tables)")
    print(f"validate level=full              median {t_validate * 1e3:8.2f} ms")
    print(f"validate level=shape             median {t_shape * 1e3:8.2f} ms")
    print(f"lower_local_request_ids (all ranks)      {t_fast * 1e6:8.1f} us")
    print(f"nested O(L*R) scan, numpy broadcast      {t_nested * 1e6:8.1f} us   ratio {t_nested / t_fast:8.1f}x")
    print(f"nested O(L*R) scan, scalar loops         {t_python * 1e6:8.1f} us   ratio {t_python / t_fast:8.1f}x")


if __name__ == "__main__":
    main()
