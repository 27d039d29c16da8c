"""Every file dspark writes goes through here: nothing that is not a regular file is ever replaced.

Writers (``--save`` and ``--png`` of both command-line programs, :func:`dspark_abi.io.fixtures.save`, the
conformance vectors, the synthetic checkpoint writer) call :func:`check_target` before any work (a command-line
program: before the run) and :func:`write_bytes` / :func:`write_with` to write. The rules:

* a target that exists must be a regular file: a directory, character or block device (``/dev/null``), FIFO or
  socket is refused with :class:`WriteTargetError` (it is never opened, replaced or removed);
* a symbolic link is written *through*: the file it points at (resolved fully, as ``os.path.realpath`` does) is
  the target, checked by the same rules, and the link itself stays a link; a dangling link creates its target;
* the target's directory must exist, be a directory and accept a new file: checked by creating (and removing) an
  empty probe file in it, so the real reason (``ENOENT`` in ``/proc``, ``EROFS``, ``EACCES``) is known before the
  run, also as root, for whom permission bits say nothing;
* the file is written to a fresh temporary file beside the target (mode 0666 less the umask, or the old file's
  mode) and moved over it with ``os.replace``, so a reader never sees half a file; the target is checked again
  just before the move.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["WRITE_CODES", "WriteTargetError", "check_target", "write_bytes", "write_text", "write_with"]

#: code -> (what it means, how to fix it) of :class:`WriteTargetError`.
WRITE_CODES: dict[str, tuple[str, str]] = {
    "write.not_regular": ("the path exists and is not a regular file (a device such as /dev/null, a FIFO or a "
                          "socket); it is never replaced",
                          "write to a regular file path instead (e.g. a new file in a directory you own)"),
    "write.is_directory": ("the path is a directory", "give a file name inside it"),
    "write.no_directory": ("the file's directory does not exist or is not a directory",
                           "create the directory first (mkdir -p) or write somewhere else"),
    "write.not_writable": ("no file can be created in the file's directory (permissions, a read-only or virtual "
                           "file system)", "write somewhere else"),
    "write.failed": ("the write itself failed (e.g. the disk is full)", "free space or write somewhere else"),
}


class WriteTargetError(OSError):
    """A file that cannot or must not be written; ``str()`` is one line with the reason and the fix.

    Attributes:
        code: A key of :data:`WRITE_CODES`.
        path: The path as given.
        reason: What is wrong (without the path).
        fix: What to do.
    """

    def __init__(self, code: str, path: str | os.PathLike[str], reason: str, fix: str | None = None,
                 err: int | None = None):
        self.code, self.path, self.reason = code, os.fspath(path), reason
        self.fix = fix or WRITE_CODES[code][1]
        super().__init__(err or 0, f"{reason}; {self.fix}")

    def __str__(self) -> str:
        return f"{self.code}: {self.path}: {self.reason}; {self.fix}"


def _kind(mode: int) -> str:
    return ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def _check_existing(path: str | os.PathLike[str], real: Path) -> int | None:
    """The mode of the existing regular file at ``real`` (None: nothing there); refuses anything else."""
    try:
        mode = os.stat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (the directory is checked next)
        return None
    except OSError as exc:
        raise WriteTargetError("write.not_writable", path, f"cannot inspect the target: {exc.strerror or exc}",
                               err=exc.errno) from None
    if stat.S_ISDIR(mode):
        raise WriteTargetError("write.is_directory", path, "is a directory",
                               f"give a file name inside it, e.g. {os.path.join(os.fspath(path), 'out.safetensors')}",
                               err=errno.EISDIR)
    if not stat.S_ISREG(mode):
        shown = f" (the link points at {real})" if os.fspath(real) != os.path.abspath(path) else ""
        raise WriteTargetError("write.not_regular", path, f"is {_kind(mode)}{shown}, not a regular file; it was "
                               "left as it is", err=errno.EEXIST)
    return mode


def check_target(path: str | os.PathLike[str]) -> Path:
    """The file to write for ``path`` (symlinks resolved), after checking it can be written safely.

    Raises :class:`WriteTargetError` (an ``OSError``) with the reason and the fix; creates nothing that stays.
    """
    try:
        real = Path(os.path.realpath(path))
    except (OSError, ValueError) as exc:
        raise WriteTargetError("write.no_directory", path, f"invalid path: {exc}", "pass a valid file path") from None
    _check_existing(path, real)
    parent = real.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise WriteTargetError("write.no_directory", path, f"directory {parent} {what}",
                               f"create it first (mkdir -p {parent}) or write somewhere else", err=errno.ENOENT)
    probe = parent / f".{real.name}.{secrets.token_hex(4)}.probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise WriteTargetError("write.not_writable", path, f"cannot create a file in directory {parent}: "
                               f"{exc.strerror or exc}", err=exc.errno) from None
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return real


def write_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Write a file through ``write(binary file object)`` safely (see the module docstring); returns the file
    written (the link's target for a symlink). Raises :class:`WriteTargetError` (an ``OSError``)."""
    real = check_target(path)
    old_mode = _check_existing(path, real)
    tmp = real.parent / f".{real.name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as exc:
        raise WriteTargetError("write.not_writable", path, f"cannot create a file in directory {real.parent}: "
                               f"{exc.strerror or exc}", err=exc.errno) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        if old_mode is not None:
            os.chmod(tmp, stat.S_IMODE(old_mode))
        _check_existing(path, real)          # swapped for a device or a directory meanwhile: still refused
        os.replace(tmp, real)
    except WriteTargetError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        full = {errno.ENOSPC, errno.EFBIG, errno.EIO, getattr(errno, "EDQUOT", errno.ENOSPC)}
        code = "write.failed" if exc.errno in full else "write.not_writable"
        raise WriteTargetError(code, path, f"cannot write: {exc.strerror or exc}", err=exc.errno) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return real


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` safely (see :func:`write_with`)."""
    return write_with(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` safely (see :func:`write_with`)."""
    return write_bytes(path, text.encode("utf-8"))
