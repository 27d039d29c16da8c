"""The persistent form (spec 5.9): build_step().to_full() is build()'s batch exactly; from_full inverts it; the
allocator's persistent tables stay proven under every commit and release, and a mirror advanced by apply() equals
them; the incremental check agrees with the stateless one on valid steps and on every mutation (each reported
with its code by both); a step built against a recycled slot is refused."""

from __future__ import annotations

import functools
import hashlib
import json
import pickle
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.conformance import persistent as persistent_vectors
from dspark_abi.layout import POOL_NAMES
from dspark_abi.persistent import DeltaCells, PersistentStep, PersistentTables, check_step, from_full
from dspark_abi.presets import TINY, TINY_1M, TINY_DSPARK
from dspark_abi.upstream import to_upstream


def examples(n):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Loop:
    """A serving loop that builds every step twice, as a full batch and as a persistent step, from one queue."""

    def __init__(self, config, seed, *, tp=2, ring_width="step", max_new=300, blocks=4096):
        self.config, self.rng = config, np.random.default_rng(seed)
        self.alloc = BlockAllocator(config, PoolBlocks.uniform(blocks), capacity=2)
        self.builder = BatchBuilder(config, PaddingPolicy(tp_size=tp), self.alloc, ring_width=ring_width)
        self.max_new, self.live = max_new, {}

    def queue(self, seed):
        rng = np.random.default_rng(seed)
        ids = [i for i in range(6) if rng.random() < 0.6] or [0]
        for i in ids:
            c = self.live.get(i, 0)
            if c > 0 and self.config.dspark_block_size and rng.random() < 0.5:
                self.builder.add_verify(i, c, [7] * int(rng.integers(1, self.config.max_verify_width + 1)))
            else:
                n = int(rng.integers(1, self.max_new))
                self.builder.add(i, c, n, [k % 1000 for k in range(n)])

    def both(self):
        """(full batch, persistent step) of the next step, nothing committed."""
        seed = int(self.rng.integers(1 << 30))
        self.queue(seed)
        batch = self.builder.build()
        self.queue(seed)
        return batch, self.builder.build_step()

    def commit(self, step, after=None):
        req = step.requests
        accepted = np.where(req.verify_width > 0,
                            np.minimum(req.verify_width, self.rng.integers(1, 4, req.count)), req.commit_rows)
        self.builder.commit(step, accepted=accepted)
        if after is not None:
            after()
        for i in req.ids.tolist():
            self.live[i] = self.alloc.cached_tokens(i)
        if self.live and self.rng.random() < 0.25:
            gone = int(self.rng.choice(sorted(self.live)))
            self.alloc.release(gone)
            del self.live[gone]
            return gone
        return None


@pytest.mark.parametrize(("config", "ring_width", "max_new"), [
    (TINY, "step", 300), (TINY, "fixed", 300), (TINY_DSPARK, "step", 100), (TINY_1M, "step", 1000)])
def test_persistent_step_is_the_full_batch_and_tables_stay_proven(config, ring_width, max_new):
    loop = Loop(config, 3, ring_width=ring_width, max_new=max_new)
    mirror = PersistentTables.from_arrays(config, loop.alloc.pool_blocks, loop.alloc.persistent.to_arrays())
    for _ in range(25):
        batch, step = loop.both()
        tables = loop.alloc.persistent
        assert step.to_full(tables) == batch
        for p in POOL_NAMES:           # attrs equality compares values and dtypes; the widths too
            assert step.to_full(tables).tables[p].shape == batch.tables[p].shape
        assert from_full(batch, tables).to_full(tables) == batch
        assert check_step(step, tables).ok and check_step(step, tables, level="full").ok
        mirror.grow(tables.slots)
        mirror.apply(step)             # a device mirror advanced by the delta alone
        gone = loop.commit(step, after=functools.partial(_same, step, tables, batch))   # right after the commit too
        assert tables.prove() == []
        if gone is not None:
            mirror.release(int(np.flatnonzero(mirror.in_use & (mirror.holders == gone))[0]))
        for p in POOL_NAMES:
            np.testing.assert_array_equal(mirror.table(p), tables.table(p))
        np.testing.assert_array_equal(mirror.generations, tables.generations)


