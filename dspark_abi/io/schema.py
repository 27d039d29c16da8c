"""Generate ``spec/v1/abi.schema.json`` from the pydantic models (``python -m dspark_abi.io.schema [--check]``).

The schema describes the fixture manifest (:class:`~dspark_abi.io.manifest.FixtureManifest`) and, through
its ``$defs``, the model configuration (``ModelConfig``), padding policy, pool block counts and the
conformance expectation; ``x-dspark-fields`` carries the ABI's field declarations (:mod:`dspark_abi.fields`).
It is derived, never edited: ``--check`` exits 1 when the committed file differs from a fresh generation.
The output depends on the installed pydantic version.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dspark_abi.fields import FIELDS, PERSISTENT_FIELDS
from dspark_abi.io.manifest import FORMAT_VERSION, FixtureManifest

#: Where the schema lives in a source checkout.
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "spec" / "v1" / "abi.schema.json"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def build_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a fixture manifest, with every nested model in ``$defs``.

    ``x-dspark-fields`` lists the declaration of every ABI field (:data:`dspark_abi.fields.FIELDS`: tensor name,
    dtype, symbolic shape, padding, scope, required, since); ``tensors`` admits exactly their names and
    ``extra.``-prefixed ones. ``x-dspark-persistent-fields`` lists those a persistent step (spec 5.9) carries
    instead of the block tables (:data:`dspark_abi.fields.PERSISTENT_FIELDS`).
    """
    schema = FixtureManifest.model_json_schema(mode="validation")
    return {"$schema": JSON_SCHEMA_DIALECT, "x-dspark-format-version": FORMAT_VERSION,
            "x-dspark-fields": [f.as_json() for f in FIELDS],
            "x-dspark-persistent-fields": [f.as_json() for f in PERSISTENT_FIELDS], **schema}


def render() -> str:
    """Canonical text of the schema file (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(build_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_abi.io.schema", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH, help=f"default: {DEFAULT_PATH}")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from a fresh generation")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text() if args.path.is_file() else None
        if current != text:
            print(f"{args.path} is out of date; regenerate with: python -m dspark_abi.io.schema {args.path}")
            return 1
        print(f"{args.path} is up to date")
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
