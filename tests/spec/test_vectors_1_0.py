"""The frozen 1.0 conformance vectors (spec/v1/vectors-1.0, copied from the 1.0 release and never regenerated) are
read by today's 1.1 reader and judged as their 1.0 index says, except where 1.1 documents a difference (spec
section 12, change log of 1.1)."""

import hashlib
import json

import pytest

from dspark_abi.conformance import runner, vectors
from dspark_abi.io import fixtures
from dspark_abi.io.manifest import SUPPORTED_VERSIONS

from .conftest import VECTORS_1_0

#: 1.0-invalid vectors that 1.1 accepts because R12 (tables.width) was relaxed, with the reason. None: R12 now
#: accepts tables narrower than the 1.0 width, and the only 1.0 width vector (invalid/tables_width) is one column
#: wider than it, which 1.1 still refuses.
RELAXED_BY_R12: dict[str, str] = {}
#: 1.0 vectors that 1.1 judges differently for another documented reason.
OTHER_DIFFERENCES: dict[str, str] = {
    "hostile/newer_minor.safetensors": "names format_version 1.1, newer than a 1.0 reader implements; a 1.1 reader "
                                       "implements it, so the file (the valid single_token batch) is read and valid",
}


def _index() -> dict:
    return json.loads((VECTORS_1_0 / "index.json").read_text())


def test_the_frozen_set_is_the_1_0_release():
    index = _index()
    assert index["format_version"] == "1.0"
    assert len(index["vectors"]) == 68
    for entry in index["vectors"]:  # unchanged bytes: the index's hashes are those of the 1.0 release
        assert hashlib.sha256((VECTORS_1_0 / entry["file"]).read_bytes()).hexdigest() == entry["sha256"], entry
    assert "1.0" in SUPPORTED_VERSIONS


def test_frozen_1_0_vectors_are_judged_as_their_index_says():
    rows = runner.run(VECTORS_1_0)
    assert len(rows) == len(_index()["vectors"])
    failed = {r.file: r for r in rows if not r.passed}
    assert set(failed) == set(RELAXED_BY_R12) | set(OTHER_DIFFERENCES), {k: r.detail for k, r in failed.items()}


@pytest.mark.parametrize("entry", [e for e in _index()["vectors"] if not e["file"].startswith("hostile/")],
                         ids=lambda e: e["file"])
def test_readable_1_0_files_are_1_0_files(entry):
    fixture = fixtures.read(VECTORS_1_0 / entry["file"])
    assert fixture.manifest.format_version == "1.0"
    assert fixture.manifest.expected is not None
    assert fixture.manifest.expected.model_dump(mode="json") == entry["expected"]
    report = fixture.validate()
    relaxed = entry["file"] in RELAXED_BY_R12
    assert report.ok == (entry["expected"]["valid"] or relaxed)
    if not relaxed:
        assert sorted(report.codes) == entry["expected"]["codes"]


def test_newer_minor_of_1_0_is_a_readable_1_1_file():
    fixture = fixtures.read(VECTORS_1_0 / "hostile" / "newer_minor.safetensors")
    assert fixture.manifest.format_version == "1.1" and fixture.validate().ok


def test_the_frozen_set_is_not_the_generated_one():
    """The generator writes spec/v1/vectors only; the 1.0 directory differs from a fresh generation (1.1 bytes)."""
    assert vectors.check(VECTORS_1_0)
