"""The DSpark drafter's target hidden features of a prefill, [P, T * D] in the order of ``dspark_target_layers``:
the mean of the residual streams after each target layer (DeepSeek's ``h.mean(dim=2)``, ``target_hidden``) and
hc_head of them (upstream pypto-lib's ``dspark_target_hidden``, ``target_hidden_hc_head``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from tolerances import assert_close, forward_reductions, order_atol

from dspark_abi.presets import TINY, TINY_DSPARK
from dspark_kernels import prefill
from dspark_kernels.model.forward import ForwardOptions, run_forward
from dspark_kernels.model.numerics import rms_norm
from dspark_kernels.model.tp import run_tp_inprocess

from .conftest import Session

D = TINY_DSPARK.hidden_size
#: two summation orders along the forward's reduction chain (tests/tolerances.py): packing, chunking and rank
#: views change row counts and BLAS blocks, never the math (see tests/model/test_forward.py)
K = forward_reductions(TINY_DSPARK)


def _slot(features: np.ndarray, layer: int) -> np.ndarray:
    k = TINY_DSPARK.dspark_target_layers.index(layer)
    return features[..., k * D:(k + 1) * D]


def _session(**kw) -> Session:
    return Session(config=TINY_DSPARK, **kw)


def _run(s: Session, requests, **kw):
    b = s.batch(requests)
    return b, run_forward(b, b.token_ids, s.weights, s.caches, ForwardOptions(precision=s.precision, **kw))


def _restated_hc_head(x_hc: np.ndarray, fn: np.ndarray, scale: float, base: np.ndarray, eps: float,
                      hc_eps: float) -> np.ndarray:
    """docs/checkpoints.md section 6, written out in float64: y = sum_j (sigmoid(m_j * scale + b_j) + hc_eps) x_j,
    m = (flatten(x) @ fn.T) * rsqrt(mean(flatten(x)^2) + eps)."""
    flat = x_hc.reshape(x_hc.shape[0], -1).astype(np.float64)
    mixes = flat @ fn.astype(np.float64).T / np.sqrt((flat**2).mean(axis=1, keepdims=True) + eps)
    weights = 1 / (1 + np.exp(-(mixes * scale + base))) + hc_eps
    return np.einsum("tj,tjd->td", weights, x_hc.astype(np.float64))


def test_features_are_the_stream_mean_of_each_target_layers_output_and_hc_head_on_request():
    s = _session()
    b, whole = _run(s, [(0, 0, 40), (1, 0, 23)])
    assert whole.target_hidden.shape == whole.target_hidden_hc_head.shape == (b.padded_rows, 3 * D)
    head = s.weights.head()
    for layer in TINY_DSPARK.dspark_target_layers:
        # the streams after `layer`: the same forward stopped there, from the same (fresh) caches
        part = _session()
        _, upto = _run(part, [(0, 0, 40), (1, 0, 23)], layers=list(range(layer + 1)))
        # DeepSeek's definition restated in float64: the plain mean of the hc streams
        mean = upto.x_hc.astype(np.float64).mean(axis=1)
        # fp32 against float64: the forward's two orders (K), then hc = 4 terms of the mean (order bound)
        assert_close(_slot(whole.target_hidden, layer), mean, order_atol(mean, K, 4), f"mean, layer {layer}")
        want = _restated_hc_head(upto.x_hc, head.hc.fn, float(head.hc.scale[0]), head.hc.base,
                                 TINY_DSPARK.rms_norm_eps, TINY_DSPARK.hc_eps)
        # fp32 against float64: one reduction over hc * D for the mixes, then hc terms (order bound, c = 4)
        assert_close(_slot(whole.target_hidden_hc_head, layer), want, order_atol(want, K, 4), f"layer {layer}")
        # the two reductions are different features (learned, token-dependent weights vs 1/4 each)
        assert np.abs(want - mean).max() > 100 * order_atol(want, K, 4)
    # the last layer's hc_head feature is what the final norm turns into the hidden rows the LM head reads
    last = TINY_DSPARK.dspark_target_layers[-1]
    np.testing.assert_array_equal(rms_norm(_slot(whole.target_hidden_hc_head, last), head.norm,
                                           TINY_DSPARK.rms_norm_eps), whole.hidden)


def test_padding_rows_are_zero_and_layers_not_run_leave_their_slot_zero():
    s = _session(tp=4)
    b, res = _run(s, [(0, 0, 9)], layers=[0, 1])
    assert b.padded_rows == 12
    for features in (res.target_hidden, res.target_hidden_hc_head):
        assert not features[9:].any()
        assert _slot(features[:9], 1).any()
        assert not _slot(features, 2).any() and not _slot(features, 3).any()


def test_packed_equals_alone_and_chunked_equals_one_shot():
    packed = _session()
    _run(packed, [(0, 0, 50), (1, 0, 70)])
    _, rp = _run(packed, [(0, 50, 11), (1, 70, 30), (2, 0, 6)])
    alone = _session()
    _run(alone, [(1, 0, 70)])
    _, ra = _run(alone, [(1, 70, 30)])
    assert_close(rp.target_hidden[11:41], ra.target_hidden[:30], order_atol(ra.target_hidden, K), "packed vs alone")
    one = _session()
    _, r1 = _run(one, [(1, 0, 100)])
    assert_close(np.concatenate([ra.target_hidden[:30]]), r1.target_hidden[70:100],
                 order_atol(r1.target_hidden, K), "chunked (70 + 30) vs one shot")


def test_every_tp_rank_view_gives_the_groups_features():
    group = _session(tp=2)
    _, rg = _run(group, [(0, 0, 21), (1, 0, 14)])
    ranks = _session(tp=2)
    bt = ranks.batch([(0, 0, 21), (1, 0, 14)])
    for rank in run_tp_inprocess(bt, bt.token_ids, ranks.weights, ranks.caches):
        assert_close(rank.result.target_hidden, rg.target_hidden, order_atol(rg.target_hidden, K), f"rank {rank.rank}")


def test_prefill_result_and_request_views_carry_them():
    s = _session()
    b = s.batch([(0, 0, 5), (1, 0, 3)])
    res = prefill(b, b.token_ids, s.weights, s.caches)
    assert res.target_hidden.shape == (8, 3 * D)
    assert res.target_hidden_hc_head.shape == (8, 3 * D)
    assert not np.array_equal(res.target_hidden, res.target_hidden_hc_head)
    views = res.requests
    np.testing.assert_array_equal(views[1].target_hidden, res.target_hidden[5:8])


@pytest.mark.parametrize("precision", ["a2a3", "deepseek"])
def test_bf16_precisions_give_bf16_features_the_mean_rounded_once(precision: str):
    """The official mean of bf16 streams: fp32 sum in stream order, / 4 (exact), one bf16 rounding."""
    s = _session(precision=precision)
    b = s.batch([(0, 0, 12)])
    res = prefill(b, b.token_ids, s.weights, s.caches, precision=precision, layers=[0, 1, 2, 3])
    for features in (res.target_hidden, res.target_hidden_hc_head):
        np.testing.assert_array_equal(features.astype(ml_dtypes.bfloat16).astype(np.float32), features)
    last = TINY_DSPARK.dspark_target_layers[-1]
    x = res.x_hc
    want = (((x[:, 0] + x[:, 1]) + x[:, 2]) + x[:, 3]) * np.float32(0.25)
    np.testing.assert_array_equal(_slot(res.target_hidden, last), want.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_no_target_layers_no_features():
    s = Session(config=TINY)
    _, res = _run(s, [(0, 0, 4)])
    assert res.target_hidden is None
