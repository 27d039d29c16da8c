"""Regression tests of reported defects: each failed before its fix.

1. ndarray subclasses (masked arrays, matrices) slipped past or crashed validation.
2. a validated PackedBatch shared buffers the caller could make writeable again.
3. validation allocated O(pool blocks); huge pool sizes crashed it.
4. the builder silently truncated floats and crashed on odd argument types.
5. a bad PoolBlocks could be constructed and then crashed validate().
6. lowering wrapped unsigned query_start_loc differences; merge_rank_arrays silently dropped a positions copy.
7. an empty batch (N = 0) was told to "split the batch".
"""

import json
import struct
import tracemalloc

import numpy as np
import pytest

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, PoolBlocks, rules, validate
from dspark_abi.batch import RequestTables
from dspark_abi.errors import CODES
from dspark_abi.io.fixtures import encode, encode_raw, read
from dspark_abi.io.manifest import MANIFEST_KEY, PoolBlockCounts
from dspark_abi.layout import POOL_NAMES
from dspark_abi.lowering import lower_local_request_ids
from dspark_abi.presets import TINY
from dspark_abi.ranks import merge_rank_arrays, split_rank_arrays
from dspark_abi.testing import MUTATIONS, mutate
from dspark_abi.validation import validate_arrays

#: Largest block count of a pool with 32-row pages whose slots all fit int32.
MAX_KV_BLOCKS = (2**31 - 1) // 32


def _batch(tp=2, requests=((126, 3), (30, 4)), blocks=96, token_ids=False):
    """A built batch; ``requests`` are (num_cached, num_new) pairs, the order of ``BatchBuilder.add``."""
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp), BlockAllocator(TINY, PoolBlocks.uniform(blocks)))
    for rid, (cached, new) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new, token_ids=np.arange(new) + 1 if token_ids else None)
    return builder.build()


def _plain(batch):
    """Writeable private copies of a batch's flat arrays."""
    return {k: np.array(v) for k, v in batch.to_arrays().items()}


def _builder(**policy):
    return BatchBuilder(TINY, PaddingPolicy(**policy), BlockAllocator(TINY, PoolBlocks.uniform(64)))


# ---------------------------------------------------------------------------------------------- 1. subclasses
def test_masked_slot_cannot_hide_a_duplicate_write():
    batch = _batch()
    arrays = _plain(batch)
    slots = arrays["ori_slot_mapping"].copy()
    slots[3] = slots[0]  # request 1 would overwrite request 0's cached KV row ...
    mask = np.zeros(slots.shape, bool)
    mask[3] = True       # ... and the mask hides it from every comparison
    arrays["ori_slot_mapping"] = np.ma.MaskedArray(slots, mask=mask)
    report = validate(arrays, TINY, batch.policy, batch.pool_blocks)
    assert not report.ok
    issue = next(i for i in report.issues if i.field == "ori_slot_mapping")
    assert issue.code == "array.dtype"
    assert "MaskedArray" in str(issue.actual)
    with pytest.raises(ABIError) as err:
        PackedBatch.from_arrays(arrays, TINY, batch.policy, batch.pool_blocks)
    assert "array.dtype" in err.value.codes


def test_masked_position_is_rejected():
    batch = _batch()
    arrays = _plain(batch)
    arrays["positions"] = np.ma.masked_equal(arrays["positions"], 127)
    report = validate(arrays, TINY, batch.policy, batch.pool_blocks)
    assert [(i.code, i.field) for i in report.issues] == [("array.dtype", "positions")]


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix is what users still pass
def test_matrix_table_is_a_coded_issue_not_an_index_error():
    batch = _batch()
    arrays = dict(_plain(batch), ori_block_table=np.matrix(batch.tables.ori))
    report = validate(arrays, TINY, batch.policy, batch.pool_blocks)
    assert [(i.code, i.field) for i in report.issues] == [("array.dtype", "ori_block_table")]
    assert "matrix" in str(report.issues[0].actual)


def test_masked_hidden_rows_are_rejected():
    batch = _batch()
    hidden = np.ma.MaskedArray(np.zeros((batch.padded_rows, 4), np.float32))
    report = validate(batch.to_arrays(), TINY, batch.policy, batch.pool_blocks, hidden=hidden)
    assert [(i.code, i.field) for i in report.issues] == [("array.dtype", "hidden")]


