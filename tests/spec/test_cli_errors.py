"""`dspark-abi` user mistakes: one short line on stderr naming the problem and the fix, exit 1 or 2, no traceback."""

import json
import os
import shutil

import pytest

from dspark_abi import cli
from dspark_abi.cli.common import parse_request
from dspark_abi.conformance import runner

from .conftest import VECTORS, index_entries
from .test_fixtures import with_tensor

RAGGED2 = VECTORS / "valid" / "ragged2_tp2.safetensors"
DUPLICATE = VECTORS / "invalid" / "writes_duplicate.safetensors"
HOSTILE = VECTORS / "hostile" / "truncated_data.safetensors"


def run(capsys, *argv):
    """(exit code, stdout, stderr) of ``dspark-abi ARGV`` run in-process."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:  # an argparse error that escaped main()
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    return code, out, err


def one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------------------------------- build arguments
@pytest.mark.parametrize("tp", ["0", "-2", "100", "two"])
def test_bad_tp_is_a_usage_error(capsys, tp):
    code, out, err = run(capsys, "build", "--request", "3@126", "--tp", tp)
    assert code == 2 and out == ""
    line = one_line(err)
    assert "--tp" in line and "1" in line and "64" in line and repr(tp) in line


def test_tp_larger_than_the_tokens_is_a_valid_geometry(capsys):
    code, out, _ = run(capsys, "build", "--request", "3@126", "--tp", "8")
    assert code == 0 and "TP=8 R=1 N=3 P=8 L=1" in out


@pytest.mark.parametrize("blocks", ["-5", "0", "many", str(2**40)])
def test_bad_pool_blocks_is_a_usage_error(capsys, blocks):
    code, out, err = run(capsys, "build", "--request", "3@126", "--pool-blocks", blocks)
    assert code == 2 and out == ""
    line = one_line(err)
    assert "--pool-blocks" in line and ">= 1" in line and "alloc.exhausted" not in line


def test_too_few_pool_blocks_is_a_failed_run(capsys):
    code, _, err = run(capsys, "build", "--request", "3@126", "--pool-blocks", "1")
    assert code == 1 and "alloc.exhausted" in err and len(err.splitlines()) <= 8


@pytest.mark.parametrize(("request_text", "says"), [
    ("3@-1", "cached tokens must be a non-negative integer"),
    ("-3@1", "new tokens must be a non-negative integer"),
    ("3@x", "cached tokens must be a non-negative integer"),
    ("3-126", "must look like TOKENS@CACHED"),
    ("3@1@2", "must look like TOKENS@CACHED"),
])
def test_bad_request_says_what_is_wrong(capsys, request_text, says):
    code, out, err = run(capsys, "build", f"--request={request_text}")  # '=': argparse takes -3@1 for an option
    assert code == 2 and out == ""
    line = one_line(err)
    assert says in line and "e.g. 3@126" in line


def test_parse_request_keeps_its_contract():
    import argparse

    assert parse_request(" 3@126 ") == (3, 126)
    with pytest.raises(argparse.ArgumentTypeError, match="cached tokens"):
        parse_request("3@-1")


@pytest.mark.parametrize("request_text", ["3@99999999999", "3@99999999999999999999", "100000000000000000000@0"])
def test_huge_requests_are_refused_quickly(capsys, request_text):
    code, _, err = run(capsys, "build", "--request", request_text)
    assert code == 1 and "builder.request" in err  # the builder's word on it, not pools sized for it
    assert len(err.splitlines()) <= 4


def test_usage_errors_return_instead_of_raising(capsys):
    assert cli.main(["build", "--request", "3@126", "--tp", "0"]) == 2
    assert cli.main([]) == 2
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------- output files
@pytest.mark.parametrize("option", ["--png", "--save"])
def test_output_into_a_missing_directory_is_refused_before_building(capsys, tmp_path, option):
    target = tmp_path / "no" / "such" / "out.file"
    other = "--save" if option == "--png" else "--png"
    kept = tmp_path / "kept.file"
    code, out, err = run(capsys, "build", "--request", "3@126", option, target, other, kept)
    assert code == 2 and out == ""
    line = one_line(err)
    assert option in line and str(target.parent) in line and "does not exist" in line
    assert not kept.exists()  # nothing was written: the check runs before any work


def test_output_onto_a_directory_is_refused(capsys, tmp_path):
    code, _, err = run(capsys, "build", "--request", "3@126", "--save", tmp_path)
    assert code == 2 and "is a directory" in one_line(err)


def test_show_png_into_a_missing_directory(capsys, tmp_path):
    code, out, err = run(capsys, "show", RAGGED2, "--png", tmp_path / "absent" / "x.png")
    assert code == 2 and out == "" and "--png" in one_line(err)


def test_json_stays_one_document_with_save_and_png(capsys, tmp_path):
    save, png = tmp_path / "b.safetensors", tmp_path / "b.png"
    code, out, err = run(capsys, "build", "--request", "3@126", "--tp", "2", "--json", "--save", save, "--png", png)
    assert code == 0
    assert json.loads(out)["padded_rows"] == 4
    assert err.splitlines() == [f"wrote {save}", f"wrote {png}"]
    assert save.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------------- show
def test_show_valid_file_exits_0(capsys):
    code, out, err = run(capsys, "show", RAGGED2)
    assert code == 0 and err == ""
    assert out.startswith("config=demo TP=2 R=2 N=7 P=8 L=4") and "issue" not in out


def test_show_invalid_file_prints_layout_then_every_issue(capsys):
    code, out, _ = run(capsys, "show", DUPLICATE)
    assert code == 1
    layout, _, issues = out.partition(f"{DUPLICATE}: invalid (2 issues)")
    assert "rank 0: rows" in layout and "local_request_ids" in layout
    assert "slots.mismatch" in issues and "writes.duplicate" in issues


def test_show_invalid_json_is_one_document_with_layout_and_issues(capsys):
    code, out, _ = run(capsys, "show", DUPLICATE, "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["status"] == "invalid" and doc["padded_rows"] == len(doc["rows"])
    assert sorted({i["code"] for i in doc["issues"]}) == ["slots.mismatch", "writes.duplicate"]


@pytest.mark.parametrize("name", ["geometry_rows", "array_missing", "array_shape", "qsl_start", "qsl_shape"])
def test_show_without_a_renderable_geometry_prints_the_issues_only(capsys, name):
    path = VECTORS / "invalid" / f"{name}.safetensors"
    code, out, _ = run(capsys, "show", path)
    assert code == 1
    assert out.startswith(f"{path}: invalid") and "rank 0" not in out
    code, out, _ = run(capsys, "show", path, "--json")
    assert code == 1 and "rows" not in json.loads(out)


def test_show_renders_value_level_invalid_files(capsys):
    for name in ("tables_width", "qsl_empty_request", "positions_out_of_range", "padding_hidden"):
        path = VECTORS / "invalid" / f"{name}.safetensors"
        code, out, _ = run(capsys, "show", path)
        assert code == 1 and out.startswith("config=") and f"{path}: invalid" in out, name


def test_show_unreadable_file_exits_2(capsys, tmp_path):
    code, out, _ = run(capsys, "show", HOSTILE)
    assert code == 2 and out.startswith(f"{HOSTILE}: unreadable") and "fixture.unreadable" in out
    code, out, _ = run(capsys, "show", tmp_path / "absent.safetensors")
    assert code == 2 and "check the path" in out


def test_show_and_validate_agree_on_exit_codes(capsys):
    for entry in index_entries()[::5]:
        path = VECTORS / entry["file"]
        assert run(capsys, "show", path)[0] == run(capsys, "validate", path)[0], entry["file"]


# ---------------------------------------------------------------------------------------------- hostile files
@pytest.mark.parametrize("shape", [[0, 2**70], [2**62, 0], [0] * 65])
@pytest.mark.parametrize("command", ["validate", "show"])
def test_hostile_shapes_are_unreadable_on_the_command_line(capsys, tmp_path, shape, command):
    path = with_tensor(tmp_path, "extra.x", shape)
    code, out, _ = run(capsys, command, path)
    assert code == 2 and "fixture.unreadable" in out


@pytest.mark.parametrize("name", ["\ud800", "\x1b[31mred\x1b[0m", "two\nlines"])
@pytest.mark.parametrize("command", ["validate", "show"])
def test_file_strings_are_printed_escaped(capsys, tmp_path, name, command):
    path = with_tensor(tmp_path, name, [0], in_manifest=False)  # not in the manifest: named in a fixture.tensors issue
    code, out, _ = run(capsys, command, path)
    assert code == 2
    assert "\x1b" not in out and "\ud800" not in out
    out.encode("utf-8")  # printable
    issue_lines = [line for line in out.splitlines() if "fixture.tensors" in line]
    assert len(issue_lines) == 1 and ascii(name)[1:-1] in issue_lines[0]
    code, out, _ = run(capsys, command, path, "--json")
    (doc,) = [json.loads(line) for line in out.splitlines()] if command == "validate" else [json.loads(out)]
    assert doc["issues"][0]["field"] == name


def test_odd_file_names_are_printed_escaped(capsys, tmp_path):
    path = tmp_path / "\x1b[2Jx.safetensors"
    shutil.copy(RAGGED2, path)
    code, out, _ = run(capsys, "validate", path)
    assert code == 0 and "\x1b" not in out and "\\x1b[2Jx.safetensors: valid" in out


def test_fifo_is_unreadable_not_a_hang(capsys, tmp_path):
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    code, out, _ = run(capsys, "validate", fifo)
    assert code == 2 and "not a regular file" in out


def test_directory_is_unreadable_with_the_actual_fix(capsys, tmp_path):
    code, out, _ = run(capsys, "validate", tmp_path)
    assert code == 2 and "is a directory" in out and "regenerate" not in out


# ---------------------------------------------------------------------------------------------- conformance
def test_conformance_without_a_directory_uses_the_shipped_vectors(capsys):
    assert runner.default_vectors_dir() == VECTORS  # a checkout: spec/v1/vectors
    code, out, _ = run(capsys, "conformance")
    n = len(index_entries())
    assert code == 0 and out.splitlines()[-1] == f"{n} vectors: {n} passed, 0 failed"


def test_packaged_vectors_are_preferred(monkeypatch, tmp_path):
    shipped = tmp_path / "dspark_abi" / "spec_v1" / "vectors"
    shipped.mkdir(parents=True)
    (shipped / "index.json").write_text(json.dumps({"vectors": []}))
    monkeypatch.setattr(runner, "_package_root", lambda: tmp_path / "dspark_abi")
    assert runner.default_vectors_dir() == shipped


def test_conformance_without_any_vectors_says_to_pass_a_directory(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "_package_root", lambda: tmp_path / "site-packages" / "dspark_abi")
    code, out, err = run(capsys, "conformance")
    assert code == 2 and out == "" and "DIR" in one_line(err)


def test_conformance_table_escapes_names_from_the_index(capsys, tmp_path):
    (tmp_path / "index.json").write_text(json.dumps({"vectors": [
        {"file": "\x1b[2Jgone.safetensors", "expected": {"valid": True, "codes": []}}]}))
    code, out, _ = run(capsys, "conformance", tmp_path)
    assert code == 1 and "\x1b" not in out and "\\x1b[2Jgone.safetensors" in out


# ---------------------------------------------------------------------------------------------- newcomer findings
def test_conformance_errors_carry_the_program_prefix(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "_package_root", lambda: tmp_path / "site-packages" / "dspark_abi")
    code, _, err = run(capsys, "conformance")
    assert code == 2 and one_line(err).startswith("dspark-abi: error: ")
    code, _, err = run(capsys, "conformance", tmp_path / "nowhere")
    assert code == 2 and one_line(err).startswith("dspark-abi: error: ")


def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"dspark-abi {version('dspark')}"


@pytest.mark.parametrize("value", ["-1@0", "-3@-2", "-x@1"])
def test_a_negative_request_names_the_real_problem(capsys, value):
    for argv in (["build", "--request", value], [f"--request={value}"]):
        code, out, err = run(capsys, *argv if argv[0] == "build" else ["build", *argv])
        line = one_line(err)
        assert code == 2 and out == "" and "expected one argument" not in line, line
        assert "non-negative integer" in line and value in line, line


def test_a_text_file_is_not_a_safetensors_file(capsys, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("some notes a user saved by mistake\n" * 3)
    code, out, _ = run(capsys, "validate", text)
    assert code == 2 and "not a safetensors file" in out and "exceeds the cap" not in out, out
    assert "8675467939940627818" not in out


def test_bytes_after_the_data_section_are_unreadable(capsys, tmp_path):
    longer = tmp_path / "longer.safetensors"
    longer.write_bytes(RAGGED2.read_bytes() + b"\0")
    code, out, _ = run(capsys, "validate", longer)
    assert code == 2 and "fixture.unreadable" in out and "trailing bytes" in out, out


def test_help_describes_every_preset_and_the_pad_position(capsys):
    from dspark_abi.presets import PRESETS

    code, out, _ = run(capsys, "build", "--help")
    out = " ".join(out.split()).replace("- ", "-")  # argparse wraps lines after hyphens too
    assert code == 0
    for name in PRESETS:
        assert f"{name}: " in out, name
    assert "--pad-position" in out and "position 0" in out and "p_last + 1" in out


def test_docs_describe_every_preset():
    from dspark_abi.presets import PRESETS

    from .conftest import REPO

    text = (REPO / "docs" / "serving.md").read_text()
    for name in PRESETS:
        assert f"| `{name}` |" in text, name


def test_doc_links_to_anchors_resolve():
    """Every [text](file.md#anchor) in docs/ names a heading of that file (GitHub's anchor rule)."""
    import re

    from .conftest import REPO

    docs = REPO / "docs"

    def anchors(path):  # type: ignore[no-untyped-def]
        heads = [m.group(1) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)]
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    broken = []
    for doc in docs.glob("*.md"):
        for target, anchor in re.findall(r"\]\(([\w\-]+\.md)#([^)]+)\)", doc.read_text()):
            if (docs / target).is_file() and anchor not in anchors(docs / target):
                broken.append(f"{doc.name} -> {target}#{anchor}")
    assert not broken, broken


