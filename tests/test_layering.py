"""The layering contracts of pyproject.toml [tool.importlinter] hold (the ABI never imports the kernels, the
reference never imports torch or pypto, pypto never imports the reference, directly or through another module,
the model layer and the API import neither backend, nothing imports a CLI)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_layering_contracts_are_kept():
    run = subprocess.run([sys.executable, "-c", LINT, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout
