"""Conformance vectors: deterministic, committed, complete, and passed by this library."""

import re
import shutil

import pytest

from dspark_abi import CODES, POOL_NAMES
from dspark_abi.cli.files import format_table
from dspark_abi.conformance import runner, vectors
from dspark_abi.io import fixtures

from .conftest import SPEC, VECTORS, entries_of, index_entries

#: Codes no fixture file can produce; the API tests in tests/abi/test_codes.py raise them.
API_ONLY_CODES = {"pools.blocks", "rank.index", "rank.replicated_mismatch", "rank.local_mismatch", "config.invalid",
                  "config.mismatch", "builder.request", "alloc.exhausted", "alloc.unknown_request",
                  "alloc.stale_plan", "kernel.index_range",
                  # raised by dspark_abi.upstream (upstream's tensor forms) and dspark_abi.capabilities (start-up
                  # checks of a kernel), never by validating a fixture file
                  "upstream.shape", "upstream.depth", "upstream.past_span", "upstream.state_ring_overwrite",
                  "capability.pool_size", "capability.index_overflow", "capability.table_depth",
                  # a rule of BatchBuilder.commit's arguments, not of a batch
                  "commit.accepted",
                  # rules of the persistent form (spec 5.9): its own vectors, spec/v1/vectors-persistent/
                  # (tests/abi/test_persistent.py), a full-form fixture cannot carry persistent tables
                  "tables.slot", "tables.stale_slot", "tables.persistent", "delta.mapped", "delta.released",
                  # a forward's check of the tables it reads a persistent step through (spec 8.11)
                  "tables.unapplied",
                  # the DSpark drafter's API (dspark_kernels.drafter), not a batch
                  "drafter.config", "drafter.gap", "drafter.unknown_request", "drafter.unmapped",
                  "capability.token_cap"}
#: Keep the committed vectors small enough for any checkout and the wheel (measured: 1.8 MB in 1.1, 3.8 MB in 1.0).
MAX_VECTOR_BYTES = 10 * 2**20


def test_committed_vectors_have_not_drifted():
    assert vectors.check(VECTORS) == [], "regenerate with: python -m dspark_abi.conformance.vectors spec/v1/vectors"


def test_generation_is_deterministic(tmp_path):
    vectors.generate(tmp_path / "a")
    vectors.generate(tmp_path / "b")
    a, b = vectors._listing(tmp_path / "a"), vectors._listing(tmp_path / "b")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_check_reports_changed_missing_and_stale_files(tmp_path):
    copy = tmp_path / "vectors"
    shutil.copytree(VECTORS, copy)
    target = copy / "valid" / "single_token.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    (copy / "invalid" / "qsl_start.safetensors").unlink()
    (copy / "hostile" / "leftover.safetensors").write_bytes(b"")
    problems = vectors.check(copy)
    assert "differs: valid/single_token.safetensors" in problems
    assert "missing: invalid/qsl_start.safetensors" in problems
    assert "stale (not generated): hostile/leftover.safetensors" in problems
    assert vectors.main([str(copy), "--check"]) == 1


def test_every_vector_passes_conformance():
    rows = runner.run(VECTORS)
    failed = [r for r in rows if not r.passed]
    assert not failed, format_table(failed)
    assert len(rows) == len(index_entries())


def test_conformance_detects_a_wrong_expectation(tmp_path):
    copy = tmp_path / "vectors"
    shutil.copytree(VECTORS, copy)
    index = (copy / "index.json").read_text()
    (copy / "index.json").write_text(index.replace('"qsl.start"', '"qsl.non_monotonic"', 1))
    rows = {r.file: r for r in runner.run(copy)}
    bad = rows["invalid/qsl_start.safetensors"]
    assert not bad.passed and bad.detail == "manifest expectation differs from the index"
    assert sum(not r.passed for r in rows.values()) == 1


def test_required_cases_exist():
    valid = {e["file"].removeprefix("valid/").removesuffix(".safetensors") for e in entries_of("valid")}
    assert len(valid) >= 12
    assert {"ragged2_tp2", "flash_single_8192_tp4", "many_short_tp4", "unaligned_tp2", "unaligned_tp4",
            "unaligned_tp8_idle_ranks", "cross_every_rank_tp8", "zero_length_requests", "chunk_continuation",
            "ratio4_boundaries", "ratio128_boundaries"} <= valid
    assert {"ring_past_one_turn", "ring_chunk_continuation", "ring_allocator_width", "ring_full_width_ori",
            "zero_length_tail",
            "full_width_flash16k", "flash_near_max_position", "dspark_target_layers"} <= valid  # 1.1
    invalid = {e["file"].removeprefix("invalid/").removesuffix(".safetensors") for e in entries_of("invalid")}
    assert {"tables_width", "tables_width_empty", "tables_width_ring_short", "tables_width_compressed_short",
            "slots_without_modulo"} <= invalid


def _load(name):
    return fixtures.load(VECTORS / f"valid/{name}.safetensors")


