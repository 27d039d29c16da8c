"""The command line: ``dspark-abi`` (:mod:`~dspark_abi.cli.main`; ``python -m dspark_abi.cli``), its file
commands (:mod:`~dspark_abi.cli.files`) and what it shares with the ``dspark`` program
(:mod:`~dspark_abi.cli.common`). Built on the core, :mod:`dspark_abi.io` and :mod:`dspark_abi.conformance`."""

from dspark_abi.cli.main import main

__all__ = ["main"]
