"""pypto kernels for the prefill stages, targeting Ascend A2/A3 (``backend="pypto"``).

The stage modules mirror :mod:`dspark_kernels.reference` name for name (``lowering``, ``projections``,
``paged``, ``window``, ``compressor``, ``indexer``, ``entry_rows``, ``sparse_attention``, ``o_proj``,
``attention``, ``backend``); ``_ops`` holds what the kernels share. :class:`~dspark_kernels.pypto.backend.PyptoBackend`
is the backend the registry resolves ``"pypto"`` to. Importing this package does not import torch or pypto;
the kernel modules and ``runtime`` do. See ``docs/pypto.md``.
"""

import warnings
from typing import Any

from dspark_kernels.pypto.attention import attention_pypto
from dspark_kernels.pypto.backend import PyptoBackend
from dspark_kernels.pypto.errors import KernelOutputError, PyptoUnavailableError
from dspark_kernels.pypto.isolate import IsolatedCallError, run_isolated

__all__ = ["IsolatedCallError", "KernelOutputError", "PyptoBackend", "PyptoUnavailableError", "attention_pypto",
           "run_isolated"]


def __getattr__(name: str) -> Any:
    """``PyptoAttention`` (deprecated for one minor version): :class:`PyptoBackend`."""
    if name == "PyptoAttention":
        warnings.warn("dspark_kernels.pypto.PyptoAttention is deprecated: use dspark_kernels.pypto.PyptoBackend",
                      DeprecationWarning, stacklevel=2)
        return PyptoBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
