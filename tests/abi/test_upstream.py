"""dspark_abi.upstream: the tensors of upstream's packed prefill entry, both ways, and every rejection."""

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, RequestTables
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.layout import physical_rows, written_logical
from dspark_abi.presets import FLASH, TINY
from dspark_abi.testing import packed_batches
from dspark_abi.upstream import (
    UPSTREAM_MAX_LOGIT_ROWS,
    UPSTREAM_SLOTS,
    UPSTREAM_TABLE_DEPTHS,
    UPSTREAM_TABLES,
    UPSTREAM_TENSORS,
    from_upstream,
    table_depths,
    to_upstream,
)

TINY_1M = TINY.model_copy(update={"max_position_embeddings": 1048576, "name": "tiny-1m"})

#: prefill_fwd's metadata parameters at pypto-lib 740fe59 (models/deepseek_v4_flash_dspark/prefill_fwd.py), in
#: order, written out here as the independent oracle of UPSTREAM_TENSORS.
SIGNATURE = [
    ("query_start_loc", "int32"), ("hca_compress_state_block_table", "int32"),
    ("csa_compress_state_block_table", "int32"), ("csa_inner_compress_state_block_table", "int32"),
    ("ori_block_table", "int32"), ("hca_cmp_block_table", "int32"), ("csa_cmp_block_table", "int32"),
    ("idx_block_table", "int32"), ("ori_slot_mapping_full", "int64"), ("position_ids_local", "int32"),
    ("position_ids_full", "int32"), ("input_ids", "int64"), ("hca_cmp_slot_mapping_full", "int64"),
    ("hca_state_slot_mapping_full", "int64"), ("csa_cmp_slot_mapping_full", "int64"),
    ("csa_idx_slot_mapping_full", "int64"), ("csa_state_slot_mapping_full", "int64"),
    ("csa_inner_state_slot_mapping_full", "int64"), ("logit_row_indices", "int32"),
]


def build(config, steps, tp=2, blocks=None):
    """The batch of the last of ``steps``: each a list of (request_id, num_cached, num_new)."""
    contexts = [c + n for c, n in {r: (c, n) for step in steps for r, c, n in step}.values()]
    alloc = BlockAllocator(config, blocks or pool_blocks_for(config, contexts, slack=8))
    builder = BatchBuilder(config, PaddingPolicy(tp_size=tp), alloc)
    rng = np.random.default_rng(0)
    for step in steps:
        for rid, cached, new in step:
            builder.add(rid, num_cached=cached, num_new=new, token_ids=rng.integers(1, config.vocab_size, new))
        batch = builder.build()
        builder.commit(batch)
    return batch


def back(tensors, batch, **kw):
    return from_upstream(tensors, batch.config, batch.policy, batch.pool_blocks, request_ids=batch.request_ids, **kw)


def writable(tensors):
    return {k: np.array(v) for k, v in tensors.items()}


def codes_of(fn):
    with pytest.raises(ABIError) as err:
        fn()
    return err.value


RAGGED2 = [[(0, 0, 126), (1, 0, 30)], [(0, 126, 3), (1, 30, 4)]]


# ---------------------------------------------------------------------------------------------- the form
def test_tensors_are_the_prefill_entrys_metadata_in_its_order():
    assert [(k, dt.name) for k, (dt, _) in UPSTREAM_TENSORS.items()] == SIGNATURE
    tensors = to_upstream(build(TINY_1M, RAGGED2))
    assert [(k, v.dtype.name) for k, v in tensors.items()] == SIGNATURE


def test_frozen_depths_are_the_table_widths_at_one_million_positions():
    assert table_depths(TINY_1M) == table_depths(FLASH) == UPSTREAM_TABLE_DEPTHS
    assert UPSTREAM_TABLE_DEPTHS == {"ori": 32768, "csa_cmp": 8192, "hca_cmp": 256, "idx": 8192,
                                     "csa_state": 524288, "csa_inner_state": 524288, "hca_state": 131072}


