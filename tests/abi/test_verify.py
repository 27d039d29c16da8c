"""Verify requests (ABI 1.2): the builder's add_verify, output intent, commit with accepted counts, the validator's
verify rules and the ring headroom of the rejection invariant. Every bad input gets its code and mutates nothing."""

from __future__ import annotations

import copy

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_abi import BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, PoolBlocks
from dspark_abi.errors import ABIError
from dspark_abi.layout import verify_headroom
from dspark_abi.presets import FLASH_DSPARK, TINY, TINY_DSPARK
from dspark_abi.requests import implied_logit_rows
from dspark_abi.validation import validate_arrays

CONFIG = TINY_DSPARK
K = CONFIG.dspark_block_size


def _builder(tp: int = 1, blocks: int = 256, config=CONFIG) -> BatchBuilder:
    return BatchBuilder(config, PaddingPolicy(tp_size=tp), BlockAllocator(config, PoolBlocks.uniform(blocks)))


def _prefilled(builder: BatchBuilder, lengths: dict[int, int]) -> None:
    """Prefill and commit each request's prompt (token ids i % 97)."""
    for rid, n in lengths.items():
        builder.add(rid, num_cached=0, num_new=n, token_ids=[i % 97 for i in range(n)])
    builder.commit(builder.build())


def _snapshot(builder: BatchBuilder) -> tuple:
    alloc = builder.allocator
    return (dict(alloc._cached), {p: t.copy() for p, t in alloc._tables.items()}, dict(alloc._top),
            len(builder._pending), set(builder._built))


def test_presets_and_hf_config_carry_the_block_size():
    assert FLASH_DSPARK.dspark_block_size == 5 and FLASH_DSPARK.max_verify_width == 6
    assert TINY.dspark_block_size == 0 and TINY.max_verify_width == 1
    hf = FLASH_DSPARK.to_hf_config()
    assert hf["dspark_block_size"] == 5
    assert "dspark_block_size" not in TINY.to_hf_config()
    from dspark_abi.config import ModelConfig
    assert ModelConfig.from_hf_config(hf, name=FLASH_DSPARK.name) == FLASH_DSPARK


def test_mixed_step_of_verify_requests_and_prefill_chunks():
    builder = _builder(tp=4)
    _prefilled(builder, {0: 40, 1: 7})
    builder.add_verify(0, num_cached=40, token_ids=[1, 2, 3, 4])            # anchor + 3 drafts = 1 + K
    builder.add(2, num_cached=0, num_new=5, token_ids=[9] * 5, logits="none")   # an earlier chunk
    builder.add_verify(1, num_cached=7, token_ids=[8])                       # the anchor alone
    builder.add(3, num_cached=0, num_new=3, token_ids=[4, 5, 6])             # a final chunk
    batch = builder.build()
    req = batch.requests
    assert batch.positions[:13].tolist() == [40, 41, 42, 43, 0, 1, 2, 3, 4, 7, 0, 1, 2]
    assert req.verify_width.tolist() == [4, 0, 1, 0] and req.is_verify.tolist() == [True, False, True, False]
    assert batch.verify_widths.tolist() == [4, 0, 1, 0] and batch.logit_mode.tolist() == [2, 0, 2, 1]
    assert batch.logit_rows.tolist() == [0, 1, 2, 3, -1, 9, 12]
    lo, hi = req.logit_row_ranges
    assert lo.tolist() == [0, 9, 9, 12] and hi.tolist() == [4, 9, 10, 13]
    assert req.logit_entries.tolist() == [0, 4, 5, 6, 7]
    # the record derived from the arrays is the builder's
    again = PackedBatch.from_arrays(batch.to_arrays(), CONFIG, batch.policy, batch.pool_blocks)
    assert np.array_equal(again.requests.logit_mode, req.logit_mode)
    assert np.array_equal(again.requests.verify_width, req.verify_width)
    # the ring tables hold the headroom of the widest verify request
    for pl in CONFIG.layout:
        assert batch.tables[pl.name].shape[1] >= verify_headroom(pl, 4)


