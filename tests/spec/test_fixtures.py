"""Fixture files: round trips, canonical bytes, interoperability, and hostile files rejected without side effects."""

import json
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.io import fixtures
from dspark_abi.io.manifest import MANIFEST_KEY, Expectation
from dspark_abi.presets import DEMO, TINY
from dspark_abi.testing import packed_batches

from .conftest import VECTORS, entries_of, snapshot


def _ragged2(config=TINY, tp=2, token_ids=True):
    builder = BatchBuilder(config, PaddingPolicy(tp_size=tp), BlockAllocator(config, PoolBlocks.uniform(64)))
    builder.add(10, num_cached=126, num_new=3, token_ids=[1, 2, 3] if token_ids else None)
    builder.add(20, num_cached=30, num_new=4, token_ids=[4, 5, 6, 7] if token_ids else None)
    return builder.build()


def test_round_trip_equals_the_batch(tmp_path):
    batch = _ragged2()
    extras = {"hidden": np.linspace(-1, 1, 8 * 6, dtype=np.float32).reshape(8, 6),
              "kv_cache": np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4),
              "expected_logits": np.ones((2, 5), np.float64)}
    extras["hidden"][7] = 0
    path = fixtures.save(tmp_path / "b.safetensors", batch, tensors=extras, name="rt", description="round trip")
    loaded = fixtures.load(path)
    assert loaded.batch == batch
    assert loaded.manifest.name == "rt" and loaded.manifest.request_ids == (10, 20)
    assert sorted(loaded.tensors) == sorted(extras)
    for k, v in extras.items():
        assert loaded.tensors[k].dtype == v.dtype and np.array_equal(loaded.tensors[k], v), k


@given(packed_batches())
def test_round_trip_of_generated_batches(batch):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b.safetensors"
        fixtures.save(path, batch)
        assert fixtures.load(path).batch == batch
        assert fixtures.encode(batch.to_arrays(), config=batch.config, policy=batch.policy,
                               pool_blocks=batch.pool_blocks.as_dict()) == path.read_bytes()


def test_safetensors_library_reads_our_files(tmp_path):
    batch = _ragged2(DEMO)
    path = fixtures.save(tmp_path / "b.safetensors", batch, tensors={"hidden": np.zeros((8, 2), np.float32)})
    stored = safetensors.numpy.load_file(str(path))
    assert set(stored) == set(batch.to_arrays()) | {"extra.hidden"}
    for k, v in batch.to_arrays().items():
        assert stored[k].dtype == v.dtype and np.array_equal(stored[k], v), k
    with safetensors.safe_open(str(path), "np") as f:
        manifest = json.loads(f.metadata()[MANIFEST_KEY])  # one JSON string in __metadata__
    assert manifest["format"] == "dspark.packed_batch" and manifest["format_version"] == "1.4"
    assert manifest["tensors"]["positions"] == {"dtype": "int32", "shape": [8]}


def test_files_written_by_the_safetensors_library_are_read(tmp_path):
    batch = _ragged2()
    ours = fixtures.save(tmp_path / "ours.safetensors", batch)
    metadata = {MANIFEST_KEY: fixtures.read(ours).manifest.canonical_json(), "written_by": "safetensors"}
    theirs = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(dict(batch.to_arrays()), str(theirs), metadata=metadata)
    assert fixtures.load(theirs).batch == batch  # other metadata keys are ignored


def test_save_arrays_stores_invalid_batches_and_load_refuses_them(tmp_path):
    batch = _ragged2()
    arrays = {k: np.array(v) for k, v in batch.to_arrays().items()}
    arrays["ori_slot_mapping"][6] += 1  # last token of request 1: points at a row nobody writes
    path = fixtures.save_arrays(tmp_path / "bad.safetensors", arrays, config=TINY, policy=batch.policy,
                                pool_blocks=batch.pool_blocks.as_dict(),
                                expected=Expectation(valid=False, codes=("slots.mismatch",)))
    assert fixtures.read(path).validate().codes == {"slots.mismatch"}
    with pytest.raises(ABIError) as err:
        fixtures.load(path)
    assert err.value.codes == {"slots.mismatch"}


