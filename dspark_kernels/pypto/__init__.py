"""pypto kernels for the prefill stages, targeting Ascend A2/A3 (``backend="pypto"``).

Importing this package does not import torch or pypto; the kernel modules (``lowering``, ``projections``,
``paged``, ``compressor``, ``indexer``, ``sparse_attention``, ``o_proj``) and ``runtime`` do.
See ``docs/pypto.md``.
"""

from dspark_kernels.pypto.attention import attention_pypto
from dspark_kernels.pypto.errors import KernelOutputError, PyptoUnavailableError
from dspark_kernels.pypto.isolate import IsolatedCallError, run_isolated

__all__ = ["IsolatedCallError", "KernelOutputError", "PyptoUnavailableError", "attention_pypto", "run_isolated"]
