"""Checkpoint naming, validation (every issue at once), lazy safetensors loading and the random initializer."""

from __future__ import annotations

import pickle
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dspark_abi import ABIError
from dspark_abi.presets import TINY
from dspark_kernels.model.weight_specs import WeightsError, weight_specs
from dspark_kernels.model.weights import ModelWeights


def test_names_follow_deepseek_v4():
    names = set(weight_specs(TINY))
    for n in ("embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_scale", "hc_head_base",
              "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight", "layers.0.hc_attn_fn", "layers.0.hc_ffn_base",
              "layers.0.ffn.gate.weight", "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias",
              "layers.3.ffn.experts.3.w2.weight", "layers.2.ffn.shared_experts.w1.weight",
              "layers.1.attn.indexer.compressor.ape", "layers.2.attn.compressor.wkv.weight"):
        assert n in names, n
    assert "layers.0.ffn.gate.bias" not in names and "layers.1.ffn.gate.tid2eid" not in names
    assert weight_specs(TINY)["layers.0.hc_attn_fn"].shape == (24, 4 * TINY.hidden_size)


def test_random_is_deterministic_and_bf16_valued():
    a, b, c = ModelWeights.random(TINY, 3), ModelWeights.random(TINY, 3), ModelWeights.random(TINY, 4)
    for name in ("layers.2.ffn.experts.1.w1.weight", "hc_head_fn", "layers.1.attn.wq_b.weight"):
        assert np.array_equal(a.tensor(name), b.tensor(name))
        assert not np.array_equal(a.tensor(name), c.tensor(name))
        assert not (a.tensor(name).view(np.uint32) & 0xFFFF).any()
    t = a.tensor("layers.0.ffn.gate.tid2eid")
    assert t.min() >= 0 and t.max() < TINY.moe.n_routed_experts
    assert all(len(set(row)) == row.size for row in t[:50])  # distinct experts per token


def _save(weights: ModelWeights, path: Path, *, drop=(), override=None) -> None:
    tensors = {n: weights.tensor(n).astype(ml_dtypes.bfloat16) if s.family == "float" else weights.tensor(n)
               for n, s in weight_specs(TINY).items() if n not in drop}
    tensors |= override or {}
    tensors["mtp.0.unused.weight"] = np.zeros(2, np.float32)  # names the model does not read are ignored
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))


def test_safetensors_roundtrip_is_lazy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from dspark_kernels.model.block_weights import ExpertStack
    from dspark_kernels.model.shard_index import ShardIndex

    ref = ModelWeights.random(TINY, 5)
    ref.save_safetensors(tmp_path / "model.safetensors")
    loaded_names: list[str] = []
    real_load = ShardIndex.load

    def spy(self, name: str) -> np.ndarray:
        loaded_names.append(name)
        return real_load(self, name)

    monkeypatch.setattr(ShardIndex, "load", spy)
    w = ModelWeights.from_safetensors(tmp_path, TINY)
    assert loaded_names == []  # construction reads headers only
    lw = w.layer(2)
    assert loaded_names and all(n.startswith("layers.2.") for n in loaded_names)
    assert not any(".experts." in n for n in loaded_names)  # routed experts wait until tokens reach them
    assert isinstance(lw.moe.w1, ExpertStack) and lw.moe.w1.shape == ref.layer(2).moe.w1.shape
    np.testing.assert_array_equal(lw.moe.w1[1], ref.tensor("layers.2.ffn.experts.1.w1.weight"))
    assert [n for n in loaded_names if ".experts." in n] == ["layers.2.ffn.experts.1.w1.weight"]
    np.testing.assert_array_equal(lw.attn.wq_a, ref.layer(2).attn.wq_a)
    np.testing.assert_array_equal(w.head().head, ref.head().head)
    ids = np.array([5, 0, 5, TINY.vocab_size - 1])
    np.testing.assert_array_equal(w.embed_rows(ids), ref.embed()[ids])
    with pytest.raises(ABIError, match="expert"):
        lw.moe.w2[TINY.moe.n_routed_experts]


def test_random_embedding_rows_equal_the_whole_table():
    streamed = ModelWeights.random(TINY, 3, keep_layers=False)
    ids = np.array([7, 1, TINY.vocab_size - 1, 7])
    np.testing.assert_array_equal(streamed.embed_rows(ids), ModelWeights.random(TINY, 3).embed()[ids])
    assert streamed._embed is None  # the table itself was never built


def test_every_problem_reported_at_once(tmp_path: Path):
    ref = ModelWeights.random(TINY, 6)
    _save(ref, tmp_path / "bad.safetensors", drop=("layers.1.ffn.gate.bias", "norm.weight"),
          override={"layers.3.ffn_norm.weight": np.ones(7, np.float32),
                    "layers.0.ffn.gate.tid2eid": np.zeros((TINY.vocab_size, 2), np.float32),
                    "head.weight": np.zeros((TINY.vocab_size, TINY.hidden_size), np.int8)})
    with pytest.raises(ABIError) as err:
        ModelWeights.from_safetensors(tmp_path / "bad.safetensors", TINY)
    found = {(i.code, i.field) for i in err.value.issues}
    assert found == {("array.missing", "layers.1.ffn.gate.bias"), ("array.missing", "norm.weight"),
                     ("array.shape", "layers.3.ffn_norm.weight"), ("array.dtype", "layers.0.ffn.gate.tid2eid"),
                     ("array.dtype", "head.weight")}