def test_valid_vectors_exercise_what_their_names_say():
    flash = _load("flash_single_8192_tp4")
    assert (flash.manifest.config.name, flash.batch.num_tokens, flash.batch.tp_size) == ("flash", 8192, 4)
    for name, tp in (("unaligned_tp2", 2), ("unaligned_tp4", 4), ("unaligned_tp8_idle_ranks", 8)):
        b = _load(name).batch
        assert b.tp_size == tp and b.num_tokens % tp != 0
    idle = _load("unaligned_tp8_idle_ranks").batch
    assert all((idle.rank(r).local_request_ids == -1).all() for r in (6, 7))
    crossing = _load("cross_every_rank_tp8").batch
    owners = {r: set(crossing.rank(r).local_request_ids.tolist()) for r in range(8)}
    assert all(1 in owners[r] for r in range(8))
    assert (_load("zero_length_requests").batch.request_lengths == 0).sum() >= 2
    chunk = _load("chunk_continuation").batch
    assert chunk.request_starts[0] == 200
    state = chunk.tables.csa_state[0]     # only the 54 live pages [192, 300) of 150: earlier ones were recycled
    assert state.size == 54 and (state >= 0).all() and len(set(state.tolist())) == 54
    for name, ratio in (("ratio4_boundaries", 4), ("ratio128_boundaries", 128)):
        b = _load(name).batch
        pos = b.positions[:b.num_tokens]
        assert ((pos + 1) % ratio == 0).any() and ((pos + 1) % ratio != 0).any()


def _width(loaded, pool):
    return loaded.batch.tables[pool].shape[1]


