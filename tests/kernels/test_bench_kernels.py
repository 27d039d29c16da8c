"""The kernel benchmark's smoke run works end to end (its timings are printed, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmark_runs(tmp_path):
    out = tmp_path / "figures.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--quick", "--config",
                           "tiny", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert [row["kind"] for row in figures["gflops"]] == ["csa", "hca"]
    assert all(row["gflop"] > 0 and row["gflops"] > 0 and row["matmul_gflops"] > 0 for row in figures["gflops"])
    assert figures["packing"]["speedup_vs_one_each"] > 0 and figures["packing"]["speedup_vs_padded"] > 0
    assert figures["memory"]["peak_gib"] > 0
    assert "packed is" in proc.stdout and "peak" in proc.stdout
