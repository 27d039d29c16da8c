"""`dspark speculate`: the speculative loop from the command line (accepted lengths, --json, one-line errors)."""

import json
import subprocess
import sys

import pytest

from dspark_kernels.cli import main


def test_replay_prints_accepted_lengths_and_the_mean(capsys):
    assert main(["speculate", "--prompt", "5", "--prompt", "11", "--max-new-tokens", "6", "--drafter", "replay"]) == 0
    out = capsys.readouterr().out
    assert "request 0: prompt 5, accepted lengths [" in out and "request 1: prompt 11" in out
    assert "mean accepted length" in out


def test_json_summary_is_consistent(capsys):
    assert main(["speculate", "--prompt", "4", "--prompt", "13", "--max-new-tokens", "5", "--drafter", "hits",
                 "--hits", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    lengths = [n for r in data["requests"] for n in r["accepted_lengths"]]
    assert all(1 <= n <= 2 for n in lengths)              # one draft right, the next wrong: at most 2 per step
    assert data["mean_accepted_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert all(len(r["tokens"]) == 5 for r in data["requests"]) and data["mixed_steps"] >= 1


@pytest.mark.parametrize("argv,code,needle", [
    (["--drafts", "99"], 2, "--drafts 99"),
    (["--drafter", "hits", "--hits", "99"], 2, "--hits 99"),
    (["--prompt", "0"], 2, "--prompt"),
    (["--prompt", "5000"], 2, "positions"),
    (["--drafter", "magic"], 2, "--drafter"),
])
def test_mistakes_are_one_line(capsys, argv, code, needle):
    assert main(["speculate", *argv]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]
    assert err[0].startswith("dspark speculate: error:")


def test_installed_command_usage_error():
    proc = subprocess.run([sys.executable, "-m", "dspark_kernels.cli", "speculate", "--max-new-tokens", "-3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_distributed_mode_without_torch_is_one_usage_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)      # an import of torch now raises ImportError
    assert main(["speculate", "--mode", "distributed", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs torch" in err[0] and err[0].startswith("dspark speculate: error:")
