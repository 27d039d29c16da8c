"""DSpark prefill kernels: the numpy reference backend (default) and pypto kernels for Ascend A2/A3.

The typed entry point is :func:`prefill`; :func:`attention` runs one layer's attention on the reference.
``dspark_kernels.model`` holds what both backends share (the batch plan, weights, caches, the layer, forward
and TP group); ``dspark_kernels.reference`` and ``dspark_kernels.pypto`` hold one module per stage.
"""

# ---- the typed prefill entry point
from dspark_kernels.api import PrefillResult, RequestOutput, prefill
from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.caches import LayerCaches, ModelCaches
from dspark_kernels.model.weights import ModelWeights

# ---- reference backend (numpy)
from dspark_kernels.reference.attention import attention

__all__ = ["AttentionWeights", "LayerCaches", "ModelCaches", "ModelWeights", "PrefillResult", "RequestOutput",
           "attention", "prefill"]
