"""Weights by DeepSeek-V4 checkpoint names: one attention layer's (`AttentionWeights`) and the whole model's
(`ModelWeights`, read lazily one layer at a time and validated up front).

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
FP8 checkpoint tensors must be dequantised first.

## ModelWeights

Names (as DeepSeek-V4's ``inference/model.py`` and ``convert.py`` produce them; [out, in] layouts; D hidden,
hc streams, mix = (2 + hc) * hc, V vocab, E routed experts, K experts per token, I expert width, S shared experts):

=============================================  ==================  =========================================
name                                           shape               notes
=============================================  ==================  =========================================
``embed.weight``                               [V, D]
``layers.{i}.attn.*``                          see above           :class:`AttentionWeights` (per layer kind)
``layers.{i}.attn_norm.weight``                [D]
``layers.{i}.ffn_norm.weight``                 [D]
``layers.{i}.hc_attn_fn`` / ``hc_ffn_fn``      [mix, hc*D]         fp32 in the checkpoint
``layers.{i}.hc_attn_scale`` / ``hc_ffn_scale`` [3]
``layers.{i}.hc_attn_base`` / ``hc_ffn_base``  [mix]
``layers.{i}.ffn.gate.weight``                 [E, D]
``layers.{i}.ffn.gate.bias``                   [E]                 learned-gate layers (i >= num_hash_layers)
``layers.{i}.ffn.gate.tid2eid``                [V, K] int          hash layers (i < num_hash_layers)
``layers.{i}.ffn.experts.{e}.w1/w3.weight``    [I, D]
``layers.{i}.ffn.experts.{e}.w2.weight``       [D, I]
``layers.{i}.ffn.shared_experts.w1/w3.weight`` [S*I, D]            absent when S = 0
``layers.{i}.ffn.shared_experts.w2.weight``    [D, S*I]
``norm.weight``                                [D]
``head.weight``                                [V, D]
``hc_head_fn`` / ``hc_head_scale`` / ``hc_head_base``  [hc, hc*D] / [1] / [hc]
=============================================  ==================  =========================================

Float tensors may be float16, bfloat16, float32 or float64 and are computed with as float32; ``tid2eid`` is
int32 or int64. FP8/FP4 checkpoint tensors (with ``.scale`` companions) must be dequantised first. Names the
model does not use (``mtp.*``, scales) are ignored.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dspark_abi import ABIError, Issue, ModelConfig, ValidationReport
from dspark_abi.config import LayerKind
from dspark_kernels.model.geometry import INDEX_RATIO
from dspark_kernels.model.geometry import coff as compressor_coff
from dspark_kernels.reference.head import HeadWeights
from dspark_kernels.reference.hyper_connections import HcWeights
from dspark_kernels.reference.moe import MoEWeights

#: Float dtypes a checkpoint tensor may have (computed with as float32), and the integer ones (``tid2eid``).
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int32", "int64")
_FLOAT_NP_DTYPES = tuple(np.dtype(ml_dtypes.bfloat16) if n == "bfloat16" else np.dtype(n) for n in FLOAT_DTYPES)


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
                     *, prefix: str | None = None) -> AttentionWeights:
        """Pick layer ``layer``'s tensors out of a checkpoint mapping name -> array and validate them.

        Names are ``prefix + relative name``; the prefix defaults to ``layers.{layer}.attn.`` (pass ``""``
        for bare names). Names outside the prefix are ignored, so a whole shard can be passed. Raises one
        :class:`ABIError` listing every missing (``array.missing``), unexpected for this layer kind
        (``config.mismatch``), mis-shaped (``array.shape``) or non-float (``array.dtype``) tensor.
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
        if issues:
            raise ABIError(issues)
        return cls._assemble(config, layer, arrays)

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
    def random(cls, config: ModelConfig, layer: int, seed: int = 0) -> AttentionWeights:
        """Deterministic random weights (``seed``) scaled so activations stay O(1).

        Projections ~ N(0, 1/fan_in); norm weights ~ 1 + N(0, 0.1^2); ape ~ N(0, 0.5^2); sinks ~ N(0, 1).
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
        return cls._assemble(config, layer, arrays)

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


# ---------------------------------------------------------------------------------------------- checkpoint
_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I32": "int32",
              "I64": "int64", "I8": "int8", "U8": "uint8", "F8_E4M3": "float8_e4m3fn", "BOOL": "bool"}
#: Random tensors larger than this repeat a block of this many (prime) values, so that building a DEMO-size
#: model costs memory bandwidth, not random-number generation. Rows never repeat (prime period > row length).
_RANDOM_PERIOD = 1_048_573


@attrs.frozen
class TensorSpec:
    """Expected shape and dtype family ('float' or 'int') of one checkpoint tensor."""

    shape: tuple[int, ...]
    family: str = "float"


def weight_specs(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the model reads, checkpoint name -> :class:`TensorSpec` (the table in the module docstring)."""
    c, m = config, config.moe
    d, hc, v = c.hidden_size, c.hc_mult, c.vocab_size
    mix, inter, shared = (2 + hc) * hc, m.moe_intermediate_size, m.n_shared_experts * m.moe_intermediate_size
    out = {"embed.weight": TensorSpec((v, d))}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        out |= {AttentionWeights.prefix(i) + n: TensorSpec(s) for n, s in expected_shapes(c, i).items()}
        out |= {p + "attn_norm.weight": TensorSpec((d,)), p + "ffn_norm.weight": TensorSpec((d,))}
        for which in ("attn", "ffn"):
            out |= {p + f"hc_{which}_fn": TensorSpec((mix, hc * d)), p + f"hc_{which}_scale": TensorSpec((3,)),
                    p + f"hc_{which}_base": TensorSpec((mix,))}
        out[p + "ffn.gate.weight"] = TensorSpec((m.n_routed_experts, d))
        if i < m.num_hash_layers:
            out[p + "ffn.gate.tid2eid"] = TensorSpec((v, m.num_experts_per_tok), "int")
        else:
            out[p + "ffn.gate.bias"] = TensorSpec((m.n_routed_experts,))
        for e in range(m.n_routed_experts):
            q = f"{p}ffn.experts.{e}."
            out |= {q + "w1.weight": TensorSpec((inter, d)), q + "w2.weight": TensorSpec((d, inter)),
                    q + "w3.weight": TensorSpec((inter, d))}
        if shared:
            q = p + "ffn.shared_experts."
            out |= {q + "w1.weight": TensorSpec((shared, d)), q + "w2.weight": TensorSpec((d, shared)),
                    q + "w3.weight": TensorSpec((shared, d))}
    out |= {"norm.weight": TensorSpec((d,)), "head.weight": TensorSpec((v, d)),
            "hc_head_fn": TensorSpec((hc, hc * d)), "hc_head_scale": TensorSpec((1,)),
            "hc_head_base": TensorSpec((hc,))}
    return out


