"""The stored format of every DeepSeek-V4(-Flash/-DSpark) checkpoint tensor, and a lazy safetensors shard index.

One home for "which name holds what": :func:`model_formats` (whole checkpoint) and :func:`block_formats`
(one decoder layer, an MTP layer or a DSpark stage) map checkpoint names to a :class:`TensorFormat` (logical
shape, the kind the official checkpoint ships, the kinds this loader accepts). :class:`ShardIndex` memory-maps
safetensors shards, reads only headers up front and dequantises one tensor to float32 when asked.

Names are the official ones (``inference/model.py`` parameter paths; the Hugging Face checkpoint uses them
as-is: vLLM's ``vllm/model_executor/models/deepseek_v4.py`` maps ``layers.`` / ``embed.`` / ``head.weight`` /
``mtp.`` and the ``.scale`` suffix from the hub files). [out, in] layouts; D hidden, H heads, hd head_dim,
G o_groups, R o_lora_rank, q q_lora_rank, HI/dI indexer heads/dim, hc streams, mix = (2 + hc) * hc, V vocab,
E experts, K experts per token, I expert width, S shared experts, r DSpark Markov rank, T DSpark target layers.

=================================================  ======================  ==========================================
name (under ``layers.{i}.`` unless global)         logical shape           shipped (FP8 checkpoint, expert_dtype fp4)
=================================================  ======================  ==========================================
``attn.wq_a.weight``                               [q, D]                  F8_E4M3 + ``attn.wq_a.scale`` F8_E8M0
``attn.wq_b.weight``                               [H*hd, q]               F8_E4M3 + scale [ceil(out/128), ceil(in/128)]
``attn.wkv.weight``                                [hd, D]                 F8_E4M3 + scale
``attn.wo_a.weight``                               [G*R, H*hd/G]           F8_E4M3 + scale (convert.py: bf16)
``attn.wo_b.weight``                               [D, G*R]                F8_E4M3 + scale
``attn.q_norm.weight`` / ``attn.kv_norm.weight``   [q] / [hd]              BF16
``attn.attn_sink``                                 [H]                     F32
``attn.compressor.wkv/wgate.weight`` (ratio > 0)   [c*hd, D], c = 2 at 4   BF16 (no scale)
``attn.compressor.ape`` / ``.norm.weight``         [ratio, c*hd] / [hd]    F32 / BF16
``attn.indexer.wq_b.weight`` (ratio 4)             [HI*dI, q]              F8_E4M3 + scale
``attn.indexer.weights_proj.weight``               [HI, D]                 BF16
``attn.indexer.compressor.wkv/wgate.weight``       [2*dI, D]               BF16
``attn.indexer.compressor.ape`` / ``.norm.weight`` [4, 2*dI] / [dI]        F32 / BF16
``attn_norm.weight`` / ``ffn_norm.weight``         [D]                     BF16
``hc_attn_fn`` ``hc_attn_scale`` ``hc_attn_base``  [mix, hc*D] [3] [mix]   F32 (same for ``hc_ffn_*``)
``ffn.gate.weight``                                [E, D]                  BF16
``ffn.gate.bias`` (learned-gate layers)            [E]                     F32
``ffn.gate.tid2eid`` (hash layers)                 [V, K]                  I32
``ffn.experts.{e}.w1/w3.weight``, ``w2``           [I, D], [D, I]          I8 [out, in/2] (two e2m1 per byte, low
                                                                           nibble first) + scale [out, in/32] F8_E8M0
``ffn.shared_experts.w1/w3.weight``, ``w2``        [S*I, D], [D, S*I]      F8_E4M3 + scale
``embed.weight`` / ``head.weight``                 [V, D]                  BF16
``norm.weight``                                    [D]                     BF16
``hc_head_fn`` ``hc_head_scale`` ``hc_head_base``  [hc, hc*D] [1] [hc]     F32
``mtp.0.*`` NextN layer (V4-Flash)                 a decoder layer (SWA attention, learned gate) plus
                                                   ``e_proj``/``h_proj`` [D, D] FP8, ``enorm``/``hnorm``/``norm``
                                                   [D], ``hc_head_*``
``mtp.{s}.*`` DSpark stages s < 3 (-DSpark)        a decoder layer each (SWA, learned gate); ``mtp.0.main_proj``
                                                   [D, T*D] FP8 + ``mtp.0.main_norm`` [D]; the last stage adds
                                                   ``norm``, ``hc_head_*``, ``markov_head.markov_w1/w2.weight``
                                                   [V, r] and ``confidence_head.proj.weight`` [1, D + r]
=================================================  ======================  ==========================================

FP8-expert checkpoints (``expert_dtype: "fp8"``, e.g. V4-Flash-Base) store the experts like the shared expert
and their FP8 scales as F32 (vLLM ``DeepseekV4FP8Config.is_scale_e8m0``). A dequantised (float) checkpoint
with the same names and no scales is accepted everywhere; so are int8 + per-output-channel float32 scales
(W8A8). The dequantisation rules live in :mod:`dspark_kernels.model.quant`; ``docs/checkpoints.md`` cites
every source and marks what is not verified against a shipped header.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import ml_dtypes
import numpy as np

from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue, ValidationReport
from dspark_kernels.model import quant

Kind = Literal["fp8_block", "fp4_block", "int8_channel", "float", "int"]
KINDS: tuple[Kind, ...] = ("fp8_block", "fp4_block", "int8_channel", "float", "int")
_QUANTISED_KINDS = ("fp8_block", "fp4_block", "int8_channel")
#: Kinds accepted where the official checkpoint ships a quantised projection (float = dequantised copy).
_PROJECTION_KINDS: tuple[Kind, ...] = ("fp8_block", "fp4_block", "int8_channel", "float")

#: safetensors dtype codes -> numpy dtypes (ml_dtypes for the 8-bit floats).
ST_DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": quant.E4M3, "F8_E8M0": quant.UE8M0, "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "I16": np.dtype(np.int16), "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64), "BOOL": np.dtype(np.bool_),
}
_FLOAT_CODES = ("BF16", "F16", "F32", "F64")
_INT_CODES = ("I16", "I32", "I64")
_SCALE_CODES = ("F8_E8M0", "U8", "F32", "BF16", "F16")
#: Largest safetensors JSON header read (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------- config.json
@attrs.frozen
class QuantFormat:
    """How a checkpoint is quantised (``config.json``: ``quantization_config`` and ``expert_dtype``)."""

    quantized: bool
    """False for a float checkpoint (no ``quantization_config``): every tensor is stored as a float."""
    expert_dtype: Literal["fp4", "fp8"] = "fp4"
    """Routed experts: ``fp4`` (e2m1, 1x32 ue8m0 scales; V4-Flash) or ``fp8`` (128x128 blocks; V4-Flash-Base)."""
    scale_fmt: Literal["ue8m0"] | None = "ue8m0"
    """``ue8m0``: power-of-two block scales."""
    weight_block: tuple[int, int] = (quant.WEIGHT_BLOCK, quant.WEIGHT_BLOCK)
    """FP8 weight block (``weight_block_size``)."""

    @classmethod
    def float_checkpoint(cls) -> QuantFormat:
        return cls(quantized=False, scale_fmt=None)

    @property
    def fp8_scale_dtype(self) -> str:
        """safetensors code of the FP8 block scales: F8_E8M0 with FP4 experts, F32 with FP8 experts (vLLM)."""
        return "F8_E8M0" if self.expert_dtype == "fp4" else "F32"

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> QuantFormat:
        """Read ``quantization_config`` (+ top-level ``expert_dtype``, default ``fp4`` like vLLM) of a config.json.

        Raises :class:`ABIError` (``config.invalid``) for a quantisation this loader does not implement.
        """
        qc = hf.get("quantization_config")
        if qc is None:
            return cls.float_checkpoint()
        issues: list[Issue] = []

        def bad(key: str, expected: Any, actual: Any, fix: str) -> None:
            issues.append(Issue("config.invalid", f"config.json:quantization_config.{key}",
                                f"unsupported {key} {actual!r}", expected=expected, actual=repr(actual), fix=fix))

        if not isinstance(qc, Mapping):
            raise ABIError([Issue("config.invalid", "config.json:quantization_config", "must be an object",
                                  expected="object", actual=type(qc).__name__,
                                  fix="use the quantization_config of the DeepSeek-V4 config.json")])
        if qc.get("quant_method") != "fp8":
            bad("quant_method", "fp8", qc.get("quant_method"), "only DeepSeek's FP8 block format is implemented")
        if qc.get("fmt", "e4m3") != "e4m3":
            bad("fmt", "e4m3", qc.get("fmt"), "FP8 weights must be e4m3 (float8_e4m3fn)")
        block = qc.get("weight_block_size", [quant.WEIGHT_BLOCK, quant.WEIGHT_BLOCK])
        if list(block) != [quant.WEIGHT_BLOCK, quant.WEIGHT_BLOCK]:
            bad("weight_block_size", [128, 128], block, "only 128x128 weight blocks are implemented")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            bad("scale_fmt", "ue8m0 or absent", scale_fmt, "use power-of-two (ue8m0) or float scales")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            bad("activation_scheme", "dynamic", qc.get("activation_scheme"),
                "DeepSeek-V4 quantises activations dynamically per block")
        expert = hf.get("expert_dtype") or "fp4"
        expert_dtype: Literal["fp4", "fp8"] = "fp8" if expert == "fp8" else "fp4"
        if expert not in ("fp4", "fp8"):
            issues.append(Issue("config.invalid", "config.json:expert_dtype", f"unsupported expert_dtype {expert!r}",
                                expected="fp4 or fp8", actual=repr(expert),
                                fix="routed experts are FP4 (e2m1, V4-Flash) or FP8 (V4-Flash-Base)"))
        if issues:
            raise ABIError(issues)
        return cls(quantized=True, expert_dtype=expert_dtype, scale_fmt=scale_fmt)


@attrs.frozen
class DraftLayout:
    """The speculative-decoding layers a checkpoint carries under ``mtp.*``.

    ``nextn``: DeepSeek-V3-style MTP (``num_nextn_predict_layers``, V4-Flash). ``dspark``: the DSpark drafter
    (any ``dspark_*`` key; stages from ``n_mtp_layers``, default 3 like vLLM's ``dspark.py``).
    """

    kind: Literal["none", "nextn", "dspark"] = "none"
    stages: int = 0
    markov_rank: int = 0
    target_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> DraftLayout:
        """Read the draft layers of a config.json; raises :class:`ABIError` (``config.invalid``) for bad keys."""
        if any(k.startswith("dspark_") for k in hf):
            issues = []
            targets = hf.get("dspark_target_layer_ids")
            rank = hf.get("dspark_markov_rank")
            stages = hf.get("n_mtp_layers") or 3
            target_ids: tuple[int, ...] = ()
            if isinstance(targets, list | tuple) and all(isinstance(t, int) for t in targets):
                target_ids = tuple(targets)
            if not target_ids:
                issues.append(Issue("config.invalid", "config.json:dspark_target_layer_ids",
                                    "must be a non-empty list of layer ids", expected="e.g. [40, 41, 42]",
                                    actual=repr(targets), fix="copy dspark_target_layer_ids from the DSpark config"))
            markov_rank = rank if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 else 0
            if not markov_rank:
                issues.append(Issue("config.invalid", "config.json:dspark_markov_rank", "must be a positive int",
                                    expected="e.g. 256", actual=repr(rank),
                                    fix="copy dspark_markov_rank from the DSpark config"))
            if not (isinstance(stages, int) and stages > 0):
                issues.append(Issue("config.invalid", "config.json:n_mtp_layers", "must be a positive int",
                                    expected="e.g. 3", actual=repr(stages), fix="drop the key (default 3)"))
            if issues:
                raise ABIError(issues)
            return cls("dspark", stages, markov_rank, target_ids)
        n = hf.get("num_nextn_predict_layers") or 0
        return cls("nextn", int(n)) if n else cls()


# ---------------------------------------------------------------------------------------------- the table
@attrs.frozen
class TensorFormat:
    """One checkpoint tensor: logical (dequantised) shape, the kind shipped, the kinds accepted."""

    name: str
    shape: tuple[int, ...]
    kind: Kind
    """What the official checkpoint stores (``fp8_block`` / ``fp4_block`` / ``float`` / ``int``)."""
    shipped: str
    """The shipped safetensors dtype(s), for documentation and errors (e.g. ``"F8_E4M3 + F8_E8M0 scale"``)."""
    accepts: tuple[Kind, ...]
    """Kinds :class:`ShardIndex` accepts for this name (a dequantised float copy is always accepted)."""
    scale_dtype: str | None = None
    """safetensors code of the shipped scale (quantised kinds only)."""
    optional: bool = False
    """Absent in some releases (the DSpark confidence head is optional in vLLM too)."""

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        """Shape of the ``.scale`` companion for the shipped kind (None for unquantised kinds)."""
        if self.kind == "fp8_block":
            return quant.fp8_scale_shape(self.shape)  # type: ignore[arg-type]
        if self.kind == "fp4_block":
            return quant.fp4_scale_shape(self.shape)  # type: ignore[arg-type]
        return None


def _f(name: str, shape: tuple[int, ...], shipped: str = "BF16", kind: Kind = "float") -> TensorFormat:
    return TensorFormat(name, tuple(int(s) for s in shape), kind, shipped, ("float",) if kind == "float" else (kind,))


def _proj(name: str, shape: tuple[int, int], q: QuantFormat, kind: Kind = "fp8_block") -> TensorFormat:
    if not q.quantized:
        return TensorFormat(name, shape, "float", "BF16", _PROJECTION_KINDS)
    if kind == "fp4_block":
        return TensorFormat(name, shape, kind, "I8 (2 x e2m1 per byte) + F8_E8M0 scale", _PROJECTION_KINDS,
                            "F8_E8M0")
    return TensorFormat(name, shape, "fp8_block", f"F8_E4M3 + {q.fp8_scale_dtype} scale", _PROJECTION_KINDS,
                        q.fp8_scale_dtype)


def attention_formats(config: ModelConfig, q: QuantFormat, prefix: str, ratio: int) -> list[TensorFormat]:
    """The attention tensors of one block (``prefix`` ends with ``attn.``); ``ratio`` its compress ratio."""
    c = config
    x, d, h, g, ql = c.hidden_size, c.head_dim, c.num_attention_heads, c.o_groups, c.q_lora_rank
    out = [
        _proj(prefix + "wq_a.weight", (ql, x), q), _f(prefix + "q_norm.weight", (ql,)),
        _proj(prefix + "wq_b.weight", (h * d, ql), q),
        _proj(prefix + "wkv.weight", (d, x), q), _f(prefix + "kv_norm.weight", (d,)),
        _proj(prefix + "wo_a.weight", (g * c.o_lora_rank, h * d // g), q),
        _proj(prefix + "wo_b.weight", (x, g * c.o_lora_rank), q),
        _f(prefix + "attn_sink", (h,), "F32"),
    ]
    if ratio:
        coff = 2 if ratio == 4 else 1
        p = prefix + "compressor."
        out += [_f(p + "wkv.weight", (coff * d, x)), _f(p + "wgate.weight", (coff * d, x)),
                _f(p + "ape", (ratio, coff * d), "F32"), _f(p + "norm.weight", (d,))]
    if ratio == 4:
        hi, di = c.index_n_heads, c.index_head_dim
        p = prefix + "indexer."
        out += [_proj(p + "wq_b.weight", (hi * di, ql), q), _f(p + "weights_proj.weight", (hi, x)),
                _f(p + "compressor.wkv.weight", (2 * di, x)), _f(p + "compressor.wgate.weight", (2 * di, x)),
                _f(p + "compressor.ape", (4, 2 * di), "F32"), _f(p + "compressor.norm.weight", (di,))]
    return out


def block_formats(config: ModelConfig, q: QuantFormat, prefix: str, *, ratio: int, hash_routed: bool
                  ) -> list[TensorFormat]:
    """Every tensor of one decoder block under ``prefix`` (``layers.{i}.`` or ``mtp.{s}.``)."""
    c, m = config, config.moe
    d, hc, e, inter = c.hidden_size, c.hc_mult, m.n_routed_experts, m.moe_intermediate_size
    mix, shared = (2 + hc) * hc, m.n_shared_experts * inter
    out = attention_formats(config, q, prefix + "attn.", ratio)
    out += [_f(prefix + "attn_norm.weight", (d,)), _f(prefix + "ffn_norm.weight", (d,))]
    for which in ("attn", "ffn"):
        out += [_f(prefix + f"hc_{which}_fn", (mix, hc * d), "F32"), _f(prefix + f"hc_{which}_scale", (3,), "F32"),
                _f(prefix + f"hc_{which}_base", (mix,), "F32")]
    out.append(_f(prefix + "ffn.gate.weight", (e, d)))
    if hash_routed:
        out.append(_f(prefix + "ffn.gate.tid2eid", (c.vocab_size, m.num_experts_per_tok), "I32", "int"))
    else:
        out.append(_f(prefix + "ffn.gate.bias", (e,), "F32"))
    expert_kind: Kind = "fp4_block" if q.expert_dtype == "fp4" else "fp8_block"
    for i in range(e):
        p = f"{prefix}ffn.experts.{i}."
        out += [_proj(p + "w1.weight", (inter, d), q, expert_kind), _proj(p + "w2.weight", (d, inter), q, expert_kind),
                _proj(p + "w3.weight", (inter, d), q, expert_kind)]
    if shared:
        p = prefix + "ffn.shared_experts."
        out += [_proj(p + "w1.weight", (shared, d), q), _proj(p + "w2.weight", (d, shared), q),
                _proj(p + "w3.weight", (shared, d), q)]
    return out


def _head(prefix: str, config: ModelConfig) -> list[TensorFormat]:
    d, hc = config.hidden_size, config.hc_mult
    return [_f(prefix + "hc_head_fn", (hc, hc * d), "F32"), _f(prefix + "hc_head_scale", (1,), "F32"),
            _f(prefix + "hc_head_base", (hc,), "F32")]


def draft_formats(config: ModelConfig, q: QuantFormat, draft: DraftLayout) -> list[TensorFormat]:
    """The ``mtp.*`` tensors of ``draft`` (SWA attention and learned gates, as ``MTPBlock`` / DSpark stages)."""
    d, v = config.hidden_size, config.vocab_size
    out: list[TensorFormat] = []
    for s in range(draft.stages):
        p = f"mtp.{s}."
        out += block_formats(config, q, p, ratio=0, hash_routed=False)
        if draft.kind == "nextn":
            out += [_proj(p + "e_proj.weight", (d, d), q), _proj(p + "h_proj.weight", (d, d), q),
                    _f(p + "enorm.weight", (d,)), _f(p + "hnorm.weight", (d,)), _f(p + "norm.weight", (d,))]
            out += _head(p, config)
            continue
        if s == 0:
            out += [_proj(p + "main_proj.weight", (d, len(draft.target_layers) * d), q),
                    _f(p + "main_norm.weight", (d,))]
        if s == draft.stages - 1:
            r = draft.markov_rank
            out += [_f(p + "norm.weight", (d,)), *_head(p, config),
                    _f(p + "markov_head.markov_w1.weight", (v, r)), _f(p + "markov_head.markov_w2.weight", (v, r)),
                    attrs.evolve(_f(p + "confidence_head.proj.weight", (1, d + r)), optional=True)]
    return out


def model_formats(config: ModelConfig, q: QuantFormat, draft: DraftLayout | None = None) -> dict[str, TensorFormat]:
    """The whole checkpoint: name -> :class:`TensorFormat` (embed, every layer, head, then the draft layers)."""
    d, v = config.hidden_size, config.vocab_size
    out = [_f("embed.weight", (v, d))]
    for i in range(config.num_layers):
        out += block_formats(config, q, f"layers.{i}.", ratio=config.compress_ratios[i],
                             hash_routed=i < config.moe.num_hash_layers)
    out += [_f("norm.weight", (d,)), _f("head.weight", (v, d)), *_head("", config)]
    if draft is not None:
        out += draft_formats(config, q, draft)
    return {f.name: f for f in out}


# ---------------------------------------------------------------------------------------------- shards
@attrs.frozen
class StoredTensor:
    """Where one tensor's bytes are: file, safetensors dtype code, stored shape, absolute offset, length."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _unreadable(path: Path, message: str, fix: str, actual: Any = None) -> ABIError:
    return ABIError([Issue("fixture.unreadable", str(path), message, expected="a safetensors shard",
                           actual=actual, fix=fix)])


def read_header(path: str | Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Parse one safetensors header (no tensor data is read): name -> :class:`StoredTensor`, and metadata.

    Checks the header length, JSON, every entry's dtype/shape/offsets against the file size. Raises
    :class:`ABIError` (``fixture.unreadable``) naming the file and what is wrong.
    """
    path = Path(path)
    redo = "re-download or re-write the shard; a complete safetensors file is required"
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _unreadable(path, "shorter than the 8-byte header length", redo, actual=size)
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise _unreadable(path, f"header length {n} exceeds the file ({size} bytes) or the 100 MB limit",
                                  redo, actual=n)
            raw = fh.read(n)
    except OSError as exc:
        raise _unreadable(path, f"cannot read: {exc.strerror or exc}", "check the path and permissions",
                          actual=type(exc).__name__) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _unreadable(path, f"header is not JSON ({exc})", redo) from None
    if not isinstance(header, dict):
        raise _unreadable(path, "header is not a JSON object", redo)
    start = 8 + n
    tensors: dict[str, StoredTensor] = {}
    meta = header.pop("__metadata__", None) or {}
    for name, entry in header.items():
        try:
            dtype, shape, (lo, hi) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
            lo, hi = int(lo), int(hi)
        except (KeyError, TypeError, ValueError):
            raise _unreadable(path, f"malformed header entry for {name!r}", redo, actual=repr(entry)[:80]) from None
        if any(s < 0 for s in shape) or not 0 <= lo <= hi or start + hi > size:
            raise _unreadable(path, f"{name!r}: bytes [{lo}, {hi}) lie outside the file's data", redo,
                              actual=[lo, hi])
        np_dtype = ST_DTYPES.get(dtype)
        if np_dtype is not None and hi - lo != int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize:
            raise _unreadable(path, f"{name!r}: {hi - lo} bytes do not hold {dtype} {list(shape)}", redo,
                              actual=hi - lo)
        tensors[name] = StoredTensor(name, path, str(dtype), shape, start + lo, hi - lo)
    return tensors, {str(k): str(v) for k, v in meta.items()}


def _map_region(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """Read-only memory map of ``nbytes`` bytes at ``offset`` (the only place tensor bytes are touched)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))


