"""Structured validation errors: stable codes, `Issue`, `ValidationReport` and `ABIError`.

Every code the library can raise is registered in :data:`CODES` with a one-line meaning and a
fix hint. ``docs/errors.md`` and ``spec/v1/abi.md`` list exactly these codes; a test keeps the
three in agreement.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

#: code -> (what it means, how to fix it)
CODES: dict[str, tuple[str, str]] = {
    # ---- query_start_loc and geometry
    "qsl.shape": ("query_start_loc is not a 1-D array of length >= 2",
                  "pass [0, q0, q0+q1, ..., N] with one entry per request plus one"),
    "qsl.start": ("query_start_loc[0] is not 0", "prefix offsets start at 0"),
    "qsl.non_monotonic": ("query_start_loc decreases", "offsets must be non-decreasing (a length cannot be negative)"),
    "qsl.token_count": ("N = query_start_loc[-1] is outside [1, token_cap]",
                        "split the batch so that 1 <= N <= policy.token_cap"),
    "qsl.empty_request": ("a request has zero new tokens but the policy forbids it",
                          "drop the request or set PaddingPolicy(allow_empty_requests=True)"),
    "geometry.rows": ("an array does not have the rows the geometry gives: P (full), L (rank-local) or R",
                      "size full arrays to P = align_up(N, TP) and local ones to L = P / TP"),
    # ---- arrays
    "array.missing": ("a required array is absent", "provide every required ABI field"),
    "array.dtype": ("an array has the wrong dtype or is not a plain numpy.ndarray (e.g. a masked array or matrix)",
                    "cast to the dtype the ABI names (int32 / int64 / float)"),
    "array.shape": ("an array has the wrong rank or shape", "reshape to the symbolic shape the ABI names"),
    # ---- block tables
    "tables.request_count": ("a block table's dim 0 is not R = len(query_start_loc) - 1",
                             "give every one of the seven tables exactly one row per request"),
    "tables.width": ("a block table is wider than the config's layout or narrower than the pages the call uses",
                     "use ModelConfig.layout.pools[name].ring_width columns for ori and the state pools and, for the "
                     "compressed pools, at least the pages up to the widest request's last live page"),
    "tables.block_range": ("a block-table entry read by this call is < -1 or >= the pool's block count",
                           "use -1 for unmapped pages and block ids in [0, pool_blocks)"),
    "pools.blocks": ("pool block counts are missing, not integers, not positive or too large for int32 slots",
                     "give each of the seven pools an integer count of blocks in [1, (2**31 - 1) // page_size]"),
    # ---- persistent tables and step deltas (spec 1.3, section 5.9)
    "tables.slot": ("a table slot is outside the persistent tables or two requests of the step share one",
                    "give each request the slot the allocator holds for it (BatchBuilder.build(form='persistent'))"),
    "tables.stale_slot": ("a request's slot was released or recycled since the step was built (its generation is "
                          "not the slot's current one) or the slot is held by another request",
                          "build the step again against the current persistent tables"),
    "tables.unapplied": ("a persistent step reached a forward with tables that do not hold its delta (not applied "
                         "or committed, or written since)",
                         "apply the step to the mirror (tables.apply(step)) or commit it (BatchBuilder.commit) right "
                         "before its forward"),
    "tables.persistent": ("the persistent tables break their invariant: a block held twice or out of range, a "
                          "mapped cell outside its slot's run or an unmapped one inside it, a free slot holding pages",
                          "rebuild the tables from the allocator; never write them except by applying step deltas"),
    "delta.mapped": ("a mapped cell of a step delta is malformed: not a slot of the step, a page out of range, a "
                     "block out of range or held by another cell, or the slot's pages not one run after the step",
                     "map only free blocks (or blocks the same delta releases) on the pages right after (or, for a "
                     "new request, at) its run"),
    "delta.released": ("a released cell of a step delta does not hold the block it names or is not at the front "
                       "of its slot's run", "release only the front pages a slot holds, with the blocks they hold"),
    # ---- positions
    "positions.negative": ("a live position is negative", "positions are absolute in-request indices >= 0"),
    "positions.not_contiguous": ("positions inside a request are not start, start+1, ...",
                                 "a request's new tokens must be consecutive positions"),
    "positions.out_of_range": ("a position (live or padding) is outside [0, max_position_embeddings)",
                               "stop the request before the model's maximum context"),
    # ---- padding rows
    "padding.position": ("a padding row's position differs from the padding policy",
                         "fill padding positions as PaddingPolicy.pad_position says"),
    "padding.slot": ("a padding row has a slot mapping other than -1", "padding rows must never write"),
    "padding.hidden": ("a padding row of the hidden state is not zero", "zero hidden rows N..P-1"),
    "padding.token_id": ("a padding row's token id differs from the policy's pad id",
                         "fill with PaddingPolicy.pad_token_id"),
    # ---- slot mappings
    "slots.mismatch": ("a live token's slot differs from the row its request's table gives",
                       "derive slots from the tables: block*page_size + offset (see spec section 5)"),
    "slots.off_boundary": ("a compressed-pool slot is set on a token that is not a ratio boundary",
                           "set csa_cmp/idx/hca_cmp slots only where (p+1) % ratio == 0, else -1"),
    "slots.range": ("a slot is < -1 or beyond the pool's rows", "slots must be -1 or in [0, pool_blocks*page_size)"),
    "tables.alias": ("two logical pages a request uses in this call map to the same physical block",
                     "give every logical page of a request its own block"),
    "writes.duplicate": ("two live tokens write the same physical row of a pool",
                         "give every written logical row its own physical row"),
    # ---- reads, isolation, state rings
    "coverage.unmapped": ("a page the request reads or writes in this call is unmapped (-1)",
                          "map the window, compressed history and state history pages before the call"),
    "isolation.foreign_write": ("the batch writes a row that lies in a page another request reads or writes",
                                "never share a written page between requests"),
    "state.ring_alias": ("two positions of a request's live state range map to the same state row",
                         "the state ring must hold state_len + chunk positions without wrapping"),
    # ---- verify requests and output intent (spec 1.2, section 5.8)
    "verify.width": ("a verify request's width is not 1..1 + K rows, or verify_widths disagrees with the request's "
                     "rows (0 marks a prefill chunk)",
                     "give each verify request its anchor plus at most dspark_block_size drafts; set verify_widths[r] "
                     "to the request's row count for a verify request and 0 for a prefill chunk"),
    "verify.drafts": ("a verify request carries more drafts than the config's dspark_block_size (K)",
                      "draft at most dspark_block_size tokens per block (fewer is fine); a config without DSpark "
                      "verifies the anchor alone"),
    "verify.no_anchor": ("a verify request starts at position 0: nothing is committed before it, so it has no anchor",
                         "prefill the prompt first (add), then verify from the first position not yet cached"),
    "verify.position_limit": ("a verify request's drafts reach max_position_embeddings (a clamped duplicate "
                              "position would carry a real slot)",
                              "draft fewer tokens near the end of the context: num_cached + width <= "
                              "max_position_embeddings"),
    "verify.ring_headroom": ("a ring table (ori or a state pool) is narrower than the headroom of the step's widest "
                             "verify request: reach + verify width positions, rounded to pages, plus one page",
                             "give each ring table at least ceil((reach + width) / page_size) + 1 columns (the "
                             "builder does; PoolLayout.ring_width always suffices)"),
    "logits.intent": ("logit_mode is not 0 (none), 1 (last row) or 2 (every row) where the request allows it, or "
                      "logit_rows differs from what the intent implies",
                      "verify requests take 2, prefill chunks 0 or 1; logit_rows lists, request after request, -1 for "
                      "mode 0, the last row for mode 1 and every row for mode 2"),
    "commit.accepted": ("the accepted counts given to BatchBuilder.commit are malformed or exceed what the step "
                        "verified",
                        "pass None or one integer per request: a prefill chunk's row count, 1..width for a verify "
                        "request; nothing was committed"),
    # ---- misc fields
    "logits.range": ("a logit row index is not -1 and not in [0, N)", "point logit rows at live tokens or use -1"),
    "request_ids.duplicate": ("two requests share a serving request id", "request ids must be unique in a batch"),
    "token_ids.range": ("a live token id is < 0 or >= vocab_size", "token ids must be valid vocabulary ids"),
    # ---- TP ranks
    "rank.index": ("rank is outside [0, TP)", "ask for a rank in range"),
    "rank.replicated_mismatch": ("a field that must be identical on every rank differs between ranks",
                                 "replicate query_start_loc, tables and *_full tensors unchanged to every rank"),
    "rank.local_mismatch": ("a rank-local field differs from its slice of the full field",
                            "local rows of rank r are full rows [r*L, (r+1)*L)"),
    # ---- config / policy / cross-object
    "config.invalid": ("a configuration value is missing or invalid", "fix the named key"),
    "config.mismatch": ("an object was built for another ModelConfig or policy", "use objects built from one config"),
    # ---- fixture files
    "fixture.unreadable": ("the file is not a readable safetensors fixture (missing, truncated, bad or "
                           "oversized header)",
                           "regenerate the file with dspark_abi.io.fixtures.save"),
    "fixture.version": ("the fixture's format name or format_version is not one this library reads",
                        "upgrade dspark or convert the file to a supported format version"),
    "fixture.manifest": ("the JSON manifest in the header is invalid", "see the message for the offending key"),
    "fixture.tensors": ("a tensor is missing, unexpected, or has the wrong dtype, rank or values (e.g. NaN)",
                        "store exactly the tensors the manifest lists, with ABI dtypes and shapes"),
    # ---- serving-side builder
    "builder.request": ("a request given to the builder is invalid",
                        "pass request_id, num_cached and num_new as integers (Python or numpy, not bool, float or "
                        "str), the counts >= 0"),
    "alloc.exhausted": ("a pool has too few free blocks for this step",
                        "release finished requests or allocate bigger pools; nothing was allocated"),
    "alloc.unknown_request": ("the allocator does not know this request id", "add it before use, release it once"),
    "alloc.stale_plan": ("the allocator changed between plan and commit (another step was committed or a request "
                         "released), or the batch was committed already or by another builder",
                         "hold allocator.lock from BatchBuilder.build to BatchBuilder.commit, or build the step "
                         "again; commit each batch once, with its own builder; nothing was allocated"),
    # ---- pypto backend
    "kernel.index_range": ("an index a pypto kernel forms in fp32 reaches 2**24 and would round (flattened table "
                           "entry, pool row or position)",
                           "keep it below 2**24 = 16777216: fewer requests per call (R * table_width), smaller pools "
                           "(blocks * page_size) or shorter contexts; nothing was launched"),
    # ---- upstream prefill tensors (dspark_abi.upstream)
    "upstream.shape": ("an upstream prefill tensor has another dtype, rank or leading rank axis than "
                       "l3_prefill_fwd takes, or more logit rows than it samples",
                       "stage every metadata tensor as [TP, ...] with the entry's dtype: int32 query_start_loc, "
                       "positions, block tables and logit_row_indices, int64 slot mappings and input_ids"),
    "upstream.depth": ("an upstream block table is not as deep as the kernels' frozen depth, or the depth cannot "
                       "hold the config's pages",
                       "stage each table at its frozen depth (dspark_abi.upstream.UPSTREAM_TABLE_DEPTHS or the depths "
                       "given), -1 past each request's span"),
    "upstream.past_span": ("an upstream block table maps a page after its request's last live page",
                           "stage -1 from the request's last live page + 1 up to the table depth"),
    "upstream.state_ring_overwrite": ("two live state pages of one request share a block of an upstream state ring: "
                                      "the call would overwrite state it still reads",
                                      "give each request a state ring of at least ceil((state_len + chunk) / "
                                      "page_size) + 1 blocks, or split the chunk as the issue says"),
    # ---- kernel capabilities, checked once at start-up (dspark_abi.capabilities)
    "capability.pool_size": ("a pool has fewer blocks than the kernel's canonical minimum",
                             "allocate at least the canonical blocks the issue names for that pool"),
    "capability.index_overflow": ("a pool row, byte offset or position does not fit the index type the kernel forms "
                                  "it in (int32 byte offsets, fp32-exact rows and positions)",
                                  "keep every pool below the first overflowing block the issue names, or use a "
                                  "shorter context"),
    "capability.table_depth": ("a block table is deeper than the kernel can index (R * width reaches 2**24 in fp32, "
                               "or the config's context exceeds upstream's frozen depth)",
                               "admit at most the requests per call the issue names, or a context the kernel is "
                               "compiled for"),
    "capability.token_cap": ("the policy's token cap exceeds the kernel's group capacity",
                             "set PaddingPolicy(token_cap=...) so that align_up(token_cap, TP) <= 8192"),
    # ---- the DSpark drafter (dspark_kernels.drafter)
    "drafter.config": ("the config cannot run the DSpark drafter (no block size or target layers, or a noise token "
                       "outside the vocabulary)",
                       "use a DSpark config whose dspark_* keys are those of the checkpoint's config.json"),
    "drafter.gap": ("committed rows given to the drafter do not continue the request's history, or an anchor does "
                    "not follow its last observed row",
                    "observe every committed row once, in position order, before drafting after it; nothing was "
                    "written"),
    "drafter.unknown_request": ("the drafter has no committed rows of this request id",
                                "observe the request's prompt (its target features) first; release it once"),
    "drafter.unmapped": ("a row the drafter writes or reads lies outside the request's current ori pages in the "
                         "persistent tables it is attached to, or no tables are attached",
                         "attach the allocator's persistent tables (drafter.attach(allocator.persistent)) and observe "
                         "a step's committed rows and draft before the request's next step is built; nothing was "
                         "written"),
}


@attrs.frozen
class Issue:
    """One violated rule: stable ``code``, where (``field``, ``index``, ``request``), what was wanted.

    Attributes:
        code: The stable code of the rule, a key of :data:`CODES`.
        field: The ABI field (or argument) that breaks it.
        message: What is wrong, in one sentence.
        index: Index of the first offending element of ``field`` (None when the field as a whole is wrong).
        request: Batch index of the request that element belongs to, when there is one.
        expected: What the rule wanted there.
        actual: What was found.
        count: How many elements violate the rule (only the first, ``index``, is named).
        fix: The fix for this very issue when it is more specific than the code's generic hint.
    """

    code: str
    field: str
    message: str
    index: int | None = None
    request: int | None = None
    expected: Any = None
    actual: Any = None
    count: int = 1
    fix: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.code not in CODES:
            raise KeyError(f"unregistered issue code {self.code!r}")

    @property
    def hint(self) -> str:
        return self.fix or CODES[self.code][1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code, "field": self.field, "index": self.index, "request": self.request,
            "expected": _jsonable(self.expected), "actual": _jsonable(self.actual), "count": self.count,
            "message": self.message, "hint": self.hint,
        }

    def __str__(self) -> str:
        where = self.field + (f"[{self.index}]" if self.index is not None else "")
        req = f" (request {self.request})" if self.request is not None else ""
        more = f" [{self.count} elements]" if self.count > 1 else ""
        exp = ""
        if self.expected is not None or self.actual is not None:
            exp = f"; expected {_jsonable(self.expected)}, got {_jsonable(self.actual)}"
        return f"{self.code}: {where}{req}: {self.message}{exp}{more}. Fix: {self.hint}"


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


class ABIError(ValueError):
    """Raised when metadata violates the ABI; carries every issue found, not only the first."""

    def __init__(self, issues: Iterable[Issue]):
        self.issues: tuple[Issue, ...] = tuple(issues)
        super().__init__(self._render())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its issues (rank processes, kernel processes): the message is rendered again from them."""
        return type(self), (self.issues,)

    @property
    def codes(self) -> set[str]:
        return {i.code for i in self.issues}

    def _render(self) -> str:
        lines = [f"{len(self.issues)} ABI issue(s):"] + [f"  - {i}" for i in self.issues]
        return "\n".join(lines)


@attrs.frozen
class ValidationReport:
    """Every issue found by :func:`dspark_abi.validate`; ``ok`` when there are none.

    Attributes:
        issues: Every issue, in the order the rules were checked.
    """

    issues: tuple[Issue, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.issues

    @property
    def codes(self) -> set[str]:
        return {i.code for i in self.issues}

    def raise_if_invalid(self) -> None:
        if self.issues:
            raise ABIError(self.issues)

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "issues": [i.to_dict() for i in self.issues]}, indent=2)

    def __str__(self) -> str:
        if self.ok:
            return "valid"
        return "\n".join(str(i) for i in self.issues)