def test_old_logit_rows_arguments_keep_their_meaning():
    builder = _builder()
    builder.add(0, 0, 3)
    builder.add(1, 0, 2, logits="none")
    plain = builder.build(logit_rows=None)
    assert plain.logit_rows is None and plain.logit_mode is None and plain.requests.logit_mode.tolist() == [0, 0]
    builder.add(0, 0, 3)
    builder.add(1, 0, 2, logits="none")
    chosen = builder.build(logit_rows=[1, 4])                 # explicit rows override the chunks' intent
    assert chosen.logit_rows.tolist() == [1, 4] and chosen.logit_mode is None
    assert chosen.requests.logit_row.tolist() == [-1, 4]
    builder.add(0, 0, 3)
    builder.add(1, 0, 2, logits="none")
    intent = builder.build()
    assert intent.logit_rows.tolist() == [2, -1] and intent.logit_mode.tolist() == [1, 0]
    assert intent.verify_widths.tolist() == [0, 0]
    builder.add_many([0, 1], [0, 0], [3, 2], logits="none")          # the engine's arrays, earlier chunks
    builder.add(2, 0, 1)
    assert builder.build().logit_rows.tolist() == [-1, -1, 5]
    builder.add_many([0], [0], [3], logits="verify")                 # type: ignore[arg-type]
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.codes == {"builder.request"}


def test_prefill_only_steps_stay_1_1_batches():
    builder = _builder()
    builder.add(0, num_cached=0, num_new=5)
    batch = builder.build()
    assert batch.verify_widths is None and batch.logit_mode is None
    assert batch.logit_rows.tolist() == [4]
    assert batch.requests.logit_mode.tolist() == [1] and batch.requests.verify_width.tolist() == [0]


