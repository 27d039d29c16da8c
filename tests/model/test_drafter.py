"""The DSpark drafter (dspark_kernels.drafter) on TINY-DSpark random weights: every stage against a float64
restatement of DeepSeek's math (``DSparkAttention``, ``DSparkBlock.forward_embed / forward_head``,
``DSparkMarkovHead``, ``DSparkConfidenceHead``), the window cache's seeding in the target's ``ori`` pool (spec 5.10)
against a per-request ring through an allocator history that recycles and hands on ``ori`` blocks, packed == alone,
TP == single group, and its coded errors."""

from __future__ import annotations

import itertools

import attrs
import ml_dtypes
import numpy as np
import pytest
from drafter_steps import Steps
from tolerances import assert_close, layer_reductions, order_atol

from dspark_abi import ABIError, ModelConfig, PoolBlocks
from dspark_abi.persistent import PersistentTables
from dspark_abi.presets import FLASH_DSPARK, TINY, TINY_DSPARK
from dspark_kernels import memory
from dspark_kernels.drafter import DraftOutput, DSparkDrafter
from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.drafter_weights import DrafterWeights, stage_config
from dspark_kernels.model.prepared import prepare_weights
from dspark_kernels.model.rope import rope_at
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.reference import draft_attention
from dspark_kernels.reference.draft_attention import block_attention, context_keys

from .test_hyper_connections import _loop_hc_pre
from .test_moe import _loop_moe
from .test_target_hidden import _restated_hc_head

C = TINY_DSPARK
D, W, B = C.hidden_size, C.sliding_window, C.dspark_block_size
FEATURES = len(C.dspark_target_layers) * D
RD = C.qk_rope_head_dim
_TARGET: dict[int, ModelWeights] = {}


def _target() -> ModelWeights:
    if 0 not in _TARGET:
        _TARGET[0] = ModelWeights.random(C, 0)
    return _TARGET[0]


def _drafter(**kw: object) -> DSparkDrafter:
    return DSparkDrafter.random(C, _target(), seed=3, **kw)


def _features(request: int, n: int, start: int = 0) -> np.ndarray:
    """Fixed target features of a request's positions start .. start + n - 1 (unit scale, as stream means are)."""
    rows = np.random.default_rng([request, 17]).standard_normal((start + n, FEATURES), dtype=np.float32)
    return rows[start:]


def _observe(d: DSparkDrafter, lengths: dict[int, int], steps: Steps | None = None) -> Steps:
    """Each request's first ``lengths[r]`` rows in one step of ``steps`` (default a fresh allocator the drafter is
    attached to), committed, then observed."""
    if steps is None:
        steps = Steps(C)
        steps.attach(d)
    committed = steps.step(lengths)
    ids = list(committed)
    d.observe(ids, [committed[r] for r in ids], [_features(r, committed[r].size, int(committed[r][0])) for r in ids])
    return steps


def _window(d: DSparkDrafter, rid: int, at: int) -> np.ndarray:
    """[S, W, D] the window a draft of request ``rid`` at anchor position ``at`` reads, in ring-slot order."""
    cache = d.window_cache
    return cache.gather(*cache.window_rows([rid], np.array([at])))[:, 0]


def _state(d: DSparkDrafter) -> tuple[bytes, dict[int, int], object]:
    """What an error must leave unchanged: the window cache's bytes, the last observed positions, the tables."""
    cache = d.window_cache
    return cache.keys.tobytes(), dict(cache.last), cache.tables


