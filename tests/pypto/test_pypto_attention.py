"""A whole CSA and a whole HCA layer through the pypto backend match the reference backend (a2a3).

Every stage of these layers runs through pypto (docs/pypto.md, "What runs where"). Fixture: ``compressor_batch``
(TP 2, ratio-4 and ratio-128 boundaries inside the chunk whose new entries later rows of the same chunk see,
windows continued from the previous chunk's state ring, a request crossing the rank boundary, a padding row),
caches with random history so that window, compressed, idx and state reads carry data.

Tolerances from the measured distribution (docs/pypto.md): the attention core's online softmax rounds its
probabilities against each key tile's running maximum (the reference: the global maximum), which moves o by up
to 2**-7 and the layer output by up to 2**-9 (measured, |out| <= 1.9, mean |err| <= 2.2e-4). Caches: the pypto
writes copy kernel values; fp32 states differ by the matmul accumulation order (<= 4.8e-7), bf16/int8 entries
computed from them may flip one rounding step.
"""

import numpy as np
import pytest
from pypto_fixtures import CONFIG, SEED, compressor_batch, hidden_rows, random_history

from dspark_kernels.pypto import attention_pypto
from dspark_kernels.reference.attention import attention
from dspark_kernels.reference.caches import LayerCaches
from dspark_kernels.reference.weights import AttentionWeights

pytestmark = pytest.mark.pypto

#: Layer output: 4x the worst measured |err| (2**-9), and a mean bound far below a systematic error (>= 1e-2).
LAYER_ATOL, LAYER_MEAN_ATOL = 2.0**-7, 1e-3
#: fp32 state rows (accumulation order); bf16 pools one step; int8 idx one step; idx scales one fp32 rounding.
STATE_RTOL, STATE_ATOL = 1e-5, 1e-5
BF16_RTOL, BF16_ATOL = 2.0**-7, 1e-6
INT8_STEP, SCALE_RTOL = 1, 1e-6
MAX_DIFFERING_FRACTION = 0.01


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


@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
@pytest.mark.parametrize("rank", [None, 1], ids=["group", "rank1"])
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
    np.testing.assert_allclose(got, want, rtol=0, atol=LAYER_ATOL)
    assert np.abs(got - want).mean() <= LAYER_MEAN_ATOL
    rows = slice(None) if rank is None else slice(rank * batch.local_rows, (rank + 1) * batch.local_rows)
    np.testing.assert_array_equal(got[batch.row_request[rows] < 0], 0.0)  # padding rows
    _check_caches(caches, ref_caches)
