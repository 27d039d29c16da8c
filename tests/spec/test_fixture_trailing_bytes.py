"""A fixture file longer than its header says (bytes after the data section) is not a valid fixture.

The safetensors header fixes where every tensor ends; a reader that checks only that the data is there (files cut
short) would accept a file with anything appended: a second fixture, padding, a payload. Every reader of the
library and the command line must reject it as ``fixture.unreadable``, and leave the file as it was.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks, cli
from dspark_abi.io import fixtures
from dspark_abi.presets import TINY

from .conftest import snapshot


def _fixture(tmp_path: Path) -> bytes:
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2), BlockAllocator(TINY, PoolBlocks.uniform(16)))
    builder.add(0, num_cached=40, num_new=5, token_ids=[1, 2, 3, 4, 5])
    builder.add(1, num_cached=0, num_new=3, token_ids=[6, 7, 8])
    return fixtures.save(tmp_path / "valid.safetensors", builder.build()).read_bytes()


def _data_section(data: bytes) -> bytes:
    (header_len,) = struct.unpack("<Q", data[:8])
    return data[8 + header_len:]


#: What is appended: one byte, one zero word, whitespace, the data section again, the whole file again.
TAILS = {
    "one_byte": lambda data: b"\x00",
    "zero_word": lambda data: bytes(8),
    "whitespace": lambda data: b" \n",
    "data_again": _data_section,
    "file_again": lambda data: data,
}


@pytest.fixture
def longer(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    data = _fixture(tmp_path)
    fixtures.load(tmp_path / "valid.safetensors")  # the file as written is valid
    path = tmp_path / "longer.safetensors"
    path.write_bytes(data + TAILS[request.param](data))
    return path


@pytest.mark.parametrize("longer", TAILS, indirect=True)
def test_bytes_after_the_data_section_are_unreadable(longer: Path):
    before = snapshot(longer)
    for reader in (fixtures.read, fixtures.load):
        with pytest.raises(ABIError) as err:
            reader(longer)
        assert err.value.codes == {"fixture.unreadable"}, (reader.__name__, str(err.value))
    assert snapshot(longer) == before


@pytest.mark.parametrize("longer", TAILS, indirect=True)
def test_the_command_line_rejects_bytes_after_the_data_section(longer: Path, capsys: pytest.CaptureFixture[str]):
    for command in ("validate", "show"):
        code = cli.main([command, str(longer)])
        out, err = capsys.readouterr()
        assert code == 2 and "fixture.unreadable" in out, (command, code, out, err)
        assert "Traceback" not in out + err