def test_load_checks_hidden_padding_rows(tmp_path):
    batch = _ragged2()
    hidden = np.ones((8, 3), np.float32)  # padding row 7 is not zero
    path = fixtures.save(tmp_path / "h.safetensors", batch, tensors={"hidden": hidden})
    with pytest.raises(ABIError) as err:
        fixtures.load(path)
    assert err.value.codes == {"padding.hidden"}


def test_writer_refuses_what_it_cannot_store(tmp_path):
    batch = _ragged2()
    with pytest.raises(ValueError, match="not ABI fields"):
        fixtures.save_arrays(tmp_path / "x.safetensors", dict(batch.to_arrays(), bogus=np.zeros(2)), config=TINY,
                             policy=batch.policy, pool_blocks=batch.pool_blocks.as_dict())
    with pytest.raises(ValueError, match="cannot be stored"):
        fixtures.save(tmp_path / "x.safetensors", batch, tensors={"c": np.zeros(2, np.complex64)})
    assert not list(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("entry", entries_of("hostile"), ids=lambda e: e["file"])
def test_hostile_files_are_rejected(entry):
    path = VECTORS / entry["file"]
    before = snapshot(path)
    for reader in (fixtures.read, fixtures.load):
        with pytest.raises(ABIError) as err:
            reader(path)
        assert err.value.codes == set(entry["expected"]["codes"]), str(err.value)
    assert snapshot(path) == before


@pytest.mark.parametrize("kind", ["valid", "invalid"])
def test_reading_never_modifies_the_file(kind):
    for entry in entries_of(kind)[:6]:
        path = VECTORS / entry["file"]
        before = snapshot(path)
        fixtures.read(path).validate()
        try:
            fixtures.load(path)
        except ABIError:
            assert kind == "invalid"
        assert snapshot(path) == before


def test_missing_path_and_directory_are_unreadable(tmp_path):
    for path in (tmp_path / "absent.safetensors", tmp_path):
        with pytest.raises(ABIError) as err:
            fixtures.read(path)
        assert err.value.codes == {"fixture.unreadable"}


def _small_file(tmp_path) -> bytes:
    b = BatchBuilder(TINY, PaddingPolicy(), BlockAllocator(TINY, PoolBlocks.uniform(8)))
    b.add(0, num_cached=0, num_new=2)
    return fixtures.save(tmp_path / "s.safetensors", b.build()).read_bytes()


def test_every_truncation_is_unreadable(tmp_path):
    data = _small_file(tmp_path)
    cut = tmp_path / "cut.safetensors"
    for size in [*range(0, 64), *range(64, len(data), 61)]:
        cut.write_bytes(data[:size])
        with pytest.raises(ABIError) as err:
            fixtures.read(cut)
        assert err.value.codes == {"fixture.unreadable"}, size


def test_corrupted_bytes_never_escape_as_other_exceptions(tmp_path):
    data = _small_file(tmp_path)
    (header_len,) = struct.unpack("<Q", data[:8])
    rng = np.random.default_rng(20261130)
    corrupt = tmp_path / "corrupt.safetensors"
    outcomes = set()
    for _ in range(300):
        buf = bytearray(data)
        at = int(rng.integers(0, 8 + header_len))
        buf[at] = int(rng.integers(0, 256))
        corrupt.write_bytes(bytes(buf))
        try:
            fixtures.read(corrupt).validate()
            outcomes.add("readable")
        except ABIError as exc:
            assert all(c.startswith("fixture.") for c in exc.codes), exc
            outcomes |= exc.codes
    assert "fixture.unreadable" in outcomes and len(outcomes) >= 3


def with_tensor(tmp_path, name: str, shape: list, *, in_manifest: bool = True, file: str = "t.safetensors") -> Path:
    """A copy of a valid vector with one more zero-byte float32 tensor ``name`` of ``shape`` in the header."""
    src = (VECTORS / "valid" / "ragged2_tp2.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", src[:8])
    header, data = json.loads(src[8:8 + header_len]), src[8 + header_len:]
    if in_manifest:
        manifest = json.loads(header["__metadata__"][MANIFEST_KEY])
        manifest["tensors"][name] = {"dtype": "float32", "shape": shape}
        header["__metadata__"][MANIFEST_KEY] = json.dumps(manifest)
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data)]}
    path = tmp_path / file
    path.write_bytes(fixtures.pack_header(header) + data)
    return path


