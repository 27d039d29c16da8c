"""What a kernel can take, checked once at start-up: pool sizes, index types, table depths and the token cap.

Engines have shipped geometries their kernels could not index and found out on the first long request: a
``physical_block_id * stride`` byte offset that overflows int32 from block 29,077 on A3 gave top-k 0/512 and
gibberish (vllm-ascend #16870, #16824); reviewers there and in vLLM (vllm-ascend #16423, vllm #56254) ask for every
kernel requirement to be checked once when the engine starts. :func:`check_capabilities` does that for one
deployment geometry (config, padding policy, pool sizes) and one kernel family, without building a batch:

* every kernel: the headroom of the rejection invariant (``verify.ring_headroom``): each ring pool holds the reach
  plus one verify request of ``1 + dspark_block_size`` rows without wrapping (spec 5.8.3).
* ``"reference"``: dspark's numpy reference indexes in int64 and has no capacity of its own: nothing else to check.
* ``"pypto"``: dspark's pypto 0.2.0 kernels form table entries, pool rows and positions in fp32
  (:data:`FP32_EXACT_LIMIT`, see ``dspark_kernels/pypto/index_guard.py``, code ``kernel.index_range`` per call);
  here the worst case of a whole deployment: every block of every pool, ``max_requests`` requests.
* ``"upstream"``: pypto-lib's kernels (PR #1095): the canonical pools (:func:`canonical_pool_blocks`), the frozen
  table depths (:data:`dspark_abi.upstream.UPSTREAM_TABLE_DEPTHS`) and the 8192-row group capacity.

``"pypto"`` and ``"upstream"`` are device kernels: both get the int32 byte-offset check, per pool from
``PoolLayout.row_shape`` / ``row_dtype`` (one layer's pool; a kernel that addresses the layer-stacked tensor in
int32 overflows a layer-count times earlier).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from dspark_abi._base import align_up
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue, ValidationReport
from dspark_abi.layout import POOL_NAMES, PoolName, verify_headroom
from dspark_abi.policy import DEFAULT_TOKEN_CAP, PaddingPolicy
from dspark_abi.pools import TABLE_FIELDS, PoolBlocks
from dspark_abi.upstream import UPSTREAM_TABLE_DEPTHS

Kernel = Literal["reference", "pypto", "upstream"]
KERNELS: tuple[Kernel, ...] = ("reference", "pypto", "upstream")

#: fp32 holds every integer below 2**24 exactly; dspark's pypto kernels form indices in fp32, so each must stay
#: below it (the one home of this constant; dspark_kernels/pypto/index_guard.py imports it).
FP32_EXACT_LIMIT = 2**24
#: The first byte offset an int32 index cannot express.
INT32_BYTE_LIMIT = 2**31
#: Rows of upstream's token all-gather window (``prefill_cp_token_allgather.PREFILL_GROUP_CAP``): P must fit.
UPSTREAM_GROUP_CAP = DEFAULT_TOKEN_CAP
#: Canonical blocks of upstream's four ring pools, independent of the context (pypto-lib
#: ``models/deepseek_v4_flash_dspark/config.py``: ``KV_ORI_BLOCK_NUM``, ``CSA_STATE_PHYSICAL_BLOCKS``,
#: ``CSA_INNER_STATE_PHYSICAL_BLOCKS``, ``HCA_STATE_PHYSICAL_BLOCKS``); ``prefill_fwd.build_tensor_specs`` refuses
#: smaller custom pools. 260 two-row blocks hold a 512-row compressor tile plus the 8 carried rows.
UPSTREAM_RING_POOL_BLOCKS: dict[PoolName, int] = {"ori": 512, "csa_state": 260, "csa_inner_state": 260,
                                                  "hca_state": 256}
#: Bytes of one element of a pool's row dtype (``PoolLayout.row_dtype``).
_DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "int8": 1}


def canonical_pool_blocks(config: ModelConfig) -> dict[PoolName, int]:
    """Upstream's smallest pools for ``config``: the ring pools' constants; for the compressed pools one request's
    whole history, ``table_width`` (upstream sets ``CMP_BLOCK_NUM = CMP_MAX_BLOCKS`` in prefill_csa.py,
    ``SPARSE_CMP_BLOCK_NUM = SPARSE_CMP_MAX_BLOCKS`` in prefill_hca.py and ``IDX_CACHE_BLOCK_NUM =
    IDX_CACHE_MAX_BLOCKS`` in prefill_indexer.py: 128 / 4 / 128 at 16,384 positions, 8192 / 256 / 8192 at
    1,048,576), so they scale with the context, as pypto-serving's admission of "one complete logical-capacity
    request" does (``docs/developer-guide/deepseek-v4-dspark.md``)."""
    return {p: UPSTREAM_RING_POOL_BLOCKS.get(p, config.layout.pools[p].table_width) for p in POOL_NAMES}


