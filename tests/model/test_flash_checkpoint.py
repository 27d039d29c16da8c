"""A FLASH-dimension checkpoint in the shipped format, streamed by ``dspark prefill --weights DIR``.

The session writes one synthetic checkpoint (``dspark_kernels.model.synthetic``): FLASH dimensions (D = 4096,
64 heads of 512, all 256 routed experts of 2048 x 4096, V = 129,280) with one SWA, one CSA and one HCA layer
(layer 0 hash-routed, layers 1 and 2 the DSpark targets), FP8 e4m3 projections with ue8m0 128 x 128 scales and
FP4 e2m1 experts with ue8m0 1 x 32 scales: 12.8 GB on disk, ~1 minute to write, shared by the session
(``flash_checkpoint`` in tests/model/conftest.py) and removed at its end.

Measured (2-core VM, docs/performance.md): the 4-token prefill peaks at 3.0 GiB RSS (the goal is 12 GiB; the
fp32 head is 2 GiB of it) in ~25 s; its logits equal the up-front forward's exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dspark_abi.io import fixtures
from dspark_abi.presets import FLASH
from dspark_kernels import prefill
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.shard_index import ShardIndex
from dspark_kernels.model.weight_specs import weight_specs
from dspark_kernels.model.weights import ModelWeights

from .conftest import FLASH_3L as CONFIG

#: FLASH-size runs: minutes each, and the checkpoint (tests/model/conftest.py ``flash_checkpoint``) takes 12.8 GB.
pytestmark = pytest.mark.slow
#: The memory goal for a FLASH-dimension forward of a few tokens.
PEAK_RSS_GOAL = 12 * 2**30


def _cli_prefill(root: Path, out: Path) -> dict:
    env = os.environ | {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "dspark_kernels.cli", "prefill", "--weights", str(root),
                           "--request", "4@0", "--json", "--no-progress", "--save", str(out)],
                          capture_output=True, text=True, timeout=1800, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _upfront(root: Path, experts: set[str]) -> ModelWeights:
    """Every tensor the forward reads, dequantised now and held in memory (bf16 where that is exact, which it
    is for every FP8 / FP4 value and every bf16 tensor: halves the ~14 GB this takes in fp32). Routed experts
    no token reaches are zero placeholders: if the forward read one, its logits would differ."""
    index = ShardIndex(root)
    tensors: dict[str, np.ndarray] = {}
    for name, spec in weight_specs(CONFIG).items():
        if ".ffn.experts." in name and name not in experts:
            tensors[name] = np.broadcast_to(np.zeros((), ml_dtypes.bfloat16), spec.shape)
            continue
        a = index.tensor(name)
        if a.dtype == np.float32:
            narrow = a.astype(ml_dtypes.bfloat16)
            if np.array_equal(narrow.astype(np.float32), a):
                a = narrow
        tensors[name] = a
    return ModelWeights.from_tensors(CONFIG, tensors, keep_layers=False)


def test_flash_prefill_streams_the_checkpoint_within_the_memory_goal(flash_checkpoint: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    checkpoint = flash_checkpoint
    out = tmp_path / "prefill.safetensors"
    summary = _cli_prefill(checkpoint, out)
    print(f"dspark prefill --weights {CONFIG.name} --request 4@0: peak RSS "
          f"{summary['peak_rss_bytes'] / 2**30:.2f} GiB, {summary['seconds']:.1f} s")
    assert summary["peak_rss_bytes"] <= PEAK_RSS_GOAL
    assert summary["config"] == CONFIG.name and summary["target_hidden"]["layers"] == [1, 2]
    saved = fixtures.load(out)
    batch, logits = saved.batch, saved.tensors["outputs.logits"]
    assert batch.config == CONFIG

    # the same batch through the API, streamed in this process: records which experts the tokens reach
    read: list[str] = []
    real = ShardIndex.tensor

    def spy(self, name, expect=None):  # type: ignore[no-untyped-def]
        read.append(name)
        return real(self, name, expect)

    monkeypatch.setattr(ShardIndex, "tensor", spy)
    streamed = ModelWeights.from_safetensors(checkpoint, batch.config)
    caches = ModelCaches.allocate(batch.config, batch.pool_blocks, precision="fp32")
    lazy = prefill(batch, batch.token_ids, streamed, caches)
    monkeypatch.undo()
    experts = {n for n in read if ".ffn.experts." in n}
    k = CONFIG.moe.num_experts_per_tok
    assert 0 < len(experts) <= 3 * CONFIG.num_layers * batch.num_tokens * k  # 3 matrices per used expert
    np.testing.assert_array_equal(lazy.logits, logits)  # the CLI computed the same thing
    del streamed, caches, lazy

    upfront = _upfront(checkpoint, experts)
    caches = ModelCaches.allocate(batch.config, batch.pool_blocks, precision="fp32")
    want = prefill(batch, batch.token_ids, upfront, caches)
    # the bound; measured: equal (the same float32 values through the same operations)
    scale = float(np.abs(want.logits).max())
    assert scale > 0 and np.abs(logits - want.logits).max() <= 1e-5 * scale
    target = saved.tensors["outputs.target_hidden"]
    assert np.abs(target - want.target_hidden).max() <= 1e-5 * float(np.abs(want.target_hidden).max())


_RANDOM_FLASH = """
import json, sys
import numpy as np
from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.presets import FLASH
from dspark_kernels import memory, prefill
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.weights import ModelWeights

blocks = pool_blocks_for(FLASH, [4])
builder = BatchBuilder(FLASH, PaddingPolicy(tp_size=1), BlockAllocator(FLASH, blocks))
builder.add(0, num_cached=0, num_new=4, token_ids=np.array([11, 2, 129279, 5]))
batch = builder.build()
weights = ModelWeights.random(FLASH, seed=0, keep_layers=False)
result = prefill(batch, batch.token_ids, weights, ModelCaches.allocate(FLASH, blocks), layers=[0, 2, 3])
print(json.dumps({"peak": memory.peak_rss_bytes(), "finite": bool(np.isfinite(result.logits).all()),
                  "sampled": result.sampled.tolist()}))
"""


def test_random_flash_weights_stream_the_same_way():
    """``--config flash`` without a checkpoint: FLASH's ~1 TiB of fp32 random weights are generated per layer and
    per reached expert, like a checkpoint is read (an SWA, a CSA and an HCA layer here; the CLI runs all 43)."""
    from argparse import Namespace

    from dspark_kernels.cli.checks import load_weights

    assert not load_weights(Namespace(weights=None, seed=0, config="flash"), FLASH).keep_layers
    env = os.environ | {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-c", _RANDOM_FLASH], capture_output=True, text=True, timeout=1800,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["finite"] and out["peak"] <= PEAK_RSS_GOAL  # measured: 3.3 GiB (the fp32 head is 2 GiB of it)