class ShardIndex:
    """Tensors of one checkpoint spread over safetensors shards, mapped lazily.

    Construction reads every shard's header (and ``model.safetensors.index.json`` when a directory has one);
    :meth:`raw` memory-maps one tensor's bytes, :meth:`tensor` dequantises one tensor (and its ``.scale``) to
    float32. Nothing else is read. F8_E4M3 / F8_E8M0 tensors are viewed as ``ml_dtypes`` (safetensors' numpy
    backend cannot return them). Also a weight source for ``ModelWeights`` (:meth:`info`, :meth:`load`).
    """

    def __init__(self, paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]):
        self.unreadable: list[Issue] = []  # ModelWeights' source protocol; errors are raised instead
        files, weight_map = _resolve(paths)
        self._stored: dict[str, StoredTensor] = {}
        issues: list[Issue] = []
        for path in files:
            tensors, _ = read_header(path)
            for name, st in tensors.items():
                if name in self._stored:
                    issues.append(Issue("fixture.tensors", name, f"stored in both {self._stored[name].path.name} "
                                        f"and {path.name}", expected="one shard", actual="two",
                                        fix="remove the stale shard from the directory"))
                self._stored[name] = st
        for name, file in (weight_map or {}).items():
            listed = self._stored.get(name)
            if listed is None or listed.path.name != Path(file).name:
                issues.append(Issue("array.missing", name, f"{INDEX_FILE} lists it in {file} but that shard's header "
                                    "does not hold it", expected=file, actual=listed.path.name if listed else "missing",
                                    fix=f"re-download {file} (or the index)"))
        if issues:
            raise ABIError(issues)

    # ------------------------------------------------------------------ headers
    @property
    def names(self) -> tuple[str, ...]:
        """Every stored tensor name (including ``.scale`` companions), sorted."""
        return tuple(sorted(self._stored))

    def __contains__(self, name: object) -> bool:
        return name in self._stored

    def __len__(self) -> int:
        return len(self._stored)

    def stored(self, name: str) -> StoredTensor:
        """Header entry of ``name``; raises :class:`ABIError` (``array.missing``) when the checkpoint lacks it."""
        st = self._stored.get(name)
        if st is None:
            near = [n for n in self._stored if n.endswith(name.rsplit(".", 2)[-1])][:3]
            raise ABIError([Issue("array.missing", name, "not in any shard", expected="present", actual="missing",
                                  fix="check the checkpoint name" + (f" (similar: {', '.join(near)})" if near else "")
                                  + " or download the missing shard")])
        return st

    def scale_name(self, name: str) -> str | None:
        """The scale companion of ``name`` (``X.scale``, or the V3-style ``X.weight_scale_inv``), if stored."""
        if not name.endswith(".weight"):
            return None
        for cand in (name[: -len(".weight")] + ".scale", name + "_scale_inv"):
            if cand in self._stored:
                return cand
        return None

    def kind(self, name: str) -> Kind:
        """The stored kind of ``name``, inferred from its dtype and its scale companion's shape."""
        st = self.stored(name)
        code = st.dtype
        if code in _FLOAT_CODES:
            return "float"
        if code in _INT_CODES:
            return "int"
        scale = self.scale_name(name)
        if code == "F8_E4M3":
            if scale is None:
                raise ABIError([_no_scale(name, "F8_E4M3")])
            return "fp8_block"
        if code in ("I8", "U8") and len(st.shape) >= 1:
            if scale is None:
                raise ABIError([_no_scale(name, code)])
            s_shape = self._stored[scale].shape
            if len(st.shape) == 2 and s_shape == quant.fp4_scale_shape((st.shape[0], 2 * st.shape[1])):
                return "fp4_block"
            if code == "I8" and s_shape == st.shape[:-1]:
                return "int8_channel"
            raise ABIError([Issue("array.shape", scale, f"scale {list(s_shape)} fits neither FP4 1x32 blocks nor "
                                  f"int8 per-channel scales of {code} {list(st.shape)}",
                                  expected=[list(quant.fp4_scale_shape((st.shape[0], 2 * st.shape[-1]))),
                                            list(st.shape[:-1])], actual=list(s_shape),
                                  fix="store FP4 scales [out, in/32] or int8 scales [out]")])
        raise ABIError([Issue("array.dtype", name, f"stored as {code}, which this loader does not read",
                              expected="F8_E4M3, I8/U8 (+ .scale), BF16, F16, F32, F64 or I16/I32/I64",
                              actual=code, fix="dequantise or convert this tensor to a supported dtype")])

    def logical_shape(self, name: str) -> tuple[int, ...]:
        """Shape of the dequantised tensor (FP4: twice the stored last axis)."""
        st = self.stored(name)
        if self.kind(name) == "fp4_block":
            return st.shape[0], 2 * st.shape[1]
        return st.shape

    def companions(self) -> set[str]:
        """Names that are the scale of a quantised tensor."""
        out = set()
        for name, st in self._stored.items():
            if st.dtype in ("F8_E4M3", "I8", "U8"):
                s = self.scale_name(name)
                if s is not None:
                    out.add(s)
        return out

    # ------------------------------------------------------------------ data
    def raw(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only memory-mapped array of its own dtype (ml_dtypes for F8 codes)."""
        st = self.stored(name)
        np_dtype = ST_DTYPES.get(st.dtype)
        if np_dtype is None:
            raise ABIError([Issue("array.dtype", name, f"stored as {st.dtype}, which this loader does not read",
                                  expected=sorted(ST_DTYPES), actual=st.dtype,
                                  fix="convert this tensor to a supported dtype")])
        return np.asarray(_map_region(st.path, st.offset, st.nbytes)).view(np_dtype).reshape(st.shape)

    def tensor(self, name: str, expect: TensorFormat | None = None) -> np.ndarray:
        """``name`` dequantised: float32 (floats, FP8 blocks, FP4 blocks, int8 channels) or its int dtype.

        Reads only ``name`` and its scale. With ``expect`` the stored kind must be one ``expect.accepts`` and
        the logical shape must equal ``expect.shape``. Raises :class:`ABIError` (``array.missing`` /
        ``array.dtype`` / ``array.shape``) with a fix naming the tensor.
        """
        if expect is not None:
            if expect.name != name:
                raise ValueError(f"expect describes {expect.name!r}, not {name!r}")
            problems = self._check(expect, strict=False)
            if problems:
                raise ABIError(problems)
        kind = self.kind(name)
        if kind == "float":
            return np.array(self.raw(name), dtype=np.float32, copy=True)
        if kind == "int":
            return np.array(self.raw(name))
        scale = self.scale_name(name)
        assert scale is not None  # kind() guarantees a companion
        s_st = self._stored[scale]
        if s_st.dtype not in _SCALE_CODES:
            raise ABIError([Issue("array.dtype", scale, f"scale stored as {s_st.dtype}", expected=list(_SCALE_CODES),
                                  actual=s_st.dtype, fix="store scales as F8_E8M0 (ue8m0) or F32")])
        q, s = self.raw(name), self.raw(scale)
        if kind == "fp8_block":
            if q.ndim != 2:
                raise ABIError([Issue("array.shape", name, "FP8 block weights must be 2-D [out, in]",
                                      expected="[out, in]", actual=list(q.shape), fix="store the weight as [out, in]")])
            want = quant.fp8_scale_shape(q.shape)
            if s.shape != want:
                raise ABIError([Issue("array.shape", scale, f"FP8 scale of {list(q.shape)} must be [ceil(out/128), "
                                      "ceil(in/128)]", expected=list(want), actual=list(s.shape),
                                      fix="store one scale per 128x128 block of the weight")])
            return quant.dequant_fp8_blocks(q, s)
        if kind == "fp4_block":
            return quant.dequant_fp4_blocks(q, s)
        return quant.dequant_int8_channels(q, s, axis=-1)

    # ------------------------------------------------------------------ validation
    def _check(self, fmt: TensorFormat, *, strict: bool) -> list[Issue]:
        name = fmt.name
        if name not in self._stored:
            return [] if fmt.optional else [Issue("array.missing", name, f"required (shipped as {fmt.shipped})",
                                                  expected=list(fmt.shape), actual="missing",
                                                  fix="download the shard holding it or fix the checkpoint names")]
        try:
            kind, shape = self.kind(name), self.logical_shape(name)
        except ABIError as err:
            return list(err.issues)
        code = self._stored[name].dtype
        allowed = (fmt.kind,) if strict else fmt.accepts
        out = []
        if kind not in allowed:
            out.append(Issue("array.dtype", name, f"stored as {code} ({kind}); expected {fmt.shipped}",
                             expected=list(allowed), actual=kind,
                             fix=f"store {name} as {fmt.shipped}" + ("" if strict else " or a float copy")))
        if shape != fmt.shape:
            out.append(Issue("array.shape", name, "logical shape differs from the config", expected=list(fmt.shape),
                             actual=list(shape), fix="use the checkpoint that matches config.json"))
        scale = self.scale_name(name)
        if kind == "fp8_block" and scale is not None:
            st = self._stored[name]
            want = quant.fp8_scale_shape(st.shape) if len(st.shape) == 2 else None
            got = self._stored[scale].shape
            if got != want:
                out.append(Issue("array.shape", scale, "FP8 scale must be [ceil(out/128), ceil(in/128)]",
                                 expected=list(want) if want else "a 2-D weight", actual=list(got),
                                 fix="store one scale per 128x128 block of the weight"))
        if kind in _QUANTISED_KINDS and scale is not None:
            s_code = self._stored[scale].dtype
            if s_code not in _SCALE_CODES or (strict and fmt.scale_dtype and s_code != fmt.scale_dtype
                                              and not (s_code == "U8" and fmt.scale_dtype == "F8_E8M0")):
                out.append(Issue("array.dtype", scale, f"scale stored as {s_code}",
                                 expected=fmt.scale_dtype or list(_SCALE_CODES), actual=s_code,
                                 fix="store scales as F8_E8M0 (ue8m0) or F32"))
        return out

    def validate(self, formats: Mapping[str, TensorFormat] | Iterable[TensorFormat], *,
                 strict: bool = False) -> ValidationReport:
        """Every missing, mis-typed or mis-shaped tensor of ``formats`` (headers only; no data is read).

        ``strict``: require exactly the shipped kind and scale dtype (else any accepted kind, e.g. a float copy).
        """
        fmts = formats.values() if isinstance(formats, Mapping) else formats
        return ValidationReport(tuple(i for f in fmts for i in self._check(f, strict=strict)))

    def require(self, formats: Mapping[str, TensorFormat] | Iterable[TensorFormat], *, strict: bool = False) -> None:
        """:meth:`validate`, raising :class:`ABIError` with every issue."""
        self.validate(formats, strict=strict).raise_if_invalid()

    # ------------------------------------------------------------------ ModelWeights source protocol
    def info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Logical name -> (logical shape, dtype name) of every tensor but scale companions."""
        skip = self.companions()
        out = {}
        for name, st in self._stored.items():
            if name in skip:
                continue
            try:
                kind = self.kind(name)
            except ABIError:
                out[name] = (st.shape, st.dtype)
                continue
            out[name] = (self.logical_shape(name), "float32" if kind != "int" else str(ST_DTYPES[st.dtype]))
        return out

    def load(self, name: str) -> np.ndarray:
        """:meth:`tensor` (float32 or int)."""
        return self.tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)


def _no_scale(name: str, code: str) -> Issue:
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return Issue("array.missing", base + ".scale", f"{name} is {code} but its scale is not stored",
                 expected="present", actual="missing", fix=f"store {base}.scale next to {name}")


def _resolve(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]
             ) -> tuple[list[Path], dict[str, str] | None]:
    """Shard files of a directory (its index, else every ``*.safetensors``), a file, or a list of files."""
    if isinstance(paths, str | os.PathLike):
        p = Path(paths)
        if p.is_dir():
            index = p / INDEX_FILE
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                    files = sorted({p / str(f) for f in weight_map.values()})
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                    raise _unreadable(index, f"not a readable index ({exc})", "re-download the index") from None
                return files, {str(k): str(v) for k, v in weight_map.items()}
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise _unreadable(p, "no *.safetensors files in the directory", "point at the checkpoint directory")
            return files, None
        return [p], None
    files = [Path(f) for f in paths]
    if not files:
        raise ABIError([Issue("fixture.unreadable", "paths", "no shard files given", expected="one or more files",
                              actual=0, fix="pass the checkpoint directory or its shard files")])
    return files, None