def check_capabilities(config: ModelConfig, policy: PaddingPolicy, pool_blocks: Mapping[str, int] | PoolBlocks, *,
                       kernel: Kernel = "reference", max_requests: int | None = None) -> ValidationReport:
    """Every reason ``kernel`` cannot serve this geometry, as a report (never raises for bad input).

    max_requests: the most requests one call may carry (the serving side's admission limit, e.g. 64 per TP group
    in pypto-serving); default ``policy.token_cap``, the most requests with at least one new token.
    """
    if kernel not in KERNELS:
        return ValidationReport((Issue("config.invalid", "kernel", "unknown kernel family", expected=list(KERNELS),
                                       actual=kernel),))
    try:
        blocks = PoolBlocks.from_mapping(pool_blocks)
    except ABIError as err:
        return ValidationReport(err.issues)
    headroom = _headroom_issues(config, blocks)
    if kernel == "reference":
        return ValidationReport(tuple(headroom))
    issues = headroom + _byte_offset_issues(config, blocks)
    if kernel == "pypto":
        issues += _fp32_issues(config, blocks, policy.token_cap if max_requests is None else max_requests)
    else:
        issues += _upstream_issues(config, policy, blocks)
    return ValidationReport(tuple(issues))


def _headroom_issues(config: ModelConfig, blocks: PoolBlocks) -> list[Issue]:
    """The rejection invariant's headroom (spec 5.8.3), for every kernel: each ring pool's allocator ring
    (``PoolLayout.ring_width`` columns) and its pool hold the pages of ``reach + (1 + K)`` positions, so a rejected
    draft never shares a physical row with a position the request's next step reads. The shipped layouts always
    satisfy it (RW_p is sized for reach + 8192 positions, and 1 + K <= 65); a pool smaller than one verify request's
    headroom cannot."""
    issues = []
    width = config.max_verify_width
    for pl in config.layout:
        need = verify_headroom(pl, width)
        if pl.ring_width < need or blocks[pl.name] < need:
            short_ring = pl.ring_width < need
            issues.append(Issue(
                "verify.ring_headroom", TABLE_FIELDS[pl.name] if short_ring else f"pool_blocks.{pl.name}",
                f"a {width}-row verify request needs {need} pages of ring {pl.name!r} (reach {pl.reach} + {width} "
                f"positions); the {'ring table holds' if short_ring else 'pool has'} "
                f"{pl.ring_width if short_ring else blocks[pl.name]}", expected=f">= {need}",
                actual=pl.ring_width if short_ring else blocks[pl.name],
                fix=f"give pool {pl.name!r} at least {need} blocks" if not short_ring else
                    "use a layout whose ring tables hold reach + 1 + dspark_block_size positions"))
    return issues


def _byte_offset_issues(config: ModelConfig, blocks: PoolBlocks) -> list[Issue]:
    """Pools whose last block reaches byte offset 2**31 (int32 ``block * page_size * row_bytes``)."""
    issues = []
    for pl in config.layout:
        row_bytes = math.prod(pl.row_shape) * _DTYPE_BYTES[pl.row_dtype]
        block_bytes = pl.page_size * row_bytes
        first = INT32_BYTE_LIMIT // block_bytes          # the first block holding a byte at offset >= 2**31
        if blocks[pl.name] > first:
            issues.append(Issue(
                "capability.index_overflow", f"pool_blocks.{pl.name}",
                f"block {first} of pool {pl.name!r} ({pl.page_size} rows of {row_bytes} bytes) reaches byte offset "
                f"2**31: an int32 byte offset (block * {block_bytes}) overflows from there", index=first,
                expected=f"<= {first} blocks", actual=blocks[pl.name],
                fix=f"give pool {pl.name!r} at most {first} blocks per layer, or address it with int64 offsets"))
    return issues


