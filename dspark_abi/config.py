"""The attention-relevant DeepSeek-V4 model configuration (`ModelConfig`) and its HF loader."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from dspark_abi._base import StrictModel
from dspark_abi.errors import ABIError, Issue
from dspark_abi.layout import CacheLayout

LayerKind = Literal["swa", "csa", "hca"]
_KIND_BY_RATIO: dict[int, LayerKind] = {0: "swa", 4: "csa", 128: "hca"}


class RopeScaling(StrictModel):
    """YaRN frequency scaling, applied to compressed (CSA/HCA) layers only."""

    type: Literal["yarn"] = "yarn"
    """Scaling kind; DeepSeek-V4 uses YaRN."""
    factor: float = Field(gt=0)
    """Frequency division factor for the long-wavelength pairs (16 for V4-Flash)."""
    original_max_position_embeddings: int = Field(ge=0)
    """Context the base frequencies were trained for; 0 disables the YaRN correction."""
    beta_fast: float = Field(gt=0)
    """YaRN fast boundary (rotations per context)."""
    beta_slow: float = Field(gt=0)
    """YaRN slow boundary (rotations per context)."""


class MoEConfig(StrictModel):
    """Mixture-of-experts keys (used by the FFN stage, not by the metadata ABI)."""

    n_routed_experts: int = Field(ge=1)
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = Field(ge=1)
    """Experts selected per token."""
    moe_intermediate_size: int = Field(ge=1)
    """Hidden width of each expert's SwiGLU."""
    n_shared_experts: int = Field(ge=0)
    """Always-on shared experts."""
    num_hash_layers: int = Field(ge=0)
    """The first layers route by token id (hash routing) instead of the learned gate."""
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    """Gate scoring function."""
    routed_scaling_factor: float = Field(gt=0)
    """Multiplier applied to the routed experts' combined output."""
    swiglu_limit: float = Field(ge=0)
    """Clamp applied inside SwiGLU (0 disables it)."""
    norm_topk_prob: bool = True
    """Renormalise the selected experts' weights to sum to one."""