def test_persistent_step_carries_no_table_and_is_read_only():
    loop = Loop(TINY_1M, 5, max_new=2000)
    for _ in range(3):
        loop.commit(loop.both()[1])
    batch, step = loop.both()
    table_bytes = sum(t.nbytes for _, t in batch.tables.items())
    delta = sum(step.mapped[p].nbytes + step.released[p].nbytes for p in POOL_NAMES)
    assert step.nbytes == sum(a.nbytes for a in batch.to_arrays().values()) - table_bytes + delta + \
        step.table_slots.nbytes + step.slot_generations.nbytes + step.table_widths.nbytes
    for a in step.to_arrays().values():
        assert not a.flags.writeable
    view = loop.alloc.persistent.table("csa_cmp")
    with pytest.raises(ValueError):
        view[0, 0] = 1
    assert not loop.alloc.persistent.generations.flags.writeable


def test_to_upstream_goes_through_the_full_form():
    loop = Loop(TINY, 1)
    batch, step = loop.both()
    got, want = step.to_upstream(loop.alloc.persistent), to_upstream(batch)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def _same(step, tables, batch):
    assert step.to_full(tables) == batch


# ---------------------------------------------------------------------------------------------- mutations
def _set_cell(step, kind, pool, at, value):
    """``step`` with entry ``at`` of one pool's delta (``kind``: mapped or released) set to ``value``."""
    cells = getattr(step, kind)
    a = np.array(cells[pool])
    a[at] = value
    return attrs.evolve(step, **{kind: attrs.evolve(cells, **{pool: a})})


def _set(step, name, at, value):
    a = np.array(getattr(step, name))
    a[at] = value
    return attrs.evolve(step, **{name: a})


def _mutations(step, tables, rng):
    """(expected code, mutated step) for each mutation this step admits."""
    r = int(rng.integers(step.num_requests))
    slots = step.table_slots
    out = [("tables.stale_slot", _set(step, "slot_generations", r, step.slot_generations[r] + 1)),
           ("tables.slot", _set(step, "table_slots", r, tables.slots + 3))]
    if step.num_requests > 1:
        out.append(("tables.slot", _set(step, "table_slots", r, slots[(r + 1) % slots.size])))
    others = np.flatnonzero(tables.in_use & ~np.isin(np.arange(tables.slots), slots))
    if others.size:
        out.append(("tables.stale_slot", _set(step, "table_slots", r, others[0])))
    for p in POOL_NAMES:
        m = step.mapped[p]
        if m.shape[0]:
            k = int(rng.integers(m.shape[0]))
            held = tables.table(p)[tables.table(p) >= 0]
            held = held[~np.isin(held, step.released[p][:, 2])]     # a released block may be mapped again
            if held.size:
                out.append(("delta.mapped", _set_cell(step, "mapped", p, (k, 2), held[0])))
            out.append(("delta.mapped", _set_cell(step, "mapped", p, (k, 2), step.pool_blocks[p])))
            out.append(("delta.mapped", _set_cell(step, "mapped", p, (k, 1), -1)))
        rel = step.released[p]
        if rel.shape[0]:
            k = int(rng.integers(rel.shape[0]))
            out.append(("delta.released", _set_cell(step, "released", p, (k, 2), rel[k, 2] + 1)))
    row = int(rng.integers(step.num_tokens))
    for p in ("ori", "csa_state"):
        bumped = np.array(step.slots[p])
        bumped[row] += 1
        out.append(("slots.mismatch", attrs.evolve(step, slots=attrs.evolve(step.slots, **{p: bumped}))))
    return out


@examples(12)
@given(seed=st.integers(0, 2**20), steps=st.integers(1, 4), config=st.sampled_from([TINY, TINY_DSPARK]))
def test_incremental_agrees_with_full_on_mutated_steps(seed, steps, config):
    loop = Loop(config, seed, max_new=120)
    for _ in range(steps):
        loop.commit(loop.both()[1])
    _, step = loop.both()
    tables = loop.alloc.persistent
    before = {p: tables.table(p).copy() for p in POOL_NAMES}
    rng = np.random.default_rng(seed)
    for code, bad in _mutations(step, tables, rng):
        inc, full = check_step(bad, tables), check_step(bad, tables, level="full")
        assert not inc.ok and not full.ok, (code, inc, full)
        assert code in inc.codes and code in full.codes, (code, inc.codes, full.codes)
        with pytest.raises(ABIError):
            tables.copy().apply(bad)
    for p in POOL_NAMES:                 # checking changed nothing
        np.testing.assert_array_equal(before[p], tables.table(p))


