"""The DSpark drafter with ``backend="pypto"`` against the same drafter on the reference backend, both in a2a3, on
TINY-DSpark random weights: three requests' blocks packed in one draft (a short context, one past the window and a
two-row one).

On pypto the stages shared with the target run as kernels in child processes (hc_pre with the fused norms,
hc_post, the MoE, hc_head, hc_head + RMSNorm, the LM head), the draft attention (the block keys' shared kv, the q
path, the sparse-attention kernel over the ring rows and the block's entry rows, o_proj), observe's main_x and
window keys (the linear + norm and shared kv kernels; the keys' FP8 step on the host on both backends) and the
Markov and confidence heads. Both sides compute the a2a3 numerics, so they differ by the kernels' fp32 summation
orders before each bf16 rounding, which flip a rounding now and then (tests/tolerances.py):

* window keys after observe: one bf16 step, or one e4m3 step on the FP8-stepped dims (``_assert_window_close``).
* head rows h and the normed hidden rows, per row in norm: ``H_RTOL`` of the row. Each of the three stages' draft
  attention may move its output by one int8 step of o_proj (``LAYER_RTOL``, the attention policy below: one bf16
  flip of o moves an int8 activation by one step); hc_post and the residual adds carry a relative error at gain
  <= 1 and the norms keep it relative, so the stages' errors add, 3 x ``LAYER_RTOL``, plus the head's own bf16
  roundings (``BF16_RTOL``); a factor 2 of margin. Elementwise there is no such bound (a cancelling element keeps
  its row's absolute error), so the row norm is the measure; the exact fraction and the ratio are printed.
* tokens: the same first maximum unless the reference's top-2 margin of the biased logits is below the logits'
  bound, ``H_RTOL * ||hidden_row|| * ||head_v||`` (Cauchy-Schwarz on the hidden row's error) plus the Markov
  bias's fp32 order; once a row's token legitimately differs, the request's later rows are biased by another
  previous token and are not compared. The test prints every such row (reported, not hidden).
* confidence (fp32, ``[h ; markov_w1[previous]] @ proj``, on the rows whose previous token is the same on both
  sides): ``H_RTOL * ||h_row|| * ||proj_h||`` plus two fp32 orders of the D + r products (``order_atol``).

The draft attention alone (:mod:`dspark_kernels.pypto.draft_attention` against the reference's
``block_attention``, a2a3, rings partly filled, exactly full and wrapped, the whole block and a TP rank's share of
its rows) is held to the whole-layer attention policy of test_pypto_attention.py: one bf16 flip of o or of a key
moves an int8 activation of o_proj by one step, which moves outputs by <= 2**-7.
"""

import numpy as np
import pytest
from drafter_steps import Steps
from tolerances import BF16_ATOL, BF16_RTOL, MAX_DIFFERING_FRACTION, order_atol

from dspark_abi import ABIError
from dspark_abi.presets import FLASH_DSPARK, TINY_DSPARK
from dspark_kernels.drafter import DSparkDrafter
from dspark_kernels.model.drafter_weights import DrafterWeights, stage_config
from dspark_kernels.model.numerics import bf16_round
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.model.rope import rope_at
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.pypto.backend import PyptoBackend
from dspark_kernels.pypto.draft_attention import block_attention_isolated
from dspark_kernels.pypto.markov import markov_heads_isolated
from dspark_kernels.pypto.observe import main_x_isolated
from dspark_kernels.reference.draft_attention import block_attention
from dspark_kernels.reference.markov import markov_heads
from dspark_kernels.reference.observe import main_x

pytestmark = pytest.mark.pypto

C = TINY_DSPARK
D, W, B = C.hidden_size, C.sliding_window, C.dspark_block_size
FEATURES = len(C.dspark_target_layers) * D
#: The whole-layer attention policy of test_pypto_attention.py (its module docstring).
LAYER_ATOL, LAYER_RTOL, LAYER_MEAN_ATOL = 2.0**-6, 2.0**-7, 1e-3
#: Relative row-norm bound of the head rows of the two drafters (module docstring): 2 x (3 stages x LAYER_RTOL +
#: BF16_RTOL) = 2**-4.
H_RTOL = 2 * (C.n_mtp_layers * LAYER_RTOL + BF16_RTOL)
#: Observed rows per request: a short context, one past the window (ring wrapped) and a two-row one.
LENGTHS = {1: 9, 2: W + 4, 3: 2}


