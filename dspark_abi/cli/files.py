"""File subcommands of the ``dspark-abi`` CLI: ``validate FILE...`` and ``conformance [DIR]``.

``add_file_commands(subparsers)`` registers both on an argparse parser; each sets ``func`` (args -> exit
code). ``dspark-abi`` (:mod:`dspark_abi.cli.main`) registers them.

validate: exit 0 when every file is valid, 1 when one is invalid, 2 when one cannot be read (the
highest wins). ``--json`` prints one JSON object per file, one per line (the conformance protocol).
Files are opened read-only and never modified. Text output escapes every string that comes from a file
or a path (tensor names, messages, values): a name cannot move the cursor, clear the screen or break a line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dspark_abi.cli.common import UsageError, printable
from dspark_abi.conformance.runner import FileResult, Row, check_file, default_vectors_dir, run

__all__ = ["add_file_commands", "cmd_conformance", "cmd_validate", "format_table", "print_result"]


def add_file_commands(subparsers: Any) -> None:
    """Register ``validate`` and ``conformance`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    v = subparsers.add_parser("validate", help="validate fixture files against the ABI (exit 0/1/2)",
                              description="Validate fixture files: exit 0 valid, 1 invalid, 2 unreadable.")
    v.add_argument("files", nargs="+", metavar="FILE", help="safetensors fixture files")
    v.add_argument("--json", action="store_true", help="print one JSON object per file (one per line)")
    v.add_argument("--level", choices=("shape", "full"), default="full",
                   help="'shape': presence, dtypes, shapes, query_start_loc only; 'full' (default): every rule")
    v.set_defaults(func=cmd_validate)

    c = subparsers.add_parser("conformance", help="run the conformance vectors and print a pass/fail table",
                              description="Check every vector listed in DIR/index.json (default: the vectors "
                                          "installed with dspark_abi); exit 1 on any failure.")
    c.add_argument("directory", metavar="DIR", nargs="?", default=None,
                   help="vectors directory, e.g. spec/v1/vectors (default: the vectors shipped with the package)")
    c.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    c.add_argument("--command", metavar="CMD", default=None,
                   help="check another implementation: run CMD per file ('{path}' is replaced by the file); it "
                        "must print {\"status\": ..., \"issues\": [{\"code\": ...}]} and exit 0/1/2")
    c.add_argument("--timeout", type=float, default=60.0, help="seconds per external command (default 60)")
    c.set_defaults(func=cmd_conformance)


def _value(v: Any) -> str:
    return printable("-" if v is None else json.dumps(v) if not isinstance(v, str) else v)


def print_result(result: FileResult) -> None:
    """The text form of one file's result: ``PATH: status (n issues)``, then two lines per issue."""
    n = len(result.issues)
    print(f"{printable(result.path)}: {result.status}" + (f" ({n} issue{'s' if n != 1 else ''})" if n else ""))
    for i in result.issues:
        d = i.to_dict()
        print(f"  {i.code}  field={printable(i.field)}  index={_value(d['index'])}  request={_value(d['request'])}  "
              f"expected={_value(d['expected'])}  actual={_value(d['actual'])}  count={i.count}")
        print(f"      {printable(i.message)}. Fix: {printable(i.hint)}")


def format_table(rows: list[Row]) -> str:
    """Fixed-width pass/fail table of conformance rows with a summary line."""
    width = max([len(printable(r.file)) for r in rows] + [6])

    def show(codes: tuple[str, ...] | None) -> str:
        return "-" if codes is None else printable(", ".join(codes) or "valid")

    lines = [f"{'RESULT':6}  {'VECTOR':{width}}  {'EXPECTED':32}  ACTUAL"]
    for r in rows:  # file names, codes and details come from index.json or another program: escaped
        tail = f"  ({printable(r.detail)})" if r.detail else ""
        lines.append(f"{'pass' if r.passed else 'FAIL':6}  {printable(r.file):{width}}  {show(r.expected):32}  "
                     f"{show(r.actual)}{tail}")
    failed = sum(not r.passed for r in rows)
    lines.append(f"{len(rows)} vectors: {len(rows) - failed} passed, {failed} failed")
    return "\n".join(lines)


def cmd_validate(args: argparse.Namespace) -> int:
    worst = 0
    for path in args.files:
        result = check_file(path, args.level)
        if args.json:
            print(json.dumps(result.to_dict(), sort_keys=True))
        else:
            print_result(result)
        worst = max(worst, result.exit_code)
    return worst


def cmd_conformance(args: argparse.Namespace) -> int:
    directory = args.directory if args.directory is not None else default_vectors_dir()
    if directory is None:
        raise UsageError("this installation ships no conformance vectors; pass the vectors directory: dspark-abi "
                         "conformance DIR (e.g. spec/v1/vectors of a dspark checkout)")
    try:
        rows = run(directory, command=args.command, timeout=args.timeout)
    except ValueError as exc:  # printed as 'dspark-abi: error: ...', exit 2, like every usage error
        raise UsageError(printable(exc)) from None
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=1))
    else:
        print(format_table(rows))
    return 0 if rows and all(r.passed for r in rows) else 1
