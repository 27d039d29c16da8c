"""Run pypto work in a fresh Python process and get numpy results back.

pypto 0.2.0 leaks about 23 MB per kernel call and some of its errors end the whole process with exit
code 1 and no Python exception (missing g++, some C++ worker-thread failures). :func:`run_isolated`
runs one importable function in a child process (``python -m dspark_kernels.pypto.isolate``), returns
its pickled result, re-raises its exception, and turns a dead child into :class:`IsolatedCallError`
carrying the tail of the child's output. Importing this module does not import torch or pypto.
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Repository root (the child must import dspark_kernels from the same tree as the parent).
_REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 900.0
_LOG_TAIL_LINES = 60


class IsolatedCallError(RuntimeError):
    """The child process died, timed out, or raised an exception that could not be sent back."""


def run_isolated(func: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> Any:
    """Call ``func(*args, **kwargs)`` in a new process; ``func`` must be a module-level function.

    Arguments and the result travel by pickle (numpy arrays, attrs objects, plain data). An exception
    raised by ``func`` is re-raised here with the child's traceback attached as a note.
    """
    module, name = func.__module__, func.__qualname__
    if module == "__main__" or "<locals>" in name:
        raise ValueError(f"run_isolated needs an importable module-level function, got {module}.{name}")
    with tempfile.TemporaryDirectory(prefix="dspark-isolate-") as tmp:
        request, reply, log = Path(tmp, "request.pkl"), Path(tmp, "reply.pkl"), Path(tmp, "child.log")
        request.write_bytes(pickle.dumps((module, name, args, kwargs)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*_search_path(module), env.get("PYTHONPATH", "")) if p)
        with open(log, "wb") as sink:
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "dspark_kernels.pypto.isolate", str(request), str(reply)],
                    stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp, env=env,
                    timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                raise IsolatedCallError(f"{module}.{name} timed out after {timeout:.0f} s\n{_tail(log)}") from None
        if not reply.exists():
            raise IsolatedCallError(
                f"{module}.{name}: child process exited with code {proc.returncode} without a result "
                f"(pypto ends the process on some C++ errors); last output lines:\n{_tail(log)}")
        ok, payload = pickle.loads(reply.read_bytes())
    if ok:
        return payload
    exc, child_traceback = payload
    if isinstance(exc, BaseException):
        exc.add_note(f"raised in the isolated child process:\n{child_traceback}")
        raise exc
    raise IsolatedCallError(f"{module}.{name} raised in the child process:\n{child_traceback}")


def _search_path(module: str) -> tuple[str, ...]:
    """The repository root, the folder of a top-level module (a test helper pytest imported by path), and every
    folder inside the repository on the parent's ``sys.path`` (what that module imports by path in turn, e.g. a
    shared ``tests/tolerances.py``)."""
    paths = [str(_REPO_ROOT)]
    file = getattr(sys.modules.get(module), "__file__", None)
    if "." not in module and file:
        paths.insert(0, str(Path(file).resolve().parent))
    for entry in sys.path:
        folder = Path(entry or ".").resolve()
        if folder.is_relative_to(_REPO_ROOT) and str(folder) not in paths:
            paths.append(str(folder))
    return tuple(paths)


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _child(request: Path, reply: Path) -> None:
    module, name, args, kwargs = pickle.loads(request.read_bytes())
    try:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        result: tuple[bool, Any] = (True, target(*args, **kwargs))
    except Exception as exc:  # every failure is reported to the parent
        text = traceback.format_exc()
        result = (False, (exc if _portable(exc) else None, text))
    reply.write_bytes(pickle.dumps(result))


def _portable(exc: BaseException) -> bool:
    """Re-raise in the parent only builtin and dspark exceptions that survive a pickle round trip.

    Others (pypto's parser errors, for example) would import pypto into the parent, or fail to unpickle;
    they arrive as IsolatedCallError with the child's traceback.
    """
    if type(exc).__module__.split(".")[0] not in ("builtins", "dspark_abi", "dspark_kernels"):
        return False
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return True


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
