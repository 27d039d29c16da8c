"""The quantisers of precision ``"deepseek"``: what DeepSeek's official inference adds at run time to its bf16
activations (the bf16 points themselves are :func:`~dspark_kernels.model.numerics.narrow`; the list of every
point is the :mod:`~dspark_kernels.model.numerics` docstring).

Source: DeepSeek's first V4-Flash ``inference/model.py`` and ``inference/kernel.py`` (byte copy: GitHub
Mockingjay1316/deepseek-v4-flash-spark, commit 0825add; ``docs/checkpoints.md`` section 4 cites the later
release). The fake quantisers are :mod:`dspark_kernels.model.quant`'s; this module fixes which one runs where:

* :func:`linear` -- ``model.py`` ``linear()``: a weight **stored** FP8 or FP4 (its dtype as loaded; the official
  ``Linear`` dispatches on ``weight.dtype``) gets its input quantised to e4m3 per 1x128 block (power-of-two scale,
  ``act_quant(x, 128, "ue8m0")``) and an FP8 / FP4 GEMM with fp32 accumulation and a bf16 output; any other
  (bf16) Linear is a bf16 ``F.linear``: a checkpoint converted to bf16 runs without activation quantisation.
  Which Linears of a layer take the FP8 path is :func:`fp8_inputs` of the weights as loaded
  (``AttentionWeights.fp8_stored`` / ``MoEWeights.fp8_stored``), never the shipped-format table. dspark multiplies the
  dequantised activations with the weights as given: a real checkpoint's dequantised weight values times the
  power-of-two activation scales are the GEMM's products, so the result equals the FP8 / FP4 GEMM up to fp32
  summation order (the kernel adds per-K-block partial products scaled in fp32; here one BLAS product).
* :func:`kv_fake_quant` -- the in-place ``act_quant(kv[..., :-rd], 64, "ue8m0", inplace=True)`` of window and
  compressed KV, in the release :data:`KV_RELEASE`.
* :func:`index_fake_quant` -- ``rotate_activation`` (Hadamard, bf16 out) then the in-place
  ``fp4_act_quant(x, 32)`` of the indexer queries and compressed keys (the same in both releases).
* :func:`head_rms` -- the per-head query RMS, which ``Attention.forward`` computes with bf16 tensor ops.

The official kernels assert that K is a multiple of the block; dspark also accepts a ragged last block (zero
padding, which changes no block maximum), as TINY's ``q_lora_rank`` of 64 needs. FLASH has no ragged block.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from dspark_abi.presets import FLASH
from dspark_kernels.model import quant
from dspark_kernels.model.checkpoint_format import QuantFormat, block_formats
from dspark_kernels.model.numerics import bf16_round
from dspark_kernels.model.numerics import linear as _product

#: The release whose in-place FP8 KV fake quant precision ``"deepseek"`` follows. ``"v4.1-flash"`` rounds the 448
#: non-RoPE dims to e4m3 (the technical report's FP8 KV); in the first V4-Flash release (``"v4-flash"``) the step
#: writes back through bf16 and is an identity on bf16 values, so that release is this mode without the KV
#: rounding. Used by :func:`kv_fake_quant` only.
KV_RELEASE: quant.Release = "v4.1-flash"

#: Block-relative names of tensors the checkpoint ships FP8 that the official inference does not run as FP8
#: GEMMs: ``convert.py`` dequantises ``wo_a`` into bf16 and ``Attention.forward`` uses a bf16 einsum.
DEQUANTISED_AT_CONVERSION = frozenset({"attn.wo_a"})

_EXPERT = re.compile(r"\.experts\.\d+\.")


def _block_name(name: str) -> str:
    """``ffn.experts.7.w1.weight`` -> ``ffn.experts.w1``; ``attn.wq_a.weight`` -> ``attn.wq_a``."""
    return _EXPERT.sub(".experts.", name).removesuffix(".weight")


@lru_cache(maxsize=1)
def _projection_kinds() -> dict[str, str]:
    """Block-relative name -> shipped kind of every 2-D projection of a CSA block of the official checkpoint
    (:func:`~dspark_kernels.model.checkpoint_format.block_formats`, the one home of the table)."""
    formats = block_formats(FLASH, QuantFormat(quantized=True), "", ratio=4, hash_routed=False)
    return {_block_name(f.name): f.kind for f in formats if f.name.endswith(".weight") and len(f.shape) == 2}


@lru_cache(maxsize=1)
def fp8_gemm_weights() -> frozenset[str]:
    """Block-relative names (``attn.wq_a``, ``ffn.experts.w1``, ...) of the Linears whose inputs the official
    inference quantises when run on the checkpoint **as shipped**: every projection shipped ``fp8_block`` or
    ``fp4_block``, except :data:`DEQUANTISED_AT_CONVERSION`. What a run quantises follows the weights it loaded
    (:func:`fp8_inputs`); this is the set for the shipped FP8 / FP4 checkpoint."""
    shipped = {n for n, kind in _projection_kinds().items() if kind in ("fp8_block", "fp4_block")}
    return frozenset(shipped - DEQUANTISED_AT_CONVERSION)


def fp8_inputs(stored: frozenset[str] | set[str], prefix: str) -> frozenset[str]:
    """The Linears whose input the official ``linear()`` quantises, given the names of the weights stored FP8 /
    FP4 as loaded: ``stored`` relative names (``wq_a.weight``, ``experts.w1``) under ``prefix`` (``attn.`` /
    ``ffn.``) -> block-relative names (``attn.wq_a``), minus :data:`DEQUANTISED_AT_CONVERSION` (``convert.py``
    dequantises ``wo_a`` before the model loads it)."""
    names = {prefix + _block_name(n) for n in stored}
    return frozenset(names - DEQUANTISED_AT_CONVERSION)


def _on_padded(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, block: int) -> np.ndarray:
    """``fn`` over the last axis zero-padded to a multiple of ``block``, cut back to its length."""
    k = x.shape[-1]
    pad = -k % block
    if not pad:
        return fn(x)
    wide = np.concatenate([x, np.zeros((*x.shape[:-1], pad), dtype=np.float32)], axis=-1)
    return fn(wide)[..., :k]


def act_quant(x: np.ndarray, block: int = quant.GEMM_ACT_BLOCK) -> np.ndarray:
    """The FP8 GEMMs' input: x [..., K] float32 -> its e4m3 values times their power-of-two block scales
    (1 x ``block`` along K, floor 1e-4; :func:`~dspark_kernels.model.quant.fp8_gemm_act_quant`), float32 (exact)."""
    def quantise(v: np.ndarray) -> np.ndarray:
        q, s = quant.fp8_act_quant(v, block)
        result: np.ndarray = q.astype(np.float32) * np.repeat(s, block, axis=-1)
        return result
    return _on_padded(quantise, np.asarray(x, dtype=np.float32), block)


def linear(x: np.ndarray, w: np.ndarray, name: str, fp8: frozenset[str]) -> np.ndarray:
    """The official ``Linear`` of checkpoint tensor ``name`` (block-relative, e.g. ``attn.wq_b``): x [M, K],
    w [N, K] -> bf16 values [M, N] float32. ``fp8``: the layer's Linears whose weight is stored FP8 / FP4
    (:func:`fp8_inputs`); x is quantised first exactly when ``name`` is one of them.

    Raises ValueError for a name that is not a projection of the checkpoint table.
    """
    kinds = _projection_kinds()
    if name not in kinds:
        raise ValueError(f"{name!r} is not a projection of the DeepSeek-V4 checkpoint table")
    a = act_quant(x) if name in fp8 else x
    return bf16_round(_product(a, w))


def kv_fake_quant(kv: np.ndarray, rope_dim: int) -> np.ndarray:
    """Window or compressed KV [..., D] (bf16 values, RoPE applied) -> the non-RoPE dims ``[:D - rope_dim]`` FP8
    fake-quantised in blocks of 64 as release :data:`KV_RELEASE` does; the RoPE dims unchanged. float32."""
    nope = kv.shape[-1] - rope_dim
    part = _on_padded(lambda v: quant.fp8_act_fake_quant(v, quant.KV_ACT_BLOCK, release=KV_RELEASE),
                      np.asarray(kv[..., :nope], dtype=np.float32), quant.KV_ACT_BLOCK)
    return np.concatenate([part, kv[..., nope:]], axis=-1).astype(np.float32, copy=False)


def index_fake_quant(x: np.ndarray) -> np.ndarray:
    """Indexer q or compressed key [..., dI] (bf16 values, RoPE applied) -> Hadamard-rotated (Sylvester order,
    ``dI**-0.5``, rounded to bf16) and FP4 e2m1 fake-quantised in blocks of 32 (power-of-two scales). float32."""
    rotated = bf16_round(quant.hadamard_rotate(x))
    return _on_padded(lambda v: quant.fp4_act_fake_quant(v, quant.FP4_BLOCK), rotated, quant.FP4_BLOCK)


def head_rms(q: np.ndarray, eps: float) -> np.ndarray:
    """``q * rsqrt(mean(q**2) + eps)`` per head as bf16 tensor ops: q [..., D] bf16 values -> bf16 values.

    Each op rounds its result to bf16 (fp32 arithmetic inside, as torch does): the squares, their mean (fp32
    accumulation), ``+ eps``, the rsqrt and the product.
    """
    sq = bf16_round(q * q)
    mean = bf16_round(sq.mean(axis=-1, keepdims=True, dtype=np.float32))
    inv = bf16_round(np.float32(1.0) / np.sqrt(bf16_round(mean + np.float32(eps))))
    return bf16_round(q * inv)
