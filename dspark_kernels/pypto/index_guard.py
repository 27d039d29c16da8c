"""Host guard of the pypto kernels' fp32 index arithmetic (importable without torch or pypto).

pypto 0.2.0 has no integer shifts or divisions on int32 tensors, so the window, entry-row and compressor
kernels form table and row indices in fp32 (``floor`` for the page): the flattened table entry
``request * width + column`` (``width`` = the columns of the table the kernel is given, ``column`` = the page,
or for a ring table the page modulo ``width``, :func:`dspark_kernels.pypto._ops.ring_column`), the pool row
``block * page_size + offset`` and ``position + 1``; a ring column also forms ``floor(page / width) * width``
(at most ``page + width``). fp32
holds every integer below 2**24 exactly; above it consecutive integers collide (2**24 + 1 rounds to 2**24),
so e.g. request 2049 of an 8192-wide table (entry 2048 * 8192 + page >= 2**24) would read another request's
page. Instead of rounding silently, the launchers raise :class:`ABIError` ``kernel.index_range`` before any
kernel runs when the largest such value reaches 2**24.
"""

from __future__ import annotations

import numpy as np

from dspark_abi.capabilities import FP32_EXACT_LIMIT  # every index the kernels form in fp32 stays below it
from dspark_abi.errors import ABIError, Issue


def index_range_issues(field: str, *, requests: int, width: int, page: int, max_block: int,
                       max_position: int = 0, ring: bool = False) -> list[Issue]:
    """Issues (``kernel.index_range``) for a table lookup ``table[request, column] * page + key % page``.

    requests, width: the table's rows R and width (its real columns), flattened by the kernel (largest entry
    R * width - 1); page: the pool's page size; max_block: the largest block id the lookup can return (largest
    pool row (max_block + 1) * page - 1); max_position: the largest position (or logical entry) the kernel
    reads (it forms max_position + 1). ring: the table is a ring table (``PoolLayout.is_ring``; column =
    page mod width): the kernel also forms ``floor(page / width) * width <= max_position // page + width``.
    ``field`` names the table in the issues. Empty list = every index exact.
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
    max_page = max(int(max_position), 0) // page
    if ring and max_page + width > limit:
        issues.append(Issue(
            "kernel.index_range", field,
            f"the ring column of page {max_page} in a {width}-wide table forms floor(page / width) * width, up to "
            f"page + width = {max_page + width}, in fp32; values > 2**24 round",
            expected=f"page + table width <= {limit}", actual=max_page + width))
    return issues


def table_issues(field: str, table: np.ndarray, page: int, positions: np.ndarray, *, ring: bool) -> list[Issue]:
    """:func:`index_range_issues` for one kernel launch: the [R, width] table (its real width), the positions
    (or logical entries) it is given and whether it is a ring table (``PoolLayout.is_ring``)."""
    table = np.asarray(table)
    positions = np.asarray(positions)
    return index_range_issues(field, requests=table.shape[0], width=table.shape[1], page=page,
                              max_block=int(table.max(initial=-1)), max_position=int(positions.max(initial=0)),
                              ring=ring)


def check_table(field: str, table: np.ndarray, page: int, positions: np.ndarray, *, ring: bool) -> None:
    """Raise :class:`ABIError` ``kernel.index_range`` if a launch with these inputs would round an index."""
    issues = table_issues(field, table, page, positions, ring=ring)
    if issues:
        raise ABIError(issues)
