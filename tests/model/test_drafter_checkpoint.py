"""The drafter's ``mtp.*`` weights in a checkpoint: the synthetic writer stores them as shipped, DrafterWeights
streams them with the target's loaders, a checkpoint without them is refused with one clear issue, and the memory
estimate matches what the drafter allocates. The FLASH-dimension run is marked slow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from drafter_steps import Steps

from dspark_abi import ABIError, PoolBlocks
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.persistent import PersistentTables
from dspark_abi.presets import FLASH_DSPARK, TINY_DSPARK
from dspark_kernels import memory
from dspark_kernels.drafter import DSparkDrafter
from dspark_kernels.model import quant
from dspark_kernels.model.block_weights import ExpertStack
from dspark_kernels.model.drafter_weights import DrafterWeights, stage_config
from dspark_kernels.model.shard_index import ShardIndex
from dspark_kernels.model.synthetic import write_checkpoint
from dspark_kernels.model.weight_specs import WeightsError
from dspark_kernels.model.weights import ModelWeights

from .conftest import FLASH_3L

C = TINY_DSPARK
FEATURES = len(C.dspark_target_layers) * C.hidden_size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-dspark") / "ckpt", C, seed=0)


def test_the_synthetic_checkpoint_stores_the_drafter_as_shipped(checkpoint: Path):
    index = ShardIndex(checkpoint)
    last = f"mtp.{C.n_mtp_layers - 1}."
    assert index.kind("mtp.0.main_proj.weight") == "fp8_block"
    assert index.stored("mtp.0.main_proj.scale").dtype == "F8_E8M0"
    assert index.kind("mtp.1.attn.wq_b.weight") == "fp8_block"
    assert index.kind("mtp.2.ffn.experts.0.w1.weight") == "fp4_block"
    assert index.stored(last + "markov_head.markov_w1.weight").dtype == "BF16"
    assert index.stored(last + "hc_head_fn").dtype == "F32"
    hf = json.loads((checkpoint / "config.json").read_text())
    assert (hf["dspark_markov_rank"], hf["n_mtp_layers"], hf["dspark_noise_token_id"]) == (256, 3, 0)


def test_streamed_drafter_weights_are_the_random_ones_in_their_stored_formats(checkpoint: Path):
    loaded, random = DrafterWeights.from_safetensors(checkpoint, C), DrafterWeights.random(C, seed=0)
    assert not loaded.stages.keep_layers and loaded.main_proj_fp8
    # FP8 projections: the random values through the writer's e4m3 + ue8m0 128x128 encoding, exactly
    np.testing.assert_array_equal(loaded.main_proj, quant.dequant_fp8_blocks(*quant.quant_fp8_blocks(random.main_proj)))
    a, b = loaded.stage(1).attn, random.stage(1).attn
    np.testing.assert_array_equal(a.wq_b, quant.dequant_fp8_blocks(*quant.quant_fp8_blocks(b.wq_b)))
    assert "wq_b.weight" in a.fp8_stored
    # floats: the same bf16 values
    for x, y in [(loaded.markov_w1, random.markov_w1), (loaded.markov_w2, random.markov_w2),
                 (loaded.main_norm, random.main_norm), (loaded.head_norm(), random.head_norm()),
                 (loaded.head_hc().fn, random.head_hc().fn), (a.kv_norm, b.kv_norm), (a.attn_sink, b.attn_sink)]:
        np.testing.assert_array_equal(x, y)
    assert loaded.confidence is not None
    np.testing.assert_array_equal(loaded.confidence, random.confidence)
    # routed experts are read one at a time (streaming), FP4 as stored
    assert isinstance(loaded.stage(0).moe.w1, ExpertStack)
    assert "ffn.experts.w1" in loaded.stage(0).moe.fp8_stored


def test_a_drafter_from_the_checkpoint_drafts(checkpoint: Path):
    target = ModelWeights.from_safetensors(checkpoint, C)
    d = DSparkDrafter.from_checkpoint(checkpoint, C, target)
    feats = np.random.default_rng(0).standard_normal((12, FEATURES)).astype(np.float32)
    steps = Steps(C)
    steps.attach(d)
    d.observe([3], [steps.step({3: 12})[3]], [feats])
    out = d.draft([3], np.array([5]), np.array([12]))
    assert out.tokens.shape == (1, C.dspark_block_size) and np.isfinite(out.confidence).all()
    assert ((out.tokens >= 0) & (out.tokens < C.vocab_size)).all()


def test_a_checkpoint_without_a_drafter_is_one_clear_issue(tmp_path: Path):
    plain = write_checkpoint(tmp_path / "plain", C.model_copy(update={"dspark_block_size": 0}), seed=0)
    with pytest.raises(WeightsError) as err:
        DrafterWeights.from_safetensors(plain, C)
    (issue,) = err.value.issues
    assert issue.code == "array.missing" and issue.field == "mtp.*" and "without speculation" in (issue.fix or "")


def test_a_checkpoint_missing_one_drafter_tensor_names_it(tmp_path: Path, checkpoint: Path):
    (tmp_path / "ckpt").mkdir()
    for f in checkpoint.iterdir():
        (tmp_path / "ckpt" / f.name).symlink_to(f)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["mtp.2.markov_head.markov_w2.weight"]
    kept = {n: f for n, f in index["weight_map"].items() if f != shard}    # drop the last stage's shard
    (tmp_path / "ckpt" / shard).unlink()
    (tmp_path / "ckpt" / "model.safetensors.index.json").unlink()
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": kept}))
    with pytest.raises(ABIError) as err:
        DrafterWeights.from_safetensors(tmp_path / "ckpt", C)
    missing = {i.field for i in err.value.issues if i.code == "array.missing"}
    assert "mtp.2.markov_head.markov_w2.weight" in missing and "mtp.2.attn.wq_a.weight" in missing
    assert "mtp.2.norm.weight" in missing and not any(f.startswith("layers.") for f in missing)


def test_window_bytes_are_what_the_drafter_allocates():
    """The window cache is S more layers of the ori pool: its size follows the pool's blocks, not the requests."""
    target = ModelWeights.random(C, 0)
    d = DSparkDrafter.random(C, target)
    blocks = pool_blocks_for(C, [40] * 5)
    d.attach(PersistentTables(C, blocks))
    assert d.window_cache.nbytes == memory.drafter_window_bytes(C, blocks) == 3 * blocks.ori * 32 * C.head_dim * 4
    flash = pool_blocks_for(FLASH_DSPARK, [FLASH_DSPARK.sliding_window] * 8, slack=0)
    assert memory.drafter_window_bytes(FLASH_DSPARK, flash) == 3 * flash.ori * 32 * 512 * 4   # 192 KiB per block
    with pytest.warns(DeprecationWarning):                      # the 1.3 per-request rings, for comparison
        assert memory.drafter_ring_bytes(FLASH_DSPARK, 1) == 3 * 128 * 512 * 4 + 8    # 768 KiB per request
    est = memory.estimate_drafter(FLASH_DSPARK, requests=8, streaming=True)
    assert est.caches == memory.drafter_window_bytes(FLASH_DSPARK, flash) and est.total < 2 * 2**30
    big = memory.estimate_drafter(FLASH_DSPARK, requests=8, streaming=True, pool_blocks=PoolBlocks.uniform(4096))
    assert big.caches - est.caches == 3 * (4096 - flash.ori) * 32 * 512 * 4
    kept = memory.estimate_drafter(C, requests=1, streaming=False)
    assert kept.weights > memory.estimate_drafter(C, requests=1, streaming=True).weights
    with pytest.raises(ABIError):
        memory.estimate_drafter(stage_config(C), requests=1, streaming=True)


