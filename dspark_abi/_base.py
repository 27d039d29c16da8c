"""Shared building blocks: the strict pydantic base, array equality for attrs fields, integer helpers."""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base of every pydantic model at the project's boundary (config, policy, manifests).

    Unknown keys are rejected, NaN/inf are rejected, models are frozen (hashable) and field
    docstrings flow into the generated JSON Schema.
    """

    model_config = ConfigDict(
        strict=True,
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
        use_attribute_docstrings=True,
        validate_default=True,
    )


def array_eq(a: Any, b: Any) -> bool:
    """Equality for attrs fields holding arrays (``None`` allowed)."""
    if a is None or b is None:
        return a is None and b is None
    return bool(a.dtype == b.dtype and np.array_equal(a, b))


def expand_ranges(start: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ragged ranges -> flat (owner, value) pairs: range i yields ``start[i] .. start[i] + count[i] - 1`` (nothing
    when ``count[i] == 0``), ranges in order. owner: [sum(count)] int64 index of the range; value: [sum(count)]
    ``start``'s dtype promoted with int64. O(len(count) + sum(count)), no Python loop.

    >>> owner, value = expand_ranges(np.array([10, 0, 7]), np.array([2, 0, 3]))
    >>> owner.tolist(), value.tolist()
    ([0, 0, 2, 2, 2], [10, 11, 7, 8, 9])
    """
    count = np.asarray(count, dtype=np.int64)
    owner = np.repeat(np.arange(count.size, dtype=np.int64), count)
    first = np.cumsum(count) - count
    return owner, np.asarray(start)[owner] + (np.arange(owner.size, dtype=np.int64) - first[owner])


def find_in(keys: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index in ``keys`` of each ``wanted`` value found there, [W] bool mask of the wanted values found).

    keys: [K] distinct ints (any order); wanted: [W] ints. One sort of ``keys`` and one search: O((K + W) log K).
    """
    if keys.size == 0 or wanted.size == 0:
        return np.empty(0, np.int64), np.zeros(wanted.size, dtype=bool)
    order = np.argsort(keys, kind="stable")
    at = order[np.minimum(np.searchsorted(keys, wanted, sorter=order), keys.size - 1)]
    found = keys[at] == wanted
    return at[found], found


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


def align_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return cdiv(n, multiple) * multiple
