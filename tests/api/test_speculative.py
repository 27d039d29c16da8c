"""The greedy speculative loop (``dspark_kernels.speculative``): the golden property.

For every drafter (replaying the target's own continuation, random, right exactly j of K times), prefill then
build -> forward -> accept -> commit steps, with other requests' prefill chunks packed into the same dispatches,
yield exactly the tokens of plain greedy decoding one token per step, and leave every cache row a later step can
read equal to prefilling the committed tokens in one shot. Garbage planted after every step in each cache row a
rejected draft wrote (every pool: ori, csa_cmp, idx, hca_cmp and the three state rings) never reaches an output.
"""

from __future__ import annotations

import copy
import warnings
import zlib

import numpy as np
import pytest
from tolerances import assert_close, forward_reductions, order_atol

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.layout import physical_rows
from dspark_abi.presets import TINY_1M, TINY_DSPARK
from dspark_kernels.api import prefill
from dspark_kernels.model.accept import accept_greedy
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.speculative import (
    FixedHitsDrafter,
    RandomDrafter,
    ReplayDrafter,
    generate,
    greedy_decode,
    rejected_rows,
)

CFG = TINY_DSPARK
#: drafts per verify request: the config's DSpark block size
K = CFG.dspark_block_size
#: two summation orders over a whole forward (chunked vs one-shot, packed vs alone): tests/tolerances.py
FORWARD_K = forward_reductions(CFG)
#: what a rejected draft's rows are overwritten with after each step: NaN reaches any output it touches
GARBAGE = np.nan
NEW_TOKENS = 12
#: prompt lengths and the chunk: request 0 verifies while 1 and 2 still prefill (mixed dispatches)
PROMPT_LENGTHS = (5, 23, 40)
CHUNK = 8


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return ModelWeights.random(CFG, seed=3)


def prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, CFG.vocab_size, n) for n in PROMPT_LENGTHS]


_PLAIN: dict[tuple[int, str], object] = {}


def plain(weights: ModelWeights, tp: int, mode: str):
    if (tp, mode) not in _PLAIN:
        _PLAIN[(tp, mode)] = greedy_decode(prompts(), weights, NEW_TOKENS, tp=tp, tp_mode=mode)  # type: ignore[arg-type]
    return _PLAIN[(tp, mode)]


def streams(result) -> dict[int, np.ndarray]:
    return {i: np.concatenate([p, result.tokens[i]]) for i, p in enumerate(prompts())}


def assert_same_tokens(got, want) -> list[str]:
    """Tokens equal; a first difference is allowed only where the plain run's top-2 logit margin is within two
    summation orders over the forward (eps32 * sqrt(K) * max|logits of that row|), and is reported."""
    notes = []
    for i, tokens in want.tokens.items():
        assert got.tokens[i].size == tokens.size
        diff = np.flatnonzero(got.tokens[i] != tokens)
        if diff.size:
            j = int(diff[0])
            margin = float(want.margins[i][j])
            tol = order_atol(want.logit_scales[i][j:j + 1], FORWARD_K)
            assert margin <= tol, f"request {i}: token {j} differs ({got.tokens[i][j]} vs {tokens[j]}) " \
                                  f"with a top-2 margin {margin:.3e} above the tolerance {tol:.3e}"
            notes.append(f"request {i} token {j}: near-tie (margin {margin:.3e} <= {tol:.3e}), tokens differ")
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return notes


class Planter:
    """on_step hook: overwrite every cache row a rejected draft wrote with garbage; counts rows per pool."""

    def __init__(self) -> None:
        self.planted: dict[str, int] = {}

    def __call__(self, record, caches: ModelCaches) -> None:
        mask = rejected_rows(record.batch, record.accepted)
        for layer in caches.layers:
            for name, array in layer.arrays().items():
                pool = "idx" if name == "idx_scale" else name
                rows = record.batch.slots[pool][mask]
                rows = rows[rows >= 0]
                array[rows] = GARBAGE if array.dtype.kind == "f" else 127
                self.planted[pool] = self.planted.get(pool, 0) + int(rows.size)


