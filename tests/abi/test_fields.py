"""Every ABI field is declared once (dspark_abi.fields) and every consumer reads that declaration: the validator's
presence / dtype / rank / row checks, PackedBatch.from_arrays / to_arrays, the per-rank host form, upstream's tensor
names, the fixture manifest and the JSON Schema (the spec's table: tests/spec/test_field_table.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

import dspark_abi
from dspark_abi import ABI_VERSION, BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, PoolBlocks, validate
from dspark_abi.fields import BATCH_FIELDS, BY_NAME, FIELDS, SLOT_FIELDS, SLOT_SPECS, TABLE_FIELDS, TABLE_SPECS
from dspark_abi.io import fixtures
from dspark_abi.io.manifest import ABI_TENSORS, EXTRA_PREFIX, HIDDEN_TENSOR, OPTIONAL_TENSORS, REQUIRED_TENSORS
from dspark_abi.io.schema import build_schema
from dspark_abi.layout import POOL_NAMES
from dspark_abi.presets import TINY
from dspark_abi.ranks import LOCAL, REPLICATED, merge_rank_arrays, split_rank_arrays
from dspark_abi.upstream import UPSTREAM_TENSORS, from_upstream, to_upstream

REPO = Path(__file__).resolve().parents[2]


def _batch(tp=2):
    """A TP-2 batch carrying every optional field (request ids, token ids, logit rows) and padding rows."""
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp), BlockAllocator(TINY, PoolBlocks.uniform(64)))
    rng = np.random.default_rng(0)
    for rid, (cached, new) in enumerate(((0, 5), (0, 4))):
        builder.add(100 + rid, num_cached=cached, num_new=new, token_ids=rng.integers(0, TINY.vocab_size, new))
    batch = builder.build()
    assert batch.padded_rows > batch.num_tokens and batch.logit_rows is not None
    return batch


def test_the_declaration_is_one_list_of_unique_names():
    assert len(BY_NAME) == len(FIELDS)
    assert len({f.file_name for f in FIELDS}) == len(FIELDS)
    assert [f.name for f in BATCH_FIELDS] == [f.name for f in FIELDS if f.in_batch]
    # the pool families: one declaration per pool, in pool order, named as the containers are indexed
    assert list(TABLE_SPECS) == list(SLOT_SPECS) == list(POOL_NAMES)
    assert all(f.pool == p and f.family == "tables" for p, f in TABLE_SPECS.items())
    assert all(f.pool == p and f.family == "slots" for p, f in SLOT_SPECS.items())
    assert {p: f"{p}_block_table" for p in POOL_NAMES} == TABLE_FIELDS
    assert {p: f"{p}_slot_mapping" for p in POOL_NAMES} == SLOT_FIELDS
    # required fields come first: a fixture's canonical order is required then optional, both in ABI order
    flags = [f.required for f in BATCH_FIELDS]
    assert flags == sorted(flags, reverse=True)
    for f in FIELDS:
        assert f.dtype == "floating" or np.dtype(f.dtype).name == f.dtype
        assert f.scope in ("replicated", "rank_local")
        assert (1, 0) <= tuple(map(int, f.since.split("."))) <= tuple(map(int, ABI_VERSION.split(".")))
        assert f.meaning and f.padding_doc
        # a field with a padding value has a row axis of P; one without has none
        assert (f.padding is not None) == (f.shape[0] == "P"), f.name


def test_to_arrays_and_from_arrays_carry_exactly_the_declared_fields():
    batch = _batch()
    arrays = batch.to_arrays()
    assert list(arrays) == [f.name for f in BATCH_FIELDS]          # every field, in ABI order
    for f in BATCH_FIELDS:
        a = arrays[f.name]
        assert a.dtype == np.dtype(f.dtype) and a.ndim == f.ndim, f.name
        rows = {"P": batch.padded_rows, "R": batch.num_requests, "R+1": batch.num_requests + 1}.get(f.shape[0])
        assert rows is None or a.shape[0] == rows, f.name
    again = PackedBatch.from_arrays(arrays, batch.config, batch.policy, batch.pool_blocks)
    assert again == batch
    bare = {k: v for k, v in arrays.items() if BY_NAME[k].required}
    assert list(PackedBatch.from_arrays(bare, batch.config, batch.policy, batch.pool_blocks).to_arrays()) == \
        [f.name for f in BATCH_FIELDS if f.required] + ["request_ids"]   # ids default to 0..R-1


@pytest.mark.parametrize("name", [f.name for f in BATCH_FIELDS])
def test_the_validator_checks_each_fields_declared_dtype_and_presence(name):
    batch = _batch()
    spec = BY_NAME[name]
    arrays = dict(batch.to_arrays())
    wrong = np.float32 if spec.dtype != "float32" else np.int32
    arrays[name] = arrays[name].astype(wrong)
    report = validate(arrays, batch.config, batch.policy, batch.pool_blocks)
    issue = next(i for i in report.issues if i.code == "array.dtype")
    assert (issue.field, issue.expected, issue.actual) == (name, spec.dtype, np.dtype(wrong).name)
    del arrays[name]
    report = validate(arrays, batch.config, batch.policy, batch.pool_blocks)
    assert ("array.missing" in report.codes) == spec.required
    if not spec.required:
        assert report.ok


@pytest.mark.parametrize("name", [f.name for f in BATCH_FIELDS if f.ndim == 1 and f.shape[0] in ("P", "R")])
def test_the_validator_checks_the_declared_row_count(name):
    batch = _batch()
    arrays = dict(batch.to_arrays())
    arrays[name] = np.concatenate([arrays[name], arrays[name][:1]])
    report = validate(arrays, batch.config, batch.policy, batch.pool_blocks)
    assert any(i.code == "geometry.rows" and i.field == name for i in report.issues), str(report)


def test_the_per_rank_form_follows_each_fields_scope():
    batch = _batch()
    tp = batch.tp_size
    per_rank = split_rank_arrays(batch.to_arrays(), batch.policy)
    for f in BATCH_FIELDS:
        if f.scope == "replicated":
            assert f.per_rank_name in REPLICATED and per_rank[f.per_rank_name].shape[0] == tp
        else:    # rank-local: only its [TP, L] slices
            assert f.per_rank_name not in per_rank and f.local is not None
        if f.local is not None:
            assert LOCAL[f.local] == f.per_rank_name
            assert per_rank[f.local].shape == (tp, batch.local_rows)
    assert set(per_rank) == set(REPLICATED) | set(LOCAL)
    assert merge_rank_arrays(per_rank, batch.policy).keys() == batch.to_arrays().keys()
    assert PackedBatch.from_rank_arrays(per_rank, batch.config, batch.policy, batch.pool_blocks) == batch
    for r in range(tp):     # the rank view holds the rank-local fields' slices
        view = batch.rank(r)
        assert np.array_equal(view.token_ids, per_rank["token_ids_local"][r])
        assert np.array_equal(view.positions, per_rank["positions_local"][r])


def test_upstream_names_come_from_the_declaration():
    declared = {f.upstream for f in BATCH_FIELDS if f.upstream} | {f.upstream_local for f in BATCH_FIELDS
                                                                    if f.upstream_local}
    assert set(UPSTREAM_TENSORS) == declared
    batch = _batch()
    tensors = to_upstream(batch)
    for name, (dtype, _) in UPSTREAM_TENSORS.items():
        owner = next(f for f in BATCH_FIELDS if name in (f.upstream, f.upstream_local))
        assert tensors[name].dtype == dtype == np.dtype(owner.dtype)
    back = from_upstream(tensors, batch.config, batch.policy, batch.pool_blocks, request_ids=batch.request_ids)
    assert back.to_arrays().keys() == batch.to_arrays().keys()


def test_manifest_and_schema_list_the_declared_tensors(tmp_path):
    assert tuple(f.name for f in BATCH_FIELDS if f.required) == REQUIRED_TENSORS
    assert tuple(f.name for f in BATCH_FIELDS if not f.required) == OPTIONAL_TENSORS
    assert BY_NAME["hidden"].file_name == HIDDEN_TENSOR and HIDDEN_TENSOR.startswith(EXTRA_PREFIX)
    schema = build_schema()
    assert schema["x-dspark-fields"] == [f.as_json() for f in FIELDS]
    names = schema["properties"]["tensors"]["propertyNames"]["anyOf"]
    assert names[0]["enum"] == list(ABI_TENSORS)
    assert names[1]["pattern"] == "^extra\\..+"
    # a fixture round trip stores every declared field under its declared name, with the declared dtype
    batch = _batch()
    hidden = np.zeros((batch.padded_rows, 4), np.float32)
    path = fixtures.save(tmp_path / "b.safetensors", batch, tensors={"hidden": hidden})
    stored = fixtures.read(path)
    tensors = stored.manifest.tensors
    assert set(tensors) == {f.file_name for f in FIELDS}       # (the manifest's keys are sorted)
    for f in FIELDS:
        info = tensors[f.file_name]
        assert f.dtype == "floating" or info.dtype == f.dtype
        assert len(info.shape) == f.ndim
    assert fixtures.load(path).batch == batch
    assert json.loads(stored.manifest.canonical_json())["tensors"].keys() == tensors.keys()


def test_field_spec_is_frozen():
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        BY_NAME["positions"].dtype = "int64"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- a new field
#: The two hand edits that add an optional [R] field (the value rules, codes and docs of a real field come on top).
NEW_FIELD_DECLARATION = '''    FieldSpec("draft_counts", "int32", ("R",), None, "replicated", False, "1.1",
              "drafted rows of each request (hypothetical)", "–"),
'''
NEW_FIELD_ATTRIBUTE = '''    draft_counts: np.ndarray | None = _afield("draft_counts", True)
'''
NEW_FIELD_CHECKS = '''
import json, sys
from pathlib import Path
import numpy as np
from dspark_abi import BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy, PoolBlocks, validate
from dspark_abi.io import fixtures, schema, spec_table
from dspark_abi.presets import TINY
from dspark_abi.ranks import split_rank_arrays

tmp = Path(sys.argv[1])
builder = BatchBuilder(TINY, PaddingPolicy(tp_size=2), BlockAllocator(TINY, PoolBlocks.uniform(64)))
builder.add(7, num_cached=0, num_new=5)
builder.add(8, num_cached=0, num_new=4)
batch = builder.build()
arrays = batch.to_arrays() | {"draft_counts": np.array([3, 0], np.int32)}
new = PackedBatch.from_arrays(arrays, batch.config, batch.policy, batch.pool_blocks)
assert new.draft_counts.tolist() == [3, 0] and list(new.to_arrays())[-1] == "draft_counts"
per_rank = split_rank_arrays(new.to_arrays(), new.policy)
assert per_rank["draft_counts"].shape == (2, 2)
assert PackedBatch.from_rank_arrays(per_rank, new.config, new.policy, new.pool_blocks) == new
assert new.rank(1).positions.size == new.local_rows
assert fixtures.load(fixtures.save(tmp / "new.safetensors", new)).batch == new
codes = lambda **kw: validate(arrays | kw, batch.config, batch.policy, batch.pool_blocks).codes
assert codes() == set()
assert codes(draft_counts=np.array([3, 0], np.int64)) == {"array.dtype"}
assert codes(draft_counts=np.array([3, 0, 1], np.int32)) == {"geometry.rows"}
assert schema.main([str(tmp / "abi.schema.json")]) == 0
doc = json.loads((tmp / "abi.schema.json").read_text())
assert "draft_counts" in doc["properties"]["tensors"]["propertyNames"]["anyOf"][0]["enum"]
assert "draft_counts" in [f["name"] for f in doc["x-dspark-fields"]]
assert spec_table.main([str(tmp / "abi.md")]) == 0
assert "| `draft_counts` (optional) | [R] | int32 | replicated | 1.1 |" in (tmp / "abi.md").read_text()
print("ok")
'''


def test_a_new_optional_request_field_is_one_declaration_and_one_attribute(tmp_path):
    """In a copy of the package: declare an optional [R] field and give PackedBatch its attribute; nothing else
    is edited. from_arrays / to_arrays, the per-rank form, fixture files, the validator's dtype and row checks,
    the JSON Schema and the spec's table then carry it (its value rules would be the only further code)."""
    src = Path(dspark_abi.__file__).parent
    copy = tmp_path / "pkg" / "dspark_abi"
    shutil.copytree(src, copy, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "spec_v1"))
    for name, anchor, text in (("fields.py", '    FieldSpec("hidden", "floating"', NEW_FIELD_DECLARATION),
                               ("batch.py", '    logit_rows: np.ndarray | None = _afield("logit_rows", True)\n',
                                NEW_FIELD_ATTRIBUTE)):
        source = (copy / name).read_text()
        assert source.count(anchor) == 1, name
        at = source.index(anchor) + (len(anchor) if name == "batch.py" else 0)
        (copy / name).write_text(source[:at] + text + source[at:])
    (tmp_path / "abi.md").write_text((REPO / "spec" / "v1" / "abi.md").read_text())
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "pkg"))
    # cwd: python -c puts it first on sys.path, and the copy must shadow the checkout
    done = subprocess.run([sys.executable, "-c", NEW_FIELD_CHECKS, str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr
