"""The MoE kernels (gate, routed experts grouped by expert, shared expert, combine) against the reference in a2a3
precision, on TINY: a hash-routed layer (0) and a learned-gate layer (1, experts scaled 8x so the SwiGLU clamp is
reached), 12 rows of which 2 are padding, streaming expert weights (``ExpertStack``, quantised when used).

Measured (10 seeds x both layer kinds, docs/pypto.md): expert ids identical in every case, order included; routing
weights within 4.2e-7 relative (the gate's fp32 logits: torch's matmul order against numpy's); the MoE output
bit-identical (0 differing elements of 20 x 10 x 128). Bit-exactness is not guaranteed by the math: the logits' and
the sum of squares' fp32 order can move a weight or a row scale by an ulp and so flip an int8 rounding of ``h`` or a
bf16 rounding of an output, one bf16 step of one element; the bounds below allow that on a small fraction.
"""

import attrs
import numpy as np
import pytest
from pypto_fixtures import CONFIG, SEED
from tolerances import BF16_RTOL, MAX_DIFFERING_FRACTION  # output: measured no flipped rounding

from dspark_abi import ABIError
from dspark_kernels.model.numerics import bf16_round
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.pypto import PyptoBackend
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.pypto.moe import PAIR_TILE, ExpertTiles, run_moe
from dspark_kernels.reference.moe import moe as reference_moe
from dspark_kernels.reference.moe import quantized_gate

pytestmark = pytest.mark.pypto

ROWS, PADDING = 12, (5, 11)
#: Routing weights: measured <= 4.2e-7 relative; 5x margin.
WEIGHT_RTOL = 2e-6
#: The learned-gate case only counts if its top-k is not decided by a near tie: the K-th and (K+1)-th biased scores
#: must differ by more than the scores' fp32 error (logits of length-D dots: ~1e-6 of |score| ~ 1; 100x margin).
MIN_SELECTION_GAP = 1e-4


def _case(seed: int, layer: int) -> tuple:
    """(x [ROWS, D] bf16 x_mixed rows, MoEWeights, ffn_norm, token ids, live mask)."""
    lw = ModelWeights.random(CONFIG, seed, keep_layers=False).layer(layer)
    w = lw.moe
    if layer >= CONFIG.moe.num_hash_layers:  # reach the SwiGLU clamp (|gate| > 10): experts and shared expert 8x
        e = range(CONFIG.moe.n_routed_experts)
        w = attrs.evolve(w, w1=np.stack([w.w1[i] for i in e]) * 8, w3=np.stack([w.w3[i] for i in e]) * 8,
                         shared_w1=w.shared_w1 * 8, shared_w3=w.shared_w3 * 8)
    rng = np.random.default_rng([SEED, seed, layer])
    live = np.ones(ROWS, bool)
    live[list(PADDING)] = False
    x = bf16_round((rng.standard_normal((ROWS, CONFIG.hidden_size)) * 3).astype(np.float32))
    x[~live] = 0
    return x, w, lw.ffn_norm, rng.integers(0, CONFIG.vocab_size, ROWS), live


# --- run in the child process (run_isolated imports this module there) ------------------------------------

