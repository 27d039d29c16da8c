"""The checkpoint format table and the lazy shard index (``dspark_kernels.model.checkpoint_format``,
``dspark_kernels.model.shard_index``).

Synthetic checkpoints are written in the shipped format (F8_E4M3 + F8_E8M0 block scales, I8-packed FP4 experts,
BF16/F32 floats, I32 ``tid2eid``) by a small safetensors writer in this file, split over two shards with a
``model.safetensors.index.json`` as on the hub.
"""

import importlib
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dspark_abi import ABIError, ModelConfig
from dspark_abi.presets import FLASH, TINY
from dspark_kernels.model import checkpoint_format as cf
from dspark_kernels.model import quant
from dspark_kernels.model import shard_index as si
from dspark_kernels.model.weight_specs import weight_specs

DATA = Path(__file__).resolve().parents[1] / "data"
Q = cf.QuantFormat(quantized=True)
_CODES = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
          np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32", np.dtype(np.int8): "I8",
          np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


def write_safetensors(path: Path, tensors: dict, raw: dict | None = None) -> None:
    """Minimal safetensors writer: ``tensors`` name -> array; ``raw`` name -> (dtype code, shape, bytes)."""
    entries = {n: (_CODES[a.dtype], list(a.shape), np.ascontiguousarray(a).tobytes()) for n, a in tensors.items()}
    entries |= raw or {}
    header, blobs, off = {}, [], 0
    for name, (code, shape, data) in entries.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def encode(fmts: dict, seed: int = 0) -> tuple[dict, dict]:
    """Stored tensors in the shipped format for ``fmts``, and the float32 values a reader must return."""
    rng = np.random.default_rng(seed)
    stored, want = {}, {}
    for name, f in fmts.items():
        if f.kind == "int":
            a = np.argsort(rng.random((f.shape[0], TINY.moe.n_routed_experts)), axis=1)[:, : f.shape[1]]
            stored[name] = want[name] = a.astype(np.int32)
            continue
        w = (rng.standard_normal(f.shape) * f.shape[-1] ** -0.5).astype(np.float32)
        if f.kind == "fp8_block":
            q, s = quant.quant_fp8_blocks(w)
            stored[name], stored[name.removesuffix(".weight") + ".scale"] = q, s
            want[name] = quant.dequant_fp8_blocks(q, s)
        elif f.kind == "fp4_block":
            p, s = quant.quant_fp4_blocks(w)
            stored[name], stored[name.removesuffix(".weight") + ".scale"] = p.view(np.int8), s
            want[name] = quant.dequant_fp4_blocks(p, s)
        elif f.shipped == "F32":
            stored[name] = want[name] = w
        else:
            stored[name] = w.astype(ml_dtypes.bfloat16)
            want[name] = stored[name].astype(np.float32)
    return stored, want