def readable_rows(config, alloc: BlockAllocator, caches: ModelCaches, lengths: dict[int, int]):
    """{(layer, array name): values} of the cache rows of :func:`readable_rows_index`, in logical order."""
    return {(li, name): caches.layers[li].arrays()[name][rows]
            for (li, name), rows in readable_rows_index(config, alloc, caches, lengths).items()}


def one_shot(weights: ModelWeights, result):
    """Fresh allocator and caches holding every request's committed tokens, prefilled in one chunk per request;
    the committed lengths and each request's [c, T * D] target features."""
    committed = {}
    for i, p in enumerate(prompts()):
        c = result.allocator.cached_tokens(i)
        committed[i] = np.concatenate([p, result.tokens[i]])[:c]
    alloc = BlockAllocator(CFG, pool_blocks_for(CFG, [t.size for t in committed.values()], slack=8))
    caches = ModelCaches.allocate(CFG, alloc.pool_blocks)
    builder = BatchBuilder(CFG, PaddingPolicy(), alloc)
    for i, t in committed.items():
        builder.add(i, num_cached=0, num_new=t.size, token_ids=t)
    batch = builder.build()
    out = prefill(batch, batch.token_ids, weights, caches)
    builder.commit(batch)
    features = {r.request_id: r.target_hidden for r in out.requests}
    return alloc, caches, {i: t.size for i, t in committed.items()}, features


def assert_caches_equal_one_shot(weights: ModelWeights, result) -> None:
    alloc, caches, lengths, _ = one_shot(weights, result)
    assert {i: result.allocator.cached_tokens(i) for i in lengths} == lengths
    got = readable_rows(CFG, result.allocator, result.caches, lengths)
    want = readable_rows(CFG, alloc, caches, lengths)
    for key, ref in want.items():
        assert np.isfinite(got[key]).all(), f"garbage in a readable row of {key}"
        # chunked == one-shot: two summation orders along the forward's chain (tests/tolerances.py)
        assert_close(got[key], ref, order_atol(ref, FORWARD_K), f"cache rows {key}")


# ---------------------------------------------------------------------------------------------- acceptance
def test_acceptance_equals_the_per_request_scan():
    """The vectorized stage against the plain definition, on random ids with many agreements."""
    rng = np.random.default_rng(4)
    for _ in range(50):
        r, w = int(rng.integers(1, 6)), int(rng.integers(1, 7))
        tokens, greedy = rng.integers(0, 3, (r, w)), rng.integers(0, 3, (r, w))
        widths = rng.integers(1, w + 1, r)
        got = accept_greedy(tokens, greedy, widths)
        for i in range(r):
            m = 0
            while m < widths[i] - 1 and tokens[i, m + 1] == greedy[i, m]:
                m += 1
            assert (got.accepted[i], got.bonus[i]) == (m + 1, greedy[i, m])


# ---------------------------------------------------------------------------------------------- golden
def drafter(kind: str, reference):
    if kind == "replay":
        return ReplayDrafter(streams(reference))
    if kind == "random":
        return RandomDrafter(CFG.vocab_size, seed=1)
    return FixedHitsDrafter(streams(reference), hits=int(kind[-1]), vocab_size=CFG.vocab_size)


