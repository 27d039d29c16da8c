"""Fixed cases at every range bound of the ABI rules: the last legal value is accepted, the first illegal one is
reported under its code, naming the element at the bound.

An off-by-one (``>`` for ``>=``, a bound taken from the wrong size) moves a bound by one; randomised batches reach
a bound exactly only by chance. Bounds: positions ``[0, max_position_embeddings)`` (live and padding rows), token
ids ``[0, vocab_size)``, block ids ``-1`` or ``[0, blocks)``, slots ``-1`` or ``[0, blocks * page_size)``, logit rows
``-1`` or ``[0, N)``, ``N <= token_cap``, table widths ``[1, full table width]``. Each case goes through
:func:`dspark_abi.validate` and a serving loop's :class:`~dspark_abi.incremental.StepValidator`, whose reports
must be equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PackedBatch, PaddingPolicy, PoolBlocks, validate
from dspark_abi.errors import Issue, ValidationReport
from dspark_abi.incremental import StepValidator
from dspark_abi.layout import POOL_NAMES, PoolName
from dspark_abi.pools import SLOT_FIELDS, TABLE_FIELDS
from dspark_abi.presets import TINY

MAX_POS = TINY.max_position_embeddings
#: (num_cached, num_new) whose last token sits at the last legal position, MAX_POS - 1, beside a request at 0.
AT_END = ((MAX_POS - 3, 3), (0, 4))


#: Three requests whose tokens write every pool (position 383 ends an hca_cmp entry of 128 positions).
SPREAD = ((200, 9), (40, 7), (380, 12))


def _batch(requests: tuple[tuple[int, int], ...], *, tp: int = 1, pad_position: str = "zero",
           token_cap: int | None = None) -> PackedBatch:
    policy = PaddingPolicy(tp_size=tp, pad_position=pad_position,
                           **({} if token_cap is None else {"token_cap": token_cap}))
    builder = BatchBuilder(TINY, policy, BlockAllocator(TINY, PoolBlocks.uniform(256)))
    for rid, (cached, new) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new, token_ids=np.arange(new) + 1)
    return builder.build()


def _arrays(batch: PackedBatch) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in batch.to_arrays().items()}


def _report(arrays: dict[str, np.ndarray], config: ModelConfig, policy: PaddingPolicy,
            pool_blocks: PoolBlocks) -> ValidationReport:
    """validate()'s report, which a serving loop's StepValidator (its first step here) must give too."""
    report = validate(arrays, config, policy, pool_blocks)
    assert StepValidator(config, policy, pool_blocks).validate(arrays) == report
    return report


def _check(batch: PackedBatch, arrays: dict[str, np.ndarray], code: str | None, *, index: int | None = None,
           policy: PaddingPolicy | None = None, pool_blocks: PoolBlocks | None = None) -> Issue | None:
    """Validate; ``code`` None: nothing reported; else ``code`` reported once, for one element (``index``)."""
    report = _report(arrays, batch.config, policy or batch.policy, pool_blocks or batch.pool_blocks)
    if code is None:
        assert report.ok, report.issues
        return None
    hits = [issue for issue in report.issues if issue.code == code]
    assert hits, f"{code} not reported: {report.codes}"
    if index is not None:
        assert (hits[0].index, hits[0].count) == (index, 1), hits[0]
    return hits[0]


# -------------------------------------------------------------------------------------------------- positions
def test_the_last_legal_position_is_accepted():
    batch = _batch(AT_END)
    assert int(batch.positions[2]) == MAX_POS - 1  # the premise
    _check(batch, _arrays(batch), None)


def test_the_first_position_past_the_last_is_out_of_range():
    batch = _batch(AT_END)
    arrays = _arrays(batch)
    arrays["positions"][:3] += 1                         # MAX_POS - 2 .. MAX_POS: only the last is out of range
    issue = _check(batch, arrays, "positions.out_of_range", index=2)
    assert issue is not None and issue.actual == MAX_POS and issue.request == 0


def test_position_zero_is_accepted_and_minus_one_is_negative():
    batch = _batch(((0, 3), (5, 2)))
    _check(batch, _arrays(batch), None)
    arrays = _arrays(batch)
    arrays["positions"][:3] -= 1                         # -1, 0, 1: only the first is negative
    issue = _check(batch, arrays, "positions.negative", index=0)
    assert issue is not None and issue.actual == -1


def test_padding_positions_continue_up_to_the_last_legal_one():
    # tp 2, 4 + 3 live tokens: one padding row, whose continued position is the last live token's + 1
    at_end = _batch(((0, 4), (MAX_POS - 4, 3)), tp=2, pad_position="continue")
    assert at_end.padded_rows == at_end.num_tokens + 1 and int(at_end.positions[-1]) == MAX_POS - 1
    _check(at_end, _arrays(at_end), None)
    arrays = _arrays(at_end)
    arrays["positions"][-1] = MAX_POS                    # the continued position one past the last legal one
    issue = _check(at_end, arrays, "positions.out_of_range", index=at_end.num_tokens)
    assert issue is not None and issue.actual == MAX_POS


# -------------------------------------------------------------------------------------------------- token ids
@pytest.mark.parametrize(("value", "code"), [(0, None), (TINY.vocab_size - 1, None), (-1, "token_ids.range"),
                                             (TINY.vocab_size, "token_ids.range")])
def test_token_id_bounds(value: int, code: str | None):
    batch = _batch(((10, 3), (0, 4)))
    arrays = _arrays(batch)
    arrays["token_ids"][4] = value
    _check(batch, arrays, code, index=4)


# ------------------------------------------------------------------------------------------------- logit rows
@pytest.mark.parametrize(("row", "code"), [("-1", None), ("N-1", None), ("-2", "logits.range"),
                                           ("N", "logits.range")])
def test_logit_row_bounds(row: str, code: str | None):
    batch = _batch(((10, 3), (0, 4)))
    arrays = _arrays(batch)
    n = batch.num_tokens
    arrays["logit_rows"][0] = {"-1": -1, "N-1": n - 1, "-2": -2, "N": n}[row]
    _check(batch, arrays, code, index=0)


# ------------------------------------------------------------------------------------------------ token count
def test_token_count_up_to_the_cap():
    batch = _batch(((10, 3), (0, 4)), token_cap=7)       # N = 7 = token_cap: legal
    _check(batch, _arrays(batch), None)
    issue = _check(batch, _arrays(batch), "qsl.token_count", policy=batch.policy.model_copy(update={"token_cap": 6}))
    assert issue is not None and issue.actual == 7


# ------------------------------------------------------------------------------------ block ids, slots, widths
def _used_blocks(batch: PackedBatch, pool: PoolName) -> int:
    """Blocks a pool needs for this batch: one past the largest block id its table holds."""
    return int(batch.tables[pool].max()) + 1


@pytest.mark.parametrize("pool", POOL_NAMES)
def test_a_pool_exactly_as_large_as_its_largest_block_id_needs(pool: PoolName):
    """Blocks ``[0, n)``: a table holding block n - 1 is legal with n blocks, out of range with n - 1."""
    batch = _batch(SPREAD)
    n = _used_blocks(batch, pool)
    exact = batch.pool_blocks.as_dict() | {pool: n}
    _check(batch, _arrays(batch), None, pool_blocks=PoolBlocks(**exact))
    issue = _check(batch, _arrays(batch), "tables.block_range", pool_blocks=PoolBlocks(**(exact | {pool: n - 1})))
    assert issue is not None and issue.field == TABLE_FIELDS[pool] and issue.actual == n - 1


@pytest.mark.parametrize("pool", POOL_NAMES)
def test_block_id_minus_two_is_out_of_range(pool: PoolName):
    batch = _batch(SPREAD)
    arrays = _arrays(batch)
    table = arrays[TABLE_FIELDS[pool]]
    r, col = np.argwhere(table >= 0)[0]
    table[r, col] = -2
    issue = _check(batch, arrays, "tables.block_range")
    assert issue is not None and issue.actual == -2


@pytest.mark.parametrize("pool", POOL_NAMES)
def test_slot_bounds(pool: PoolName):
    """Slots ``-1`` or ``[0, blocks * page_size)``: the last row of the pool is in range (it may mismatch the
    table, another rule), one past it and -2 are not."""
    batch = _batch(SPREAD)
    rows = batch.pool_blocks.as_dict()[pool] * TINY.layout.pools[pool].page_size
    written = np.flatnonzero(np.asarray(batch.slots[pool][:batch.num_tokens]) >= 0)
    t = int(written[-1])
    for value, in_range in ((rows - 1, True), (rows, False), (-2, False)):
        arrays = _arrays(batch)
        arrays[SLOT_FIELDS[pool]][t] = value
        report = _report(arrays, batch.config, batch.policy, batch.pool_blocks)
        hits = [issue for issue in report.issues if issue.code == "slots.range"]
        if in_range:
            assert not hits and report.codes, (value, report.codes)  # reported as a mismatch, not out of range
        else:
            assert hits and (hits[0].index, hits[0].actual, hits[0].count) == (t, value, 1), (value, report.codes)


def test_table_width_up_to_the_full_width():
    """A compressed pool's table may have up to the layout's full width (extra columns unmapped), not one more."""
    batch = _batch(((200, 9), (40, 7)))
    pool: PoolName = "csa_cmp"
    full = TINY.layout.pools[pool].table_width
    for width, code in ((full, None), (full + 1, "tables.width")):
        arrays = _arrays(batch)
        table = arrays[TABLE_FIELDS[pool]]
        arrays[TABLE_FIELDS[pool]] = np.concatenate(
            [table, np.full((table.shape[0], width - table.shape[1]), -1, np.int32)], axis=1)
        issue = _check(batch, arrays, code)
        assert code is None or (issue is not None and issue.actual == full + 1)