def _red_pixels(png):  # type: ignore[no-untyped-def]
    import matplotlib.image

    img = matplotlib.image.imread(png)
    return int(((img[..., 0] > 0.75) & (img[..., 1] < 0.15) & (img[..., 2] < 0.15)).sum())


def test_the_picture_of_an_invalid_fixture_looks_invalid(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from dspark_abi.cli.main import Layout, build_batch, offending_rows
    from dspark_abi.io import fixtures

    bad = tmp_path / "bad.safetensors"
    batch = build_batch("tiny", [(3, 126), (4, 30)], 2)
    arrays = {k: v.copy() for k, v in batch.to_arrays().items()}
    arrays["positions"][5] = 7                    # row 5 of request 1 breaks its contiguous positions
    fixtures.save_arrays(bad, arrays, config=batch.config, policy=batch.policy,
                         pool_blocks=batch.pool_blocks.as_dict())
    good_png, bad_png = tmp_path / "good.png", tmp_path / "bad.png"
    good = tmp_path / "good.safetensors"
    fixtures.save(good, batch)
    assert run(capsys, "show", good, "--png", good_png)[0] == 0
    code, out, _ = run(capsys, "show", bad, "--png", bad_png)
    assert code == 1 and "positions.not_contiguous" in out
    fixture = fixtures.read(bad)
    issues = fixture.validate().issues
    assert 5 in offending_rows(Layout.of_fixture(fixture), issues)
    assert _red_pixels(good_png) == 0 and _red_pixels(bad_png) > 2000     # the banner and the marked cells
