"""`dspark generate`: speculative generation from the command line (the acceptance summary, --json, start-up
checks as coded lines, one-line mistakes)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_abi.presets import TINY_DSPARK
from dspark_kernels.cli import main
from dspark_kernels.model.synthetic import write_checkpoint

#: The keys of the --json document (tests/api/test_cli_generate.py is its schema's only home besides the code).
SUMMARY_KEYS = {"config", "checkpoint", "drafter", "drafts", "adaptive", "min_drafts", "features", "tp", "tp_mode",
                "requests", "steps", "mixed_steps", "verify_requests", "tokens", "mean_accepted_length",
                "acceptance_by_position", "verify_rows_per_token", "seconds_per_step", "max_step_seconds",
                "seconds", "wall_seconds"}
SHORT = ["--prompts", "2", "--prompt-len", "6", "--max-new-tokens", "5"]


def run_json(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def test_default_run_prints_the_acceptance_summary(capsys):
    assert main(["generate", *SHORT]) == 0
    out = capsys.readouterr().out
    assert "tiny-dspark: 2 request(s), drafter dspark, K = 3" in out
    assert "acceptance by draft position: 1: " in out and "verify rows per generated token" in out
    assert "ms per step" in out and "mean accepted length" in out


def test_json_schema_and_replay_acceptance(capsys):
    """Replay drafts are always right: every verify step accepts all its drafts (K + 1 tokens where the budget
    allows K drafts), one verify row per generated token."""
    data = run_json(capsys, *SHORT, "--drafter", "replay", "--prompt-len", "9", "--chunk", "4")
    assert set(data) == SUMMARY_KEYS
    assert data["acceptance_by_position"] == [1.0] * TINY_DSPARK.dspark_block_size
    assert data["verify_rows_per_token"] == 1.0
    assert all(n == TINY_DSPARK.dspark_block_size + 1 for r in data["requests"] for n in r["accepted_lengths"][:-1])
    assert data["tokens"] == 10 and all(len(r["tokens"]) == 5 for r in data["requests"])
    lengths = [n for r in data["requests"] for n in r["accepted_lengths"]]
    assert data["mean_accepted_length"] == pytest.approx(sum(lengths) / len(lengths))


def test_adaptive_and_threads_give_the_same_tokens_as_fixed(capsys):
    fixed = run_json(capsys, *SHORT)
    adaptive = run_json(capsys, *SHORT, "--adaptive", "0", "--min-drafts", "0", "--tp", "2", "--tp-mode", "threads")
    assert adaptive["adaptive"] == 0.0 and adaptive["tp_mode"] == "threads"
    assert [r["tokens"] for r in adaptive["requests"]] == [r["tokens"] for r in fixed["requests"]]


def test_prompts_from_a_file_and_options(capsys, tmp_path: Path):
    (tmp_path / "p.json").write_text("[[1, 2, 3], [4, 5]]")
    (tmp_path / "p.txt").write_text("1 2 3\n\n4,5\n")
    a = run_json(capsys, "--prompt-file", str(tmp_path / "p.json"), "--max-new-tokens", "3")
    b = run_json(capsys, "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "3")
    c = run_json(capsys, "--prompt", "1,2,3", "--prompt", "4 5", "--max-new-tokens", "3")
    assert [r["prompt"] for r in a["requests"]] == [3, 2]
    assert a["requests"] == b["requests"] == c["requests"]


def one_line(capsys, argv: list[str], code: int) -> str:
    assert main(["generate", *argv]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("dspark generate: error:")
    return err[0]


@pytest.mark.parametrize("argv,code,needle", [
    (["--drafts", "4"], 1, "verify.drafts: K:"),                         # start-up check: K above the block size
    (["--features", "hc_head"], 1, "config.invalid: features:"),         # start-up check: hc_head not asked for
    (["--prompt", "1,2,9999"], 1, "token_ids.range"),
    (["--prompt-len", "5000"], 1, "positions.out_of_range"),
    (["--adaptive", "0", "--drafter", "random"], 2, "--adaptive"),
    (["--adaptive", "nan"], 2, "--adaptive"),
    (["--prompt", "1,x"], 2, "--prompt"),
    (["--prompt", "1", "--prompts", "2"], 2, "--prompts"),
    (["--config", "tiny"], 2, "not a DSpark model"),
    (["--drafter", "magic"], 2, "--drafter"),
    (["--tp-mode", "fibers"], 2, "--tp-mode"),
    (["--prompt-file", "/nonexistent/p.txt"], 2, "--prompt-file"),
])
def test_mistakes_are_one_line(capsys, argv, code, needle):
    assert needle in one_line(capsys, argv, code)


def test_every_failed_start_up_check_is_one_coded_line(capsys):
    assert main(["generate", "--drafts", "9", "--features", "hc_head"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[2].strip() for line in err] == ["verify.drafts", "config.invalid"]
    assert "41834" in err[0] and "--allow-hc-head" in err[1]


def test_allow_hc_head_runs(capsys):
    data = run_json(capsys, *SHORT, "--features", "hc_head", "--allow-hc-head")
    assert data["features"] == "hc_head"


def without_drafter(source: Path, target: Path) -> None:
    """Copy a safetensors shard without its mtp.* tensors (raw bytes: the format is an 8-byte little-endian
    header length, a JSON header of dtype, shape and data offsets, then the data)."""
    raw = source.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8: 8 + n]), raw[8 + n:]
    kept, parts, at = {}, [], 0
    for name, entry in header.items():
        if name == "__metadata__" or name.startswith("mtp."):
            continue
        lo, hi = entry["data_offsets"]
        parts.append(data[lo:hi])
        kept[name] = {**entry, "data_offsets": [at, at + hi - lo]}
        at += hi - lo
    if "__metadata__" in header:
        kept["__metadata__"] = header["__metadata__"]
    text = json.dumps(kept).encode()
    target.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(parts))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-dspark", TINY_DSPARK)


def test_a_checkpoint_without_drafter_tensors_says_how_to_run_without(capsys, checkpoint: Path, tmp_path: Path):
    """A TINY-DSpark target checkpoint with its mtp.* tensors removed: one line naming them and the way out; the
    same checkpoint runs with the replay drafter."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in checkpoint.iterdir():
        if f.suffix == ".safetensors":
            without_drafter(f, bare / f.name)
        elif f.name == "config.json":
            (bare / f.name).write_text(f.read_text())
    line = one_line(capsys, ["--checkpoint", str(bare), "--max-new-tokens", "2"], 1)
    assert "mtp.*" in line and "--drafter replay" in line and "greedy" in line
    data = run_json(capsys, "--checkpoint", str(bare), "--drafter", "replay", *SHORT)
    assert data["checkpoint"] == str(bare) and data["verify_rows_per_token"] == 1.0


