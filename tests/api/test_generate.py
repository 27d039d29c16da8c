"""Speculative generation with a drafter that conditions on the target (``speculative.generate``).

The loop's side of the contract, checked with a test double that implements the :class:`ConditionedDrafter`
protocol exactly as specified (it drafts the target's own greedy continuation with a scripted confidence): it is
handed the target features of every committed row and of nothing else (contiguous absolute positions, the
accepted rows of verify steps, every row of prefill chunks; values equal to a one-shot prefill of the committed
tokens), it drafts before each verify step with the anchor at the first uncommitted position, finished requests
are released; the width is fixed or follows the confidence threshold; the report's figures follow from the
accepted counts; a deployment's mistakes are refused before the first step with coded issues and nothing changed.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest
from safetensors.numpy import save_file
from tolerances import assert_close, order_atol

from dspark_abi import ABIError, BlockAllocator, ModelConfig
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.persistent import PersistentTables
from dspark_abi.presets import TINY, TINY_DSPARK
from dspark_kernels.drafter import DSparkDrafter
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.speculative import (
    ConditionedDrafter,
    RandomDrafter,
    ReplayDrafter,
    check_deployment,
    checkpoint_drafter_issues,
    draft_widths,
    generate,
)

from .test_speculative import CHUNK, FORWARD_K, NEW_TOKENS, assert_same_tokens, one_shot, plain, prompts, streams

CFG = TINY_DSPARK
B = CFG.dspark_block_size
#: the double's confidence logits for drafts 1..B (a threshold of 0 keeps 2 drafts, of 1 keeps 1)
CONFIDENCE = np.array([3.0, 0.5, -1.0], np.float32)[:B]


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return ModelWeights.random(CFG, seed=3)          # the weights of tests/api/test_speculative.py


@attrs.frozen(eq=False)
class Block:
    tokens: np.ndarray
    confidence: np.ndarray


class Conditioned:
    """A ConditionedDrafter double: drafts the stream after the anchor (right on the first ``hits`` drafts of a
    block, then the stream's token + 1) with the confidence :data:`CONFIDENCE`, and checks every call against the
    protocol as it happens (the loop's side of the contract)."""

    def __init__(self, streams: dict[int, np.ndarray], config: ModelConfig = CFG, hits: int = B) -> None:
        self.streams, self.config, self.hits = streams, config, hits
        self.seen: dict[int, int] = {}                       # request -> positions observed so far
        self.features: dict[int, list[np.ndarray]] = {}
        self.released: list[int] = []
        self.calls: list[str] = []
        self.tables: PersistentTables | None = None

    def attach(self, tables) -> None:
        self.calls.append("attach")
        assert isinstance(tables, PersistentTables)
        self.tables = tables

    def observe(self, request_ids, positions, features) -> None:
        self.calls.append("observe")
        assert self.tables is not None, "observe before attach"
        assert len(request_ids) == len(positions) == len(features) and len(set(request_ids)) == len(request_ids)
        for r, p, f in zip(request_ids, positions, features, strict=True):
            assert r not in self.released, "observe after release"
            assert p.dtype == np.int64 and p.size >= 1
            np.testing.assert_array_equal(p, np.arange(self.seen.get(r, 0), self.seen.get(r, 0) + p.size))
            assert f.shape == (p.size, len(self.config.dspark_target_layers) * self.config.hidden_size)
            assert f.dtype == np.float32
            self.seen[r] = int(p[-1]) + 1
            self.features.setdefault(r, []).append(f.copy())

    def draft(self, request_ids, anchors, anchor_positions) -> Block:
        self.calls.append("draft")
        rows = []
        assert len(anchors) == len(request_ids)
        for r, p in zip(request_ids, anchor_positions, strict=True):
            assert p == self.seen[r], "the anchor is the first position not observed (every committed row was)"
            rows.append(self.streams[int(r)][p + 1: p + 1 + B])
        tokens = np.stack([np.pad(t, (0, B - t.size)) for t in rows])
        tokens[:, self.hits:] = (tokens[:, self.hits:] + 1) % self.config.vocab_size
        return Block(tokens.astype(np.int64), np.tile(CONFIDENCE, (len(rows), 1)))

    def release(self, request_ids) -> None:
        self.calls.append("release")
        assert not set(request_ids) & set(self.released), "released twice"
        self.released += list(request_ids)


def test_the_double_is_a_conditioned_drafter():
    assert isinstance(Conditioned({}), ConditionedDrafter)
    assert not isinstance(ReplayDrafter({}), ConditionedDrafter)


# ---------------------------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("tp,mode", [(1, "single"), (2, "threads")])
def test_drafter_sees_exactly_the_committed_rows(weights, tp, mode):
    """Packed with other requests' prefill chunks, in each TP mode: tokens equal plain greedy decoding, every
    committed row of a request that drafts again is observed once, in order, with the features a one-shot
    prefill of the committed tokens has there (never a rejected draft's row: the double is right on one draft of
    each block); every request is released once, after its last observe."""
    reference = plain(weights, tp, mode)
    double = Conditioned(streams(reference), hits=1)
    got = generate(prompts(), weights, double, NEW_TOKENS, B, tp=tp, tp_mode=mode, prefill_chunk=CHUNK)
    assert_same_tokens(got, reference)   # equal, or a reported near-tie (tests/api/test_speculative.py)
    assert double.calls[0] == "attach" and double.tables is got.allocator.persistent
    assert any(s.mixed for s in got.steps)
    assert any(v.accepted < v.width for s in got.steps for v in s.verify)     # rejected rows were written
    assert sorted(double.released) == list(range(len(prompts())))
    assert double.calls[-1] == "release"
    features = one_shot(weights, got)[3]
    for r, chunks in double.features.items():
        seen = np.concatenate(chunks)
        # every row up to the request's last verify step's anchor: observed before its drafts were made
        last_anchor = max(v.position for s in got.steps for v in s.verify if v.request_id == r)
        assert seen.shape[0] >= last_anchor
        want = features[r][: seen.shape[0]]
        # verify and chunked rows vs one prompt: two summation orders along the forward (tests/tolerances.py)
        assert_close(seen, want, order_atol(want, FORWARD_K), f"observed features of request {r}")


def test_replay_acceptance_is_k_plus_one(weights):
    """A drafter that is always right: every verify step accepts all its drafts, K + 1 tokens per step where the
    token budget leaves room for K drafts; per-position acceptance 1, one verify row per generated token."""
    reference = plain(weights, 1, "single")
    for drafter in (ReplayDrafter(streams(reference)), Conditioned(streams(reference))):
        got = generate(prompts(), weights, drafter, NEW_TOKENS, B, prefill_chunk=CHUNK)
        if assert_same_tokens(got, reference):    # a near-tie parted the streams: the drafts are not all right
            continue
        verified = [v for s in got.steps for v in s.verify]
        assert all(v.accepted == v.width for v in verified)
        for i, lengths in got.accepted_lengths.items():   # only the last step of a request may be narrower
            assert all(n == B + 1 for n in lengths[:-1]), (i, lengths)
        np.testing.assert_array_equal(got.acceptance_by_position, np.ones(B))
        assert got.verify_rows_per_token == 1.0


@pytest.mark.parametrize("threshold,min_drafts,drafts", [(0.0, 1, 2), (1.0, 1, 1), (5.0, 0, 0), (5.0, 2, 2),
                                                         (-5.0, 1, B)])
def test_adaptive_width_honours_the_threshold(weights, threshold, min_drafts, drafts):
    """With confidence logits (3, 0.5, -1) the loop verifies the drafts up to the first below the threshold, at
    least min_drafts (fewer only where the token budget ends); the tokens stay plain greedy decoding's."""
    reference = plain(weights, 1, "single")
    got = generate(prompts(), weights, Conditioned(streams(reference)), NEW_TOKENS, B, adaptive=threshold,
                   min_drafts=min_drafts, prefill_chunk=CHUNK)
    assert_same_tokens(got, reference)   # equal, or a reported near-tie (tests/api/test_speculative.py)
    for i in got.tokens:
        widths = [v.width - 1 for s in got.steps for v in s.verify if v.request_id == i]
        assert widths[:-1] == [drafts] * (len(widths) - 1) and widths[-1] <= drafts, (i, widths)


def test_draft_widths_equal_the_per_request_scan():
    rng = np.random.default_rng(5)
    for _ in range(50):
        r, b = int(rng.integers(1, 6)), int(rng.integers(1, 7))
        confidence = rng.normal(size=(r, b)).astype(np.float32)
        k, t, low = int(rng.integers(0, b + 1)), float(rng.normal()), int(rng.integers(0, 3))
        got = draft_widths(confidence, k, t, low)
        for i in range(r):
            n = 0
            while n < k and confidence[i, n] >= t:
                n += 1
            assert got[i] == min(max(n, low), k)
        np.testing.assert_array_equal(draft_widths(confidence, k), np.full(r, k))


def test_summary_follows_from_the_steps(weights):
    reference = plain(weights, 1, "single")
    got = generate(prompts(), weights, Conditioned(streams(reference)), NEW_TOKENS, B, adaptive=0.0,
                   prefill_chunk=CHUNK)
    notes = assert_same_tokens(got, reference)
    s = got.summary()
    verified = [v for st in got.steps for v in st.verify]
    assert s["steps"] == len(got.steps) and s["verify_requests"] == len(verified)
    assert s["tokens"] == NEW_TOKENS * len(prompts())
    assert s["verify_rows_per_token"] == sum(v.width for v in verified) / sum(v.accepted for v in verified)
    assert notes or s["acceptance_by_position"] == [1.0, 1.0]   # two drafts verified per step, both right
    assert s["seconds"] == pytest.approx(sum(st.seconds for st in got.steps))
    assert all(st.seconds > 0 for st in got.steps)


def test_hc_head_features_only_when_asked_for(weights):
    reference = plain(weights, 1, "single")
    with pytest.raises(ABIError) as err:
        generate(prompts(), weights, Conditioned(streams(reference)), 2, B, features="hc_head")
    assert [(i.code, i.field) for i in err.value.issues] == [("config.invalid", "features")]
    assert "allow_hc_head" in err.value.issues[0].fix
    mean, head = Conditioned(streams(reference)), Conditioned(streams(reference))
    generate(prompts()[:1], weights, mean, 2, B)
    generate(prompts()[:1], weights, head, 2, B, features="hc_head", allow_hc_head=True)
    assert not np.allclose(mean.features[0][0], head.features[0][0])   # the two reductions differ


# ---------------------------------------------------------------------------------------------- refusals
def refused(weights, drafter, **kwargs) -> ABIError:
    """generate(...) raises before the first step: no cache row written, the allocator never saw a request, the
    drafter never called."""
    alloc = BlockAllocator(CFG, pool_blocks_for(CFG, [64], slack=8))
    caches = ModelCaches.allocate(CFG, alloc.pool_blocks)
    before = {k: v.copy() for k, v in caches.arrays().items()}
    args = {"prompts": [np.arange(5)], "max_new_tokens": 4, "K": B} | kwargs
    with pytest.raises(ABIError) as err:
        generate(args.pop("prompts"), weights, drafter, allocator=alloc, caches=caches, **args)
    assert alloc.knows(0) is False
    assert getattr(drafter, "calls", []) == []
    for k, v in before.items():
        np.testing.assert_array_equal(caches.arrays()[k], v)
    return err.value


def test_k_above_the_block_size_is_refused_citing_the_evidence(weights):
    issues = refused(weights, Conditioned({}), K=B + 1).issues
    assert [i.code for i in issues] == ["verify.drafts"] and "41834" in issues[0].message


def test_a_drafter_of_another_model_is_refused(weights):
    other = CFG.model_copy(update={"dspark_target_layers": (0, 1, 2)})
    issues = refused(weights, Conditioned({}, config=other)).issues
    assert [(i.code, i.field) for i in issues] == [("config.mismatch", "dspark_target_layers")]


def test_adaptive_width_needs_a_confidence_head(weights):
    issues = refused(weights, RandomDrafter(CFG.vocab_size), adaptive=0.0).issues
    assert [(i.code, i.field) for i in issues] == [("config.invalid", "adaptive")]


def test_an_object_that_is_no_drafter_is_refused(weights):
    issues = refused(weights, object()).issues
    assert [(i.code, i.field) for i in issues] == [("config.invalid", "drafter")]


def test_a_config_without_target_layers_cannot_feed_a_drafter():
    tiny = ModelWeights.random(TINY, seed=0)
    issues = check_deployment(TINY, tiny, Conditioned({}, config=TINY), TINY.dspark_block_size)
    assert ("config.invalid", "dspark_target_layers") in [(i.code, i.field) for i in issues]


@pytest.mark.parametrize("window", [CFG.sliding_window - 1, CFG.sliding_window + 1])
def test_a_window_other_than_the_ori_pools_is_refused(weights, window):
    """The drafter's window lives in the target's ori pool, which keeps sliding_window positions mapped between a
    request's steps: a narrower window is not the drafter's, a wider one would read rows ori has released."""
    double = Conditioned({})
    double.window_cache = type("Window", (), {"window": window})()   # type: ignore[attr-defined]
    issues = check_deployment(CFG, weights, double, B)
    assert [(i.code, i.field) for i in issues] == [("config.invalid", "window_cache.window")]
    double.window_cache.window = CFG.sliding_window                  # type: ignore[attr-defined]
    assert check_deployment(CFG, weights, double, B) == []


def test_a_drafter_whose_main_proj_does_not_take_the_features_is_refused(weights):
    drafter = DSparkDrafter.random(CFG, weights, seed=5)
    assert check_deployment(CFG, weights, drafter, B) == []
    drafter.weights = attrs.evolve(drafter.weights, main_proj=drafter.weights.main_proj[:, :-1])
    issues = check_deployment(CFG, weights, drafter, B)
    assert [(i.code, i.field) for i in issues] == [("array.shape", "mtp.0.main_proj.weight")]


def test_cached_rows_cannot_feed_a_conditioned_drafter(weights):
    issues = refused(weights, Conditioned({}), cached=[3]).issues
    assert [(i.code, i.field) for i in issues] == [("config.invalid", "cached")]


def test_every_failure_is_reported_at_once(weights):
    other = CFG.model_copy(update={"hidden_size": CFG.hidden_size * 2})
    issues = check_deployment(CFG, weights, Conditioned({}, config=other), B + 2, adaptive=float("nan"),
                              features="hc_head")
    assert {(i.code, i.field) for i in issues} == {("config.mismatch", "hidden_size"), ("verify.drafts", "K"),
                                                  ("config.invalid", "adaptive"), ("config.invalid", "features")}
    assert check_deployment(CFG, weights, Conditioned({}), B) == []


def test_a_prompt_beyond_the_position_limit_is_refused(weights):
    long = np.zeros(CFG.max_position_embeddings + 1, np.int64)
    issues = refused(weights, Conditioned({}), prompts=[np.arange(3), long]).issues
    assert [(i.code, i.index) for i in issues] == [("positions.out_of_range", 1)]


def test_a_checkpoint_without_drafter_tensors_names_them_and_the_way_out(tmp_path: Path):
    save_file({"embed.weight": np.zeros((4, 2), np.float32)}, str(tmp_path / "model-00001.safetensors"))
    issues = checkpoint_drafter_issues(tmp_path)
    assert [(i.code, i.field) for i in issues] == [("array.missing", "mtp.*")]
    assert "replay" in issues[0].fix and "greedy" in issues[0].fix
    save_file({"mtp.0.norm.weight": np.zeros(2, np.float32)}, str(tmp_path / "model-00002.safetensors"))
    assert checkpoint_drafter_issues(tmp_path) == []


# ---------------------------------------------------------------------------------------------- the DSpark drafter
class Spied(DSparkDrafter):
    """The DSpark drafter, recording the requests it is told to release."""

    released: list[int]

    def release(self, request_ids) -> None:
        super().release(request_ids)
        self.released = [*getattr(self, "released", []), *request_ids]


def dspark(weights: ModelWeights, tp: int = 1, mode: str = "single") -> Spied:
    return Spied.random(CFG, weights, seed=5, tp=tp,                          # type: ignore[return-value]
                        tp_mode="threads" if mode == "threads" else "single")


@pytest.mark.parametrize("tp,mode,tables", [(1, "single", "persistent"), (2, "threads", "persistent"),
                                           (1, "single", "full")])
def test_dspark_drafter_yields_plain_greedy_tokens(weights, tp, mode, tables):
    """The golden property with the DSpark drafter (random TINY-DSpark weights), packed with prefill chunks, its
    window in the loop's ori pool (both table forms commit into the allocator's persistent tables); every request
    released once."""
    reference = plain(weights, tp, mode)
    drafter = dspark(weights, tp, mode)
    got = generate(prompts(), weights, drafter, NEW_TOKENS, B, tp=tp, tp_mode=mode, prefill_chunk=CHUNK,
                   tables=tables)
    assert_same_tokens(got, reference)   # equal, or a reported near-tie (tests/api/test_speculative.py)
    assert any(s.mixed for s in got.steps)
    assert sorted(drafter.released) == list(range(len(prompts())))
    assert drafter.window_cache.tables is got.allocator.persistent     # the window lives in the loop's ori pool


def test_dspark_drafter_adaptive_width(weights):
    reference = plain(weights, 1, "single")
    got = generate(prompts(), weights, dspark(weights), NEW_TOKENS, B, adaptive=0.0, min_drafts=0,
                   prefill_chunk=CHUNK)
    assert_same_tokens(got, reference)   # equal, or a reported near-tie (tests/api/test_speculative.py)
    assert got.summary()["verify_requests"] > 0


@pytest.mark.distributed
def test_dspark_drafter_runs_in_the_rank_processes(weights):
    """TP 2 with one process per rank: the DSpark drafter runs there (TP 2 over the group, fed by each rank's own
    target features), not in the caller. Tokens equal plain greedy decoding; every step's rows (so every draft)
    and the acceptance equal the same loop's with the drafter as a single group in the caller (threads TP, the
    ranks' arithmetic; the drafter's TP drafts equal its single group's: tests/model/test_drafter.py); no step
    brings target features back to the caller, whose drafter is never called."""
    from dspark_kernels.speculative import greedy_decode

    short = [prompts()[0], prompts()[1][:9]]
    reference = greedy_decode(short, weights, 6, tp=2, tp_mode="threads")
    single = generate(short, weights, dspark(weights), 6, B, tp=2, tp_mode="threads", prefill_chunk=CHUNK)
    caller = dspark(weights)
    got = generate(short, weights, caller, 6, B, tp=2, tp_mode="distributed", prefill_chunk=CHUNK)
    for i, tokens in reference.tokens.items():
        np.testing.assert_array_equal(got.tokens[i], tokens)
    assert len(got.steps) == len(single.steps) and got.accepted_lengths == single.accepted_lengths
    for mine, theirs in zip(got.steps, single.steps, strict=True):
        np.testing.assert_array_equal(mine.batch.token_ids, theirs.batch.token_ids)   # anchors and drafts
        np.testing.assert_array_equal(mine.accepted, theirs.accepted)
    verified = [v for s in got.steps for v in s.verify]
    assert verified and all(v.target_hidden is None for v in verified)
    assert all(v.target_hidden is not None for s in single.steps for v in s.verify)
    assert getattr(caller, "released", []) == []      # in the caller's place, it would have released every request


def test_the_rank_group_proxy_attaches_only_the_allocators_tables(weights):
    """The distributed loop's caller-side drafter (its copies run in the rank processes, each attached to its own
    mirror of the allocator's tables): attach checks the tables are the allocator's and changes nothing; before a
    step started the group, draft and observe name no known request."""
    from dspark_kernels.speculative import _drafter_in_ranks, _runner

    runner, alloc = _runner(CFG, weights, None, None, [16], "distributed", "reference", "fp32", 8)
    proxy = _drafter_in_ranks(runner, DSparkDrafter.random(CFG, weights, seed=5), "mean")
    assert isinstance(proxy, ConditionedDrafter) and not isinstance(proxy, DSparkDrafter)
    assert runner.drafter is not None and runner.drafter[2] == "mean"
    proxy.attach(alloc.persistent)
    with pytest.raises(ABIError) as err:
        proxy.attach(alloc.persistent.copy())
    assert [(i.code, i.field) for i in err.value.issues] == [("config.mismatch", "tables")]
    with pytest.raises(ABIError) as err:
        proxy.draft([0], np.array([1]), np.array([4]))
    assert err.value.issues[0].code == "drafter.unknown_request"
    with pytest.raises(ABIError) as err:                  # features stay in the ranks: arrays are refused
        proxy.observe([0], [np.arange(3)], [np.zeros((3, 1), np.float32)])
    assert [i.code for i in err.value.issues] == ["config.invalid"]
    # other drafters, a drafter built from weights in memory and the other modes keep the caller's drafter
    in_memory = DSparkDrafter(CFG, DSparkDrafter.random(CFG, weights, seed=5).weights, weights)
    assert in_memory.recipe is None and _drafter_in_ranks(runner, in_memory, "mean") is in_memory
    single, _ = _runner(CFG, weights, None, None, [16], "single", "reference", "fp32", 8)
    local = DSparkDrafter.random(CFG, weights, seed=5)
    assert _drafter_in_ranks(single, local, "mean") is local


def test_dspark_drafter_near_the_position_limit():
    """Requests that run into max_position_embeddings: the drafter drafts only while its block fits before the
    limit (later steps verify the anchor alone); generation stops at the limit, as plain greedy decoding does."""
    from dspark_kernels.speculative import greedy_decode

    cfg = CFG.model_copy(update={"max_position_embeddings": 128})
    w = ModelWeights.random(cfg, seed=3)
    short = [np.arange(118) % cfg.vocab_size, np.arange(40)]
    reference = greedy_decode(short, w, 14)
    drafter = DSparkDrafter.random(cfg, w, seed=5)
    got = generate(short, w, drafter, 14, B, prefill_chunk=64)
    assert got.tokens[0].size == 128 - 118 + 1 and got.tokens[1].size == 14     # the limit ends request 0
    assert_same_tokens(got, reference)
    last = [v for s in got.steps for v in s.verify if v.request_id == 0][-1]
    assert last.position + last.width <= 128


def test_a_failed_step_releases_the_drafter_state(weights):
    """A step that fails (here: on_step raising after the second commit) leaves no request held by the drafter."""
    double = Conditioned(streams(plain(weights, 1, "single")))
    seen = []

    def fail(record, caches) -> None:
        seen.append(record)
        if len(seen) == 2:
            raise RuntimeError("the scheduler stopped")

    with pytest.raises(RuntimeError, match="scheduler"):
        generate(prompts(), weights, double, NEW_TOKENS, B, prefill_chunk=CHUNK, on_step=fail)
    assert sorted(double.released) == sorted(double.seen) and double.seen


def test_a_noise_token_outside_the_vocabulary_is_refused(weights):
    """The config refuses it when built (validation); a config that skipped validation is caught at start-up."""
    with pytest.raises(ValueError, match="dspark_noise_token_id"):
        ModelConfig.model_validate({**CFG.model_dump(), "dspark_noise_token_id": CFG.vocab_size})
    bad = CFG.model_copy(update={"dspark_noise_token_id": CFG.vocab_size})
    issues = check_deployment(bad, weights, RandomDrafter(CFG.vocab_size), B)
    assert ("token_ids.range", "dspark_noise_token_id") in [(i.code, i.field) for i in issues]
