"""DSpark prefill kernels: the numpy reference backend (default) and pypto kernels for Ascend A2/A3.

The typed entry point is :func:`prefill`; :func:`attention` runs one layer's attention on the reference.
"""

# ---- the typed prefill entry point
from dspark_kernels.api import PrefillResult, RequestOutput, prefill
from dspark_kernels.model_caches import ModelCaches
from dspark_kernels.model_weights import ModelWeights

# ---- reference backend (numpy)
from dspark_kernels.reference import AttentionWeights, LayerCaches, attention

__all__ = ["AttentionWeights", "LayerCaches", "ModelCaches", "ModelWeights", "PrefillResult", "RequestOutput",
           "attention", "prefill"]
