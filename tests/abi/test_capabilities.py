"""dspark_abi.capabilities: what each kernel family can take, checked once, with the first failing value."""

import attrs
import pytest

from dspark_abi import CODES, PaddingPolicy, PoolBlocks
from dspark_abi.capabilities import (
    FP32_EXACT_LIMIT,
    canonical_pool_blocks,
    check_capabilities,
)
from dspark_abi.presets import TINY
from dspark_abi.upstream import UPSTREAM_TABLE_DEPTHS

TINY_1M = TINY.model_copy(update={"max_position_embeddings": 1048576, "name": "tiny-1m"})
POLICY = PaddingPolicy(tp_size=2)
NEW_CODES = ("capability.pool_size", "capability.index_overflow", "capability.table_depth", "capability.token_cap")


def check(config=TINY, policy=POLICY, blocks=64, **kw):
    pools = PoolBlocks.uniform(blocks) if isinstance(blocks, int) else blocks
    return check_capabilities(config, policy, pools, **kw)


def test_codes_are_registered_with_meaning_and_fix():
    for code in NEW_CODES:
        meaning, fix = CODES[code]
        assert meaning and fix


def test_reference_takes_any_valid_geometry():
    assert check(TINY_1M, PaddingPolicy(tp_size=3, token_cap=100_000), 60_000_000, kernel="reference").ok


def test_unknown_kernel_and_bad_pools_are_reported_not_raised():
    assert check(kernel="cuda").codes == {"config.invalid"}
    assert check_capabilities(TINY, POLICY, {"ori": 4}, kernel="pypto").codes == {"pools.blocks"}


# ---------------------------------------------------------------------------------------------- int32 bytes
@pytest.mark.parametrize("kernel", ["pypto", "upstream"])
def test_int32_byte_offsets_name_the_first_overflowing_block(kernel):
    # TINY's ori row is 128 bf16 = 256 bytes, a block 32 rows = 8192 bytes: block 262144 starts at byte 2**31
    ok = attrs.evolve(PoolBlocks.uniform(1024), ori=262144)
    assert "capability.index_overflow" not in check(blocks=ok, kernel=kernel).codes
    report = check(blocks=attrs.evolve(ok, ori=262145), kernel=kernel)
    issue = next(i for i in report.issues if i.code == "capability.index_overflow")
    assert (issue.field, issue.index, issue.actual) == ("pool_blocks.ori", 262144, 262145)


def test_byte_offsets_follow_each_pools_rows():
    # csa_state rows are 4 * 128 fp32 = 2048 bytes in pages of 2: 4096-byte blocks, 2**31 at block 524288
    report = check(blocks=attrs.evolve(PoolBlocks.uniform(1024), csa_state=524289), kernel="upstream")
    assert [(i.field, i.index) for i in report.issues if i.code == "capability.index_overflow"] == [
        ("pool_blocks.csa_state", 524288)]


# ---------------------------------------------------------------------------------------------- pypto fp32
def test_pypto_pool_rows_in_fp32():
    # pages of 32 rows: block 2**24 / 32 = 524288 holds row 2**24. With 64-byte idx rows the int32 byte limit is
    # twice as far (block 1048576), so the fp32 row limit fires alone; the upstream kernels do not have it
    small_rows = TINY.model_validate(TINY.model_dump() | {"index_head_dim": 64})
    limit = FP32_EXACT_LIMIT // 32
    ok = attrs.evolve(PoolBlocks.uniform(64), idx=limit)
    assert check(small_rows, blocks=ok, kernel="pypto", max_requests=1).ok
    over = attrs.evolve(ok, idx=limit + 1)
    report = check(small_rows, blocks=over, kernel="pypto", max_requests=1)
    assert [(i.code, i.field, i.index) for i in report.issues] == [("capability.index_overflow", "pool_blocks.idx",
                                                                    limit)]
    assert "capability.index_overflow" not in check(small_rows, blocks=over, kernel="upstream").codes


