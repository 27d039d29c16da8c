"""The kernels' structure: the two backends mirror each other stage for stage, pypto builds on the model layer
only, every shared fact has one home, and a batch's facts are derived once (the plan), not per layer or rank."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import dspark_kernels
from dspark_abi import ABIError, BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.layout import visible_entries, written_logical
from dspark_abi.presets import TINY

PACKAGE = Path(dspark_kernels.__file__).parent
#: The prefill attention stages: one module of this name in each backend.
STAGES = {"lowering", "projections", "paged", "window", "compressor", "indexer", "entry_rows", "sparse_attention",
          "o_proj", "attention", "backend"}
#: Modules of a backend that are not stages.
HELPERS = {"reference": {"__init__", "tiling"},
           "pypto": {"__init__", "_ops", "runtime", "isolate", "index_guard", "errors"}}
#: The rest of a layer (outside attention): stages of the Backend protocol beside the attention stages.
LAYER_STAGES = {"hyper_connections", "moe", "head"}
#: The DSpark drafter's own stages: one module per backend, registered by dspark_kernels.drafter (not in the
#: Backend protocol: only the drafter runs them).
DRAFTER_STAGES = {"draft_attention", "observe", "markov"}


def _modules(backend: str) -> set[str]:
    """The backend's module names, a stage's kernel submodules (``moe_gate`` beside ``moe``) folded into it."""
    stems = {p.stem for p in (PACKAGE / backend).glob("*.py")}
    return {next((s for s in stems if m.startswith(s + "_")), m) for m in stems}


def test_kernel_submodules_fold_into_their_stage():
    stems = {p.stem for p in (PACKAGE / "pypto").glob("*.py")}
    assert {"moe_gate", "moe_routed", "moe_shared"} <= stems
    assert "moe_gate" not in _modules("pypto") and "moe" in _modules("pypto")
    assert "o_proj" in _modules("pypto") and "sparse_attention" in _modules("pypto")


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def test_reference_and_pypto_have_the_same_stage_modules():
    reference = _modules("reference") - HELPERS["reference"]
    pypto = _modules("pypto") - HELPERS["pypto"]
    assert reference - LAYER_STAGES - DRAFTER_STAGES == STAGES
    assert pypto - LAYER_STAGES - DRAFTER_STAGES == STAGES
    assert pypto & LAYER_STAGES <= reference & LAYER_STAGES


def test_pypto_imports_the_model_layer_never_the_reference():
    for path, tree in _sources():
        if path.parent.name != "pypto":
            continue
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("dspark_kernels.reference") for n in names), (path.name, names)


@pytest.mark.parametrize("name", ["INDEX_RATIO", "OVERLAP_RATIO", "MASKED_SCORE", "MIN_COLUMNS", "MIN_ROW_BYTES",
                                  "INT8_AMAX_FLOOR", "INT8_MAX", "BACKENDS", "POOLS_BY_KIND", "PRECISION",
                                  "HC_K_SPLITS", "CUBE_MAD_K", "RMS_CHUNK"])
def test_each_shared_constant_has_one_definition(name):
    homes = [path.relative_to(PACKAGE) for path, tree in _sources() for node in tree.body
             if isinstance(node, ast.Assign | ast.AnnAssign)
             and name in [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                          if isinstance(t, ast.Name)]]
    assert len(homes) <= 1, homes


def test_the_ratio_constants_are_the_abi_pools_ratios():
    from dspark_kernels.model.geometry import INDEX_RATIO, OVERLAP_RATIO

    pools = TINY.layout.pools
    assert pools["idx"].ratio == INDEX_RATIO and pools["csa_cmp"].ratio == OVERLAP_RATIO


def test_no_kernel_module_rederives_row_ownership_or_visibility():
    """Row ownership is ``batch.row_request`` (via the plan) and the visible-entry formula is the ABI's: no
    ``.rank(r)`` view, no host-side ``lower_local_request_ids`` outside the pypto stage-1 checks, no ``(p + 1) //``."""
    for path, tree in _sources():
        where = path.relative_to(PACKAGE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert node.func.attr != "rank", where
            if isinstance(node, ast.ImportFrom) and str(where) != "pypto/lowering.py":
                assert "lower_local_request_ids" not in [a.name for a in node.names], where
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                left = node.left
                plus_one = (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Add)
                            and isinstance(left.right, ast.Constant) and left.right.value == 1)
                assert not plus_one, (where, ast.unparse(node))


# ---------------------------------------------------------------------------------------------- the backends
def _protocol_methods(protocol: type) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_"))


