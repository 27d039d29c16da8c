"""Host guard of the pypto kernels' fp32 index arithmetic (importable without torch or pypto).

pypto 0.2.0 has no integer shifts or divisions on int32 tensors, so the window, entry-row and compressor
kernels form table and row indices in fp32 (``floor`` for the page): the flattened table entry
``request * table_width + page``, the pool row ``block * page_size + offset`` and ``position + 1``. fp32
holds every integer below 2**24 exactly; above it consecutive integers collide (2**24 + 1 rounds to 2**24),
so e.g. request 2049 of an 8192-wide table (entry 2048 * 8192 + page >= 2**24) would read another request's
page. Instead of rounding silently, the launchers raise :class:`ABIError` ``kernel.index_range`` before any
kernel runs when the largest such value reaches 2**24.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.errors import ABIError, Issue

#: Every index the kernels form in fp32 must stay below this (integers < 2**24 are exact in fp32).
FP32_EXACT_LIMIT = 2**24


def index_range_issues(field: str, *, requests: int, width: int, page: int, max_block: int,
                       max_position: int = 0) -> list[Issue]:
    """Issues (``kernel.index_range``) for a table lookup ``table[request, key // page] * page + key % page``.

    requests, width: the table's rows R and width, flattened by the kernel (largest entry R * width - 1);
    page: the pool's page size; max_block: the largest block id the lookup can return (largest pool row
    (max_block + 1) * page - 1); max_position: the largest position (or logical entry) the kernel reads
    (it forms max_position + 1). ``field`` names the table in the issues. Empty list = every index exact.
    """
    issues = []
    limit = FP32_EXACT_LIMIT
    last_entry = requests * width - 1
    if last_entry >= limit:
        issues.append(Issue(
            "kernel.index_range", field,
            f"the kernel flattens the table to R * table_width = {requests} * {width} entries and indexes them "
            f"in fp32; entries >= 2**24 round", expected=f"R <= {limit // width} requests of this table per call",
            actual=requests))
    last_row = (int(max_block) + 1) * page - 1
    if max_block >= 0 and last_row >= limit:
        issues.append(Issue(
            "kernel.index_range", field,
            f"block {int(max_block)} * page_size {page} + offset reaches pool row {last_row}, formed in fp32; rows "
            f">= 2**24 round", expected=f"block ids < {limit // page} (pools of at most {limit // page} blocks)",
            actual=int(max_block)))
    if max_position + 1 >= limit:
        issues.append(Issue(
            "kernel.index_range", field, f"position + 1 = {int(max_position) + 1} is formed in fp32 and would round",
            expected=f"positions < {limit - 1}", actual=int(max_position)))
    return issues


def table_issues(field: str, table: np.ndarray, page: int, positions: np.ndarray) -> list[Issue]:
    """:func:`index_range_issues` for one kernel launch: the [R, width] table and positions it is given."""
    table = np.asarray(table)
    positions = np.asarray(positions)
    return index_range_issues(field, requests=table.shape[0], width=table.shape[1], page=page,
                              max_block=int(table.max(initial=-1)), max_position=int(positions.max(initial=0)))


def check_table(field: str, table: np.ndarray, page: int, positions: np.ndarray) -> None:
    """Raise :class:`ABIError` ``kernel.index_range`` if a launch with these inputs would round an index."""
    issues = table_issues(field, table, page, positions)
    if issues:
        raise ABIError(issues)
