"""The two command lines, run as a user runs them (subprocesses through python -m)."""

import json
import subprocess
import sys

import pytest


def run(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr)
    return proc


def test_abi_build_text_layout():
    out = run("dspark_abi.cli", "build", "--request", "3@126", "--request", "4@30", "--tp", "2").stdout
    assert "N=7 P=8 L=4" in out
    assert "local_request_ids=[0, 0, 0, 1]" in out and "local_request_ids=[1, 1, 1, -1]" in out
    assert " pad " in out


def test_abi_build_json():
    data = json.loads(run("dspark_abi.cli", "build", "--request", "5@0", "--tp", "4", "--json").stdout)
    assert data["padded_rows"] == 8 and data["local_rows"] == 2
    assert [r["request"] for r in data["rows"]] == [0, 0, 0, 0, 0, -1, -1, -1]
    assert all(r["slots"]["ori"] == -1 for r in data["rows"][5:])


def test_abi_build_rejects_malformed_request():
    proc = run("dspark_abi.cli", "build", "--request", "3-126", check=False)
    assert proc.returncode == 2 and "TOKENS@CACHED" in proc.stderr


def test_abi_build_reports_abi_errors_with_exit_1():
    proc = run("dspark_abi.cli", "build", "--request", "9000@0", check=False)
    assert proc.returncode == 1 and "qsl.token_count" in proc.stderr


@pytest.mark.slow
def test_prefill_group_and_thread_ranks_agree():
    args = ["dspark_kernels.cli", "prefill", "--config", "tiny", "--request", "3@126", "--request", "4@30",
            "--tp", "2", "--json"]
    group = json.loads(run(*args).stdout)
    threads = json.loads(run(*args, "--mode", "threads").stdout)
    assert [r["next_token"] for r in group["requests"]] == [r["next_token"] for r in threads["requests"]]
    assert [r["positions"] for r in group["requests"]] == [[126, 128], [30, 33]]


def test_prefill_mistakes_end_in_one_line_from_the_installed_command():
    """The real process: exit codes and one-line stderr survive `sys.exit(main())` (details in
    test_cli_prefill_errors.py)."""
    usage = run("dspark_kernels.cli", "prefill", "--request", "3@0", "--seed", "-1", check=False)
    assert usage.returncode == 2 and len(usage.stderr.strip().splitlines()) == 1 and "--seed" in usage.stderr
    bad = run("dspark_kernels.cli", "prefill", "--request", "3@5000", check=False)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_abi_build_png(tmp_path):
    png = tmp_path / "layout.png"
    run("dspark_abi.cli", "build", "--request", "3@126", "--request", "4@30", "--tp", "2", "--png", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000


def test_prefill_reports_and_saves_the_dspark_target_hidden(tmp_path):
    """A DSpark config's drafter features: shape and layers in --json, the [P, T * D] rows in --save."""
    from dspark_abi.io import fixtures

    path = tmp_path / "run.safetensors"
    proc = run("dspark_kernels.cli", "prefill", "--config", "tiny-dspark", "--request", "3@40", "--request", "4@0",
               "--tp", "2", "--json", "--save", str(path))
    summary = json.loads(proc.stdout)["target_hidden"]
    assert summary == {"layers": [1, 2, 3], "shape": [8, 3 * 128], "saved_as": "outputs.target_hidden",
                       "reduction": "mean of the hc streams (DeepSeek's h.mean(dim=2))"}
    saved = fixtures.load(path)
    target = saved.tensors["outputs.target_hidden"]
    assert target.shape == (8, 384) and target[:7].any() and not target[7:].any()   # row 7 is padding
    plain = json.loads(run("dspark_kernels.cli", "prefill", "--request", "3@0", "--json").stdout)
    assert plain["target_hidden"] is None                                            # tiny has no drafter
