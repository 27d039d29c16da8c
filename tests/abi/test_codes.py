"""One test per error code: each rule, broken once, is reported with its code, field and request."""

import ast
import pathlib

import numpy as np
import pytest

from dspark_abi import (
    CODES,
    ABIError,
    BatchBuilder,
    BlockAllocator,
    ModelConfig,
    PackedBatch,
    PaddingPolicy,
    PoolBlocks,
    validate,
)
from dspark_abi.lowering import lower_local_request_ids
from dspark_abi.presets import FLASH, TINY
from dspark_abi.ranks import split_rank_arrays
from dspark_abi.testing import MUTATIONS, mutate

#: Codes that only fixture-file reading raises; tests/spec covers them.
FILE_CODES = {c for c in CODES if c.startswith("fixture.")}


def _batch(tp=2, requests=((126, 3), (30, 4), (0, 9)), blocks=96, token_ids=True, **policy):
    """A built batch; ``requests`` are (num_cached, num_new) pairs, the order of ``BatchBuilder.add``."""
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=tp, **policy), BlockAllocator(TINY, PoolBlocks.uniform(blocks)))
    rng = np.random.default_rng(0)
    for rid, (cached, new) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new,
                    token_ids=rng.integers(0, TINY.vocab_size, new) if token_ids else None)
    return builder.build()


# several shapes of batch, so that every mutation has something to break
BATCHES = {
    "ragged3_tp2": lambda: _batch(),
    "ragged3_tp4": lambda: _batch(tp=4, requests=((200, 5), (31, 2), (3, 7))),
    "continue_pad": lambda: _batch(tp=4, requests=((140, 6), (0, 3)), pad_position="continue"),
}


@pytest.mark.parametrize("code", sorted(MUTATIONS))
def test_mutation_is_reported_with_its_code(code):
    hits = 0
    for name, make in BATCHES.items():
        batch = make()
        for seed in range(3):
            case = mutate(batch, code, seed)
            if case is None:
                continue
            report = validate(case.arrays, case.config, case.policy, case.pool_blocks, hidden=case.hidden)
            assert code in report.codes, (name, seed, str(report))
            issue = next(i for i in report.issues if i.code == code)
            assert issue.field and issue.message and issue.hint
            assert issue.count >= 1
            if case.hidden is None:
                with pytest.raises(ABIError) as err:  # constructors raise the same issues
                    PackedBatch.from_arrays(case.arrays, case.config, case.policy, case.pool_blocks)
                assert code in err.value.codes
            else:  # hidden rows are no batch field: the batch is fine, validate(batch, hidden=...) reports them
                batch_of_case = PackedBatch.from_arrays(case.arrays, case.config, case.policy, case.pool_blocks)
                assert code in validate(batch_of_case, hidden=case.hidden).codes
            hits += 1
    assert hits > 0, f"no batch could break {code}"


def test_issue_names_request_index_and_values():
    batch = _batch()
    arrays = {k: np.array(v) for k, v in batch.to_arrays().items()}
    arrays["ori_slot_mapping"][4] += 1  # request 1, second token (position 31)
    report = validate(arrays, TINY, batch.policy, batch.pool_blocks)
    issue = next(i for i in report.issues if i.code == "slots.mismatch")
    assert (issue.field, issue.index, issue.request) == ("ori_slot_mapping", 4, 1)
    assert issue.actual == issue.expected + 1
    assert "ori_slot_mapping[4] (request 1)" in str(issue)


def test_qsl_shape():
    batch = _batch()
    arrays = dict(batch.to_arrays(), query_start_loc=np.array([0], np.int32))
    assert "qsl.shape" in validate(arrays, TINY, batch.policy, batch.pool_blocks).codes
    arrays = dict(batch.to_arrays(), query_start_loc=np.zeros((2, 2), np.int32))
    assert "qsl.shape" in validate(arrays, TINY, batch.policy, batch.pool_blocks).codes


def test_qsl_empty_request_per_policy():
    batch = _batch(requests=((10, 3), (5, 0), (0, 2)))
    assert validate(batch).ok  # allowed by default
    strict = batch.policy.model_copy(update={"allow_empty_requests": False})
    report = validate(batch.to_arrays(), TINY, strict, batch.pool_blocks)
    issue = next(i for i in report.issues if i.code == "qsl.empty_request")
    assert issue.request == 1


def test_pools_blocks():
    batch = _batch()
    report = validate(batch.to_arrays(), TINY, batch.policy, {"ori": 0})
    assert report.codes == {"pools.blocks"}


