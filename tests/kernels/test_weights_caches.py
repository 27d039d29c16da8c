"""`AttentionWeights` (checkpoint names, validation, random init) and `LayerCaches` allocation."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dspark_abi.errors import ABIError
from dspark_abi.presets import FLASH, TINY
from dspark_kernels import AttentionWeights, LayerCaches
from dspark_kernels.model.attention_weights import expected_shapes
from dspark_kernels.model.prepared import PreparedWeightsCache


@pytest.mark.parametrize("layer", range(TINY.num_layers))
def test_checkpoint_round_trip(layer):
    w = AttentionWeights.random(TINY, layer, seed=1)
    tensors = w.to_tensors()
    assert all(name.startswith(f"layers.{layer}.attn.") for name in tensors)
    shard = tensors | {"layers.9.attn.wq_a.weight": np.zeros(3), "embed.weight": np.zeros(2)}  # other names ignored
    back = AttentionWeights.from_tensors(TINY, layer, shard)
    for name, array in back.to_tensors().items():
        np.testing.assert_array_equal(array, tensors[name])
        assert array.dtype == np.float32 and not array.flags.writeable
    assert (w.indexer is not None) == (TINY.layer_kind(layer) == "csa")
    assert (w.compressor is not None) == (TINY.layer_kind(layer) != "swa")


def test_flash_names_and_shapes():
    shapes = expected_shapes(FLASH, 2)  # a CSA layer
    assert shapes["wq_b.weight"] == (64 * 512, 1024)
    assert shapes["wo_a.weight"] == (8 * 1024, 4096)
    assert shapes["compressor.ape"] == (4, 1024)
    assert shapes["indexer.compressor.wkv.weight"] == (256, 4096)
    assert expected_shapes(FLASH, 3)["compressor.wkv.weight"] == (512, 4096)  # HCA: coff 1
    assert len(expected_shapes(FLASH, 0)) == 8


def test_every_problem_reported_at_once():
    tensors = AttentionWeights.random(TINY, 2, seed=1).to_tensors()  # an HCA layer
    del tensors["layers.2.attn.wq_a.weight"]
    tensors["layers.2.attn.wkv.weight"] = np.zeros((3, 3), np.float32)
    tensors["layers.2.attn.attn_sink"] = np.zeros(8, np.int32)
    tensors["layers.2.attn.indexer.wq_b.weight"] = np.zeros((1024, 64), np.float32)  # CSA-only name
    with pytest.raises(ABIError) as err:
        AttentionWeights.from_tensors(TINY, 2, tensors)
    by_field = {i.field.removeprefix("layers.2.attn."): i.code for i in err.value.issues}
    assert by_field == {"wq_a.weight": "array.missing", "wkv.weight": "array.shape", "attn_sink": "array.dtype",
                        "indexer.wq_b.weight": "config.mismatch"}


def test_bf16_checkpoint_tensors_are_accepted():
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in AttentionWeights.random(TINY, 0).to_tensors().items()}
    w = AttentionWeights.from_tensors(TINY, 0, tensors)
    assert w.wq_a.dtype == np.float32


def test_random_is_deterministic_and_scaled():
    a, b = AttentionWeights.random(TINY, 1, seed=3), AttentionWeights.random(TINY, 1, seed=3)
    np.testing.assert_array_equal(a.wq_b, b.wq_b)
    assert not np.array_equal(a.wq_b, AttentionWeights.random(TINY, 1, seed=4).wq_b)
    x = np.random.default_rng(0).standard_normal((64, TINY.hidden_size)).astype(np.float32)
    assert 0.5 < float(np.std(x @ a.wq_a.T)) < 2.0  # activations stay O(1)


def test_prepared_a2a3_weights():
    w = AttentionWeights.random(TINY, 1, seed=3)
    cache = PreparedWeightsCache()  # the caller's cache, not the frozen weights'
    p = cache.get(w, "a2a3")
    assert cache.get(w, "a2a3") is p and cache.get(w, "fp32").wq_b is w.wq_b  # cached per precision
    assert np.all(np.abs(p.wq_b) <= 127) and np.all(p.wq_b == np.rint(p.wq_b))
    assert p.wq_b_scale.shape == (TINY.num_attention_heads * TINY.head_dim,)
    np.testing.assert_array_equal(p.wq_a.astype(ml_dtypes.bfloat16).astype(np.float32), p.wq_a)


@pytest.mark.parametrize("precision", ["fp32", "a2a3"])
def test_layer_caches(precision):
    blocks = {"ori": 3, "csa_cmp": 2, "idx": 2, "csa_state": 5, "csa_inner_state": 4}
    c = LayerCaches.allocate(TINY, 1, blocks, precision)
    assert c.ori.shape == (96, 128) and c.csa_state.shape == (10, 512) and c.csa_inner_state.shape == (8, 512)
    assert c.idx.dtype == (np.int8 if precision == "a2a3" else np.float32) and c.idx_scale.shape == (64,)
    assert c.hca_cmp is None and c.hca_state is None
    assert all(np.all(a == 0) for a in c.arrays().values())
    d = c.copy()
    d.ori[0] = 1
    assert np.all(c.ori == 0)
    with pytest.raises(ABIError) as err:
        LayerCaches.allocate(TINY, 2, {"ori": 1, "hca_cmp": 0}, precision)
    assert {i.field for i in err.value.issues} == {"pool_blocks.hca_cmp", "pool_blocks.hca_state"}
