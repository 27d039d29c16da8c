"""Write the field table of ``spec/v1/abi.md`` section 4.1 from :data:`dspark_abi.fields.FIELDS`
(``python -m dspark_abi.io.spec_table [SPEC] [--check]``).

The table between the markers :data:`~dspark_abi.fields.TABLE_BEGIN` and :data:`~dspark_abi.fields.TABLE_END` is
derived, never edited: ``--check`` exits 1 when the committed spec's table differs from a fresh generation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dspark_abi.fields import with_field_table

#: Where the spec lives in a source checkout.
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "spec" / "v1" / "abi.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_abi.io.spec_table", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH, help=f"default: {DEFAULT_PATH}")
    parser.add_argument("--check", action="store_true", help="exit 1 if the table differs from a fresh generation")
    args = parser.parse_args(argv)
    try:
        text = args.path.read_text()
        fresh = with_field_table(text)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if fresh != text:
            print(f"{args.path}: the field table is out of date; regenerate with: python -m dspark_abi.io.spec_table")
            return 1
        print(f"{args.path}: the field table is up to date")
        return 0
    if fresh != text:
        args.path.write_text(fresh)
    print(f"wrote the field table of {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