def test_rank_index():
    with pytest.raises(ABIError) as err:
        _batch(tp=2).rank(2)
    assert err.value.codes == {"rank.index"}


def test_rank_replicated_and_local_mismatch():
    batch = _batch(tp=2)
    per = split_rank_arrays(batch.to_arrays(), batch.policy)
    per["ori_block_table"][1, 0, 0] += 1
    per["positions_local"][1, 2] += 7
    with pytest.raises(ABIError) as err:
        PackedBatch.from_rank_arrays(per, TINY, batch.policy, batch.pool_blocks)
    assert err.value.codes == {"rank.replicated_mismatch", "rank.local_mismatch"}


def test_rank_arrays_round_trip():
    batch = _batch(tp=4, requests=((200, 5), (31, 2), (3, 7)))
    per = split_rank_arrays(batch.to_arrays(), batch.policy)
    assert PackedBatch.from_rank_arrays(per, TINY, batch.policy, batch.pool_blocks) == batch


def test_config_invalid_names_every_missing_key():
    with pytest.raises(ABIError) as err:
        ModelConfig.from_hf_config({"hidden_size": 128})
    assert err.value.codes == {"config.invalid"}
    fields = {i.field for i in err.value.issues}
    assert {"config.json:head_dim", "config.json:compress_ratios", "config.json:n_routed_experts"} <= fields


def test_config_mismatch():
    with pytest.raises(ABIError) as err:
        BatchBuilder(TINY, PaddingPolicy(), BlockAllocator(FLASH, PoolBlocks.uniform(8)))
    assert err.value.codes == {"config.mismatch"}


def test_builder_request_errors_are_all_reported():
    builder = BatchBuilder(TINY, PaddingPolicy(), BlockAllocator(TINY, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=-1, num_new=3)
    builder.add(0, num_cached=0, num_new=2)
    builder.add(2, num_cached=TINY.max_position_embeddings, num_new=1)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.codes == {"builder.request"}
    assert [i.index for i in err.value.issues] == [0, 1, 2]


def test_builder_token_count():
    builder = BatchBuilder(TINY, PaddingPolicy(), BlockAllocator(TINY, PoolBlocks.uniform(64)))
    builder.add(0, num_cached=0, num_new=0)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.codes == {"qsl.token_count"}


def test_alloc_exhausted_changes_nothing():
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(4))
    builder = BatchBuilder(TINY, PaddingPolicy(), alloc)
    builder.add(0, num_cached=0, num_new=8)
    before = {p: alloc.free_blocks(p) for p in ("ori", "csa_state", "hca_state")}
    builder.add(1, num_cached=0, num_new=300)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.codes == {"alloc.exhausted"}
    assert {p: alloc.free_blocks(p) for p in before} == before
    assert not alloc.knows(0) and not alloc.knows(1)


def test_alloc_unknown_request():
    alloc = BlockAllocator(TINY, PoolBlocks.uniform(4))
    with pytest.raises(ABIError) as err:
        alloc.release(7)
    assert err.value.codes == {"alloc.unknown_request"}


def test_lowering_rejects_bad_qsl():
    with pytest.raises(ABIError) as err:
        lower_local_request_ids(np.array([0, 5, 3], np.int32), 0, 4)
    assert err.value.codes == {"qsl.non_monotonic"}


TESTED_HERE = set(MUTATIONS) | {
    "qsl.shape", "qsl.empty_request", "pools.blocks", "rank.index", "rank.replicated_mismatch",
    "rank.local_mismatch", "config.invalid", "config.mismatch", "builder.request", "alloc.exhausted",
    "alloc.unknown_request",
}

