"""ModelConfig: HF loading, presets and the derived cache layout."""

import pytest
from pydantic import ValidationError

from dspark_abi import ABIError, ModelConfig
from dspark_abi.presets import DEMO, FLASH, FLASH_16K, TINY, get_preset

FLASH_HF = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "rms_norm_eps": 1e-6,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "num_hidden_layers": 43,
    "num_nextn_predict_layers": 1, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "vocab_size": 129280,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "n_shared_experts": 1,
    "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "norm_topk_prob": True,
}


def test_from_hf_config_matches_flash_preset():
    config = ModelConfig.from_hf_config(FLASH_HF, name="flash")
    assert config == FLASH
    assert config.num_layers == 43  # the MTP layer's ratio is dropped
    assert [config.layer_kind(i) for i in (0, 1, 2, 3, 42)] == ["swa", "swa", "csa", "hca", "csa"]


def test_bad_value_is_reported_with_its_key():
    with pytest.raises(ABIError) as err:
        ModelConfig.from_hf_config(dict(FLASH_HF, compress_ratios=[0, 3] + [4] * 41))
    assert any("compress_ratios" in i.field for i in err.value.issues)


def test_inconsistent_dims_rejected():
    with pytest.raises(ValidationError, match="o_groups"):
        TINY.model_validate(TINY.model_dump() | {"o_groups": 3})


def test_flash_layout_matches_upstream_table_widths():
    # at upstream's fixture depth the full widths are its kernels' table widths
    assert [p.table_width for p in FLASH_16K.layout] == [512, 128, 4, 128, 8192, 8192, 2048]
    # at the real depth: full widths ceil(2**20 / 32), ceil(2**18 / 32), ... and ring widths for the ring pools,
    # ceil((reach + 8192) / page) + 1 with reach W - 1 = 127 (ori) and state_len 8 / 8 / 128
    assert [p.table_width for p in FLASH.layout] == [32768, 8192, 256, 8192, 524288, 524288, 131072]
    assert [p.ring_width for p in FLASH.layout if p.is_ring] == [261, 4101, 4101, 1041]
    assert [p.page_size for p in FLASH.layout] == [32, 32, 32, 32, 2, 2, 8]
    assert [p.state_len for p in FLASH.layout if p.is_state] == [8, 8, 128]
    assert FLASH.layout.pools["csa_state"].row_shape == (2048,)


def test_tiny_has_every_layer_kind_and_spec_values():
    assert {TINY.layer_kind(i) for i in range(TINY.num_layers)} == {"swa", "csa", "hca"}
    assert (TINY.hidden_size, TINY.num_attention_heads, TINY.head_dim, TINY.index_topk) == (128, 8, 128, 8)
    assert TINY.max_position_embeddings >= 4096
    assert DEMO.num_layers == 8 and get_preset("FLASH") is FLASH


def test_config_is_frozen_and_strict():
    with pytest.raises(ValidationError):
        TINY.hidden_size = 5
    with pytest.raises(ValidationError):
        ModelConfig.model_validate(TINY.model_dump() | {"unknown_key": 1})
