"""The pypto kernels form table and row indices in fp32 (exact below 2**24): launchers refuse geometries that
would round (``kernel.index_range``) before any kernel is built or run. No kernel runs in these tests."""

import types

import numpy as np
import pytest

from dspark_abi import ABIError
from dspark_abi.presets import TINY_1M
from dspark_kernels.model.plan import CompressorState, RopeRows
from dspark_kernels.pypto.index_guard import FP32_EXACT_LIMIT, index_range_issues, table_issues

WIDTH, PAGE = 8192, 32


def test_fp32_rounds_the_entry_of_request_2049_of_an_8192_wide_table():
    entry = 2048 * WIDTH + 1  # request index 2048 (the 2049th), page 1
    assert int(np.float32(entry)) != entry  # what the guard protects against


def test_guard_flags_request_2049_of_an_8192_wide_table():
    assert index_range_issues("ori_block_table", requests=2048, width=WIDTH, page=PAGE, max_block=10) == []
    issues = index_range_issues("ori_block_table", requests=2049, width=WIDTH, page=PAGE, max_block=10)
    assert [i.code for i in issues] == ["kernel.index_range"]
    assert issues[0].field == "ori_block_table" and issues[0].actual == 2049
    assert "2048" in issues[0].expected and "2**24" in issues[0].hint


def test_guard_flags_pool_rows_from_2_24():
    last_ok = FP32_EXACT_LIMIT // PAGE - 1  # its last row is 2**24 - 1
    assert index_range_issues("t", requests=1, width=8, page=PAGE, max_block=last_ok) == []
    issues = index_range_issues("t", requests=1, width=8, page=PAGE, max_block=last_ok + 1)
    assert [i.code for i in issues] == ["kernel.index_range"] and issues[0].actual == last_ok + 1
    assert str(last_ok + 1) in issues[0].expected


def test_guard_flags_positions_and_reports_every_overflow():
    assert index_range_issues("t", requests=1, width=8, page=PAGE, max_block=-1,
                              max_position=FP32_EXACT_LIMIT - 2) == []
    issues = index_range_issues("t", requests=4096, width=WIDTH, page=PAGE, max_block=2**20,
                                max_position=FP32_EXACT_LIMIT)
    assert len(issues) == 3 and {i.code for i in issues} == {"kernel.index_range"}


def test_ring_guard_bounds_the_quotient_product():
    """A ring column forms floor(page / width) * width <= page + width: it must stay <= 2**24."""
    width = 2**20
    last_page = FP32_EXACT_LIMIT - width  # page + width == 2**24: still exact
    ok = dict(requests=1, width=width, page=1, max_block=-1)
    assert index_range_issues("t", **ok, max_position=last_page - 1, ring=True) == []
    issues = index_range_issues("t", **ok, max_position=last_page + 1, ring=True)
    assert [i.code for i in issues] == ["kernel.index_range"] and issues[0].actual == last_page + 1 + width
    assert index_range_issues("t", **ok, max_position=last_page + 1, ring=False) == []  # column = page: no product


def test_table_issues_use_the_table_it_is_given():
    """The guard reads the launch's real width: a trimmed table of 2049 requests passes where a full one rounds."""
    positions = np.array([TINY_1M.max_position_embeddings - 1])
    full = np.full((2049, WIDTH), -1, np.int32)
    assert [i.code for i in table_issues("t", full, PAGE, positions, ring=False)] == ["kernel.index_range"]
    assert table_issues("t", full[:, :100], PAGE, positions, ring=False) == []
    for pl in TINY_1M.layout:  # tiny-1m's ring tables at the last position of a 1M context
        if pl.is_ring:
            ring_table = np.zeros((64, pl.ring_width), np.int32)
            assert table_issues(pl.name, ring_table, pl.page_size, positions, ring=True) == []


# ---- the launchers check before building or launching a kernel
HIGH_BLOCK = FP32_EXACT_LIMIT // PAGE  # block * 32 + offset >= 2**24


def _table(block=HIGH_BLOCK):
    table = np.full((2, 8), -1, np.int32)
    table[0, 0] = block
    return table


def _no_kernels(monkeypatch, module, *factories):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was built or launched")

    for name in (*factories, "launch"):
        monkeypatch.setattr(module, name, refuse)


def test_window_launcher_refuses_before_launch(monkeypatch):
    window = pytest.importorskip("dspark_kernels.pypto.window")
    _no_kernels(monkeypatch, window, "window_kernel")
    with pytest.raises(ABIError) as err:
        window.run_window(np.array([0, 1]), np.array([0, 0]), _table(), window=16, ring=True)
    assert err.value.codes == {"kernel.index_range"}
    assert err.value.issues[0].field == "ori_block_table"


def test_entry_rows_launcher_refuses_before_launch(monkeypatch):
    entry_rows = pytest.importorskip("dspark_kernels.pypto.entry_rows")
    _no_kernels(monkeypatch, entry_rows, "entry_rows_kernel")
    with pytest.raises(ABIError) as err:
        entry_rows.run_entry_rows(np.array([7, 8]), np.array([0, 1]), _table(), np.zeros((2, 8), np.int32),
                                  ring=False)
    assert err.value.codes == {"kernel.index_range"}
    wide = np.full((2049, WIDTH), -1, np.int32)  # request 2049 of an 8192-wide table
    with pytest.raises(ABIError) as err:
        entry_rows.run_entry_rows(np.array([7]), np.array([2048]), wide, None, ring=False, ratio=128, columns=8)
    assert err.value.codes == {"kernel.index_range"} and err.value.issues[0].actual == 2049


def test_compressor_refuses_before_writing_the_state_ring(monkeypatch):
    compressor = pytest.importorskip("dspark_kernels.pypto.compressor")
    _no_kernels(monkeypatch, compressor, "pool_kernel", "state_rows_kernel", "run_state_rows")
    with pytest.raises(ABIError) as err:
        compressor.run_pool(np.array([3]), np.array([0]), _table(), np.zeros((64, 16), np.float32),
                            np.zeros(4, np.float32), np.zeros((1, 2)), np.zeros((1, 2)), ratio=4, page=PAGE, eps=1e-6,
                            ring=True)
    assert err.value.codes == {"kernel.index_range"}
    ring = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    before = ring.copy()
    weights = types.SimpleNamespace(ratio=4, dim=4)
    with pytest.raises(ABIError) as err:
        state = CompressorState(pool=ring, slots=np.array([2, 3]), table=_table(), table_row=np.array([0, 0]),
                                page_size=PAGE)
        compressor.compress_into(np.zeros((2, 8), np.float32), np.array([2, 3]), np.array([0, 0]), state, weights,
                                 RopeRows(np.zeros((2, 2)), np.zeros((2, 2))), eps=1e-6)
    assert err.value.codes == {"kernel.index_range"}
    assert err.value.issues[0].field == "state_table"
    np.testing.assert_array_equal(ring, before)  # nothing was written
