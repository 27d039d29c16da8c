"""Steps that map a drafter's window (the one home of this test helper): the DSpark drafter's window cache lives in
the target's ``ori`` pool (spec 5.10), so a test that observes or drafts first builds and commits the target's steps
for the requests, as a serving loop does, and attaches the drafter to the allocator's persistent tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PaddingPolicy, PoolBlocks
from dspark_abi.allocator import pool_blocks_for


class Steps:
    """An allocator and builder whose committed steps map requests' ``ori`` pages.

    contexts: the longest context of each request the test will run (sizes the pools, :func:`pool_blocks_for`);
    pool_blocks: explicit pools instead (few blocks force the allocator to hand released blocks on).
    """

    def __init__(self, config: ModelConfig, contexts: Sequence[int] = (512,) * 8, *,
                 pool_blocks: PoolBlocks | None = None):
        self.config = config
        self.alloc = BlockAllocator(config, pool_blocks or pool_blocks_for(config, list(contexts), slack=4))
        self.builder = BatchBuilder(config, PaddingPolicy(), self.alloc)
        self.cached: dict[int, int] = {}

    def attach(self, *drafters: object) -> None:
        """Attach every drafter to the allocator's persistent tables."""
        for d in drafters:
            d.attach(self.alloc.persistent)   # type: ignore[attr-defined]

    def step(self, rows: Mapping[int, int], accepted: Mapping[int, int] | None = None) -> dict[int, np.ndarray]:
        """Build and commit one step: ``rows[r]`` new rows of each request r (a prefill chunk; with ``accepted`` a
        verify request of that width committing ``accepted[r]`` rows). Returns each request's committed positions."""
        accepted = accepted or {}
        ids = list(rows)
        for r in ids:
            start = self.cached.get(r, 0)
            if r in accepted:
                self.builder.add_verify(r, num_cached=start, token_ids=np.zeros(rows[r], np.int64))
            else:
                self.builder.add(r, num_cached=start, num_new=rows[r], token_ids=np.zeros(rows[r], np.int64))
        step = self.builder.build_step()
        self.builder.commit(step, accepted=[accepted.get(r, rows[r]) for r in step.requests.ids.tolist()])
        out = {}
        for r in ids:
            start = self.cached.get(r, 0)
            self.cached[r] = start + accepted.get(r, rows[r])
            out[r] = np.arange(start, self.cached[r], dtype=np.int64)
        return out

    def release(self, request_id: int) -> None:
        """The request finished: the allocator frees its blocks (later requests take them)."""
        self.alloc.release(request_id)
        self.cached.pop(request_id, None)
