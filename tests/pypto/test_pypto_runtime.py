"""The pypto runtime's own guarantees: loud unwritten outputs, isolated crashes."""

import os

import pypto_cases
import pytest

from dspark_kernels.pypto.errors import KernelOutputError
from dspark_kernels.pypto.isolate import IsolatedCallError, run_isolated

pytestmark = pytest.mark.pypto


def _die() -> None:
    os._exit(1)  # what pypto does on some C++ errors


def test_dead_child_is_reported():
    with pytest.raises(IsolatedCallError, match="exited with code 1"):
        run_isolated(_die)


def test_unwritten_output_fails_loudly():
    with pytest.raises(KernelOutputError, match="128 of 256 elements unwritten"):
        run_isolated(pypto_cases.unwritten_output)