@pytest.mark.parametrize("protocol_name, classes", [
    ("Backend", [("dspark_kernels.reference.backend", "ReferenceBackend"),
                 ("dspark_kernels.pypto.backend", "PyptoBackend")]),
    ("AttentionStages", [("dspark_kernels.reference.attention", "ReferenceStages"),
                         ("dspark_kernels.pypto.attention", "PyptoStages")]),
])
def test_both_backends_implement_every_stage_with_the_protocols_signature(protocol_name, classes):
    import importlib
    import inspect

    from dspark_kernels.model import backends

    protocol = getattr(backends, protocol_name)
    methods = _protocol_methods(protocol)
    assert methods, protocol_name
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        for method in methods:  # identical parameters, defaults and annotations
            assert inspect.signature(getattr(cls, method)) == inspect.signature(getattr(protocol, method)), \
                (name, method)
    if protocol_name == "AttentionStages":
        assert all(isinstance(getattr(importlib.import_module(m), n).query_block, int) for m, n in classes)


def test_the_registry_resolves_every_backend_by_name():
    from dspark_kernels.model.backends import BACKENDS, REGISTRY, resolve_backend

    assert tuple(REGISTRY) == BACKENDS
    for name in BACKENDS:
        backend = resolve_backend(name, "a2a3")
        assert type(backend).__name__ == REGISTRY[name][1]
        assert type(backend).__module__ == REGISTRY[name][0]


def test_one_attention_orchestrator():
    """Only the model layer's ``run_attention`` calls the stages in order: no backend module calls two KV-side
    stages in one function (the hand-written orchestrators are gone)."""
    kv_side = {"shared_kv", "run_shared_kv", "compress", "compress_into", "compress_index_keys"}
    query_side = {"sparse_attention", "run_sparse_attention"}
    for path, tree in _sources():
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            called = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
                      for c in ast.walk(func) if isinstance(c, ast.Call)}
            both = bool(called & kv_side) and bool(called & query_side)
            assert not both or (path.name, func.name) == ("backends.py", "run_attention") or \
                (path.name, func.name) == ("backends.py", "_query_block"), (path.relative_to(PACKAGE), func.name)


# ---------------------------------------------------------------------------------------------- the plan
def _batch(tp: int):
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp), BlockAllocator(TINY, PoolBlocks.uniform(256)))
    for rid, new in enumerate((9, 0, 134, 3)):  # an empty request, boundaries of both ratios, padding rows
        builder.add(rid, num_cached=0, num_new=new)
    return builder.build()


@pytest.mark.parametrize("tp", [1, 4])
def test_plan_facts_come_from_the_batch(tp):
    from dspark_kernels.model.plan import BatchPlan

    batch = _batch(tp)
    for rank in [None, *range(tp)]:
        plan = BatchPlan.build(batch, rank=rank)
        assert plan.request is batch.row_request  # shared, not recomputed
        lo, hi = (0, batch.padded_rows) if rank is None else (rank * batch.local_rows, (rank + 1) * batch.local_rows)
        assert (plan.row_start, plan.row_stop) == (lo, hi)
        runs = plan.runs_in(lo, hi)
        owner = np.full(hi - lo, -1)
        for start, stop, r in runs:
            owner[start:stop] = r
        np.testing.assert_array_equal(owner, batch.row_request[lo:hi])
        assert all(stop > start for start, stop, _ in runs)
        live = batch.row_request >= 0
        for ratio, pool in ((4, "csa_cmp"), (128, "hca_cmp")):
            want = np.flatnonzero(live & (written_logical(TINY.layout.pools[pool], batch.positions) >= 0))
            np.testing.assert_array_equal(plan.boundaries[ratio], want)
            np.testing.assert_array_equal(plan.visible[ratio], np.where(live, visible_entries(batch.positions,
                                                                                              ratio), 0))
        assert plan.rope["csa"] is plan.rope["hca"]  # compressed kinds share one frequency table


def test_plan_refuses_a_rank_outside_the_group():
    from dspark_kernels.model.plan import BatchPlan

    with pytest.raises(ABIError) as err:
        BatchPlan.build(_batch(2), rank=2)
    assert err.value.codes == {"rank.index"}


def test_a_forward_builds_one_plan_and_prepares_each_layer_once(monkeypatch):
    from dspark_kernels.model import forward, prepared
    from dspark_kernels.model.caches import ModelCaches
    from dspark_kernels.model.plan import BatchPlan
    from dspark_kernels.model.weights import ModelWeights

    batch = _batch(1)
    plans, prepares = [], []
    build, prepare = BatchPlan.build, prepared.prepare_weights
    monkeypatch.setattr(BatchPlan, "build", classmethod(lambda cls, *a, **k: plans.append(1) or build(*a, **k)))
    monkeypatch.setattr(prepared, "prepare_weights", lambda w, p: prepares.append(w.layer) or prepare(w, p))
    weights = ModelWeights.random(TINY, 0)
    cache = prepared.PreparedWeightsCache()
    for _ in range(2):
        tokens = np.zeros(batch.padded_rows, np.int64)
        forward.run_forward(batch, tokens, weights, ModelCaches.allocate(TINY, batch.pool_blocks),
                            forward.ForwardOptions(prepared=cache))
    assert len(plans) == 2 and prepares == list(range(TINY.num_layers))  # the caller's cache is reused