def moe_many(cases: list[tuple]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per case: the kernels' (out, ids, weights), both kernels in this process."""
    out = []
    for x, w, norm, ids, live in cases:
        r = run_moe(x, w, CONFIG, norm=norm, token_ids=ids, live=live)
        out.append((r.out, r.ids, r.weights))
    return out


def moe_in_calls(case: tuple, tiles_per_call: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' output with every routed tile in one call, and in calls of ``tiles_per_call`` tiles."""
    x, w, norm, ids, live = case
    one, split = (run_moe(x, w, CONFIG, norm=norm, token_ids=ids, live=live, tiles_per_call=n).out
                  for n in (10**6, tiles_per_call))
    return one, split


# --- tests --------------------------------------------------------------------------------------------------

def _check_output(got: np.ndarray, want: np.ndarray, live: np.ndarray) -> None:
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=BF16_RTOL, atol=0)
    assert np.mean(got != want) <= MAX_DIFFERING_FRACTION
    assert not got[~live].any()  # padding rows: exact zeros


def test_moe_kernels_match_the_a2a3_reference():
    cases = [_case(seed, layer) for seed in (0, 1) for layer in (0, 1)]
    for (x, w, norm, ids, live), (out, got_ids, got_w) in zip(cases, run_isolated(moe_many, cases), strict=True):
        gate = quantized_gate(x[live], w, CONFIG, norm=norm, token_ids=ids[live])
        if w.tid2eid is None:  # the selection is well defined: no near tie at the K-th place
            xl = x[live].astype(np.float64)
            normed = xl / np.sqrt((xl * xl).mean(axis=1, keepdims=True) + CONFIG.rms_norm_eps) * norm
            s = np.sort(np.sqrt(np.logaddexp(0, normed @ w.gate_w.T)) + w.gate_bias, axis=1)[:, ::-1]
            k = CONFIG.moe.num_experts_per_tok
            assert (s[:, k - 1] - s[:, k]).min() > MIN_SELECTION_GAP
            unclamped = CONFIG.model_copy(update={"moe": CONFIG.moe.model_copy(update={"swiglu_limit": 0.0})})
            assert not np.array_equal(reference_moe(x, w, unclamped, norm=norm, live=live, precision="a2a3"),
                                      reference_moe(x, w, CONFIG, norm=norm, live=live, precision="a2a3"))
        np.testing.assert_array_equal(got_ids, gate.experts)  # expert selection: exact, slot order included
        np.testing.assert_allclose(got_w, gate.weights, rtol=WEIGHT_RTOL, atol=0)
        _check_output(out, reference_moe(x, w, CONFIG, norm=norm, token_ids=ids, live=live, precision="a2a3"), live)


def test_the_backend_runs_both_kernels_in_child_processes():
    x, w, norm, ids, live = _case(2, 0)
    got = PyptoBackend().moe(x, w, CONFIG, norm=norm, token_ids=ids, live=live, precision="a2a3")
    _check_output(got, reference_moe(x, w, CONFIG, norm=norm, token_ids=ids, live=live, precision="a2a3"), live)
    with pytest.raises(ValueError, match="a2a3"):
        PyptoBackend().moe(x, w, CONFIG, norm=norm, token_ids=ids, live=live, precision="fp32")


def test_routed_experts_split_over_several_calls_give_the_same_output():
    """Long tile lists run as several routed calls (``MAX_TILES_PER_CALL``; FLASH at L = 128 has 242 tiles): each
    tile's math is the same and the combine reads the concatenated pairs, so the output is bit-identical."""
    case = _case(3, 1)
    x, w, norm, ids, live = case
    gate = quantized_gate(x[live], w, CONFIG, norm=norm, token_ids=ids[live])
    tiles = len(ExpertTiles.build(gate.experts, gate.weights, CONFIG.moe.n_routed_experts).tile_expert)
    assert tiles >= 3  # 2 tiles per call: at least two routed calls
    one, split = run_isolated(moe_in_calls, case, 2)
    np.testing.assert_array_equal(split, one)
    _check_output(split, reference_moe(x, w, CONFIG, norm=norm, token_ids=ids, live=live, precision="a2a3"), live)


def test_bad_inputs_are_refused_before_any_kernel():
    x, w, norm, ids, live = _case(0, 0)
    with pytest.raises(ABIError) as err:
        run_moe(x, w, CONFIG, norm=norm, live=live)  # a hash layer without token ids
    assert err.value.codes == {"token_ids.range"}
    bad = ids.copy()
    bad[3] = CONFIG.vocab_size
    with pytest.raises(ABIError) as err:
        run_moe(x, w, CONFIG, norm=norm, token_ids=bad, live=live)
    assert err.value.codes == {"token_ids.range"} and "token_ids[3]" in str(err.value)
    with pytest.raises(ABIError) as err:
        run_moe(x, attrs.evolve(w, tid2eid=w.tid2eid + CONFIG.moe.n_routed_experts), CONFIG, token_ids=ids)
    assert err.value.codes == {"config.mismatch"}
    softmax = CONFIG.model_copy(update={"moe": CONFIG.moe.model_copy(update={"scoring_func": "softmax"})})
    with pytest.raises(ABIError) as err:
        run_moe(x, w, softmax, norm=norm, token_ids=ids, live=live)
    assert err.value.codes == {"config.invalid"}
    out = run_moe(x, w, CONFIG, norm=norm, token_ids=ids, live=np.zeros(ROWS, bool))  # no live row: no kernel
    assert out.cycles == (None, None) and not out.out.any()


def test_expert_tiles_group_every_pair_once():
    """Host metadata of the experts kernel: each (row, slot) pair sits in one padded slot of its expert's tiles."""
    rng = np.random.default_rng(SEED)
    t, k, e = 37, 3, 9
    ids = rng.integers(0, e, (t, k))
    ids[:, 1] = np.where(ids[:, 1] == 4, 5, ids[:, 1])  # expert 4 only from slots 0 and 2
    w = rng.random((t, k)).astype(np.float32)
    tiles = ExpertTiles.build(ids, w, e)
    slot = tiles.slot_pos.reshape(k, t).T                                                    # (T, K)
    np.testing.assert_array_equal(tiles.pair_rows[slot], np.broadcast_to(np.arange(t)[:, None], (t, k)))
    np.testing.assert_array_equal(tiles.pair_w[slot, 0], w)
    np.testing.assert_array_equal(tiles.experts[tiles.tile_expert[slot // PAIR_TILE]], ids)
    assert len(np.unique(slot)) == t * k  # no slot shared
    pad = np.setdiff1d(np.arange(len(tiles.pair_rows)), slot)
    assert not tiles.pair_w[pad].any() and not tiles.pair_rows[pad].any()
    counts = np.bincount(ids.ravel(), minlength=e)[tiles.experts]
    assert len(tiles.tile_expert) == int((-(-counts // PAIR_TILE)).sum())  # whole tiles, none spare
    assert np.all(np.diff(tiles.tile_expert) >= 0)  # experts in ascending order, tile by tile