def test_commit_advances_by_the_accepted_counts_and_frees_nothing_read_later():
    builder = _builder()
    _prefilled(builder, {0: 70, 1: 10})
    alloc = builder.allocator
    builder.add_verify(0, num_cached=70, token_ids=[1, 2, 3, 4])
    builder.add(1, num_cached=10, num_new=3, token_ids=[1, 2, 3])
    batch = builder.build()
    rejected = batch.requests.uncommitted_rows(np.array([2, 3]))
    assert batch.positions[rejected].tolist() == [72, 73]              # the two rejected drafts of request 0
    builder.commit(batch, accepted=[2, 3])
    assert alloc.cached_tokens(0) == 72 and alloc.cached_tokens(1) == 13
    # every page the committed end still reads and every page of the rejected rows (72, 73) stays mapped
    tables = alloc.table_rows([0])
    for pl in CONFIG.layout:
        lo, hi = CONFIG.layout.read_range(pl.name, 72, 74)
        pages = np.arange(lo // pl.page_size, (hi - 1) // pl.page_size + 1)
        columns = pages % pl.ring_width if pl.is_ring else pages
        assert (tables[pl.name][0, columns] >= 0).all(), pl.name
    # the next step starts at the first rejected position and validates
    builder.add_verify(0, num_cached=72, token_ids=[5, 6])
    nxt = builder.build()
    assert nxt.positions[:2].tolist() == [72, 73]
    builder.commit(nxt, accepted=[1])
    assert alloc.cached_tokens(0) == 73


def test_a_step_without_drafts_is_a_verify_of_width_one_on_a_config_without_dspark():
    builder = _builder(config=TINY)
    _prefilled(builder, {0: 9})
    builder.add_verify(0, num_cached=9, token_ids=[3])
    batch = builder.build()
    assert batch.verify_widths.tolist() == [1] and batch.logit_rows.tolist() == [0]
    builder.add_verify(0, num_cached=9, token_ids=[3, 4])
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.codes == {"verify.drafts"}


@pytest.mark.parametrize(("token_ids", "cached", "code"), [
    ([], 40, "verify.width"),
    ([1] * (K + 2), 40, "verify.drafts"),
    ([1, 2], 0, "verify.no_anchor"),
    ([1, 2, 3], CONFIG.max_position_embeddings - 2, "verify.position_limit"),
])
def test_bad_verify_requests_are_coded_and_change_nothing(token_ids, cached, code):
    builder = _builder(blocks=512)
    _prefilled(builder, {0: 40})
    builder.add_verify(0, num_cached=cached, token_ids=token_ids)
    before = _snapshot(builder)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert code in err.value.codes
    assert _same(_snapshot(builder), before)


def _same(a: tuple, b: tuple) -> bool:
    return (a[0] == b[0] and all(np.array_equal(a[1][p], b[1][p]) for p in a[1]) and a[2:] == b[2:])


def test_builder_refuses_drafts_past_the_position_limit():
    builder = _builder(blocks=512)
    last = CONFIG.max_position_embeddings
    builder.add_verify(0, num_cached=last - 2, token_ids=[1, 2])          # rows at the last two positions: fine
    builder.build()
    builder.add_verify(0, num_cached=last - 2, token_ids=[1, 2, 3])
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.codes == {"verify.position_limit"}


def test_verify_steps_need_the_intent_logits():
    builder = _builder()
    _prefilled(builder, {0: 40})
    builder.add_verify(0, num_cached=40, token_ids=[1, 2])
    with pytest.raises(ABIError) as err:
        builder.build(logit_rows=None)
    assert err.value.codes == {"builder.request"}
    builder.add(1, num_cached=0, num_new=2, logits="every")   # type: ignore[arg-type]
    with pytest.raises(ABIError) as err:
        builder.build()
    assert "builder.request" in err.value.codes


@pytest.mark.parametrize("accepted", [[5, 3], [0, 3], [2, 2], [2], "x", [2.0, 3]])
def test_commit_refuses_bad_accepted_counts_and_changes_nothing(accepted):
    builder = _builder()
    _prefilled(builder, {0: 40, 1: 4})
    builder.add_verify(0, num_cached=40, token_ids=[1, 2, 3, 4])
    builder.add(1, num_cached=4, num_new=3, token_ids=[1, 2, 3])
    batch = builder.build()
    before = _snapshot(builder)
    with pytest.raises(ABIError) as err:
        builder.commit(batch, accepted=accepted)
    assert err.value.codes == {"commit.accepted"}
    assert _same(_snapshot(builder), before)
    builder.commit(batch, accepted=[4, 3])        # still committable once, then never again
    with pytest.raises(ABIError) as err:
        builder.commit(batch, accepted=[4, 3])
    assert err.value.codes == {"alloc.stale_plan"}


def test_stale_and_foreign_batches_are_refused():
    builder, other = _builder(), _builder()
    _prefilled(builder, {0: 40})
    _prefilled(other, {0: 40})
    builder.add_verify(0, num_cached=40, token_ids=[1, 2])
    batch = builder.build()
    with pytest.raises(ABIError) as err:
        other.commit(batch, accepted=[1])
    assert err.value.codes == {"alloc.stale_plan"}
    builder.add_verify(0, num_cached=40, token_ids=[1, 2, 3])
    newer = builder.build()
    builder.commit(newer, accepted=[3])
    before = _snapshot(builder)
    with pytest.raises(ABIError) as err:               # overtaken by the commit of another build of the step
        builder.commit(batch, accepted=[1])
    assert err.value.codes == {"alloc.stale_plan"}
    assert _same(_snapshot(builder), before)


# ------------------------------------------------------------------------------------------------ validator rules
def _verify_batch(start: int = 48, width: int = 4) -> PackedBatch:
    builder = _builder()
    _prefilled(builder, {0: start})
    builder.add_verify(0, num_cached=start, token_ids=list(range(1, width + 1)))
    return builder.build()


def _codes(arrays: dict, config=CONFIG) -> set[str]:
    batch = _verify_batch()
    return validate_arrays(arrays, config, batch.policy, batch.pool_blocks).codes


def test_validator_verify_rules():
    batch = _verify_batch()
    a = batch.to_arrays()
    assert _codes(a) == set()
    assert _codes(a | {"verify_widths": np.array([3], np.int32)}) == {"verify.width", "logits.intent"} - {
        "logits.intent"} or _codes(a | {"verify_widths": np.array([3], np.int32)}) >= {"verify.width"}
    assert _codes(a | {"verify_widths": np.array([-1], np.int32)}) >= {"verify.width"}
    assert _codes(a, config=TINY) == {"verify.drafts"}
    assert _codes(a | {"logit_mode": np.array([1], np.int8)}) == {"logits.intent"}   # a verify request: 2
    assert _codes(a | {"logit_mode": np.array([3], np.int8)}) == {"logits.intent"}
    assert _codes(a | {"logit_rows": np.array([0, 1, 2], np.int32)}) == {"logits.intent"}
    assert _codes({k: v for k, v in a.items() if k != "logit_rows"}) == {"logits.intent"}


def test_validator_refuses_a_verify_request_with_nothing_committed():
    builder = BatchBuilder(CONFIG, PaddingPolicy(), BlockAllocator(CONFIG, PoolBlocks.uniform(256)),
                           ring_width="fixed")            # full ring tables: only the anchor rule is broken
    builder.add(0, num_cached=0, num_new=3, token_ids=[1, 2, 3])
    a = builder.build().to_arrays()
    a |= {"verify_widths": np.array([3], np.int32), "logit_mode": np.array([2], np.int8),
          "logit_rows": np.array([0, 1, 2], np.int32)}
    assert _codes(a) == {"verify.no_anchor"}


def test_validator_refuses_a_ring_narrower_than_the_headroom():
    batch = _verify_batch(start=48, width=4)            # ori live range [33, 52): one page; headroom 2 pages
    ori = batch.tables.ori
    need = verify_headroom(CONFIG.layout.pools["ori"], 4)
    assert ori.shape[1] >= need == 2
    narrow = np.ascontiguousarray(ori[:, 1:2])             # page 1 sits in column 1 % 1 = 0
    a = batch.to_arrays() | {"ori_block_table": narrow}
    assert _codes(a) == {"verify.ring_headroom"}
    # without verify_widths (a 1.1 batch) the same table is valid
    plain = {k: v for k, v in a.items() if k not in ("verify_widths", "logit_mode")}
    plain["logit_rows"] = np.array([3], np.int32)
    assert _codes(plain) == set()


def test_implied_logit_rows_is_the_one_rule():
    start, end = np.array([0, 3, 3, 5]), np.array([3, 3, 5, 9])
    assert implied_logit_rows(start, end, np.array([2, 1, 0, 1])).tolist() == [0, 1, 2, -1, -1, 8]
    assert implied_logit_rows(start, end, np.array([0, 2, 2, 2])).tolist() == [-1, -1, 3, 4, 5, 6, 7, 8]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(-1, 3)), max_size=12))