def write_sharded(root: Path, stored: dict) -> Path:
    """Two shards (names alternate) plus the hub's index file."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[0::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        write_safetensors(root / file, {n: stored[n] for n in part})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (root / si.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    fmts = cf.model_formats(TINY, Q)
    stored, want = encode(fmts)
    return write_sharded(tmp_path_factory.mktemp("tiny"), stored), fmts, want


# ---------------------------------------------------------------------------------------------- the table
def test_flash_table_has_the_shipped_formats_and_scale_shapes():
    fmts = cf.model_formats(FLASH, Q)
    wq_b = fmts["layers.2.attn.indexer.wq_b.weight"]
    assert (wq_b.shape, wq_b.kind, wq_b.scale_shape, wq_b.scale_dtype) == ((8192, 1024), "fp8_block", (64, 8),
                                                                            "F8_E8M0")
    w1, w2 = fmts["layers.5.ffn.experts.255.w1.weight"], fmts["layers.5.ffn.experts.0.w2.weight"]
    assert (w1.kind, w1.shape, w1.scale_shape) == ("fp4_block", (2048, 4096), (2048, 128))
    assert (w2.shape, w2.scale_shape) == ((4096, 2048), (4096, 64))
    assert fmts["layers.0.attn.wo_a.weight"].scale_shape == (64, 32)
    assert fmts["layers.3.attn.compressor.wkv.weight"].kind == "float"  # bf16, no scale
    assert fmts["layers.3.attn.compressor.ape"].shape == (128, 512)
    assert fmts["layers.2.attn.compressor.ape"].shape == (4, 1024)
    assert fmts["layers.0.ffn.gate.tid2eid"].kind == "int" and "layers.3.ffn.gate.tid2eid" not in fmts
    assert fmts["layers.3.ffn.gate.bias"].shipped == "F32"
    assert "layers.3.attn.indexer.wq_b.weight" not in fmts and "layers.0.attn.compressor.ape" not in fmts
    n_layer = [k for k in fmts if k.startswith("layers.42.")]
    assert len(n_layer) == 8 + 4 + 6 + 2 + 6 + 2 + 3 * 256 + 3  # attn, compressor, indexer, norms, hc, gate, ffn


def test_fp8_expert_checkpoints_store_float32_scales():
    fmts = cf.model_formats(FLASH, cf.QuantFormat(quantized=True, expert_dtype="fp8"))
    w1 = fmts["layers.5.ffn.experts.3.w1.weight"]
    assert (w1.kind, w1.scale_shape, w1.scale_dtype) == ("fp8_block", (16, 32), "F32")
    assert all(f.kind == "float" for f in cf.model_formats(TINY, cf.QuantFormat.float_checkpoint()).values()
               if f.kind != "int")


def test_draft_tables_of_nextn_and_dspark():
    nextn = cf.model_formats(FLASH, Q, cf.DraftLayout("nextn", 1))
    assert nextn["mtp.0.e_proj.weight"].kind == "fp8_block" and nextn["mtp.0.hc_head_fn"].shape == (4, 16384)
    assert "mtp.0.attn.compressor.wkv.weight" not in nextn and "mtp.0.ffn.gate.bias" in nextn
    ds = cf.model_formats(FLASH, Q, cf.DraftLayout("dspark", 3, 256, (40, 41, 42)))
    assert ds["mtp.0.main_proj.weight"].shape == (4096, 3 * 4096) and "mtp.1.main_proj.weight" not in ds
    assert ds["mtp.2.markov_head.markov_w1.weight"].shape == (129280, 256)
    assert ds["mtp.2.confidence_head.proj.weight"].optional and "mtp.0.hc_head_fn" not in ds
    assert ds["mtp.2.ffn.experts.7.w3.weight"].kind == "fp4_block"


def _weights_module():
    return importlib.import_module("dspark_kernels.model.weights")


def test_table_names_and_shapes_agree_with_the_model_weights_reader():
    specs = weight_specs(TINY)
    fmts = cf.model_formats(TINY, Q)
    assert set(specs) == set(fmts)
    assert {n: s.shape for n, s in specs.items()} == {n: f.shape for n, f in fmts.items()}


# ---------------------------------------------------------------------------------------------- config.json
def test_quant_format_and_draft_layout_from_the_real_config_files():
    flash = json.loads((DATA / "deepseek_v4_flash_config.json").read_text())
    dspark = json.loads((DATA / "deepseek_v4_flash_dspark_config.json").read_text())
    assert cf.QuantFormat.from_hf_config(flash) == cf.QuantFormat(quantized=True, expert_dtype="fp4",
                                                                  scale_fmt="ue8m0")
    assert cf.DraftLayout.from_hf_config(flash) == cf.DraftLayout("nextn", 1)
    assert cf.DraftLayout.from_hf_config(dspark) == cf.DraftLayout("dspark", 3, 256, (40, 41, 42))
    assert cf.QuantFormat.from_hf_config({}) == cf.QuantFormat.float_checkpoint()
    config = ModelConfig.from_hf_config(dspark)
    fmts = cf.model_formats(config, cf.QuantFormat.from_hf_config(dspark), cf.DraftLayout.from_hf_config(dspark))
    assert fmts["mtp.0.main_proj.weight"].shape == (4096, len(config.dspark_target_layers) * 4096)


def test_unsupported_quantisation_is_a_config_error_with_a_fix():
    qc = {"quant_method": "awq", "fmt": "e5m2", "weight_block_size": [64, 64], "scale_fmt": "fp16"}
    with pytest.raises(ABIError) as err:
        cf.QuantFormat.from_hf_config({"quantization_config": qc, "expert_dtype": "int4"})
    assert err.value.codes == {"config.invalid"}
    fields = {i.field for i in err.value.issues}
    assert {"config.json:quantization_config.quant_method", "config.json:quantization_config.fmt",
            "config.json:expert_dtype"} <= fields
    assert all(i.fix for i in err.value.issues)
    with pytest.raises(ABIError, match="dspark_markov_rank"):
        cf.DraftLayout.from_hf_config({"dspark_target_layer_ids": [40], "dspark_markov_rank": 0})


# ---------------------------------------------------------------------------------------------- shard index
def test_sharded_checkpoint_in_the_real_format_reads_back(tiny_ckpt):
    root, fmts, want = tiny_ckpt
    index = si.ShardIndex(root)
    assert index.validate(fmts, strict=True).ok
    for name in ("layers.1.attn.wq_b.weight", "layers.1.attn.indexer.wq_b.weight", "layers.2.ffn.experts.3.w2.weight",
                 "layers.0.ffn.gate.tid2eid", "layers.3.hc_ffn_fn", "embed.weight", "layers.0.attn.wo_a.weight"):
        got = index.tensor(name, fmts[name])
        assert got.shape == fmts[name].shape
        assert np.array_equal(got, want[name]), name
    assert index.kind("layers.2.ffn.experts.3.w2.weight") == "fp4_block"
    assert index.raw("layers.2.ffn.experts.3.w2.weight").dtype == np.int8
    assert index.raw("layers.1.attn.wq_b.scale").dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
    assert "layers.1.attn.wq_b.scale" not in index.info() and index.info()["layers.2.ffn.experts.3.w2.weight"] == \
        ((128, 64), "float32")


def test_reading_one_tensor_maps_only_its_bytes_and_its_scale(tiny_ckpt, monkeypatch):
    root, _, want = tiny_ckpt
    index = si.ShardIndex(root)  # headers only: nothing mapped yet
    mapped = []
    real = si._map_region

    def counting(path, off, n):
        mapped.append((path.name, off, n))
        return real(path, off, n)

    monkeypatch.setattr(si, "_map_region", counting)
    name = "layers.1.attn.wkv.weight"
    assert np.array_equal(index.tensor(name), want[name])
    regions = {(s.path.name, s.offset, s.nbytes) for s in (index.stored(name), index.stored(name[:-7] + ".scale"))}
    assert set(mapped) == regions and len(mapped) == 2


def test_other_tensors_bytes_are_never_interpreted(tmp_path):
    good, scale = quant.quant_fp8_blocks(np.linspace(-3, 3, 4 * 6, dtype=np.float32).reshape(4, 6))
    garbage = np.full((300, 300), 0xFF, dtype=np.uint8)  # NaN e4m3 everywhere, and no scale
    write_safetensors(tmp_path / "a.safetensors", {"x.weight": good, "x.scale": scale},
                      raw={"junk.weight": ("F8_E4M3", [300, 300], garbage.tobytes()),
                           "odd": ("F4", [8], bytes(4))})
    index = si.ShardIndex(tmp_path / "a.safetensors")
    assert np.array_equal(index.tensor("x.weight"), quant.dequant_fp8_blocks(good, scale))
    with pytest.raises(ABIError) as err:
        index.tensor("junk.weight")
    assert err.value.codes == {"array.missing"} and err.value.issues[0].field == "junk.scale"
    with pytest.raises(ABIError) as err:
        index.raw("odd")
    assert err.value.codes == {"array.dtype"}


def test_missing_wrong_dtype_and_wrong_shape_are_structured_errors(tiny_ckpt, tmp_path):
    index = si.ShardIndex(tiny_ckpt[0])
    with pytest.raises(ABIError) as err:
        index.tensor("layers.9.attn.wq_a.weight")
    assert err.value.codes == {"array.missing"} and err.value.issues[0].fix
    bad = {
        "a.weight": np.zeros((4, 8), np.int32),                         # int where a projection belongs
        "b.weight": np.zeros((4, 8), ml_dtypes.float8_e4m3fn), "b.scale": np.zeros((2, 2), np.float32),
        "c.weight": np.zeros((3, 3), ml_dtypes.bfloat16),
    }
    write_safetensors(tmp_path / "bad.safetensors", bad)
    idx = si.ShardIndex(tmp_path / "bad.safetensors")
    fmts_bad = [cf._proj("a.weight", (4, 8), Q), cf._proj("b.weight", (4, 8), Q), cf._f("c.weight", (3, 4)),
                cf._f("d.weight", (2,))]
    report = idx.validate(fmts_bad)
    by_field = {(i.field, i.code) for i in report.issues}
    assert ("a.weight", "array.dtype") in by_field
    assert ("c.weight", "array.shape") in by_field and ("d.weight", "array.missing") in by_field
    assert ("b.scale", "array.shape") in by_field
    with pytest.raises(ABIError) as err:
        idx.tensor("b.weight")  # scale [2, 2] for a [4, 8] weight: must be [1, 1]
    assert err.value.codes == {"array.shape"} and err.value.issues[0].expected == [1, 1]
    assert all(i.fix for i in report.issues)
    # strict: a float copy where FP8 ships is reported, lenient accepts it
    write_safetensors(tmp_path / "f.safetensors", {"e.weight": np.zeros((4, 8), np.float32)})
    fidx = si.ShardIndex(tmp_path / "f.safetensors")
    assert fidx.validate([cf._proj("e.weight", (4, 8), Q)]).ok
    assert not fidx.validate([cf._proj("e.weight", (4, 8), Q)], strict=True).ok


def test_unreadable_shards_and_inconsistent_indexes(tmp_path):
    (tmp_path / "trunc.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ABIError) as err:
        si.ShardIndex(tmp_path / "trunc.safetensors")
    assert err.value.codes == {"fixture.unreadable"} and "header length" in err.value.issues[0].message
    (tmp_path / "nojson.safetensors").write_bytes(struct.pack("<Q", 8) + b"not json")
    with pytest.raises(ABIError, match="not JSON"):
        si.ShardIndex(tmp_path / "nojson.safetensors")
    beyond = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", len(beyond)) + beyond + bytes(8))
    with pytest.raises(ABIError, match="outside the file"):
        si.ShardIndex(tmp_path / "short.safetensors")
    d = tmp_path / "dup"
    d.mkdir()
    write_safetensors(d / "a.safetensors", {"t": np.zeros(2, np.float32)})
    write_safetensors(d / "b.safetensors", {"t": np.zeros(2, np.float32)})
    with pytest.raises(ABIError) as err:
        si.ShardIndex(d)
    assert err.value.codes == {"fixture.tensors"}
    (d / si.INDEX_FILE).write_text(json.dumps({"weight_map": {"t": "a.safetensors", "u": "a.safetensors"}}))
    with pytest.raises(ABIError) as err:
        si.ShardIndex(d)
    assert err.value.codes == {"array.missing"} and err.value.issues[0].field == "u"


def test_model_weights_reads_a_quantised_checkpoint_through_the_index(tiny_ckpt):
    root, _, want = tiny_ckpt
    mod = _weights_module()
    weights = mod.ModelWeights(TINY, si.ShardIndex(root), keep_layers=False)
    layer = weights.layer(1)
    assert np.array_equal(layer.attn.wq_b, want["layers.1.attn.wq_b.weight"])
    assert np.array_equal(weights.tensor("layers.2.ffn.experts.0.w1.weight"), want["layers.2.ffn.experts.0.w1.weight"])