@pytest.mark.parametrize("tp,mode", [(1, "single"), (2, "single"), (2, "threads")])
@pytest.mark.parametrize("kind", ["replay", "random", "hits1", "hits2"])
def test_speculative_equals_plain_greedy(weights, kind, tp, mode):
    reference = plain(weights, tp, mode)
    planter = Planter()
    got = generate(prompts(), weights, drafter(kind, reference), NEW_TOKENS, K, tp=tp, tp_mode=mode,
                   prefill_chunk=CHUNK, on_step=planter)
    assert any(s.mixed for s in got.steps), "no dispatch mixed prefill chunks and verify requests"
    notes = assert_same_tokens(got, reference)
    if not notes:
        lengths = [n for v in got.accepted_lengths.values() for n in v]
        if kind == "replay":           # every draft right: each step generates 1 + its drafts
            assert got.mean_accepted_length > 2
        elif kind.startswith("hits"):  # exactly j right: j + 1 tokens, or fewer where the budget allowed fewer
            for step in got.steps:
                for v in step.verify:
                    assert v.accepted == min(int(kind[-1]), v.width - 1) + 1
        assert all(1 <= n <= K + 1 for n in lengths)
    if kind != "replay":   # rejected drafts wrote rows in every pool kind, all of them garbage now
        assert {p for p, n in planter.planted.items() if n} >= {"ori", "csa_state", "csa_inner_state", "hca_state"}
    assert_caches_equal_one_shot(weights, got)


@pytest.mark.parametrize("tp,mode", [(1, "single"), (2, "threads")])
def test_both_table_forms_run_the_same_loop_bit_for_bit(weights, tp, mode):
    """The loops on the persistent form (the default: ``build_step``, the kernels read the persistent tables
    through the loop's mirror) and on the full form (``build``): the same steps, tokens and caches bit for bit,
    garbage planted in the rejected rows alike; plain greedy likewise."""
    runs = {form: generate(prompts(), weights, RandomDrafter(CFG.vocab_size, seed=1), NEW_TOKENS, K, tp=tp,
                           tp_mode=mode, prefill_chunk=CHUNK, on_step=Planter(), tables=form)
            for form in ("persistent", "full")}
    plains = {form: greedy_decode(prompts(), weights, 3, tp=tp, tp_mode=mode, tables=form)
              for form in ("persistent", "full")}
    for got, want in (tuple(runs.values()), tuple(plains.values())):
        assert len(got.steps) == len(want.steps)
        for a, b in zip(got.steps, want.steps, strict=True):
            assert a.batch == b.batch                    # the step's full form is the batch build() made
        for i, tokens in want.tokens.items():
            np.testing.assert_array_equal(got.tokens[i], tokens)
        for name, array in got.caches.arrays().items():
            np.testing.assert_array_equal(array, want.caches.arrays()[name], err_msg=name)


def test_garbage_in_a_committed_row_is_caught(weights):
    """The planting test has teeth: the same NaN written into one committed row (the anchor's ori row of each
    verify request) reaches the outputs or the readable cache rows."""

    def plant_committed(record, caches: ModelCaches) -> None:
        anchors = np.asarray(record.batch.query_start_loc[:-1])[[
            k for k, r in enumerate(record.batch.requests.ids) if int(r) in {v.request_id for v in record.verify}]]
        for layer in caches.layers:
            rows = record.batch.slots["ori"][anchors]
            layer.ori[rows[rows >= 0]] = GARBAGE

    reference = plain(weights, 1, "single")
    got = generate(prompts(), weights, RandomDrafter(CFG.vocab_size, seed=1), NEW_TOKENS, K, prefill_chunk=CHUNK,
                   on_step=plant_committed)
    differs = any(not np.array_equal(got.tokens[i], reference.tokens[i]) for i in reference.tokens)
    if not differs:
        with pytest.raises(AssertionError):
            assert_caches_equal_one_shot(weights, got)


# ---------------------------------------------------------------------------------------------- deep positions
#: TINY heads at the real 1,048,576-position depth, with DSpark target layers (so verify steps have drafts)
DEEP = TINY_1M.model_copy(update={"name": "tiny-1m-dspark", "dspark_target_layers": CFG.dspark_target_layers,
                                  "dspark_block_size": K})
