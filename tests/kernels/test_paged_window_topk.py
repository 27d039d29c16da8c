"""Paged access (slots, tables, -1 never wraps), sliding-window rows and the indexer's top-k selection."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dspark_abi.layout import physical_rows
from dspark_kernels.reference.indexer import select_topk
from dspark_kernels.reference.paged import gather_rows, scatter_rows
from dspark_kernels.reference.window import window_rows


def test_physical_rows_hand_case():
    table = np.array([[3, -1, 0], [1, 2, -1]], np.int32)
    request = np.array([0, 1, -1])
    logical = np.array([[0, 33, 70, 100], [5, 40, 64, -1], [0, 1, 2, 3]])
    want = np.array([[96, -1, 6, -1], [37, 72, -1, -1], [-1, -1, -1, -1]])  # page 3 is beyond the table
    np.testing.assert_array_equal(physical_rows(table, request, logical, 32, ring=False), want)
    # a ring table of 3 columns: page 3 (logical 100) sits in column 0, page 2 in column 2
    ring = np.array([[96, -1, 6, 100], [37, 72, -1, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(physical_rows(table, request, logical, 32, ring=True), ring)


def test_scatter_and_gather_never_wrap():
    pool = np.arange(12, dtype=np.float32).reshape(6, 2)
    scatter_rows(pool, np.array([-1, 2, -1]), np.full((3, 2), -5.0, np.float32))
    np.testing.assert_array_equal(pool[5], [10, 11])  # the last row is untouched by -1
    np.testing.assert_array_equal(pool[2], [-5, -5])
    values, valid = gather_rows(pool, np.array([[5, -1]]))
    np.testing.assert_array_equal(values, [[[10, 11], [0, 0]]])
    np.testing.assert_array_equal(valid, [[True, False]])


def window_loop(p, r, table, w):
    out = [-1] * w
    if r < 0:
        return out
    v = min(w, p + 1)
    for k in range(v):
        a = p + 1 - v + k
        blk = table[r][a // 32]
        out[k] = -1 if blk < 0 else blk * 32 + a % 32
    return out


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(-1, 1)), min_size=1, max_size=12),
       st.sampled_from([1, 16, 128]))
def test_window_rows_against_loop(rows, w):
    rng = np.random.default_rng(len(rows))
    table = rng.integers(-1, 50, size=(2, 8)).astype(np.int32)
    pos = np.array([p for p, _ in rows])
    req = np.array([r for _, r in rows])
    got = window_rows(pos, req, table, w)
    want = np.array([window_loop(p, r, table, w) for p, r in rows])
    np.testing.assert_array_equal(got, want)


def test_topk_hand_case_with_ties():
    scores = np.array([[0.5, 2.0, 0.5, -np.inf, 2.0, 0.5],
                       [1.0, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf],
                       [-np.inf] * 6], np.float32)
    np.testing.assert_array_equal(select_topk(scores, 4), [[1, 4, 0, 2], [0, -1, -1, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(select_topk(scores[:, :3], 4)[0], [1, 0, 2, -1])


@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)),
                  elements=st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 1.0, 2.5])), st.integers(1, 12))
def test_topk_against_sorted_loop(scores, k):
    """Small integer-like scores force many ties: the order must be (score desc, index asc), -1 after."""
    got = select_topk(scores, k)
    for t in range(scores.shape[0]):
        ranked = sorted((-float(s), c) for c, s in enumerate(scores[t]) if np.isfinite(s))[:k]
        want = [c for _, c in ranked] + [-1] * (k - len(ranked))
        np.testing.assert_array_equal(got[t], want)
