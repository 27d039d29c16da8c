"""The constructors of both forms of a step keep their order: ``PackedBatch`` and ``PersistentStep`` are built
positionally by users' code, so the fields they share may move to one declaration only if every parameter keeps its
place, kind, default, converter and comparison. Pinned from the 1.3 order (before the shared fields got one home)."""

from __future__ import annotations

import inspect

import attrs
import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.batch import StepArrays
from dspark_abi.persistent import PersistentStep
from dspark_abi.presets import TINY

P, K = "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY"
#: (name, kind, has a default) of every constructor parameter, in order, as of ABI 1.3.
SIGNATURES = {
    PackedBatch: [
        ("config", P, False), ("policy", P, False), ("pool_blocks", P, False), ("query_start_loc", P, False),
        ("positions", P, False), ("tables", P, False), ("slots", P, False), ("request_ids", P, True),
        ("token_ids", P, True), ("logit_rows", P, True), ("verify_widths", P, True), ("logit_mode", P, True),
        ("requests", K, True)],
    PersistentStep: [
        ("config", P, False), ("policy", P, False), ("pool_blocks", P, False), ("query_start_loc", P, False),
        ("positions", P, False), ("slots", P, False), ("table_slots", P, False), ("slot_generations", P, False),
        ("table_widths", P, False), ("mapped", P, False), ("released", P, False), ("request_ids", P, False),
        ("token_ids", P, True), ("logit_rows", P, True), ("verify_widths", P, True), ("logit_mode", P, True),
        ("requests", K, True)],
}
#: Fields holding an ABI array: frozen on assignment (a converter) and compared by value (not by identity).
ARRAYS = {"query_start_loc", "positions", "request_ids", "token_ids", "logit_rows", "verify_widths", "logit_mode",
          "table_slots", "slot_generations", "table_widths"}


@pytest.mark.parametrize("cls", list(SIGNATURES), ids=lambda c: c.__name__)
def test_constructor_order_kinds_and_defaults_are_pinned(cls):
    got = [(p.name, p.kind.name, p.default is not inspect.Parameter.empty)
           for p in inspect.signature(cls).parameters.values()]
    assert got == SIGNATURES[cls]
    for f in attrs.fields(cls):
        assert (f.converter is not None) == (f.name in ARRAYS or f.name == "pool_blocks"), f.name
        assert (f.default is None) == any(d for n, _, d in SIGNATURES[cls] if n == f.name), f.name
        assert f.eq == (f.name != "requests"), f.name        # the request record is derived: not compared
        assert f.validator is None, f.name


def _both():
    alloc = BlockAllocator(TINY, pool_blocks_for(TINY, [80, 40]))
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2), alloc)
    builder.add(7, num_cached=0, num_new=30, token_ids=np.arange(30))
    builder.add(9, num_cached=0, num_new=5, token_ids=np.arange(5))
    step = builder.build_step()
    return step.to_full(alloc.persistent), step


def test_positional_construction_still_builds_both_forms():
    batch, step = _both()
    again = PackedBatch(*(getattr(batch, n) for n, kind, _ in SIGNATURES[PackedBatch] if kind == P))
    assert again == batch
    step_again = PersistentStep(*(getattr(step, n) for n, kind, _ in SIGNATURES[PersistentStep] if kind == P))
    assert step_again == step
    mine = np.array(step.positions)             # converters freeze a copy: the caller's array stays its own
    made = attrs.evolve(step, positions=mine)
    mine[0] += 1
    assert made.positions[0] == step.positions[0] and not made.positions.flags.writeable


def test_shared_fields_have_one_declaration():
    """The leading fields both forms share and their request record are declared once (StepArrays), inherited by
    both; so are the geometry and row ownership the kernels read (one formula)."""
    shared = ("config", "policy", "pool_blocks", "query_start_loc", "positions", "requests")
    assert tuple(f.name for f in attrs.fields(StepArrays)) == shared
    for name in shared:
        a, b = getattr(attrs.fields(PackedBatch), name), getattr(attrs.fields(PersistentStep), name)
        assert a.inherited and b.inherited, name
    for name in ("tp_size", "padded_rows", "num_requests", "num_tokens", "local_rows", "row_request"):
        assert name not in vars(PackedBatch) and name not in vars(PersistentStep), name
    batch, step = _both()
    np.testing.assert_array_equal(step.row_request, batch.row_request)