def _features(request: int, n: int) -> np.ndarray:
    """Fixed unit-scale target features of a request's first n positions."""
    return np.random.default_rng([request, 17]).standard_normal((n, FEATURES), dtype=np.float32)


class _Recorded(DSparkDrafter):
    """A drafter that keeps what its head computed (logits [R, B, V] and head rows h [R, B, D]) of the last draft,
    for the margins and bounds below; it computes exactly what :class:`DSparkDrafter` does."""

    def _markov(self, logits, h, anchors):  # type: ignore[no-untyped-def]
        self.seen = (logits, h)
        return super()._markov(logits, h, anchors)

    def _logits(self, hidden, head, rank, all_gather):  # type: ignore[no-untyped-def]
        self.hidden = hidden
        return super()._logits(hidden, head, rank, all_gather)


def _draft(backend: object, **tp: object) -> tuple[_Recorded, object, np.ndarray]:
    target = ModelWeights.random(C, 0)
    d = _Recorded(C, DrafterWeights.random(C, 3), target, precision="a2a3", backend=backend,  # type: ignore[arg-type]
                  **tp)
    ids = list(LENGTHS)
    steps = Steps(C)
    steps.attach(d)
    committed = steps.step(LENGTHS)
    d.observe(ids, [committed[r] for r in ids], [_features(r, LENGTHS[r]) for r in ids])
    anchors = np.array([r * 7 % C.vocab_size for r in ids])
    at = np.array([LENGTHS[r] for r in ids])
    window = d.window_cache.gather(*d.window_cache.window_rows(ids, at))                        # (S, R, W, hd)
    return d, d.draft(ids, anchors, at), window


def _assert_window_close(got: np.ndarray, want: np.ndarray) -> None:
    """The observed window keys [..., hd] of both backends. Both compute main_x and each stage's shared kv in a2a3:
    fp32 sums in their own orders, each rounded to bf16, which an order difference flips now and then (one bf16
    step of the element, BF16_RTOL), then the same FP8 step of the non-RoPE dims. On the RoPE dims a flip stays
    one bf16 step; on the non-RoPE dims it can move the element across an e4m3 rounding point (one e4m3 step of
    the element: 3 mantissa bits, 2**-3 of it) or, where it moves the block's amax across a power of two, onto the
    block's coarser grid (one step of its subnormal range: amax * 2**-8). On at most MAX_DIFFERING_FRACTION of the
    elements; printed."""
    rd = C.qk_rope_head_dim
    nope = got.shape[-1] - rd
    block = np.abs(want[..., :nope]).reshape(*want.shape[:-1], -1, 64).max(-1, keepdims=True)
    fp8_bound = (2.0**-3 * np.abs(want[..., :nope]).reshape((*block.shape[:-1], 64))
                 + block * 2.0**-8).reshape(*want.shape[:-1], nope)
    differing = float(np.mean(got != want))
    print(f"\nwindow keys: {differing:.4f} of the elements differ, max |diff| {float(np.abs(got - want).max()):.3g}")
    assert np.all(np.abs(got[..., :nope] - want[..., :nope]) <= fp8_bound)
    np.testing.assert_allclose(got[..., nope:], want[..., nope:], rtol=BF16_RTOL, atol=BF16_ATOL)
    assert differing <= MAX_DIFFERING_FRACTION, differing


