"""Writes never destroy what is at the target: every writer refuses directories, devices, FIFOs and sockets,
writes through symlinks, and checks the directory before any work (run as root too, as CI does)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from dspark_abi.cli.main import build_batch
from dspark_abi.conformance import vectors
from dspark_abi.io import fixtures, safe_write
from dspark_abi.io.safe_write import WriteTargetError, check_target, write_bytes
from dspark_abi.presets import TINY
from dspark_kernels.model import synthetic

from .conftest import run_cli


def _batch():  # type: ignore[no-untyped-def]
    return build_batch("tiny", [(3, 0)], 1)


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.fixture
def sock(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    yield path
    s.close()


def _kinds(tmp_path: Path, fifo: Path, sock: Path) -> dict[str, tuple[Path, str, int]]:
    """name -> (path, expected code, stat kind test bit) of every non-regular target."""
    folder = tmp_path / "dir"
    folder.mkdir()
    return {"fifo": (fifo, "write.not_regular", stat.S_IFIFO), "socket": (sock, "write.not_regular", stat.S_IFSOCK),
            "directory": (folder, "write.is_directory", stat.S_IFDIR),
            "dev_null": (Path(os.devnull), "write.not_regular", stat.S_IFCHR)}


def _writers(path: Path):  # type: ignore[no-untyped-def]
    """Every writer the project has, aimed at ``path``."""
    batch = _batch()
    return {"bytes": lambda: write_bytes(path, b"x"),
            "fixture": lambda: fixtures.save(path, batch),
            "safetensors": lambda: synthetic.write_safetensors(path, []),
            "check": lambda: check_target(path)}


def test_every_writer_refuses_what_is_not_a_regular_file(tmp_path, fifo, sock):
    for name, (path, code, kind) in _kinds(tmp_path, fifo, sock).items():
        for writer, write in _writers(path).items():
            with pytest.raises(WriteTargetError) as info:
                write()
            assert info.value.code == code, (name, writer)
            assert isinstance(info.value, OSError) and info.value.fix, (name, writer)
            assert stat.S_IFMT(os.stat(path).st_mode) == kind, (name, writer)     # still what it was
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".probe"))]
    assert not leftovers


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "real.safetensors"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    fixtures.save(link, _batch())
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640                 # the old file's mode is kept
    assert fixtures.load(link).batch == fixtures.load(target).batch == _batch()


def test_a_symlink_to_a_device_or_directory_is_refused(tmp_path, fifo):
    for pointee in (Path(os.devnull), fifo, tmp_path):
        link = tmp_path / f"to_{pointee.name or 'root'}"
        link.symlink_to(pointee)
        with pytest.raises(WriteTargetError, match=r"not a regular file|is a directory"):
            fixtures.save(link, _batch())
        assert link.is_symlink()
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "new.bin")
    write_bytes(link, b"abc")
    assert link.is_symlink() and (tmp_path / "new.bin").read_bytes() == b"abc"


def test_the_directory_is_checked_with_the_real_reason(tmp_path):
    with pytest.raises(WriteTargetError, match="does not exist") as info:
        check_target(tmp_path / "missing" / "x")
    assert info.value.code == "write.no_directory"
    (tmp_path / "file").write_text("")
    with pytest.raises(WriteTargetError, match="is not a directory"):
        check_target(tmp_path / "file" / "x")
    if os.path.isdir("/proc/self"):      # creating a file fails with ENOENT, whatever the permission bits say
        with pytest.raises(WriteTargetError, match="cannot create a file in directory /proc") as info:
            check_target("/proc/x")
        assert info.value.code == "write.not_writable"


def test_a_regular_file_is_replaced_whole(tmp_path):
    target = tmp_path / "f"
    target.write_bytes(b"old contents")
    write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def explode(f):  # type: ignore[no-untyped-def]
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(WriteTargetError, match="No space left") as info:
        safe_write.write_with(target, explode)
    assert info.value.code == "write.failed"
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_synthetic_checkpoint_checks_every_file_before_writing(tmp_path):
    cfg = synthetic.short_schedule(TINY) if hasattr(synthetic, "short_schedule") else TINY
    (tmp_path / "config.json").mkdir()            # the last file written: refused before the first shard
    with pytest.raises(WriteTargetError, match="is a directory"):
        synthetic.write_checkpoint(tmp_path, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_conformance_generation_refuses_a_device_in_place_of_a_vector(tmp_path):
    (tmp_path / "index.json").symlink_to(os.devnull)
    with pytest.raises(WriteTargetError, match="character device"):
        vectors.generate(tmp_path)
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.parametrize("option", ["--save", "--png"])
def test_build_cli_refuses_dev_null_and_a_fifo(option, fifo):
    for target in (os.devnull, str(fifo)):
        res = run_cli("build", "--request", "3@0", option, target)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "not a regular file" in lines[0] and "Traceback" not in res.stderr, res.stderr
        assert res.stdout == ""                    # refused before the layout was printed
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode) and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_show_png_refuses_dev_null(tmp_path):
    path = tmp_path / "b.safetensors"
    fixtures.save(path, _batch())
    res = run_cli("show", str(path), "--png", os.devnull)
    assert res.returncode == 2 and "not a regular file" in res.stderr, res.stderr
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