# ---------------------------------------------------------------------------------------------- errors
class WeightsError(ABIError):
    """Weights that cannot serve a config: every issue (``issues``, as :class:`ABIError`) plus a one-line
    :meth:`summary` (counts and the first few names) for a checkpoint that is wholly wrong.

    ``unreadable`` names files that could not be opened; ``unused`` lists checkpoint tensors the model does not
    read (ignored, but telling when the required ones are missing: another model's or converter's names).
    """

    #: Names quoted per category in :meth:`summary`.
    EXAMPLES = 3

    def __init__(self, issues: Iterable[Issue], *, config_name: str, required: int,
                 unused: Iterable[str] = (), unreadable: Iterable[str] = ()):
        super().__init__(issues)
        self.config_name, self.required = config_name, required
        self.unused, self.unreadable = tuple(unused), tuple(unreadable)

    def __reduce__(self) -> tuple[Any, ...]:  # survives a process boundary (a rank or kernel process)
        return _weights_error, (self.issues, self.config_name, self.required, self.unused, self.unreadable)

    def by_code(self, code: str) -> list[Issue]:
        return [i for i in self.issues if i.code == code]

    def summary(self) -> str:
        """One line, e.g. '170 of 170 tensors tiny needs are missing (embed.weight, ...); the checkpoint holds
        12 tensors tiny does not read (model.embed.weight, ...)'."""
        if self.unreadable:
            return "; ".join(i.message for i in self.issues)
        n, parts = self.EXAMPLES, []
        missing, shape, dtype = self.by_code("array.missing"), self.by_code("array.shape"), self.by_code("array.dtype")
        if missing:
            parts.append(f"{len(missing)} of {self.required} tensors {self.config_name} needs are missing "
                         f"({_examples([i.field for i in missing], n)})")
        if shape:
            first = shape[0]
            parts.append(f"{len(shape)} have the wrong shape ({first.field}: expected {first.expected}, got "
                         f"{first.actual}{', ...' if len(shape) > 1 else ''})")
        if dtype:
            parts.append(f"{len(dtype)} have an unsupported dtype ({dtype[0].field}: {dtype[0].actual}; "
                         "dequantise FP8/FP4 checkpoints first)")
        others = [i for i in self.issues if i.code not in ("array.missing", "array.shape", "array.dtype")]
        parts += [str(i) for i in others[:1]]
        text = ", ".join(parts) if parts else "weights are invalid"
        if missing and self.unused:
            text += (f"; the checkpoint holds {len(self.unused)} tensors {self.config_name} does not read "
                     f"({_examples(self.unused, n)})")
        return text


