"""`dspark`: the command line of the kernels (``dspark prefill``; entry point ``dspark_kernels.cli:main``).

:mod:`~dspark_kernels.cli.app` runs the command (parser, run, one-line errors), :mod:`~dspark_kernels.cli.checks`
checks and loads everything first, :mod:`~dspark_kernels.cli.progress` shows the layers. The helpers both
programs share (one-line parser, ``UsageError``, output checks) are in :mod:`dspark_abi.cli.common`.
"""

from dspark_kernels.cli.app import main, make_parser

__all__ = ["main", "make_parser"]
