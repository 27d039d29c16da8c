"""Rotary position embedding of DeepSeek-V4: interleaved pairs on the LAST ``qk_rope_head_dim`` dims.

Frequencies per layer kind:

* ``"swa"`` layers: ``omega_i = rope_theta ** (-2i / rd)``, no YaRN.
* ``"csa"`` / ``"hca"`` layers (q, window kv, compressed entries and the indexer alike):
  ``compress_rope_theta`` with the YaRN correction of ``config.rope_scaling``, applied whenever
  ``original_max_position_embeddings > 0`` (regardless of the sequence length), none otherwise.

Angles ``position * omega`` are computed in float32 at the positions a call needs (O(positions x rd/2), never
a table over all 1,048,576 positions). In ``"a2a3"`` precision cos/sin are bf16, as the kernels receive them;
in ``"deepseek"`` they stay float32, as the official ``precompute_freqs_cis`` (``torch.polar`` over fp32 angles)
builds them.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from dspark_abi.config import LayerKind, ModelConfig
from dspark_kernels.model.numerics import Precision, bf16_round


def inverse_frequencies(config: ModelConfig, kind: LayerKind) -> np.ndarray:
    """``omega`` [rd/2] float32 of a layer kind (YaRN-corrected on compressed layers when configured)."""
    rd = config.qk_rope_head_dim
    compressed = kind != "swa"
    theta = config.compress_rope_theta if compressed else config.rope_theta
    omega = (1.0 / (np.float32(theta) ** (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd)))).astype(np.float32)
    scaling = config.rope_scaling
    if not compressed or scaling is None or scaling.original_max_position_embeddings <= 0:
        return omega

    def correction_dim(rotations: float) -> float:
        # the pair index whose wavelength fits ``rotations`` times into the original context
        return rd * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), rd - 1)
    span = (high - low) if high != low else 0.001
    ramp = np.clip((np.arange(rd // 2, dtype=np.float32) - low) / np.float32(span), 0, 1)  # (rd/2,)
    result: np.ndarray = (omega / np.float32(scaling.factor) * ramp + omega * (1 - ramp)).astype(np.float32)
    return result


@lru_cache(maxsize=16)
def _omega(config: ModelConfig, kind: LayerKind) -> np.ndarray:
    omega = inverse_frequencies(config, kind)
    omega.flags.writeable = False
    return omega


def rope_at(config: ModelConfig, kind: LayerKind, positions: np.ndarray,
            precision: Precision = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [*positions.shape, rd/2] float32 of angles ``float32(p) * omega`` (bf16-valued in ``"a2a3"``).

    positions must lie in [0, max_position_embeddings); the caller validates them. Positions up to 2**24 are
    exact in float32, so the angle is the same float32 product a table row would hold.
    """
    angles = np.asarray(positions, dtype=np.int64).astype(np.float32)[..., None] * _omega(config, kind)
    cos, sin = np.cos(angles), np.sin(angles)
    return (bf16_round(cos), bf16_round(sin)) if precision == "a2a3" else (cos, sin)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, inverse: bool = False,
               out: np.ndarray | None = None) -> np.ndarray:
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x`` by interleaved pairs.

    x: [T, ..., dim] float32. cos, sin: [T, rd/2] float32 (broadcast over the middle axes of ``x``).
    Pair i = dims (dim - rd + 2i, dim - rd + 2i + 1) = (e, o):
    forward ``(e cos - o sin, e sin + o cos)``; inverse ``(e cos + o sin, o cos - e sin)``.
    Returns a new float32 array, or ``out`` (which may be ``x`` itself) filled with the result.
    """
    rd = 2 * cos.shape[-1]
    if out is None:
        out = np.array(x, dtype=np.float32, copy=True)
    elif out is not x:
        out[...] = x
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[-1],)   # (T, 1.., rd/2)
    c, s = cos.reshape(shape), sin.reshape(shape)
    even = x[..., -rd::2].copy()                                        # (T, ..., rd/2)
    odd = x[..., -rd + 1::2].copy()
    if inverse:
        s = -s
    out[..., -rd::2] = even * c - odd * s
    out[..., -rd + 1::2] = even * s + odd * c
    return out
