"""Deterministic generator of the conformance vectors (``python -m dspark_abi.conformance.vectors DIR [--check]``).

Three kinds, one file each: ``valid/`` batches built by :class:`BatchBuilder` (two of them re-laid by hand to
other table widths: the allocator's ring width and the full 1.0 width); ``invalid/`` batches that break exactly
one rule of a valid base (expected codes stated by hand, never computed by the validator; the geometry they need
is restated here, not taken from :mod:`dspark_abi.layout`); ``hostile/`` files that are not readable fixtures.
``index.json`` lists every file with its expected outcome and SHA-256. The bytes depend only on this module (no
randomness, no clock), so ``--check`` can compare a fresh generation byte for byte with the committed files.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import attrs
import numpy as np

from dspark_abi.allocator import BlockAllocator
from dspark_abi.batch import PackedBatch
from dspark_abi.builder import BatchBuilder
from dspark_abi.config import ModelConfig
from dspark_abi.conformance.hostile import hostile_files
from dspark_abi.conformance.runner import INDEX_NAME
from dspark_abi.io.fixtures import encode
from dspark_abi.io.manifest import FORMAT_VERSION, Expectation
from dspark_abi.io.safe_write import write_bytes, write_text
from dspark_abi.policy import PaddingPolicy
from dspark_abi.presets import DEMO, FLASH, FLASH_16K, TINY, TINY_1M

INDEX_FORMAT = "dspark.conformance_index"
KINDS = ("valid", "invalid", "hostile")
VALID = Expectation(valid=True)
#: Pools big enough for every TINY/DEMO vector (file size does not depend on them).
SMALL_POOLS = {"ori": 256, "csa_cmp": 64, "hca_cmp": 32, "idx": 64, "csa_state": 1024, "csa_inner_state": 1024,
               "hca_state": 1024}
#: FLASH, one 8192-token chunk from position 0: 256 ori pages, 64 cmp/idx pages, 4096/1024 state pages.
FLASH_POOLS = {"ori": 512, "csa_cmp": 128, "hca_cmp": 4, "idx": 128, "csa_state": 4100,
               "csa_inner_state": 4100, "hca_state": 1040}
#: Pools for the 1,048,576-position vectors (TINY_1M, FLASH): the compressed history of a request at position
#: p needs ceil(p / 128) csa_cmp and idx pages, an 8192-token chunk 4101 ratio-4 state pages.
DEEP_POOLS = {"ori": 1024, "csa_cmp": 8300, "hca_cmp": 300, "idx": 8300, "csa_state": 8300,
              "csa_inner_state": 8300, "hca_state": 2100}

# The table geometry restated by hand for the vectors derived from builder output below (the oracle does not
# call dspark_abi.layout): ring pools (page size, positions read back before a chunk; None = the window, W - 1)
# address page i in column i % (the table's column count); compressed pools (ratio) use column = page, 32 entries
# a page.
_RING_POOLS: dict[str, tuple[int, int | None]] = {
    "ori": (32, None), "csa_state": (2, 8), "csa_inner_state": (2, 8), "hca_state": (8, 128)}
_COMPRESSED_POOLS: dict[str, int] = {"csa_cmp": 4, "hca_cmp": 128, "idx": 4}


def _spans(arrays: dict[str, np.ndarray]) -> list[tuple[int, int]]:
    """(first position, one past the last) of each request, from query_start_loc and positions."""
    qsl, pos = arrays["query_start_loc"].tolist(), arrays["positions"]
    return [(int(pos[a]), int(pos[a]) + b - a) if b > a else (0, 0) for a, b in itertools.pairwise(qsl)]


def _ring_pages(config: ModelConfig, pool: str, s: int, e: int) -> range:
    """Logical pages of ring pool ``pool`` that a request with new positions [s, e) reads or writes."""
    page, reach = _RING_POOLS[pool]
    lo = max(0, s - (config.sliding_window - 1 if reach is None else reach))
    return range(lo // page, (e - 1) // page + 1) if e > s else range(0)


def _full_width(config: ModelConfig, pool: str) -> int:
    """The 1.0 table width: pages covering every position below max_position_embeddings."""
    m = config.max_position_embeddings
    if pool in _RING_POOLS:
        return -(-m // _RING_POOLS[pool][0])
    entries = -(-m // _COMPRESSED_POOLS[pool])
    return -(-entries // 32)


def _rewidth(config: ModelConfig, arrays: dict[str, np.ndarray], widths: dict[str, int]) -> dict[str, np.ndarray]:
    """Copy of ``arrays`` with the named block tables re-laid to ``widths`` columns: each live page's block
    moves from its column in the old table to its column in the new one; every other entry is -1."""
    out = dict(arrays)
    spans = _spans(arrays)
    for pool, width in widths.items():
        field = f"{pool}_block_table"
        old = arrays[field]
        new = np.full((old.shape[0], width), -1, np.int32)
        if pool in _COMPRESSED_POOLS:       # column = page: keep the columns both tables have
            keep = min(width, old.shape[1])
            new[:, :keep] = old[:, :keep]
        else:
            for r, (s, e) in enumerate(spans):
                for page in _ring_pages(config, pool, s, e):
                    new[r, page % width] = old[r, page % old.shape[1]]
        out[field] = new
    return out


@attrs.frozen(eq=False)
class Vector:
    """One conformance vector before it is written.

    Attributes:
        name: Path below the vectors directory without suffix, e.g. ``valid/ragged2_tp2``.
        description: What the vector exercises.
        config: Model configuration of the batch.
        policy: Padding policy of the batch.
        pool_blocks: Pool -> block count.
        arrays: The flat ABI arrays stored.
        extras: Optional tensors stored as ``extra.<name>``.
        expected: The outcome validation must produce.
    """

    name: str
    description: str
    config: ModelConfig
    policy: PaddingPolicy
    pool_blocks: dict[str, int]
    arrays: dict[str, np.ndarray]
    extras: dict[str, np.ndarray]
    expected: Expectation


#: One builder step: (request id, num_cached, num_new) per request, the argument order of BatchBuilder.add.
Step = list[tuple[int, int, int]]


def _token_ids(rid: int, cached: int, new: int, vocab: int) -> np.ndarray:
    return (np.arange(cached, cached + new, dtype=np.int64) * 7919 + rid * 104729) % vocab


def build(config: ModelConfig, policy: PaddingPolicy, steps: list[Step], pools: dict[str, int] = SMALL_POOLS,
          *, token_ids: bool = True) -> PackedBatch:
    """Run the builder over ``steps`` (chunked prefill: a later step continues earlier requests); last batch."""
    alloc = BlockAllocator(config, pools)
    batch = None
    for step in steps:
        builder = BatchBuilder(config, policy, alloc)
        for rid, cached, new in step:
            builder.add(rid, cached, new, _token_ids(rid, cached, new, config.vocab_size) if token_ids else None)
        batch = builder.build()
        builder.commit(batch)
    if batch is None:
        raise ValueError("build() needs at least one step")
    return batch


def _valid(name: str, description: str, batch: PackedBatch, extras: dict[str, np.ndarray] | None = None,
           drop: tuple[str, ...] = ()) -> Vector:
    arrays = {k: v for k, v in batch.to_arrays().items() if k not in drop}
    return Vector(f"valid/{name}", description, batch.config, batch.policy, batch.pool_blocks.as_dict(), arrays,
                  extras or {}, VALID)


def _hidden(rows: int, live: int) -> np.ndarray:
    """[P, 2, 4] float32 stand-in for x_hc: deterministic live rows, zero padding rows."""
    h = (np.arange(rows * 8, dtype=np.float32).reshape(rows, 2, 4) % 13 - 6) / 8
    h[live:] = 0
    return h


def valid_vectors() -> Iterator[Vector]:
    tp = PaddingPolicy
    ragged2 = build(DEMO, tp(tp_size=2), [[(0, 126, 3), (1, 30, 4)]])
    yield _valid("ragged2_tp2", "The worked example of spec/v1/abi.md section 3: 3 tokens after 126 cached and 4 after "
                 "30 on DEMO, TP 2 (N=7, P=8, L=4); request 1 crosses the rank boundary.", ragged2,
                 {"hidden": _hidden(8, 7)})
    yield _valid("single_token", "One request of one token at position 0, TP 1: P = N, no padding row.",
                 build(TINY, tp(), [[(0, 0, 1)]]))
    yield _valid("flash_single_8192_tp4", "FLASH, one request of N = 8192 = token_cap new tokens from position 0, "
                 "TP 4 (L = 2048).", build(FLASH, tp(tp_size=4), [[(0, 0, 8192)]], FLASH_POOLS))
    short = [(i, (i * 37) % 300, (i * 5) % 7 + 1) for i in range(24)]
    yield _valid("many_short_tp4", "24 short requests (1..7 tokens) after varied cached prefixes, TP 4.",
                 build(TINY, tp(tp_size=4), [short]))
    yield _valid("unaligned_tp2", "N = 13 on TP 2: P = 14, one padding row.", build(TINY, tp(tp_size=2),
                 [[(0, 0, 5), (1, 40, 8)]]))
    yield _valid("unaligned_tp4", "N = 13 on TP 4: P = 16, three padding rows.", build(TINY, tp(tp_size=4),
                 [[(0, 10, 6), (1, 0, 7)]]))
    yield _valid("unaligned_tp8_idle_ranks", "N = 17 on TP 8: P = 24, L = 3; ranks 6 and 7 own only padding rows.",
                 build(TINY, tp(tp_size=8), [[(0, 0, 9), (1, 64, 8)]]))
    yield _valid("cross_every_rank_tp8", "Requests of 1, 30, 1 tokens on TP 8 (L = 4): request 1 crosses all "
                 "seven rank boundaries.", build(TINY, tp(tp_size=8), [[(0, 5, 1), (1, 100, 30), (2, 7, 1)]]))
    yield _valid("zero_length_requests", "Zero-length requests first, in the middle and last (one with a cached "
                 "prefix); they own no row and their logit row is -1.",
                 build(TINY, tp(tp_size=2), [[(0, 0, 0), (1, 10, 3), (2, 50, 0), (3, 0, 4), (4, 0, 0)]]))
    yield _valid("chunk_continuation", "Third step of chunked prefill: request 0 continues at 200 after chunks of "
                 "100; state-ring pages below start - state_len were recycled.",
                 build(TINY, tp(tp_size=2), [[(0, 0, 100), (1, 0, 20)], [(0, 100, 100)], [(0, 200, 100), (2, 0, 5)]]))
    yield _valid("prefix_hit_one_token", "Prefix-cache hit with a one-token tail (1000 cached) next to a fresh "
                 "request, DEMO TP 4.", build(DEMO, tp(tp_size=4), [[(0, 1000, 1), (1, 0, 9)]]))
    ratio4 = [(0, 2, 1), (1, 3, 1), (2, 4, 1), (3, 4, 4), (4, 127, 1), (5, 131, 1), (6, 126, 6)]
    yield _valid("ratio4_boundaries", "Tokens just before, on and after ratio-4 boundaries ((p+1) % 4 == 0), "
                 "entries 31 and 32 on both sides of a compressed page.", build(TINY, tp(), [ratio4]))
    ratio128 = [(0, 126, 4), (1, 255, 1), (2, 383, 2), (3, 127, 1), (4, 0, 128)]
    yield _valid("ratio128_boundaries", "Ratio-128 boundaries at 127, 255 and 383 inside, at the end of and alone "
                 "in requests, TP 2.", build(TINY, tp(tp_size=2), [ratio128]))
    yield _valid("pad_continue_tp4", "Policy pad_position='continue': padding rows continue the last live "
                 "position.", build(TINY, tp(tp_size=4, pad_position="continue"), [[(0, 0, 3), (1, 20, 2)]]))
    yield _valid("near_max_position", "A request ending at max_position_embeddings - 1 (last table columns).",
                 build(TINY, tp(tp_size=2), [[(0, 0, 3), (1, 4090, 6)]]))
    yield _valid("required_fields_only", "Only the 16 required tensors (no request_ids, token_ids, logit_rows).",
                 build(TINY, tp(tp_size=2), [[(0, 0, 3)]], token_ids=False),
                 drop=("request_ids", "token_ids", "logit_rows"))
    drafter = TINY.model_copy(update={"dspark_target_layers": (1, 3)})
    yield _valid("dspark_target_layers", "A config carrying the 1.1 manifest key dspark_target_layers (the DSpark "
                 "drafter's target layers, here 1 and 3 of TINY).", build(drafter, tp(), [[(0, 0, 3)]]))
    yield from deep_vectors()


def _widths(arrays: dict[str, np.ndarray], pools: Iterable[str]) -> str:
    """'ori 3, csa_state 24, ...': the column counts of the named tables (for descriptions)."""
    return ", ".join(f"{p} {arrays[f'{p}_block_table'].shape[1]}" for p in pools)


def _ring_width(config: ModelConfig, pool: str) -> int:
    """The ring width BlockAllocator keeps, restated: pages of reach + 8192 positions, plus one, at most K_p."""
    page, reach = _RING_POOLS[pool]
    reach = config.sliding_window - 1 if reach is None else reach
    return min(_full_width(config, pool), -(-(reach + 8192) // page) + 1)


def deep_vectors() -> Iterator[Vector]:
    """Valid batches at the real depth, 1,048,576 positions (1.1): ring tables, trimmed compressed tables."""
    tp = PaddingPolicy
    rings, compressed = tuple(_RING_POOLS), tuple(_COMPRESSED_POOLS)
    turn = build(TINY_1M, tp(tp_size=2), [[(0, 300_000, 40), (1, 20_000, 5)]], DEEP_POOLS).to_arrays()
    ori_w = turn["ori_block_table"].shape[1]
    past = _valid_arrays("ring_past_one_turn", "TINY_1M (1,048,576 positions), TP 2: 40 tokens after 300,000 cached "
                         f"and 5 after 20,000 (beyond 16,384). Ring tables as narrow as the step allows "
                         f"({_widths(turn, rings)}): ori page 9375 sits in column 9375 % {ori_w} = {9375 % ori_w} "
                         "and request 0's live runs wrap from the last column to column 0; compressed tables trimmed "
                         f"to the widest live range ({_widths(turn, compressed)}).", TINY_1M, tp(tp_size=2),
                         DEEP_POOLS, turn)
    yield past
    allocator = {pool: _ring_width(TINY_1M, pool) for pool in rings}
    wide = _rewidth(TINY_1M, past.arrays, allocator)
    yield attrs.evolve(past, name="valid/ring_allocator_width", arrays=wide, description="valid/ring_past_one_turn "
                       f"with its ring tables laid out at the allocator's ring width ({_widths(wide, rings)}): ori "
                       f"page 9375 in column {9375 % allocator['ori']}; other columns, the same blocks and slots (the "
                       "modulus is each table's own column count).")
    k_ori = _full_width(TINY_1M, "ori")
    yield attrs.evolve(past, name="valid/ring_full_width_ori", arrays=_rewidth(TINY_1M, past.arrays, {"ori": k_ori}),
                       description=f"valid/ring_past_one_turn with ori_block_table at the full 1.0 width ({k_ori} "
                       "columns: page 9375 in column 9375, the modulo is the identity) next to the narrow tables of "
                       "the other pools: each table has its own width.")
    cont = build(TINY_1M, tp(tp_size=2), [[(0, 0, 8192)], [(0, 8192, 100), (1, 8250, 90)]], DEEP_POOLS)
    yield _valid("ring_chunk_continuation", "TINY_1M, TP 2, second step of chunked prefill: request 0 continues at "
                 "8192 after an 8192-token chunk; its ori pages 256..259 reuse the blocks of pages 0..3, recycled when "
                 "they left the window, and pages 258 and 259 wrap to columns 0 and 1 of the allocator's 258-column "
                 f"ring; request 1 has 90 tokens after 8250 ({_widths(cont.to_arrays(), rings)} columns).", cont)
    zero = build(TINY_1M, tp(tp_size=2), [[(0, 100, 5), (1, 300_000, 0), (2, 0, 0)]], DEEP_POOLS).to_arrays()
    yield _valid_arrays("zero_length_tail", "TINY_1M, TP 2: two zero-length requests at the tail (query_start_loc "
                        "[0, 5, 5, 5]), one with 300,000 cached tokens: they do not widen any table "
                        f"({_widths(zero, (*rings, *compressed))}), their rows are unspecified.", TINY_1M,
                        tp(tp_size=2), DEEP_POOLS, zero)
    full = build(FLASH_16K, tp(tp_size=2), [[(0, 12_000, 100)]], FLASH_POOLS)
    widths = {pool: _full_width(FLASH_16K, pool) for pool in (*rings, *compressed)}
    laid = _rewidth(FLASH_16K, full.to_arrays(), widths)
    yield _valid_arrays("full_width_flash16k", "FLASH_16K, TP 2, 100 tokens after 12,000: the builder's batch with "
                        f"every table at the full 1.0 width ({_widths(laid, (*rings, *compressed))}; page j in column "
                        "j), as a 1.0 writer lays it out: the ring modulo is the identity, the slots are unchanged.",
                        FLASH_16K, tp(tp_size=2), FLASH_POOLS, laid)
    near = build(FLASH, tp(tp_size=2), [[(0, 1_048_000, 576)]], DEEP_POOLS).to_arrays()
    yield _valid_arrays("flash_near_max_position", "FLASH (1,048,576 positions), TP 2: 576 tokens after 1,048,000 "
                        "cached, ending at max_position_embeddings - 1: the compressed tables need every page "
                        f"({_widths(near, compressed)}), the ring tables only the live range ({_widths(near, rings)}).",
                        FLASH, tp(tp_size=2), DEEP_POOLS, near)


def _valid_arrays(name: str, description: str, config: ModelConfig, policy: PaddingPolicy, pools: dict[str, int],
                  arrays: dict[str, np.ndarray]) -> Vector:
    return Vector(f"valid/{name}", description, config, policy, dict(pools), dict(arrays), {}, VALID)


def _invalid(base: Vector, name: str, codes: tuple[str, ...], description: str,
             edit: Callable[[dict[str, np.ndarray]], None] = lambda a: None, *,
             policy: PaddingPolicy | None = None, extras: dict[str, np.ndarray] | None = None) -> Vector:
    arrays = {k: v.copy() for k, v in base.arrays.items()}
    edit(arrays)
    return Vector(f"invalid/{name}", description, base.config, policy or base.policy, base.pool_blocks, arrays,
                  base.extras if extras is None else extras, Expectation(valid=False, codes=tuple(sorted(codes))))


def invalid_vectors(valid: dict[str, Vector]) -> Iterator[Vector]:
    """Mutations of ragged2 (DEMO, blocks: ori request 0 reads pages 0..4, writes 3..4) and of others."""
    b = valid["valid/ragged2_tp2"]
    ori = b.arrays["ori_block_table"]
    n_ori = b.pool_blocks["ori"]

    def put(field: str, index: tuple[int, ...] | int, value: int) -> Callable[[dict[str, np.ndarray]], None]:
        def edit(a: dict[str, np.ndarray]) -> None:
            a[field][index] = value
        return edit

    def replace(field: str, value: np.ndarray | None) -> Callable[[dict[str, np.ndarray]], None]:
        def edit(a: dict[str, np.ndarray]) -> None:
            if value is None:
                del a[field]
            else:
                a[field] = value
        return edit

    qsl = b.arrays["query_start_loc"]
    yield _invalid(b, "qsl_shape", ("qsl.shape",), "query_start_loc is 2-D [1, R+1].",
                   replace("query_start_loc", qsl.reshape(1, -1)))
    yield _invalid(b, "qsl_start", ("qsl.start",), "query_start_loc[0] = 1.", put("query_start_loc", 0, 1))
    yield _invalid(b, "qsl_non_monotonic", ("qsl.non_monotonic",), "query_start_loc = [0, 8, 7].",
                   put("query_start_loc", 1, 8))
    yield _invalid(b, "qsl_token_count", ("qsl.token_count",), "N = 7 exceeds the policy's token_cap = 4.",
                   policy=b.policy.model_copy(update={"token_cap": 4}))
    z = valid["valid/zero_length_requests"]
    yield _invalid(z, "qsl_empty_request", ("qsl.empty_request",), "Zero-length requests under a policy with "
                   "allow_empty_requests = false.", policy=z.policy.model_copy(update={"allow_empty_requests": False}))
    yield _invalid(b, "geometry_rows", ("geometry.rows",), "positions has P + 1 rows.",
                   replace("positions", np.zeros(9, np.int32)))
    yield _invalid(b, "array_missing", ("array.missing",), "ori_slot_mapping is absent.",
                   replace("ori_slot_mapping", None))
    yield _invalid(b, "array_dtype", ("array.dtype",), "positions stored as int64.",
                   replace("positions", b.arrays["positions"].astype(np.int64)))
    yield _invalid(b, "array_shape", ("array.shape",), "positions is [P, 1].",
                   replace("positions", b.arrays["positions"].reshape(-1, 1)))
    yield _invalid(b, "tables_request_count", ("tables.request_count",), "hca_cmp_block_table has R + 1 rows.",
                   replace("hca_cmp_block_table", np.vstack([b.arrays["hca_cmp_block_table"]] * 2)[:3]))
    hca = b.arrays["hca_cmp_block_table"]
    wide = _full_width(b.config, "hca_cmp") + 1
    yield _invalid(b, "tables_width", ("tables.width",), f"hca_cmp_block_table has {wide} columns, one more than "
                   "DEMO's full width (the pages of every position below max_position_embeddings).",
                   replace("hca_cmp_block_table", np.hstack([hca, np.full((2, wide - hca.shape[1]), -1, np.int32)])))
    yield _invalid(b, "tables_width_empty", ("tables.width",), "hca_cmp_block_table has no column (fewer than 1).",
                   replace("hca_cmp_block_table", hca[:, :0]))
    yield _invalid(b, "tables_block_range", ("tables.block_range",), "Request 0's window page 0 maps to block "
                   "pool_blocks (one past the last).", put("ori_block_table", (0, 0), n_ori))
    yield _invalid(b, "tables_block_range_negative", ("tables.block_range",), "Request 0's window page 0 is -2.",
                   put("ori_block_table", (0, 0), -2))
    yield _invalid(b, "tables_alias", ("tables.alias",), "Request 0's window pages 0 and 1 map to one block.",
                   put("ori_block_table", (0, 1), int(ori[0, 0])))
    yield _invalid(b, "coverage_unmapped", ("coverage.unmapped",), "Request 0's window page 0 (read, not "
                   "written) is unmapped.", put("ori_block_table", (0, 0), -1))
    yield _invalid(b, "isolation_foreign_write", ("isolation.foreign_write",), "Request 0's window page 0 maps to "
                   "the block request 1 writes positions 32..33 into.", put("ori_block_table", (0, 0), int(ori[1, 1])))
    st = b.arrays["csa_state_block_table"]
    sw = st.shape[1]
    yield _invalid(b, "state_ring_alias", ("state.ring_alias",), "Request 0's csa_state history page 59 (positions "
                   f"118..119, column 59 % {sw}) shares a block with page 60 (column 60 % {sw}).",
                   put("csa_state_block_table", (0, 59 % sw), int(st[0, 60 % sw])))
    yield _invalid(b, "positions_negative", ("positions.negative",), "Request 1 starts at position -1.",
                   replace("positions", np.array([126, 127, 128, -1, 0, 1, 2, 0], np.int32)))
    yield _invalid(b, "positions_not_contiguous", ("positions.not_contiguous",), "Request 0 skips position 128.",
                   put("positions", 2, 129))
    last = b.config.max_position_embeddings - 1
    yield _invalid(b, "positions_out_of_range", ("positions.out_of_range",), f"Request 1 runs from {last} past "
                   f"max_position_embeddings = {last + 1}.",
                   replace("positions", np.array([126, 127, 128, last, last + 1, last + 2, last + 3, 0], np.int32)))
    yield _invalid(b, "padding_position", ("padding.position",), "Padding row 7 has position 1 under "
                   "pad_position = 'zero'.", put("positions", 7, 1))
    end = valid["valid/near_max_position"]
    yield _invalid(end, "padding_position_out_of_range", ("positions.out_of_range",), "Policy pad_position = "
                   "'continue' after a request ending at 4095: the padding row would take position 4096.",
                   put("positions", 9, 4096), policy=end.policy.model_copy(update={"pad_position": "continue"}))
    yield _invalid(b, "padding_slot", ("padding.slot",), "Padding row 7 writes hca_state row 5.",
                   put("hca_state_slot_mapping", 7, 5))
    yield _invalid(b, "padding_token_id", ("padding.token_id",), "Padding row 7 has token id 3 (pad id 0).",
                   put("token_ids", 7, 3))
    hidden = b.extras["hidden"].copy()
    hidden[7, 0, 0] = 1.0
    yield _invalid(b, "padding_hidden", ("padding.hidden",), "Padding row 7 of extra.hidden is not zero.",
                   extras={"hidden": hidden})
    yield _invalid(b, "token_ids_range", ("token_ids.range",), "Row 4 has token id vocab_size.",
                   put("token_ids", 4, b.config.vocab_size))
    yield _invalid(b, "logits_range", ("logits.range",), "logit_rows = [2, 7] and N = 7.", put("logit_rows", 1, 7))
    yield _invalid(b, "request_ids_duplicate", ("request_ids.duplicate",), "Both requests have serving id 7.",
                   replace("request_ids", np.array([7, 7], np.int64)))
    page3 = int(ori[0, 3]) * 32
    yield _invalid(b, "slots_mismatch", ("slots.mismatch",), "Row 0 (position 126) writes offset 0 of its page "
                   "instead of offset 30.", put("ori_slot_mapping", 0, page3))
    cmp0 = int(b.arrays["csa_cmp_block_table"][0, 0]) * 32
    yield _invalid(b, "slots_off_boundary", ("slots.off_boundary",), "Row 0 (position 126, (p+1) % 4 != 0) writes "
                   "csa_cmp entry 5 of its own page.", put("csa_cmp_slot_mapping", 0, cmp0 + 5))
    yield _invalid(b, "slots_range", ("slots.range",), "Row 3 writes ori row pool_blocks * 32.",
                   put("ori_slot_mapping", 3, n_ori * 32))
    yield _invalid(b, "writes_duplicate", ("slots.mismatch", "writes.duplicate"), "Row 1 writes the ori row of row "
                   "0 (a duplicate write is always also a slot/table mismatch or an alias).",
                   put("ori_slot_mapping", 1, int(b.arrays["ori_slot_mapping"][0])))
    bad_hidden = b.extras["hidden"].astype(np.int32)
    yield _invalid(b, "hidden_dtype", ("array.dtype",), "extra.hidden stored as int32.", extras={"hidden": bad_hidden})
    yield from deep_invalid_vectors(valid)


def deep_invalid_vectors(valid: dict[str, Vector]) -> Iterator[Vector]:
    """Mutations of valid/ring_past_one_turn (TINY_1M; request 0: positions 300,000..300,039)."""
    d = valid["valid/ring_past_one_turn"]
    state = d.arrays["csa_state_block_table"]

    def cut(field: str, width: int) -> Callable[[dict[str, np.ndarray]], None]:
        def edit(a: dict[str, np.ndarray]) -> None:
            a[field] = np.ascontiguousarray(a[field][:, :width])
        return edit

    need = len(_ring_pages(d.config, "csa_state", 300_000, 300_040))        # pages 149996..150019
    yield _invalid(d, "tables_width_ring_short", ("tables.width",), f"csa_state_block_table cut from "
                   f"{state.shape[1]} to {need - 1} columns, one fewer than the {need} pages of request 0's live "
                   "range [299992, 300040): the ring would wrap onto itself.", cut("csa_state_block_table", need - 1))
    last_page = (300_040 // 4 - 1) // 32                                    # entries [0, 75010): page 2344
    yield _invalid(d, "tables_width_compressed_short", ("tables.width",), f"csa_cmp_block_table trimmed to "
                   f"{last_page} columns: request 0's last live page, {last_page}, is not in the table.",
                   cut("csa_cmp_block_table", last_page))

    # A writer of request 0 whose page, read without the modulo (its offset in the live run, as in a table that
    # starts at the run's first page), names another column holding a page the call only reads: its slot then
    # lands on a row no token of the call writes, so the only fault is the slot formula.
    hca_w = d.arrays["hca_state_block_table"].shape[1]
    run = _ring_pages(d.config, "hca_state", 300_000, 300_040)             # pages 37484..37504
    written = range(300_000 // 8, (300_040 - 1) // 8 + 1)
    row, position, page, column, target = next(
        (k, p, p // 8, p // 8 - run.start, q) for k, p in enumerate(range(300_000, 300_040))
        for q in run if p // 8 - run.start < hca_w and (p // 8 - run.start) % hca_w != (p // 8) % hca_w
        and q % hca_w == p // 8 - run.start and q not in written)

    def window_relative(a: dict[str, np.ndarray]) -> None:
        a["hca_state_slot_mapping"][row] = int(a["hca_state_block_table"][0, column]) * 8 + position % 8

    yield _invalid(d, "slots_without_modulo", ("slots.mismatch",), f"Row {row} (request 0, position {position:,}, "
                   f"hca_state page {page}) writes through column {column} = {page} - {run.start}, the page's offset "
                   f"in its live run (the table read without the ring modulo), instead of column {page} % {hca_w} = "
                   f"{page % hca_w}; column {column} holds page {target}, which the call only reads.", window_relative)


def all_vectors() -> list[Vector]:
    valid = {v.name: v for v in valid_vectors()}
    return [*valid.values(), *invalid_vectors(valid)]


def generate(directory: str | Path) -> list[Path]:
    """Write every vector, the hostile files and ``index.json`` into ``directory``; stale vectors are removed."""
    root = Path(directory)
    for kind in KINDS:
        (root / kind).mkdir(parents=True, exist_ok=True)
        for stale in (root / kind).glob("*.safetensors"):
            if stale.is_symlink() or stale.is_file():   # a link, not what it points at; never a device or FIFO
                stale.unlink()
    files: dict[str, tuple[bytes, Expectation, str]] = {}
    vectors = all_vectors()
    for v in vectors:
        data = encode(v.arrays, config=v.config, policy=v.policy, pool_blocks=v.pool_blocks, tensors=v.extras,
                      expected=v.expected, name=v.name, description=v.description)
        files[v.name + ".safetensors"] = (data, v.expected, v.description)
    base = next(v for v in vectors if v.name == "valid/single_token")
    hostile = hostile_files(base.arrays, config=base.config, policy=base.policy, pool_blocks=base.pool_blocks)
    for name, (data, code, description) in hostile.items():
        files[f"hostile/{name}.safetensors"] = (data, Expectation(valid=False, codes=(code,)), description)
    entries = []
    for rel, (data, expected, description) in files.items():
        write_bytes(root / rel, data)
        entries.append({"file": rel, "description": description, "expected": expected.model_dump(mode="json"),
                        "sha256": hashlib.sha256(data).hexdigest()})
    index = {"format": INDEX_FORMAT, "format_version": FORMAT_VERSION, "vectors": entries}
    write_text(root / INDEX_NAME, json.dumps(index, indent=1, sort_keys=True) + "\n")
    return [root / INDEX_NAME, *(root / rel for rel in files)]


def _listing(root: Path) -> dict[str, bytes]:
    paths = [root / INDEX_NAME, *(p for kind in KINDS for p in sorted((root / kind).glob("*")))]
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in paths if p.is_file()}


def check(directory: str | Path) -> list[str]:
    """Differences between ``directory`` and a fresh generation (empty list = no drift)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        fresh = _listing(Path(tmp))
    committed = _listing(Path(directory)) if (Path(directory) / INDEX_NAME).is_file() else {}
    problems = [f"missing: {k}" for k in sorted(fresh.keys() - committed.keys())]
    problems += [f"stale (not generated): {k}" for k in sorted(committed.keys() - fresh.keys())]
    problems += [f"differs: {k}" for k in sorted(fresh.keys() & committed.keys()) if fresh[k] != committed[k]]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_abi.conformance.vectors",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="spec/v1/vectors")
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from a fresh generation")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.directory)
        for p in problems:
            print(p)
        print("vectors up to date" if not problems else f"{len(problems)} difference(s); regenerate with "
              f"python -m dspark_abi.conformance.vectors {args.directory}")
        return 1 if problems else 0
    paths = generate(args.directory)
    print(f"wrote {len(paths)} files to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
