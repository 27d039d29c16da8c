"""Hypothesis strategies for users' own tests: valid packed batches and single-rule mutations.

Needs the ``test`` extra (hypothesis).

    from hypothesis import given
    from dspark_abi.testing import packed_batches, mutated_batches

    @given(packed_batches())
    def test_my_kernel_accepts(batch): ...

    @given(mutated_batches())
    def test_rejects(case):
        assert case.code in dspark_abi.validate(case.arrays, case.config, case.policy, case.pool_blocks,
                                                hidden=case.hidden).codes
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

from dspark_abi.allocator import BlockAllocator
from dspark_abi.batch import PackedBatch
from dspark_abi.builder import BatchBuilder
from dspark_abi.config import ModelConfig
from dspark_abi.fields import BATCH_FIELDS, SLOT_FIELDS, TABLE_FIELDS, FieldSpec
from dspark_abi.layout import POOL_NAMES, PoolName, table_column, touched_pages
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import PoolBlocks
from dspark_abi.presets import TINY

TP_SIZES = (1, 2, 4, 8)


@st.composite
def packed_batches(draw: st.DrawFn, config: ModelConfig = TINY, *, max_requests: int = 6,
                   max_new: int = 40, max_cached: int = 300, tp_sizes: tuple[int, ...] = TP_SIZES,
                   token_ids: bool | None = None) -> PackedBatch:
    """Valid batches: ragged lengths, zero-length requests, every TP size, requests crossing rank
    boundaries (any N), and chunk continuations (a request's later chunk reusing earlier tables).
    Block ids are scrambled by allocating and releasing decoy requests first."""
    tp = draw(st.sampled_from(tp_sizes))
    policy = PaddingPolicy(tp_size=tp, pad_position=draw(st.sampled_from(["zero", "continue"])))
    n_req = draw(st.integers(1, max_requests))
    news = draw(st.lists(st.integers(0, max_new), min_size=n_req, max_size=n_req).filter(lambda v: sum(v) > 0))
    cached = draw(st.lists(st.integers(0, max_cached), min_size=n_req, max_size=n_req))
    chunked = draw(st.lists(st.booleans(), min_size=n_req, max_size=n_req))
    with_ids = draw(st.booleans()) if token_ids is None else token_ids
    slack = draw(st.integers(8, 64))
    span = max_cached + max_new + 64  # the decoys' tokens too
    alloc = BlockAllocator(config, PoolBlocks(**{
        pl.name: (n_req + 3) * (span // pl.page_size + 2) + slack for pl in config.layout}))
    decoys = draw(st.integers(0, 3))
    if decoys:  # leave holes in the free lists so block ids are not simply ascending
        warm = BatchBuilder(config, PaddingPolicy(), alloc)
        for d in range(decoys):
            warm.add(10_000 + d, num_cached=draw(st.integers(0, 64)), num_new=draw(st.integers(1, 16)))
        warm.commit(warm.build())
        alloc.release(10_000 + draw(st.integers(0, decoys - 1)))
    builder = BatchBuilder(config, policy, alloc)
    first_chunk = [(i, c) for i, c in enumerate(cached) if chunked[i] and c > 0]
    if first_chunk:  # an earlier step of these requests: their tables exist before this batch
        for i, c in first_chunk:
            builder.add(i, num_cached=0, num_new=c)
        builder.commit(builder.build())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    for i in range(n_req):
        ids = rng.integers(0, config.vocab_size, news[i]) if with_ids else None
        builder.add(i, num_cached=cached[i], num_new=news[i], token_ids=ids)
    return builder.build()


@attrs.frozen
class MutatedBatch:
    """Flat arrays of a once-valid batch with exactly one rule broken; ``code`` must be reported.

    Attributes:
        code: The rule broken (a registered error code); validation must report it.
        arrays: The flat ABI arrays (writeable copies), one rule broken.
        config: The batch's model configuration.
        policy: The batch's padding policy.
        pool_blocks: The batch's pool block counts.
        hidden: Hidden rows to validate with (only for ``padding.hidden``), else None.
        note: Free text about the mutation.
    """

    code: str
    arrays: dict[str, np.ndarray]
    config: ModelConfig
    policy: PaddingPolicy
    pool_blocks: PoolBlocks
    hidden: np.ndarray | None = None
    note: str = ""


Arrays = dict[str, np.ndarray]
#: A mutation's extra validate() arguments ({} or {"hidden": ...}); None when the batch cannot break the rule.
Extra = dict[str, Any] | None
Mutator = Callable[[Arrays, PackedBatch, np.random.Generator], Extra]


def _requests_with(b: PackedBatch, min_len: int) -> np.ndarray:
    return np.flatnonzero(b.request_lengths >= min_len)


def _touched_pages(b: PackedBatch, pool: PoolName, r: int) -> np.ndarray:
    """Table columns of the logical pages of ``pool`` request ``r`` reads or writes in the call (in page order)."""
    start = b.request_starts[r:r + 1]
    pl = b.config.layout.pools[pool]
    _, pages = touched_pages(pl, start, start + b.request_lengths[r:r + 1], b.config.sliding_window)
    return np.asarray(table_column(pl, pages, b.tables[pool].shape[1]))


def _page_size(b: PackedBatch, pool: PoolName) -> int:
    return b.config.layout.pools[pool].page_size


def _m_qsl_start(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    a["query_start_loc"][0] = 1
    return {}


def _m_qsl_non_monotonic(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if b.num_requests < 2:
        return None
    a["query_start_loc"][1] = a["query_start_loc"][2] + 1
    return {}


def _m_qsl_token_count(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    a["query_start_loc"][-1] = b.policy.token_cap + 1
    return {}


def _declared(a: Arrays, rng: np.random.Generator, rows: tuple[str, ...] | None = None,
              required: bool = False) -> FieldSpec:
    """A random declared field the arrays carry (1-D with a leading ``rows`` symbol / required, when asked)."""
    pick = [f for f in BATCH_FIELDS if f.name in a and (rows is None or (f.ndim == 1 and f.shape[0] in rows))
            and (f.required or not required)]
    return pick[int(rng.integers(len(pick)))]


def _m_geometry_rows(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    f = _declared(a, rng, rows=("P", "R"))      # any declared per-row or per-request field, one entry too many
    a[f.name] = np.append(a[f.name], a[f.name][:1])
    return {}


def _m_dtype(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    f = _declared(a, rng)                       # any declared field, as the other integer width
    a[f.name] = a[f.name].astype(np.int64 if f.dtype == "int32" else np.int32)
    return {}


def _m_missing(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    del a[_declared(a, rng, required=True).name]
    return {}


def _m_shape(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    a["ori_slot_mapping"] = a["ori_slot_mapping"][:, None]
    return {}


def _m_request_count(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    f = TABLE_FIELDS[POOL_NAMES[int(rng.integers(7))]]
    a[f] = np.concatenate([a[f], np.full((1, a[f].shape[1]), -1, np.int32)])
    return {}


def _m_width(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    f = TABLE_FIELDS[POOL_NAMES[int(rng.integers(7))]]
    a[f] = a[f][:, :0]       # no column at all (a table wider than the layout's is the other way to break it)
    return {}


def _m_block_range(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    r = int(rng.choice(_requests_with(b, 1)))
    pages = _touched_pages(b, "ori", r)
    a["ori_block_table"][r, pages[-1]] = b.pool_blocks.ori
    return {}


def _m_negative(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    r = int(rng.choice(_requests_with(b, 1)))
    lo, hi = int(b.query_start_loc[r]), int(b.query_start_loc[r + 1])
    shift = int(b.request_starts[r]) + int(b.request_lengths[r])
    a["positions"][lo:hi] -= shift
    if hi == b.num_tokens and b.policy.pad_position == "continue":
        a["positions"][hi:] -= shift
    return {}


def _m_not_contiguous(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    cands = _requests_with(b, 2)
    if cands.size == 0:
        return None
    r = int(rng.choice(cands))
    a["positions"][int(b.query_start_loc[r])] += 2
    return {}


def _m_out_of_range(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    r = int(rng.choice(_requests_with(b, 1)))
    lo, hi = int(b.query_start_loc[r]), int(b.query_start_loc[r + 1])
    shift = b.config.max_position_embeddings
    a["positions"][lo:hi] += shift
    if hi == b.num_tokens and b.policy.pad_position == "continue":
        a["positions"][hi:] += shift
    return {}


def _m_pad_position(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if b.padded_rows == b.num_tokens:
        return None
    a["positions"][b.num_tokens] += 3
    return {}


def _m_pad_slot(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if b.padded_rows == b.num_tokens:
        return None
    a[SLOT_FIELDS[POOL_NAMES[int(rng.integers(7))]]][b.num_tokens] = 0
    return {}


def _m_pad_token(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if b.padded_rows == b.num_tokens or "token_ids" not in a:
        return None
    a["token_ids"][b.num_tokens] = b.policy.pad_token_id + 1
    return {}


def _m_pad_hidden(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if b.padded_rows == b.num_tokens:
        return None
    hidden = np.zeros((b.padded_rows, 4), np.float32)
    hidden[b.num_tokens:, 1] = 1.0
    return {"hidden": hidden}


def _m_slot_mismatch(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    t, ps = int(rng.integers(b.num_tokens)), _page_size(b, "ori")
    a["ori_slot_mapping"][t] = b.pool_blocks.ori * ps - 1 - a["ori_slot_mapping"][t] % ps
    return {}


def _m_off_boundary(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    pos = b.positions[: b.num_tokens]
    off = np.flatnonzero((pos + 1) % b.config.layout.pools["csa_cmp"].ratio != 0)
    if off.size == 0:
        return None
    a["csa_cmp_slot_mapping"][int(rng.choice(off))] = 0
    return {}


def _m_slot_range(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    a["hca_state_slot_mapping"][int(rng.integers(b.num_tokens))] = b.pool_blocks.hca_state * _page_size(b, "hca_state")
    return {}


def _m_duplicate(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if b.num_tokens < 2:
        return None
    i, j = rng.choice(b.num_tokens, 2, replace=False)
    a["csa_state_slot_mapping"][j] = a["csa_state_slot_mapping"][i]
    return {}


def _m_unmapped(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    r = int(rng.choice(_requests_with(b, 1)))
    pool = POOL_NAMES[int(rng.integers(7))]
    pages = _touched_pages(b, pool, r)
    if pages.size == 0:
        return None
    a[TABLE_FIELDS[pool]][r, int(rng.choice(pages))] = -1
    return {}


def _m_foreign(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    live = _requests_with(b, 1)
    if live.size < 2:
        return None
    writer, other = (int(x) for x in rng.choice(live, 2, replace=False))
    row = int(b.query_start_loc[writer])
    block = int(b.slots.ori[row]) // _page_size(b, "ori")
    page = int(rng.choice(_touched_pages(b, "ori", other)))
    a["ori_block_table"][other, page] = block
    return {}


def _m_alias(pool: PoolName) -> Mutator:
    def mutate(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
        for r in rng.permutation(_requests_with(b, 1)):
            pages = _touched_pages(b, pool, int(r))
            if pages.size >= 2:
                a[TABLE_FIELDS[pool]][r, pages[1]] = a[TABLE_FIELDS[pool]][r, pages[0]]
                return {}
        return None
    return mutate


def _m_logits(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if "logit_rows" not in a:
        return None
    a["logit_rows"][0] = b.num_tokens
    return {}


def _m_request_ids(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if b.num_requests < 2:
        return None
    a["request_ids"][1] = a["request_ids"][0]
    return {}


def _m_token_range(a: Arrays, b: PackedBatch, rng: np.random.Generator) -> Extra:
    if "token_ids" not in a:
        return None
    a["token_ids"][int(rng.integers(b.num_tokens))] = b.config.vocab_size
    return {}


#: code -> mutator breaking exactly that rule on a valid batch (returns None when not applicable).
MUTATIONS: dict[str, Mutator] = {
    "qsl.start": _m_qsl_start, "qsl.non_monotonic": _m_qsl_non_monotonic, "qsl.token_count": _m_qsl_token_count,
    "geometry.rows": _m_geometry_rows, "array.dtype": _m_dtype, "array.missing": _m_missing,
    "array.shape": _m_shape, "tables.request_count": _m_request_count, "tables.width": _m_width,
    "tables.block_range": _m_block_range, "positions.negative": _m_negative,
    "positions.not_contiguous": _m_not_contiguous, "positions.out_of_range": _m_out_of_range,
    "padding.position": _m_pad_position, "padding.slot": _m_pad_slot, "padding.token_id": _m_pad_token,
    "padding.hidden": _m_pad_hidden, "slots.mismatch": _m_slot_mismatch, "slots.off_boundary": _m_off_boundary,
    "slots.range": _m_slot_range, "writes.duplicate": _m_duplicate, "coverage.unmapped": _m_unmapped,
    "isolation.foreign_write": _m_foreign, "state.ring_alias": _m_alias("hca_state"),
    "tables.alias": _m_alias("ori"), "logits.range": _m_logits, "request_ids.duplicate": _m_request_ids,
    "token_ids.range": _m_token_range,
}


def mutate(batch: PackedBatch, code: str, seed: int = 0) -> MutatedBatch | None:
    """Break rule ``code`` of a valid batch (None when this batch cannot break it, e.g. no padding rows)."""
    arrays = {k: np.array(v) for k, v in batch.to_arrays().items()}
    extra = MUTATIONS[code](arrays, batch, np.random.default_rng(seed))
    if extra is None:
        return None
    return MutatedBatch(code, arrays, batch.config, batch.policy, batch.pool_blocks, extra.get("hidden"))


@st.composite
def mutated_batches(draw: st.DrawFn, config: ModelConfig = TINY, codes: tuple[str, ...] | None = None
                    ) -> MutatedBatch:
    """A valid batch with one rule broken; ``.code`` names the rule."""
    batch = draw(packed_batches(config, token_ids=True))
    code = draw(st.sampled_from(codes or tuple(MUTATIONS)))
    case = mutate(batch, code, draw(st.integers(0, 2**16)))
    if case is None:
        reject()  # this batch cannot break the rule: hypothesis draws another (like assume(False))
    return case