def test_pypto_drafter_equals_the_reference_drafter_within_the_bf16_policies():
    ref, want, want_window = _draft("reference")
    got_d, got, got_window = _draft("pypto")
    assert isinstance(got_d.backend, PyptoBackend)
    # the registered pypto stages
    assert got_d._attention.__module__ == "dspark_kernels.pypto.draft_attention"
    assert got_d._main_x.__module__ == got_d._context_keys.__module__ == "dspark_kernels.pypto.observe"
    assert got_d._markov_heads.__module__ == "dspark_kernels.pypto.markov"
    assert np.abs(want_window).max() > 0                                          # the windows hold keys
    _assert_window_close(got_window, want_window)
    _assert_within_the_bf16_policies(ref, want, got_d, got, "pypto drafter")


def _assert_within_the_bf16_policies(ref: _Recorded, want, got_d: _Recorded, got, label: str  # type: ignore[no-untyped-def]
                                     ) -> None:
    """``got`` (drafted by ``got_d``) agrees with ``want`` (by ``ref``) within the module docstring's policies:
    head and hidden rows in row norm, tokens and confidences."""
    logits, h = ref.seen
    got_logits, got_h = got_d.seen
    assert np.isfinite(got_h).all() and np.isfinite(got_logits).all()
    h_rows = np.linalg.norm(h, axis=-1)                                                        # (R, B)
    h_ratio = float((np.linalg.norm(got_h - h, axis=-1) / (H_RTOL * h_rows)).max())
    hidden_ratio = float((np.linalg.norm(got_d.hidden - ref.hidden, axis=-1)
                          / (H_RTOL * np.linalg.norm(ref.hidden, axis=-1))).max())
    differing = float(np.mean(got_h != h))
    print(f"\n{label}: head rows: {differing:.4f} of the elements differ; max row-norm error / H_RTOL bound: h "
          f"{h_ratio:.3g}, hidden {hidden_ratio:.3g}")
    assert h_ratio <= 1 and hidden_ratio <= 1, (h_ratio, hidden_ratio)
    # tokens, row by row: equal unless the reference's top-2 margin is within the logits' bound
    w = ref.weights
    head = ref.target.head().head
    logit_bound = (H_RTOL * np.linalg.norm(ref.hidden, axis=-1)[:, None] * np.linalg.norm(head, axis=-1)[None, :]
                   ).reshape(logits.shape)                                                     # (R, B, V)
    compared = np.zeros(want.tokens.shape, bool)
    near_ties, margins = [], []
    for k, rid in enumerate(LENGTHS):
        previous = r_anchor = rid * 7 % C.vocab_size
        for i in range(B):
            biased = logits[k, i] + w.markov_w1[previous] @ w.markov_w2.T
            top2 = np.sort(biased)[-2:]
            bias_order = order_atol(w.markov_w1[previous] @ w.markov_w2.T, C.dspark_markov_rank)
            margin, bound = float(top2[1] - top2[0]), float(logit_bound[k, i].max()) + bias_order
            compared[k, i] = True
            margins.append(margin / bound)
            if got.tokens[k, i] != want.tokens[k, i]:
                assert margin <= 2 * bound, (rid, i, margin, bound)   # both sides' logits may move by the bound
                near_ties.append((rid, i, margin, bound))
                break
            previous = int(want.tokens[k, i])
        assert r_anchor == rid * 7 % C.vocab_size
    print(f"\n{label}: {int(compared.sum())} of {compared.size} block rows compared, "
          f"near-tie token differences (request, row, reference margin, logits bound): {near_ties or 'none'}")
    # confidence on the compared rows: every h element one bf16 step off at worst, plus two fp32 orders
    if w.confidence is not None:
        proj = w.confidence[0]                                                                  # (D + r,)
        bound = (H_RTOL * h_rows * np.linalg.norm(proj[:D])
                 + order_atol(want.confidence, D + C.dspark_markov_rank, 2))                    # (R, B)
        same_previous = compared.copy()
        for rid_k, i, _, _ in near_ties:   # a differing row's own confidence reads the same previous token
            same_previous[list(LENGTHS).index(rid_k), i] = True
        diff = np.abs(got.confidence - want.confidence)
        print(f"confidence max |diff| / bound: "
              f"{float((diff / bound)[same_previous].max()):.3g}; smallest reference top-2 margin / logits bound: "
              f"{min(margins):.3g}")
        assert np.all(diff[same_previous] <= bound[same_previous]), float((diff - bound)[same_previous].max())