#: cached contexts beyond a turn of every ring (ori 8,256 positions, ratio-4 state rings 8,202): request 0's first
#: verify step drafts position 9,087, which completes HCA entry 70 (ratio 128), request 1's cross ratio-4 entries
DEEP_CONTEXTS = {0: 9_085, 1: 20_003}
DEEP_PROMPT = 1
FORWARD_K_DEEP = forward_reductions(DEEP)


def planted_history() -> tuple[BlockAllocator, ModelCaches]:
    """Requests at ``DEEP_CONTEXTS`` whose history rows (every row a next step reads) hold seeded values: a deep
    context without prefilling it (as tests/kernels/test_deep_positions.py does per layer)."""
    ids = list(DEEP_CONTEXTS)
    cached = np.array([DEEP_CONTEXTS[i] for i in ids], np.int64)
    alloc = BlockAllocator(DEEP, pool_blocks_for(DEEP, [int(c) + 64 for c in cached], slack=16))
    alloc.commit(alloc.plan(ids, cached, cached))
    caches = ModelCaches.allocate(DEEP, alloc.pool_blocks)
    rows = readable_rows_index(DEEP, alloc, caches, {i: int(c) for i, c in zip(ids, cached, strict=True)})
    for (li, name), physical in rows.items():
        array = caches.layers[li].arrays()[name]
        rng = np.random.default_rng([li, zlib.crc32(name.encode())])
        if name == "idx_scale":
            array[physical] = rng.uniform(0.01, 0.02, (physical.size, *array.shape[1:])).astype(array.dtype)
        else:
            array[physical] = rng.standard_normal((physical.size, *array.shape[1:])).astype(array.dtype)
    return alloc, caches


def readable_rows_index(config, alloc: BlockAllocator, caches: ModelCaches, lengths: dict[int, int]):
    """{(layer, array name): physical rows} a next step of each request (cached length c) can read, in logical
    order: per-token pools their reach before c (ori: the window), compressed pools every entry complete before c.
    Rows beyond those (what rejected drafts wrote at positions >= c) are left out: the next step rewrites them."""
    ids = list(lengths)
    tables = alloc.table_rows(ids)
    out = {}
    for li, layer in enumerate(caches.layers):
        for name in layer.arrays():
            pool = "idx" if name == "idx_scale" else name
            pl = config.layout.pools[pool]
            parts = []
            for k, rid in enumerate(ids):
                c = lengths[rid]
                lo = max(0, c - pl.reach) if pl.is_ring else 0
                hi = c // pl.ratio if pl.ratio else c
                parts.append(physical_rows(tables[pool], np.full(hi - lo, k), np.arange(lo, hi), pl.page_size,
                                           ring=pl.is_ring))
            out[(li, name)] = np.concatenate(parts)
            assert (out[(li, name)] >= 0).all(), (li, name)
    return out


