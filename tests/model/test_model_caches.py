"""ModelCaches: allocation per layer kind, save/load round trip, and refusal of another config's caches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from dspark_abi import ABIError, PoolBlocks
from dspark_abi.presets import TINY
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.forward import run_forward

from .conftest import Session


def test_allocate_per_kind():
    c = ModelCaches.allocate(TINY, PoolBlocks.uniform(4))
    assert [lc.kind for lc in c.layers] == ["swa", "csa", "hca", "csa"]
    assert c[0].csa_cmp is None and c[2].hca_state is not None and c[1].idx_scale is not None
    assert c[0].ori.shape == (4 * 32, TINY.head_dim)


def test_save_load_continues_a_prefill(tmp_path: Path):
    a = Session()
    b = a.batch([(0, 0, 130)])
    run_forward(b, b.token_ids, a.weights, a.caches)
    a.caches.save(tmp_path / "caches.safetensors")
    loaded = ModelCaches.load(tmp_path / "caches.safetensors", TINY, precision="fp32")
    for name, arr in a.caches.arrays().items():
        np.testing.assert_array_equal(loaded.arrays()[name], arr)
    # the next chunk from the loaded caches equals the next chunk from the live ones
    b2 = a.batch([(0, 130, 7)])
    live = run_forward(b2, b2.token_ids, a.weights, a.caches)
    resumed = run_forward(b2, b2.token_ids, a.weights, loaded)
    np.testing.assert_array_equal(resumed.hidden, live.hidden)


def test_load_rejects_another_config_and_broken_files(tmp_path: Path):
    c = ModelCaches.allocate(TINY, PoolBlocks.uniform(2))
    c.save(tmp_path / "c.safetensors")
    other = TINY.model_copy(update={"name": "tiny-wide", "sliding_window": 32})
    with pytest.raises(ABIError) as err:
        ModelCaches.load(tmp_path / "c.safetensors", other)
    assert "config.mismatch" in err.value.codes
    with pytest.raises(ABIError) as err:
        ModelCaches.load(tmp_path / "c.safetensors", TINY, precision="a2a3")
    assert "config.mismatch" in err.value.codes
    arrays = {n: a for n, a in c.arrays().items() if n != "layers.2.hca_state"}
    arrays["layers.0.ori"] = np.zeros((3, 3), np.float32)
    meta = {"format": "dspark.caches", "format_version": "1", "config": TINY.model_dump_json(),
            "precision": "fp32", "pool_blocks": '{"ori": 2, "csa_cmp": 2, "hca_cmp": 2, "idx": 2, "csa_state": 2, '
            '"csa_inner_state": 2, "hca_state": 2}'}
    save_file(arrays, str(tmp_path / "broken.safetensors"), metadata=meta)
    with pytest.raises(ABIError) as err:
        ModelCaches.load(tmp_path / "broken.safetensors", TINY)
    assert {(i.code, i.field) for i in err.value.issues} == {("array.missing", "layers.2.hca_state"),
                                                              ("array.shape", "layers.0.ori")}
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ABIError):
        ModelCaches.load(tmp_path / "junk.safetensors", TINY)
