"""The stored format of every DeepSeek-V4(-Flash/-DSpark) checkpoint tensor (the name -> format table).

One home for "which name holds what": :func:`model_formats` (whole checkpoint) and :func:`block_formats`
(one decoder layer, an MTP layer or a DSpark stage) map checkpoint names to a :class:`TensorFormat` (logical
shape, the kind the official checkpoint ships, the kinds this loader accepts). The lazy reader that checks
shards against this table is :class:`~dspark_kernels.model.shard_index.ShardIndex`.

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

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_kernels.model import quant

Kind = Literal["fp8_block", "fp4_block", "int8_channel", "float", "int"]
KINDS: tuple[Kind, ...] = ("fp8_block", "fp4_block", "int8_channel", "float", "int")
#: Kinds accepted where the official checkpoint ships a quantised projection (float = dequantised copy).
_PROJECTION_KINDS: tuple[Kind, ...] = ("fp8_block", "fp4_block", "int8_channel", "float")


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

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` keys :meth:`from_hf_config` reads back to this format (none for a float checkpoint)."""
        if not self.quantized:
            return {}
        qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.weight_block),
                              "activation_scheme": "dynamic"}
        if self.scale_fmt is not None:
            qc["scale_fmt"] = self.scale_fmt
        return {"quantization_config": qc, "expert_dtype": self.expert_dtype}

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
    """Kinds :class:`~dspark_kernels.model.shard_index.ShardIndex` accepts for this name (a dequantised float
    copy is always accepted)."""
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