def test_the_pypto_drafter_needs_the_a2a3_precision():
    with pytest.raises(ABIError) as err:
        DSparkDrafter.random(C, ModelWeights.random(C, 0), precision="fp32", backend="pypto")
    assert err.value.issues[0].code == "config.invalid"


def test_pypto_draft_attention_equals_the_reference_within_the_attention_policy():
    prec = "a2a3"
    w = prepare_weights(DrafterWeights.random(C, 3).stage(1).attn, prec)
    rng = np.random.default_rng(5)
    r = 3
    anchors_at = np.array([2, W, W + 9])                     # rings partly filled, exactly full, wrapped
    visible = np.minimum(W, anchors_at)
    ring = bf16_round(rng.standard_normal((r, W, C.head_dim)).astype(np.float32))
    x = bf16_round(rng.standard_normal((r * B, D)).astype(np.float32))
    cos, sin = rope_at(stage_config(C), "swa", (anchors_at[:, None] + np.arange(B)).reshape(-1), prec)
    kw = {"heads": C.num_attention_heads, "eps": C.rms_norm_eps, "scale": C.softmax_scale, "precision": prec}
    share = slice(2, 7)                                      # a TP rank's rows: across a request boundary
    want = block_attention(x, ring, visible, w, cos, sin, **kw)
    got = block_attention_isolated(x, ring, visible, w, cos, sin, **kw)
    got_share = block_attention_isolated(x, ring, visible, w, cos, sin, rows=share, **kw)
    assert got.shape == want.shape and np.isfinite(got).all()
    print(f"\ndraft attention: max |pypto - reference| {float(np.abs(got - want).max()):.3g}, "
          f"{float(np.mean(got != want)):.3f} of the outputs differ")
    np.testing.assert_allclose(got, want, rtol=LAYER_RTOL, atol=LAYER_ATOL)
    assert np.abs(got - want).mean() <= LAYER_MEAN_ATOL
    np.testing.assert_array_equal(got_share, got[share])
    # the ring matters: the reference without it moves the output far past the tolerance
    no_ring = block_attention(x, ring, np.ones_like(visible), w, cos, sin, **kw)
    assert np.abs(no_ring - want).max() > 10 * LAYER_ATOL


def test_pypto_drafter_tp_equals_the_single_group():
    """TP 2 (threads) on pypto: each rank runs its share of the block rows through the draft attention and the
    MoE kernels and its vocabulary shard through the LM head, gathered rank-major; the drafts and confidences
    equal the single group's on pypto within the bf16 policies of the module docstring."""
    single_d, single, single_window = _draft("pypto")
    tp_d, tp, tp_window = _draft("pypto", tp=2, tp_mode="threads")
    assert tp_d.tp == 2 and isinstance(tp_d.backend, PyptoBackend)
    # A rank's kernels see only its share of the rows (attention, MoE) or of the vocabulary (LM head), and the
    # attention kernel's fp32 summation order depends on its row count: a bf16 rounding flips now and then
    # (measured: one element of stage 1's attention output, 2**-9, in request 1's first row), and the later
    # stages carry it to that request's other rows, whose head rows then differ by more than one bf16 step on
    # ~15 % of their elements (the other requests stay bit-equal). The final values are held to the policies of
    # the pypto-vs-reference test: tokens equal unless a near tie, confidences within one bf16 step of every
    # head element. The head rows are held in row norm (the module docstring), which allows such a flip per stage.
    np.testing.assert_array_equal(tp_window, single_window)     # observe is replicated: every rank the same keys
    _assert_within_the_bf16_policies(single_d, single, tp_d, tp, "pypto drafter TP 2 vs single group")


