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


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


def align_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return cdiv(n, multiple) * multiple