def test_deep_vectors_exercise_what_their_names_say():
    """The 1.1 vectors at 1,048,576 positions: the modulo matters, the runs wrap, the widths are what they say."""
    rings = ("ori", "csa_state", "csa_inner_state", "hca_state")
    turn = _load("ring_past_one_turn")
    assert turn.manifest.config.max_position_embeddings == 1_048_576
    assert turn.batch.request_starts.tolist() == [300_000, 20_000]
    ori_w = _width(turn, "ori")
    for pool, page_size, reach in (("ori", 32, 15), ("csa_state", 2, 8), ("hca_state", 8, 128)):
        width = _width(turn, pool)
        first, last = (300_000 - reach) // page_size, (300_039 // page_size)
        assert last >= 2 * width                                     # more than one ring turn
        assert first % width > last % width, pool                    # request 0's live run wraps to column 0
        assert width == max(last - first + 1, (20_004 // page_size) - (20_000 - reach) // page_size + 1)
    allocator = _load("ring_allocator_width")
    assert {p: _width(allocator, p) for p in rings} == {"ori": 258, "csa_state": 4101, "csa_inner_state": 4101,
                                                        "hca_state": 1041}
    assert all((allocator.batch.slots[p] == turn.batch.slots[p]).all() for p in POOL_NAMES)
    full_ori = _load("ring_full_width_ori")
    assert _width(full_ori, "ori") == 32768 and _width(full_ori, "csa_state") == _width(turn, "csa_state")
    assert int(full_ori.batch.tables.ori[0, 9375]) == int(turn.batch.tables.ori[0, 9375 % ori_w])
    assert all((full_ori.batch.slots[p] == turn.batch.slots[p]).all() for p in POOL_NAMES)
    cont = _load("ring_chunk_continuation").batch
    assert cont.request_starts.tolist() == [8192, 8250]
    ori = cont.tables.ori
    assert [int(ori[0, page % ori.shape[1]]) for page in range(256, 260)] == [0, 1, 2, 3]  # recycled blocks
    tail = _load("zero_length_tail").batch
    assert tail.query_start_loc.tolist() == [0, 5, 5, 5] and tail.tables.csa_cmp.shape[1] == 1
    full = _load("full_width_flash16k")
    assert full.manifest.config.name == "flash-16k"
    assert {p: t.shape[1] for p, t in full.batch.tables.items()} == {
        "ori": 512, "csa_cmp": 128, "hca_cmp": 4, "idx": 128, "csa_state": 8192, "csa_inner_state": 8192,
        "hca_state": 2048}
    near = _load("flash_near_max_position").batch
    assert near.config.name == "flash" and int(near.positions[near.num_tokens - 1]) == 1_048_575
    assert (near.tables.csa_cmp.shape[1], near.tables.hca_cmp.shape[1]) == (8192, 256)
    assert _load("dspark_target_layers").manifest.config.dspark_target_layers == (1, 3)


def test_full_width_vector_has_the_slots_of_the_builders_ring_form():
    """The 1.0 layout of a batch and the builder's ring layout of it address the same rows (the modulo is the
    identity at the full width)."""
    from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy
    from dspark_abi.presets import FLASH_16K

    full = _load("full_width_flash16k")
    builder = BatchBuilder(FLASH_16K, PaddingPolicy(tp_size=2), BlockAllocator(FLASH_16K, vectors.FLASH_POOLS))
    builder.add(0, 12_000, 100, full.batch.token_ids[:100])
    ring = builder.build()
    assert ring.tables.ori.shape[1] < full.batch.tables.ori.shape[1]
    assert all((ring.slots[p] == full.batch.slots[p]).all() for p in POOL_NAMES)


#: The slot formula restated by hand (spec section 5.2), independent of dspark_abi.layout: pool -> (page size,
#: ratio); ratio 0 = a ring pool (every token writes its position; column = page % the table's width), else a
#: compressed pool (ratio boundaries write entry (p+1)/ratio - 1; column = page).
_SLOT_FORMULA = {"ori": (32, 0), "csa_cmp": (32, 4), "hca_cmp": (32, 128), "idx": (32, 4), "csa_state": (2, 0),
                 "csa_inner_state": (2, 0), "hca_state": (8, 0)}


@pytest.mark.parametrize("entry", entries_of("valid"), ids=lambda e: e["file"])
def test_valid_vectors_follow_the_hand_written_slot_formula(entry):
    arrays = fixtures.read(VECTORS / entry["file"]).arrays
    qsl, positions = arrays["query_start_loc"].tolist(), arrays["positions"].tolist()
    for pool, (page_size, ratio) in _SLOT_FORMULA.items():
        table, slots = arrays[f"{pool}_block_table"], arrays[f"{pool}_slot_mapping"].tolist()
        width = table.shape[1]
        for r in range(len(qsl) - 1):
            for row in range(qsl[r], qsl[r + 1]):
                p = positions[row]
                if ratio and (p + 1) % ratio:
                    assert slots[row] == -1, (pool, row)
                    continue
                index = (p + 1) // ratio - 1 if ratio else p
                page = index // page_size
                column = page if ratio else page % width
                assert column < width, (pool, row)
                assert slots[row] == int(table[r, column]) * page_size + index % page_size, (pool, row)
        assert all(s == -1 for s in slots[qsl[-1]:]), pool


def test_invalid_vectors_break_exactly_one_rule():
    for entry in entries_of("invalid"):
        codes = entry["expected"]["codes"]
        if entry["file"] == "invalid/writes_duplicate.safetensors":
            assert codes == ["slots.mismatch", "writes.duplicate"]  # inseparable, see spec section 9
        elif entry["file"] == "invalid/verify_position_limit.safetensors":
            assert codes == ["positions.out_of_range", "verify.position_limit"]  # a row past MAXPOS is both
        else:
            assert len(codes) == 1, entry


def test_every_file_producible_code_has_a_vector():
    covered = {c for e in index_entries() for c in e["expected"]["codes"]}
    assert covered == set(CODES) - API_ONLY_CODES
    hostile_codes = {c for e in entries_of("hostile") for c in e["expected"]["codes"]}
    assert hostile_codes == {c for c in CODES if c.startswith("fixture.")}


def test_vectors_stay_small():
    total = sum(p.stat().st_size for p in VECTORS.rglob("*") if p.is_file())
    assert total < MAX_VECTOR_BYTES


def _example_block(name: str = "ragged2_tp2") -> dict[str, list[int]]:
    text = (SPEC / "abi.md").read_text()
    block = text.split(f"<!-- example:{name} -->", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    out = {}
    for line in block.strip().splitlines():
        m = re.fullmatch(r"(\w+) = \[(.*)\]", line.strip())
        assert m, line
        out[m.group(1)] = [int(x) for x in m.group(2).split(",")]
    return out


def test_spec_worked_example_matches_its_vector():
    example = _example_block()
    loaded = _load("ragged2_tp2")
    arrays = loaded.batch.to_arrays()
    for name, values in example.items():
        rank = re.fullmatch(r"rank(\d+)_local_request_ids", name)
        actual = loaded.batch.rank(int(rank.group(1))).local_request_ids if rank else arrays[name]
        assert actual.tolist() == values, name
    assert len(example) >= 12
    assert (loaded.batch.num_requests, loaded.batch.num_tokens, loaded.batch.padded_rows) == (2, 7, 8)


def test_spec_ring_example_matches_its_vector():
    example = _example_block("ring_past_one_turn")
    arrays = _load("ring_past_one_turn").batch.to_arrays()
    assert example["table_widths"] == [arrays[f"{p}_block_table"].shape[1] for p in POOL_NAMES]
    for row in (0, 3):
        assert example[f"row{row}_slots"] == [int(arrays[f"{p}_slot_mapping"][row]) for p in POOL_NAMES], row


@pytest.mark.parametrize("entry", entries_of("valid"), ids=lambda e: e["file"])
def test_valid_vectors_reencode_to_the_same_bytes(entry):
    path = VECTORS / entry["file"]
    loaded = fixtures.load(path)
    m = loaded.manifest
    data = fixtures.encode(loaded.batch.to_arrays(), config=m.config, policy=m.policy,
                           pool_blocks=m.pool_blocks.as_dict(), tensors=loaded.tensors, expected=m.expected,
                           name=m.name, description=m.description)
    if "request_ids" not in m.tensors:  # the batch fills in default ids; the file stores only what was given
        arrays = {k: v for k, v in loaded.batch.to_arrays().items() if k in m.tensors}
        data = fixtures.encode(arrays, config=m.config, policy=m.policy, pool_blocks=m.pool_blocks.as_dict(),
                               tensors=loaded.tensors, expected=m.expected, name=m.name, description=m.description)
    assert data == path.read_bytes()