def test_pypto_table_entries_in_fp32():
    # at 1M positions the compressed tables are 8192 wide (2048 requests fit 2**24 entries), the csa state rings
    # 4101 wide (4091 requests fit)
    width = TINY_1M.layout.pools["csa_state"].ring_width
    assert width == 4101 and FP32_EXACT_LIMIT // width == 4091

    def too_deep(requests):
        report = check(TINY_1M, kernel="pypto", max_requests=requests)
        return {i.field for i in report.issues if i.code == "capability.table_depth"}

    assert too_deep(64) == too_deep(2048) == set()
    assert too_deep(2049) == too_deep(4091) == {"csa_cmp_block_table", "idx_block_table"}
    assert too_deep(4092) == {"csa_cmp_block_table", "idx_block_table", "csa_state_block_table",
                              "csa_inner_state_block_table"}
    # by default every request of a full token cap counts: 8192 one-token requests
    assert too_deep(None) == too_deep(4092)


def test_pypto_positions_in_fp32():
    ok = TINY.model_copy(update={"max_position_embeddings": FP32_EXACT_LIMIT - 1})
    far = TINY.model_copy(update={"max_position_embeddings": FP32_EXACT_LIMIT})
    assert "max_position_embeddings" not in {i.field for i in check(ok, kernel="pypto", max_requests=1).issues}
    assert ("capability.index_overflow", "max_position_embeddings") in {
        (i.code, i.field) for i in check(far, kernel="pypto", max_requests=1).issues}


# ---------------------------------------------------------------------------------------------- upstream
def test_upstream_canonical_pools_scale_only_for_the_compressed_pools():
    assert canonical_pool_blocks(TINY_1M) == {"ori": 512, "csa_cmp": 8192, "hca_cmp": 256, "idx": 8192,
                                              "csa_state": 260, "csa_inner_state": 260, "hca_state": 256}
    flash_16k = TINY.model_copy(update={"max_position_embeddings": 16384})
    assert canonical_pool_blocks(flash_16k) == {"ori": 512, "csa_cmp": 128, "hca_cmp": 4, "idx": 128,
                                                "csa_state": 260, "csa_inner_state": 260, "hca_state": 256}


def test_upstream_pool_sizes_at_and_below_the_canonical_ones():
    canonical = PoolBlocks(**canonical_pool_blocks(TINY_1M))
    assert check(TINY_1M, blocks=canonical, kernel="upstream").ok
    report = check(TINY_1M, blocks=attrs.evolve(canonical, csa_state=259, hca_cmp=255), kernel="upstream")
    assert [(i.code, i.field, i.expected) for i in report.issues] == [
        ("capability.pool_size", "pool_blocks.hca_cmp", ">= 256"),
        ("capability.pool_size", "pool_blocks.csa_state", ">= 260")]


def test_upstream_frozen_depths_bound_the_context():
    canonical = PoolBlocks(**canonical_pool_blocks(TINY_1M))
    deeper = TINY.model_copy(update={"max_position_embeddings": 2 * 1048576})
    report = check(deeper, blocks=PoolBlocks(**canonical_pool_blocks(deeper)), kernel="upstream")
    assert {i.field for i in report.issues if i.code == "capability.table_depth"} == {
        f"{p}_block_table" for p in UPSTREAM_TABLE_DEPTHS}
    # a shorter context is staged at the frozen depths (-1 past the span): fine
    assert "capability.table_depth" not in check(TINY, blocks=canonical, kernel="upstream").codes


@pytest.mark.parametrize("tp, cap, ok", [(4, 8192, True), (4, 8193, False), (3, 8190, True), (3, 8191, False)])
def test_upstream_token_cap_against_the_group_window(tp, cap, ok):
    canonical = PoolBlocks(**canonical_pool_blocks(TINY_1M))
    report = check(TINY_1M, PaddingPolicy(tp_size=tp, token_cap=cap), canonical, kernel="upstream")
    assert report.ok is ok
    if not ok:
        assert report.codes == {"capability.token_cap"} and report.issues[0].actual > 8192
