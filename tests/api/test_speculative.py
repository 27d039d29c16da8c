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

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy
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
    """{(layer, array name): [rows, ...]} of the cache rows a next step of each request (cached length c) can
    read, in logical order: per-token pools their reach before c (ori: the window), compressed pools every entry
    complete before c."""
    ids = list(lengths)
    tables = alloc.table_rows(ids)
    out = {}
    for li, layer in enumerate(caches.layers):
        for name, array in layer.arrays().items():
            pool = "idx" if name == "idx_scale" else name
            pl = config.layout.pools[pool]
            parts = []
            for k, rid in enumerate(ids):
                c = lengths[rid]
                lo = max(0, c - pl.reach) if pl.is_ring else 0
                hi = c // pl.ratio if pl.ratio else c
                rows = physical_rows(tables[pool], np.full(hi - lo, k), np.arange(lo, hi), pl.page_size,
                                     ring=pl.is_ring)
                assert (rows >= 0).all(), (pool, rid)
                parts.append(array[rows])
            out[(li, name)] = np.concatenate(parts)
    return out


def one_shot(weights: ModelWeights, result) -> tuple[BlockAllocator, ModelCaches, dict[int, int]]:
    """Fresh caches holding every request's committed tokens, prefilled in one chunk per request."""
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
    prefill(batch, batch.token_ids, weights, caches)
    builder.commit(batch)
    return alloc, caches, {i: t.size for i, t in committed.items()}


def assert_caches_equal_one_shot(weights: ModelWeights, result) -> None:
    alloc, caches, lengths = one_shot(weights, result)
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
