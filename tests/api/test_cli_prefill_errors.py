"""`dspark prefill` as a user meets it: every mistake ends in one line on stderr (what is wrong and the fix),
exit 2 (usage error, unreadable file) or 1 (invalid input, failed run), no traceback, nothing computed or
written first; the backend reported is the backend that ran; progress shows on and off a terminal.

Everything runs in-process through :func:`dspark_kernels.cli.app.main`; pypto itself never runs here (a
recording stand-in replaces its attention entry and computes with the reference in a2a3 numerics).
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import dspark_kernels.pypto.backend
from dspark_abi.presets import TINY
from dspark_kernels.cli import app as cli
from dspark_kernels.cli import progress
from dspark_kernels.model import weights as mw
from dspark_kernels.model.weight_specs import weight_specs
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.reference.backend import ReferenceBackend

#: File the recording attention appends one line per call to (an environment variable reaches rank processes).
PROBE_ENV = "DSPARK_TEST_ATTENTION_PROBE"


class RecordingAttention(ReferenceBackend):
    """Stands in for ``dspark_kernels.pypto.backend.PyptoBackend``: its attention records (pid, rank, layer);
    every stage computes with the reference in the numerics the kernels implement (the plan and weights are
    a2a3). Module level, so spawned rank processes can unpickle it."""

    def attention(self, plan, layer, x, weights, caches):  # type: ignore[no-untyped-def]
        with open(os.environ[PROBE_ENV], "a") as f:
            f.write(f"{os.getpid()} {plan.rank} {layer}\n")
        return super().attention(plan, layer, x, weights, caches)


def invoke(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``dspark prefill ARGS`` run in this process."""
    code = cli.main(["prefill", *args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, expected_code: int, *needles: str) -> str:
    assert code == expected_code, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI starts computing (every check must come first)."""
    def refuse(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the prefill ran before the input was checked")

    monkeypatch.setattr(cli, "prefill", refuse)
    monkeypatch.setattr(mw.RandomSource, "load", refuse)


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Replace the pypto attention backend by :class:`RecordingAttention`; returns the record file."""
    path = tmp_path / "attention-calls.txt"
    path.touch()
    monkeypatch.setenv(PROBE_ENV, str(path))
    monkeypatch.setattr(dspark_kernels.pypto.backend, "PyptoBackend", RecordingAttention)
    return path


def calls(path: Path) -> list[tuple[str, int]]:
    """(rank, layer) of every recorded attention call."""
    return [(r, int(layer)) for _, r, layer in (line.split() for line in path.read_text().splitlines())]


# ---------------------------------------------------------------------------------------------- 1. --seed
def test_negative_seed_is_a_usage_error(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "3@0", "--seed", "-1")
    one_line_error(code, err, 2, "--seed", ">= 0")


def test_malformed_arguments_are_one_line(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "3-126")
    one_line_error(code, err, 2, "TOKENS@CACHED", "--help")
    code, _, err = invoke(capsys, "--request", "3@0", "--tp", "0")
    one_line_error(code, err, 2, "--tp")


# ---------------------------------------------------------------------------------------------- 2. --save
def test_save_into_missing_directory_is_refused_before_computing(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "3@0", "--save", "/nonexistent/x.safetensors")
    one_line_error(code, err, 2, "/nonexistent", "does not exist")


def test_save_below_a_file_or_onto_a_directory_is_refused(capsys, no_compute, tmp_path):
    (tmp_path / "file").write_text("")
    code, _, err = invoke(capsys, "--request", "3@0", "--save", str(tmp_path / "file" / "x.safetensors"))
    one_line_error(code, err, 2, "not a directory")
    code, _, err = invoke(capsys, "--request", "3@0", "--save", str(tmp_path))
    one_line_error(code, err, 2, "is a directory")


def test_save_into_read_only_directory_is_refused(capsys, no_compute, tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    # root may write anywhere, so creating a file there fails as it does for an ordinary user
    real_open = os.open

    def deny(path, flags, *args):  # type: ignore[no-untyped-def]
        if str(path).startswith(str(folder)) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", deny)
    code, _, err = invoke(capsys, "--request", "3@0", "--save", str(folder / "x.safetensors"))
    one_line_error(code, err, 2, "cannot create a file", "Permission denied")


def test_save_into_a_virtual_file_system_names_the_real_reason_before_computing(capsys, no_compute):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this system")
    code, _, err = invoke(capsys, "--request", "3@0", "--save", "/proc/x")
    line = one_line_error(code, err, 2, "/proc/x", "cannot create a file in directory /proc")
    assert "free space" not in line


def test_save_onto_dev_null_is_refused_and_dev_null_survives(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "3@0", "--save", os.devnull)
    one_line_error(code, err, 2, os.devnull, "character device", "left as it is")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_save_with_json_keeps_stdout_one_json_document(capsys, tmp_path):
    target = tmp_path / "run.safetensors"
    code, out, err = invoke(capsys, "--request", "3@0", "--json", "--save", str(target), "--no-progress")
    assert code == 0, err
    data = json.loads(out)  # the whole of stdout is one document
    assert data["backend"] == "reference" and data["requests"][0]["positions"] == [0, 2]
    assert err.strip() == f"wrote {target}"
    assert target.stat().st_size > 0


# ---------------------------------------------------------------------------------------------- 3. --weights
def test_missing_weights_folder_says_it_does_not_exist(capsys, no_compute, tmp_path):
    code, _, err = invoke(capsys, "--request", "3@0", "--weights", str(tmp_path / "nope"))
    one_line_error(code, err, 2, "nope", "does not exist")


def test_corrupt_safetensors_names_the_file(capsys, no_compute, tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"this is not a safetensors file")
    code, _, err = invoke(capsys, "--request", "3@0", "--weights", str(tmp_path))
    one_line_error(code, err, 2, "model-00001.safetensors", "header")


@pytest.mark.parametrize("text, needle", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"),
                                          ('{"hidden_size": 128}', "missing")])
def test_malformed_config_json_names_the_file(capsys, no_compute, tmp_path, text, needle):
    (tmp_path / "config.json").write_text(text)
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    code, _, err = invoke(capsys, "--request", "3@0", "--weights", str(tmp_path))
    one_line_error(code, err, 2, "config.json", needle)


def test_checkpoint_of_another_model_is_summarised(capsys, no_compute, tmp_path):
    """Tensors under foreign names (e.g. a Hugging Face layout): one line with counts and examples, not 170."""
    names = list(weight_specs(TINY))
    save_file({f"model.{n}": np.zeros(1, np.float32) for n in names[:12]}, str(tmp_path / "model.safetensors"))
    code, _, err = invoke(capsys, "--request", "3@0", "--weights", str(tmp_path))
    line = one_line_error(code, err, 1, f"{len(names)} of {len(names)}", "embed.weight", "12 tensors",
                          "model.embed.weight", "--weights")
    assert len(line) < 600


def test_weights_for_another_config_are_summarised(capsys, tmp_path):
    ModelWeights.random(TINY, 0).save_safetensors(tmp_path / "tiny.safetensors")
    code, _, err = invoke(capsys, "--request", "3@0", "--weights", str(tmp_path), "--config", "demo")
    one_line_error(code, err, 1, "wrong shape", "--config")


# ---------------------------------------------------------------------------------------------- 4. extras
def test_distributed_without_torch_names_the_extra(capsys, no_compute, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    code, _, err = invoke(capsys, "--request", "3@0", "--tp", "2", "--mode", "distributed")
    one_line_error(code, err, 2, "pip install 'dspark[dist]'")


def test_pypto_backend_without_pypto_names_the_extra(capsys, no_compute, monkeypatch):
    monkeypatch.setitem(sys.modules, "pypto", None)
    code, _, err = invoke(capsys, "--request", "3@0", "--backend", "pypto", "--precision", "a2a3")
    one_line_error(code, err, 2, "pip install 'dspark[pypto]'")


def test_nccl_without_cuda_is_refused_up_front(capsys, no_compute):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = invoke(capsys, "--request", "3@0", "--tp", "2", "--mode", "distributed", "--dist-backend", "nccl")
    one_line_error(code, err, 2, "nccl", "--dist-backend gloo")


def test_dist_backend_without_distributed_mode_is_a_usage_error(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "3@0", "--tp", "2", "--mode", "threads", "--dist-backend", "gloo")
    one_line_error(code, err, 2, "--dist-backend", "--mode distributed")


def test_pypto_tooling_missing_in_the_kernel_process_names_it(capsys, monkeypatch):
    from dspark_kernels.pypto.errors import PyptoUnavailableError

    def unavailable(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise PyptoUnavailableError("pypto's CPU simulation needs g++ on PATH (apt-get install g++ binutils cmake)")

    monkeypatch.setattr(dspark_kernels.pypto.backend, "PyptoBackend", unavailable)
    code, _, err = invoke(capsys, "--request", "3@0", "--backend", "pypto", "--precision", "a2a3", "--no-progress")
    one_line_error(code, err, 2, "--backend pypto", "apt-get install g++")


def test_a_failed_run_is_one_line_with_the_full_report_in_a_file(capsys, monkeypatch):
    def crash(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("kernel process exited with code 1 without a result\nlast output lines:\n...")

    monkeypatch.setattr(cli, "prefill", crash)
    code, _, err = invoke(capsys, "--request", "3@0")
    line = one_line_error(code, err, 1, "RuntimeError", "kernel process exited", "full report in")
    report = Path(line.rsplit("full report in ", 1)[1].rstrip(")"))
    assert "Traceback" in report.read_text() and "last output lines" in report.read_text()
    report.unlink()


# ---------------------------------------------------------------------------------------------- 5. backend
def test_group_mode_runs_the_pypto_attention(capsys, probe):
    code, out, err = invoke(capsys, "--request", "3@5", "--backend", "pypto", "--precision", "a2a3", "--json",
                            "--no-progress")
    assert code == 0, err
    assert json.loads(out)["backend"] == "pypto"
    # the context fill (5 tokens) and the batch, every layer, all rows in one call
    assert calls(probe) == [("None", i) for i in range(TINY.num_layers)] * 2


def test_reference_backend_does_not_call_pypto(capsys, probe):
    code, _, err = invoke(capsys, "--request", "3@0", "--tp", "2", "--mode", "threads", "--precision", "a2a3",
                          "--no-progress")
    assert code == 0, err
    assert calls(probe) == []


def test_threads_mode_runs_the_pypto_attention_on_every_rank(capsys, probe):
    code, out, err = invoke(capsys, "--request", "3@0", "--request", "4@0", "--tp", "2", "--mode", "threads",
                            "--backend", "pypto", "--precision", "a2a3", "--json", "--no-progress")
    assert code == 0, err
    data = json.loads(out)
    assert data["backend"] == "pypto" and data["mode"] == "threads"
    assert sorted(calls(probe)) == sorted((r, i) for r in ("0", "1") for i in range(TINY.num_layers))


def test_threads_and_group_modes_agree_with_pypto(capsys, probe):
    args = ["--request", "3@0", "--request", "4@0", "--tp", "2", "--backend", "pypto", "--precision", "a2a3",
            "--json", "--no-progress"]
    group = json.loads(invoke(capsys, *args)[1])
    threads = json.loads(invoke(capsys, *args, "--mode", "threads")[1])
    assert [r["next_token"] for r in group["requests"]] == [r["next_token"] for r in threads["requests"]]


@pytest.mark.distributed
def test_distributed_mode_runs_the_pypto_attention_in_every_rank_process(capsys, probe):
    pytest.importorskip("torch")
    code, out, err = invoke(capsys, "--request", "3@0", "--request", "4@0", "--tp", "2", "--mode", "distributed",
                            "--backend", "pypto", "--precision", "a2a3", "--json", "--no-progress")
    assert code == 0, err
    assert json.loads(out)["backend"] == "pypto"
    lines = [line.split() for line in probe.read_text().splitlines()]
    assert sorted((r, int(i)) for _, r, i in lines) == sorted((r, i) for r in ("0", "1") for i in range(4))
    assert len({pid for pid, _, _ in lines}) == 2 and str(os.getpid()) not in {pid for pid, _, _ in lines}


# ---------------------------------------------------------------------------------------------- 6. precision
def test_pypto_without_a2a3_names_the_flag(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "3@0", "--backend", "pypto")
    one_line_error(code, err, 2, "pass --precision a2a3")


# ---------------------------------------------------------------------------------------------- 7. progress
def test_progress_lines_off_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_DELAY_S", 0.0)
    code, _, err = invoke(capsys, "--request", "3@20")
    assert code == 0, err
    assert "\r" not in err
    lines = err.strip().splitlines()
    assert any(line.startswith("context r0") and "layer 4/4" in line for line in lines), err
    assert any(line.startswith("prefill") and "layer 4/4" in line for line in lines), err
    assert sum("prefill" in line for line in lines) == TINY.num_layers  # one line per layer (<= 10 layers)


def test_progress_off_a_terminal_waits_for_long_calls(capsys):
    code, _, err = invoke(capsys, "--request", "3@0")  # a TINY call ends long before the delay
    assert code == 0 and err == ""


def test_no_progress_silences_and_progress_forces_the_bar(capsys):
    code, _, err = invoke(capsys, "--request", "3@20", "--no-progress")
    assert code == 0 and err == ""
    code, _, err = invoke(capsys, "--request", "3@20", "--progress")
    assert code == 0 and "\r" in err and "4/4" in err


def test_progress_bar_on_a_terminal(capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    code, _, _ = invoke(capsys, "--request", "3@0")
    assert code == 0
    shown = term.getvalue()
    assert "\r" in shown and "prefill" in shown and "4/4" in shown and "layer/s" in shown  # tqdm's bar


def _drain(master: int, quiet_seconds: float = 2.0) -> str:
    """Everything written to a pty so far: the kernel moves a pty's output to the master side asynchronously, so
    one read right after the writes can see only its first part on a loaded machine."""
    import select

    chunks = []
    while select.select([master], [], [], quiet_seconds)[0]:
        chunk = os.read(master, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_progress_bar_on_a_terminal_that_reports_no_size(capsys, monkeypatch):
    """A bare pty says 0 x 0; tqdm's bar must still have text (it draws blanks when told 0 rows)."""
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    term = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", term)
    try:
        code, _, _ = invoke(capsys, "--request", "3@0")
        term.flush()
        shown = _drain(master)
    finally:
        term.close()
        os.close(master)
    assert code == 0 and "prefill:" in shown and "4/4" in shown


# ---------------------------------------------------------------------------------------------- 8. memory
def test_flash_streams_and_is_refused_with_the_estimate_when_even_that_does_not_fit(capsys, no_compute, monkeypatch):
    from dspark_kernels import memory

    # FLASH's random weights stream like a checkpoint (one layer and one routed expert at a time): ~3.2 GiB
    monkeypatch.setattr(memory, "available_bytes", lambda: 2 << 30)
    code, _, err = invoke(capsys, "--request", "3@126", "--config", "flash")
    line = one_line_error(code, err, 1, "GiB", "2.0 GiB available", "--config tiny")
    assert "routed experts 96.0 MiB" in line  # one expert resident, not the 24 GiB of a layer's 256


def test_too_little_memory_refuses_even_tiny(capsys, no_compute, monkeypatch):
    from dspark_kernels import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)
    code, _, err = invoke(capsys, "--request", "3@0")
    one_line_error(code, err, 1, "MiB", "1.0 MiB")


# ---------------------------------------------------------------------------------------------- 9. requests
def test_builder_issue_prints_its_message(capsys, no_compute, tmp_path):
    target = tmp_path / "x.safetensors"
    code, _, err = invoke(capsys, "--request", "3@5000", "--save", str(target))
    line = one_line_error(code, err, 1, "3@5000", "max_position_embeddings=4096")
    assert "see the message" not in line
    assert not target.exists()  # nothing written on bad input


def test_too_many_tokens_for_one_prefill(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "3000@0", "--request", "3000@0", "--request", "3000@0")
    one_line_error(code, err, 1, "--request", "9000", "8192")


def test_no_new_tokens(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "0@10")
    one_line_error(code, err, 1, "new token")


def test_abi_errors_are_one_line_with_the_builder_message():
    """A builder.request issue (registered hint: 'see the message') prints its message and names the --request."""
    from dspark_abi.errors import ABIError, Issue

    exc = ABIError([Issue("builder.request", "requests", "a continued request must start where its previous chunk "
                          "ended", index=1, request=1, expected=30, actual=0),
                    Issue("qsl.token_count", "requests", "a batch needs 1..token_cap new tokens")])
    args = cli.make_parser().parse_args(["prefill", "--request", "3@126", "--request", "4@0"])
    line = cli._abi_line(exc, args)
    assert "\n" not in line and line.startswith("--request 4@0: builder.request")
    assert "must start where its previous chunk ended; expected 30, got 0" in line
    assert "see the message" not in line and line.endswith("(and 1 more: qsl.token_count)")


# ---------------------------------------------------------------------------------------------- newcomer findings
def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        cli.make_parser().parse_args(["--version"])
    out, _ = capsys.readouterr()
    assert info.value.code == 0 and out.strip() == f"dspark {version('dspark')}"
    assert cli.main(["--version"]) == 0


def test_a_negative_request_names_the_real_problem(capsys, no_compute):
    code, _, err = invoke(capsys, "--request", "-1@0")
    line = one_line_error(code, err, 2, "-1@0", "non-negative integer")
    assert "expected one argument" not in line


def test_weights_with_a_config_json_say_that_config_is_ignored(capsys, no_compute, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    _, _, err = invoke(capsys, "--weights", str(tmp_path), "--config", "demo", "--request", "3@0")
    assert "--config demo is ignored" in err and str(tmp_path / "config.json") in err, err
    _, _, err = invoke(capsys, "--weights", str(tmp_path), "--request", "3@0")   # no --config: no note
    assert "ignored" not in err, err


def test_the_repository_has_the_license_pyproject_declares():
    root = Path(__file__).resolve().parents[2]
    text = (root / "LICENSE").read_text()
    assert 'license = { text = "Apache-2.0" }' in (root / "pyproject.toml").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def test_a_long_context_shows_one_progress_over_all_its_chunks(capsys, monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_DELAY_S", 0.0)
    # 3 chunks of at most token_cap (8192) tokens: one stage line, then lines whose overall share only grows
    code, _, err = invoke(capsys, "--config", "tiny-1m", "--request", "2@17000", "--tp", "1")
    assert code == 0, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("dspark prefill: 3 context call(s) (17000 cached tokens)"), err
    ctx = [line for line in lines if line.startswith("context r0 chunk")]
    assert {line.split(":")[0] for line in ctx} == {f"context r0 chunk {k}/3" for k in (1, 2, 3)}, err
    shares = [int(line.split("overall ")[1].split("%")[0]) for line in ctx]
    assert shares == sorted(shares) and shares[-1] == 100 and shares[0] < 50, err


def test_the_context_bar_runs_on_across_chunks(capsys, monkeypatch):
    from dspark_kernels.cli.progress import ContextProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with ContextProgress("bar", [(0, 100), (0, 100), (1, 200)], 4) as fill:
        bars = []
        for i in range(3):
            on_layer = fill.chunk(i)
            for done in range(1, 5):
                on_layer(done, 4)
                bars.append(fill._bar.n)
    assert bars == sorted(bars) and bars[-1] == fill.total == 1600       # never restarts
    assert "context r1 layer 4/4: 100%" in term.getvalue()          # tqdm throttles the frames in between
    assert [fill.label(i) for i in range(3)] == ["context r0 chunk 1/2", "context r0 chunk 2/2", "context r1"]


def test_random_flash_weights_warn_up_front(capsys, monkeypatch):
    from dspark_kernels.cli import app
    from dspark_kernels.model.weights import ModelWeights

    def stop(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt     # right after the announcement: no FLASH run in a test

    monkeypatch.setattr(app, "ModelCaches", type("C", (), {"allocate": staticmethod(stop)}))
    monkeypatch.setattr(app, "check_memory", lambda *a, **k: None)
    monkeypatch.setattr(app, "load_weights", lambda args, config: ModelWeights.random(config, keep_layers=False))
    code, _, err = invoke(capsys, "--config", "flash", "--request", "3@126")
    assert code == 130
    assert "about 12 minutes" in err and "--config tiny" in err, err
