"""StepValidator: every report equals validate_arrays' (issue for issue), over conformance vectors, serving loops
with chunked requests joining and leaving, every single-rule mutation and targeted edits of old table cells; a
rejected step leaves the state as it was; valid serving steps never fall back to the exact page check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dspark_abi.incremental as incremental
from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy, validate_arrays
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.conformance import runner, vectors
from dspark_abi.incremental import StepValidator
from dspark_abi.io import fixtures
from dspark_abi.layout import POOL_NAMES, table_column, touched_pages
from dspark_abi.pools import TABLE_FIELDS, PoolBlocks
from dspark_abi.presets import TINY, TINY_1M
from dspark_abi.testing import MUTATIONS, mutate

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "v1" / "vectors"
RING_MODES = ["exact", "tracked"]
def examples(n):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(sv, arrays, hidden=None):
    """Validate with both validators; the reports must be identical (every issue, in order)."""
    arrays = arrays.to_arrays() if hasattr(arrays, "to_arrays") else arrays
    full = validate_arrays(arrays, sv.config, sv.policy, sv.pool_blocks, hidden=hidden)
    inc = sv.validate(arrays, hidden=hidden)
    assert inc.issues == full.issues, f"incremental:\n{inc}\nfull:\n{full}"
    return inc


def snapshot(sv):
    """The validator's state, to prove a rejected step changed nothing."""
    refs = {p: (r.count.copy(), r.sum.copy(), r.sumsq.copy(), r.total) for p, r in sv._refs.items()}
    return refs, sv._accepted


def assert_unchanged(sv, snap):
    refs, accepted = snap
    assert sv._accepted is accepted
    for p, (c, s, q, total) in refs.items():
        r = sv._refs[p]
        assert r.total == total
        for now, then in ((r.count, c), (r.sum, s), (r.sumsq, q)):  # the arrays may have grown: by zeros only
            size = max(now.size, then.size)
            np.testing.assert_array_equal(np.pad(now, (0, size - now.size)), np.pad(then, (0, size - then.size)))


# ---------------------------------------------------------------------------------------------- conformance vectors
def _committed():
    for entry in runner.load_index(VECTORS):
        if not entry["file"].startswith("hostile/"):
            yield entry["file"]


@pytest.mark.parametrize("ring", RING_MODES)
@pytest.mark.parametrize("name", list(_committed()))
def test_committed_vector_agrees(name, ring):
    f = fixtures.read(VECTORS / name)
    m = f.manifest
    sv = StepValidator(m.config, m.policy, f.pool_blocks, ring_pools=ring)
    first = check(sv, f.arrays, f.extras.get("hidden"))
    second = check(sv, f.arrays, f.extras.get("hidden"))     # valid: the baseline now, every page kept
    assert first.ok == second.ok


@pytest.mark.parametrize("ring", RING_MODES)
def test_generated_vectors_agree_in_sequence(ring):
    # every vector once with a fresh validator, then all vectors of one geometry through one validator: the
    # invalid ones are edits of the valid ones, checked against them as the accepted baseline
    groups: dict[tuple, StepValidator] = {}
    for v in vectors.all_vectors():
        check(StepValidator(v.config, v.policy, v.pool_blocks, ring_pools=ring), v.arrays, v.extras.get("hidden"))
        key = (v.config.name, v.policy.model_dump_json(), tuple(sorted(v.pool_blocks.items())))
        sv = groups.setdefault(key, StepValidator(v.config, v.policy, v.pool_blocks, ring_pools=ring))
        snap = snapshot(sv)
        report = check(sv, v.arrays, v.extras.get("hidden"))
        assert report.ok == v.expected.valid
        if not report.ok:
            assert_unchanged(sv, snap)


# ---------------------------------------------------------------------------------------------- serving loops
def _live_cells(batch, pool, r):
    """(pages, columns) of request r's live pages of ``pool`` in this batch's table."""
    pl = batch.config.layout.pools[pool]
    s = batch.request_starts[r:r + 1]
    _, pages = touched_pages(pl, s, s + batch.request_lengths[r:r + 1], batch.config.sliding_window)
    return pages, np.asarray(table_column(pl, pages, batch.tables[pool].shape[1]))


