"""Ready-made configurations: ``FLASH`` (DeepSeek-V4-Flash at its 1,048,576 positions), ``FLASH_16K`` (the same
model at the 16,384 positions of upstream's a2a3 fixtures), ``FLASH_DSPARK`` (with the DSpark drafter's target
layers), ``DEMO``, ``TINY``, ``TINY_1M`` and ``TINY_DSPARK``."""

from __future__ import annotations

from dspark_abi.config import ModelConfig, MoEConfig, RopeScaling

_FLASH_YARN = RopeScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)

#: The model's real depth: YaRN factor 16 over the original 65,536 positions.
REAL_MAX_POSITIONS = 1_048_576

#: DeepSeek-V4-Flash: 43 layers (SWA 0-1, then CSA/HCA alternating, CSA last) at its 1,048,576 positions.
FLASH = ModelConfig(
    name="flash",
    hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, rms_norm_eps=1e-6,
    index_n_heads=64, index_head_dim=128, index_topk=512,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4,),
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_scaling=_FLASH_YARN,
    max_position_embeddings=REAL_MAX_POSITIONS, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, vocab_size=129280,
    moe=MoEConfig(n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, n_shared_experts=1,
                  num_hash_layers=3, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0),
)

#: FLASH at the 16,384 positions upstream's a2a3 fixtures size their tables for (its goldens use this depth).
FLASH_16K = FLASH.model_copy(update={"name": "flash-16k", "max_position_embeddings": 16384})

#: Upstream's DEMO (FLASH head sizes, 8 layers, compress theta 40000 without YaRN), scaled to the real depth.
DEMO = FLASH.model_copy(update={
    "name": "demo",
    "compress_ratios": (0, 0, 4, 128, 4, 128, 4, 0),
    "compress_rope_theta": 40000.0,
    "rope_scaling": RopeScaling(factor=40.0, original_max_position_embeddings=0, beta_fast=32.0, beta_slow=1.0),
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

#: TINY's heads at the real depth: 1M-position tables (ring and trimmed) on any CPU.
TINY_1M = TINY.model_copy(update={"name": "tiny-1m", "max_position_embeddings": REAL_MAX_POSITIONS})

#: DeepSeek-V4-Flash-DSpark's target model: FLASH whose layers 40, 41 and 42 feed the DSpark drafter
#: (``dspark_target_layer_ids`` of the DSpark checkpoint's config.json).
#: Its drafter proposes blocks of ``dspark_block_size`` = 5 drafts: a verify request holds up to 6 rows.
#: Its drafter: 3 stages, a Markov head of rank 256, noise token 128799 (the checkpoint's config.json).
FLASH_DSPARK = FLASH.model_copy(update={"name": "flash-dspark", "dspark_target_layers": (40, 41, 42),
                                        "dspark_block_size": 5, "dspark_noise_token_id": 128799,
                                        "dspark_markov_rank": 256, "n_mtp_layers": 3})
#: TINY with the same shape of drafter features: its last three layers; blocks of 3 drafts (verify width <= 4).
#: Its drafter: 3 stages of TINY's sizes, FLASH's Markov rank 256, noise token 0 (DeepSeek's defaults).
TINY_DSPARK = TINY.model_copy(update={"name": "tiny-dspark", "dspark_target_layers": (1, 2, 3),
                                      "dspark_block_size": 3})

PRESETS: dict[str, ModelConfig] = {"flash": FLASH, "flash-16k": FLASH_16K, "flash-dspark": FLASH_DSPARK,
                                   "demo": DEMO, "tiny": TINY, "tiny-1m": TINY_1M, "tiny-dspark": TINY_DSPARK}


def get_preset(name: str) -> ModelConfig:
    """Look up a preset by name (case-insensitive)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