def test_implied_logit_rows_matches_the_rule_request_by_request(requests):
    """The vectorized rule against the rule spelled per request: intent 2 every row of a non-empty request, 1 its
    last row, anything else (or an empty request) one -1."""
    lengths = np.array([n for n, _ in requests], np.int64)
    end = np.cumsum(lengths)
    start = end - lengths
    mode = np.array([m for _, m in requests], np.int8)
    want: list[int] = []
    for lo, hi, m in zip(start.tolist(), end.tolist(), mode.tolist(), strict=True):
        want += list(range(lo, hi)) if m == 2 and hi > lo else [hi - 1] if m == 1 and hi > lo else [-1]
    got = implied_logit_rows(start, end, mode)
    assert got.dtype == np.int32 and got.tolist() == want


def test_evolving_a_batch_rederives_its_record():
    batch = _verify_batch()
    plain = attrs.evolve(batch, verify_widths=None, logit_mode=None, logit_rows=np.array([3], np.int32))
    assert plain.requests.verify_width.tolist() == [0] and plain.requests.logit_mode.tolist() == [1]
    assert copy.copy(batch).requests.verify_width.tolist() == [4]


def test_capability_check_states_the_headroom_for_every_kernel():
    from dspark_abi.capabilities import KERNELS, check_capabilities
    for config in (TINY_DSPARK, FLASH_DSPARK):
        for pl in config.layout:        # the shipped rings already hold reach + 1 + K (they hold reach + 8192)
            assert pl.ring_width >= verify_headroom(pl, config.max_verify_width)
    policy = PaddingPolicy()
    assert check_capabilities(TINY_DSPARK, policy, PoolBlocks.uniform(64)).ok
    tiny_pools = PoolBlocks.uniform(64).as_dict() | {"csa_state": 3}    # fewer than reach 8 + 4 rows of 2-row pages
    need = verify_headroom(TINY_DSPARK.layout.pools["csa_state"], 4)
    for kernel in KERNELS:
        report = check_capabilities(TINY_DSPARK, policy, tiny_pools, kernel=kernel)
        issue = next(i for i in report.issues if i.code == "verify.ring_headroom")
        assert (issue.field, issue.expected, issue.actual) == ("pool_blocks.csa_state", f">= {need}", 3)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_speculative_loop_with_the_incremental_validator_agrees_with_full_validation(tp):
    """Verify steps with random widths and acceptance, mixed with chunks of other prompts, through a builder with a
    StepValidator: every step validates, equals the stateless verdict, and every request's cached count is the sum
    of what was committed."""
    from dspark_abi import validate
    from dspark_abi.incremental import StepValidator

    rng = np.random.default_rng(tp)
    policy = PaddingPolicy(tp_size=tp)
    alloc = BlockAllocator(CONFIG, PoolBlocks.uniform(512))
    builder = BatchBuilder(CONFIG, policy, alloc, validator=StepValidator(CONFIG, policy, alloc.pool_blocks))
    _prefilled(builder, {0: 29, 1: 126, 2: 250})
    done = {0: 29, 1: 126, 2: 250}
    chunk_of = {10: 0}                                 # a long prompt arriving in chunks of 37
    for _ in range(40):
        for rid in done:
            width = int(rng.integers(1, K + 2))
            builder.add_verify(rid, done[rid], rng.integers(0, CONFIG.vocab_size, width))
        for rid, cached in chunk_of.items():
            builder.add(rid, cached, 37, token_ids=rng.integers(0, CONFIG.vocab_size, 37), logits="none")
        batch = builder.build()
        assert validate(batch).ok
        req = batch.requests
        width = req.verify_width.astype(np.int64)
        accepted = np.where(req.is_verify, rng.integers(1, np.maximum(width, 1) + 1), req.lengths).astype(np.int64)
        builder.commit(batch, accepted=accepted)
        for rid, a in zip(req.ids.tolist(), accepted.tolist(), strict=True):
            if rid in done:
                done[rid] += a
            else:
                chunk_of[rid] += a
        for rid, n in (done | chunk_of).items():
            assert alloc.cached_tokens(rid) == n


