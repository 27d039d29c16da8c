"""The wheel ships every package of the tree and the v1 spec (text, schema, conformance vectors)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_of_the_tree_is_listed():
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.glob("dspark_*/**/__init__.py")}
    listed = set(_setuptools()["packages"]) - set(_setuptools()["package-dir"])
    assert listed == tree, f"pyproject.toml [tool.setuptools] packages: missing {tree - listed}, stale {listed - tree}"


def test_the_shipped_spec_holds_the_vectors_and_the_schema():
    source = ROOT / _setuptools()["package-dir"]["dspark_abi.spec_v1"]
    patterns = _setuptools()["package-data"]["dspark_abi.spec_v1"]
    shipped = {p for pattern in patterns for p in source.glob(pattern)}
    vectors = set((source / "vectors").glob("*/*.safetensors"))
    assert vectors and vectors <= shipped
    assert {source / "abi.schema.json", source / "vectors" / "index.json"} <= shipped