@pytest.mark.parametrize("tp", [1, 4])
def test_plan_lookups_are_the_stage_lookups(tp):
    """The table lookups every layer reads (window rows, visible entry rows, compressor windows) are the plan's,
    equal to what the stages compute on bare arrays."""
    from dspark_kernels.model.geometry import window_state_rows
    from dspark_kernels.model.plan import BatchPlan
    from dspark_kernels.reference.entry_rows import visible_entry_rows
    from dspark_kernels.reference.window import window_rows

    batch = _batch(tp)
    pools, tables = TINY.layout.pools, batch.tables
    for rank in [None, *range(tp)]:
        plan = BatchPlan.build(batch, rank=rank)
        q = plan.query_rows
        pos, req = batch.positions[q], batch.row_request[q]
        np.testing.assert_array_equal(plan.window, window_rows(pos, req, tables["ori"], TINY.sliding_window))
        for pool, ratio in (("idx", 4), ("hca_cmp", 128)):
            want = visible_entry_rows(np.where(req >= 0, visible_entries(pos, ratio), 0), req, tables[pool])
            np.testing.assert_array_equal(plan.entry_rows[pool], want)
            np.testing.assert_array_equal(plan.entry_rows_in(pool, plan.row_start, plan.row_stop), want)
        for pool, ratio in (("csa_state", 4), ("csa_inner_state", 4), ("hca_state", 128)):
            b, rows = window_state_rows(batch.positions, batch.row_request, tables[pool], ratio,
                                        pools[pool].page_size)
            np.testing.assert_array_equal(plan.state_windows[pool].boundaries, b)
            np.testing.assert_array_equal(plan.state_windows[pool].rows, rows)


def test_kernels_read_block_tables_through_the_plan():
    """Every kernel table lookup is ``plan.tables[pool][plan.table_row[rows], column]``: no module reads a batch's
    ``.tables`` but the plan that copies them (and the pypto backend's index-range pre-check of a batch)."""
    readers = set()
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "tables" and "batch" in ast.unparse(node.value):
                readers.add(str(path.relative_to(PACKAGE)))
    assert readers == {"model/plan.py", "pypto/backend.py"}


#: Stage entry points whose arguments are grouped into value objects (the plan's CompressorState, IndexKeyPools,
#: RopeRows; IndexerWeights; ForwardOptions / RankContext), and the parameters each had before.
GROUPED = {("reference/compressor.py", "compress"): 14, ("reference/compressor.py", "compress_index_keys"): 15,
           ("pypto/compressor.py", "compress_into"): 14, ("pypto/indexer.py", "run_indexer"): 16,
           ("reference/indexer.py", "lightning_topk"): 10, ("model/forward.py", "run_forward"): 14}


def test_stage_entry_points_take_value_objects_not_long_parameter_lists():
    """No more than 9 parameters (``**deprecated`` of run_forward's earlier keywords counts as one)."""
    counts = {}
    for path, tree in _sources():
        for node in tree.body:
            key = (str(path.relative_to(PACKAGE)), getattr(node, "name", ""))
            if isinstance(node, ast.FunctionDef) and key in GROUPED:
                a = node.args
                extra = (a.vararg is not None) + (a.kwarg is not None)
                counts[key] = len(a.posonlyargs + a.args + a.kwonlyargs) + extra
    assert counts.keys() == GROUPED.keys()
    assert all(n <= 9 for n in counts.values()), counts


def test_no_kernel_module_imports_a_private_name_of_the_abi():
    """The kernels use the ABI through its public names (a private helper the kernels need gets a public one, e.g.
    ``PersistentTables.current_issues``): no ``from dspark_abi... import _name``."""
    private = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dspark_abi"):
                private += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert private == []


def test_no_kernel_module_keys_state_by_object_identity():
    """Per-plan state belongs to the plan: no module keeps a dict keyed by ``id(...)``."""
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "id", (path.relative_to(PACKAGE), ast.unparse(node))


def test_a_prefill_checks_its_caches_once(monkeypatch):
    from dspark_kernels.api import prefill
    from dspark_kernels.model.caches import ModelCaches
    from dspark_kernels.model.weights import ModelWeights

    batch = _batch(1)
    calls = []
    check = ModelCaches.issues_for
    monkeypatch.setattr(ModelCaches, "issues_for", lambda self, *a: calls.append(1) or check(self, *a))
    prefill(batch, np.full(batch.padded_rows, batch.policy.pad_token_id, np.int64), ModelWeights.random(TINY, 0),
            ModelCaches.allocate(TINY, batch.pool_blocks), layers=[0])
    assert len(calls) == 1
