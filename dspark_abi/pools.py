"""The seven pools' `PoolBlocks`, the physical block count of each (their field names: :mod:`dspark_abi.fields`).

Below :mod:`dspark_abi.batch`: the validator, the allocator and the fixture manifest use these without the
batch types.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from dspark_abi.errors import ABIError, Issue
from dspark_abi.fields import SLOT_FIELDS, TABLE_FIELDS
from dspark_abi.layout import MAX_POOL_BLOCKS, PAGE_SIZES, POOL_NAMES, PoolName

__all__ = ["SLOT_FIELDS", "TABLE_FIELDS", "PoolBlocks", "block_count_issue"]  # the field names: dspark_abi.fields


def _block_count(value: Any) -> Any:
    """numpy integers become Python ints; anything else is left for the check to report."""
    return int(value) if isinstance(value, np.integer) else value


def block_count_issue(pool: PoolName, value: Any) -> Issue | None:
    """Why ``value`` is not a legal block count of ``pool`` (None when it is): an int in [1, MAX_POOL_BLOCKS]."""
    limit = MAX_POOL_BLOCKS[pool]
    if not isinstance(value, bool) and isinstance(value, int | np.integer) and 1 <= value <= limit:
        return None
    if isinstance(value, int) and value.bit_length() > 64:  # a 400-digit count: name it, do not print it
        value = f"{str(value)[:20]}... ({len(str(value))} digits)"
    return Issue("pools.blocks", f"pool_blocks.{pool}",
                 f"block count of pool {pool!r} must be an integer in [1, {limit}] (page size "
                 f"{PAGE_SIZES[pool]}: every slot must fit int32)",
                 expected=f"1..{limit}", actual=value,
                 fix=f"give pool {pool!r} an integer count of blocks between 1 and {limit} (a Python or numpy "
                     "integer, not bool or float)")


@attrs.frozen
class PoolBlocks:
    """Physical block count of each pool (the bound for table entries and slots).

    Every count is a Python int in ``[1, MAX_POOL_BLOCKS[pool]]`` (``(2**31 - 1) // page_size``, so that block
    ids and slots fit int32): construction raises ``pools.blocks`` otherwise, so no bad instance exists.

    Attributes:
        ori: Blocks of the uncompressed KV pool (32 rows each).
        csa_cmp: Blocks of the ratio-4 compressed KV pool (32 entries each).
        hca_cmp: Blocks of the ratio-128 compressed KV pool (32 entries each).
        idx: Blocks of the indexer key cache and its scale (32 entries each).
        csa_state: Blocks of the ratio-4 compressor state ring (2 positions each).
        csa_inner_state: Blocks of the indexer compressor state ring (2 positions each).
        hca_state: Blocks of the ratio-128 compressor state ring (8 positions each).
    """

    ori: int = attrs.field(converter=_block_count)
    csa_cmp: int = attrs.field(converter=_block_count)
    hca_cmp: int = attrs.field(converter=_block_count)
    idx: int = attrs.field(converter=_block_count)
    csa_state: int = attrs.field(converter=_block_count)
    csa_inner_state: int = attrs.field(converter=_block_count)
    hca_state: int = attrs.field(converter=_block_count)

    def __attrs_post_init__(self) -> None:
        issues = [i for p in POOL_NAMES if (i := block_count_issue(p, getattr(self, p))) is not None]
        if issues:
            raise ABIError(issues)

    @classmethod
    def from_mapping(cls, blocks: Mapping[str, int] | PoolBlocks) -> PoolBlocks:
        """Checked conversion of a mapping pool -> block count; raises ``pools.blocks`` naming every problem."""
        if isinstance(blocks, PoolBlocks):
            return blocks
        if not isinstance(blocks, Mapping):
            raise ABIError([Issue("pools.blocks", "pool_blocks", "must be a mapping pool name -> block count",
                                  expected="PoolBlocks or a mapping of the seven pools", actual=type(blocks).__name__,
                                  fix="pass PoolBlocks(...), PoolBlocks.uniform(n) or a dict with the seven pools")])
        missing = [p for p in POOL_NAMES if p not in blocks]
        extra = [k for k in blocks if k not in POOL_NAMES]
        issues = []
        if missing or extra:
            issues.append(Issue("pools.blocks", "pool_blocks", "pool_blocks must name exactly the seven pools",
                                expected=list(POOL_NAMES), actual={"missing": missing, "extra": extra}))
        issues += [i for p in POOL_NAMES if p in blocks and (i := block_count_issue(p, blocks[p])) is not None]
        if issues:
            raise ABIError(issues)
        return cls(**{p: blocks[p] for p in POOL_NAMES})

    @classmethod
    def uniform(cls, blocks: int) -> PoolBlocks:
        """The same block count for every pool."""
        return cls(**dict.fromkeys(POOL_NAMES, blocks))

    def __getitem__(self, pool: str) -> int:
        count: int = getattr(self, pool)
        return count

    def as_dict(self) -> dict[str, int]:
        """Pool name -> block count, in ABI order."""
        return {p: getattr(self, p) for p in POOL_NAMES}
