"""Ready-made configurations: ``FLASH`` (DeepSeek-V4-Flash), ``DEMO`` and ``TINY``."""

from __future__ import annotations

from dspark_abi.config import ModelConfig, MoEConfig, RopeScaling

_FLASH_YARN = RopeScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)

#: DeepSeek-V4-Flash: 43 layers (SWA 0-1, then CSA/HCA alternating, CSA last), 16384 positions
#: as upstream's a2a3 kernels size their tables.
FLASH = ModelConfig(
    name="flash",
    hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, rms_norm_eps=1e-6,
    index_n_heads=64, index_head_dim=128, index_topk=512,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4,),
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_scaling=_FLASH_YARN,
    max_position_embeddings=16384, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, vocab_size=129280,
    moe=MoEConfig(n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, n_shared_experts=1,
                  num_hash_layers=3, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0),
)

#: Upstream's DEMO: FLASH head sizes, 8 layers, 4096 positions, compress theta 40000 without YaRN.
DEMO = FLASH.model_copy(update={
    "name": "demo",
    "compress_ratios": (0, 0, 4, 128, 4, 128, 4, 0),
    "compress_rope_theta": 40000.0,
    "rope_scaling": RopeScaling(factor=40.0, original_max_position_embeddings=0, beta_fast=32.0, beta_slow=1.0),
    "max_position_embeddings": 4096,
    "moe": FLASH.moe.model_copy(update={"n_routed_experts": 16, "num_experts_per_tok": 2}),
})

#: Small enough for tests and demos on any CPU, with every layer kind (SWA, CSA, HCA).
TINY = ModelConfig(
    name="tiny",
    hidden_size=128, num_attention_heads=8, head_dim=128, qk_rope_head_dim=64,
    q_lora_rank=64, o_groups=4, o_lora_rank=32, sliding_window=16, rms_norm_eps=1e-6,
    index_n_heads=8, index_head_dim=128, index_topk=8,
    compress_ratios=(0, 4, 128, 4),
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_scaling=_FLASH_YARN,
    max_position_embeddings=4096, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, vocab_size=1024,
    moe=MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                  num_hash_layers=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0),
)

PRESETS: dict[str, ModelConfig] = {"flash": FLASH, "demo": DEMO, "tiny": TINY}


def get_preset(name: str) -> ModelConfig:
    """Look up a preset by name (case-insensitive)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