def _fp32_issues(config: ModelConfig, blocks: PoolBlocks, requests: int) -> list[Issue]:
    """dspark's pypto kernels: pool rows, flattened table entries and positions formed in fp32."""
    issues = []
    for pl in config.layout:
        first = FP32_EXACT_LIMIT // pl.page_size          # the first block with a row >= 2**24
        if blocks[pl.name] > first:
            issues.append(Issue(
                "capability.index_overflow", f"pool_blocks.{pl.name}",
                f"rows of block {first} of pool {pl.name!r} reach 2**24; the pypto kernels form block * "
                f"{pl.page_size} + offset in fp32, which rounds there", index=first, expected=f"<= {first} blocks",
                actual=blocks[pl.name], fix=f"give pool {pl.name!r} at most {first} blocks for the pypto backend"))
        width = pl.ring_width if pl.is_ring else pl.table_width      # the widest table the builder emits
        if requests * width > FP32_EXACT_LIMIT:
            issues.append(Issue(
                "capability.table_depth", TABLE_FIELDS[pl.name],
                f"{requests} requests * {width} columns: the pypto kernels flatten the table and index its entries "
                "in fp32, entries >= 2**24 round", expected=f"<= {FP32_EXACT_LIMIT // width} requests per call",
                actual=requests, fix=f"admit at most {FP32_EXACT_LIMIT // width} requests per call (max_requests)"))
    if config.max_position_embeddings >= FP32_EXACT_LIMIT:
        issues.append(Issue(
            "capability.index_overflow", "max_position_embeddings", "the pypto kernels form position + 1 in fp32",
            expected=f"< {FP32_EXACT_LIMIT}", actual=config.max_position_embeddings,
            fix=f"use max_position_embeddings < {FP32_EXACT_LIMIT} with the pypto backend"))
    return issues


def _upstream_issues(config: ModelConfig, policy: PaddingPolicy, blocks: PoolBlocks) -> list[Issue]:
    """pypto-lib's kernels: canonical pools, frozen table depths, the group capacity."""
    issues = []
    for p, minimum in canonical_pool_blocks(config).items():
        if blocks[p] < minimum:
            issues.append(Issue("capability.pool_size", f"pool_blocks.{p}", f"upstream's kernels need at least "
                                f"{minimum} blocks of pool {p!r}", expected=f">= {minimum}", actual=blocks[p],
                                fix=f"give pool {p!r} at least {minimum} blocks"))
        width = config.layout.pools[p].table_width
        if width > UPSTREAM_TABLE_DEPTHS[p]:
            issues.append(Issue(
                "capability.table_depth", TABLE_FIELDS[p], f"{config.name}'s context needs {width} pages, the "
                f"deployed kernels' table is frozen at {UPSTREAM_TABLE_DEPTHS[p]}", expected=f"<= "
                f"{UPSTREAM_TABLE_DEPTHS[p]} pages", actual=width,
                fix="use max_position_embeddings <= 1048576, the context the deployed kernels are compiled for"))
    padded = align_up(policy.token_cap, policy.tp_size)
    if padded > UPSTREAM_GROUP_CAP:
        issues.append(Issue("capability.token_cap", "policy.token_cap", f"P = align_up(token_cap, TP) = {padded} rows "
                            f"exceed upstream's {UPSTREAM_GROUP_CAP}-row token window", expected=f"<= "
                            f"{UPSTREAM_GROUP_CAP} rows", actual=padded,
                            fix=f"set token_cap <= {UPSTREAM_GROUP_CAP // policy.tp_size * policy.tp_size}"))
    return issues