def test_ragged2_values_per_rank():
    batch = build(TINY_1M, RAGGED2)
    t = to_upstream(batch)
    assert t["query_start_loc"].tolist() == [[0, 3, 7]] * 2
    assert t["position_ids_local"].tolist() == [[126, 127, 128, 30], [31, 32, 33, 0]]
    assert t["position_ids_full"].shape == (2, 8) and t["input_ids"].shape == (2, 4)
    assert t["input_ids"][1, 3] == 0 and (t["input_ids"].reshape(-1)[:7] == batch.token_ids[:7]).all()
    assert t["logit_row_indices"].shape == (2, UPSTREAM_MAX_LOGIT_ROWS)
    assert t["logit_row_indices"][0, :3].tolist() == [2, 6, -1] and (t["logit_row_indices"][1] == -1).all()
    for name, depth in (("ori_block_table", 32768), ("csa_compress_state_block_table", 524288)):
        assert t[name].shape == (2, 2, depth) and not t[name].flags.writeable
    ori = t["ori_block_table"][0]
    # request 0 reads positions [126 - 15, 129): pages 3 and 4; request 1 [15, 34): pages 0 and 1; all else -1
    assert np.flatnonzero(ori[0] >= 0).tolist() == [3, 4] and np.flatnonzero(ori[1] >= 0).tolist() == [0, 1]
    width = batch.tables.ori.shape[1]                            # a ring table: page i in column i % width
    assert (ori[0, [3, 4]] == batch.tables.ori[0, [3 % width, 4 % width]]).all()
    slots = t["ori_slot_mapping_full"][0]
    b0, b1 = ori[0, [3, 4]].tolist(), ori[1, [0, 1]].tolist()
    assert slots.tolist() == [b0[0] * 32 + 30, b0[0] * 32 + 31, b0[1] * 32, b1[0] * 32 + 30, b1[0] * 32 + 31,
                              b1[1] * 32, b1[1] * 32 + 1, -1]


