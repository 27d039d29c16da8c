"""Checkpoints in the shipped format, streamed: the synthetic writer (``dspark_kernels.model.synthetic``), the
loader reading FP8 / FP4 / W8A8 tensors lazily (``ModelWeights.from_safetensors`` over ``ShardIndex``), only the
experts tokens reach, and forwards that equal a forward with every tensor dequantised up front.

The FLASH-dimension checkpoint (memory goal) is tests/model/test_flash_checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PaddingPolicy, PoolBlocks
from dspark_abi.presets import FLASH, FLASH_DSPARK, TINY, TINY_DSPARK
from dspark_kernels import prefill
from dspark_kernels.model import quant
from dspark_kernels.model.block_weights import ExpertStack
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.checkpoint_format import QuantFormat, model_formats
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.model.shard_index import INDEX_FILE, ShardIndex
from dspark_kernels.model.synthetic import Entry, short_schedule, write_checkpoint, write_safetensors
from dspark_kernels.model.weight_specs import weight_specs
from dspark_kernels.model.weights import ModelWeights

#: TINY with 16 routed experts, 2 per token: a few tokens reach only some experts, so laziness is visible.
SPARSE = ModelConfig.model_validate(TINY.model_dump() | {"name": "tiny-e16",
                                                         "moe": TINY.moe.model_dump() | {"n_routed_experts": 16}})


def _run(weights: ModelWeights, config: ModelConfig, precision: str = "fp32", tokens: int = 5):
    builder = BatchBuilder(config, PaddingPolicy(tp_size=1), BlockAllocator(config, PoolBlocks.uniform(16)))
    rng = np.random.default_rng(3)
    builder.add(0, num_cached=0, num_new=tokens, token_ids=rng.integers(0, config.vocab_size, tokens))
    builder.add(1, num_cached=0, num_new=2, token_ids=rng.integers(0, config.vocab_size, 2))
    batch = builder.build()
    caches = ModelCaches.allocate(config, PoolBlocks.uniform(16), precision=precision)
    return prefill(batch, batch.token_ids, weights, caches, precision=precision)


def _upfront(root: Path, config: ModelConfig) -> ModelWeights:
    """Every tensor of the checkpoint dequantised now, held in memory."""
    index = ShardIndex(root)
    return ModelWeights.from_tensors(config, {n: index.tensor(n) for n in weight_specs(config)})


@pytest.mark.parametrize("config", [TINY, FLASH, FLASH_DSPARK, short_schedule(FLASH)], ids=lambda c: c.name)
def test_config_json_round_trips(config: ModelConfig):
    hf = config.to_hf_config() | QuantFormat(quantized=True).to_hf_config()
    assert ModelConfig.from_hf_config(hf, name=config.name) == config
    assert QuantFormat.from_hf_config(hf) == QuantFormat(quantized=True)


def test_synthetic_checkpoint_is_stored_as_shipped(tmp_path: Path):
    root = write_checkpoint(tmp_path / "ckpt", TINY_DSPARK, seed=4)
    hf = json.loads((root / "config.json").read_text())
    assert ModelConfig.from_hf_config(hf, name=TINY_DSPARK.name) == TINY_DSPARK
    assert hf["dspark_target_layer_ids"] == list(TINY_DSPARK.dspark_target_layers)
    index = ShardIndex(root)
    formats = model_formats(TINY_DSPARK, QuantFormat.from_hf_config(hf))
    index.require(formats.values(), strict=True)  # exactly the shipped kinds and scale dtypes
    mapped = json.loads((root / INDEX_FILE).read_text())["weight_map"]
    assert set(mapped) == set(index.names)
    assert index.stored("layers.1.attn.wq_b.weight").dtype == "F8_E4M3"
    assert index.stored("layers.1.ffn.experts.3.w2.weight").dtype == "I8"
    assert index.stored("layers.1.ffn.experts.3.w2.scale").dtype == "F8_E8M0"
    again = write_checkpoint(tmp_path / "again", TINY_DSPARK, seed=4)
    for name in ("layers.2.attn.wkv.weight", "layers.0.ffn.experts.1.w1.weight", "embed.weight"):
        np.testing.assert_array_equal(ShardIndex(again).tensor(name), index.tensor(name))  # deterministic
    other = ShardIndex(write_checkpoint(tmp_path / "other", TINY_DSPARK, seed=5))
    assert not np.array_equal(other.tensor("layers.2.attn.wkv.weight"), index.tensor("layers.2.attn.wkv.weight"))


def test_streamed_forward_equals_the_dequantised_up_front_forward(tmp_path: Path):
    root = write_checkpoint(tmp_path / "ckpt", TINY_DSPARK, seed=1)
    streamed = ModelWeights.from_safetensors(root, TINY_DSPARK)
    assert not streamed.keep_layers and isinstance(streamed.layer(0).moe.w1, ExpertStack)
    got, want = _run(streamed, TINY_DSPARK), _run(_upfront(root, TINY_DSPARK), TINY_DSPARK)
    # the same float32 values through the same operations: equal (the bound is 1e-5 relative)
    np.testing.assert_array_equal(got.logits, want.logits)
    np.testing.assert_array_equal(got.target_hidden, want.target_hidden)
    assert np.isfinite(got.logits).all() and np.abs(got.logits).max() > 0


def test_only_the_experts_tokens_reach_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = write_checkpoint(tmp_path / "ckpt", SPARSE, seed=2)
    read: list[str] = []
    real = ShardIndex.tensor

    def spy(self, name, expect=None):  # type: ignore[no-untyped-def]
        read.append(name)
        return real(self, name, expect)

    monkeypatch.setattr(ShardIndex, "tensor", spy)
    result = _run(ModelWeights.from_safetensors(root, SPARSE), SPARSE, tokens=1)
    experts = {n for n in read if ".ffn.experts." in n}
    per_layer = {i: {n.split(".")[4] for n in experts if n.startswith(f"layers.{i}.")}
                 for i in range(SPARSE.num_layers)}
    k = SPARSE.moe.num_experts_per_tok
    rows = 3  # two requests of 1 and 2 tokens
    for i, used in per_layer.items():
        assert 1 <= len(used) <= rows * k < SPARSE.moe.n_routed_experts, (i, used)
        # every read expert is read for all three matrices, once
        names = [n for n in read if n.startswith(f"layers.{i}.ffn.experts.")]
        assert len(names) == 3 * len(used) == len(set(names))
    assert "embed.weight" not in read  # its rows are read straight from the mapped shard
    assert np.isfinite(result.logits).all()


def _int8_checkpoint(folder: Path, config: ModelConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A float (bf16) checkpoint whose wq_b / wo_b / indexer.wq_b are int8 + one float32 scale per channel."""
    folder.mkdir()
    ref = ModelWeights.random(config, 9)
    stored, entries = {}, []
    for name, spec in weight_specs(config).items():
        a = ref.tensor(name)
        if name.endswith(("attn.wq_b.weight", "attn.wo_b.weight", "indexer.wq_b.weight")):
            q, s = quant.quant_int8_channels(a)
            stored[name] = (q, s)
            entries += [Entry(name, "I8", q.shape, lambda q=q: q),
                        Entry(name.removesuffix(".weight") + ".scale", "F32", s.shape, lambda s=s: s)]
        elif spec.family == "int":
            entries.append(Entry(name, "I32", a.shape, lambda a=a: a.astype(np.int32)))
        else:
            entries.append(Entry(name, "BF16", a.shape, lambda a=a: a.astype(ml_dtypes.bfloat16)))
    write_safetensors(folder / "model.safetensors", entries)
    return stored


