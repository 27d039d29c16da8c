"""The whole model's weights (`ModelWeights`): validated up front against
:func:`~dspark_kernels.model.weight_specs.weight_specs` (the checkpoint names and shapes, tabled in
:mod:`dspark_kernels.model.weight_specs`), read lazily one layer at a time from an in-memory mapping,
a checkpoint folder in its stored formats (:class:`~dspark_kernels.model.shard_index.ShardIndex`: memory-mapped
shards, FP8 / FP4 / int8 dequantised per tensor when a layer runs) or deterministic random values.

Streaming (``keep_layers=False``, the default for checkpoints): a layer is built when the forward runs it and
dropped after; its routed experts are :class:`~dspark_kernels.model.block_weights.ExpertStack` s read one expert
at a time when tokens are routed to it; the embedding gives only the batch's rows. Peak memory is then one
layer without its experts, one expert, the fp32 LM head and the activations (docs/serving.md). One attention
layer's weights are
:class:`~dspark_kernels.model.attention_weights.AttentionWeights`; the hyper-connection, MoE and head value
classes are in :mod:`dspark_kernels.model.block_weights`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from dspark_abi import ABIError, Issue, ModelConfig, ValidationReport
from dspark_kernels.model.attention_weights import FLOAT_DTYPES, INT_DTYPES, AttentionWeights, expected_shapes
from dspark_kernels.model.block_weights import ExpertStack, HcWeights, HeadWeights, MoEWeights
from dspark_kernels.model.checkpoint_format import QuantFormat, model_formats
from dspark_kernels.model.shard_index import ShardIndex
from dspark_kernels.model.weight_specs import TensorSpec, WeightsError, weight_specs

#: Random tensors larger than this repeat a block of this many (prime) values, so that building a DEMO-size
#: model costs memory bandwidth, not random-number generation. Rows never repeat (prime period > row length).
_RANDOM_PERIOD = 1_048_573


# ---------------------------------------------------------------------------------------------- sources
class _ArraySource:
    def __init__(self, arrays: Mapping[str, Any]):
        self.arrays = dict(arrays)

    def info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (tuple(np.shape(a)), str(np.asarray(a).dtype)) for n, a in self.arrays.items()}

    def load(self, name: str) -> np.ndarray:
        return np.asarray(self.arrays[name])


class RandomSource:
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
        spec = self.specs[name]
        if spec.family == "int":
            return self._tid2eid(spec, self._rng(name))
        block = self._block(name, spec)
        out = np.resize(block, int(np.prod(spec.shape))).reshape(spec.shape)
        out.flags.writeable = False
        return out

    def rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """``load(name)[rows]`` of a 2-D float tensor without generating the rest (the embedding's few rows)."""
        spec = self.specs[name]
        block = self._block(name, spec)
        flat = np.asarray(rows, dtype=np.int64)[:, None] * spec.shape[1] + np.arange(spec.shape[1])
        result: np.ndarray = block[flat % block.size]
        return result

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(self.seed_name(name).encode())])

    def _tid2eid(self, spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """K distinct experts per token."""
        experts = self.config.moe.n_routed_experts
        return np.argsort(rng.random((spec.shape[0], experts)), axis=1)[:, : spec.shape[1]].astype(np.int32)

    def _block(self, name: str, spec: TensorSpec) -> np.ndarray:
        """The tensor's first ``min(n, _RANDOM_PERIOD)`` values (bf16 values as float32); the rest repeats them."""
        rng = self._rng(name)
        leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
        base = rng.standard_normal(min(int(np.prod(spec.shape)), _RANDOM_PERIOD), dtype=np.float32)
        if leaf.endswith("norm") or leaf.endswith("_scale") or leaf == "scale":
            base = 1.0 + 0.1 * base
        elif leaf in ("bias", "ape") or leaf.endswith("_base"):
            base = 0.1 * base if leaf != "ape" else 0.5 * base
        elif leaf == "embed" or leaf == "attn_sink":
            pass
        else:  # projections [out, in]: unit-variance outputs
            base = base * np.float32(spec.shape[-1] ** -0.5)
        return base.astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16 values, as a checkpoint holds


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
    with ``keep_layers`` the result is kept for later calls, otherwise it is rebuilt each time and its routed
    experts are read one at a time as the MoE reaches them (streaming, for models larger than memory).
    Build with :meth:`random`, :meth:`from_safetensors` or :meth:`from_tensors`.
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
        return cls(config, RandomSource(config, seed, share_layers), keep_layers=keep_layers)

    @classmethod
    def from_safetensors(cls, paths: str | Path | Iterable[str | Path], config: ModelConfig, *,
                         keep_layers: bool = False) -> ModelWeights:
        """Weights from a checkpoint folder (its ``model.safetensors.index.json``, else every ``*.safetensors``),
        one shard file or a list of them, in any stored format :class:`ShardIndex` reads (FP8 / FP4 / int8 +
        scales as shipped, or floats). Headers are checked now; tensors are memory-mapped and dequantised when
        a layer runs (``keep_layers=False``: streaming, routed experts one at a time as tokens reach them).

        Raises :class:`WeightsError` (an :class:`ABIError`) when a file cannot be read or the tensors do not fit
        ``config``; its ``summary()`` is one line however many tensors are wrong."""
        try:
            source = ShardIndex(paths if isinstance(paths, str | Path) else [Path(p) for p in paths])
        except ABIError as exc:
            unreadable = [i.field for i in exc.issues if i.code == "fixture.unreadable"]
            raise WeightsError(exc.issues, config_name=config.name, required=len(weight_specs(config)),
                               unreadable=unreadable) from None
        return cls(config, source, keep_layers=keep_layers)

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: Mapping[str, Any], *, keep_layers: bool = True
                     ) -> ModelWeights:
        """Weights from an in-memory mapping checkpoint name -> float (or int ``tid2eid``) array; floats are
        computed with as float32. ``keep_layers=False`` builds each layer when it runs and reads routed experts
        one at a time (arrays larger than memory in float32, e.g. bf16 or memory-mapped ones)."""
        return cls(config, _ArraySource(tensors), keep_layers=keep_layers)

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
        if isinstance(self._source, ShardIndex):  # stored kinds and scale shapes too (headers only)
            formats = model_formats(self.config, QuantFormat(quantized=True))
            return self._source.validate([formats[n] for n in weight_specs(self.config)])
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
                issues.append(Issue("array.dtype", name, f"must be one of {'/'.join(allowed)} (in-memory weights are "
                                    "floats; load FP8/FP4 checkpoints with from_safetensors)", expected=spec.family,
                                    actual=dtype))
            if tuple(shape) != spec.shape:
                issues.append(Issue("array.shape", name, f"wrong shape for {self.config.name}",
                                    expected=list(spec.shape), actual=list(shape)))
        return ValidationReport(tuple(issues))

    # ------------------------------------------------------------------ access
    def tensor(self, name: str) -> np.ndarray:
        """One tensor by checkpoint name, as float32 (floats) or int64 (``tid2eid``)."""
        a = self._source.load(name)
        result: np.ndarray
        if a.dtype.kind in "iu":
            result = a.astype(np.int64, copy=False)
            return result
        result = a if a.dtype == np.float32 else a.astype(np.float32)
        return result

    def embed(self) -> np.ndarray:
        """``embed.weight`` [V, D] fp32 (read once, then kept)."""
        if self._embed is None:
            self._embed = self.tensor("embed.weight")
        return self._embed

    def embed_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """``embed()[token_ids]`` [T, D] fp32; streaming weights read only these rows (FLASH's table is 2 GiB)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if self._embed is not None or self.keep_layers or not hasattr(self._source, "rows"):
            return self.embed()[ids]
        result: np.ndarray = self._source.rows("embed.weight", ids)
        return result

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
        if not (isinstance(src, RandomSource) and src.share_layers and self.keep_layers):
            return None
        return next((lw for j, lw in self._layers.items() if src.layer_key(j) == src.layer_key(i)), None)

    def _experts(self, i: int) -> Mapping[str, np.ndarray | ExpertStack]:
        """``w1``/``w2``/``w3`` [E, ...] of layer i: stacked arrays when layers are kept (shared between layers
        under ``share_layers``), else :class:`ExpertStack` s that read one expert when the MoE asks for it."""
        src, p, m = self._source, f"layers.{i}.ffn.experts.", self.config.moe
        if not self.keep_layers:
            d, inter = self.config.hidden_size, m.moe_intermediate_size
            shapes = {"w1": (inter, d), "w2": (d, inter), "w3": (inter, d)}
            int8 = getattr(src, "int8_parts", None)
            return {w: ExpertStack((m.n_routed_experts, *shapes[w]), _ExpertReader(self, f"{p}{{}}.{w}.weight"),
                                   None if int8 is None else _ExpertReader(self, f"{p}{{}}.{w}.weight", int8=True))
                    for w in ("w1", "w2", "w3")}
        shared = isinstance(src, RandomSource) and src.share_layers
        if shared and self._stacked is not None:
            return self._stacked
        stacked = {w: np.stack([self.tensor(f"{p}{e}.{w}.weight") for e in range(m.n_routed_experts)])
                   for w in ("w1", "w2", "w3")}
        if shared:
            self._stacked = stacked
        return stacked

    def _stored_fp8(self, name: str) -> bool:
        """Whether tensor ``name`` is stored FP8 / FP4 as loaded (a checkpoint's header says; in-memory and random
        weights are floats)."""
        return isinstance(self._source, ShardIndex) and self._source.kind(name) in ("fp8_block", "fp4_block")

    def _read_layer(self, i: int) -> LayerWeights:
        c, t, p = self.config, self.tensor, f"layers.{i}."
        attn_names = [AttentionWeights.prefix(i) + n for n in expected_shapes(c, i)]
        int8 = getattr(self._source, "int8_parts", None)
        stored = {} if int8 is None else {n: parts for n in attn_names if (parts := int8(n)) is not None}
        attn = AttentionWeights.from_tensors(c, i, {n: self._source.load(n) for n in attn_names}, int8=stored,
                                             fp8=[n for n in attn_names if self._stored_fp8(n)])
        e_count = c.moe.n_routed_experts
        stack = self._experts(i)
        shared = {w: (t(f"{p}ffn.shared_experts.{w}.weight") if c.moe.n_shared_experts else None)
                  for w in ("w1", "w2", "w3")}
        hash_layer = i < c.moe.num_hash_layers
        tid2eid = t(p + "ffn.gate.tid2eid") if hash_layer else None
        if tid2eid is not None and (tid2eid.min() < 0 or tid2eid.max() >= e_count):
            raise ABIError([Issue("config.mismatch", p + "ffn.gate.tid2eid", "expert ids must lie in [0, E)",
                                  expected=f"[0, {e_count})", actual=[int(tid2eid.min()), int(tid2eid.max())])])
        fp8 = {f"ffn.experts.{w}" for w in ("w1", "w2", "w3")
               if all(self._stored_fp8(f"{p}ffn.experts.{e}.{w}.weight") for e in range(e_count))}
        if c.moe.n_shared_experts:
            fp8 |= {f"ffn.shared_experts.{w}" for w in ("w1", "w2", "w3")
                    if self._stored_fp8(f"{p}ffn.shared_experts.{w}.weight")}
        moe = MoEWeights(gate_w=t(p + "ffn.gate.weight"), gate_bias=None if hash_layer else t(p + "ffn.gate.bias"),
                         tid2eid=tid2eid, w1=stack["w1"], w2=stack["w2"], w3=stack["w3"],
                         shared_w1=shared["w1"], shared_w2=shared["w2"], shared_w3=shared["w3"],
                         fp8_stored=frozenset(fp8))

        def hc(which: str) -> HcWeights:
            return HcWeights(t(f"{p}hc_{which}_fn"), t(f"{p}hc_{which}_scale"), t(f"{p}hc_{which}_base"))

        return LayerWeights(layer=i, attn=attn, attn_norm=t(p + "attn_norm.weight"), ffn_norm=t(p + "ffn_norm.weight"),
                            hc_attn=hc("attn"), hc_ffn=hc("ffn"), moe=moe)


@attrs.frozen
class _ExpertReader:
    """Reads expert ``e`` of one stack (``template.format(e)``) from a :class:`ModelWeights`; pickles with it."""

    weights: ModelWeights
    template: str
    int8: bool = False

    def __call__(self, e: int) -> Any:
        name = self.template.format(e)
        if self.int8:
            return self.weights._source.int8_parts(name)
        return self.weights.tensor(name)