@pytest.mark.parametrize("kind", ["random", "hits1"])
def test_speculative_equals_plain_beyond_a_ring_turn(kind):
    weights = ModelWeights.random(DEEP, seed=5)
    alloc, caches = planted_history()
    deep_prompts = [np.random.default_rng(rid).integers(0, DEEP.vocab_size, DEEP_PROMPT) for rid in DEEP_CONTEXTS]
    cached = list(DEEP_CONTEXTS.values())
    new = 6
    reference = greedy_decode(deep_prompts, weights, new, cached=cached, allocator=copy.deepcopy(alloc),
                              caches=caches.copy())
    stream = {i: np.concatenate([p, reference.tokens[i]]) for i, p in enumerate(deep_prompts)}
    drafter_ = RandomDrafter(DEEP.vocab_size, seed=2) if kind == "random" else \
        FixedHitsDrafter(stream, hits=1, vocab_size=DEEP.vocab_size)
    planter = Planter()
    got = generate(deep_prompts, weights, drafter_, new, K, cached=cached, allocator=alloc,
                   caches=caches, on_step=planter)
    if kind == "random":   # rejected drafts completed compressed entries of both ratios: garbage there too
        assert planter.planted.get("hca_cmp", 0) > 0 and planter.planted.get("csa_cmp", 0) > 0
    for i, tokens in reference.tokens.items():
        diff = np.flatnonzero(got.tokens[i] != tokens)
        if diff.size:
            j = int(diff[0])
            tol = order_atol(reference.logit_scales[i][j:j + 1], FORWARD_K_DEEP)
            assert reference.margins[i][j] <= tol, (i, j)
            warnings.warn(f"request {i} token {j}: near-tie, tokens differ", stacklevel=1)
            return
    lengths = {i: got.allocator.cached_tokens(i) for i in DEEP_CONTEXTS}
    assert lengths == {i: reference.allocator.cached_tokens(i) for i in DEEP_CONTEXTS}
    mine = readable_rows_index(DEEP, got.allocator, got.caches, lengths)
    theirs = readable_rows_index(DEEP, reference.allocator, reference.caches, lengths)
    for key, rows in theirs.items():
        ref = reference.caches.layers[key[0]].arrays()[key[1]][rows]
        val = got.caches.layers[key[0]].arrays()[key[1]][mine[key]]
        assert np.isfinite(val).all(), key
        # verify steps vs one-token steps: two summation orders along the forward's chain (tests/tolerances.py)
        assert_close(val, ref, order_atol(ref, FORWARD_K_DEEP), f"cache rows {key}")



@pytest.mark.distributed
@pytest.mark.parametrize("form", ["persistent", "full"])
def test_speculative_equals_plain_on_rank_processes(weights, form):
    """TP 2 with one process per rank (torch.distributed, gloo), a short run: on the persistent form the rank
    processes live across the steps, each advancing its own mirror of the persistent tables by the steps' deltas
    (:class:`~dspark_kernels.model.tp.RankGroup`); on the full form every step is a launch."""
    short = [prompts()[0], prompts()[1][:9]]
    reference = greedy_decode(short, weights, 4, tp=2, tp_mode="threads")
    got = generate(short, weights, RandomDrafter(CFG.vocab_size, seed=1), 4, K, tp=2, tp_mode="distributed",
                   prefill_chunk=CHUNK, on_step=Planter(), tables=form)
    assert any(s.mixed for s in got.steps)
    for i, tokens in reference.tokens.items():
        np.testing.assert_array_equal(got.tokens[i], tokens)   # same ranks' math as threads: equal tokens


def test_verify_results_carry_the_accepted_rows_features(weights):
    """Per-request results: accepted count, accepted drafts, bonus, and the target features of the accepted rows
    only."""
    reference = plain(weights, 1, "single")
    got = generate(prompts(), weights, FixedHitsDrafter(streams(reference), hits=2, vocab_size=CFG.vocab_size),
                   NEW_TOKENS, K, prefill_chunk=CHUNK)
    verified = [v for s in got.steps for v in s.verify]
    assert verified and all(v.target_hidden.shape == (v.accepted, 3 * CFG.hidden_size) for v in verified)
    assert all(v.accepted == 1 + v.accepted_tokens.size for v in verified)
    assert any(v.accepted < v.width for v in verified)          # some drafts were rejected
    features = one_shot(weights, got)[3]
    for v in verified:   # the features of the committed rows, as a one-shot prefill of the same tokens has them
        want = features[v.request_id][v.position: v.position + v.accepted]
        # verify rows vs one prompt: two summation orders along the forward's chain (tests/tolerances.py)
        assert_close(v.target_hidden, want, order_atol(want, FORWARD_K), "target features of accepted rows")


