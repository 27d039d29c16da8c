"""The head's kernels against the reference in a2a3 precision: the stream mean (the DSpark target features),
hc_head (upstream's target features), hc_head +
final RMSNorm, the LM head over requested rows (whole vocabulary and each TP shard) and greedy sampling, on the
packed TINY rows of ``packed_batch`` (P = 10, one zero padding row) with ``ModelWeights.random`` head weights.

Tolerances, derived from the reduction lengths (K = hc*X = 512 for the mixes and the stream RMS, X = 128 for the
final RMS and the logits; u = 2**-24 the fp32 unit roundoff) and measured on 3 seeds x 2 input scales:

* hc_head / final hidden (bf16): the kernel and numpy sum the K-long mixes, the sums of squares and the X-long
  norm in different orders, which moves the fp32 value before its bf16 rounding by at most ~K u relative
  (3e-5 << one bf16 step, 2**-8): an element is equal or one bf16 step apart, and a step only where the value
  sits within that distance of a rounding boundary. Allowed: one bf16 step (``rtol = 2**-7``) on at most 1 % of
  elements. Measured: 0 differing elements in every case.
* logits (fp32): bf16 x bf16 products are exact in fp32, so two summation orders of the X products differ by at
  most ``2 (X - 1) u sum_i |x_i w_i|`` per logit (the standard bound of recursive summation, both orders).
  Measured: 57-60 % of the logits differ, by at most 7.2e-7 absolute and 0.0068 of that bound.
* greedy: exact (a selection over the kernel's own input; ties planted).
"""

import numpy as np
import pytest
from pypto_fixtures import CONFIG, SEED, packed_batch

# one bf16 step, plus the near-zero floor of cancelling streams
from tolerances import BF16_ATOL_CANCELLING as BF16_ATOL
from tolerances import BF16_RTOL, MAX_DIFFERING_FRACTION

from dspark_kernels.model.geometry import vocab_shard
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.pypto.isolate import run_isolated
from dspark_kernels.reference import head as ref_head
from dspark_kernels.reference.hyper_connections import hc_head as ref_hc_head

pytestmark = pytest.mark.pypto

#: fp32 unit roundoff.
U32 = 2.0**-24
#: Input scales of the residual streams: embedding-like and grown over many layers.
X_SCALES = (0.05, 3.0)
#: TP sizes whose vocabulary shards are checked (1024 rows: 512 + 512 and 342 + 342 + 340, an unaligned shard).
TP_SIZES = (2, 3)


def _streams(seed: int, scale: float) -> np.ndarray:
    batch = packed_batch()
    rng = np.random.default_rng([seed, 31])
    x = (rng.standard_normal((batch.padded_rows, CONFIG.hc_mult, CONFIG.hidden_size)) * scale).astype(np.float32)
    x[batch.row_request < 0] = 0
    return x


def _head():
    return ModelWeights.random(CONFIG, seed=SEED % 1000).head()


def _close_bf16(got: np.ndarray, want: np.ndarray, name: str) -> None:
    assert got.shape == want.shape and np.isfinite(got).all(), name
    np.testing.assert_allclose(got, want, rtol=BF16_RTOL, atol=BF16_ATOL, err_msg=name)
    assert np.mean(got != want) <= MAX_DIFFERING_FRACTION, name


# --- run in the child process (run_isolated imports this module there) ------------------------------------

def head_kernels(cases: list[np.ndarray], head, rows: np.ndarray, shards: list[slice]) -> list[tuple]:
    """Per x_hc: (hc_head [T, X], final hidden [T, X], logits of the whole head and of each shard)."""
    from dspark_kernels.pypto import head as k
    from dspark_kernels.pypto.hyper_connections import hc_head

    out = []
    for x in cases:
        hidden = k.final_hidden(x, head, CONFIG)
        out.append((hc_head(x, head.hc, CONFIG), hidden, k.logits_for_rows(hidden, rows, head.head),
                    [k.logits_for_rows(hidden, rows, head.head[s]) for s in shards]))
    return out