# ---------------------------------------------------------------------------------------------- FLASH, slow
#: The session's FLASH_3L target checkpoint (tests/model/conftest.py) with FLASH-DSpark's drafter keys: its target
#: layers 1 and 2 feed three FLASH-dimension draft stages, written beside it (~10.5 GB, removed after the test).
FLASH_3L_DSPARK = FLASH_3L.model_copy(update={"name": "flash-3l-dspark", "dspark_block_size": 5,
                                              "dspark_noise_token_id": 128799})
#: The target's goal for a FLASH-dimension run (tests/model/test_flash_checkpoint.py).
PEAK_RSS_GOAL = 12 * 2**30

_FLASH_DRAFT = """
import json, sys, time
from pathlib import Path
import numpy as np
from dspark_kernels import memory
from dspark_kernels.drafter import DSparkDrafter
from dspark_kernels.model.drafter_weights import DrafterWeights
from dspark_kernels.model.weights import ModelWeights
from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
config = ModelConfig.model_validate_json(sys.argv[3])
target_root, drafter_root = Path(sys.argv[1]), Path(sys.argv[2])
t0 = time.time()
target = ModelWeights.from_safetensors(target_root, config)
drafter = DSparkDrafter(config, DrafterWeights.from_safetensors(sorted(drafter_root.glob("*.safetensors")), config),
                        target)
features = np.random.default_rng(0).standard_normal((6, 2 * config.hidden_size)).astype(np.float32)
alloc = BlockAllocator(config, pool_blocks_for(config, [6]))     # the target's step of the 6 rows maps their ori pages
builder = BatchBuilder(config, PaddingPolicy(), alloc)
builder.add(0, num_cached=0, num_new=6, token_ids=np.zeros(6, np.int64))
builder.commit(builder.build_step())
drafter.attach(alloc.persistent)
drafter.observe([0], [np.arange(6)], [features])
out = drafter.draft([0], np.array([11]), np.array([6]))
print(json.dumps({"peak": memory.peak_rss_bytes(), "seconds": time.time() - t0, "tokens": out.tokens.tolist(),
                  "finite": bool(np.isfinite(out.confidence).all())}))
"""