@pytest.mark.parametrize("shape", [[0, 2**70], [2**62, 0], [0] * 65, [1] * 40 + [0] * 30, [2**40, 2**40, 0]],
                         ids=["0x2^70", "2^62x0", "65_dims", "70_dims", "2^40x2^40x0"])
def test_zero_size_tensors_with_hostile_shapes_are_unreadable(tmp_path, shape):
    path = with_tensor(tmp_path, "extra.x", shape)
    with pytest.raises(ABIError) as err:
        fixtures.read(path)
    assert err.value.codes == {"fixture.unreadable"}
    assert err.value.issues[0].field == "extra.x"


def test_sane_zero_size_tensors_are_read(tmp_path):
    path = with_tensor(tmp_path, "extra.empty", [0, 3, 2**20])
    assert fixtures.read(path).extras["empty"].shape == (0, 3, 2**20)


def test_missing_path_directory_and_fifo_say_the_actual_fix(tmp_path):
    fixes = {}
    for kind, path in (("missing", tmp_path / "absent.safetensors"), ("directory", tmp_path)):
        with pytest.raises(ABIError) as err:
            fixtures.read(path)
        (issue,) = err.value.issues
        assert issue.code == "fixture.unreadable" and "regenerate" not in issue.hint
        fixes[kind] = issue.hint
    assert "check the path" in fixes["missing"]
    assert "directory" in fixes["directory"] and ".safetensors" in fixes["directory"]


def test_fifo_is_refused_without_opening_it(tmp_path):
    import os
    import threading

    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    outcome = {}

    def target():
        try:
            fixtures.read(fifo)
        except ABIError as exc:
            outcome["issues"] = exc.issues

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout=5)
    if worker.is_alive():  # stuck in open(): release it by opening the writing end, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=10)
        pytest.fail("reading a FIFO blocked in open()")
    (issue,) = outcome["issues"]
    assert issue.code == "fixture.unreadable" and "not a regular file" in issue.hint


def test_an_issue_can_carry_its_own_fix():
    from dspark_abi.errors import CODES, Issue

    generic = Issue("fixture.unreadable", "file", "cannot open the file")
    specific = Issue("fixture.unreadable", "file", "cannot open the file", fix="check the path")
    assert generic.hint == CODES["fixture.unreadable"][1]
    assert specific.hint == "check the path" and specific.to_dict()["hint"] == "check the path"
    assert str(specific).endswith("Fix: check the path")


@pytest.mark.parametrize(("version", "readable"), [("1.0", True), ("1.1", True), ("1.2", True), ("1.3", True),
                                                   ("1.4", True), ("1.5", False), ("1.10", False), ("2.0", False),
                                                   ("1", False), (1.1, False)])
def test_reader_accepts_every_minor_up_to_1_4(tmp_path, version, readable):
    """Writers write 1.4; readers read 1.0 to 1.4 (spec section 12) and refuse a newer minor or another major."""
    batch = _ragged2()
    data = fixtures.encode(batch.to_arrays(), config=TINY, policy=batch.policy, pool_blocks=batch.pool_blocks.as_dict())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    manifest = json.loads(header["__metadata__"][MANIFEST_KEY])
    assert manifest["format_version"] == "1.4"
    manifest["format_version"] = version
    header["__metadata__"][MANIFEST_KEY] = json.dumps(manifest)
    path = tmp_path / "v.safetensors"
    path.write_bytes(fixtures.pack_header(header) + data[8 + header_len:])
    if readable:
        assert fixtures.load(path).batch == batch
    else:
        with pytest.raises(ABIError) as err:
            fixtures.read(path)
        assert err.value.codes == {"fixture.version"}
