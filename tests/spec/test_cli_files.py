"""`dspark-abi validate` and `dspark-abi conformance`: exit codes, output, JSON, read-only behaviour, protocol."""

import json
import shutil
import sys

import pytest

from dspark_abi import cli
from dspark_abi.cli.files import format_table
from dspark_abi.conformance import runner

from .conftest import VECTORS, entries_of, index_entries, run_cli, snapshot

RAGGED2 = VECTORS / "valid" / "ragged2_tp2.safetensors"
DUPLICATE = VECTORS / "invalid" / "writes_duplicate.safetensors"


def test_validate_valid_file_exits_0():
    before = snapshot(RAGGED2)
    proc = run_cli("validate", str(RAGGED2))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{RAGGED2}: valid"
    assert snapshot(RAGGED2) == before


def test_validate_invalid_file_exits_1_and_prints_every_issue():
    before = snapshot(DUPLICATE)
    proc = run_cli("validate", str(DUPLICATE))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{DUPLICATE}: invalid (2 issues)"
    first = lines[1].split()
    assert first == ["slots.mismatch", "field=ori_slot_mapping", "index=1", "request=0", "expected=127", "actual=126",
                     "count=1"]
    assert lines[3].split()[0] == "writes.duplicate"
    assert snapshot(DUPLICATE) == before


def test_validate_json_is_one_object_per_file():
    proc = run_cli("validate", "--json", str(RAGGED2), str(DUPLICATE))
    assert proc.returncode == 1
    valid, invalid = (json.loads(line) for line in proc.stdout.splitlines())
    assert (valid["status"], valid["ok"], valid["issues"], valid["format_version"]) == ("valid", True, [], "1.4")
    assert invalid["status"] == "invalid" and not invalid["ok"]
    issue = invalid["issues"][0]
    assert {k: issue[k] for k in ("code", "field", "index", "request", "expected", "actual", "count")} == {
        "code": "slots.mismatch", "field": "ori_slot_mapping", "index": 1, "request": 0, "expected": 127,
        "actual": 126, "count": 1}


def test_validate_hostile_files_exit_2_and_stay_untouched():
    entries = entries_of("hostile")
    paths = [VECTORS / e["file"] for e in entries]
    before = [snapshot(p) for p in paths]
    proc = run_cli("validate", "--json", *map(str, paths))
    assert proc.returncode == 2, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(entries)
    for entry, result in zip(entries, results, strict=True):
        assert result["status"] == "unreadable"
        assert sorted({i["code"] for i in result["issues"]}) == entry["expected"]["codes"], entry["file"]
    assert [snapshot(p) for p in paths] == before


@pytest.mark.parametrize("entry", entries_of("hostile"), ids=lambda e: e["file"])
def test_each_hostile_kind_exits_2(entry, capsys):
    path = VECTORS / entry["file"]
    before = snapshot(path)
    assert cli.main(["validate", str(path)]) == 2
    out = capsys.readouterr().out
    assert f"{path}: unreadable" in out and entry["expected"]["codes"][0] in out
    assert snapshot(path) == before


def test_worst_file_decides_the_exit_code(capsys):
    hostile = VECTORS / entries_of("hostile")[0]["file"]
    assert cli.main(["validate", str(RAGGED2), str(DUPLICATE)]) == 1
    assert cli.main(["validate", str(hostile), str(RAGGED2)]) == 2
    assert cli.main(["validate", "--level", "shape", str(DUPLICATE)]) == 0  # a value rule, not a shape rule
    capsys.readouterr()


def test_conformance_command_passes_on_the_committed_vectors():
    proc = run_cli("conformance", str(VECTORS))
    assert proc.returncode == 0, proc.stdout[-2000:]
    n = len(index_entries())
    assert proc.stdout.splitlines()[-1] == f"{n} vectors: {n} passed, 0 failed"


def test_conformance_json_and_failure_exit(tmp_path, capsys):
    copy = tmp_path / "vectors"
    shutil.copytree(VECTORS, copy)
    assert cli.main(["conformance", str(copy), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(index_entries()) and all(r["passed"] for r in rows)
    (copy / "invalid" / "unlisted.safetensors").write_bytes(RAGGED2.read_bytes())
    assert cli.main(["conformance", str(copy)]) == 1
    assert "FAIL    invalid/unlisted.safetensors" in capsys.readouterr().out
    assert cli.main(["conformance", str(tmp_path)]) == 2  # no index.json
    assert "cannot read the vector index" in capsys.readouterr().err


def _subset(tmp_path, files):
    """A vectors directory holding only ``files`` (and their index entries)."""
    root = tmp_path / "subset"
    entries = [e for e in index_entries() if e["file"] in files]
    for e in entries:
        (root / e["file"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(VECTORS / e["file"], root / e["file"])
    (root / "index.json").write_text(json.dumps({"vectors": entries}))
    return root


SUBSET = ["valid/ragged2_tp2.safetensors", "invalid/writes_duplicate.safetensors", "hostile/truncated_data.safetensors"]


def test_external_implementation_protocol(tmp_path):
    root = _subset(tmp_path, SUBSET)
    ours = f"{sys.executable} -m dspark_abi.cli validate --json {{path}}"
    rows = runner.run(root, command=ours)
    assert [r.passed for r in rows] == [True, True, True], format_table(rows)
    lazy = f"{sys.executable} -c \"print('{{\\\"status\\\": \\\"valid\\\", \\\"issues\\\": []}}')\""
    rows = runner.run(root, command=lazy)  # always says valid (path appended, ignored)
    assert [r.passed for r in rows] == [True, False, False]
    rows = runner.run(root, command=f"{sys.executable} -c \"print('not json')\"")
    assert not any(r.passed for r in rows) and all("protocol JSON" in r.detail for r in rows)
    exit_lies = f"{sys.executable} -c \"print('{{\\\"status\\\": \\\"invalid\\\", \\\"issues\\\": []}}')\""
    assert "exit code 0 does not match" in runner.run(root, command=exit_lies)[0].detail