def test_direct_construction_rejects_a_masked_array():
    batch = _batch()
    masked = np.ma.MaskedArray(batch.positions, mask=np.zeros(batch.positions.shape, bool))
    with pytest.raises(ABIError) as err:
        PackedBatch(config=TINY, policy=batch.policy, pool_blocks=batch.pool_blocks,
                    query_start_loc=batch.query_start_loc, positions=masked, tables=batch.tables, slots=batch.slots)
    assert err.value.codes == {"array.dtype"}


def test_per_rank_form_rejects_a_masked_array():
    batch = _batch()
    per = split_rank_arrays(batch.to_arrays(), batch.policy)
    per["ori_slot_mapping"] = np.ma.MaskedArray(per["ori_slot_mapping"])
    with pytest.raises(ABIError) as err:
        merge_rank_arrays(per, batch.policy)
    assert err.value.codes == {"array.dtype"}


# ---------------------------------------------------------------------------------------------- 2. immutability
def _assert_frozen_for_good(array):
    """Neither the array nor any ndarray it is a view of can be made writeable again."""
    chain = [array]
    while isinstance(chain[-1].base, np.ndarray):
        chain.append(chain[-1].base)
    for a in chain:
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a.flags.writeable = True


def test_caller_cannot_unfreeze_its_read_only_input():
    batch = _batch()
    arrays = _plain(batch)
    for a in arrays.values():
        a.flags.writeable = False  # read-only, owns its data, C-contiguous: used to be kept without a copy
    frozen = PackedBatch.from_arrays(arrays, TINY, batch.policy, batch.pool_blocks)
    arrays["ori_slot_mapping"].flags.writeable = True
    arrays["ori_slot_mapping"][3] = arrays["ori_slot_mapping"][0]
    arrays["ori_block_table"].flags.writeable = True
    arrays["ori_block_table"][:] = 7
    assert frozen.slots.ori.tolist() == batch.slots.ori.tolist()
    assert frozen.tables.ori.tolist() == batch.tables.ori.tolist()
    assert validate(frozen).ok


@pytest.mark.parametrize("source", ["builder", "from_arrays"])
def test_to_arrays_cannot_be_made_writeable(source):
    batch = _batch(token_ids=True)
    if source == "from_arrays":
        batch = PackedBatch.from_arrays(_plain(batch), TINY, batch.policy, batch.pool_blocks)
    for name, array in batch.to_arrays().items():
        _assert_frozen_for_good(array)
        assert array.flags.c_contiguous, name
    for array in (batch.row_request, batch.request_starts, batch.rank(1).positions, batch.rank(1).slots.ori):
        _assert_frozen_for_good(array)


def test_tables_given_directly_are_copied_once_and_frozen():
    batch = _batch()
    mine = {p: np.array(batch.tables[p]) for p in POOL_NAMES}
    tables = RequestTables(**mine)
    mine["ori"][:] = 5
    assert tables.ori.tolist() == batch.tables.ori.tolist()
    _assert_frozen_for_good(tables.ori)


# ---------------------------------------------------------------------------------------------- 3. pool sizes
@pytest.mark.parametrize("ori", [10**9, 10**12, 2**62, 10**400, MAX_KV_BLOCKS + 1])
def test_huge_pool_is_a_coded_issue(ori):
    batch = _batch()
    report = validate(batch.to_arrays(), TINY, batch.policy, dict(batch.pool_blocks.as_dict(), ori=ori))
    assert report.codes == {"pools.blocks"}
    issue = report.issues[0]
    assert issue.field == "pool_blocks.ori"
    assert issue.actual == ori if ori < 2**64 else issue.actual.endswith("(401 digits)")
    assert str(MAX_KV_BLOCKS) in str(issue.expected) and str(MAX_KV_BLOCKS) in issue.hint
    assert len(str(issue)) < 400


def test_validation_memory_does_not_grow_with_the_pool():
    batch = _batch()
    blocks = dict.fromkeys(POOL_NAMES, MAX_KV_BLOCKS)  # the largest legal pools (2**26 blocks each)
    arrays = batch.to_arrays()
    tracemalloc.start()
    try:
        report = validate(arrays, TINY, batch.policy, blocks)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.ok, str(report)
    assert peak < 8 * 2**20, peak  # a few arrays of O(P + live pages); was 2 x 256 MiB per pool


