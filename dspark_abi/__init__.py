"""dspark_abi: the typed, validated metadata ABI of packed multi-request DSpark prefill.

The core modules (config, layout, pools, policy, errors, lowering, rules, validation, ranks, batch,
allocator, builder, presets, testing) import nothing outside the core; ``dspark_abi.io`` (fixture files,
manifest, schema), ``dspark_abi.conformance`` (vectors and their runner) and ``dspark_abi.cli`` (the
``dspark-abi`` command) build on it.
"""

from collections.abc import Mapping
from typing import Any

from dspark_abi.allocator import BlockAllocator
from dspark_abi.batch import PackedBatch, RankView, RequestTables, SlotMappings
from dspark_abi.builder import BatchBuilder
from dspark_abi.config import ModelConfig, MoEConfig, RopeScaling
from dspark_abi.errors import CODES, ABIError, Issue, ValidationReport
from dspark_abi.layout import POOL_NAMES, CacheLayout, PoolLayout
from dspark_abi.lowering import lower_local_request_ids
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import PoolBlocks
from dspark_abi.validation import Level, validate_arrays

__version__ = "1.2.0"
#: Version of the metadata ABI specification this library implements (spec/v1).
ABI_VERSION = "1.4"


def validate(batch_or_arrays: PackedBatch | Mapping[str, Any], config: ModelConfig | None = None,
             policy: PaddingPolicy | None = None, pool_blocks: PoolBlocks | Mapping[str, int] | None = None, *,
             hidden: Any = None, level: Level = "full") -> ValidationReport:
    """Validate a :class:`PackedBatch` (with optional hidden rows) or flat ABI arrays; returns a report.

    For arrays, pass ``config``, ``policy`` and ``pool_blocks``. Never raises for bad data.
    """
    if isinstance(batch_or_arrays, PackedBatch):
        b = batch_or_arrays
        return validate_arrays(b.to_arrays(), b.config, b.policy, b.pool_blocks, hidden=hidden, level=level)
    if config is None or policy is None or pool_blocks is None:
        raise TypeError("validate(arrays, config, policy, pool_blocks): all three are required for raw arrays")
    return validate_arrays(batch_or_arrays, config, policy, pool_blocks, hidden=hidden, level=level)


__all__ = [
    "ABI_VERSION",
    "CODES",
    "POOL_NAMES",
    "ABIError",
    "BatchBuilder",
    "BlockAllocator",
    "CacheLayout",
    "Issue",
    "MoEConfig",
    "ModelConfig",
    "PackedBatch",
    "PaddingPolicy",
    "PoolBlocks",
    "PoolLayout",
    "RankView",
    "RequestTables",
    "RopeScaling",
    "SlotMappings",
    "ValidationReport",
    "lower_local_request_ids",
    "validate",
    "validate_arrays",
]
