"""Conformance vectors: deterministic, committed, complete, and passed by this library."""

import re
import shutil

import pytest

from dspark_abi import CODES
from dspark_abi.cli.files import format_table
from dspark_abi.conformance import runner, vectors
from dspark_abi.io import fixtures

from .conftest import SPEC, VECTORS, entries_of, index_entries

#: Codes no fixture file can produce; the API tests in tests/abi/test_codes.py raise them.
API_ONLY_CODES = {"pools.blocks", "rank.index", "rank.replicated_mismatch", "rank.local_mismatch", "config.invalid",
                  "config.mismatch", "builder.request", "alloc.exhausted", "alloc.unknown_request",
                  "alloc.stale_plan", "kernel.index_range"}
#: Keep the committed vectors small enough for any checkout (measured: 3.8 MB).
MAX_VECTOR_BYTES = 10 * 2**20


def test_committed_vectors_have_not_drifted():
    assert vectors.check(VECTORS) == [], "regenerate with: python -m dspark_abi.conformance.vectors spec/v1/vectors"


def test_generation_is_deterministic(tmp_path):
    vectors.generate(tmp_path / "a")
    vectors.generate(tmp_path / "b")
    a, b = vectors._listing(tmp_path / "a"), vectors._listing(tmp_path / "b")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_check_reports_changed_missing_and_stale_files(tmp_path):
    copy = tmp_path / "vectors"
    shutil.copytree(VECTORS, copy)
    target = copy / "valid" / "single_token.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    (copy / "invalid" / "qsl_start.safetensors").unlink()
    (copy / "hostile" / "leftover.safetensors").write_bytes(b"")
    problems = vectors.check(copy)
    assert "differs: valid/single_token.safetensors" in problems
    assert "missing: invalid/qsl_start.safetensors" in problems
    assert "stale (not generated): hostile/leftover.safetensors" in problems
    assert vectors.main([str(copy), "--check"]) == 1


def test_every_vector_passes_conformance():
    rows = runner.run(VECTORS)
    failed = [r for r in rows if not r.passed]
    assert not failed, format_table(failed)
    assert len(rows) == len(index_entries())


def test_conformance_detects_a_wrong_expectation(tmp_path):
    copy = tmp_path / "vectors"
    shutil.copytree(VECTORS, copy)
    index = (copy / "index.json").read_text()
    (copy / "index.json").write_text(index.replace('"qsl.start"', '"qsl.non_monotonic"', 1))
    rows = {r.file: r for r in runner.run(copy)}
    bad = rows["invalid/qsl_start.safetensors"]
    assert not bad.passed and bad.detail == "manifest expectation differs from the index"
    assert sum(not r.passed for r in rows.values()) == 1


def test_required_cases_exist():
    valid = {e["file"].removeprefix("valid/").removesuffix(".safetensors") for e in entries_of("valid")}
    assert len(valid) >= 12
    assert {"ragged2_tp2", "flash_single_8192_tp4", "many_short_tp4", "unaligned_tp2", "unaligned_tp4",
            "unaligned_tp8_idle_ranks", "cross_every_rank_tp8", "zero_length_requests", "chunk_continuation",
            "ratio4_boundaries", "ratio128_boundaries"} <= valid


def _load(name):
    return fixtures.load(VECTORS / f"valid/{name}.safetensors")


def test_valid_vectors_exercise_what_their_names_say():
    flash = _load("flash_single_8192_tp4")
    assert (flash.manifest.config.name, flash.batch.num_tokens, flash.batch.tp_size) == ("flash", 8192, 4)
    for name, tp in (("unaligned_tp2", 2), ("unaligned_tp4", 4), ("unaligned_tp8_idle_ranks", 8)):
        b = _load(name).batch
        assert b.tp_size == tp and b.num_tokens % tp != 0
    idle = _load("unaligned_tp8_idle_ranks").batch
    assert all((idle.rank(r).local_request_ids == -1).all() for r in (6, 7))
    crossing = _load("cross_every_rank_tp8").batch
    owners = {r: set(crossing.rank(r).local_request_ids.tolist()) for r in range(8)}
    assert all(1 in owners[r] for r in range(8))
    assert (_load("zero_length_requests").batch.request_lengths == 0).sum() >= 2
    chunk = _load("chunk_continuation").batch
    assert chunk.request_starts[0] == 200 and (chunk.tables.csa_state[0, :50] == -1).all()  # recycled ring pages
    for name, ratio in (("ratio4_boundaries", 4), ("ratio128_boundaries", 128)):
        b = _load(name).batch
        pos = b.positions[:b.num_tokens]
        assert ((pos + 1) % ratio == 0).any() and ((pos + 1) % ratio != 0).any()


def test_invalid_vectors_break_exactly_one_rule():
    for entry in entries_of("invalid"):
        codes = entry["expected"]["codes"]
        if entry["file"] == "invalid/writes_duplicate.safetensors":
            assert codes == ["slots.mismatch", "writes.duplicate"]  # inseparable, see spec section 9
        else:
            assert len(codes) == 1, entry


def test_every_file_producible_code_has_a_vector():
    covered = {c for e in index_entries() for c in e["expected"]["codes"]}
    assert covered == set(CODES) - API_ONLY_CODES
    hostile_codes = {c for e in entries_of("hostile") for c in e["expected"]["codes"]}
    assert hostile_codes == {c for c in CODES if c.startswith("fixture.")}


def test_vectors_stay_small():
    total = sum(p.stat().st_size for p in VECTORS.rglob("*") if p.is_file())
    assert total < MAX_VECTOR_BYTES


def _example_block() -> dict[str, list[int]]:
    text = (SPEC / "abi.md").read_text()
    block = text.split("<!-- example:ragged2_tp2 -->", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    out = {}
    for line in block.strip().splitlines():
        m = re.fullmatch(r"(\w+) = \[(.*)\]", line.strip())
        assert m, line
        out[m.group(1)] = [int(x) for x in m.group(2).split(",")]
    return out


def test_spec_worked_example_matches_its_vector():
    example = _example_block()
    loaded = _load("ragged2_tp2")
    arrays = loaded.batch.to_arrays()
    for name, values in example.items():
        rank = re.fullmatch(r"rank(\d+)_local_request_ids", name)
        actual = loaded.batch.rank(int(rank.group(1))).local_request_ids if rank else arrays[name]
        assert actual.tolist() == values, name
    assert len(example) >= 12
    assert (loaded.batch.num_requests, loaded.batch.num_tokens, loaded.batch.padded_rows) == (2, 7, 8)


@pytest.mark.parametrize("entry", entries_of("valid"), ids=lambda e: e["file"])
def test_valid_vectors_reencode_to_the_same_bytes(entry):
    path = VECTORS / entry["file"]
    loaded = fixtures.load(path)
    m = loaded.manifest
    data = fixtures.encode(loaded.batch.to_arrays(), config=m.config, policy=m.policy,
                           pool_blocks=m.pool_blocks.as_dict(), tensors=loaded.tensors, expected=m.expected,
                           name=m.name, description=m.description)
    if "request_ids" not in m.tensors:  # the batch fills in default ids; the file stores only what was given
        arrays = {k: v for k, v in loaded.batch.to_arrays().items() if k in m.tensors}
        data = fixtures.encode(arrays, config=m.config, policy=m.policy, pool_blocks=m.pool_blocks.as_dict(),
                               tensors=loaded.tensors, expected=m.expected, name=m.name, description=m.description)
    assert data == path.read_bytes()
