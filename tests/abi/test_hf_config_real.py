"""``ModelConfig.from_hf_config`` on the real DeepSeek-V4-Flash config.json and its DSpark variant.

``tests/data/deepseek_v4_flash_config.json`` restates, key for key, the public ``config.json`` of
deepseek-ai/DeepSeek-V4-Flash (its byte copy on GitHub: Mockingjay1316/deepseek-v4-flash-spark, commit 0825add,
``config.json``; only ``transformers_version`` is left out). ``tests/data/deepseek_v4_flash_dspark_config.json``
is that file plus what the DSpark checkpoints (DeepSeek-V4-Flash-DSpark, -0731) add, as quoted by third-party
loaders and notes (no stored copy of the hub file itself was available): ``dspark_block_size: 5``,
``dspark_markov_rank: 256``, ``dspark_noise_token_id: 128799``, ``dspark_target_layer_ids: [40, 41, 42]`` and
46 ``compress_ratios`` (``[0, 0] + [4, 128] * 20 + [4, 0, 0, 0]``: three SWA draft stages). vLLM's DSpark draft
(``vllm/models/deepseek_v4/nvidia/dspark.py``) reads the same key names.
"""

import json
from pathlib import Path

import pytest

from dspark_abi import ABIError, ModelConfig
from dspark_abi.presets import FLASH

DATA = Path(__file__).resolve().parents[1] / "data"


def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="module")
def flash_hf() -> dict:
    return _load("deepseek_v4_flash_config.json")


@pytest.fixture(scope="module")
def dspark_hf() -> dict:
    return _load("deepseek_v4_flash_dspark_config.json")


def test_real_flash_config_is_the_flash_preset_at_full_context(flash_hf):
    config = ModelConfig.from_hf_config(flash_hf, name="flash")
    assert config.max_position_embeddings == 1_048_576  # the preset trims the context to upstream's fixtures
    assert config == FLASH.model_copy(update={"max_position_embeddings": 1_048_576})
    assert config.num_layers == 43 and len(flash_hf["compress_ratios"]) == 44  # the MTP layer's entry dropped
    assert config.dspark_target_layers == ()


def test_real_dspark_config_carries_the_target_layers(dspark_hf, flash_hf):
    config = ModelConfig.from_hf_config(dspark_hf, name="flash-dspark")
    assert config.dspark_target_layers == (40, 41, 42)
    assert config.dspark_block_size == 5 and config.max_verify_width == 6   # anchor + 5 drafts per verify request
    assert config.num_layers == 43 and len(dspark_hf["compress_ratios"]) == 46  # three draft stages dropped
    base = ModelConfig.from_hf_config(flash_hf, name="flash-dspark")
    drafter = {"dspark_target_layers": (), "dspark_block_size": 0, "dspark_noise_token_id": 0}
    assert (config.dspark_noise_token_id, config.dspark_markov_rank, config.n_mtp_layers) == (128799, 256, 3)
    assert config.model_copy(update=drafter) == base  # nothing else


def test_target_layers_survive_a_json_round_trip_and_are_omitted_when_empty(dspark_hf, flash_hf):
    config = ModelConfig.from_hf_config(dspark_hf)
    assert ModelConfig.model_validate_json(config.model_dump_json()) == config
    assert json.loads(config.model_dump_json())["dspark_target_layers"] == [40, 41, 42]
    # configs without a drafter serialise exactly as before the field existed (fixture headers unchanged)
    assert "dspark_target_layers" not in json.loads(ModelConfig.from_hf_config(flash_hf).model_dump_json())
    assert "dspark_target_layers" not in FLASH.model_dump()
    assert "dspark_block_size" not in FLASH.model_dump() and "dspark_block_size" in config.model_dump()


@pytest.mark.parametrize("bad", [[41, 40], [40, 40], [43], [-1, 5], "40", [40.5]])
def test_bad_target_layers_are_a_config_error_naming_the_key(dspark_hf, bad):
    with pytest.raises(ABIError) as err:
        ModelConfig.from_hf_config(dict(dspark_hf, dspark_target_layer_ids=bad))
    assert err.value.codes == {"config.invalid"}
    assert any("dspark_target_layer" in i.field or "dspark_target_layers" in i.message for i in err.value.issues)
