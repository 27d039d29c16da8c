"""DSpark prefill kernels: the numpy reference backend (default) and pypto kernels for Ascend A2/A3."""

# ---- reference backend (numpy)
from dspark_kernels.reference import AttentionWeights, LayerCaches, attention

__all__ = ["AttentionWeights", "LayerCaches", "attention"]
