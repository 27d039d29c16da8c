"""pypto kernels for the prefill stages, targeting Ascend A2/A3 (``backend="pypto"``).

The stage modules mirror :mod:`dspark_kernels.reference` name for name (``lowering``, ``projections``,
``paged``, ``window``, ``compressor``, ``indexer``, ``entry_rows``, ``sparse_attention``, ``o_proj``,
``attention``); ``_ops`` holds what the kernels share. Importing this package does not import torch or pypto;
the kernel modules and ``runtime`` do. See ``docs/pypto.md``.
"""

from dspark_kernels.pypto.attention import PyptoAttention, attention_pypto
from dspark_kernels.pypto.errors import KernelOutputError, PyptoUnavailableError
from dspark_kernels.pypto.isolate import IsolatedCallError, run_isolated

__all__ = ["IsolatedCallError", "KernelOutputError", "PyptoAttention", "PyptoUnavailableError", "attention_pypto",
           "run_isolated"]