class ModelConfig(StrictModel):
    """Attention-relevant DeepSeek-V4 configuration; frozen, strict, hashable.

    Everything the metadata ABI derives (table widths, state lengths, pool row shapes) comes
    from this object through :attr:`layout`.
    """

    name: str = Field(min_length=1)
    """Human-readable preset or checkpoint name; recorded in fixture manifests."""
    hidden_size: int = Field(ge=1)
    """Model width D."""
    num_attention_heads: int = Field(ge=1)
    """Query heads H."""
    head_dim: int = Field(ge=2)
    """Latent head dim (K = V); the last ``qk_rope_head_dim`` dims carry RoPE."""
    qk_rope_head_dim: int = Field(ge=2)
    """RoPE dims (interleaved pairs, at the end of every head)."""
    q_lora_rank: int = Field(ge=1)
    """Low-rank query width."""
    o_groups: int = Field(ge=1)
    """Output-projection groups; heads are split evenly across them."""
    o_lora_rank: int = Field(ge=1)
    """Low-rank width of each output group."""
    sliding_window: int = Field(ge=1)
    """Window W: a query sees its own token plus the W - 1 previous ones."""
    rms_norm_eps: float = Field(gt=0)
    """RMSNorm epsilon."""
    index_n_heads: int = Field(ge=1)
    """Lightning-indexer heads."""
    index_head_dim: int = Field(ge=2)
    """Lightning-indexer head dim (RoPE on its last ``qk_rope_head_dim`` dims)."""
    index_topk: int = Field(ge=1)
    """Compressed entries selected per query in CSA layers."""
    compress_ratios: tuple[Literal[0, 4, 128], ...] = Field(min_length=1)
    """Per-layer compress ratio: 0 = SWA, 4 = CSA, 128 = HCA (one entry per layer run here)."""
    rope_theta: float = Field(gt=0)
    """RoPE base of SWA-only layers (no YaRN)."""
    compress_rope_theta: float = Field(gt=0)
    """RoPE base of compressed layers (with :attr:`rope_scaling`)."""
    rope_scaling: RopeScaling | None = None
    """YaRN scaling of compressed layers; ``None`` means plain RoPE."""
    max_position_embeddings: int = Field(ge=128)
    """Positions must be < this; sizes every block table."""
    hc_mult: int = Field(ge=1)
    """Hyper-connection streams."""
    hc_sinkhorn_iters: int = Field(default=20, ge=1)
    """Sinkhorn normalisation iterations of the hyper-connection mix."""
    hc_eps: float = Field(default=1e-6, gt=0)
    """Hyper-connection epsilon."""
    vocab_size: int = Field(ge=1)
    """Vocabulary size (token ids must be < this)."""
    moe: MoEConfig
    """MoE FFN keys."""
    dspark_target_layers: tuple[int, ...] = Field(default=(), exclude_if=lambda layers: not layers)
    """Layers whose output feeds the DSpark drafter (``dspark_target_layer_ids``; ``[40, 41, 42]`` for
    DeepSeek-V4-Flash-DSpark); empty without a drafter. Omitted from dumps when empty."""
    dspark_block_size: int = Field(default=0, ge=0, le=64, exclude_if=lambda k: not k)
    """K: the most drafts the DSpark drafter proposes per block (``dspark_block_size``; 5 for
    DeepSeek-V4-Flash-DSpark), so a verify request holds 1 to 1 + K rows (:attr:`max_verify_width`); 0 without a
    drafter (a verify request is then its anchor alone). Omitted from dumps when 0."""
    dspark_noise_token_id: int = Field(default=0, ge=0, exclude_if=lambda t: not t)
    """The token id filling the DSpark drafter's block after its anchor (``dspark_noise_token_id``; 128799 for
    DeepSeek-V4-Flash-DSpark; DeepSeek's default 0); must be a vocabulary id. Omitted from dumps when 0."""
    dspark_markov_rank: int = Field(default=256, ge=1, exclude_if=lambda r: r == 256)
    """Width r of the drafter's Markov head (``dspark_markov_rank``; 256 for DeepSeek-V4-Flash-DSpark and
    DeepSeek's default). Omitted from dumps when 256."""
    n_mtp_layers: int = Field(default=3, ge=1, exclude_if=lambda n: n == 3)
    """Draft stages of the DSpark drafter (``n_mtp_layers``; 3 for DeepSeek-V4-Flash-DSpark), each a V4 block
    with sliding-window attention. Omitted from dumps when 3."""

    @model_validator(mode="after")
    def _check_dims(self) -> ModelConfig:
        problems = []
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (interleaved pairs)")
        if self.qk_rope_head_dim > self.head_dim:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be <= head_dim={self.head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim:
            problems.append(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be <= index_head_dim={self.index_head_dim}"
            )
        if self.num_attention_heads % self.o_groups:
            problems.append(f"num_attention_heads={self.num_attention_heads} must be divisible by "
                            f"o_groups={self.o_groups}")
        if self.index_head_dim & (self.index_head_dim - 1):
            problems.append(f"index_head_dim={self.index_head_dim} must be a power of two (Hadamard rotation)")
        if self.moe.num_experts_per_tok > self.moe.n_routed_experts:
            problems.append("moe.num_experts_per_tok must be <= moe.n_routed_experts")
        targets, n_layers = self.dspark_target_layers, len(self.compress_ratios)
        if targets and (list(targets) != sorted(set(targets)) or targets[0] < 0 or targets[-1] >= n_layers):
            problems.append(f"dspark_target_layers={list(targets)} must be distinct ascending layer ids in "
                            f"[0, {n_layers})")
        if self.dspark_noise_token_id >= self.vocab_size:
            problems.append(f"dspark_noise_token_id={self.dspark_noise_token_id} must be a vocabulary id "
                            f"(< vocab_size={self.vocab_size})")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ------------------------------------------------------------------ derived
    @property
    def max_verify_width(self) -> int:
        """1 + K: the most rows of one verify request (its anchor plus at most ``dspark_block_size`` drafts)."""
        return 1 + self.dspark_block_size

    @property
    def num_layers(self) -> int:
        """Layers in the schedule (``len(compress_ratios)``)."""
        return len(self.compress_ratios)

    def layer_kind(self, layer: int) -> LayerKind:
        """'swa', 'csa' or 'hca' for ``layer``."""
        return _KIND_BY_RATIO[self.compress_ratios[layer]]

    @property
    def heads_per_group(self) -> int:
        """Query heads per output group."""
        return self.num_attention_heads // self.o_groups

    @property
    def softmax_scale(self) -> float:
        """``head_dim ** -0.5`` (no YaRN mscale)."""
        scale: float = self.head_dim**-0.5  # typeshed: int ** float may be complex, hence the annotation
        return scale

    @property
    def index_weight_scale(self) -> float:
        """Lightning-indexer head-weight scale ``index_head_dim**-0.5 * index_n_heads**-0.5``."""
        scale: float = self.index_head_dim**-0.5 * self.index_n_heads**-0.5
        return scale

    @property
    def layout(self) -> CacheLayout:
        """The paged-cache layout this config implies (part of the ABI); derived once per config (a step reads it
        a few dozen times: 15 us each to derive, 1 us to look up)."""
        return _layout_of(self)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, name: str | None = None) -> ModelConfig:
        """Build from a DeepSeek-V4 ``config.json`` dictionary.

        ``compress_ratios`` may hold extra entries for multi-token-prediction layers; only the
        first ``num_hidden_layers`` are kept. ``dspark_target_layer_ids`` (DSpark checkpoints) fills
        ``dspark_target_layers``; ``quantization_config`` and the ``dspark_*`` drafter keys are read by
        ``dspark_kernels.model.checkpoint_format``. Raises :class:`ABIError` (code ``config.invalid``)
        naming every missing or bad key.
        """
        issues: list[Issue] = []

        def take(key: str, *aliases: str, default: Any = ...) -> Any:
            for k in (key, *aliases):
                if k in hf:
                    return hf[k]
            if default is ...:
                issues.append(Issue("config.invalid", f"config.json:{key}", f"required key {key!r} is missing",
                                    expected="present", actual="missing"))
                return None
            return default

        ratios = take("compress_ratios")
        n_layers = take("num_hidden_layers", "n_layers", default=None)
        if isinstance(ratios, list | tuple) and n_layers is not None:
            ratios = list(ratios)[: int(n_layers)]
        scaling = take("rope_scaling", default=None)
        if scaling is not None and isinstance(scaling, Mapping):
            scaling = {k: scaling[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
                       if k in scaling} | {"type": "yarn"}
        data = {
            "name": name or str(hf.get("_name_or_path") or hf.get("model_type") or "deepseek_v4"),
            "hidden_size": take("hidden_size", "dim"),
            "num_attention_heads": take("num_attention_heads", "n_heads"),
            "head_dim": take("head_dim"),
            "qk_rope_head_dim": take("qk_rope_head_dim", "rope_head_dim"),
            "q_lora_rank": take("q_lora_rank"),
            "o_groups": take("o_groups"),
            "o_lora_rank": take("o_lora_rank"),
            "sliding_window": take("sliding_window", "window_size"),
            "rms_norm_eps": take("rms_norm_eps", "norm_eps", default=1e-6),
            "index_n_heads": take("index_n_heads"),
            "index_head_dim": take("index_head_dim"),
            "index_topk": take("index_topk"),
            "compress_ratios": tuple(ratios) if isinstance(ratios, list | tuple) else ratios,
            "rope_theta": take("rope_theta"),
            "compress_rope_theta": take("compress_rope_theta"),
            "rope_scaling": scaling,
            "max_position_embeddings": take("max_position_embeddings", "max_seq_len"),
            "hc_mult": take("hc_mult"),
            "hc_sinkhorn_iters": take("hc_sinkhorn_iters", default=20),
            "hc_eps": take("hc_eps", default=1e-6),
            "vocab_size": take("vocab_size"),
            "moe": {
                "n_routed_experts": take("n_routed_experts"),
                "num_experts_per_tok": take("num_experts_per_tok", "n_activated_experts"),
                "moe_intermediate_size": take("moe_intermediate_size", "moe_inter_dim"),
                "n_shared_experts": take("n_shared_experts", default=1),
                "num_hash_layers": take("num_hash_layers", "n_hash_layers", default=0),
                "scoring_func": take("scoring_func", "score_func", default="sqrtsoftplus"),
                "routed_scaling_factor": take("routed_scaling_factor", "route_scale", default=1.0),
                "swiglu_limit": take("swiglu_limit", default=0.0),
                "norm_topk_prob": take("norm_topk_prob", default=True),
            },
            "dspark_target_layers": take("dspark_target_layer_ids", default=[]),
            "dspark_block_size": take("dspark_block_size", default=0),
            "dspark_noise_token_id": take("dspark_noise_token_id", default=0),
            "dspark_markov_rank": take("dspark_markov_rank", default=256),
            "n_mtp_layers": take("n_mtp_layers", default=3) or 3,
        }
        if issues:
            raise ABIError(issues)
        try:
            return cls.model_validate_json(json.dumps(data))
        except ValidationError as exc:
            raise ABIError(issues_from_pydantic(exc, prefix="config.json")) from None


    def to_hf_config(self) -> dict[str, Any]:
        """This config as DeepSeek-V4 ``config.json`` keys (what :meth:`from_hf_config` reads back to an equal
        config, ``name`` aside: a folder's config is named after the folder). Quantisation keys are written by
        ``dspark_kernels.model.checkpoint_format.QuantFormat.to_hf_config``."""
        m = self.moe
        out: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "_name_or_path": self.name,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank, "sliding_window": self.sliding_window, "rms_norm_eps": self.rms_norm_eps,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "compress_ratios": list(self.compress_ratios),
            "rope_theta": self.rope_theta, "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.model_dump(),
            "max_position_embeddings": self.max_position_embeddings, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps, "vocab_size": self.vocab_size,
            "n_routed_experts": m.n_routed_experts, "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_intermediate_size, "n_shared_experts": m.n_shared_experts,
            "num_hash_layers": m.num_hash_layers, "scoring_func": m.scoring_func,
            "routed_scaling_factor": m.routed_scaling_factor, "swiglu_limit": m.swiglu_limit,
            "norm_topk_prob": m.norm_topk_prob, "torch_dtype": "bfloat16",
        }
        if self.dspark_target_layers:
            out["dspark_target_layer_ids"] = list(self.dspark_target_layers)
        if self.dspark_block_size:
            out["dspark_block_size"] = self.dspark_block_size
            out["dspark_noise_token_id"] = self.dspark_noise_token_id
            out["dspark_markov_rank"] = self.dspark_markov_rank
            out["n_mtp_layers"] = self.n_mtp_layers
        return out


def issues_from_pydantic(exc: ValidationError, *, prefix: str, code: str = "config.invalid") -> list[Issue]:
    """Turn a pydantic ValidationError into ABI issues (one per error, with its location)."""
    out = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        out.append(Issue(code, f"{prefix}:{loc}" if loc else prefix, err["msg"],
                         expected=err["type"], actual=repr(err.get("input"))[:80]))
    return out


@functools.lru_cache(maxsize=64)
def _layout_of(config: ModelConfig) -> CacheLayout:
    """The layout of ``config`` (frozen and hashable: one derivation per distinct config)."""
    return CacheLayout.from_config(config)
