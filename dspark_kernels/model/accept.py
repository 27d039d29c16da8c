"""Greedy acceptance of verify requests: the stage after the LM head of a verify step, shared by both backends.

A verify request of width ``w`` holds inputs ``[anchor, d_1 .. d_{w-1}]`` at consecutive positions; the target's
greedy ids at its rows are ``g_0 .. g_{w-1}`` (the backend's ``greedy`` head stage,
:mod:`dspark_kernels.model.backends`).
Draft ``d_{i+1}`` is what the target would have produced after row ``i`` exactly when ``d_{i+1} == g_i``. The
request accepts the longest agreeing prefix, ``m`` drafts, and commits ``1 + m`` rows (the anchor and the ``m``
drafts); it generates ``d_1 .. d_m`` and the bonus ``g_m``, the target's own choice after the last accepted row
(the next step's anchor). Greedy speculative decoding therefore yields exactly the tokens of plain greedy decoding.

Only greedy acceptance is implemented: temperature sampling (rejection sampling against the draft distribution)
is out of scope. Integer work on ids the backend already sampled, vectorized over requests: both backends'
``Backend.accept`` run this same stage (:mod:`dspark_kernels.model.backends`).
"""

from __future__ import annotations

import attrs
import numpy as np

from dspark_abi import ABIError, Issue

__all__ = ["Acceptance", "accept_greedy", "greedy_matrix"]


@attrs.frozen(eq=False)
class Acceptance:
    """Per-request outcome of a verify step (R verify requests).

    accepted: [R] int64 rows committed, ``1 + m`` in ``[1, width]`` (the anchor is always committed).
    matched: [R] int64 drafts accepted, ``m = accepted - 1``.
    bonus: [R] int64 the target's greedy id after the last accepted row: the next anchor.
    """

    accepted: np.ndarray
    matched: np.ndarray
    bonus: np.ndarray


def greedy_matrix(sampled: np.ndarray, logit_rows: np.ndarray, starts: np.ndarray, widths: np.ndarray,
                  padded_rows: int) -> np.ndarray:
    """[R, W] int64 greedy ids of R verify requests at their rows, W = max width, -1 beyond each width.

    sampled: [M] int64 greedy ids of the forward's logit rows; logit_rows: [M] int group rows (-1 inactive);
    starts: [R] group row of each request's anchor; widths: [R] rows per request (>= 1).
    Raises :class:`ABIError` (``array.missing``) if a verify row has no logits (the batch did not ask for them).
    """
    rows = np.asarray(logit_rows, dtype=np.int64)
    index = np.full(padded_rows, -1, np.int64)                 # group row -> position in the logit rows
    live = rows >= 0
    index[rows[live]] = np.flatnonzero(live)
    widths = np.asarray(widths, dtype=np.int64)
    cols = np.arange(int(widths.max(initial=1)))
    valid = cols[None, :] < widths[:, None]
    group_rows = np.where(valid, np.asarray(starts, dtype=np.int64)[:, None] + cols[None, :], 0)
    where = np.where(valid, index[np.clip(group_rows, 0, max(padded_rows - 1, 0))], -1)
    missing = valid & (where < 0)
    if missing.any():
        r = int(np.argwhere(missing)[0, 0])
        raise ABIError([Issue("array.missing", "logit_rows", "a verify request needs logits at every row",
                              request=r, expected="every row of each verify request among the logit rows",
                              actual=f"{int(missing.sum())} verify row(s) without logits",
                              fix="build verify steps with the builder's default logit rows")])
    return np.where(valid, np.asarray(sampled, dtype=np.int64)[np.maximum(where, 0)], -1)


def accept_greedy(tokens: np.ndarray, greedy: np.ndarray, widths: np.ndarray) -> Acceptance:
    """Greedy acceptance of R verify requests.

    tokens: [R, W] int inputs ``[anchor, d_1 ..]`` of each request (any value beyond its width);
    greedy: [R, W] int the target's greedy id at each row (any value beyond the width); widths: [R] in [1, W].
    ``m`` = the length of the leading run of ``tokens[:, i + 1] == greedy[:, i]`` over ``i < width - 1``
    (a cumulative product over the padded match mask), accepted = 1 + m, bonus = greedy[m].

    >>> a = accept_greedy(np.array([[5, 7, 8, 9], [5, 1, 2, 0]]), np.array([[7, 8, 4, 3], [6, 2, 0, 0]]),
    ...                   np.array([4, 3]))
    >>> a.accepted.tolist(), a.bonus.tolist()
    ([3, 1], [4, 6])
    """
    tokens, greedy = np.asarray(tokens, dtype=np.int64), np.asarray(greedy, dtype=np.int64)
    widths = np.asarray(widths, dtype=np.int64)
    drafts = tokens.shape[1] - 1
    in_width = np.arange(drafts)[None, :] < (widths - 1)[:, None]
    agree = (tokens[:, 1:] == greedy[:, :drafts]) & in_width
    matched = np.cumprod(agree, axis=1).sum(axis=1).astype(np.int64)
    bonus = np.take_along_axis(greedy, matched[:, None], axis=1)[:, 0]
    return Acceptance(accepted=matched + 1, matched=matched, bonus=bonus)
