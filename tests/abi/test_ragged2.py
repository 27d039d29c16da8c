"""The upstream two-request case, named: TP 2, 3 tokens after 126 cached and 4 after 30."""

import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks, validate
from dspark_abi.presets import FLASH, TINY


@pytest.fixture(params=[TINY, FLASH], ids=lambda c: c.name)
def ragged2(request):
    config = request.param
    builder = BatchBuilder(config, PaddingPolicy(tp_size=2), BlockAllocator(config, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=126, num_new=3)
    builder.add(1, num_cached=30, num_new=4)
    return builder.build()


def test_geometry(ragged2):
    assert ragged2.query_start_loc.tolist() == [0, 3, 7]
    assert (ragged2.num_tokens, ragged2.padded_rows, ragged2.local_rows) == (7, 8, 4)
    assert ragged2.positions[:7].tolist() == [126, 127, 128, 30, 31, 32, 33]


def test_rank_local_request_ids(ragged2):
    assert ragged2.rank(0).local_request_ids.tolist() == [0, 0, 0, 1]
    assert ragged2.rank(1).local_request_ids.tolist() == [1, 1, 1, -1]
    assert ragged2.rank(1).positions.tolist() == [31, 32, 33, 0]


def test_boundaries_and_padding(ragged2):
    s = ragged2.slots
    # position 127 is a ratio-4 and a ratio-128 boundary; 31 is a ratio-4 boundary; padding never writes
    assert np.flatnonzero(s.csa_cmp >= 0).tolist() == [1, 4]
    assert np.flatnonzero(s.idx >= 0).tolist() == [1, 4]
    assert np.flatnonzero(s.hca_cmp >= 0).tolist() == [1]
    for _, mapping in s.items():
        assert mapping[7] == -1
    assert (s.ori[:7] >= 0).all() and (s.hca_state[:7] >= 0).all()


def test_slots_follow_tables(ragged2):
    t, s = ragged2.tables, ragged2.slots

    def ring(row, page):  # ori and the state pools hold logical page i in column i % width
        return row[page % row.size]

    # request 0, position 128: ori page 4 offset 0; csa entry 31 at position 127: page 0 offset 31
    assert s.ori[2] == ring(t.ori[0], 128 // 32) * 32 + 0
    assert s.csa_cmp[1] == t.csa_cmp[0, 31 // 32] * 32 + 31
    assert s.hca_cmp[1] == t.hca_cmp[0, 0] * 32 + 0
    assert s.csa_state[5] == ring(t.csa_state[1], 32 // 2) * 2 + 0
    assert s.hca_state[6] == ring(t.hca_state[1], 33 // 8) * 8 + 1
    assert validate(ragged2).ok


def test_history_pages_are_mapped(ragged2):
    # request 0 reads entries [0, 32) of csa_cmp and window positions [126-W+1, 129)
    w = ragged2.config.sliding_window
    assert (ragged2.tables.csa_cmp[0, :1] >= 0).all()
    ori, hca_state = ragged2.tables.ori[0], ragged2.tables.hca_state[0]
    pages = np.arange(max(0, 126 - w + 1) // 32, 129 // 32 + 1)
    assert ori.size >= pages.size and (ori[pages % ori.size] >= 0).all()      # ring: page i in column i % width
    # state history [start - state_len, end)
    pages = np.arange(max(0, 126 - 128) // 8, 129 // 8 + 1)
    assert hca_state.size >= pages.size and (hca_state[pages % hca_state.size] >= 0).all()