# ---------------------------------------------------------------------------------------------- float64 math
def _rms64(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w.astype(np.float64)


def _rope64(x: np.ndarray, positions: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Interleaved-pair RoPE on the last RD dims at ``positions`` (theta rope_theta, no YaRN: an SWA stage)."""
    omega = 1.0 / C.rope_theta ** (np.arange(0, RD, 2, dtype=np.float64) / RD)
    ang = positions.astype(np.float64)[:, None] * omega                               # (T, RD/2)
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (RD // 2,)
    c, s = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape) * (-1 if inverse else 1)
    out = x.astype(np.float64).copy()
    e, o = x[..., -RD::2].astype(np.float64), x[..., -RD + 1::2].astype(np.float64)
    out[..., -RD::2], out[..., -RD + 1::2] = e * c - o * s, e * s + o * c
    return out


def _keys64(x: np.ndarray, attn, positions: np.ndarray) -> np.ndarray:
    """A window key before the FP8 step: RoPE(rms_norm(x @ wkv.T, kv_norm)) at ``positions``."""
    return _rope64(_rms64(x.astype(np.float64) @ attn.wkv.T.astype(np.float64), attn.kv_norm, C.rms_norm_eps),
                   positions)


def _fp8_bound(v: np.ndarray) -> np.ndarray:
    """|fake_quant(v) - v| on the non-RoPE dims: half an e4m3 step (3 mantissa bits: 2**-4 of the value) plus half
    the block's subnormal step (amax * 2**-9 * 2 for the power-of-two scale rounding up)."""
    nope = v.shape[-1] - RD
    blocks = np.abs(v[..., :nope]).reshape(*v.shape[:-1], -1, 64).max(-1, keepdims=True)
    bound = np.zeros_like(v)
    bound[..., :nope] = (2.0**-4 * np.abs(v[..., :nope]).reshape((*blocks.shape[:-1], 64))
                         + blocks * 2.0**-8).reshape(*v.shape[:-1], nope)
    return bound


def _attention64(x: np.ndarray, attn, rings: list[np.ndarray], own: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """DeepSeek's ``DSparkAttention`` over R blocks of B rows in float64: x [R*B, D] normed rows, rings[r] the
    request's visible ring keys, own [R*B, hd] the block rows' keys, pos [R*B] their positions."""
    r = len(rings)
    qr = _rms64(x.astype(np.float64) @ attn.wq_a.T.astype(np.float64), attn.q_norm, C.rms_norm_eps)
    q = (qr @ attn.wq_b.T.astype(np.float64)).reshape(r * B, C.num_attention_heads, C.head_dim)
    q = _rope64(_rms64(q, None, C.rms_norm_eps), pos)
    out = np.zeros((r * B, C.num_attention_heads, C.head_dim))
    for k in range(r):
        keys = np.concatenate([rings[k].astype(np.float64), own[k * B:(k + 1) * B].astype(np.float64)])
        for i in range(k * B, (k + 1) * B):                       # every block row sees the same keys: non-causal
            logits = q[i] @ keys.T * C.softmax_scale                                       # (H, keys)
            top = logits.max(-1, keepdims=True)
            p = np.exp(logits - top)
            out[i] = (p @ keys) / (p.sum(-1, keepdims=True) + np.exp(attn.attn_sink[:, None] - top))
    o = _rope64(out, pos, inverse=True).reshape(r * B, -1)
    g = C.o_groups
    wo_a = attn.wo_a.astype(np.float64).reshape(g, C.o_lora_rank, -1)
    y = np.einsum("tgd,grd->tgr", o.reshape(r * B, g, -1), wo_a).reshape(r * B, -1)
    return y @ attn.wo_b.T.astype(np.float64)


# ---------------------------------------------------------------------------------------------- config
def test_config_keys_round_trip_through_config_json():
    for cfg in (FLASH_DSPARK, TINY_DSPARK):
        hf = cfg.to_hf_config()
        assert hf["dspark_noise_token_id"] == cfg.dspark_noise_token_id and hf["n_mtp_layers"] == 3
        back = ModelConfig.from_hf_config(hf, name=cfg.name)
        assert back == cfg
    assert (FLASH_DSPARK.dspark_noise_token_id, FLASH_DSPARK.dspark_markov_rank) == (128799, 256)
    # DeepSeek's defaults (rank 256, noise 0, 3 stages) are omitted from dumps: fixture manifests stay as they were
    assert not {"dspark_markov_rank", "dspark_noise_token_id", "n_mtp_layers"} & set(TINY_DSPARK.model_dump())
    assert FLASH_DSPARK.model_dump()["dspark_noise_token_id"] == 128799


def test_a_config_without_a_drafter_is_refused():
    with pytest.raises(ABIError) as err:
        DrafterWeights.random(TINY)
    assert {i.field for i in err.value.issues} == {"dspark_block_size", "dspark_target_layers"}
    assert {i.code for i in err.value.issues} == {"drafter.config"}
    bad_noise = TINY_DSPARK.model_copy(update={"dspark_noise_token_id": TINY_DSPARK.vocab_size})  # unvalidated copy
    with pytest.raises(ABIError) as err:
        DSparkDrafter.random(bad_noise, ModelWeights.random(bad_noise, 0))
    assert [(i.code, i.field) for i in err.value.issues] == [("drafter.config", "dspark_noise_token_id")]
    hf = TINY_DSPARK.to_hf_config() | {"dspark_noise_token_id": TINY_DSPARK.vocab_size}
    with pytest.raises(ABIError) as err:
        ModelConfig.from_hf_config(hf)
    assert err.value.issues[0].code == "config.invalid" and "dspark_noise_token_id" in err.value.issues[0].message


# ---------------------------------------------------------------------------------------------- stages
def test_main_x_and_the_ring_keys_against_float64():
    d = _drafter()
    n = 2 * W + 5                                              # longer than the window: the ring keeps the last W
    _observe(d, {4: n})
    feats = _features(4, n)
    main64 = _rms64(feats.astype(np.float64) @ d.weights.main_proj.T.astype(np.float64), d.weights.main_norm,
                    C.rms_norm_eps)
    # two orders of the main_proj product (K = T*D) and the norm (D)
    assert_close(d.main_x(feats), main64, order_atol(main64, FEATURES + D, 2), "main_x")
    kept = np.arange(n - W, n)
    window = _window(d, 4, n)
    for s in range(C.n_mtp_layers):
        attn = d.weights.stage(s).attn
        want = _keys64(main64[kept], attn, kept)                                  # (W, hd)
        got = window[s, kept % W]
        # fp32 chain (K = T*D + D + D + hd) plus the FP8 step on the non-RoPE dims (only there)
        tol = order_atol(want, FEATURES + 2 * D + 2 * C.head_dim, 4) + _fp8_bound(want)
        assert np.all(np.abs(got - want) <= tol), f"stage {s}"
        # the FP8 step ran: the non-RoPE dims lie on their blocks' e4m3 grid (quantising again changes nothing),
        # which the unquantised keys do not
        np.testing.assert_array_equal(ds.kv_fake_quant(got, RD), got)
        assert not np.array_equal(ds.kv_fake_quant(want.astype(np.float32), RD), want.astype(np.float32))
        assert_close(got[:, -RD:], want[:, -RD:], order_atol(want, FEATURES + 2 * D + 2 * C.head_dim, 4), "rope")


def test_block_attention_against_float64():
    cfg, prec = stage_config(C), "fp32"
    d = _drafter()
    attn = d.weights.stage(1).attn
    w = prepare_weights(attn, prec)
    rng = np.random.default_rng(5)
    r = 3
    anchors_at = np.array([2, W, W + 9])                     # rings partly filled, exactly full, wrapped
    visible = np.minimum(W, anchors_at)
    ring = rng.standard_normal((r, W, C.head_dim)).astype(np.float32)
    x = rng.standard_normal((r * B, D)).astype(np.float32)
    pos = (anchors_at[:, None] + np.arange(B)).reshape(-1)
    cos, sin = rope_at(cfg, "swa", pos)
    got = block_attention(x, ring, visible, w, cos, sin, heads=C.num_attention_heads, eps=C.rms_norm_eps,
                          scale=C.softmax_scale, precision=prec)
    own = context_keys(x, w, cos, sin, C.rms_norm_eps, prec).astype(np.float64)     # checked above (ring keys)
    want = _attention64(x, attn, [ring[k, : visible[k]] for k in range(r)], own, pos)
    hd, h, g = C.head_dim, C.num_attention_heads, C.o_groups
    k_chain = (D + C.q_lora_rank) + (C.q_lora_rank + hd) + (hd + W + B) + (h * hd // g + g * C.o_lora_rank)
    tol = order_atol(want, k_chain, 4)
    assert_close(got, want, tol, "draft attention")
    # the sink and the ring matter: without either the output moves by far more than the tolerance
    no_ring = _attention64(x, attn, [ring[k, :0] for k in range(r)], own, pos)
    no_sink = _attention64(x, attrs.evolve(attn, attn_sink=np.full(h, -np.inf, np.float32)),
                           [ring[k, : visible[k]] for k in range(r)], own, pos)
    assert np.abs(no_ring - want).max() > 100 * tol and np.abs(no_sink - want).max() > 100 * tol


def test_markov_head_and_confidence_against_float64():
    d = _drafter()
    rng = np.random.default_rng(8)
    r = 4
    logits = rng.standard_normal((r, B, C.vocab_size)).astype(np.float32) * 4
    h = rng.standard_normal((r, B, D)).astype(np.float32)
    anchors = rng.integers(0, C.vocab_size, r)
    out = d._markov(logits, h, anchors)
    w = d.weights
    prev = anchors.copy()
    tokens = np.zeros((r, B), np.int64)
    conf = np.zeros((r, B))
    for i in range(B):                          # DSparkBlock.forward_head: bias by the previous token, then argmax
        emb = w.markov_w1[prev].astype(np.float64)
        biased = logits[:, i].astype(np.float64) + emb @ w.markov_w2.T.astype(np.float64)
        tokens[:, i] = prev = biased.argmax(-1)
        conf[:, i] = np.concatenate([h[:, i].astype(np.float64), emb], -1) @ w.confidence[0].astype(np.float64)
    np.testing.assert_array_equal(out.tokens, tokens)
    assert_close(out.confidence, conf, order_atol(conf, D + C.dspark_markov_rank, 2), "confidence")
    assert out.tokens.dtype == np.int64 and out.confidence.dtype == np.float32


# ---------------------------------------------------------------------------------------------- the window
def test_prefill_seeding_keeps_the_last_window_rows_at_absolute_slots_and_chunks_equal_one_call():
    one, chunked = _drafter(), _drafter()
    n = 3 * W + 7
    _observe(one, {1: n})
    cuts = [0, 5, W + 3, 2 * W + 11, n]                          # chunks shorter and longer than the window
    steps = Steps(C)
    steps.attach(chunked)
    for lo, hi in itertools.pairwise(cuts):
        _observe(chunked, {1: hi - lo}, steps)
    a, b = _window(one, 1, n), _window(chunked, 1, n)
    # the same rows in different GEMM row counts (K = T*D + the key chain)
    assert_close(b, a, order_atol(a, FEATURES + 2 * D + 2 * C.head_dim, 2), "chunked vs one call")
    # slot p % W holds position p's key, for the last W positions: compare with those rows observed alone
    alone = _drafter()
    keys = alone.main_x(_features(1, n)[n - W:])
    pos = np.arange(n - W, n)
    cos, sin = rope_at(C, "swa", pos)
    for s in range(C.n_mtp_layers):
        w = prepare_weights(alone.weights.stage(s).attn, "fp32")
        want = context_keys(keys, w, cos, sin, C.rms_norm_eps, "fp32")
        assert_close(a[s, pos % W], want, order_atol(want, FEATURES + 2 * D + 2 * C.head_dim, 2) + _fp8_bound(want),
                     f"stage {s}")


# ---------------------------------------------------------------------------------------------- packed, TP
#: two orders along a draft: the stages' layer chains plus the head (tests/tolerances.py)
K_DRAFT = C.n_mtp_layers * layer_reductions(stage_config(C)) + 2 * D + C.dspark_markov_rank


def _draft(d: DSparkDrafter, lengths: dict[int, int]) -> DraftOutput:
    ids = list(lengths)
    anchors = np.array([r * 7 % C.vocab_size for r in ids])
    return d.draft(ids, anchors, np.array([lengths[r] for r in ids]))


def test_packed_equals_alone():
    lengths = {1: 9, 2: W + 4, 3: 2}
    packed = _drafter()
    _observe(packed, lengths)
    together = _draft(packed, lengths)
    assert together.tokens.shape == (3, B) and together.confidence.shape == (3, B)
    for k, rid in enumerate(lengths):
        alone = _drafter()
        _observe(alone, {rid: lengths[rid]})
        one = _draft(alone, {rid: lengths[rid]})
        np.testing.assert_array_equal(together.tokens[k], one.tokens[0])
        assert_close(together.confidence[k], one.confidence[0], order_atol(one.confidence, K_DRAFT, 4), f"{rid}")
    assert len({tuple(t) for t in together.tokens}) > 1           # different contexts draft differently


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_threads_equal_the_single_group(tp):
    lengths = LENGTHS
    single, group = _drafter(), _drafter(tp=tp, tp_mode="threads")
    _observe(single, lengths)
    _observe(group, lengths)
    a, b = _draft(single, lengths), _draft(group, lengths)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    assert_close(b.confidence, a.confidence, order_atol(a.confidence, K_DRAFT, 4), f"TP {tp}")


def test_propose_is_the_drafter_protocol():
    d = _drafter()
    ctx = np.random.default_rng(2).integers(0, C.vocab_size, 12)
    _observe(d, {5: 11})
    out = d.draft([5], ctx[-1:], np.array([11]))
    got = d.propose([5], [ctx], [2])
    np.testing.assert_array_equal(got[0], out.tokens[0, :2])


# ---------------------------------------------------------------------------------------------- errors
def test_observe_gap_and_unknown_request_change_nothing():
    d = _drafter()
    steps = _observe(d, {7: 20})
    steps.step({7: 4, 8: 4, 9: 5})                                # pages mapped: only the history is wrong
    before = _state(d)
    with pytest.raises(ABIError) as err:                          # request 7 continues at 20, not 22
        d.observe([8, 7], [np.arange(4), np.arange(22, 24)], [_features(8, 4), _features(7, 2, 22)])
    assert [(i.code, i.request) for i in err.value.issues] == [("drafter.gap", 7)]
    with pytest.raises(ABIError) as err:                          # a new request starts at 0
        d.observe([9], [np.arange(3, 5)], [_features(9, 2, 3)])
    assert err.value.issues[0].code == "drafter.gap"
    with pytest.raises(ABIError) as err:                          # a hole inside the rows; a request twice
        d.observe([7, 8, 8], [np.array([20, 22]), np.arange(2), np.arange(2, 4)],
                  [_features(7, 2, 20), _features(8, 2), _features(8, 2, 2)])
    assert sorted((i.field, i.index) for i in err.value.issues) == [("positions", 0), ("request_ids", 2)]
    with pytest.raises(ABIError) as err:
        d.draft([5], np.array([1]), np.array([0]))
    assert err.value.issues[0].code == "drafter.unknown_request" and err.value.issues[0].request == 5
    with pytest.raises(ABIError) as err:                          # the anchor follows position 19
        d.draft([7], np.array([1]), np.array([19]))
    assert err.value.issues[0].code == "drafter.gap"
    with pytest.raises(ABIError) as err:
        d.release([7, 5])
    assert err.value.issues[0].code == "drafter.unknown_request"
    assert _state(d) == before
    d.release([7])
    with pytest.raises(ABIError):
        d.draft([7], np.array([1]), np.array([20]))



_DISTRIBUTED_RANK = '''
import json, sys
import attrs
import ml_dtypes
import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        sys.path.insert(0, "tests")
        from model.test_drafter import _drafter, _draft, _observe, LENGTHS   # the package pytest imports
        d = _drafter(tp=2, tp_mode="distributed")
        _observe(d, LENGTHS)
        out = _draft(d, LENGTHS)
        np.savez(f"{out_dir}/rank{rank}.npz", tokens=out.tokens, confidence=out.confidence)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(rank_main, args=(sys.argv[1], sys.argv[2]), nprocs=2, join=True, start_method="spawn")
'''
#: requests of the TP tests (ragged: the last shares split a request's block rows across ranks)
LENGTHS = {1: 9, 2: W + 4, 3: 2, 4: 30}


@pytest.mark.distributed
def test_two_process_gloo_drafter_equals_the_single_group(tmp_path):
    """tp_mode 'distributed': two rank processes on torch.distributed (gloo), each with its own drafter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "ranks.py"
    script.write_text(_DISTRIBUTED_RANK)
    repo = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")]), "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "init"), str(tmp_path)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    single = _drafter()
    _observe(single, LENGTHS)
    want = _draft(single, LENGTHS)
    for rank in (0, 1):
        got = np.load(tmp_path / f"rank{rank}.npz")
        np.testing.assert_array_equal(got["tokens"], want.tokens)
        assert_close(got["confidence"], want.confidence, order_atol(want.confidence, K_DRAFT, 4), f"rank {rank}")


def test_a_draft_reads_only_the_last_window_rows():
    """Two histories that differ only before the last W positions draft the same (the ring forgets them), and a
    change inside the window changes the draft's confidence."""
    n = 2 * W + 3
    base = _features(6, n)
    older = base.copy()
    older[: n - W] += 1.0
    newer = base.copy()
    newer[n - 1] += 1.0
    outs = []
    for feats in (base, older, newer):
        d = _drafter()
        steps = Steps(C)
        steps.attach(d)
        d.observe([6], [steps.step({6: n})[6]], [feats])
        outs.append(d.draft([6], np.array([9]), np.array([n])))
    np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
    np.testing.assert_array_equal(outs[1].confidence, outs[0].confidence)
    assert np.abs(outs[2].confidence - outs[0].confidence).max() > order_atol(outs[0].confidence, K_DRAFT, 4)


def test_deepseek_precision_rounds_to_bf16_where_the_release_does():
    d = _drafter(precision="deepseek")
    _observe(d, {1: 12})
    ring = _window(d, 1, 12)[:, :12]
    # RoPE dims bf16 (the release's bf16 activations), non-RoPE dims on the FP8 grid
    np.testing.assert_array_equal(ring[..., -RD:], ring[..., -RD:].astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(ds.kv_fake_quant(ring, RD), ring)
    out = _draft(d, {1: 12})
    fp32 = _drafter()
    _observe(fp32, {1: 12})
    ref = _draft(fp32, {1: 12})
    assert out.tokens.shape == ref.tokens.shape and np.isfinite(out.confidence).all()
    # the bf16 activations and FP8 steps are really taken: the confidence moves by more than fp32 orders could
    assert np.abs(out.confidence - ref.confidence).max() > order_atol(ref.confidence, K_DRAFT, 4)


def test_a_whole_draft_against_float64_deepseek():
    """Observe, three stages, head, Markov and confidence composed as DeepSeek's ``forward_spec`` does, in float64
    (hc_pre: tests/model/test_hyper_connections.py's loop, MoE: test_moe.py's loop). The FP8 step of the keys
    (checked by the ring test) is left out on both sides here: its roundings would flip on fp32-vs-float64
    differences."""
    lengths = {1: W + 5, 2: 4}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(draft_attention.ds, "kv_fake_quant", lambda kv, rope_dim: kv)
        d = _drafter()
        _observe(d, lengths)
        got = _draft(d, lengths)
    w, target = d.weights, _target()
    ids = list(lengths)
    anchors = np.array([r * 7 % C.vocab_size for r in ids])
    at = np.array([lengths[r] for r in ids])
    main = {r: _rms64(_features(r, lengths[r]).astype(np.float64) @ w.main_proj.T.astype(np.float64),
                      w.main_norm, C.rms_norm_eps) for r in ids}
    block = np.full((len(ids), B), C.dspark_noise_token_id)
    block[:, 0] = anchors
    pos = (at[:, None] + np.arange(B)).reshape(-1)
    x_hc = np.repeat(target.embed()[block.reshape(-1)][:, None, :].astype(np.float64), C.hc_mult, axis=1)
    hc = (C.hc_mult, C.hc_sinkhorn_iters, C.hc_eps, C.rms_norm_eps)
    for s in range(C.n_mtp_layers):
        lw = w.stage(s)
        rings = []
        for r in ids:                                         # the last W committed rows, position order
            kept = np.arange(max(lengths[r] - W, 0), lengths[r])
            rings.append(_keys64(main[r][kept], lw.attn, kept))
        xm, post, comb = _loop_hc_pre(x_hc, lw.hc_attn, *hc)
        xn = _rms64(xm, lw.attn_norm, C.rms_norm_eps)
        out = _attention64(xn, lw.attn, rings, _keys64(xn, lw.attn, pos), pos)
        x_hc = post[..., None] * out[:, None, :] + np.einsum("tio,tid->tod", comb, x_hc)
        xm, post, comb = _loop_hc_pre(x_hc, lw.hc_ffn, *hc)
        out = _loop_moe(_rms64(xm, lw.ffn_norm, C.rms_norm_eps), lw.moe, np.zeros(len(xm), np.int64), cfg=C)
        x_hc = post[..., None] * out[:, None, :] + np.einsum("tio,tid->tod", comb, x_hc)
    head = w.head_hc()
    h = _restated_hc_head(x_hc, head.fn, float(head.scale[0]), head.base, C.rms_norm_eps, C.hc_eps)
    logits = (_rms64(h, w.head_norm(), C.rms_norm_eps) @ target.head().head.T.astype(np.float64)).reshape(
        len(ids), B, -1)
    prev, conf = anchors.copy(), np.zeros((len(ids), B))
    tokens = np.zeros((len(ids), B), np.int64)
    for i in range(B):
        emb = w.markov_w1[prev].astype(np.float64)
        tokens[:, i] = prev = (logits[:, i] + emb @ w.markov_w2.T.astype(np.float64)).argmax(-1)
        conf[:, i] = np.concatenate([h.reshape(len(ids), B, -1)[:, i], emb], -1) @ w.confidence[0].astype(np.float64)
    np.testing.assert_array_equal(got.tokens, tokens)
    assert_close(got.confidence, conf, order_atol(conf, K_DRAFT, 4), "confidence")


def test_a_failed_weight_read_during_observe_changes_nothing(monkeypatch: pytest.MonkeyPatch):
    d = _drafter()
    steps = _observe(d, {7: 20})
    steps.step({7: 3, 8: 4})
    before = _state(d)
    read = d.weights.stages.layer

    def failing(s: int):
        if s == C.n_mtp_layers - 1:
            raise OSError("shard unreadable")
        return read(s)

    monkeypatch.setattr(d.weights.stages, "layer", failing)
    with pytest.raises(OSError):
        d.observe([7, 8], [np.arange(20, 23), np.arange(4)], [_features(7, 3, 20), _features(8, 4)])
    assert _state(d) == before


# ---------------------------------------------------------------------------------------------- the window in ori
def _restated_keys(d: DSparkDrafter, ids: list[int], committed: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """request -> [S, n, D] the keys an observe of ``committed`` rows computes for each request's last W rows (the
    same rows in the same call, so the same bits): what a per-request ring stores."""
    kept = [committed[r][-W:] for r in ids]
    x = d.main_x(np.concatenate([_features(r, k.size, int(k[0])) for r, k in zip(ids, kept, strict=True)]))
    pos = np.concatenate(kept)
    cos, sin = rope_at(C, "swa", pos, d.precision)
    keys = np.stack([context_keys(x, d._prepared.get(d.weights.stage(s).attn, d.precision), cos, sin,
                                  C.rms_norm_eps, d.precision) for s in range(C.n_mtp_layers)])   # (S, N, D)
    bounds = np.cumsum([0] + [k.size for k in kept])
    return {r: keys[:, bounds[i]: bounds[i + 1]] for i, r in enumerate(ids)}


def test_drafts_equal_a_per_request_ring_while_the_allocator_hands_ori_blocks_on():
    """A serving history on an ori pool of 8 blocks: prefill chunks longer and shorter than the window, verify steps
    committing 1..4 rows (the window wraps many times), a request finishing and a new one taking its blocks. After
    every step each request's window (gathered from its ori slots) and its draft equal, bit for bit, those of a
    per-request ring of W rows at slot ``position mod W`` fed with the same keys (the 1.3 design, restated)."""
    d = _drafter()
    blocks = PoolBlocks.from_mapping(Steps(C).alloc.pool_blocks.as_dict() | {"ori": 8})
    steps = Steps(C, pool_blocks=blocks)
    steps.attach(d)
    rings: dict[int, np.ndarray] = {}                         # request -> [S, W, D] the per-request ring
    holders: dict[int, set[int]] = {}                         # ori block -> requests that held it
    reached = 0
    history = [({0: 24, 1: 5}, {}), ({0: 24, 1: 40}, {}), ({0: 30, 1: 4}, {1: 2}), ({0: 4, 1: 4}, {0: 4, 1: 1}),
               ({0: 4, 1: 4}, {0: 3, 1: 4}), ({1: 4, 2: 50}, {1: 2}), ({1: 4, 2: 4}, {1: 4, 2: 1}),
               ({1: 4, 2: 4}, {1: 1, 2: 4}), ({1: 4, 2: 4}, {1: 3, 2: 2})]
    for k, (rows, accepted) in enumerate(history):
        if k == 5:                                            # request 0 finishes: its blocks go back to the pool
            steps.release(0)
            d.release([0])
            del rings[0]
        committed = steps.step(rows, accepted)
        ids = list(committed)
        keys = _restated_keys(d, ids, committed)
        d.observe(ids, [committed[r] for r in ids], [_features(r, committed[r].size, int(committed[r][0]))
                                                      for r in ids])
        for r in ids:
            ring = rings.setdefault(r, np.zeros((C.n_mtp_layers, W, C.head_dim), np.float32))
            ring[:, committed[r][-W:] % W] = keys[r]
            slot = steps.alloc.persistent.slot_of(r)
            for b in steps.alloc.persistent.table("ori")[slot]:
                if b >= 0:
                    holders.setdefault(int(b), set()).add(r)
        at = np.array([steps.cached[r] for r in ids])
        reached = max(reached, int(at.max()))
        anchors = np.array([(r * 7 + k) % C.vocab_size for r in ids])
        restated = np.stack([rings[r] for r in ids], axis=1)                          # (S, R, W, D)
        got = d.draft(ids, anchors, at)
        want = d._draft_rank(restated, anchors, at, None, None)
        for i, r in enumerate(ids):
            np.testing.assert_array_equal(_window(d, r, int(at[i])), rings[r], err_msg=f"step {k} request {r}")
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.confidence, want.confidence)
    assert reached > 4 * W                                                 # the window wrapped several times
    assert any(len(r) > 1 for r in holders.values())                       # a block served two requests
    assert any(2 in r and 0 in r for r in holders.values())                # the new request took a freed block


def test_rows_outside_the_ori_run_are_unmapped_and_change_nothing():
    """R75: a drafter observes a step's committed rows and drafts before the request's next step is built; once a
    later step moved the request's ori run past the rows, observe and draft are drafter.unmapped and nothing
    changes; without tables too."""
    d = _drafter()
    with pytest.raises(ABIError) as err:                                   # no tables attached
        d.observe([1], [np.arange(3)], [_features(1, 3)])
    assert err.value.issues[0].code == "drafter.unmapped" and "attach" in err.value.issues[0].fix
    steps = Steps(C)
    steps.attach(d)
    n = 3 * 32 + W - 1            # the window [n - W, n) starts on the last row of page 2
    _observe(d, {1: n}, steps)
    before = _state(d)
    d.draft([1], np.array([5]), np.array([n]))                             # drafted before the next step: fine
    steps.step({1: 5})            # the next step's live range starts at n - W + 1: page 2 is released
    with pytest.raises(ABIError) as err:
        d.draft([1], np.array([5]), np.array([n]))
    issue = err.value.issues[0]
    assert (issue.code, issue.field, issue.request, issue.index) == ("drafter.unmapped", "anchor_positions", 1, 0)
    assert issue.expected == "positions in pages [3, 4) (the request's ori run)"
    assert issue.actual == f"positions [{n - W}, {n - 1}]"
    # observing rows of a step after a later step moved the run past them
    late = steps.step({2: 40})[2]
    steps.step({2: 60})
    steps.step({2: 4})            # its live range starts at 100 - W + 1: pages 0 and 1 (rows 24..39) released
    with pytest.raises(ABIError) as err:
        d.observe([2], [late], [_features(2, 40)])
    assert [(i.code, i.request) for i in err.value.issues] == [("drafter.unmapped", 2)]
    assert _state(d) == before
    # a request the tables do not hold
    with pytest.raises(ABIError) as err:
        d.observe([3], [np.arange(2)], [_features(3, 2)])
    issue = err.value.issues[0]
    assert issue.code == "drafter.unmapped" and issue.expected == "no ori slot in the tables"
    assert _state(d) == before


def test_attach_refuses_other_tables_while_requests_are_observed():
    d = _drafter()
    flash = PersistentTables(FLASH_DSPARK, PoolBlocks.uniform(8))
    with pytest.raises(ABIError) as err:                                   # another ori geometry: never
        d.attach(flash)
    assert [(i.code, i.field) for i in err.value.issues] == [("config.mismatch", "tables")]
    assert d.window_cache.tables is None and d.window_cache.keys.size == 0
    steps = Steps(C)
    steps.attach(d)
    assert d.window_cache.keys.shape == (C.n_mtp_layers, steps.alloc.pool_blocks.ori * 32, C.head_dim)
    assert d.window_cache.nbytes == memory.drafter_window_bytes(C, steps.alloc.pool_blocks)
    _observe(d, {1: 9}, steps)
    before = _state(d)
    other = Steps(C, pool_blocks=PoolBlocks.uniform(64))
    with pytest.raises(ABIError) as err:                                   # another block count with rows held
        other.attach(d)
    assert [(i.code, i.field) for i in err.value.issues] == [("config.mismatch", "pool_blocks.ori")]
    assert _state(d) == before
    steps.attach(d)                                                        # the same tables again: nothing changes
    assert _state(d) == before
    same_blocks = Steps(C, pool_blocks=steps.alloc.pool_blocks)            # another allocator of the same size:
    with pytest.raises(ABIError) as err:                                   # it does not hold request 1's pages
        same_blocks.attach(d)
    assert [(i.code, i.request) for i in err.value.issues] == [("config.mismatch", 1)]
    assert _state(d) == before and d.window_cache.tables is steps.alloc.persistent
    mirror = steps.alloc.persistent.copy()                                 # a mirror of the same tables: accepted,
    d.attach(mirror)                                                       # the window kept
    assert _state(d)[:2] == before[:2] and d.window_cache.tables is mirror
    steps.attach(d)
    with pytest.warns(DeprecationWarning):                                 # 1.3's name of the window cache
        assert d.rings is d.window_cache
    d.release([1])
    other.attach(d)                                                        # nothing observed: the cache follows
    assert d.window_cache.keys.shape[1] == 64 * 32 and d.window_cache.tables is other.alloc.persistent
    _observe(d, {1: 9}, other)
    np.testing.assert_array_equal(_draft(d, {1: 9}).tokens, _draft(_observed_alone(1, 9), {1: 9}).tokens)


def _observed_alone(rid: int, n: int) -> DSparkDrafter:
    d = _drafter()
    _observe(d, {rid: n})
    return d


def test_draft_attention_is_a_deprecated_alias_of_the_stage_registry():
    from dspark_kernels import drafter

    with pytest.warns(DeprecationWarning, match="DRAFTER_STAGES"):
        old = drafter.DRAFT_ATTENTION
    assert old == {name: stages["attention"] for name, stages in drafter.DRAFTER_STAGES.items()}
    assert _drafter()._markov_heads.__module__ == "dspark_kernels.reference.markov"   # the reference's stages
