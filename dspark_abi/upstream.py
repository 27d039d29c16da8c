"""A `PackedBatch` <-> the metadata tensors of upstream's packed prefill entry, both ways, checked.

Upstream is hw-native-sys/pypto-lib PR #1095 (merged as 740fe59), ``models/deepseek_v4_flash_dspark/prefill_fwd.py``:
the device program ``prefill_fwd`` and its host entry ``l3_prefill_fwd``, which takes every tensor with a leading
rank axis and runs ``prefill_fwd(tensor[r], ..., my_rank=r)`` on rank r. 19 of its ~100 arguments are the request
metadata (:data:`UPSTREAM_TENSORS`, in parameter order), the per-step host slots the serving stack stages
(hw-native-sys/pypto-serving ``pypto_serving/model/deepseek_dspark/task_args.py``, ``_prefill_slots``).
``local_request_ids`` is derived on the device and ``my_rank`` is a scalar: neither is a tensor here.

**Form.** A dspark batch is one TP group, so every tensor has a leading axis of TP ranks, as the per-group host
leaves ``l3_prefill_attention_*_cp`` take them; ``l3_prefill_fwd``'s ``[N_RANKS, ...]`` stacks the EP world's
groups on that axis (rank = group * TP + tp_rank). ``position_ids_local`` and ``input_ids`` hold each rank's L
rows; ``logit_row_indices`` is published by the group leader (rank 0, the other ranks -1), as ``prefill_fwd``'s
fixture does. Replicated tensors are read-only broadcast views of one array (``np.ascontiguousarray`` copies).

**Tables.** Upstream tables are linear (column i = logical page i) at frozen depths, -1 past each request's span.
dspark's ring tables (ori, state pools) hold page i in column ``i % width``, its compressed tables are trimmed; both
as narrow as the batch's widest live range, as ``BatchBuilder`` emits them. Both directions move each request's
live pages (spec 5.3) and nothing else (dspark leaves the other entries unconstrained, K2), plus the compressed rows
of zero-length requests as they are (a ring row of such a request cannot be unwrapped: it has no position; it
comes back -1, as the builder writes it). So ``from_upstream(to_upstream(b)) == b`` for the builder's default
(``ring_width="step"``) batches, and ``from_upstream(to_upstream(b), ring_widths="fixed") == b`` for its
``ring_width="fixed"`` batches: a linear table does not carry the ring width (both builder modes give the same
upstream tensors), so the caller names it. Absent ``logit_rows`` come back as R times -1.

**State rings.** Upstream's fixtures share a 260-block CSA state ring (page 2) between request slots:
``utils.block_table`` maps page c of the request in table row r to ``((c % 260) * slots + r) % 260`` (slots = 2 in
ragged2), so a request's pages repeat a block every 130 pages (260 positions). A chunk whose live state range
(``state_len`` carried + the chunk) is longer overwrites rows the call still reads: :func:`from_upstream` rejects it
as ``upstream.state_ring_overwrite``, with the ring size and the longest chunk the ring holds. Keeping only each
row's last write is no way out: the batch would still alias live pages (R26) and leave live writers without a slot
(R29), and upstream's compressor scatters a tile's rows in parallel before pooling them
(``prefill_compressor_ratio4.py``), so the tile's first windows read rows its later positions overwrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
import numpy as np

from dspark_abi._base import expand_ranges
from dspark_abi.batch import PackedBatch
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_abi.fields import BATCH_FIELDS, SLOT_FIELDS, SLOT_SPECS, TABLE_FIELDS, TABLE_SPECS
from dspark_abi.layout import (
    POOL_NAMES,
    PoolLayout,
    PoolName,
    live_pages,
    page_span,
    ring_width_for,
    table_column,
    touched_pages,
)
from dspark_abi.lowering import query_start_loc_issues
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import PoolBlocks
from dspark_abi.ranks import merge_rank_arrays
from dspark_abi.requests import implied_logit_rows, owner_of_rows
from dspark_abi.validation import subclass_issue

#: Columns of the seven prefill block tables the serving stack stages for the deployed kernels, whose generated code
#: reshapes each table with its depth baked in (shallower: AICore error 507901 on the device). Source: pypto-serving
#: ``pypto_serving/model/deepseek_dspark/npu_runner.py``, ``DSPARK_PREFILL_*_TABLE_BLOCKS``. They are dspark's table
#: widths at 1,048,576 positions (32-row ori and compressed pages, 2- and 8-row state pages); the newest
#: pypto-serving stages hca_cmp at 8192 because it moved to one-row HCA pages, which this ABI's pages are not.
UPSTREAM_TABLE_DEPTHS: dict[PoolName, int] = {
    "ori": 32768, "csa_cmp": 8192, "hca_cmp": 256, "idx": 8192,
    "csa_state": 524288, "csa_inner_state": 524288, "hca_state": 131072,
}
#: Rows of ``logit_row_indices`` the serving stack stages (npu_runner.py ``DSPARK_MAX_LOGIT_ROWS`` = the 128-row
#: MoE wave; pypto-lib's ``lm_head.MAX_LOGIT_ROWS`` has changed between releases, so it is a parameter).
UPSTREAM_MAX_LOGIT_ROWS = 128

#: Upstream name of each pool's block table and slot mapping (``prefill_fwd``'s parameters; declared with the fields).
UPSTREAM_TABLES: dict[PoolName, str] = {p: str(f.upstream) for p, f in TABLE_SPECS.items()}
UPSTREAM_SLOTS: dict[PoolName, str] = {p: str(f.upstream) for p, f in SLOT_SPECS.items()}
_T, _S = UPSTREAM_TABLES, UPSTREAM_SLOTS
#: Upstream tensor -> (the dspark field it carries, upstream's shape of one TP group with its rank axis).
_UPSTREAM_OF = {f.upstream: f for f in BATCH_FIELDS if f.upstream} | {
    f.upstream_local: f for f in BATCH_FIELDS if f.upstream_local}
_UPSTREAM_SHAPE = {"query_start_loc": "[TP, R+1]", "position_ids_local": "[TP, L]", "input_ids": "[TP, L]",
                   "logit_row_indices": "[TP, MAX_LOGIT_ROWS]"}
#: The metadata tensors of ``l3_prefill_fwd``, in its parameter order: name -> (dtype, shape of one TP group).
UPSTREAM_TENSORS: dict[str, tuple[np.dtype[Any], str]] = {
    name: (np.dtype(_UPSTREAM_OF[name].dtype),
           _UPSTREAM_SHAPE.get(name, "[TP, R, depth]" if _UPSTREAM_OF[name].family == "tables" else "[TP, P]"))
    for name in ("query_start_loc",
                 *(_T[p] for p in ("hca_state", "csa_state", "csa_inner_state", "ori", "hca_cmp", "csa_cmp", "idx")),
                 _S["ori"], "position_ids_local", "position_ids_full", "input_ids",
                 *(_S[p] for p in ("hca_cmp", "hca_state", "csa_cmp", "idx", "csa_state", "csa_inner_state")),
                 "logit_row_indices")
}
#: The field upstream publishes from the group leader only (see _leader_logit_rows), not as a replicated tensor.
_LEADER_ONLY = "logit_rows"
#: Per-rank dspark field (:mod:`dspark_abi.ranks`) -> upstream tensor; with the flat aliases, names issues.
_PER_RANK = {f.per_rank_name: f.upstream for f in BATCH_FIELDS if f.upstream and f.name != _LEADER_ONLY} | {
    f.local: f.upstream_local for f in BATCH_FIELDS if f.local and f.upstream_local}
_UPSTREAM_NAME = _PER_RANK | {f.name: f.upstream or f.upstream_local for f in BATCH_FIELDS
                              if f.upstream or f.upstream_local}

def table_depths(config: ModelConfig) -> dict[PoolName, int]:
    """The config's own table widths: the depths of an upstream build compiled for its ``max_position_embeddings``
    (pypto-lib derives every ``*_MAX_BLOCKS`` from ``MAX_SEQ_LEN``; at 1,048,576 they are UPSTREAM_TABLE_DEPTHS)."""
    return {p: config.layout.pools[p].table_width for p in POOL_NAMES}


def to_upstream(batch: PackedBatch, *, depths: Mapping[str, int] | None = None,
                max_logit_rows: int = UPSTREAM_MAX_LOGIT_ROWS) -> dict[str, np.ndarray]:
    """The 19 metadata tensors of ``l3_prefill_fwd`` for one TP group (names, dtypes, order: UPSTREAM_TENSORS).

    depths: table columns per pool (default UPSTREAM_TABLE_DEPTHS, the deployed kernels; :func:`table_depths`
    for a build at the config's context); each must cover the config's table width. Raises :class:`ABIError`:
    ``upstream.depth`` for a depth below it, ``array.missing`` without token ids (upstream routes the MoE by them),
    ``upstream.shape`` for more logit rows than ``max_logit_rows``. Cost O(R * sum(depths)), off the hot path.
    """
    cfg, layout, tp = batch.config, batch.config.layout, batch.tp_size
    want = _depths(cfg, depths)
    rows = np.full(0, -1, np.int32) if batch.logit_rows is None else batch.logit_rows
    if batch.token_ids is None:
        raise ABIError([Issue("array.missing", "token_ids", "upstream's input_ids are the batch's token ids",
                              expected="[P] int64 token ids", actual=None,
                              fix="build the batch with token_ids (BatchBuilder.add(..., token_ids=...))")])
    if rows.size > max_logit_rows:
        raise ABIError([Issue("upstream.shape", "logit_row_indices", "more logit rows than upstream samples",
                              expected=f"<= {max_logit_rows} rows", actual=int(rows.size),
                              fix=f"sample at most {max_logit_rows} rows per call or pass a larger max_logit_rows")])
    empty = batch.request_lengths == 0
    start = np.where(empty, 0, batch.request_starts)
    end = start + batch.request_lengths
    out = {"query_start_loc": batch.query_start_loc, "position_ids_full": batch.positions}
    for pl in layout:
        table = batch.tables[pl.name]
        out[_T[pl.name]] = linear = np.full((batch.num_requests, want[pl.name]), -1, np.int32)
        req, page = touched_pages(pl, start, end, cfg.sliding_window)
        linear[req, page] = table[req, table_column(pl, page, table.shape[1])]
        if not pl.is_ring:                     # zero-length requests' compressed rows as they are
            linear[empty, : table.shape[1]] = table[empty]
        out[_S[pl.name]] = batch.slots[pl.name]
    out = {k: np.broadcast_to(v, (tp, *v.shape)) for k, v in out.items()}    # replicated: one array, TP views
    input_ids = np.array(batch.token_ids, dtype=np.int64)
    input_ids[batch.num_tokens:] = 0                      # upstream zeroes input_ids on padding rows
    out |= {"position_ids_local": batch.positions.reshape(tp, -1), "input_ids": input_ids.reshape(tp, -1),
            "logit_row_indices": np.full((tp, max_logit_rows), -1, np.int32)}
    out["logit_row_indices"][0, : rows.size] = rows       # the group leader publishes the rows
    return {name: out[name] for name in UPSTREAM_TENSORS}


def from_upstream(tensors: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                  pool_blocks: Mapping[str, int] | PoolBlocks, *, depths: Mapping[str, int] | None = None,
                  ring_widths: Mapping[str, int] | Literal["step", "fixed"] | None = None,
                  request_ids: Any = None) -> PackedBatch:
    """Check upstream prefill metadata (one TP group, the form :func:`to_upstream` returns) and convert it.

    Checks, in order, each raising :class:`ABIError` with every issue of its stage (issues name the upstream
    tensors): the signature (``array.missing``; ``upstream.shape``: dtype, rank, rank axis; ``upstream.depth``;
    ``tables.request_count``); the TP group (``rank.replicated_mismatch``, ``rank.local_mismatch``, the leader-only
    ``logit_row_indices``); per request with new tokens, ``upstream.past_span`` (a page mapped after its last
    live page), ``upstream.state_ring_overwrite`` and ``padding.token_id`` (input_ids not 0 on padding rows). Then
    the live pages move into dspark's tables, each as wide as the widest live range (ring pools: or
    ``ring_widths[pool]`` columns, any width >= the requests' live pages, e.g. ``ring_width``; ``"fixed"``:
    every ring pool's ``PoolLayout.ring_width``, as ``BatchBuilder(ring_width="fixed")`` emits; ``"step"`` or None:
    the default), and the arrays are validated as ``PackedBatch.from_arrays`` does. Extra tensors (weights,
    caches) are ignored.
    """
    layout, tp = config.layout, policy.tp_size
    want = _depths(config, depths)
    issues, arrays = _signature_issues(tensors, tp, want)
    if issues:
        raise ABIError(issues)
    per_rank = {field: arrays[name] for field, name in _PER_RANK.items()}
    logit_issues, logit_rows = _leader_logit_rows(arrays["logit_row_indices"], arrays["query_start_loc"].shape[1] - 1)
    try:
        flat = merge_rank_arrays(per_rank, policy)
    except ABIError as err:
        raise ABIError(_renamed(list(err.issues) + logit_issues)) from None
    if logit_issues:
        raise ABIError(logit_issues)
    qsl, positions = flat["query_start_loc"], flat["positions"].astype(np.int64)
    start, end, n, empty = _spans(qsl, positions, config)
    token_ids = np.array(flat["token_ids"], dtype=np.int64)
    issues = _span_issues(flat, config, start, end)
    pad = n + np.flatnonzero(token_ids[n:] != 0) if n is not None else np.empty(0, np.int64)
    if pad.size:
        issues.append(Issue("padding.token_id", "input_ids", "upstream's padding rows carry input_ids 0",
                            index=int(pad[0]), expected=0, actual=int(token_ids[pad[0]]), count=int(pad.size)))
    if issues:
        raise ABIError(issues)
    if n is not None:
        token_ids[n:] = policy.pad_token_id
    out: dict[str, Any] = {"query_start_loc": qsl, "positions": flat["positions"], "token_ids": token_ids,
                           "logit_rows": logit_rows} | ({} if request_ids is None else {"request_ids": request_ids})
    widths = _ring_widths(config, ring_widths)
    for pl in layout:
        req, page = touched_pages(pl, start, end, config.sliding_window)
        width = max(1, int(live_pages(pl, start, end, config.sliding_window).max(initial=0)))
        width = widths.get(pl.name, width) if pl.is_ring else width
        table, linear = np.full((qsl.size - 1, width), -1, np.int32), flat[TABLE_FIELDS[pl.name]]
        table[req, table_column(pl, page, width)] = linear[req, page]
        if not pl.is_ring:                     # zero-length requests' compressed rows as they are
            table[empty] = linear[empty, :width]
        out[TABLE_FIELDS[pl.name]] = table
        out[SLOT_FIELDS[pl.name]] = flat[SLOT_FIELDS[pl.name]]
    try:
        return PackedBatch.from_arrays(out, config, policy, pool_blocks)
    except ABIError as err:
        raise ABIError(_renamed(err.issues)) from None


# ------------------------------------------------------------------------------------------------ checks
def _ring_widths(config: ModelConfig, ring_widths: Mapping[str, int] | str | None) -> dict[str, int]:
    """Ring pool -> columns asked for (absent: the batch's widest live range)."""
    if ring_widths is None or ring_widths == "step":
        return {}
    if ring_widths == "fixed":
        return {pl.name: pl.ring_width for pl in config.layout if pl.is_ring}
    if isinstance(ring_widths, str):
        raise ABIError([Issue("config.invalid", "ring_widths", "ring_widths must be 'step', 'fixed' or a mapping "
                              "pool -> columns", expected=["step", "fixed", "{pool: columns}"],
                              actual=repr(ring_widths))])
    return dict(ring_widths)


def _depths(config: ModelConfig, depths: Mapping[str, int] | None) -> dict[PoolName, int]:
    want = {p: int((depths or UPSTREAM_TABLE_DEPTHS)[p]) for p in POOL_NAMES}
    width = table_depths(config)
    short = [p for p in POOL_NAMES if want[p] < width[p]]
    if short:
        raise ABIError([Issue("upstream.depth", _T[p], f"depth {want[p]} cannot hold the {width[p]} pages of "
                              f"{config.name}'s context", expected=f">= {width[p]}", actual=want[p]) for p in short])
    return want


def _signature_issues(tensors: Mapping[str, Any], tp: int, depths: Mapping[PoolName, int]
                      ) -> tuple[list[Issue], dict[str, np.ndarray]]:
    """Presence, dtype, rank and rank axis of every tensor; the tables' request count and depth."""
    issues: list[Issue] = []
    arrays: dict[str, np.ndarray] = {}
    for name, (dtype, shape) in UPSTREAM_TENSORS.items():
        value = tensors.get(name)
        if value is None:
            issues.append(Issue("array.missing", name, "l3_prefill_fwd needs this metadata tensor",
                                expected=f"{shape} {dtype.name}", fix="stage every tensor of UPSTREAM_TENSORS "
                                "(dspark_abi.upstream.to_upstream builds them from a PackedBatch)"))
        elif isinstance(value, np.ndarray) and type(value) is not np.ndarray:
            issues.append(subclass_issue(name, value))
        elif (a := np.asarray(value)).dtype != dtype or a.ndim != shape.count(",") + 1 or a.shape[0] != tp:
            issues.append(Issue("upstream.shape", name, f"l3_prefill_fwd takes {name} as {shape} {dtype.name}",
                                expected=f"{shape.replace('TP', f'TP={tp}')} {dtype.name}",
                                actual=f"{list(a.shape)} {a.dtype}"))
        else:
            arrays[name] = a
    qsl = arrays.get("query_start_loc")
    for p, name in _T.items():
        table = arrays.get(name)
        if table is None:
            continue
        if qsl is not None and table.shape[1] != qsl.shape[1] - 1:
            issues.append(Issue("tables.request_count", name, "dim 1 (after the rank axis) must equal "
                                "R = len(query_start_loc) - 1", expected=qsl.shape[1] - 1, actual=table.shape[1]))
        if table.shape[2] != depths[p]:
            issues.append(Issue("upstream.depth", name, "the kernels reshape the table with a frozen depth",
                                expected=depths[p], actual=table.shape[2]))
    return issues, arrays


def _leader_logit_rows(logits: np.ndarray, r_count: int) -> tuple[list[Issue], np.ndarray]:
    """The group leader's logit rows (as one entry per request, or up to the last active one) and the issue of a
    non-leader rank that publishes rows other than -1 or the leader's."""
    leader, others = logits[0], logits[1:]
    odd = np.flatnonzero(~((others == -1).all(axis=1) | (others == leader).all(axis=1)))
    issues = [Issue("rank.replicated_mismatch", "logit_row_indices", f"rank {int(odd[0]) + 1} publishes other logit "
                    "rows than the group leader (rank 0)", index=int(odd[0]) + 1,
                    expected="all -1 (leader-only) or equal to rank 0", actual="other rows", count=int(odd.size))
              ] if odd.size else []
    active = np.flatnonzero(leader != -1)
    rows = np.full(max(r_count, int(active[-1]) + 1 if active.size else 0), -1, np.int32)
    rows[: min(rows.size, leader.size)] = leader[: rows.size]
    return issues, rows


def _spans(qsl: np.ndarray, positions: np.ndarray, config: ModelConfig
           ) -> tuple[np.ndarray, np.ndarray, int | None, np.ndarray]:
    """([R] start, [R] end, N, [R] zero-length) of the requests; end = start (no live range) for zero-length
    requests and for those whose qsl or positions break the ABI (the validator reports them)."""
    r_count = max(qsl.size - 1, 0)
    zero = np.zeros(r_count, np.int64)
    if qsl.ndim != 1 or qsl.size < 2 or query_start_loc_issues(qsl) or not 0 <= int(qsl[-1]) <= positions.size:
        return zero, zero, None, zero > 0
    q = qsl.astype(np.int64)
    lengths, n = np.diff(q), int(q[-1])
    row_request = owner_of_rows(q[:-1], q[1:], 0, n)
    start = zero.copy()
    start[lengths > 0] = positions[q[:-1][lengths > 0]]
    broken = positions[:n] != start[row_request] + (np.arange(n) - q[:-1][row_request])
    usable = (lengths > 0) & (np.bincount(row_request[broken], minlength=r_count) == 0) & (start >= 0)
    usable &= start + lengths <= config.max_position_embeddings
    return start, np.where(usable, start + lengths, start), n, lengths == 0


def _span_issues(flat: Mapping[str, np.ndarray], config: ModelConfig, start: np.ndarray, end: np.ndarray
                 ) -> list[Issue]:
    """``upstream.past_span`` and ``upstream.state_ring_overwrite`` of the requests with a live range."""
    issues = []
    for pl in config.layout:
        name, table = _T[pl.name], flat[TABLE_FIELDS[pl.name]]
        hi = end // pl.ratio if pl.ratio else end                  # the live range's end (section 5.3)
        last = np.where(end > start, page_span(0, hi, pl.page_size)[1], 0)   # one past its last page
        req, col = np.nonzero(table != -1)
        past = (end[req] > start[req]) & (col >= last[req])
        if past.any():
            i = int(np.flatnonzero(past)[0])
            issues.append(Issue("upstream.past_span", name, "a page after the request's last live page is "
                                "mapped (upstream stages -1 past each request's span)", index=int(col[i]),
                                request=int(req[i]), expected=-1, actual=int(table[req[i], col[i]]),
                                count=int(past.sum())))
        if pl.is_state:
            issues += _ring_overwrite(pl, name, table, start, end, config)
    return issues


def _ring_overwrite(pl: PoolLayout, name: str, table: np.ndarray, start: np.ndarray, end: np.ndarray,
                    config: ModelConfig) -> list[Issue]:
    """Two live state pages of one request on one block: the ring is shorter than the call's live state range."""
    req, page = touched_pages(pl, start, end, config.sliding_window)
    blk = table[req, page].astype(np.int64)
    req, page, blk = req[blk >= 0], page[blk >= 0], blk[blk >= 0]
    order = np.lexsort((page, blk, req))
    req, page, blk = req[order], page[order], blk[order]
    dup = np.flatnonzero((req[1:] == req[:-1]) & (blk[1:] == blk[:-1]))
    if not dup.size:
        return []
    r, ps, reach = int(req[dup[0]]), pl.page_size, pl.reach
    period = int((page[dup + 1] - page[dup])[req[dup] == r].min())     # pages after which the ring repeats
    lo, chunk = max(0, int(start[r]) - reach), int(end[r] - start[r])
    first_page, stop_page = page_span(lo, int(end[r]), ps)
    longest = (period - 1) * ps + 1 - reach        # a live range of reach + chunk positions spans <= period pages
    split = f"split its chunk into pieces of at most {longest} tokens" if longest > 0 else \
        "the ring cannot even hold the carried history"
    return [Issue("upstream.state_ring_overwrite", name,
                  f"live state pages {int(page[dup[0]])} and {int(page[dup[0] + 1])} of request {r} share block "
                  f"{int(blk[dup[0] + 1])}: its ring repeats every {period} pages, fewer than the "
                  f"{int(stop_page - first_page)} pages of the positions [{lo}, {int(end[r])}) the call "
                  "reads and writes, so it overwrites state it still reads", index=int(page[dup[0] + 1]), request=r,
                  expected="distinct blocks on the live state pages", actual=int(blk[dup[0] + 1]),
                  count=int(dup.size), fix=f"give request {r} a {pl.name} ring of at least "
                  f"{ring_width_for(pl.table_width, ps, reach, chunk)} blocks (ceil((state_len + chunk) / page) + 1), "
                  f"or {split}")]


def _renamed(issues: Any) -> list[Issue]:
    """Issues with dspark field names replaced by the upstream tensor names."""
    return [attrs.evolve(i, field=_UPSTREAM_NAME.get(i.field, i.field)) for i in issues]


# ---------------------------------------------------------------------------------------------- the decode rectangle
#: The tensors of the decode rectangle (spec 5.8.5) besides the seven tables and slot mappings: name -> (dtype, shape).
#: B lanes of S = 1 + K rows; lane b owns rows ``[b*S, (b+1)*S)``.
DECODE_TENSORS: dict[str, tuple[np.dtype[Any], str]] = {
    "active_widths": (np.dtype(np.int32), "[B]"), "kv_seq_lens": (np.dtype(np.int32), "[B]"),
    "positions": (np.dtype(np.int32), "[B*S]"), "input_ids": (np.dtype(np.int64), "[B*S]"),
}


def to_upstream_decode(batch: PackedBatch, *, lanes: int | None = None, lane_width: int | None = None
                       ) -> dict[str, np.ndarray]:
    """A verify-only ``batch`` as upstream's decode rectangle (spec 5.8.5): request r in lane r of ``lanes`` (B,
    default R) lanes of ``lane_width`` (S, default the config's 1 + K) rows. Tensors: ``active_widths`` [B] int32
    (0 = idle lane), ``kv_seq_lens`` [B] int32 (anchor + width, 0 idle), ``positions`` [B*S] int32 (anchor + j on
    active rows, 0 elsewhere), ``input_ids`` [B*S] int64 (when the batch has token ids; ``pad_token_id`` elsewhere),
    the seven ``<pool>_block_table`` [B, w] int32 (the batch's widths; -1 rows for idle lanes) and
    ``<pool>_slot_mapping`` [B*S] int64 (-1 on every inactive row).

    Raises ``verify.width`` when a request is not a verify request (a prefill chunk has no decode form),
    ``verify.drafts`` when one is wider than S, ``upstream.shape`` when B < R. Cost O(B * S + B * w)."""
    req = batch.requests
    s = batch.config.max_verify_width if lane_width is None else int(lane_width)
    b = req.count if lanes is None else int(lanes)
    issues = []
    chunk = np.flatnonzero(~req.is_verify)
    if chunk.size:
        issues.append(Issue("verify.width", "verify_widths", "the decode rectangle holds verify requests only",
                            index=int(chunk[0]), request=int(chunk[0]), expected=">= 1", actual=0,
                            count=int(chunk.size), fix="send prefill chunks through to_upstream (the prefill entry)"))
    wide = np.flatnonzero(req.verify_width > s)
    if wide.size:
        issues.append(Issue("verify.drafts", "verify_widths", f"a verify request is wider than the lane width S = {s}",
                            index=int(wide[0]), request=int(wide[0]), expected=f"<= {s}",
                            actual=int(req.verify_width[wide[0]]), count=int(wide.size)))
    if b < req.count or s < 1:
        issues.append(Issue("upstream.shape", "active_widths", "the rectangle needs a lane per request and S >= 1",
                            expected=f">= {req.count} lanes", actual=(b, s)))
    if issues:
        raise ABIError(issues)
    width = req.verify_width.astype(np.int64)
    anchor = req.first_position
    active_widths = np.zeros(b, np.int32)
    active_widths[: req.count] = width
    kv = np.zeros(b, np.int32)
    kv[: req.count] = anchor + width
    # row (lane r, offset j) of the rectangle <- group row row_start[r] + j, for j < width[r]
    lane_rows, group_rows = _lane_rows(req.row_start.astype(np.int64), width, s)
    out: dict[str, np.ndarray] = {"active_widths": active_widths, "kv_seq_lens": kv}
    positions = np.zeros(b * s, np.int32)
    positions[lane_rows] = batch.positions[group_rows]
    out["positions"] = positions
    if batch.token_ids is not None:
        ids = np.full(b * s, batch.policy.pad_token_id, np.int64)
        ids[lane_rows] = batch.token_ids[group_rows]
        out["input_ids"] = ids
    for p in POOL_NAMES:
        table = batch.tables[p]
        rect = np.full((b, table.shape[1]), -1, np.int32)
        rect[: req.count] = table
        out[TABLE_FIELDS[p]] = rect
        slots = np.full(b * s, -1, np.int64)
        slots[lane_rows] = batch.slots[p][group_rows]
        out[SLOT_FIELDS[p]] = slots
    return out


def _lane_rows(start: np.ndarray, width: np.ndarray, lane_width: int) -> tuple[np.ndarray, np.ndarray]:
    """(rectangle rows, group rows) of every active row: lane r's rows ``r*S + j`` <- ``start[r] + j``, j < width."""
    owner, offset = expand_ranges(np.zeros(width.size, np.int64), width)
    return owner * lane_width + offset, start[owner] + offset


def from_upstream_decode(tensors: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                         pool_blocks: PoolBlocks | Mapping[str, int], *, request_ids: Any = None) -> PackedBatch:
    """The verify-only :class:`PackedBatch` of a decode rectangle (the inverse of :func:`to_upstream_decode`): the
    active lanes in lane order, each a verify request of ``active_widths[b]`` rows with logits at every row.

    Checked before anything is converted, every issue of a stage at once: dtypes and shapes (``upstream.shape``;
    ``array.missing``), ``active_widths`` in ``[0, S]`` and ``kv_seq_lens`` = anchor + width (0 on idle lanes)
    (``verify.width``), positions ``anchor + j`` on every active row (``positions.not_contiguous``) and slot -1 in
    every pool on every inactive row, so no clamped duplicate position near the limit carries a real slot
    (``padding.slot``). The batch is then validated as any other. request_ids: [active lanes] serving ids (default
    0..R-1)."""
    issues: list[Issue] = []
    names = [*DECODE_TENSORS, *TABLE_FIELDS.values(), *SLOT_FIELDS.values()]
    got: dict[str, np.ndarray] = {}
    for name in names:
        value = tensors.get(name)
        if value is None:
            if name != "input_ids":
                issues.append(Issue("array.missing", name, "decode tensor is absent", expected="present",
                                    actual="missing"))
            continue
        if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
            issues.append(subclass_issue(name, value))
            continue
        a = np.asarray(value)
        dtype = DECODE_TENSORS[name][0] if name in DECODE_TENSORS else (
            np.dtype(np.int32) if name in TABLE_FIELDS.values() else np.dtype(np.int64))
        ndim = 2 if name in TABLE_FIELDS.values() else 1
        if a.dtype != dtype or a.ndim != ndim:
            issues.append(Issue("upstream.shape", name, "decode tensor of another dtype or rank",
                                expected=(dtype.name, ndim), actual=(a.dtype.name, a.ndim)))
            continue
        got[name] = a
    if issues:
        raise ABIError(issues)
    widths, kv = got["active_widths"].astype(np.int64), got["kv_seq_lens"].astype(np.int64)
    b = widths.size
    rows = got["positions"].size
    s = rows // b if b else 0
    bad_rows = [n for n in names if n in got and got[n].ndim == 1 and n not in ("active_widths", "kv_seq_lens")
                and got[n].size != b * s]
    bad_lanes = [n for n in ("kv_seq_lens", *TABLE_FIELDS.values()) if got[n].shape[0] != b]
    if b == 0 or s * b != rows or bad_rows or bad_lanes:
        raise ABIError([Issue("upstream.shape", n, "the rectangle needs B lanes of S rows (tables: B rows)",
                              expected=f"B = {b}, S = {s}", actual=list(got[n].shape))
                        for n in (bad_rows + bad_lanes or ["positions"])])
    active = widths > 0
    lane = np.arange(b)
    anchor = kv - widths
    for mask, field, msg, expected, actual in (
            ((widths < 0) | (widths > s), "active_widths", f"active widths must lie in [0, S = {s}]",
             f"0..{s}", widths),
            (active & (anchor < 1), "kv_seq_lens", "kv_seq_lens must be anchor + width with an anchor >= 1",
             ">= width + 1", kv),
            (~active & (kv != 0), "kv_seq_lens", "an idle lane has kv_seq_lens 0", 0, kv)):
        hits = np.flatnonzero(mask)
        if hits.size:
            k = int(hits[0])
            issues.append(Issue("verify.width", field, msg, index=k, request=k, expected=expected,
                                actual=int(actual[k]), count=int(hits.size)))
    if issues:
        raise ABIError(issues)
    offset = np.tile(np.arange(s), b)
    row_active = offset < np.repeat(widths, s)
    want = np.repeat(anchor, s) + offset
    pos = got["positions"].astype(np.int64)
    wrong = np.flatnonzero(row_active & (pos != want))
    if wrong.size:
        k = int(wrong[0])
        issues.append(Issue("positions.not_contiguous", "positions", "an active row's position must be anchor + j",
                            index=k, request=k // s, expected=int(want[k]), actual=int(pos[k]),
                            count=int(wrong.size)))
    for p in POOL_NAMES:
        slot = got[SLOT_FIELDS[p]]
        real = np.flatnonzero(~row_active & (slot != -1))
        if real.size:
            k = int(real[0])
            issues.append(Issue("padding.slot", SLOT_FIELDS[p], "an inactive row of the rectangle (past its lane's "
                                "width, or an idle lane, e.g. a clamped duplicate position) must not write",
                                index=k, request=k // s, expected=-1, actual=int(slot[k]), count=int(real.size)))
    if issues:
        raise ABIError(issues)
    lanes = lane[active]
    width = widths[active]
    owner, offset = expand_ranges(np.zeros(width.size, np.int64), width)  # active rows, in lane order
    rect_rows = lanes[owner] * s + offset
    n = int(width.sum())
    p_rows = policy.padded_rows(n)
    qsl = np.zeros(lanes.size + 1, np.int32)
    np.cumsum(width, out=qsl[1:])
    positions = np.empty(p_rows, np.int32)
    positions[:n] = got["positions"][rect_rows]
    positions[n:] = policy.padding_positions(int(positions[n - 1]) if n else 0, p_rows - n)
    arrays: dict[str, np.ndarray] = {"query_start_loc": qsl, "positions": positions}
    for p in POOL_NAMES:
        arrays[TABLE_FIELDS[p]] = np.ascontiguousarray(got[TABLE_FIELDS[p]][lanes])
        slots = np.full(p_rows, policy.pad_slot, np.int64)
        slots[:n] = got[SLOT_FIELDS[p]][rect_rows]
        arrays[SLOT_FIELDS[p]] = slots
    arrays["request_ids"] = (np.arange(lanes.size, dtype=np.int64) if request_ids is None
                             else np.asarray(request_ids, np.int64))
    if "input_ids" in got:
        ids = np.full(p_rows, policy.pad_token_id, np.int64)
        ids[:n] = got["input_ids"][rect_rows]
        arrays["token_ids"] = ids
    mode = np.full(lanes.size, 2, np.int8)
    arrays["verify_widths"] = width.astype(np.int32)
    arrays["logit_mode"] = mode
    arrays["logit_rows"] = implied_logit_rows(qsl[:-1], qsl[1:], mode)
    return PackedBatch.from_arrays(arrays, config, policy, pool_blocks)