def test_bad_tid2eid_values_rejected_when_the_layer_loads():
    ref = ModelWeights.random(TINY, 7)
    tensors = {n: ref.tensor(n) for n in weight_specs(TINY)}
    tensors["layers.0.ffn.gate.tid2eid"] = np.full((TINY.vocab_size, 2), TINY.moe.n_routed_experts, np.int32)
    w = ModelWeights.from_tensors(TINY, tensors)
    with pytest.raises(ABIError, match="tid2eid"):
        w.layer(0)
    with pytest.raises(ABIError):
        w.layer(TINY.num_layers)


def test_missing_files_and_shared_layers():
    with pytest.raises(ABIError):
        ModelWeights.from_safetensors([], TINY)
    w = ModelWeights.random(TINY, 0, share_layers=True)
    one, three = w.layer(1), w.layer(3)  # both CSA, learned gate: the same arrays, own layer index
    assert three.layer == 3 and three.attn.layer == 3 and three.moe.w1 is one.moe.w1


def _held_arrays(obj, seen: dict[int, np.ndarray]) -> None:
    """Every distinct numpy array reachable through attrs objects, dicts and sequences."""
    import attrs

    if isinstance(obj, np.ndarray):
        seen.setdefault(id(obj), obj)
    elif attrs.has(type(obj)):
        for f in attrs.fields(type(obj)):
            _held_arrays(getattr(obj, f.name), seen)
    elif isinstance(obj, dict | list | tuple):
        for v in obj.values() if isinstance(obj, dict) else obj:
            _held_arrays(v, seen)


def test_weight_memory_estimate_matches_the_materialised_model():
    from dspark_kernels import memory

    w = ModelWeights.random(TINY, 0)
    seen: dict[int, np.ndarray] = {}
    for i in range(TINY.num_layers):
        _held_arrays(w.layer(i), seen)
    _held_arrays(w.head(), seen)
    _held_arrays(w.embed(), seen)
    actual = sum(a.nbytes for a in seen.values())
    estimate = memory.weight_bytes(TINY)
    assert abs(estimate - actual) <= 0.10 * actual, (estimate, actual)  # measured: equal (7474212 bytes)
    est = memory.estimate_prefill(TINY, {p: 4 for p in ("ori", "csa_cmp", "hca_cmp", "idx", "csa_state",
                                                        "csa_inner_state", "hca_state")}, rows=8)
    assert est.weights >= actual and est.total == est.weights + est.caches + est.activations


def test_cache_memory_estimate_matches_the_allocation():
    from dspark_abi.allocator import pool_blocks_for
    from dspark_kernels import memory
    from dspark_kernels.model.caches import ModelCaches

    blocks = pool_blocks_for(TINY, [300, 40])
    for precision in ("fp32", "a2a3"):
        caches = ModelCaches.allocate(TINY, blocks, precision=precision)
        assert memory.cache_bytes(TINY, blocks, precision) == sum(a.nbytes for a in caches.arrays().values())


def test_flash_estimate_counts_every_routed_expert():
    from dspark_abi.presets import FLASH
    from dspark_kernels import memory

    experts = memory.weight_bytes_by_layer(FLASH)[2]
    m = FLASH.moe
    per_layer = m.n_routed_experts * 3 * m.moe_intermediate_size * FLASH.hidden_size * 4
    assert experts == [per_layer] * FLASH.num_layers  # 24 GiB of fp32 routed experts per layer
    assert memory.weight_bytes(FLASH) > FLASH.num_layers * per_layer


def test_wrong_checkpoint_error_is_summarised_in_one_line(tmp_path: Path):
    names = list(weight_specs(TINY))
    save_file({f"model.{n}": np.zeros(1, np.float32) for n in names}, str(tmp_path / "hf.safetensors"))
    with pytest.raises(WeightsError) as err:
        ModelWeights.from_safetensors(tmp_path, TINY)
    assert isinstance(err.value, ABIError) and len(err.value.issues) == len(names)  # every issue kept
    summary = err.value.summary()
    assert "\n" not in summary and len(summary) < 400
    assert summary.startswith(f"{len(names)} of {len(names)} tensors tiny needs are missing (embed.weight, ")
    assert f"holds {len(names)} tensors tiny does not read (model.embed.weight, " in summary


def test_unreadable_safetensors_file_is_named(tmp_path: Path):
    bad = tmp_path / "model-00002.safetensors"
    bad.write_bytes(b"\x00" * 5)
    with pytest.raises(WeightsError) as err:
        ModelWeights.from_safetensors([bad], TINY)
    assert err.value.unreadable == (str(bad),) and err.value.codes == {"fixture.unreadable"}
    assert str(bad) in err.value.summary() and "header" in err.value.summary()
    again = pickle.loads(pickle.dumps(err.value))  # crosses process boundaries intact
    assert again.summary() == err.value.summary() and again.issues == err.value.issues
    with pytest.raises(WeightsError, match="cannot read"):
        ModelWeights.from_safetensors(tmp_path / "absent.safetensors", TINY)