def test_pypto_markov_heads_equal_the_reference():
    """The Markov kernel (all B rows left to right in one call) and the confidence kernel against the reference's
    fp32 heads, on random base logits. Both sides add the same bf16-valued products in fp32, in their own orders:
    the bias of a row differs by order_atol(bias, r) at most, so a token may differ only where the reference's
    top-2 margin is within twice that (then the request's later rows read another previous token: not compared);
    the confidence by two fp32 orders of its D + r products."""
    w = DrafterWeights.random(C, 3)
    rng = np.random.default_rng(2)
    r = 4
    logits = rng.standard_normal((r, B, C.vocab_size)).astype(np.float32)
    h = rng.standard_normal((r, B, D)).astype(np.float32)
    anchors = np.array([5, 17, C.vocab_size - 1, 0])
    proj = w.confidence[0] if w.confidence is not None else rng.standard_normal(D + C.dspark_markov_rank)
    got_tokens, got_conf = markov_heads_isolated(logits, h, anchors, w.markov_w1, w.markov_w2, proj)
    want_tokens, want_conf = markov_heads(logits, h, anchors, w.markov_w1, w.markov_w2, proj)
    assert got_tokens.shape == (r, B) and got_tokens.dtype == np.int64
    compared = np.zeros((r, B), bool)
    for k in range(r):
        previous = anchors[k]
        for i in range(B):
            bias = w.markov_w1[previous] @ w.markov_w2.T
            top2 = np.sort(logits[k, i] + bias)[-2:]
            compared[k, i] = True
            if got_tokens[k, i] != want_tokens[k, i]:
                assert top2[1] - top2[0] <= 2 * order_atol(bias, C.dspark_markov_rank), (k, i)
                break
            previous = want_tokens[k, i]
    print(f"\nMarkov head: {int(compared.sum())} of {compared.size} rows compared, tokens "
          f"{'equal' if np.array_equal(got_tokens, want_tokens) else 'differ on a near tie'}")
    np.testing.assert_array_less(np.abs(got_conf - want_conf)[compared],
                                 order_atol(want_conf, D + C.dspark_markov_rank, 2) + np.finfo(np.float32).tiny)
    # the bias matters: without it the drafts are the base logits' argmax, which differ here
    assert not np.array_equal(want_tokens, np.argmax(logits, axis=-1))


def test_pypto_main_x_matches_the_reference_at_flash_width():
    """main_x at FLASH-DSpark's widths (T*D = 3 x 4096 -> D = 4096; the linear + norm kernel unsplit over K, its D
    has 16 output tiles) against the reference's a2a3 main_x. Two fp32 orders of a K-long dot product differ by
    ~sqrt(K) u sum|x w| (random-walk rounding; 4x margin), scaled by the RMS normalisation and the norm weight;
    then each side rounds to bf16 (one step of the value), on at most MAX_DIFFERING_FRACTION of the elements."""
    width, d, rows = len(FLASH_DSPARK.dspark_target_layers) * FLASH_DSPARK.hidden_size, FLASH_DSPARK.hidden_size, 8
    rng = np.random.default_rng(7)
    x = bf16_round(rng.standard_normal((rows, width)).astype(np.float32))
    w = bf16_round((rng.standard_normal((d, width)) / np.sqrt(width)).astype(np.float32))
    norm = bf16_round(rng.uniform(0.5, 1.5, d).astype(np.float32))
    eps = FLASH_DSPARK.rms_norm_eps
    got = main_x_isolated(x, w, norm, eps, "a2a3")
    want = main_x(x, w, norm, eps, "a2a3")
    latent = x.astype(np.float64) @ w.T.astype(np.float64)
    inv_rms = 1 / np.sqrt(np.mean(latent**2, axis=1, keepdims=True) + eps)
    spread = 4 * np.sqrt(width) * 2.0**-24 * (np.abs(x) @ np.abs(w).T) * inv_rms * norm
    print(f"\nmain_x at FLASH width: {float(np.mean(got != want)):.4f} of the elements differ")
    np.testing.assert_array_less(np.abs(got - want), spread + BF16_RTOL * np.abs(want) + BF16_ATOL)
    assert np.mean(got != want) <= MAX_DIFFERING_FRACTION