# ---------------------------------------------------------------------------------------------- round trips
def test_round_trip_of_a_long_chunked_request_through_narrow_ring_tables():
    # contexts far past the ring tables' widths: ori and csa_state pages wrap modulo the width
    steps = [[(7, 0, 8000)], [(7, 8000, 8000), (3, 0, 100)], [(7, 16000, 5000), (3, 100, 3000)]]
    batch = build(TINY_1M, steps, tp=4)
    assert batch.tables.ori.shape[1] * 32 < 16000 and batch.tables.csa_state.shape[1] * 2 < 16000
    tensors = to_upstream(batch)
    live = np.flatnonzero(tensors["csa_compress_state_block_table"][0, 0] >= 0)
    assert live.tolist() == list(range(15992 // 2, 21000 // 2))      # [16000 - 8, 21000), unwrapped
    assert back(tensors, batch) == batch
    assert back(writable(tensors), batch) == batch                     # contiguous copies work the same


@given(packed_batches(TINY_1M, token_ids=True))
@settings(max_examples=15)
def test_round_trip_of_any_builder_batch(batch):
    # zero-length requests, chunk continuations, every TP size, scrambled block ids
    tensors = to_upstream(batch)
    assert back(tensors, batch) == batch
    # upstream's contract: every slot is its linear table's block * page_size + offset (no modulo)
    n, rows = batch.num_tokens, batch.row_request[: batch.num_tokens]
    for pl in TINY_1M.layout:
        linear = tensors[UPSTREAM_TABLES[pl.name]][0]
        logical = written_logical(pl, batch.positions[:n])
        expected = physical_rows(linear, rows, logical, pl.page_size, ring=False)
        assert (tensors[UPSTREAM_SLOTS[pl.name]][0, :n] == expected).all(), pl.name


def test_a_ring_row_of_a_zero_length_request_comes_back_unmapped():
    batch = build(TINY_1M, [[(0, 0, 40), (1, 0, 50)], [(0, 40, 0), (1, 50, 6)]])
    rows = {p: np.array(t) for p, t in batch.tables.items()}
    rows["ori"][0] = rows["ori"][1]                               # whatever a ring row of request 0 holds
    stale = attrs.evolve(batch, tables=RequestTables(**rows))
    restored = back(to_upstream(stale), stale)
    assert (restored.tables.ori[0] == -1).all() and restored == batch
    assert (restored.tables.csa_cmp[0] == batch.tables.csa_cmp[0]).all()    # compressed rows are kept


@given(packed_batches(TINY, token_ids=True), st.integers(0, 64))
@settings(max_examples=15)
def test_any_ring_width_holding_the_live_pages_gives_the_same_upstream_tensors(batch, extra):
    depths = table_depths(TINY)
    tensors = to_upstream(batch, depths=depths)
    need = {pl.name: max(1, int((batch.tables[pl.name] >= 0).sum(axis=1).max())) for pl in TINY.layout if pl.is_ring}
    widths = {p: min(w + extra, TINY.layout.pools[p].table_width) for p, w in need.items()}
    narrow = back(tensors, batch, depths=depths, ring_widths=widths)
    assert {p: narrow.tables[p].shape[1] for p in widths} == widths
    again = to_upstream(narrow, depths=depths)
    assert all(np.array_equal(again[k], tensors[k]) for k in tensors)


def test_extra_tensors_are_ignored():
    batch = build(TINY_1M, RAGGED2)
    tensors = to_upstream(batch) | {"kv_cache": np.zeros((2, 3)), "my_rank": 0}
    assert back(tensors, batch) == batch


# ---------------------------------------------------------------------------------------------- rejections
@pytest.fixture(scope="module")
def ragged2():
    batch = build(TINY_1M, RAGGED2)
    return batch, to_upstream(batch)


def test_missing_tensor(ragged2):
    batch, tensors = ragged2
    err = codes_of(lambda: back({k: v for k, v in tensors.items() if k != "input_ids"}, batch))
    assert err.codes == {"array.missing"} and err.issues[0].field == "input_ids"


@pytest.mark.parametrize("name, change", [
    ("ori_block_table", lambda a: a.astype(np.int64)),            # dtype
    ("ori_slot_mapping_full", lambda a: a.astype(np.int32)),
    ("query_start_loc", lambda a: a[0]),                           # no rank axis
    ("position_ids_full", lambda a: np.concatenate([a, a])),       # 4 ranks of a TP-2 group
])
def test_signature_mismatch_is_upstream_shape(ragged2, name, change):
    batch, tensors = ragged2
    err = codes_of(lambda: back(tensors | {name: change(np.array(tensors[name]))}, batch))
    assert err.codes == {"upstream.shape"} and err.issues[0].field == name


def test_shallow_table_is_upstream_depth(ragged2):
    batch, tensors = ragged2
    shallow = np.array(tensors["csa_cmp_block_table"])[:, :, :8191]
    err = codes_of(lambda: back(tensors | {"csa_cmp_block_table": shallow}, batch))
    assert err.codes == {"upstream.depth"} and err.issues[0].expected == 8192


def test_table_request_count(ragged2):
    batch, tensors = ragged2
    one = np.array(tensors["idx_block_table"])[:, :1]
    err = codes_of(lambda: back(tensors | {"idx_block_table": one}, batch))
    assert err.codes == {"tables.request_count"} and err.issues[0].field == "idx_block_table"


def test_ranks_must_agree_and_issues_name_upstream_tensors(ragged2):
    batch, tensors = ragged2
    t = writable(tensors)
    t["hca_compress_state_block_table"][1, 0, 0] += 1
    t["position_ids_local"][1, 0] += 1
    err = codes_of(lambda: back(t, batch))
    assert err.codes == {"rank.replicated_mismatch", "rank.local_mismatch"}
    assert {i.field for i in err.issues} == {"hca_compress_state_block_table", "position_ids_local"}


def test_logit_rows_come_from_the_group_leader(ragged2):
    batch, tensors = ragged2
    t = writable(tensors)
    t["logit_row_indices"][1] = t["logit_row_indices"][0]          # replicated is accepted too
    assert back(t, batch) == batch
    t["logit_row_indices"][1, 0] = 5
    err = codes_of(lambda: back(t, batch))
    assert err.codes == {"rank.replicated_mismatch"} and err.issues[0].field == "logit_row_indices"


def test_mapped_page_past_the_span(ragged2):
    batch, tensors = ragged2
    t = writable(tensors)
    t["ori_block_table"][:, 1, 2] = 9                             # request 1's last live ori page is 1
    t["csa_compress_state_block_table"][:, 0, 4000] = 9
    err = codes_of(lambda: back(t, batch))
    assert err.codes == {"upstream.past_span"}
    assert {(i.field, i.request, i.index) for i in err.issues} == {("ori_block_table", 1, 2),
                                                                  ("csa_compress_state_block_table", 0, 4000)}


def test_pages_below_the_live_range_are_ignored(ragged2):
    batch, tensors = ragged2
    t = writable(tensors)
    t["ori_block_table"][:, 0, :3] = 77                           # request 0's window starts on page 3
    assert back(t, batch) == batch


def test_live_page_errors_come_from_the_validator_under_upstream_names(ragged2):
    batch, tensors = ragged2
    t = writable(tensors)
    t["ori_block_table"][:, 0, 4] = -1                            # unmapped, while position 128 writes there
    t["csa_state_slot_mapping_full"][:, 4] += 1
    err = codes_of(lambda: back(t, batch))
    assert {"coverage.unmapped", "slots.mismatch"} <= err.codes
    assert ("coverage.unmapped", "ori_block_table") in {(i.code, i.field) for i in err.issues}
    assert ("slots.mismatch", "csa_state_slot_mapping_full") in {(i.code, i.field) for i in err.issues}


def test_bad_offsets_and_positions_reach_the_validator(ragged2):
    batch, tensors = ragged2
    t = writable(tensors)
    t["position_ids_full"][:, 5] += 3                              # request 1, on rank 1's local row 1
    t["position_ids_local"][1, 1] += 3
    err = codes_of(lambda: back(t, batch))
    assert "positions.not_contiguous" in err.codes
    assert {i.field for i in err.issues if i.code == "positions.not_contiguous"} == {"position_ids_full"}
    t = writable(tensors)
    t["query_start_loc"][:] = [0, 5, 3]
    assert "qsl.non_monotonic" in codes_of(lambda: back(t, batch)).codes


def test_padding_input_ids_must_be_zero(ragged2):
    batch, tensors = ragged2
    t = writable(tensors)
    t["input_ids"][1, 3] = 5
    err = codes_of(lambda: back(t, batch))
    assert err.codes == {"padding.token_id"} and err.issues[0].field == "input_ids" and err.issues[0].index == 7


def test_masked_array_is_refused(ragged2):
    batch, tensors = ragged2
    masked = np.ma.masked_array(np.array(tensors["position_ids_full"]))
    assert codes_of(lambda: back(tensors | {"position_ids_full": masked}, batch)).codes == {"array.dtype"}


def test_to_upstream_refusals():
    batch = build(TINY_1M, RAGGED2)
    assert codes_of(lambda: to_upstream(attrs.evolve(batch, token_ids=None))).codes == {"array.missing"}
    assert codes_of(lambda: to_upstream(batch, max_logit_rows=1)).codes == {"upstream.shape"}
    small = dict(UPSTREAM_TABLE_DEPTHS, ori=100)
    assert codes_of(lambda: to_upstream(batch, depths=small)).codes == {"upstream.depth"}


# ---------------------------------------------------------------------------------------------- state rings
def _with_state_ring(tensors, batch, ring_blocks, block_of):
    """``tensors`` with the csa_state table of every live page replaced by ``block_of(page, request)``, its slot
    mapping recomputed, the way upstream's fixtures map their state rings."""
    t = writable(tensors)
    table = np.full(t["csa_compress_state_block_table"].shape[1:], -1, np.int32)
    live = np.argwhere(t["csa_compress_state_block_table"][0] >= 0)
    table[live[:, 0], live[:, 1]] = block_of(live[:, 1], live[:, 0])
    t["csa_compress_state_block_table"][:] = table
    pos, req = batch.positions[: batch.num_tokens], batch.row_request[: batch.num_tokens]
    t["csa_state_slot_mapping_full"][:, : batch.num_tokens] = table[req, pos // 2] * 2 + pos % 2
    return t, attrs.evolve(batch.pool_blocks, csa_state=max(ring_blocks, batch.pool_blocks.csa_state))


def _shared_ring(page, request):     # utils.block_table(batch=2, physical_blocks=260): 2 request slots share 260
    return ((page % 260) * 2 + request) % 260


@pytest.mark.parametrize("new, rejected", [(251, False), (252, True)])
def test_shared_canonical_ring_holds_251_tokens_after_an_odd_start(new, rejected):
    # request 0 starts at 9: live state range [1, 9 + new) spans 130 pages for new = 251, 131 for 252
    batch = build(TINY_1M, [[(0, 0, 9), (1, 0, 5)], [(0, 9, new), (1, 5, 3)]])
    t, blocks = _with_state_ring(to_upstream(batch), batch, 260, _shared_ring)
    convert = lambda: from_upstream(t, TINY_1M, batch.policy, blocks, request_ids=batch.request_ids)  # noqa: E731
    if not rejected:
        assert isinstance(convert(), PackedBatch)
        return
    err = codes_of(convert)
    assert err.codes == {"upstream.state_ring_overwrite"}
    issue = err.issues[0]
    assert (issue.field, issue.request, issue.index) == ("csa_compress_state_block_table", 0, 130)
    assert "repeats every 130 pages, fewer than the 131 pages" in issue.message
    assert "pieces of at most 251 tokens" in issue.fix and "at least 131 blocks" in issue.fix


def test_a_private_canonical_ring_holds_a_longer_chunk():
    # the single-request fixtures scramble (page * 17 + 3) % 260: every 260 pages (520 rows) repeat
    batch = build(TINY_1M, [[(0, 0, 500)]], tp=1)
    t, blocks = _with_state_ring(to_upstream(batch), batch, 260, lambda page, _: (page * 17 + 3) % 260)
    assert isinstance(from_upstream(t, TINY_1M, batch.policy, blocks, request_ids=batch.request_ids), PackedBatch)
    long = build(TINY_1M, [[(0, 0, 600)]], tp=1)
    t, blocks = _with_state_ring(to_upstream(long), long, 260, lambda page, _: (page * 17 + 3) % 260)
    err = codes_of(lambda: from_upstream(t, TINY_1M, long.policy, blocks, request_ids=long.request_ids))
    assert err.codes == {"upstream.state_ring_overwrite"} and "at most 511 tokens" in err.issues[0].fix
