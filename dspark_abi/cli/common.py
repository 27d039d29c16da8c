"""What both command-line programs share (``dspark-abi`` here, ``dspark`` in dspark_kernels).

One-line errors (:class:`Parser`, :class:`UsageError`, :class:`CommandError`, :func:`run_cli`), the argument
types (:func:`parse_request`, :func:`int_in`, :func:`tp_size`), the output-path check run before any work
(:func:`check_output`) and :func:`printable`, which escapes text from files and paths before it is printed.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from dspark_abi.errors import ABIError
from dspark_abi.io import safe_write
from dspark_abi.policy import PaddingPolicy
from dspark_abi.presets import PRESETS


def printable(text: object) -> str:
    """``str(text)`` safe to print as part of one terminal line.

    Characters that are not printable (control characters such as ESC of ANSI sequences, line breaks,
    lone surrogates, which cannot even be encoded) are shown as Python escapes: ``\\x1b``, ``\\n``, ``\\ud800``.
    """
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in s)


class CommandError(Exception):
    """A failed run with a one-line reason (printed as ``prog: error: reason``): exit 1."""

    exit_code = 1


class UsageError(CommandError):
    """A command-line mistake found after parsing (e.g. an output directory that does not exist): exit 2."""

    exit_code = 2


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``prog: error: what is wrong (see prog --help)``.

    A value that starts with ``-`` and holds an ``@`` (``--request -1@0``) is taken as the option's value, so
    :func:`parse_request` can say what is wrong with it (argparse would say "expected one argument").
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # argparse takes an argument for a value (not an option) when this matches and no option looks like it
        self._negative_number_matcher = _NEGATIVE_VALUE

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {printable(message)} (see {self.prog} --help)\n")


#: Negative numbers (argparse's own rule) and anything with an '@' (a --request value such as -1@0).
_NEGATIVE_VALUE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-[^-=\s][^=\s]*@")

#: One line on each ``--config`` preset (dspark_abi.presets), shown by ``--help`` of both programs.
PRESET_SUMMARIES: dict[str, str] = {
    "flash": "DeepSeek-V4-Flash, 43 layers at its 1,048,576 positions (random weights are generated as the run "
             "streams them: about 12 minutes for a short request)",
    "flash-16k": "flash at the 16,384 positions upstream's a2a3 fixtures size their tables for",
    "flash-dspark": "flash whose layers 40-42 feed the DSpark drafter (target hidden features)",
    "demo": "upstream's DEMO: FLASH head sizes, 8 layers, 16 experts",
    "tiny": "a small model with every layer kind (SWA, CSA, HCA), 4 layers, 4,096 positions: runs in seconds",
    "tiny-1m": "tiny at the real 1,048,576-position depth (1M-position tables on any CPU)",
    "tiny-dspark": "tiny whose last three layers feed a drafter (target hidden features)",
}


def version_text(prog: str) -> str:
    """``PROG VERSION`` from the installed package metadata (the source tree's pyproject when not installed)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return f"{prog} {version('dspark')}"
    except PackageNotFoundError:
        return f"{prog} (version unknown: the package is not installed)"


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: print the program and package version, exit 0."""
    parser.add_argument("--version", action="version", version=version_text(parser.prog),
                        help="print the version of the installed dspark package and exit")


def parse_request(text: str) -> tuple[int, int]:
    """'TOKENS@CACHED' -> (new tokens, cached tokens), both non-negative integers (the order of the text)."""
    example = "TOKENS@CACHED, e.g. 3@126"
    parts = text.strip().split("@")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"request {text!r} must look like {example}")
    values = []
    for what, part in zip(("new tokens", "cached tokens"), parts, strict=True):
        part = part.strip()
        if not (part.isascii() and part.isdigit()):
            raise argparse.ArgumentTypeError(f"request {text!r}: {what} must be a non-negative integer, got "
                                             f"{part!r} ({example})")
        values.append(int(part))
    return values[0], values[1]


def int_in(text: str, lo: int, hi: int, what: str) -> int:
    """``text`` as an integer in ``[lo, hi]``, else :class:`argparse.ArgumentTypeError` naming ``what``."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"{what} must be an integer in [{lo}, {hi}], got {text!r}")
    return value


def tp_size(text: str) -> int:
    """--tp: PaddingPolicy's bounds on tp_size (a TP larger than the tokens is fine: idle ranks get padding)."""
    bounds = {k: getattr(m, k) for m in PaddingPolicy.model_fields["tp_size"].metadata for k in ("ge", "le")
              if hasattr(m, k)}
    return int_in(text, bounds["ge"], bounds["le"], "TP size")


def add_batch_arguments(parser: argparse.ArgumentParser, *, config_note: str = "") -> None:
    """The options both programs describe a packed batch with: ``--config``, ``--request`` (repeatable), ``--tp``
    (``config_note``: a sentence added to the help of ``--config``)."""
    presets = "; ".join(f"{name}: {PRESET_SUMMARIES[name]}" for name in PRESETS)
    parser.add_argument("--config", default="tiny", choices=list(PRESETS), metavar="PRESET",
                        help=f"model preset, one of {', '.join(PRESETS)} (default tiny). {presets}. "
                             f"{config_note}".strip())
    parser.add_argument("--request", action="append", type=parse_request, required=True, metavar="TOKENS@CACHED",
                        help="one request: new tokens @ already cached tokens (repeatable)")
    parser.add_argument("--tp", type=tp_size, default=1, help="TP group size, 1..64 (default 1)")


def check_output(option: str, path: str | None, example: str) -> None:
    """Refuse an output path that cannot be written, before any work is done (:class:`UsageError`).

    ``path`` must name a regular file or a new file (not a directory, device, FIFO or socket; a symlink is
    written through to its target; ``example`` is the file name suggested inside a directory) in an existing
    directory this process can create files in (:func:`dspark_abi.io.safe_write.check_target`).
    """
    if path is None:
        return
    try:
        safe_write.check_target(path)
    except safe_write.WriteTargetError as exc:
        fix = f"give a file name inside it, e.g. {printable(Path(path) / example)}" \
            if exc.code == "write.is_directory" else printable(exc.fix)
        raise UsageError(f"{option} {printable(path)}: {printable(exc.reason)}; {fix}") from None


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse and run the chosen subcommand (``args.func(args)``); returns the exit code instead of raising.

    Usage errors exit 2 (argparse's own, :class:`UsageError`), ABI errors and :class:`CommandError` exit 1,
    each as ``prog: error: ...`` on stderr (ABI errors: one line per issue); Ctrl-C exits 130.
    """
    if hasattr(signal, "SIGPIPE"):  # `dspark... | head` ends quietly, like other command-line tools
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error it already printed (2)
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    try:
        return int(args.func(args))
    except ABIError as exc:
        issues = [printable(i) for i in exc.issues]
        head = issues[0] if len(issues) == 1 else f"{len(issues)} ABI issues:"
        print("\n".join([f"{parser.prog}: error: {head}", *(f"  - {i}" for i in issues if len(issues) > 1)]),
              file=sys.stderr)
        return 1
    except CommandError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