def test_shared_block_bookkeeping_without_dense_owner_arrays():
    """Isolation still works on the sparse path (pools far larger than the pages the call uses)."""
    batch = _batch()
    arrays = _plain(batch)
    width = arrays["ori_block_table"].shape[1]   # a ring table: page i in column i % width
    shared = arrays["ori_block_table"][0, 3 % width]  # request 0's live page 3 (positions 96..127)
    arrays["ori_block_table"][1, 0] = shared  # request 1 (position 30, page 0) now writes into it
    arrays["ori_slot_mapping"][3] = shared * 32 + 30
    big = dict.fromkeys(POOL_NAMES, 10**6)
    small = batch.pool_blocks.as_dict()
    codes_big = validate(arrays, TINY, batch.policy, big).codes
    assert codes_big == validate(arrays, TINY, batch.policy, small).codes
    assert "isolation.foreign_write" in codes_big


def test_manifest_bounds_pool_blocks():
    ok = dict.fromkeys(POOL_NAMES, 1)
    assert PoolBlockCounts(**dict(ok, ori=MAX_KV_BLOCKS)).ori == MAX_KV_BLOCKS
    for bad in (MAX_KV_BLOCKS + 1, 10**400):
        with pytest.raises(ValueError):
            PoolBlockCounts(**dict(ok, ori=bad))
    with pytest.raises(ValueError):
        PoolBlockCounts(**dict(ok, csa_state=(2**31 - 1) // 2 + 1))


def test_fixture_with_a_400_digit_pool_is_a_manifest_issue(tmp_path):
    batch = _batch()
    arrays = batch.to_arrays()
    good = encode(arrays, config=batch.config, policy=batch.policy, pool_blocks=batch.pool_blocks.as_dict())
    (hlen,) = struct.unpack("<Q", good[:8])
    doc = json.loads(json.loads(good[8:8 + hlen])["__metadata__"][MANIFEST_KEY])
    doc["pool_blocks"]["ori"] = 10**400
    path = tmp_path / "huge.safetensors"
    path.write_bytes(encode_raw(arrays, {MANIFEST_KEY: json.dumps(doc, sort_keys=True, separators=(",", ":"))}))
    with pytest.raises(ABIError) as err:
        read(path)
    assert err.value.codes == {"fixture.manifest"}


# ---------------------------------------------------------------------------------------------- 4. builder input
def _builder_issue(add=None, build=None):
    builder = _builder()
    builder.add(**dict({"request_id": 0, "num_cached": 0, "num_new": 2}, **(add or {})))
    with pytest.raises(ABIError) as err:
        builder.build(**(build or {}))
    assert err.value.codes == {"builder.request"}, str(err.value)
    (issue,) = err.value.issues
    return issue


@pytest.mark.parametrize(("add", "build", "arg", "value"), [
    ({"num_new": 2.9}, None, "num_new", "2.9"),
    ({"num_cached": 3.7}, None, "num_cached", "3.7"),
    ({"num_new": "3"}, None, "num_new", "'3'"),
    ({"num_new": True}, None, "num_new", "True"),
    ({"num_cached": False}, None, "num_cached", "False"),
    ({"num_new": np.float64(2.0)}, None, "num_new", "2.0"),
    ({"num_new": None}, None, "num_new", "None"),
    ({"request_id": 2**70}, None, "request_id", str(2**70)),
    ({"request_id": True}, None, "request_id", "True"),
    ({"request_id": 1.0}, None, "request_id", "1.0"),
    ({"request_id": np.uint64(2**64 - 1)}, None, "request_id", str(2**64 - 1)),
    ({"token_ids": [1.5, 2.5]}, None, "token_ids", "1.5"),
    ({"token_ids": [True, False]}, None, "token_ids", "True"),
    ({"token_ids": [1, True]}, None, "token_ids", "True"),
    ({"token_ids": np.array([1.0, 2.0])}, None, "token_ids", "float64"),
    ({"token_ids": [2**64, 1]}, None, "token_ids", str(2**64)),
    ({"token_ids": [[1], [2, 3]]}, None, "token_ids", "[[1], [2, 3]]"),
    ({"token_ids": np.ma.MaskedArray([1, 2])}, None, "token_ids", "MaskedArray"),
    ({"token_ids": "ab"}, None, "token_ids", "'ab'"),
    (None, {"logit_rows": [0.9]}, "logit_rows", "0.9"),
    (None, {"logit_rows": [2**32 + 1]}, "logit_rows", str(2**32 + 1)),
    (None, {"logit_rows": "first"}, "logit_rows", "'first'"),
    (None, {"logit_rows": [[0]]}, "logit_rows", "[[0]]"),
])
def test_builder_rejects_inexact_arguments(add, build, arg, value):
    issue = _builder_issue(add, build)
    assert issue.field == arg
    assert arg in issue.message and value in issue.message, issue.message
    assert issue.hint and issue.hint != "see the message for the offending value"
    assert arg in issue.hint or "integer" in issue.hint


def test_builder_errors_leave_the_queue_and_allocator_untouched():
    builder = _builder()
    builder.add(0, num_cached=0, num_new=2.9)
    with pytest.raises(ABIError):
        builder.build()
    assert not builder.allocator.knows(0)
    assert len(builder._pending) == 1


@pytest.mark.parametrize("kind", [int, np.int32, np.int64, np.uint16])
def test_builder_accepts_python_and_numpy_integers(kind):
    builder = _builder()
    builder.add(kind(7), num_cached=kind(3), num_new=kind(2), token_ids=np.array([4, 5], dtype=np.int16))
    batch = builder.build(logit_rows=np.array([1], np.int64))
    assert batch.positions[:2].tolist() == [3, 4]
    assert batch.token_ids[:2].tolist() == [4, 5] and batch.logit_rows.tolist() == [1]
    assert batch.request_ids.tolist() == [7]


def test_builder_per_issue_fixes():
    long = _builder_issue({"num_cached": TINY.max_position_embeddings})
    assert str(TINY.max_position_embeddings) in long.hint
    wrong_len = _builder_issue({"token_ids": [1, 2, 3]})
    assert "token_ids" in wrong_len.hint and "2" in wrong_len.hint
    empty = BatchBuilder(TINY, PaddingPolicy(allow_empty_requests=False), BlockAllocator(TINY, PoolBlocks.uniform(64)))
    empty.add(0, num_cached=0, num_new=2)
    empty.add(1, num_cached=0, num_new=0)
    with pytest.raises(ABIError) as err:
        empty.build()
    assert "allow_empty_requests" in err.value.issues[0].hint


# ---------------------------------------------------------------------------------------------- 5. PoolBlocks
@pytest.mark.parametrize("value", [-1, 0, 2.5, True, "8", None, MAX_KV_BLOCKS + 1, 10**400])
def test_bad_pool_blocks_cannot_be_constructed(value):
    with pytest.raises(ABIError) as err:
        PoolBlocks(**dict(PoolBlocks.uniform(8).as_dict(), ori=value))
    assert err.value.codes == {"pools.blocks"}
    assert err.value.issues[0].field == "pool_blocks.ori"
    with pytest.raises(ABIError) as err:
        PoolBlocks.uniform(value)
    assert err.value.codes == {"pools.blocks"}


@pytest.mark.parametrize("value", [-1, 2.5, True, "8", None, np.float32(3)])
def test_validate_reports_bad_pool_mapping_values(value):
    batch = _batch()
    report = validate(batch.to_arrays(), TINY, batch.policy, dict(batch.pool_blocks.as_dict(), csa_state=value))
    assert report.codes == {"pools.blocks"}
    assert report.issues[0].field == "pool_blocks.csa_state"


@pytest.mark.parametrize("blocks", [None, 96, [96] * 7, "ori"])
def test_validate_reports_a_pool_argument_that_is_no_mapping(blocks):
    batch = _batch()
    # validate_arrays, not validate(): validate() itself refuses None as a missing argument
    assert validate_arrays(batch.to_arrays(), TINY, batch.policy, blocks).codes == {"pools.blocks"}


def test_pool_blocks_keep_numpy_integers_as_python_ints():
    blocks = PoolBlocks.uniform(np.int64(8))
    assert type(blocks.ori) is int and blocks == PoolBlocks.uniform(8)
    assert PoolBlocks.from_mapping(dict.fromkeys(POOL_NAMES, np.uint32(9))) == PoolBlocks.uniform(9)


# ---------------------------------------------------------------------------------------------- 6. lowering, ranks
@pytest.mark.parametrize("dtype", [np.uint32, np.uint64, np.uint16, np.int64])
def test_lowering_rejects_unsigned_decreasing_offsets(dtype):
    with pytest.raises(ABIError) as err:
        lower_local_request_ids(np.array([0, 9, 2, 7], dtype), 0, 8)
    assert err.value.codes == {"qsl.non_monotonic"}
    assert (err.value.issues[0].index, err.value.issues[0].actual) == (2, 2)


def test_lowering_accepts_unsigned_offsets():
    got = lower_local_request_ids(np.array([0, 3, 7], np.uint32), 4, 4)
    assert got.tolist() == [1, 1, 1, -1]


def test_lowering_rejects_offsets_beyond_int64():
    with pytest.raises(ABIError) as err:
        lower_local_request_ids(np.array([0, 2**63 + 5], np.uint64), 0, 4)
    assert err.value.codes == {"qsl.shape"}


def test_merge_rejects_disagreeing_positions_and_positions_full():
    batch = _batch()
    per = split_rank_arrays(batch.to_arrays(), batch.policy)
    del per["positions_local"]
    per["positions"] = per["positions_full"].copy()
    per["positions"][:, 2] += 1
    with pytest.raises(ABIError) as err:
        merge_rank_arrays(per, batch.policy)
    assert err.value.codes == {"rank.replicated_mismatch"}
    issue = err.value.issues[0]
    assert issue.field == "positions" and issue.index == 2
    # the same copy under both names is harmless
    per["positions"] = per["positions_full"].copy()
    assert merge_rank_arrays(per, batch.policy)["positions"].tolist() == batch.positions.tolist()


# ---------------------------------------------------------------------------------------------- 7. N = 0
def test_empty_batch_is_not_told_to_split():
    batch = _batch()
    arrays = dict(batch.to_arrays(), query_start_loc=np.array([0, 0, 0], np.int32))
    issue = next(i for i in validate(arrays, TINY, batch.policy, batch.pool_blocks).issues
                 if i.code == "qsl.token_count")
    assert "split" not in issue.hint and "add" in issue.hint
    builder = _builder()
    builder.add(0, num_cached=0, num_new=0)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert "split" not in err.value.issues[0].hint and "add" in err.value.issues[0].hint
    with pytest.raises(ABIError) as err:
        _builder().build()  # no request at all
    assert err.value.codes == {"qsl.token_count"} and "split" not in err.value.issues[0].hint


def test_oversized_batch_is_told_to_split():
    batch = _batch()
    small = batch.policy.model_copy(update={"token_cap": 4})
    issue = next(i for i in validate(batch.to_arrays(), TINY, small, batch.pool_blocks).issues
                 if i.code == "qsl.token_count")
    assert issue.hint == CODES["qsl.token_count"][1] and "split" in issue.hint
    builder = BatchBuilder(TINY, PaddingPolicy(token_cap=4), BlockAllocator(TINY, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=0, num_new=5)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert "split" in err.value.issues[0].hint


@pytest.mark.parametrize("code", sorted(MUTATIONS))
def test_sparse_owner_path_reports_what_the_dense_path_reports(code, monkeypatch):
    """Every single-rule mutation gets the same report when block ownership is kept sparse (huge pools)."""
    cases = [c for seed in range(3) for c in [mutate(_batch(tp=4, requests=((200, 5), (31, 2), (3, 7))), code, seed),
                                              mutate(_batch(), code, seed)] if c is not None]
    dense = [validate(c.arrays, c.config, c.policy, c.pool_blocks, hidden=c.hidden) for c in cases]
    monkeypatch.setattr(rules, "_dense", lambda n_blocks, n_pages: False)
    sparse = [validate(c.arrays, c.config, c.policy, c.pool_blocks, hidden=c.hidden) for c in cases]
    assert [r.issues for r in sparse] == [r.issues for r in dense]
    assert all(code in r.codes for r in sparse)
