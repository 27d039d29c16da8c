"""Vectorized numpy reference backend of every DSpark prefill attention stage (the definition other
backends are checked against). See ``docs/kernels.md``."""

from dspark_kernels.reference.attention import attention
from dspark_kernels.reference.caches import LayerCaches
from dspark_kernels.reference.numerics import PRECISIONS, Precision
from dspark_kernels.reference.weights import AttentionWeights

__all__ = ["PRECISIONS", "AttentionWeights", "LayerCaches", "Precision", "attention"]