def test_a2a3_uses_stored_int8_weights_without_requantising(tmp_path: Path):
    stored = _int8_checkpoint(tmp_path / "w8a8", TINY)
    weights = ModelWeights.from_safetensors(tmp_path / "w8a8", TINY)
    for layer in range(TINY.num_layers):
        attn = weights.layer(layer).attn
        prepared = prepare_weights(attn, "a2a3")
        pairs = [("attn.wq_b", attn.wq_b, prepared.wq_b, prepared.wq_b_scale),
                 ("attn.wo_b", attn.wo_b, prepared.wo_b, prepared.wo_b_scale)]
        if attn.indexer is not None:
            pairs.append(("attn.indexer.wq_b", attn.indexer.wq_b, prepared.idx_wq_b, prepared.idx_wq_b_scale))
        for leaf, dequantised, q, scale in pairs:
            want_q, want_s = stored[f"layers.{layer}.{leaf}.weight"]
            np.testing.assert_array_equal(q, want_q.astype(np.float32))   # the checkpoint's own integers
            np.testing.assert_array_equal(scale, want_s)                  # and scales, bit for bit
            np.testing.assert_array_equal(dequantised, want_q * want_s[:, None])  # fp32 sees q * scale
    assert np.isfinite(_run(weights, TINY, precision="a2a3").logits).all()


def test_streamed_random_weights_equal_kept_random_weights():
    kept, streamed = ModelWeights.random(TINY, 6), ModelWeights.random(TINY, 6, keep_layers=False)
    np.testing.assert_array_equal(_run(streamed, TINY).logits, _run(kept, TINY).logits)


def test_the_cli_keeps_random_weights_only_when_the_model_fits(monkeypatch: pytest.MonkeyPatch):
    from argparse import Namespace

    from dspark_kernels import memory
    from dspark_kernels.cli.checks import KEEP_RANDOM_SHARE, load_weights

    args = Namespace(weights=None, seed=0, config="tiny")
    need = memory.weight_bytes(TINY)
    monkeypatch.setattr(memory, "available_bytes", lambda: int(need / KEEP_RANDOM_SHARE) + 1)
    assert load_weights(args, TINY).keep_layers
    monkeypatch.setattr(memory, "available_bytes", lambda: int(need / KEEP_RANDOM_SHARE) - 1)
    assert not load_weights(args, TINY).keep_layers