#: Codes whose test lives in another file, next to the feature that raises them: code -> (file, test function).
#: test_every_code_has_a_test checks that each function exists and names its code.
TESTED_ELSEWHERE = {
    "alloc.stale_plan": ("tests/abi/test_allocator_threads.py", "test_plan_made_stale_by_another_commit_is_refused"),
    "kernel.index_range": ("tests/pypto/test_pypto_index_guard.py",
                           "test_guard_flags_request_2049_of_an_8192_wide_table"),
    "upstream.shape": ("tests/abi/test_upstream.py", "test_signature_mismatch_is_upstream_shape"),
    "upstream.depth": ("tests/abi/test_upstream.py", "test_shallow_table_is_upstream_depth"),
    "upstream.past_span": ("tests/abi/test_upstream.py", "test_mapped_page_past_the_span"),
    "upstream.state_ring_overwrite": ("tests/abi/test_upstream.py",
                                      "test_shared_canonical_ring_holds_251_tokens_after_an_odd_start"),
    "capability.pool_size": ("tests/abi/test_capabilities.py",
                             "test_upstream_pool_sizes_at_and_below_the_canonical_ones"),
    "capability.index_overflow": ("tests/abi/test_capabilities.py",
                                  "test_int32_byte_offsets_name_the_first_overflowing_block"),
    "capability.table_depth": ("tests/abi/test_capabilities.py", "test_pypto_table_entries_in_fp32"),
    "capability.token_cap": ("tests/abi/test_capabilities.py", "test_upstream_token_cap_against_the_group_window"),
    "verify.width": ("tests/abi/test_verify.py", "test_validator_verify_rules"),
    "verify.drafts": ("tests/abi/test_verify.py", "test_a_step_without_drafts_is_a_verify_of_width_one_on_a_config_"
                      "without_dspark"),
    "verify.no_anchor": ("tests/abi/test_verify.py", "test_validator_refuses_a_verify_request_with_nothing_committed"),
    "verify.position_limit": ("tests/abi/test_verify.py", "test_builder_refuses_drafts_past_the_position_limit"),
    "verify.ring_headroom": ("tests/abi/test_verify.py", "test_validator_refuses_a_ring_narrower_than_the_headroom"),
    "logits.intent": ("tests/abi/test_verify.py", "test_validator_verify_rules"),
    "commit.accepted": ("tests/abi/test_verify.py", "test_commit_refuses_bad_accepted_counts_and_changes_nothing"),
    "tables.slot": ("tests/abi/test_persistent.py", "test_persistent_codes"),
    "tables.stale_slot": ("tests/abi/test_persistent.py", "test_step_built_against_a_recycled_slot_is_stale"),
    "tables.persistent": ("tests/abi/test_persistent.py", "test_loaded_tables_are_proven"),
    "delta.mapped": ("tests/abi/test_persistent.py", "test_persistent_codes"),
    "delta.released": ("tests/abi/test_persistent.py", "test_persistent_codes"),
    "tables.unapplied": ("tests/api/test_persistent_hot_path.py",
                         "test_a_forward_refuses_tables_without_the_steps_delta"),
    "drafter.config": ("tests/model/test_drafter.py", "test_a_config_without_a_drafter_is_refused"),
    "drafter.gap": ("tests/model/test_drafter.py", "test_observe_gap_and_unknown_request_change_nothing"),
    "drafter.unknown_request": ("tests/model/test_drafter.py", "test_observe_gap_and_unknown_request_change_nothing"),
    "drafter.unmapped": ("tests/model/test_drafter.py",
                         "test_rows_outside_the_ori_run_are_unmapped_and_change_nothing"),
}


def test_every_code_has_a_test():
    assert not TESTED_HERE & set(TESTED_ELSEWHERE)
    assert set(CODES) == TESTED_HERE | set(TESTED_ELSEWHERE) | FILE_CODES
    root = pathlib.Path(__file__).resolve().parents[2]
    for code, (path, name) in TESTED_ELSEWHERE.items():
        source = (root / path).read_text()
        func = next((n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        assert func is not None, (code, path, name)
        assert f'"{code}"' in ast.get_source_segment(source, func), (code, path, name)


def test_continue_padding_past_the_context_is_out_of_range():
    builder = BatchBuilder(TINY, PaddingPolicy(tp_size=4, pad_position="continue"),
                           BlockAllocator(TINY, PoolBlocks.uniform(600)))
    builder.add(0, num_cached=TINY.max_position_embeddings - 2, num_new=2)
    with pytest.raises(ABIError) as err:
        builder.build()
    assert err.value.codes == {"positions.out_of_range"}
    assert err.value.issues[0].index == 2  # the first padding row


def test_an_abi_error_pickles_with_its_issues_and_message():
    """Errors cross process boundaries (TP rank processes, pypto kernel processes): a pickled ABIError must come
    back with the same issues and the same message (the default exception pickling re-ran __init__ on the message
    string and rendered one issue per character)."""
    import pickle

    from dspark_abi import ABIError, Issue

    err = ABIError([Issue("drafter.gap", "positions", "rows must continue", index=1, request=7, expected=3,
                          actual=5, fix="observe every committed row once")])
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ABIError and back.issues == err.issues and str(back) == str(err)