def test_persistent_codes():
    loop = Loop(TINY, 11, max_new=40)
    step = None
    for _ in range(8):                   # until a step releases ring pages (requests past the window)
        step = loop.both()[1]
        if step.released["ori"].shape[0] and step.mapped["ori"].shape[0]:
            break
        loop.commit(step)
    tables = loop.alloc.persistent
    assert step is not None and step.released["ori"].shape[0] and step.mapped["ori"].shape[0]
    held = tables.table("ori")[tables.table("ori") >= 0]
    held = held[~np.isin(held, step.released["ori"][:, 2])]
    cases = {
        "tables.slot": _set(step, "table_slots", 0, tables.slots),
        "tables.stale_slot": _set(step, "slot_generations", 0, step.slot_generations[0] + 1),
        "delta.mapped": _set_cell(step, "mapped", "ori", (0, 2), held[0]),
        "delta.released": _set_cell(step, "released", "ori", (0, 2), step.released["ori"][0, 2] + 1),
    }
    for code, bad in cases.items():
        for level in ("incremental", "full"):
            assert code in check_step(bad, tables, level=level).codes, (code, level)


def test_step_built_against_a_recycled_slot_is_stale():
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(256))
    builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
    builder.add(0, 0, 40)
    builder.commit(builder.build_step())
    builder.add(0, 40, 8)
    step = builder.build_step()            # built against request 0's slot
    alloc.release(0)                       # the slot is recycled: generation advanced
    other = BatchBuilder(TINY, PaddingPolicy(), alloc)
    other.add(9, 0, 16)
    other.commit(other.build_step())       # request 9 now holds the slot
    report = check_step(step, alloc.persistent)
    assert report.codes == {"tables.stale_slot"}
    assert check_step(step, alloc.persistent, level="full").codes == {"tables.stale_slot"}
    # the public O(R) check a forward runs (PlanSource.of) gives exactly these issues
    assert alloc.persistent.current_issues(step) == list(report.issues)
    builder.add(0, 0, 8)                   # the request again, from scratch: a step built against the slots now
    assert alloc.persistent.current_issues(builder.build_step()) == []
    with pytest.raises(ABIError) as err:
        step.to_full(alloc.persistent)
    assert err.value.codes == {"tables.stale_slot"}


def test_loaded_tables_are_proven():
    loop = Loop(TINY, 2)
    for _ in range(3):
        loop.commit(loop.both()[1])
    arrays = {k: np.array(v) for k, v in loop.alloc.persistent.to_arrays().items()}
    assert PersistentTables.from_arrays(TINY, loop.alloc.pool_blocks, arrays).prove() == []
    table = arrays["ori_table"]
    slot, col = np.argwhere(table >= 0)[0]
    other = np.argwhere(table >= 0)[-1]
    table[slot, col] = table[tuple(other)]            # one block held by two cells
    with pytest.raises(ABIError) as err:
        PersistentTables.from_arrays(TINY, loop.alloc.pool_blocks, arrays)
    assert err.value.codes == {"tables.persistent"}


def test_step_from_arrays_round_trip_and_shape_errors():
    loop = Loop(TINY, 4)
    _, step = loop.both()
    arrays = step.to_arrays()
    again = PersistentStep.from_arrays(arrays, TINY, step.policy, step.pool_blocks, loop.alloc.persistent)
    assert again == step
    broken = dict(arrays) | {"table_slots": arrays["table_slots"].astype(np.int64)}
    with pytest.raises(ABIError) as err:
        PersistentStep.from_arrays(broken, TINY, step.policy, step.pool_blocks)
    assert err.value.codes == {"array.dtype"}
    assert isinstance(step.mapped, DeltaCells)


# ---------------------------------------------------------------------------------------------- persistent vectors
PERSISTENT_VECTORS = Path(__file__).resolve().parents[2] / "spec" / "v1" / "vectors-persistent"


def _persistent_entries():
    return json.loads((PERSISTENT_VECTORS / "index.json").read_text())["vectors"]