def _weights_error(issues: tuple[Issue, ...], config_name: str, required: int, unused: tuple[str, ...],
                   unreadable: tuple[str, ...]) -> WeightsError:
    return WeightsError(issues, config_name=config_name, required=required, unused=unused, unreadable=unreadable)


def _examples(names: Iterable[str], n: int) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


# ---------------------------------------------------------------------------------------------- sources
class _ArraySource:
    def __init__(self, arrays: Mapping[str, Any]):
        self.arrays = dict(arrays)

    def info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (tuple(np.shape(a)), str(np.asarray(a).dtype)) for n, a in self.arrays.items()}

    def load(self, name: str) -> np.ndarray:
        return np.asarray(self.arrays[name])


class _SafetensorsSource:
    """Tensors spread over safetensors files; headers are read at construction, data when a tensor is loaded."""

    def __init__(self, paths: Iterable[Path]):
        self.where: dict[str, Path] = {}
        self._info: dict[str, tuple[tuple[int, ...], str]] = {}
        self.unreadable: list[Issue] = []
        for path in paths:
            try:
                with safe_open(str(path), framework="numpy") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        sl = f.get_slice(name)
                        self.where[name] = path
                        self._info[name] = (tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
            except (OSError, SafetensorError) as exc:  # missing, unreadable, truncated or not safetensors at all
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                self.unreadable.append(Issue("array.missing", str(path), f"cannot read {path}: {reason}",
                                             expected="a safetensors file", actual=type(exc).__name__))

    def info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self._info

    def load(self, name: str) -> np.ndarray:
        with safe_open(str(self.where[name]), framework="numpy") as f:
            return f.get_tensor(name)


class _RandomSource:
    """Deterministic random tensors: each name seeds its own generator from (seed, crc32(seed name)).

    The seed name is the checkpoint name, unless ``share_layers``: then attention and gate tensors of all layers
    of one (kind, hash-routed) class, and the experts of all layers, get equal values (a DEMO-size model then
    fits in memory for benchmarks, since :class:`ModelWeights` shares the arrays too).
    """

    def __init__(self, config: ModelConfig, seed: int, share_layers: bool):
        self.config, self.seed, self.share_layers = config, seed, share_layers
        self.specs = weight_specs(config)

    def info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (s.shape, "float32" if s.family == "float" else "int32") for n, s in self.specs.items()}

    def layer_key(self, layer: int) -> str:
        """Layers with equal keys get equal attention/gate values under ``share_layers``."""
        return f"{self.config.layer_kind(layer)}-{'hash' if layer < self.config.moe.num_hash_layers else 'gate'}"

    def seed_name(self, name: str) -> str:
        if not (self.share_layers and name.startswith("layers.")):
            return name
        _, index, rest = name.split(".", 2)
        key = "all" if rest.startswith(("ffn.experts.", "ffn.shared_experts.")) else self.layer_key(int(index))
        return f"layers.{key}.{rest}"

    def load(self, name: str) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(self.seed_name(name).encode())])
        return self._generate(name, self.specs[name], rng)

    def _generate(self, name: str, spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        shape, n = spec.shape, int(np.prod(spec.shape))
        if spec.family == "int":  # tid2eid: K distinct experts per token
            experts = self.config.moe.n_routed_experts
            return np.argsort(rng.random((shape[0], experts)), axis=1)[:, : shape[1]].astype(np.int32)
        leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
        base = rng.standard_normal(min(n, _RANDOM_PERIOD), dtype=np.float32)
        if leaf.endswith("norm") or leaf.endswith("_scale") or leaf == "scale":
            base = 1.0 + 0.1 * base
        elif leaf in ("bias", "ape") or leaf.endswith("_base"):
            base = 0.1 * base if leaf != "ape" else 0.5 * base
        elif leaf == "embed" or leaf == "attn_sink":
            pass
        else:  # projections [out, in]: unit-variance outputs
            base = base * np.float32(shape[-1] ** -0.5)
        base = base.astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16 values, as a checkpoint holds
        out = np.resize(base, n).reshape(shape)
        out.flags.writeable = False
        return out


# ---------------------------------------------------------------------------------------------- model
@attrs.frozen
class LayerWeights:
    """Everything layer ``layer`` reads: attention, the two norms, the two hc mixers and the MoE FFN."""

    layer: int
    attn: AttentionWeights
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    hc_attn: HcWeights
    hc_ffn: HcWeights
    moe: MoEWeights


class ModelWeights:
    """All weights of a :class:`ModelConfig`, validated at construction, materialised lazily.

    ``layer(i)`` reads layer i's tensors when it is asked for (a forward asks when the layer runs);
    with ``keep_layers`` the result is kept for later calls, otherwise it is rebuilt each time (streaming,
    for models larger than memory). Build with :meth:`random`, :meth:`from_safetensors` or :meth:`from_tensors`.
    """

    def __init__(self, config: ModelConfig, source: Any, *, keep_layers: bool = True):
        self.config, self._source, self.keep_layers = config, source, keep_layers
        self._layers: dict[int, LayerWeights] = {}
        self._head: HeadWeights | None = None
        self._embed: np.ndarray | None = None
        self._stacked: dict[str, np.ndarray] | None = None
        unreadable = getattr(source, "unreadable", [])
        if unreadable:
            raise WeightsError(unreadable, config_name=config.name, required=len(weight_specs(config)),
                               unreadable=[i.field for i in unreadable])
        report = self.validate()
        if not report.ok:
            specs = weight_specs(config)
            raise WeightsError(report.issues, config_name=config.name, required=len(specs),
                               unused=[n for n in source.info() if n not in specs])

    def __getstate__(self) -> dict[str, Any]:  # ship the source, not materialised layers
        return {**self.__dict__, "_layers": {}, "_head": None, "_embed": None, "_stacked": None}

    # ------------------------------------------------------------------ construction
    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, *, share_layers: bool = False,
               keep_layers: bool = True) -> ModelWeights:
        """Deterministic random weights (bf16 values): projections ~ N(0, 1/fan_in), norms and hc scales
        ~ 1 + N(0, 0.01), biases ~ N(0, 0.01), ape ~ N(0, 0.25), embeddings and sinks ~ N(0, 1), and
        ``tid2eid`` rows of K distinct experts. ``share_layers`` gives all layers of one kind the same values."""
        return cls(config, _RandomSource(config, seed, share_layers), keep_layers=keep_layers)

    @classmethod
    def from_safetensors(cls, paths: str | Path | Iterable[str | Path], config: ModelConfig, *,
                         keep_layers: bool = False) -> ModelWeights:
        """Weights from a directory of ``*.safetensors`` files or a list of files (headers checked now).

        Raises :class:`WeightsError` (an :class:`ABIError`) when a file cannot be read or the tensors do not fit
        ``config``; its ``summary()`` is one line however many tensors are wrong."""
        if isinstance(paths, str | Path) and Path(paths).is_dir():
            files = sorted(Path(paths).glob("*.safetensors"))
        else:
            files = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
        if not files:
            raise WeightsError([Issue("array.missing", "weights", f"no *.safetensors files found in {paths}",
                                      expected="one or more files", actual=str(paths))],
                               config_name=config.name, required=len(weight_specs(config)), unreadable=[str(paths)])
        return cls(config, _SafetensorsSource(files), keep_layers=keep_layers)

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: Mapping[str, Any]) -> ModelWeights:
        """Weights from an in-memory mapping checkpoint name -> array."""
        return cls(config, _ArraySource(tensors))

    def save_safetensors(self, path: str | Path, *, dtype: str = "bfloat16") -> None:
        """Write every tensor to one safetensors file (floats as ``dtype``), loadable by :meth:`from_safetensors`."""
        out = {}
        for name, spec in weight_specs(self.config).items():
            a = self.tensor(name)
            out[name] = np.ascontiguousarray(a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
                                             if spec.family == "float" else a)
        save_file(out, str(path), metadata={"config": self.config.model_dump_json()})

    # ------------------------------------------------------------------ validation
    def validate(self) -> ValidationReport:
        """Every missing, mis-shaped or mis-typed tensor (codes array.missing / array.shape / array.dtype)."""
        info = self._source.info()
        issues = []
        for name, spec in weight_specs(self.config).items():
            if name not in info:
                issues.append(Issue("array.missing", name, f"required by {self.config.name}",
                                    expected=list(spec.shape), actual="missing"))
                continue
            shape, dtype = info[name]
            allowed = FLOAT_DTYPES if spec.family == "float" else INT_DTYPES
            if dtype not in allowed:
                issues.append(Issue("array.dtype", name, f"must be one of {'/'.join(allowed)} (dequantise FP8/FP4 "
                                    "checkpoints first)", expected=spec.family, actual=dtype))
            if tuple(shape) != spec.shape:
                issues.append(Issue("array.shape", name, f"wrong shape for {self.config.name}",
                                    expected=list(spec.shape), actual=list(shape)))
        return ValidationReport(tuple(issues))

    # ------------------------------------------------------------------ access
    def tensor(self, name: str) -> np.ndarray:
        """One tensor by checkpoint name, as float32 (floats) or int64 (``tid2eid``)."""
        a = self._source.load(name)
        if a.dtype.kind in "iu":
            return a.astype(np.int64, copy=False)
        return a if a.dtype == np.float32 else a.astype(np.float32)

    def embed(self) -> np.ndarray:
        """``embed.weight`` [V, D] fp32 (read once, then kept)."""
        if self._embed is None:
            self._embed = self.tensor("embed.weight")
        return self._embed

    def head(self) -> HeadWeights:
        """hc_head mixer, final norm and LM head (read once, then kept)."""
        if self._head is None:
            t = self.tensor
            self._head = HeadWeights(HcWeights(t("hc_head_fn"), t("hc_head_scale"), t("hc_head_base")),
                                     t("norm.weight"), t("head.weight"))
        return self._head

    def layer(self, i: int) -> LayerWeights:
        """Layer ``i``'s weights (read from the source now unless kept from an earlier call)."""
        if not 0 <= i < self.config.num_layers:
            raise ABIError([Issue("config.mismatch", "layer", f"{self.config.name} has {self.config.num_layers} "
                                  "layers", expected=f"0 <= layer < {self.config.num_layers}", actual=i)])
        if i in self._layers:
            return self._layers[i]
        twin = self._shared_twin(i)
        if twin is not None:  # share_layers: same arrays, this layer's index
            lw = attrs.evolve(twin, layer=i, attn=attrs.evolve(twin.attn, layer=i))
        else:
            lw = self._read_layer(i)
        if self.keep_layers:
            self._layers[i] = lw
        return lw

    def _shared_twin(self, i: int) -> LayerWeights | None:
        src = self._source
        if not (isinstance(src, _RandomSource) and src.share_layers and self.keep_layers):
            return None
        return next((lw for j, lw in self._layers.items() if src.layer_key(j) == src.layer_key(i)), None)

    def _experts(self, i: int) -> dict[str, np.ndarray]:
        """Stacked ``w1``/``w2``/``w3`` [E, ...] of layer i (shared between layers under ``share_layers``)."""
        src, p = self._source, f"layers.{i}.ffn.experts."
        shared = isinstance(src, _RandomSource) and src.share_layers and self.keep_layers
        if shared and self._stacked is not None:
            return self._stacked
        out = {w: np.stack([self.tensor(f"{p}{e}.{w}.weight") for e in range(self.config.moe.n_routed_experts)])
               for w in ("w1", "w2", "w3")}
        if shared:
            self._stacked = out
        return out

    def _read_layer(self, i: int) -> LayerWeights:
        c, t, p = self.config, self.tensor, f"layers.{i}."
        attn_names = [AttentionWeights.prefix(i) + n for n in expected_shapes(c, i)]
        attn = AttentionWeights.from_tensors(c, i, {n: self._source.load(n) for n in attn_names})
        e_count = c.moe.n_routed_experts
        stack = self._experts(i)
        shared = {w: (t(f"{p}ffn.shared_experts.{w}.weight") if c.moe.n_shared_experts else None)
                  for w in ("w1", "w2", "w3")}
        hash_layer = i < c.moe.num_hash_layers
        tid2eid = t(p + "ffn.gate.tid2eid") if hash_layer else None
        if tid2eid is not None and (tid2eid.min() < 0 or tid2eid.max() >= e_count):
            raise ABIError([Issue("config.mismatch", p + "ffn.gate.tid2eid", "expert ids must lie in [0, E)",
                                  expected=f"[0, {e_count})", actual=[int(tid2eid.min()), int(tid2eid.max())])])
        moe = MoEWeights(gate_w=t(p + "ffn.gate.weight"), gate_bias=None if hash_layer else t(p + "ffn.gate.bias"),
                         tid2eid=tid2eid, w1=stack["w1"], w2=stack["w2"], w3=stack["w3"],
                         shared_w1=shared["w1"], shared_w2=shared["w2"], shared_w3=shared["w3"])

        def hc(which: str) -> HcWeights:
            return HcWeights(t(f"{p}hc_{which}_fn"), t(f"{p}hc_{which}_scale"), t(f"{p}hc_{which}_base"))

        return LayerWeights(layer=i, attn=attn, attn_norm=t(p + "attn_norm.weight"), ffn_norm=t(p + "ffn_norm.weight"),
                            hc_attn=hc("attn"), hc_ffn=hc("ffn"), moe=moe)
