"""`attention` checks every input before touching a cache, and reports every mismatch at once."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_abi.errors import ABIError
from dspark_abi.presets import TINY
from dspark_kernels import AttentionWeights, LayerCaches, attention

from .conftest import TINY_POOLS, build, hidden_rows, new_allocator, sequence


@pytest.fixture
def setup(tiny_weights):
    batch = build(new_allocator(), [(0, 0, 9), (1, 0, 4)], tp=2)
    x = hidden_rows(batch, {0: sequence(0, 9), 1: sequence(1, 4)})
    caches = LayerCaches.allocate(TINY, 1, TINY_POOLS)
    for a in caches.arrays().values():
        a += 1  # non-zero, so that any write would show
    return batch, x, caches


def snapshot(caches):
    return {n: a.copy() for n, a in caches.arrays().items()}


def assert_unchanged(caches, before):
    for n, a in caches.arrays().items():
        np.testing.assert_array_equal(a, before[n])


def test_all_mismatches_in_one_error(setup, tiny_weights):
    batch, x, caches = setup
    before = snapshot(caches)
    bad_caches = LayerCaches.allocate(TINY, 1, dict(TINY_POOLS.as_dict(), ori=5), "a2a3")
    with pytest.raises(ABIError) as err:
        attention(batch, 1, x.astype(np.float64), tiny_weights[3], bad_caches, rank=2)
    fields = {(i.code, i.field) for i in err.value.issues}
    assert fields == {("array.dtype", "x"), ("config.mismatch", "weights.layer"), ("rank.index", "rank"),
                      ("config.mismatch", "caches.precision"), ("config.mismatch", "caches.pool_blocks.ori")}
    with pytest.raises(ABIError) as err:
        attention(batch, 1, x[:-1], tiny_weights[1], caches)
    assert err.value.codes == {"array.shape"}
    assert_unchanged(caches, before)


def test_other_config_and_types(setup, tiny_weights):
    batch, x, caches = setup
    other = TINY.model_copy(update={"name": "tiny2", "index_topk": 4})
    with pytest.raises(ABIError) as err:
        attention(batch, 1, x, AttentionWeights.random(other, 1), caches)
    assert err.value.codes == {"config.mismatch"}
    with pytest.raises(ABIError, match="layer"):
        attention(batch, 7, x, tiny_weights[1], caches)
    with pytest.raises(TypeError, match="PackedBatch"):
        attention(batch.to_arrays(), 1, x, tiny_weights[1], caches)
    with pytest.raises(TypeError, match="LayerCaches"):
        attention(batch, 1, x, tiny_weights[1], caches.arrays())
    with pytest.raises(ValueError, match="precision"):
        attention(batch, 1, x, tiny_weights[1], caches, precision="bf16")


def test_replaced_pool_array_is_caught(setup, tiny_weights):
    batch, x, caches = setup
    caches.csa_state = caches.csa_state[:-2]
    caches.ori = caches.ori.astype(np.float64)
    with pytest.raises(ABIError) as err:
        attention(batch, 1, x, tiny_weights[1], caches)
    assert {(i.code, i.field) for i in err.value.issues} == {("array.shape", "caches.csa_state"),
                                                             ("array.dtype", "caches.ori")}
