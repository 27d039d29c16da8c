"""Streaming a FLASH-dimension checkpoint in the shipped format: peak memory and time of `dspark prefill --weights`.

Writes (or reuses, ``--dir``) the synthetic ``short_schedule(FLASH)`` checkpoint (FLASH dimensions, one SWA, CSA
and HCA layer, all 256 FP4 experts, FP8 projections: 12.8 GB), then runs ``dspark prefill --weights DIR`` in a
fresh process for each token count and prints, side by side, the measured peak RSS, the estimate
``dspark prefill`` checks before running (``memory.estimate_prefill``), their ratio, and the wall time.

    python benchmarks/bench_streaming.py                  # writes into a temporary folder, removed afterwards
    python benchmarks/bench_streaming.py --dir /data/f3l --tokens 4 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dspark_abi import BlockAllocator
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.presets import FLASH
from dspark_kernels import memory
from dspark_kernels.model.synthetic import short_schedule, write_checkpoint

CONFIG = short_schedule(FLASH, name="flash-3l")


def run_prefill(folder: Path, tokens: int) -> dict:
    env = os.environ | {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "dspark_kernels.cli", "prefill", "--weights", str(folder),
                           "--request", f"{tokens}@0", "--json", "--no-progress"],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"dspark prefill failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="checkpoint folder (written there if it has no config.json)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 64], help="new tokens per run")
    args = parser.parse_args()
    scratch = None if args.dir else Path(tempfile.mkdtemp(prefix="dspark-flash-"))
    folder = args.dir or scratch / CONFIG.name  # type: ignore[operator]
    try:
        if not (folder / "config.json").exists():
            t0 = time.perf_counter()
            write_checkpoint(folder, CONFIG)
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(f"wrote {folder} ({size / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f} s")
        print(f"{'tokens':>6} {'peak RSS':>10} {'estimate':>10} {'RSS/est':>8} {'prefill s':>10}")
        for n in args.tokens:
            out = run_prefill(folder, n)
            blocks = BlockAllocator(CONFIG, pool_blocks_for(CONFIG, [n])).pool_blocks
            est = memory.estimate_prefill(CONFIG, blocks, rows=n, logit_rows=1, resident_layers=1).total
            peak = out["peak_rss_bytes"]
            print(f"{n:>6} {memory.format_bytes(peak):>10} {memory.format_bytes(est):>10} {peak / est:>8.2f} "
                  f"{out['seconds']:>10.1f}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
