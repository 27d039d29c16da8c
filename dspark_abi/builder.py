"""`BatchBuilder`: serving code adds requests and gets a validated `PackedBatch`.

>>> from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
>>> from dspark_abi.presets import TINY
>>> alloc = BlockAllocator(TINY, PoolBlocks.uniform(64))
>>> builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2), alloc)
>>> builder.add(0, num_cached=126, num_new=3)
>>> builder.add(1, num_cached=30, num_new=4)
>>> batch = builder.build()
>>> batch.query_start_loc.tolist(), batch.positions.tolist()
([0, 3, 7], [126, 127, 128, 30, 31, 32, 33, 0])
>>> batch.rank(0).local_request_ids.tolist(), batch.rank(1).local_request_ids.tolist()
([0, 0, 0, 1], [1, 1, 1, -1])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from dspark_abi.allocator import BlockAllocator, StepPlan
from dspark_abi.batch import PackedBatch, RequestTables, SlotMappings
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_abi.layout import POOL_NAMES
from dspark_abi.policy import PaddingPolicy


@attrs.frozen
class RequestSpec:
    """One request of a step: ``num_new`` tokens after ``num_cached`` already in the caches."""

    request_id: int
    num_cached: int
    num_new: int
    token_ids: np.ndarray | None = None


class BatchBuilder:
    """Collects the requests of one prefill step and builds its metadata.

    ``build()`` maps pages through the allocator (all or nothing), derives slots from tables and
    positions, pads to the TP geometry per policy, validates, and only then commits the allocation.
    For chunked prefill, add the same request id in a later step with ``num_cached`` advanced by the
    tokens of its earlier chunks; it keeps its tables.
    """

    def __init__(self, config: ModelConfig, policy: PaddingPolicy, allocator: BlockAllocator):
        if allocator.config != config:
            raise ABIError([Issue("config.mismatch", "allocator", "allocator was built for another config",
                                  expected=config.name, actual=allocator.config.name)])
        self.config, self.policy, self.allocator = config, policy, allocator
        self._pending: list[RequestSpec] = []

    def add(self, request_id: int, num_cached: int, num_new: int, token_ids: Sequence[int] | np.ndarray | None = None
            ) -> None:
        """Queue one request for the next :meth:`build` (checked there, all requests at once)."""
        tids = None if token_ids is None else np.asarray(token_ids)
        self._pending.append(RequestSpec(request_id, num_cached, num_new, tids))

    def clear(self) -> None:
        """Drop the queued requests."""
        self._pending.clear()

    def build(self, *, logit_rows: str | Sequence[int] | None = "last") -> PackedBatch:
        """Validated batch of the queued requests; clears the queue on success.

        logit_rows: 'last' samples the last new token of every non-empty request (-1 for empty ones),
        None leaves them out, or an explicit list of group rows.
        On any error nothing is allocated and the queue is kept, so the caller can fix and retry.
        """
        specs = list(self._pending)
        self._check_specs(specs)
        ids = [s.request_id for s in specs]
        starts = np.array([s.num_cached for s in specs], dtype=np.int64)
        lengths = np.array([s.num_new for s in specs], dtype=np.int64)
        plan = self.allocator.plan(ids, starts, starts + lengths)
        batch = self._assemble(specs, starts, lengths, plan, logit_rows)
        self.allocator.commit(plan)
        self._pending.clear()
        return batch

    # ------------------------------------------------------------------ internals
    def _check_specs(self, specs: list[RequestSpec]) -> None:
        issues: list[Issue] = []
        seen: set[int] = set()
        max_pos = self.config.max_position_embeddings

        def bad(i: int, msg: str, expected: Any, actual: Any) -> None:
            issues.append(Issue("builder.request", "requests", msg, index=i, request=i, expected=expected,
                                actual=actual))

        for i, s in enumerate(specs):  # per-request checks: the builder's input is a list of requests
            if not isinstance(s.request_id, int | np.integer) or s.request_id in seen:
                bad(i, "request ids must be unique integers", "unique int", s.request_id)
            seen.add(s.request_id)
            if s.num_cached < 0 or s.num_new < 0:
                bad(i, "token counts must be >= 0", ">= 0", (s.num_cached, s.num_new))
            elif s.num_cached + s.num_new > max_pos:
                bad(i, f"context would exceed max_position_embeddings={max_pos}", f"<= {max_pos}",
                    s.num_cached + s.num_new)
            if s.num_new == 0 and not self.policy.allow_empty_requests:
                bad(i, "zero-length request not allowed by policy", "> 0", 0)
            if self.allocator.knows(s.request_id):
                have = self.allocator.cached_tokens(s.request_id)
                if s.num_cached != have:
                    bad(i, "a continued request must start where its previous chunk ended", have, s.num_cached)
            if s.token_ids is not None and s.token_ids.shape != (s.num_new,):
                bad(i, "token_ids must hold one id per new token", (s.num_new,), s.token_ids.shape)
        total = sum(s.num_new for s in specs)
        if not specs or not 1 <= total <= self.policy.token_cap:
            issues.append(Issue("qsl.token_count", "requests", "a batch needs 1..token_cap new tokens",
                                expected=f"1..{self.policy.token_cap}", actual=total))
        with_ids = {s.token_ids is None for s in specs}
        if len(with_ids) > 1:
            issues.append(Issue("builder.request", "token_ids", "give token ids for every request or none",
                                expected="all or none", actual="some"))
        if issues:
            raise ABIError(issues)

    def _assemble(self, specs: list[RequestSpec], starts: np.ndarray, lengths: np.ndarray, plan: StepPlan,
                  logit_rows: str | Sequence[int] | None) -> PackedBatch:
        layout, policy = self.config.layout, self.policy
        qsl = np.zeros(len(specs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=qsl[1:])
        n = int(qsl[-1])
        p_rows = policy.padded_rows(n)
        row_req = np.repeat(np.arange(len(specs)), lengths)                            # [N]
        pos = starts[row_req] + (np.arange(n) - qsl[:-1][row_req])                     # [N]
        positions = np.empty(p_rows, dtype=np.int32)
        positions[:n] = pos
        positions[n:] = 0 if policy.pad_position == "zero" else pos[-1] + 1 + np.arange(p_rows - n)

        tables = {}
        for p in POOL_NAMES:  # the step's tables = current rows + this plan's new mappings - releases
            t = self.allocator._tables[p][plan.rows]
            r_rows, r_pages, _ = plan.release_cells[p]
            m_rows, m_pages, m_blocks = plan.map_cells[p]
            if r_rows.size:
                t[_index(plan.rows, r_rows), r_pages] = -1
            if m_rows.size:
                t[_index(plan.rows, m_rows), m_pages] = m_blocks
            t.flags.writeable = False
            tables[p] = t

        slots = {}
        for p in POOL_NAMES:
            pl = layout.pools[p]
            s = np.full(p_rows, -1, dtype=np.int64)
            if pl.ratio:
                write = (pos + 1) % pl.ratio == 0
                logical = (pos + 1) // pl.ratio - 1
            else:
                write = np.ones(n, dtype=bool)
                logical = pos
            w = np.flatnonzero(write)
            blk = tables[p][row_req[w], logical[w] // pl.page_size].astype(np.int64)
            s[w] = blk * pl.page_size + logical[w] % pl.page_size
            s.flags.writeable = False
            slots[p] = s

        token_ids = None
        if specs and specs[0].token_ids is not None:
            token_ids = np.full(p_rows, policy.pad_token_id, dtype=np.int64)
            token_ids[:n] = np.concatenate([s.token_ids for s in specs if s.token_ids is not None])
        if logit_rows == "last":
            rows = np.where(lengths > 0, qsl[1:] - 1, -1).astype(np.int32)
        elif logit_rows is None:
            rows = None
        else:
            rows = np.asarray(logit_rows, dtype=np.int32)
        request_ids = np.array([s.request_id for s in specs], dtype=np.int64)
        return PackedBatch(config=self.config, policy=policy, pool_blocks=self.allocator.pool_blocks,
                           query_start_loc=qsl, positions=positions, tables=RequestTables(**tables),
                           slots=SlotMappings(**slots), request_ids=request_ids, token_ids=token_ids,
                           logit_rows=rows)


def _index(rows: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Positions of ``wanted`` allocator rows within ``rows`` (each wanted row occurs in rows)."""
    order = np.argsort(rows, kind="stable")
    return order[np.searchsorted(rows, wanted, sorter=order)]