@st.composite
def _mixed_steps(draw):
    """(tp, ring mode, prompts, step): verify requests of random widths at random contexts beside prefill chunks."""
    tp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    ring = draw(st.sampled_from(["step", "fixed"]))
    n_verify = draw(st.integers(1, 6))
    contexts = draw(st.lists(st.integers(1, 3000), min_size=n_verify, max_size=n_verify))
    widths = draw(st.lists(st.integers(1, K + 1), min_size=n_verify, max_size=n_verify))
    chunks = draw(st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 40), st.booleans()), max_size=3))
    order = draw(st.permutations(range(n_verify + len(chunks))))
    return tp, ring, contexts, widths, chunks, order


@given(_mixed_steps())
@settings(max_examples=40, deadline=None)
def test_any_mixed_step_is_valid_and_its_record_is_the_arrays_record(case):
    """Any mix of verify requests and chunks, in any order, on any TP size and ring mode: the batch validates
    (stateless and incremental), its logit rows are the intent's, the record derived from the arrays equals the
    builder's, ring tables hold the headroom, and a rectangle round trip of its verify part is exact."""
    from dspark_abi import validate
    from dspark_abi.incremental import StepValidator

    tp, ring, contexts, widths, chunks, order = case
    policy = PaddingPolicy(tp_size=tp)
    from dspark_abi.allocator import pool_blocks_for
    ends = [c + w for c, w in zip(contexts, widths, strict=True)] + [at + n for at, n, _ in chunks]
    alloc = BlockAllocator(CONFIG, pool_blocks_for(CONFIG, ends, slack=64))
    builder = BatchBuilder(CONFIG, policy, alloc, ring_width=ring)
    for rid, ctx in enumerate(contexts):      # one step per context: together they may pass the token cap
        builder.add(rid, 0, ctx)
        builder.commit(builder.build(logit_rows=None))
    entries = [("verify", rid, ctx, w) for rid, (ctx, w) in enumerate(zip(contexts, widths, strict=True))]
    entries += [("chunk", 100 + i, at, n, last) for i, (at, n, last) in enumerate(chunks)]
    for k in order:
        e = entries[k]
        if e[0] == "verify":
            builder.add_verify(e[1], e[2], [(e[1] + j) % 97 for j in range(e[3])])
        else:
            builder.add(e[1], e[2], e[3], token_ids=[j % 97 for j in range(e[3])],
                        logits="last" if e[4] else "none")
    batch = builder.build()
    assert validate(batch).ok
    assert StepValidator(CONFIG, policy, alloc.pool_blocks).validate(batch).ok
    req = batch.requests
    assert np.array_equal(batch.logit_rows, implied_logit_rows(req.row_start, req.row_end, req.logit_mode))
    again = PackedBatch.from_arrays(batch.to_arrays(), CONFIG, policy, batch.pool_blocks).requests
    for name in ("verify_width", "logit_mode", "logit_row", "row_start", "row_end", "ids"):
        assert np.array_equal(getattr(again, name), getattr(req, name)), name
    widest = int(req.verify_width.max())
    for pl in CONFIG.layout:
        assert batch.tables[pl.name].shape[1] >= verify_headroom(pl, widest)
    lo, hi = req.logit_row_ranges
    assert np.array_equal(hi - lo, np.where(req.is_verify, req.lengths, req.logit_mode.astype(np.int64)))
