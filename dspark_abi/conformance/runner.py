"""Conformance runner: check a validator (this library, or any program) against the vectors' expectations.

The vectors directory holds ``index.json``: every file with its expected outcome (``valid``, or the exact
set of error codes). :func:`run` checks each file either in-process (this library) or by running an
external command per file (the protocol below) and returns one :class:`Row` per file.

External protocol (``--command "my-validator --json {path}"``): the command is split like a shell
command line (no shell is involved), ``{path}`` is replaced by the file's path (appended when absent),
and the program must print one JSON object on stdout,
``{"status": "valid" | "invalid" | "unreadable", "issues": [{"code": "<stable code>", ...}, ...]}``,
and exit 0 (valid), 1 (invalid) or 2 (unreadable). ``dspark-abi validate --json FILE`` speaks it.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import shlex
import subprocess
from pathlib import Path
from typing import Any, Literal

import attrs
from pydantic import ValidationError

from dspark_abi.errors import ABIError, Issue
from dspark_abi.io.fixtures import FixtureFile, read
from dspark_abi.io.manifest import Expectation
from dspark_abi.validation import Level

Status = Literal["valid", "invalid", "unreadable"]
EXIT_CODES: dict[str, int] = {"valid": 0, "invalid": 1, "unreadable": 2}
INDEX_NAME = "index.json"


@attrs.frozen
class FileResult:
    """Outcome of checking one file: status, every issue, and the format version when readable.

    Attributes:
        path: The file checked.
        status: 'valid', 'invalid' (readable, rules broken) or 'unreadable' (no fixture file).
        issues: Every issue: ``fixture.*`` ones when unreadable, else the validation's.
        format_version: The manifest's format version; None when unreadable.
    """

    path: str
    status: Status
    issues: tuple[Issue, ...]
    format_version: str | None = None

    @property
    def codes(self) -> set[str]:
        return {i.code for i in self.issues}

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "status": self.status, "ok": self.status == "valid",
                "format_version": self.format_version, "issues": [i.to_dict() for i in self.issues]}


def check_file(path: str | Path, level: Level = "full") -> FileResult:
    """Read (file level) and validate (ABI level) one fixture file; never raises for bad files."""
    return inspect_file(path, level)[0]


def inspect_file(path: str | Path, level: Level = "full") -> tuple[FileResult, FixtureFile | None]:
    """:func:`check_file`'s result and the file as read (None when unreadable), e.g. to show an invalid batch."""
    try:
        fixture = read(path)
    except ABIError as exc:
        return FileResult(str(path), "unreadable", exc.issues), None
    report = fixture.validate(level)
    result = FileResult(str(path), "valid" if report.ok else "invalid", report.issues, fixture.manifest.format_version)
    return result, fixture


def _package_root() -> Path:
    return Path(str(importlib.resources.files("dspark_abi")))


def default_vectors_dir() -> Path | None:
    """The conformance vectors installed with the package, else those of a source checkout, else None.

    Looked up in order: ``dspark_abi/spec_v1/vectors`` inside the installed package (a wheel ships ``spec/v1``
    there, see ``pyproject.toml``), then ``spec/v1/vectors`` next to the package directory (a checkout).
    """
    root = _package_root()
    for candidate in (root / "spec_v1" / "vectors", root.parent / "spec" / "v1" / "vectors"):
        if (candidate / INDEX_NAME).is_file():
            return candidate
    return None


@attrs.frozen
class Row:
    """One line of the conformance table.

    Attributes:
        file: The vector, relative to the vectors directory.
        expected: Expected codes; empty = valid.
        actual: Codes reported; None when no usable answer came back.
        passed: True when the answer matches the expectation.
        detail: Why it did not pass (empty when it did).
    """

    file: str
    expected: tuple[str, ...]
    actual: tuple[str, ...] | None
    passed: bool
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "expected": list(self.expected), "actual": None if self.actual is None
                else list(self.actual), "passed": self.passed, "detail": self.detail}


def load_index(directory: str | Path) -> list[dict[str, Any]]:
    """Entries of ``index.json`` (raises ValueError naming the problem when it is unusable)."""
    path = Path(directory) / INDEX_NAME
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the vector index ({exc})") from None
    entries = doc.get("vectors") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: 'vectors' must be a list")
    return entries


def run(directory: str | Path, *, command: str | None = None, timeout: float = 60.0) -> list[Row]:
    """Check every vector listed in ``directory/index.json``; files not listed there fail too."""
    root = Path(directory)
    rows, listed = [], set()
    for entry in load_index(root):
        try:
            rel = str(entry["file"])
            expected = Expectation.model_validate_json(json.dumps(entry["expected"]))
        except (KeyError, TypeError, ValidationError) as exc:
            raise ValueError(f"{root / INDEX_NAME}: bad entry {entry!r:.120}: {exc}") from None
        listed.add(rel)
        rows.append(_check_entry(root, rel, expected, entry.get("sha256"), command, timeout))
    for path in sorted(root.rglob("*.safetensors")):
        rel = path.relative_to(root).as_posix()
        if rel not in listed:
            rows.append(Row(rel, (), None, False, f"not listed in {INDEX_NAME}"))
    return rows


def _check_entry(root: Path, rel: str, expected: Expectation, sha256: str | None, command: str | None,
                 timeout: float) -> Row:
    path = root / rel
    want = expected.codes
    if not path.is_file():
        return Row(rel, want, None, False, "file missing")
    if sha256 is not None and hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        return Row(rel, want, None, False, "sha256 differs from the index (regenerate the vectors)")
    answer = _run_internal(path, expected) if command is None else _run_external(command, path, timeout)
    if isinstance(answer, str):
        return Row(rel, want, None, False, answer)
    status, codes = answer
    detail = ""
    if set(codes) != set(want):
        detail = "codes differ"
    elif (status == "valid") != expected.valid:
        detail = f"status {status!r} contradicts the expectation"
    elif status == "unreadable" and not all(c.startswith("fixture.") for c in codes):
        detail = "unreadable, but the codes are not fixture.* codes"
    return Row(rel, want, codes, not detail, detail)


def _run_internal(path: Path, expected: Expectation) -> tuple[Status, tuple[str, ...]] | str:
    """(status, sorted codes) from this library; a readable file's manifest must agree with the index."""
    try:
        fixture = read(path)
    except ABIError as exc:
        return "unreadable", tuple(sorted(exc.codes))
    if fixture.manifest.expected != expected:
        return "manifest expectation differs from the index"
    report = fixture.validate()
    return ("valid" if report.ok else "invalid"), tuple(sorted(report.codes))


def _run_external(command: str, path: Path, timeout: float) -> tuple[Status, tuple[str, ...]] | str:
    """(status, sorted codes) from the external command, or a string saying what went wrong."""
    args = shlex.split(command)
    args = [a.replace("{path}", str(path)) for a in args] if "{path}" in command else [*args, str(path)]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"command failed to run: {exc}"
    try:
        doc = json.loads(proc.stdout)
        status = doc["status"]
        codes = tuple(sorted({str(i["code"]) for i in doc["issues"]}))
    except (ValueError, KeyError, TypeError) as exc:
        return f"stdout is not a protocol JSON object ({type(exc).__name__}: {exc}); stderr: {proc.stderr[-200:]}"
    if status not in EXIT_CODES:
        return f"unknown status {status!r}"
    if proc.returncode != EXIT_CODES[status]:
        return f"exit code {proc.returncode} does not match status {status!r} (expected {EXIT_CODES[status]})"
    return status, codes