def greedy_many(cases: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    from dspark_kernels.pypto.head import greedy

    return [greedy(logits, rows) for logits, rows in cases]


def stream_means(cases: list[np.ndarray]) -> list[np.ndarray]:
    from dspark_kernels.pypto.head import stream_mean

    return [stream_mean(x) for x in cases]


def logits_of_non_bf16_weights() -> None:
    from dspark_kernels.pypto.head import logits_for_rows

    logits_for_rows(np.ones((8, 16), np.float32), np.array([0]), np.full((8, 16), 1.0 + 2.0**-12, np.float32))


# --- tests --------------------------------------------------------------------------------------------------

def test_hc_head_final_hidden_and_logits_match_reference():
    head = _head()
    batch = packed_batch()
    pad = batch.row_request < 0
    # logit rows: each request's last row, an inactive row, a repeated row
    rows = np.array([2, 6, -1, 8, 2], np.int64)
    shards = [vocab_shard(CONFIG.vocab_size, tp, r) for tp in TP_SIZES for r in range(tp)]
    assert any((s.stop - s.start) % 8 for s in shards)  # a shard the kernel pads to whole 32-byte rows
    cases = [_streams(seed, scale) for seed in (SEED, SEED + 1, SEED + 2) for scale in X_SCALES]
    got = run_isolated(head_kernels, cases, head, rows, shards)
    for x, (y, hidden, logits, parts) in zip(cases, got, strict=True):
        _close_bf16(y, ref_hc_head(x, head.hc, CONFIG, precision="a2a3"), "hc_head")
        want_hidden = ref_head.final_hidden(x, head, CONFIG, precision="a2a3")
        _close_bf16(hidden, want_hidden, "final hidden")
        assert not y[pad].any() and not hidden[pad].any()
        # logits of the kernel's own hidden rows (the head stage alone), against the bound of two fp32 orders
        want = ref_head.logits_for_rows(hidden, rows, head.head)
        live = rows >= 0
        bound = 2 * (CONFIG.hidden_size - 1) * U32 * (np.abs(hidden[rows[live]]) @ np.abs(head.head).T)
        assert logits.shape == want.shape
        assert np.all(np.abs(logits[live] - want[live]) <= bound)
        assert np.all(logits[~live] == 0)
        # each TP shard: its vocabulary rows' logits, within the same bound
        for s, part in zip(shards, parts, strict=True):
            assert part.shape == (rows.size, s.stop - s.start)
            assert np.all(np.abs(part[live] - want[live, s]) <= bound[:, s])
            assert np.all(part[~live] == 0)


def test_stream_mean_matches_reference_exactly():
    """DeepSeek's target feature (the mean of the hc streams): the same three fp32 adds in stream order, an exact
    * 1/4 and one bf16 rounding on both sides, so bit-identical (also for streams that are not bf16 values)."""
    from dspark_kernels.model.numerics import bf16_round

    pad = packed_batch().row_request < 0
    cases = [_streams(SEED, scale) for scale in X_SCALES]
    cases += [bf16_round(c) for c in cases]
    for x, got in zip(cases, run_isolated(stream_means, cases), strict=True):
        want = ref_head.stream_mean(x, precision="a2a3")
        np.testing.assert_array_equal(got, want)
        assert not got[pad].any() and got[~pad].any()


def test_greedy_matches_reference_first_maximum():
    rng = np.random.default_rng([SEED, 37])
    vocab = CONFIG.vocab_size
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    logits[1, [5, 700, 1000]] = 9.0          # a tie: the first maximum wins
    logits[2, -1] = 9.0                      # the maximum in the last column
    logits[3] = 0.0                          # all equal: id 0
    logits[4, [3, 4]] = np.float32(7.0), np.nextafter(np.float32(7.0), np.float32(8.0))  # one ulp apart
    rows = np.array([0, 1, 2, 3, 4, -1])
    odd = rng.standard_normal((3, 1021)).astype(np.float32)  # a width the kernel pads with -inf columns
    odd[0, [1019, 1020]] = 5.0
    cases = [(logits, rows), (odd, np.array([4, -1, 0]))]
    results = run_isolated(greedy_many, cases)
    for (lg, rw), got in zip(cases, results, strict=True):
        np.testing.assert_array_equal(got, ref_head.greedy(lg, rw))
        assert got.dtype == np.int64
    assert results[0].tolist() == [int(np.argmax(logits[0])), 5, vocab - 1, 0, 4, -1]
    assert results[1].tolist() == [1019, -1, int(np.argmax(odd[2]))]


def test_head_kernel_input_checks():
    with pytest.raises(ValueError, match="bf16"):
        run_isolated(logits_of_non_bf16_weights)
