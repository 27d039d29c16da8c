"""The kernel benchmarks: bench_kernels' smoke run works end to end (its timings are printed, never asserted);
bench_pypto's layer, forward and packing sums count every stage it prices and combine the figures as stated."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


def _bench_pypto():
    """benchmarks/bench_pypto.py as a module (benchmarks/ is not a package the tests import from)."""
    spec = importlib.util.spec_from_file_location("bench_pypto_under_test", ROOT / "benchmarks" / "bench_pypto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.pypto  # reads the rates from pypto's A2A3.ini; runs no kernel
def test_pypto_bench_layers_name_every_stage_and_combine_their_figures(capsys):
    bench = _bench_pypto()
    named = {stage for calls in bench.LAYER_STAGES.values() for stage, _ in calls}
    named |= {stage for stage, _ in bench.FORWARD_ONCE}
    assert named == set(bench.STAGES)  # every stage priced is counted somewhere, nothing counted is unpriced
    shapes = ((64, 4, 1), (2048, 4, 32))
    for shape in shapes:
        assert all(bench.stage_roofline(stage, *shape) > 0 for stage in bench.STAGES), shape

    # synthetic cost-model figures: every stage at 3x its roofline, one stage without a kernel
    def table(p, tp, r, missing=()):
        return {s: {"cycles": None if s in missing else 3 * bench.stage_roofline(s, p, tp, r),
                    "roofline": bench.stage_roofline(s, p, tp, r)} for s in bench.STAGES}

    sums = bench.layer_sums(table(2048, 4, 32, missing=("indexer",)), 2048)
    assert sums["csa"]["missing"] == ["indexer"] and sums["swa"]["missing"] == sums["hca"]["missing"] == []
    for kind in ("swa", "hca"):  # sums of 3x each term: 3x, up to fp64 rounding of a few dozen terms
        assert sums[kind]["cycles"] == pytest.approx(3 * sums[kind]["roofline"], rel=1e-12)
    full = bench.layer_sums(table(2048, 4, 32), 2048)
    forward = bench.forward_estimate(table(2048, 4, 32), full, 2048, 4, tokens=8192)
    assert forward["calls"] == 4 and forward["missing"] == []
    layers = [bench.FLASH.layer_kind(i) for i in range(bench.FLASH.num_layers)]
    per_call = sum(full[k]["cycles"] for k in layers) + sum(
        n * 3 * bench.stage_roofline(s, 2048, 4, 32) for s, n in bench.FORWARD_ONCE)
    assert forward["cycles_per_call"] == pytest.approx(per_call, rel=1e-12)
    want = 8192 / (4 * per_call / (bench.CUBE_MHZ * 1e6)) / 4
    assert forward["tokens_per_s_per_die"] == pytest.approx(want, rel=1e-12)
    assert forward["roofline_tokens_per_s_per_die"] == pytest.approx(3 * want, rel=1e-12)
    # one call of all 8192 rows reads every weight once instead of 4 times: its roofline is never slower
    assert forward["one_call_roofline_tokens_per_s_per_die"] >= forward["roofline_tokens_per_s_per_die"]

    # 32 x 64 tokens in one call of 2048 rows, or in 4 calls of 512 (8 requests each), vs 32 single calls
    for rows, calls_per_layer in ((2048, 1), (512, 4)):
        packed = bench.packing(table(rows, 4, rows // 64), table(64, 4, 1), rows, requests=32, tokens=64)
        for kind, calls in bench.LAYER_STAGES.items():
            one = sum(n * bench.stage_weight(s, rows) * 3 * bench.stage_roofline(s, rows, 4, rows // 64)
                      for s, n in calls)
            each = sum(n * bench.stage_weight(s, 64) * 3 * bench.stage_roofline(s, 64, 4, 1) for s, n in calls)
            assert packed[kind]["calls"] == calls_per_layer
            assert packed[kind]["ratio"] == pytest.approx(32 * each / (calls_per_layer * one), rel=1e-12)
    assert "tokens/s per die" in capsys.readouterr().out


@pytest.mark.pypto  # imports the bench (A2A3.ini); runs no kernel
def test_pypto_bench_routing_picks_distinct_experts_uniformly():
    bench = _bench_pypto()
    moe = bench.FLASH.moe
    ids = bench.uniform_routing(4096)
    assert ids.shape == (4096, moe.num_experts_per_tok)
    assert all(len(set(row)) == moe.num_experts_per_tok for row in ids.tolist())
    counts = np.bincount(ids.ravel(), minlength=moe.n_routed_experts)
    mean = ids.size / moe.n_routed_experts  # 96 per expert; binomial sd ~9.7, so 6 sd is ~58
    assert np.abs(counts - mean).max() < 6 * np.sqrt(mean), counts
    assert bench.expected_experts(1) == pytest.approx(moe.num_experts_per_tok)
    assert bench.expected_experts(4096) == pytest.approx(moe.n_routed_experts, rel=1e-6)


@pytest.mark.pypto  # imports the bench (A2A3.ini); runs no kernel
def test_pypto_bench_reuses_an_earlier_runs_cycles_except_the_stages_run_again(tmp_path):
    bench = _bench_pypto()
    rows = {"shared_kv": {"cycles": 72044, "note": ""}, "indexer": {"cycles": 257650, "note": ""},
            "moe_gate": {"cycles": None, "note": "failed: ..."}}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"tp": 4, "geometries": {"table": [512, 4], "single": [64, 1]},
                                   "table": rows, "single": {"shared_kv": {"cycles": 9000, "note": ""}}}))
    tables = bench._earlier_tables(earlier, 4, {"indexer"})
    assert set(tables) == {(512, 4), (64, 1)}
    assert set(tables[(512, 4)]) == {"shared_kv"}  # the rerun stage and the failed one run again
    assert tables[(64, 1)]["shared_kv"]["cycles"] == 9000
    with pytest.raises(SystemExit, match="TP=4, not TP=2"):
        bench._earlier_tables(earlier, 2, set())
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    with pytest.raises(SystemExit, match="not a bench_pypto --json file"):
        bench._earlier_tables(broken, 4, set())


def _flash_stage_cycles(monkeypatch, stage: str, p_rows: int, requests: int, depth: int | None = None) -> int:
    """One stage's cost-model cycles at FLASH sizes (TP = 4), as the bench prices it, in a child process; query
    rows ``depth`` positions deep (default the bench's DEPTH)."""
    from dspark_kernels.pypto.isolate import run_isolated

    monkeypatch.setenv("DSPARK_PYPTO_COST_ONLY", "1")  # the child inherits it: cycles only, no interpreter
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the child imports the bench as benchmarks.bench_pypto
    from benchmarks.bench_pypto import stage_cycles

    extra = () if depth is None else (depth,)
    return run_isolated(stage_cycles, stage, p_rows, 4, requests, *extra, timeout=900)


@pytest.mark.pypto  # one cost-model compile of the gate at FLASH sizes in a child process (~10 s)
def test_the_moe_gate_compiles_at_flash_sizes(monkeypatch):
    # its fp32 operands once took [256, 128] cube tiles (128 KB) and failed to compile past L0B's 64 KB
    cycles = _flash_stage_cycles(monkeypatch, "moe_gate", 64, 1)
    assert cycles > _bench_pypto().stage_roofline("moe_gate", 64, 4, 1)


@pytest.mark.pypto  # the experts at FLASH sizes, L = 128 (242 tiles: two routed calls), in a child (~1.5-3 min)
def test_the_moe_experts_run_at_flash_sizes_in_several_routed_calls(monkeypatch):
    # as one call of 242 tiles the cost model's simulation failed a workspace allocation and never returned
    from dspark_kernels.pypto.moe import MAX_TILES_PER_CALL

    bench = _bench_pypto()
    assert bench.routed_tiles(128) > MAX_TILES_PER_CALL
    cycles = _flash_stage_cycles(monkeypatch, "moe_experts", 512, 4)
    assert cycles > bench.stage_roofline("moe_experts", 512, 4, 4)


@pytest.mark.pypto  # one cost-model compile of the indexer at 16,384 candidates, L = 2 rows, in a child (~10 s)
def test_the_indexer_compiles_at_64k_contexts(monkeypatch):
    # in one sort tile its top-512 needed 327,680 B of the vector core's 196,608 B buffer and did not compile;
    # it now sorts two column tiles of 8,192 and merges their winners
    bench = _bench_pypto()
    assert bench.index_candidates(bench.ROUND_CONTEXT) == 16384
    cycles = _flash_stage_cycles(monkeypatch, "indexer", 8, 2, bench.ROUND_CONTEXT)
    assert cycles > bench.stage_roofline("indexer", 8, 4, 2, bench.ROUND_CONTEXT)


@pytest.mark.pypto  # imports the bench (A2A3.ini); runs no kernel: every stage's cycles from an "earlier run"
def test_pypto_bench_round_sums_its_parts_and_gives_tokens_per_second(capsys):
    bench = _bench_pypto()
    geometry = bench.round_geometries()
    (p_draft, r), (p_verify, _) = geometry["draft"], geometry["verify"]
    draft = {s for s, _ in bench.DRAFT_STAGE_CALLS + bench.DRAFT_HEAD_CALLS}
    ctx = bench.ROUND_CONTEXT

    def table(p, stages, logit_rows):  # every stage at 2x its roofline
        return {s: {"cycles": 2 * bench.stage_roofline(s, p, 4, r, ctx, logit_rows), "note": ""} for s in stages}

    earlier = {(p_draft, r): table(p_draft, draft, p_draft), (p_verify, r): table(p_verify, bench.STAGES, p_verify)}
    p_observe = geometry["observe"][0]   # the observe's main_x (its keys are the verify table's shared kv)
    earlier[(p_observe, r)] = {**earlier.get((p_observe, r), {}), **table(p_observe, {"main_x"}, None)}
    out = bench.draft_round(4, earlier=earlier)
    assert all(row["note"].startswith("(earlier run)") for part in ("draft", "verify", "observe")
               for row in out[part].values())   # every stage from the table: no kernel ran
    assert out["missing"] == []  # the indexer is priced like every other stage
    assert out["cycles"] == pytest.approx(sum(part["cycles"] for part in out["parts"].values()), rel=1e-12)
    assert out["cycles"] == pytest.approx(2 * out["roofline"], rel=1e-12)  # sums of 2x each term (fp64 rounding)
    seconds = out["cycles"] / (bench.CUBE_MHZ * 1e6)
    assert out["ms_per_die"] == pytest.approx(1e3 * seconds, rel=1e-12)
    tokens = [r, r * (1 + bench.ROUND_DRAFTS)]  # every first draft rejected .. every draft accepted
    assert out["tokens_per_round"] == tokens
    assert out["tokens_per_s_per_die"] == pytest.approx([n / seconds / 4 for n in tokens], rel=1e-12)
    assert out["roofline_tokens_per_s_per_die"] == pytest.approx([2 * v for v in out["tokens_per_s_per_die"]],
                                                                 rel=1e-12)
    assert "tokens/s per die" in capsys.readouterr().out