def _written_blocks(batch, pool, r):
    ps = batch.config.layout.pools[pool].page_size
    lo, hi = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
    s = batch.slots[pool][lo:hi]
    return np.unique(s[s >= 0] // ps)


def perturb(batch, rng, old_page=False):
    """A copy of the batch's arrays with one live table cell of one request remapped (valid or not): to -1, out of
    range, the request's own other block, a block another request writes, or reads, or any block."""
    arrays = {k: np.array(v) for k, v in batch.to_arrays().items()}
    live = np.flatnonzero(batch.request_lengths > 0)
    r = int(rng.choice(live))
    pool = POOL_NAMES[int(rng.integers(7))]
    _, cols = _live_cells(batch, pool, r)
    if cols.size == 0:
        return arrays, "nothing"
    k = 0 if old_page else int(rng.integers(cols.size))
    table = arrays[TABLE_FIELDS[pool]]
    n_blocks = batch.pool_blocks[pool]
    others = [int(o) for o in live if o != r]
    kind = str(rng.choice(["unmapped", "range", "own", "foreign_written", "foreign_read", "any"]))
    if kind == "unmapped":
        value = -1
    elif kind == "range":
        value = n_blocks + int(rng.integers(3))
    elif kind == "own" and cols.size > 1:
        value = int(table[r, cols[(k + 1) % cols.size]])
    elif kind == "foreign_written" and others and _written_blocks(batch, pool, o := int(rng.choice(others))).size:
        value = int(rng.choice(_written_blocks(batch, pool, o)))
    elif kind == "foreign_read" and others:
        o = int(rng.choice(others))
        _, ocols = _live_cells(batch, pool, o)
        if ocols.size == 0:
            return arrays, "nothing"
        value = int(batch.tables[pool][o, int(rng.choice(ocols))])
    else:
        kind, value = "any", int(rng.integers(n_blocks))
    table[r, cols[k]] = value
    return arrays, kind


def serve(config, policy, rng, *, steps, max_requests, max_new, max_join_cached, pools, mutations, perturbations,
          ring_pools, accept_perturbed=True):
    """Drive a serving loop: requests join (possibly with a cached prefix), continue in chunks and leave; ids are
    reused. Every step: each mutation and perturbation (incremental == full, a rejected step changes nothing),
    sometimes a valid perturbation becomes the accepted step, then the builder's batch (valid, never exact)."""
    alloc = BlockAllocator(config, pools)
    builder = BatchBuilder(config, policy, alloc)
    sv = StepValidator(config, policy, alloc.pool_blocks, ring_pools=ring_pools)
    active: dict[int, int] = {}
    next_id, max_pos = 0, config.max_position_embeddings
    for step in range(steps):
        for rid in [r for r in active if rng.random() < 0.25 or active[r] >= max_pos - max_new]:
            if alloc.knows(rid):
                alloc.release(rid)
            del active[rid]
        while len(active) < max_requests and (not active or rng.random() < 0.5):
            rid = int(rng.integers(0, next_id)) if next_id and rng.random() < 0.2 else next_id
            next_id = max(next_id, rid + 1)
            if rid not in active:
                active[rid] = int(rng.integers(0, max_join_cached + 1)) if rng.random() < 0.5 else 0
        order = [r for r in sorted(active, key=lambda _: rng.random()) if rng.random() > 0.15]  # some pause
        order = order or list(active)[:1]
        news = [int(rng.integers(0, max_new + 1)) for _ in order]
        news[0] = news[0] or 1
        for rid, new in zip(order, news, strict=True):
            builder.add(rid, active[rid], new)
            active[rid] += new
        batch = builder.build()
        for code in mutations:
            case = mutate(batch, code, int(rng.integers(2**16)))
            if case is None:
                continue
            snap = snapshot(sv)
            report = check(sv, case.arrays, case.hidden)
            assert code in report.codes
            assert_unchanged(sv, snap)
        for _ in range(perturbations):
            arrays, _kind = perturb(batch, rng, old_page=rng.random() < 0.5)
            snap = snapshot(sv)
            report = check(sv, arrays)
            if not report.ok:
                assert_unchanged(sv, snap)
            elif accept_perturbed and rng.random() < 0.3:
                break                        # the remapped step was accepted: the builder's batch follows on it
        report = check(sv, batch)
        assert report.ok and sv.last_stats.suspect == (), (step, sv.last_stats)
    return sv


@examples(12)
@given(seed=st.integers(0, 2**32 - 1), tp=st.sampled_from([1, 2, 4]), pad=st.sampled_from(["zero", "continue"]),
       ring=st.sampled_from(RING_MODES))
def test_serving_loop_tiny_every_mutation(seed, tp, pad, ring):
    rng = np.random.default_rng(seed)
    policy = PaddingPolicy(tp_size=tp, pad_position=pad)
    serve(TINY, policy, rng, steps=8, max_requests=4, max_new=48, max_join_cached=600,
          pools=pool_blocks_for(TINY, [TINY.max_position_embeddings] * 5), mutations=sorted(MUTATIONS),
          perturbations=6, ring_pools=ring)


@examples(14)
@given(seed=st.integers(0, 2**32 - 1), ring=st.sampled_from(RING_MODES))
def test_serving_loop_tiny_tight_pools_perturbed(seed, ring):
    # small pools: blocks are recycled and reused by other requests from step to step
    rng = np.random.default_rng(seed)
    pools = PoolBlocks(**{p: n // 2 for p, n in pool_blocks_for(TINY, [1200] * 4).as_dict().items()})
    serve(TINY, PaddingPolicy(tp_size=2), rng, steps=12, max_requests=4, max_new=40, max_join_cached=300,
          pools=pools, mutations=(), perturbations=10, ring_pools=ring)


@examples(3)
@given(seed=st.integers(0, 2**32 - 1), ring=st.sampled_from(RING_MODES))
def test_serving_loop_1m(seed, ring):
    rng = np.random.default_rng(seed)
    policy = PaddingPolicy(tp_size=2)
    serve(TINY_1M, policy, rng, steps=4, max_requests=3, max_new=600, max_join_cached=400_000,
          pools=pool_blocks_for(TINY_1M, [420_000] * 6), mutations=sorted(MUTATIONS), perturbations=6,
          ring_pools=ring)


# ---------------------------------------------------------------------------------------------- targeted edits
def _long_loop(config=TINY_1M, cached=300_000, steps=3):
    """Request 0 deep in its context, request 1 short, both continuing for ``steps`` chunks; yields each batch."""
    alloc = BlockAllocator(config, pool_blocks_for(config, [cached + 4096, 4096]))
    builder = BatchBuilder(config, PaddingPolicy(tp_size=2), alloc)
    pos = {0: cached, 1: 40}
    for _ in range(steps):
        for rid, q in ((0, 160), (1, 130)):
            builder.add(rid, pos[rid], q)
            pos[rid] += q
        yield builder.build()


#: (pool, edit) pairs; request 1's only hca_cmp page (entries < 32) is written every step, so it has no read-only
#: hca_cmp page to borrow and "foreign_read" has no case there
OLD_CELL_EDITS = [(pool, edit) for pool in ["csa_cmp", "idx", "hca_cmp", "ori", "csa_state", "hca_state"]
                  for edit in ["foreign_written", "own", "unmapped", "range", "foreign_read", "free"]
                  if (pool, edit) != ("hca_cmp", "foreign_read")]


@pytest.mark.parametrize(("pool", "edit"), OLD_CELL_EDITS)
def test_an_old_cell_of_a_continuing_request_is_compared(pool, edit):
    # ring pools tracked too, so that every pool's old cell is found by the comparison of cells
    batches = list(_long_loop())
    sv = StepValidator(batches[0].config, batches[0].policy, batches[0].pool_blocks, ring_pools="tracked")
    for b in batches[:-1]:
        assert check(sv, b).ok
    b = batches[-1]
    pages, cols = _live_cells(b, pool, 0)
    assert pages.size > 1
    arrays = {k: np.array(v) for k, v in b.to_arrays().items()}
    table = arrays[TABLE_FIELDS[pool]]
    old_col = int(cols[0])                    # the oldest live page: unchanged for steps, deep in the history
    used = np.concatenate([b.tables[pool][r, _live_cells(b, pool, r)[1]] for r in (0, 1)])
    read_only = np.setdiff1d(b.tables[pool][1, _live_cells(b, pool, 1)[1]], _written_blocks(b, pool, 1))
    assert edit != "foreign_read" or read_only.size, f"request 1 has no read-only {pool} page to borrow"
    value = {"foreign_written": int(_written_blocks(b, pool, 1)[0]), "own": int(table[0, cols[-1]]), "unmapped": -1,
             "range": b.pool_blocks[pool], "foreign_read": int(read_only[0]) if read_only.size else -1,
             "free": int(np.setdiff1d(np.arange(b.pool_blocks[pool]), used)[0])}[edit]
    table[0, old_col] = value
    snap = snapshot(sv)
    report = check(sv, arrays)
    want = {"foreign_written": "isolation.foreign_write", "own": "state.ring_alias" if pool.endswith("state") else
            "tables.alias", "unmapped": "coverage.unmapped", "range": "tables.block_range"}.get(edit)
    if want is None:      # remapped to a block no one writes: legal, and it becomes the baseline
        assert report.ok and sv.last_stats.fresh[pool] >= 1
    else:
        assert want in report.codes and pool in sv.last_stats.suspect
        assert_unchanged(sv, snap)
    assert check(sv, b).ok and sv.last_stats.suspect == ()   # the real step agrees on either baseline


def test_edit_after_acceptance_of_a_writeable_array_is_caught():
    # a caller's writeable arrays are copied when accepted: editing them in place afterwards is seen
    b0, b1 = list(_long_loop(steps=2))
    sv = StepValidator(b0.config, b0.policy, b0.pool_blocks)
    assert check(sv, {k: np.array(v) for k, v in b0.to_arrays().items()}).ok
    arrays = {k: np.array(v) for k, v in b1.to_arrays().items()}
    assert check(sv, arrays).ok
    arrays["csa_cmp_block_table"][0, 0] = int(_written_blocks(b1, "csa_cmp", 1)[0])
    assert "isolation.foreign_write" in check(sv, arrays).codes


def test_request_ids_absent_and_reordered_requests():
    batches = list(_long_loop(steps=3))
    sv = StepValidator(batches[0].config, batches[0].policy, batches[0].pool_blocks)
    for b in batches:
        arrays = dict(b.to_arrays())
        del arrays["request_ids"]                       # identified by batch index
        assert check(sv, arrays).ok
    # the same requests in the other order, new ids: every page fresh, still one answer
    b = batches[-1]
    flip = {k: np.array(v) for k, v in b.to_arrays().items()}
    flip["request_ids"] = np.array([7, 8], dtype=np.int64)
    assert check(sv, flip).ok


def test_untracked_pool_and_overflow_fall_back_to_full(monkeypatch):
    batches = list(_long_loop(config=TINY, cached=1500, steps=3))
    big = dict(batches[0].pool_blocks.as_dict(), csa_state=incremental.MAX_TRACKED_BLOCKS + 1)
    sv = StepValidator(TINY, batches[0].policy, big, ring_pools="tracked")
    assert sv.tracked_pools == tuple(p for p in POOL_NAMES if p != "csa_state")
    for b in batches:
        assert check(sv, b).ok and sv.last_stats.exact == ("csa_state",) and sv.last_stats.suspect == ()
    sv = StepValidator(TINY, batches[0].policy, big)     # ring pools exact (the default): compressed ones tracked
    assert sv.tracked_pools == ("csa_cmp", "hca_cmp", "idx")
    monkeypatch.setattr(incremental, "_SUM_LIMIT", 1)
    sv = StepValidator(TINY, batches[0].policy, batches[0].pool_blocks)
    for b in batches:
        assert check(sv, b).ok
    assert sv._accepted is None                   # each step was validated in full and the state dropped


def test_reset_invalid_pool_blocks_and_batch_input():
    b0, b1 = list(_long_loop(config=TINY, cached=1000, steps=2))
    sv = StepValidator(TINY, b0.policy, b0.pool_blocks)
    assert sv.validate(b0).ok and sv.validate(b1).ok
    sv.reset()
    assert sv._accepted is None and check(sv, b1).ok
    bad = StepValidator(TINY, b0.policy, {"ori": 0})
    assert check(bad, b0).codes == {"pools.blocks"}


def test_blocks_shared_read_only_by_several_requests_stay_incremental():
    # requests 1 and 2 read request 0's first csa_cmp page (a shared prefix block, legal); then request 2 comes back
    # under a new id: a new request on a block two others share is no suspicion, the pool stays incremental
    alloc = BlockAllocator(TINY, pool_blocks_for(TINY, [2400] * 3))
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2), alloc)
    sv = StepValidator(TINY, builder.policy, alloc.pool_blocks)

    def step(cached, share, ids=None):
        for rid in range(3):
            builder.add(rid, cached, 50)
        arrays = {k: np.array(v) for k, v in builder.build().to_arrays().items()}
        table = arrays["csa_cmp_block_table"]
        if share:
            table[1, 0] = table[2, 0] = table[0, 0]
        if ids is not None:
            arrays["request_ids"] = np.array(ids, dtype=np.int64)
        return arrays

    assert check(sv, step(2000, False)).ok
    assert check(sv, step(2050, True)).ok and sv.last_stats.suspect == ()
    assert check(sv, step(2100, True)).ok and sv.last_stats.suspect == ()
    assert check(sv, step(2150, True, ids=[0, 1, 99])).ok and sv.last_stats.suspect == ()
    assert sv.last_stats.fresh["csa_cmp"] > 1                     # request 99: every page fresh
    arrays = step(2200, True, ids=[0, 1, 99])
    arrays["csa_cmp_block_table"][2, 1] = arrays["csa_cmp_block_table"][0, 0]   # 99 maps the shared block twice
    assert "tables.alias" in check(sv, arrays).codes


def test_ring_pools_argument_is_checked():
    with pytest.raises(ABIError) as err:
        StepValidator(TINY, PaddingPolicy(), pool_blocks_for(TINY, [64]), ring_pools="all")
    assert err.value.codes == {"config.invalid"} and err.value.issues[0].field == "ring_pools"


# ---------------------------------------------------------------------------------------------- both forms, one loop
def _foreign_alias(batch, pool="csa_cmp"):
    """A copy of ``batch``'s arrays with request 0's oldest live ``pool`` cell pointing at a block request 1 writes
    in this step (a foreign write into request 0's history: ``isolation.foreign_write``)."""
    arrays = {k: np.array(v) for k, v in batch.to_arrays().items()}
    _, cols = _live_cells(batch, pool, 0)
    arrays[TABLE_FIELDS[pool]][0, cols[0]] = int(_written_blocks(batch, pool, 1)[0])
    return arrays


@pytest.mark.parametrize("ring", RING_MODES)
def test_persistent_commits_leave_no_stale_baseline(ring):
    """A builder with a step validator, build() and build_step() mixed: every build() batch gets exactly the report
    of validate_arrays; a persistent step's commit makes the validator forget its baseline (the next build() compares
    no cell with a step older than the allocator's tables), a full-form commit makes the batch the baseline again;
    and a corrupted batch right after persistent steps, or one step later, is still caught, changing nothing."""
    policy = PaddingPolicy(tp_size=2)
    alloc = BlockAllocator(TINY, pool_blocks_for(TINY, [2000, 2000, 2000]))
    sv = StepValidator(TINY, policy, alloc.pool_blocks, ring_pools=ring)
    builder = BatchBuilder(TINY, policy, alloc, validator=sv)
    pos = dict.fromkeys(range(3), 0)
    forms = ["full", "step", "step", "full", "full", "step", "full"]
    for i, form in enumerate(forms):
        rids = [0, 1] + ([2] if i >= 1 else [])

        def queue(rids=rids):
            for rid in rids:
                builder.add(rid, pos[rid], 150)

        queue()
        if form == "step":
            step = builder.build_step()
            builder.commit(step)
        else:
            batch = builder.build()
            stats = sv.last_stats
            assert validate_arrays(batch.to_arrays(), TINY, policy, alloc.pool_blocks).ok
            if i == 0 or forms[i - 1] == "step":     # no baseline: every page fresh, no cell compared
                assert set(stats.compared.values()) == {0} and stats.fresh["csa_cmp"] > 0
            else:                                    # the last full-form commit is the baseline
                assert stats.compared["csa_cmp"] > 0
            if i in (3, 4):                          # right after persistent steps, and one full step later
                corrupt = _foreign_alias(batch)
                full = validate_arrays(corrupt, TINY, policy, alloc.pool_blocks)
                report, proposal = sv.propose(corrupt)
                assert not full.ok and report.issues == full.issues and proposal is None
                assert "isolation.foreign_write" in report.codes
                queue()                              # the real step again (the proposal of the first was dropped)
                again = builder.build()
                assert again == batch and sv.last_stats == stats
                batch = again
            builder.commit(batch)
        for rid in rids:
            pos[rid] += 150