@pytest.mark.slow
def test_a_flash_dimension_drafter_streams_within_the_targets_memory(flash_checkpoint: Path, tmp_path: Path):
    root = write_checkpoint(tmp_path / "drafter", FLASH_3L_DSPARK, seed=0, drafter_only=True)
    try:
        env = os.environ | {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
        proc = subprocess.run([sys.executable, "-c", _FLASH_DRAFT, str(flash_checkpoint), str(root),
                               FLASH_3L_DSPARK.model_dump_json()], capture_output=True, text=True, timeout=3600,
                              env=env, check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    print(f"FLASH drafter observe(6) + draft(1 request): peak RSS {out['peak'] / 2**30:.2f} GiB, "
          f"{out['seconds']:.1f} s")
    # measured (2-core VM): 3.9 GiB peak (the target's fp32 LM head is 2 GiB of it; the target's own 4-token
    # prefill peaks at 3.0 GiB), 20 s for loading, observe and one draft (the checkpoint writes take ~1 min)
    assert out["finite"] and out["peak"] <= PEAK_RSS_GOAL


def test_drafter_shards_written_alone_equal_those_of_the_whole_checkpoint(checkpoint: Path, tmp_path: Path):
    alone = write_checkpoint(tmp_path / "drafter", C, seed=0, drafter_only=True)
    shards = sorted(alone.glob("*.safetensors"))
    assert len(shards) == C.n_mtp_layers and not any(n.startswith("layers.") for n in ShardIndex(shards).names)
    a, b = DrafterWeights.from_safetensors(shards, C), DrafterWeights.from_safetensors(checkpoint, C)
    np.testing.assert_array_equal(a.main_proj, b.main_proj)
    np.testing.assert_array_equal(a.stage(2).attn.wo_b, b.stage(2).attn.wo_b)
    np.testing.assert_array_equal(a.stage(0).moe.w2[1], b.stage(0).moe.w2[1])


def test_a_drafters_recipe_rebuilds_it(checkpoint: Path):
    """``drafter.recipe`` (what a TP rank process builds its own drafter from, e.g. in the distributed loop) is
    small and picklable and rebuilds a drafter that drafts exactly what the original drafts, for a checkpoint's
    drafter and a random one; a drafter built from weights in memory has none."""
    import pickle

    target = ModelWeights.from_safetensors(checkpoint, C)
    feats = np.random.default_rng(0).standard_normal((12, FEATURES)).astype(np.float32)
    for made in (DSparkDrafter.from_checkpoint(checkpoint, C, target, keep_layers=True),
                 DSparkDrafter.random(C, target, seed=4)):
        assert made.recipe is not None
        shipped = pickle.dumps(made.recipe)
        assert len(shipped) < 20_000                  # a recipe, not weights
        rebuilt = pickle.loads(shipped).build(target, tp=2, tp_mode="threads")
        assert rebuilt.recipe == made.recipe and rebuilt.tp == 2
        outs = []
        for d in (made, rebuilt):
            steps = Steps(C)
            steps.attach(d)
            d.observe([3], [steps.step({3: 12})[3]], [feats])
            outs.append(d.draft([3], np.array([5]), np.array([12])))
        np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
    assert DSparkDrafter(C, DrafterWeights.random(C, 4), target).recipe is None
