"""Whole CSA and HCA layers (and an SWA layer) through the pypto backend match the reference backend (a2a3).

Every stage of these layers runs through pypto (docs/pypto.md, "What runs where"). Fixture: ``compressor_batch``
(TP 2, ratio-4 and ratio-128 boundaries inside the chunk whose new entries later rows of the same chunk see,
windows continued from the previous chunk's state ring, a request crossing the rank boundary, a padding row),
caches with random history so that window, compressed, idx and state reads carry data.

Tolerances from the measured distribution (docs/pypto.md, 3 seeds x CSA/HCA x group/rank 1): with the default
key tile every TINY key set fits one softmax pass, and the layer output matched bit for bit in 8 of 12 cases;
otherwise one bf16 flip of o (or of kv) moves an int8 activation of o_proj by one step, which moves up to 21 %
of a rank's outputs by <= 2**-8 (mean |err| <= 2.2e-4). With several online-softmax steps per query (the
probabilities then round against each tile's running maximum) the measured worst case was 2**-7. Caches:
fp32 states may differ by the matmul accumulation order (<= 4.8e-7 measured), bf16/int8 entries computed from
them by one rounding step.

Ring tables (ABI 1.1): ``ring_batch`` (``tiny-1m``, one ring turn deep) runs whole CSA / HCA layers whose ori and
state tables are narrower than the positions' pages (columns = page mod width) and whose compressed tables are
trimmed, against the reference on the same inputs; window rows one page off must move the output.
"""

import numpy as np
import pytest
from pypto_fixtures import (
    CONFIG,
    RING_CONFIG,
    SEED,
    SHALLOW_RING,
    compressor_batch,
    hidden_rows,
    random_history,
    ring_batch,
)
from tolerances import BF16_ATOL, BF16_RTOL, MAX_DIFFERING_FRACTION

from dspark_kernels.model.attention_weights import AttentionWeights
from dspark_kernels.model.caches import LayerCaches
from dspark_kernels.pypto import attention_pypto
from dspark_kernels.reference.attention import attention

pytestmark = pytest.mark.pypto

#: Layer output: the worst measured |err| is 2**-7 (one bf16 step of |out| in [1, 2)); allow two steps, and a
#: mean bound far below a systematic error (>= 1e-2; measured mean <= 2.7e-4).
LAYER_ATOL, LAYER_RTOL, LAYER_MEAN_ATOL = 2.0**-6, 2.0**-7, 1e-3
#: fp32 state rows (accumulation order); bf16 pools one step; int8 idx one step; idx scales one fp32 rounding.
STATE_RTOL, STATE_ATOL = 1e-5, 1e-5
INT8_STEP, SCALE_RTOL = 1, 1e-6


def _check_caches(got: LayerCaches, want: LayerCaches) -> None:
    for name, w in want.arrays().items():
        g = got.arrays()[name]
        if name.endswith("state"):
            np.testing.assert_allclose(g, w, rtol=STATE_RTOL, atol=STATE_ATOL, err_msg=name)
            continue
        if name == "idx":
            assert np.abs(g.astype(np.int32) - w.astype(np.int32)).max() <= INT8_STEP, name
        elif name == "idx_scale":
            np.testing.assert_allclose(g, w, rtol=SCALE_RTOL, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=BF16_RTOL, atol=BF16_ATOL, err_msg=name)
        assert np.mean(g != w) <= MAX_DIFFERING_FRACTION, name


@pytest.mark.parametrize(("layer", "rank"), [(1, None), (1, 1), (2, None), (2, 1), (0, None)],
                         ids=["csa-group", "csa-rank1", "hca-group", "hca-rank1", "swa-group"])
def test_layer_matches_reference_backend(layer, rank):
    batch = compressor_batch()
    rng = np.random.default_rng(SEED + layer)
    weights = AttentionWeights.random(CONFIG, layer, seed=SEED)
    x = hidden_rows(batch)
    caches = LayerCaches.allocate(CONFIG, layer, batch.pool_blocks, precision="a2a3")
    random_history(caches, rng)
    ref_caches = caches.copy()
    want = attention(batch, layer, x, weights, ref_caches, precision="a2a3", rank=rank)
    got = attention_pypto(batch, layer, x, weights, caches, rank=rank)
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=LAYER_RTOL, atol=LAYER_ATOL)
    assert np.abs(got - want).mean() <= LAYER_MEAN_ATOL
    rows = slice(None) if rank is None else slice(rank * batch.local_rows, (rank + 1) * batch.local_rows)
    np.testing.assert_array_equal(got[batch.row_request[rows] < 0], 0.0)  # padding rows
    _check_caches(caches, ref_caches)


@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_layer_on_ring_tables_matches_reference_backend(layer):
    batch = ring_batch(cached=SHALLOW_RING)
    c = RING_CONFIG
    for pool, table in batch.tables.items():  # trimmed: ring tables far narrower than the pages read
        pl = c.layout.pools[pool]
        assert table.shape[1] <= pl.ring_width < pl.table_width if pl.is_ring else table.shape[1] < pl.table_width
        if pl.is_ring:
            assert (SHALLOW_RING[0] + 7) // pl.page_size >= 2 * table.shape[1], pool  # the modulo wraps
    weights = AttentionWeights.random(c, layer, seed=SEED)
    x = hidden_rows(batch)
    caches = LayerCaches.allocate(c, layer, batch.pool_blocks, precision="a2a3")
    random_history(caches, np.random.default_rng(SEED + layer))
    before = caches.copy()
    ref_caches = caches.copy()
    want = attention(batch, layer, x, weights, ref_caches, precision="a2a3")
    got = attention_pypto(batch, layer, x, weights, caches)
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=LAYER_RTOL, atol=LAYER_ATOL)
    assert np.abs(got - want).mean() <= LAYER_MEAN_ATOL
    np.testing.assert_array_equal(got[batch.row_request < 0], 0.0)
    _check_caches(caches, ref_caches)
    # the comparison can fail: reading the neighbouring ori block (every cached window row one page off, as a
    # wrong column would) fails the same comparison
    shifted = before.copy()
    shifted.ori[...] = np.roll(before.ori, c.layout.pools["ori"].page_size, axis=0)
    wrong = attention(batch, layer, x, weights, shifted, precision="a2a3")
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(wrong, want, rtol=LAYER_RTOL, atol=LAYER_ATOL)