@pytest.mark.parametrize("entry", _persistent_entries(), ids=lambda e: e["file"])
def test_persistent_vector_verdicts(entry):
    path = PERSISTENT_VECTORS / entry["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
    inc, full, expected = persistent_vectors.judge(path)
    assert expected == entry["expected"]
    assert sorted(inc.codes) == sorted(full.codes) == entry["expected"]["codes"]
    assert inc.ok == full.ok == entry["expected"]["valid"]


def test_persistent_vectors_are_up_to_date(tmp_path):
    assert persistent_vectors.main([str(PERSISTENT_VECTORS), "--check"]) == 0
    listed = {e["file"] for e in _persistent_entries()}
    assert listed == {p.relative_to(PERSISTENT_VECTORS).as_posix() for p in PERSISTENT_VECTORS.rglob("*.safetensors")}
    codes = {c for e in _persistent_entries() for c in e["expected"]["codes"]}
    assert {"tables.slot", "tables.stale_slot", "delta.mapped", "delta.released"} <= codes


def test_add_verify_many_equals_add_verify_one_by_one():
    loop = Loop(TINY_DSPARK, 9, max_new=60)
    loop.commit(loop.both()[1])
    ids = sorted(loop.live)
    widths = [1 + i % TINY_DSPARK.max_verify_width for i in range(len(ids))]
    tokens = [list(range(3 * i, 3 * i + w)) for i, w in enumerate(widths)]
    for rid, tids in zip(ids, tokens, strict=True):
        loop.builder.add_verify(rid, loop.live[rid], tids)
    one_by_one = loop.builder.build()
    loop.builder.add_verify_many(ids, [loop.live[i] for i in ids], widths, [t for ts in tokens for t in ts])
    assert loop.builder.build() == one_by_one
    loop.builder.add_verify_many(ids, [loop.live[i] for i in ids], widths, None)
    with pytest.raises(ABIError) as err:
        loop.builder.build()
    assert err.value.codes == {"builder.request"}
    loop.builder.clear()
    loop.builder.add_many(ids, [loop.live[i] for i in ids], widths, logits="verify")    # not a verify form
    with pytest.raises(ABIError) as err:
        loop.builder.build()
    assert err.value.codes == {"builder.request"}


def test_flat_stores_stay_the_live_storage_through_growth_copy_and_pickle():
    """The seven tables and block-owner arrays are views of one flat store each (one numpy call reads or writes the
    cells of every pool): after the allocator grew its slots, in a copy and in a pickled round trip, every per-pool
    view is still the store's, the allocator's aliases are the tables' own, and the owners agree with the tables."""
    loop = Loop(TINY, 11)                     # capacity 2: the steps below grow the slots
    for _ in range(8):
        _, step = loop.both()
        loop.commit(step)
    alloc, tables = loop.alloc, loop.alloc.persistent
    assert tables.slots > 2
    assert alloc._tables is tables._tables and alloc._first is tables._first and alloc._end is tables._end
    copies = (tables, tables.copy(), pickle.loads(pickle.dumps(tables)))
    for t in copies:
        for p in POOL_NAMES:
            assert np.shares_memory(t._tables[p], t._flat) and np.shares_memory(t._owner[p], t._owners)
            assert np.shares_memory(t._first[p], t._runs) and np.shares_memory(t._end[p], t._runs)
            np.testing.assert_array_equal(t.table(p), tables.table(p))
            table, owner = t.table(p), t._owner[p]
            held = table >= 0
            expected = np.full(owner.size, -1, np.int32)
            expected[table[held]] = np.nonzero(held)[0]
            np.testing.assert_array_equal(owner, expected)
        assert t.prove() == []
    for a, b in ((copies[0], copies[1]), (copies[0], copies[2])):
        assert not np.shares_memory(a._flat, b._flat) and not np.shares_memory(a._owners, b._owners)
    assert copies[1].config is tables.config and copies[1].pool_blocks is tables.pool_blocks   # immutable: shared
    # a step built and committed after all this writes the allocator's live tables (the copies stay as they were)
    frozen = {p: copies[1].table(p).copy() for p in POOL_NAMES}
    _, step = loop.both()
    loop.commit(step)
    assert tables.prove() == []
    changed = [p for p in POOL_NAMES if not np.array_equal(tables.table(p), frozen[p])]
    assert changed, "the commit wrote no cell of the allocator's tables"
    for p in POOL_NAMES:
        np.testing.assert_array_equal(copies[1].table(p), frozen[p])