@pytest.mark.parametrize("tp,mode", [(1, "single"), (2, "threads")])
def test_verify_step_has_logits_at_every_row(weights, tp, mode):
    """A verify step of R requests x (1 + K) rows runs the same stages as a prefill chunk of the same tokens at
    the same positions: R (1 + K) logit rows, bit-identical to that chunk's logits at every row."""
    from dspark_kernels.model.tp import run_tp_inprocess

    def forward(batch, caches):
        if mode == "single":
            return prefill(batch, batch.token_ids, weights, caches)
        return run_tp_inprocess(batch, batch.token_ids, weights, caches)[0].result

    ps = prompts()
    alloc = BlockAllocator(CFG, pool_blocks_for(CFG, [p.size + K + 1 for p in ps], slack=8))
    caches = ModelCaches.allocate(CFG, alloc.pool_blocks)
    builder = BatchBuilder(CFG, PaddingPolicy(tp_size=tp), alloc)
    for i, p in enumerate(ps):
        builder.add(i, num_cached=0, num_new=p.size - 1, token_ids=p[:-1])
    batch = builder.build()
    forward(batch, caches)
    builder.commit(batch)
    rng = np.random.default_rng(9)
    rows = [np.concatenate([p[-1:], rng.integers(0, CFG.vocab_size, K)]) for p in ps]
    chunk_alloc, chunk_caches = copy.deepcopy(alloc), caches.copy()
    for i, (p, r) in enumerate(zip(ps, rows, strict=True)):
        builder.add_verify(i, num_cached=p.size - 1, token_ids=r)
    verify = builder.build()
    chunk_builder = BatchBuilder(CFG, PaddingPolicy(tp_size=tp), chunk_alloc)
    for i, (p, r) in enumerate(zip(ps, rows, strict=True)):
        chunk_builder.add(i, num_cached=p.size - 1, num_new=r.size, token_ids=r)
    chunk = chunk_builder.build(logit_rows=list(range(len(ps) * (K + 1))))
    got, want = forward(verify, caches), forward(chunk, chunk_caches)
    assert got.logits.shape == (len(ps) * (1 + K), CFG.vocab_size)
    assert sorted(got.logit_rows.tolist()) == list(range(len(ps) * (1 + K)))
    order = np.argsort(got.logit_rows)
    np.testing.assert_array_equal(got.logits[order], want.logits[np.argsort(want.logit_rows)])
    np.testing.assert_array_equal(got.sampled[order], np.argmax(got.logits[order], axis=-1))


@pytest.mark.parametrize("bad", ["K", "max_new_tokens", "chunk", "prompt_range", "empty_prompt", "tp_mode",
                                 "too_many_drafts", "tables"])
def test_bad_arguments_are_coded_and_touch_nothing(weights, bad):
    alloc = BlockAllocator(CFG, pool_blocks_for(CFG, [64], slack=8))
    caches = ModelCaches.allocate(CFG, alloc.pool_blocks)
    before = {k: v.copy() for k, v in caches.arrays().items()}
    args = {"prompts": [np.arange(5)], "max_new_tokens": 4, "K": K, "prefill_chunk": 4, "tp_mode": "single"}
    args.update({"K": {"K": -1, "too_many_drafts": K + 1}.get(bad, K), "max_new_tokens": 0 if bad == "max_new_tokens"
                 else 4, "prefill_chunk": 0 if bad == "chunk" else 4, "tp_mode": "fibers" if bad == "tp_mode" else
                 "single"})
    if bad == "prompt_range":
        args["prompts"] = [np.array([1, CFG.vocab_size])]
    if bad == "empty_prompt":
        args["prompts"] = [np.arange(0)]
    if bad == "tables":
        args["tables"] = "sparse"
    prompts_ = args.pop("prompts")
    with pytest.raises(ABIError) as err:
        generate(prompts_, weights, RandomDrafter(CFG.vocab_size), allocator=alloc, caches=caches, **args)
    assert err.value.issues
    assert alloc.knows(0) is False    # refused before the first step
    if bad == "too_many_drafts":
        assert err.value.codes == {"verify.drafts"}
    for k, v in before.items():
        np.testing.assert_array_equal(caches.arrays()[k], v)