def test_config_with_checkpoint_is_a_usage_error(capsys, checkpoint: Path):
    assert "--config" in one_line(capsys, ["--checkpoint", str(checkpoint), "--config", "tiny-dspark"], 2)


def test_installed_command_usage_error():
    proc = subprocess.run([sys.executable, "-m", "dspark_kernels.cli", "generate", "--max-new-tokens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_speculate_still_runs(capsys):
    assert main(["speculate", "--prompt", "5", "--max-new-tokens", "3", "--drafter", "random"]) == 0
    assert "mean accepted length" in capsys.readouterr().out


def test_checkpoint_drafter_gives_the_greedy_tokens(capsys, checkpoint: Path):
    """The checkpoint's own drafter (mtp.* as the synthetic writer stores them: FP8 / FP4 with block scales)
    drafts; the tokens are those of the replay run, which reproduces plain greedy decoding."""
    dspark = run_json(capsys, "--checkpoint", str(checkpoint), *SHORT, "--adaptive", "0")
    replay = run_json(capsys, "--checkpoint", str(checkpoint), *SHORT, "--drafter", "replay")
    assert [r["tokens"] for r in dspark["requests"]] == [r["tokens"] for r in replay["requests"]]
    assert dspark["verify_requests"] > 0


def test_a_checkpoint_config_with_a_foreign_noise_token_is_one_line(capsys, checkpoint: Path, tmp_path: Path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in checkpoint.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "dspark_noise_token_id": TINY_DSPARK.vocab_size}))
    assert "dspark_noise_token_id" in one_line(capsys, ["--checkpoint", str(bad)], 2)
