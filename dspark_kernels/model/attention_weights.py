"""One attention layer's weights by DeepSeek-V4 checkpoint names (`AttentionWeights`), validated and held
read-only as float32. The whole model's weights are in :mod:`dspark_kernels.model.weights`.

## AttentionWeights

Shapes (H heads, D head_dim, G o_groups, Ro o_lora_rank, Q q_lora_rank, X hidden_size, m ratio,
coff = 2 for ratio 4 and 1 for ratio 128, HI/dI indexer heads/dim):

=============================================  ============================  ===============
name (under ``layers.{i}.attn.``)               shape                         layer kinds
=============================================  ============================  ===============
``wq_a.weight`` / ``q_norm.weight``             [Q, X] / [Q]                  all
``wq_b.weight``                                 [H*D, Q]                      all
``wkv.weight`` / ``kv_norm.weight``             [D, X] / [D]                  all
``wo_a.weight`` / ``wo_b.weight``               [G*Ro, H*D/G] / [X, G*Ro]     all
``attn_sink``                                   [H]                           all
``compressor.{wkv,wgate}.weight``               [coff*D, X]                   csa, hca
``compressor.ape`` / ``compressor.norm.weight`` [m, coff*D] / [D]             csa, hca
``indexer.wq_b.weight``                         [HI*dI, Q]                    csa
``indexer.weights_proj.weight``                 [HI, X]                       csa
``indexer.compressor.{wkv,wgate}.weight``       [2*dI, X]                     csa
``indexer.compressor.ape`` / ``.norm.weight``   [4, 2*dI] / [dI]              csa
=============================================  ============================  ===============

Tensors are accepted as float16, bfloat16, float32 or float64 and held as read-only float32.
Quantised checkpoint tensors arrive dequantised from :class:`~dspark_kernels.model.shard_index.ShardIndex`
(W8A8 ones also as :attr:`AttentionWeights.stored_int8`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs
import ml_dtypes
import numpy as np

from dspark_abi import ABIError, Issue, ModelConfig
from dspark_abi.config import LayerKind
from dspark_kernels.model import quant
from dspark_kernels.model.deepseek_numerics import fp8_gemm_weights
from dspark_kernels.model.geometry import INDEX_RATIO
from dspark_kernels.model.geometry import coff as compressor_coff

#: Float dtypes a checkpoint tensor may have (computed with as float32), and the integer ones (``tid2eid``).
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int32", "int64")
_FLOAT_NP_DTYPES = tuple(np.dtype(ml_dtypes.bfloat16) if n == "bfloat16" else np.dtype(n) for n in FLOAT_DTYPES)


#: How :meth:`AttentionWeights.random` stores its projections: ``"float"`` or in the checkpoint's ``"shipped"``
#: FP8 formats.
StoredAs = Literal["float", "shipped"]


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, dtype=np.float32, copy=True, order="C")
    out.flags.writeable = False
    return out


@attrs.frozen(eq=False)
class CompressorWeights:
    """One compressor (ratio m, output dim d): ``wkv``, ``wgate`` [coff*d, X], ``ape`` [m, coff*d], ``norm`` [d]."""

    wkv: np.ndarray
    wgate: np.ndarray
    ape: np.ndarray
    norm: np.ndarray

    @property
    def ratio(self) -> int:
        return int(self.ape.shape[0])

    @property
    def dim(self) -> int:
        return int(self.norm.shape[0])


@attrs.frozen(eq=False)
class IndexerWeights:
    """Lightning indexer: ``wq_b`` [HI*dI, Q], ``weights_proj`` [HI, X] and its ratio-4 compressor at dI."""

    wq_b: np.ndarray
    weights_proj: np.ndarray
    compressor: CompressorWeights


def expected_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint name (relative to ``layers.{layer}.attn.``) -> shape, for this layer's kind."""
    c = config
    x, d, h, g = c.hidden_size, c.head_dim, c.num_attention_heads, c.o_groups
    shapes: dict[str, tuple[int, ...]] = {
        "wq_a.weight": (c.q_lora_rank, x), "q_norm.weight": (c.q_lora_rank,),
        "wq_b.weight": (h * d, c.q_lora_rank),
        "wkv.weight": (d, x), "kv_norm.weight": (d,),
        "wo_a.weight": (g * c.o_lora_rank, h * d // g), "wo_b.weight": (x, g * c.o_lora_rank),
        "attn_sink": (h,),
    }
    kind = c.layer_kind(layer)
    if kind != "swa":
        ratio = c.compress_ratios[layer]
        coff = compressor_coff(ratio)
        shapes |= {"compressor.wkv.weight": (coff * d, x), "compressor.wgate.weight": (coff * d, x),
                   "compressor.ape": (ratio, coff * d), "compressor.norm.weight": (d,)}
    if kind == "csa":
        hi, di = c.index_n_heads, c.index_head_dim
        shapes |= {"indexer.wq_b.weight": (hi * di, c.q_lora_rank), "indexer.weights_proj.weight": (hi, x),
                   "indexer.compressor.wkv.weight": (2 * di, x), "indexer.compressor.wgate.weight": (2 * di, x),
                   "indexer.compressor.ape": (INDEX_RATIO, 2 * di), "indexer.compressor.norm.weight": (di,)}
    return shapes


@attrs.frozen(eq=False)
class AttentionWeights:
    """Validated float32 weights of attention layer ``layer`` of ``config`` (see the module table).

    Build with :meth:`from_tensors` (checkpoint mapping) or :meth:`random`. Arrays are read-only.
    The arrays a precision computes with come from :func:`~dspark_kernels.model.prepared.prepare_weights`
    (cached by the caller, :class:`~dspark_kernels.model.prepared.PreparedWeightsCache`).
    """

    config: ModelConfig
    layer: int
    wq_a: np.ndarray
    q_norm: np.ndarray
    wq_b: np.ndarray
    wkv: np.ndarray
    kv_norm: np.ndarray
    wo_a: np.ndarray
    wo_b: np.ndarray
    attn_sink: np.ndarray
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None
    stored_int8: Mapping[str, tuple[np.ndarray, np.ndarray]] = attrs.field(factory=dict)
    """Projections the checkpoint stores as int8 + per-channel scale (W8A8), by relative name (``"wq_b.weight"``):
    (q [out, in] float32 integers, scale [out] float32), equal to the float array times the scale. The a2a3
    precision computes with them as stored instead of re-quantising the dequantised weight."""
    fp8_stored: frozenset[str] = frozenset()
    """Relative names (``"wq_a.weight"``) of the projections stored FP8 / FP4 as loaded (their arrays hold the
    dequantised values); empty for float (bf16 / fp32) weights. Precision ``"deepseek"`` quantises the inputs of
    exactly these Linears, as the official ``linear()`` does (:func:`~dspark_kernels.model.deepseek_numerics.
    fp8_inputs`)."""

    @property
    def kind(self) -> LayerKind:
        return self.config.layer_kind(self.layer)

    @staticmethod
    def prefix(layer: int) -> str:
        """Checkpoint name prefix of a layer's attention weights."""
        return f"layers.{layer}.attn."

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(cls, config: ModelConfig, layer: int, tensors: Mapping[str, Any],
                     *, prefix: str | None = None,
                     int8: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                     fp8: Iterable[str] = ()) -> AttentionWeights:
        """Pick layer ``layer``'s tensors out of a checkpoint mapping name -> array and validate them.

        Names are ``prefix + relative name``; the prefix defaults to ``layers.{layer}.attn.`` (pass ``""``
        for bare names). Names outside the prefix are ignored, so a whole shard can be passed. Raises one
        :class:`ABIError` listing every missing (``array.missing``), unexpected for this layer kind
        (``config.mismatch``), mis-shaped (``array.shape``) or non-float (``array.dtype``) tensor.
        ``int8``: checkpoint name -> (q, scale) of projections stored as W8A8 (see :attr:`stored_int8`).
        ``fp8``: checkpoint names of the tensors stored FP8 / FP4 and given here dequantised (see
        :attr:`fp8_stored`); names outside the prefix are ignored, an unknown one is a ``config.mismatch``.
        """
        if not 0 <= layer < config.num_layers:
            raise ABIError([Issue("config.mismatch", "layer", f"{config.name} has {config.num_layers} layers",
                                  expected=f"0 <= layer < {config.num_layers}", actual=layer)])
        pre = cls.prefix(layer) if prefix is None else prefix
        shapes = expected_shapes(config, layer)
        given = {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}
        issues = [Issue("array.missing", pre + n, f"required by a {config.layer_kind(layer)} layer",
                        expected=list(s), actual="missing") for n, s in shapes.items() if n not in given]
        issues += [Issue("config.mismatch", pre + n, f"not a weight of a {config.layer_kind(layer)} layer of "
                         f"{config.name}", expected=sorted(shapes), actual=n) for n in given if n not in shapes]
        arrays: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            if name not in given:
                continue
            a = given[name]
            if not isinstance(a, np.ndarray) or a.dtype not in _FLOAT_NP_DTYPES:
                dtype = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
                issues.append(Issue("array.dtype", pre + name, "must be a float16/bfloat16/float32/float64 array",
                                    expected="float", actual=str(dtype)))
            elif a.shape != shape:
                issues.append(Issue("array.shape", pre + name, f"wrong shape for {config.name}",
                                    expected=list(shape), actual=list(a.shape)))
            else:
                arrays[name] = _frozen(a)
        fp8_names = frozenset(k[len(pre):] for k in fp8 if k.startswith(pre))
        issues += [Issue("config.mismatch", pre + n, "named as stored FP8 / FP4 but not a weight of this layer",
                         expected=sorted(shapes), actual=n) for n in sorted(fp8_names - set(shapes))]
        stored = {k[len(pre):]: v for k, v in (int8 or {}).items() if k.startswith(pre)}
        for name, (q, scale) in stored.items():  # W8A8 parts must be the float array's exact factors
            w = arrays.get(name)
            if w is not None and (q.shape != w.shape or scale.shape != w.shape[:1]
                                  or not np.array_equal(q * scale[:, None], w)):
                issues.append(Issue("array.shape", pre + name, "int8 parts do not multiply to the float weight",
                                    expected=f"q {list(w.shape)} * scale [{w.shape[0]}] == weight",
                                    actual=f"q {list(q.shape)}, scale {list(scale.shape)}",
                                    fix="pass the int8 tensor and scale the weight was dequantised from"))
        if issues:
            raise ABIError(issues)
        return attrs.evolve(cls._assemble(config, layer, arrays),
                            stored_int8={n: (_frozen(q), _frozen(sc)) for n, (q, sc) in stored.items()},
                            fp8_stored=fp8_names)

    @classmethod
    def _assemble(cls, config: ModelConfig, layer: int, a: Mapping[str, np.ndarray]) -> AttentionWeights:
        def comp(pre: str) -> CompressorWeights:
            return CompressorWeights(a[pre + "wkv.weight"], a[pre + "wgate.weight"], a[pre + "ape"],
                                     a[pre + "norm.weight"])

        kind = config.layer_kind(layer)
        indexer = None
        if kind == "csa":
            indexer = IndexerWeights(a["indexer.wq_b.weight"], a["indexer.weights_proj.weight"],
                                     comp("indexer.compressor."))
        return cls(config=config, layer=layer, wq_a=a["wq_a.weight"], q_norm=a["q_norm.weight"],
                   wq_b=a["wq_b.weight"], wkv=a["wkv.weight"], kv_norm=a["kv_norm.weight"], wo_a=a["wo_a.weight"],
                   wo_b=a["wo_b.weight"], attn_sink=a["attn_sink"],
                   compressor=comp("compressor.") if kind != "swa" else None, indexer=indexer)

    @classmethod
    def random(cls, config: ModelConfig, layer: int, seed: int = 0, *, stored: StoredAs = "float"
               ) -> AttentionWeights:
        """Deterministic random weights (``seed``) scaled so activations stay O(1).

        Projections ~ N(0, 1/fan_in); norm weights ~ 1 + N(0, 0.1^2); ape ~ N(0, 0.5^2); sinks ~ N(0, 1).
        ``stored="shipped"``: the projections the official inference runs as FP8 GEMMs on the shipped checkpoint
        (:func:`~dspark_kernels.model.deepseek_numerics.fp8_gemm_weights`; not ``wo_a``, which ``convert.py``
        turns into bf16) are rounded to FP8 e4m3 with 128x128 power-of-two block scales and marked
        :attr:`fp8_stored`; ``"float"`` (default): float32 values, stored as floats.
        """
        rng = np.random.default_rng([seed, layer])
        arrays = {}
        for name, shape in expected_shapes(config, layer).items():
            if name.endswith("norm.weight"):
                a = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            elif name.endswith("ape"):
                a = 0.5 * rng.standard_normal(shape, dtype=np.float32)
            elif name == "attn_sink":
                a = rng.standard_normal(shape, dtype=np.float32)
            else:
                a = rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[1] ** -0.5)
            arrays[name] = _frozen(a)
        if stored == "float":
            return cls._assemble(config, layer, arrays)
        shipped = {n for n in arrays if "attn." + n.removesuffix(".weight") in fp8_gemm_weights()}
        for name in shipped:  # FP8 e4m3 + 128x128 ue8m0 scales, dequantised exactly
            arrays[name] = _frozen(quant.dequant_fp8_blocks(*quant.quant_fp8_blocks(arrays[name])))
        return attrs.evolve(cls._assemble(config, layer, arrays), fp8_stored=frozenset(shipped))

    def to_tensors(self, *, prefix: str | None = None) -> dict[str, np.ndarray]:
        """Checkpoint name -> float32 array (inverse of :meth:`from_tensors`)."""
        pre = self.prefix(self.layer) if prefix is None else prefix
        out = {"wq_a.weight": self.wq_a, "q_norm.weight": self.q_norm, "wq_b.weight": self.wq_b,
               "wkv.weight": self.wkv, "kv_norm.weight": self.kv_norm, "wo_a.weight": self.wo_a,
               "wo_b.weight": self.wo_b, "attn_sink": self.attn_sink}

        def comp(p: str, cw: CompressorWeights) -> dict[str, np.ndarray]:
            return {p + "wkv.weight": cw.wkv, p + "wgate.weight": cw.wgate, p + "ape": cw.ape,
                    p + "norm.weight": cw.norm}

        if self.compressor is not None:
            out |= comp("compressor.", self.compressor)
        if self.indexer is not None:
            out |= {"indexer.wq_b.weight": self.indexer.wq_b,
                    "indexer.weights_proj.weight": self.indexer.weights_proj}
            out |= comp("indexer.compressor.", self.indexer.compressor)
        return {pre + k: v for k, v in out.items()}
