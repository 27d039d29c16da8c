"""Shared paths and helpers of the spec tests (vectors directory, CLI runner, byte snapshots)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "spec" / "v1"
VECTORS = SPEC / "vectors"
#: The 1.0 vectors as released, frozen (never regenerated): today's reader must still judge them.
VECTORS_1_0 = SPEC / "vectors-1.0"


def index_entries() -> list[dict]:
    return json.loads((VECTORS / "index.json").read_text())["vectors"]


def entries_of(kind: str) -> list[dict]:
    return [e for e in index_entries() if e["file"].startswith(kind + "/")]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m dspark_abi.cli ARGS`` from the repository root, as a user would."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "dspark_abi.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def snapshot(path: Path) -> tuple[bytes, int]:
    """File bytes and modification time, to prove that reading changed nothing."""
    return path.read_bytes(), path.stat().st_mtime_ns


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    return VECTORS
