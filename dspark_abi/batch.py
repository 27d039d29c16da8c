"""Frozen value objects of the metadata ABI: `RequestTables`, `SlotMappings`, `RankView`, `PackedBatch`.

Symbols (defined once, used everywhere): R requests; N live tokens = ``query_start_loc[-1]``;
TP ranks; P = align_up(N, TP) group rows; L = P / TP rank-local rows. Rows ``N..P-1`` are padding.
Every array is stored as a view of an immutable ``bytes`` copy, made once from the caller's array: mutating
the caller's array afterwards changes nothing, and no array a batch hands out (``to_arrays()``, tables, slot
mappings, rank views) can be made writeable again, not even through its ``base``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import suppress
from contextvars import ContextVar
from functools import cached_property
from typing import Any

import attrs
import numpy as np

from dspark_abi._base import array_eq
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, ValidationReport
from dspark_abi.fields import BATCH_FIELDS, BY_NAME, SLOT_FIELDS, SLOT_SPECS, TABLE_FIELDS, TABLE_SPECS
from dspark_abi.layout import POOL_NAMES, PoolName
from dspark_abi.lowering import lower_local_request_ids
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import PoolBlocks
from dspark_abi.ranks import merge_rank_arrays
from dspark_abi.requests import BatchRequests
from dspark_abi.validation import subclass_issue, validate_arrays

#: Set only by :meth:`PackedBatch.from_arrays` right after it validated the very arrays being frozen.
_ALREADY_VALIDATED: ContextVar[bool] = ContextVar("dspark_already_validated", default=False)


def _immutable(a: np.ndarray) -> bool:
    """True when ``a``'s memory is ultimately a ``bytes`` object, which no one can write or make writeable."""
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, bytes)


def freeze(value: Any, name: str = "array") -> np.ndarray:
    """``value`` as a C-contiguous array over an immutable ``bytes`` buffer, copied at most once.

    Keeps the dtype (dtype errors are the validator's job). An array that already lives in immutable memory
    (a frozen batch's array, a fixture read from bytes) is shared, not copied. ndarray subclasses raise
    ``array.dtype``: a masked array's mask would be silently dropped.
    """
    if isinstance(value, np.ndarray):
        if type(value) is not np.ndarray:
            raise ABIError([subclass_issue(name, value)])
        a = value
    else:
        a = np.asarray(value)
    if a.flags.c_contiguous and not a.flags.writeable and _immutable(a):
        return a
    if a.dtype.hasobject:  # no buffer to freeze: never a valid ABI array, the validator rejects it
        out = np.array(a, copy=True, order="C")
        out.flags.writeable = False
        return out
    return np.frombuffer(a.tobytes(order="C"), dtype=a.dtype).reshape(a.shape)


def _afield(name: str, optional: bool = False) -> Any:
    """An attrs field holding the ABI array ``name``: frozen on assignment (see :func:`freeze`), compared by value.

    (A helper, so mypy's attrs plugin takes these fields for defaulted ones, see PackedBatch.tables.)
    """
    def convert(value: Any) -> Any:
        return None if value is None else freeze(value, name)

    kw: dict[str, Any] = {"converter": convert, "eq": attrs.cmp_using(eq=array_eq)}
    if optional:
        kw["default"] = None
    return attrs.field(**kw)


class _PerPool:
    """Access by pool name and in ABI order, for the seven-field table and slot containers."""

    __slots__ = ()

    def __getitem__(self, pool: str) -> np.ndarray:
        array: np.ndarray = getattr(self, pool)
        return array

    def items(self) -> list[tuple[PoolName, np.ndarray]]:
        return [(p, getattr(self, p)) for p in POOL_NAMES]


@attrs.frozen
class RequestTables(_PerPool):
    """The seven per-request block tables, each ``[R, w]`` int32, request axis on dim 0; ``-1`` = unmapped.

    A ring pool's table (ori and the three state pools) holds logical page ``j`` of request ``r`` in column
    ``j % w``; a compressed pool's (csa_cmp, idx, hca_cmp) in column ``j``. Each table has its own width w, between
    the pages of the widest live range of the call and ``ModelConfig.layout.pools[p].table_width`` (spec 5.6).

    Attributes:
        ori: [R, w] int32: page pos//32 -> kv block (ring).
        csa_cmp: [R, w] int32: ratio-4 entry page c//32 -> block.
        hca_cmp: [R, w] int32: ratio-128 entry page c//32 -> block.
        idx: [R, w] int32: indexer entry page c//32 -> idx cache block.
        csa_state: [R, w] int32: state page pos//2 -> ratio-4 state block (ring).
        csa_inner_state: [R, w] int32: pos//2 -> indexer state block (ring).
        hca_state: [R, w] int32: pos//8 -> ratio-128 state block (ring).
    """

    ori: np.ndarray = _afield(TABLE_FIELDS["ori"])
    csa_cmp: np.ndarray = _afield(TABLE_FIELDS["csa_cmp"])
    hca_cmp: np.ndarray = _afield(TABLE_FIELDS["hca_cmp"])
    idx: np.ndarray = _afield(TABLE_FIELDS["idx"])
    csa_state: np.ndarray = _afield(TABLE_FIELDS["csa_state"])
    csa_inner_state: np.ndarray = _afield(TABLE_FIELDS["csa_inner_state"])
    hca_state: np.ndarray = _afield(TABLE_FIELDS["hca_state"])


@attrs.frozen
class SlotMappings(_PerPool):
    """The seven slot mappings, each ``[P]`` int64: flat physical row written by each group row, -1 = no write.

    ori and the three state mappings are set on every live token; csa_cmp, idx and hca_cmp only on
    ratio boundaries ((p+1) % ratio == 0). Padding rows are -1 everywhere.

    Attributes:
        ori: [P] int64: kv_cache row of position p; -1 on padding.
        csa_cmp: [P] int64: csa_cmp row of entry (p+1)/4-1 on boundaries, else -1.
        hca_cmp: [P] int64: hca_cmp row of entry (p+1)/128-1 on boundaries, else -1.
        idx: [P] int64: idx cache/scale row of entry (p+1)/4-1 on boundaries, else -1.
        csa_state: [P] int64: csa_compress_state row of p (page 2); -1 on padding.
        csa_inner_state: [P] int64: csa_inner_compress_state row of p (page 2).
        hca_state: [P] int64: hca_compress_state row of p (page 8); -1 on padding.
    """

    ori: np.ndarray = _afield(SLOT_FIELDS["ori"])
    csa_cmp: np.ndarray = _afield(SLOT_FIELDS["csa_cmp"])
    hca_cmp: np.ndarray = _afield(SLOT_FIELDS["hca_cmp"])
    idx: np.ndarray = _afield(SLOT_FIELDS["idx"])
    csa_state: np.ndarray = _afield(SLOT_FIELDS["csa_state"])
    csa_inner_state: np.ndarray = _afield(SLOT_FIELDS["csa_inner_state"])
    hca_state: np.ndarray = _afield(SLOT_FIELDS["hca_state"])


def _pool_blocks(value: Mapping[str, int] | PoolBlocks) -> PoolBlocks:
    return PoolBlocks.from_mapping(value)


class BatchGeometry:
    """R, N, P and L of a packed batch, read from its ``query_start_loc``, ``positions`` and ``tp_size``.

    Shared by :class:`PackedBatch` and the views that show a batch's rows (e.g. the CLI's layout of a
    fixture file, valid or not).
    """

    __slots__ = ()
    query_start_loc: np.ndarray
    positions: np.ndarray

    @property
    def tp_size(self) -> int:
        """TP."""
        raise NotImplementedError

    @property
    def num_requests(self) -> int:
        """R."""
        return len(self.query_start_loc) - 1

    @property
    def num_tokens(self) -> int:
        """N, live tokens."""
        return int(self.query_start_loc[-1])

    @property
    def padded_rows(self) -> int:
        """P = align_up(N, TP), the group rows (one per entry of ``positions``)."""
        return len(self.positions)

    @property
    def local_rows(self) -> int:
        """L = P / TP."""
        return self.padded_rows // self.tp_size

    @property
    def row_request(self) -> np.ndarray:
        """[P] int32: request owning each group row; -1 on padding rows."""
        return lower_local_request_ids(self.query_start_loc, 0, self.padded_rows)


@attrs.frozen
class RankView:
    """One rank's share of a packed batch: group rows ``[row_start, row_stop)`` (L of them).

    Attributes:
        rank: The rank r, in ``[0, TP)``.
        row_start: First group row of the rank, ``r * L``.
        row_stop: One past its last group row, ``(r + 1) * L``.
        positions: [L] int32: the rank's slice of ``positions`` (position_ids_local).
        local_request_ids: [L] int32: request owning each local row; -1 on padding rows.
        token_ids: [L] int64 or None: the rank's slice of token ids (input_ids).
        slots: The rank's [L] slices of the seven slot mappings (for inspection; kernels write with the full ones).
        requests: The batch's request record (replicated: every rank reads the tables of all R requests);
            ``local_request_ids`` is ``requests.owner_in(row_start, L)``.
    """

    rank: int
    row_start: int
    row_stop: int
    positions: np.ndarray
    local_request_ids: np.ndarray
    token_ids: np.ndarray | None
    slots: SlotMappings
    requests: BatchRequests | None = attrs.field(default=None, eq=False, repr=False)
    local: Mapping[str, np.ndarray] = attrs.field(factory=dict, eq=False, repr=False)
    """Flat ABI name -> the rank's [L] slice of every per-row field the batch carries (the fields
    :data:`dspark_abi.fields.FIELDS` declares with a leading ``P`` axis: positions, token ids, the seven slot
    mappings and any later one); ``positions``, ``token_ids`` and ``slots`` above are views of its entries."""


@attrs.frozen(eq=True)
class StepArrays(BatchGeometry):
    """The leading fields of a step in either form, declared once, and the geometry and row ownership both forms
    derive from them: the base of :class:`PackedBatch` (the full form) and of
    :class:`~dspark_abi.persistent.PersistentStep` (the persistent form, spec 5.9). Not built on its own.

    Attributes:
        config: The model configuration (table widths, limits).
        policy: The TP padding policy (P, L and the padding sentinels).
        pool_blocks: Physical blocks of each pool (a mapping is converted with :meth:`PoolBlocks.from_mapping`).
        query_start_loc: [R+1] int32: [0, q0, q0+q1, ..., N], non-decreasing.
        positions: [P] int32: absolute in-request position; padding rows per policy.

    The fields each form adds come after these, in its own order (a subclass's attrs fields follow its base's, so
    the optional trailing fields both forms carry, ``token_ids`` ... ``logit_mode``, are declared by each form with
    the one helper :func:`_afield`: sharing them through a base would move them before the form's own fields and
    change both positional constructors).
    """

    config: ModelConfig
    policy: PaddingPolicy
    pool_blocks: PoolBlocks = attrs.field(converter=_pool_blocks)
    query_start_loc: np.ndarray = _afield("query_start_loc")
    positions: np.ndarray = _afield("positions")
    #: The per-request record (:class:`~dspark_abi.requests.BatchRequests`), keyword-only (last in both
    #: constructors): built once, by the builder or from the arrays; not compared (it is derived from them). Filled
    #: in each form's ``__attrs_post_init__`` when not given: never None on a constructed step.
    requests: BatchRequests = attrs.field(default=None, eq=False, repr=False, kw_only=True)

    @property
    def tp_size(self) -> int:
        """TP."""
        return self.policy.tp_size

    @cached_property
    def row_request(self) -> np.ndarray:
        """[P] int32: request owning each group row; -1 on padding rows (``requests.row_request(P)``, computed
        once, read-only, shared with the builder: the one formula of both forms)."""
        return self.requests.row_request(self.padded_rows)


@attrs.frozen(eq=True)
class PackedBatch(StepArrays):
    """The whole metadata of one packed call (prefill chunks and verify requests) of one TP group. Constructing one
    validates it.

    Build with :class:`dspark_abi.BatchBuilder` (serving code) or directly from arrays; any violation
    raises :class:`ABIError` listing every issue. Read-only; change with ``attrs.evolve`` (re-validates).

    Attributes (after :class:`StepArrays`'s config, policy, pool_blocks, query_start_loc and positions):
        tables: The seven [R, width] int32 block tables.
        slots: The seven [P] int64 slot mappings.
        request_ids: [R] int64: serving request ids, unique; default 0..R-1.
        token_ids: [P] int64: token ids (MoE hash routing); padding = pad_token_id.
        logit_rows: [M] int32: group rows in [0, N) to sample; -1 = inactive.
        verify_widths: [R] int32 (since 1.2): 0 = prefill chunk, w >= 1 = verify request of w rows; None = all 0.
        logit_mode: [R] int8 (since 1.2): output intent, 0 none, 1 last row, 2 every row; None = 1.1's logit_rows.
        requests: The per-request record (:class:`~dspark_abi.requests.BatchRequests`): built once, by the
            builder or from the arrays above; not compared (it is derived from them) and re-derived when it does
            not describe them (e.g. after ``attrs.evolve``).
    """

    # config, policy, pool_blocks, query_start_loc, positions and the keyword-only requests: StepArrays's
    # mypy's attrs plugin cannot see through _afield and takes the array fields above for defaulted ones
    tables: RequestTables = attrs.field()  # type: ignore[misc]
    slots: SlotMappings = attrs.field()  # type: ignore[misc]
    request_ids: np.ndarray | None = _afield("request_ids", True)
    token_ids: np.ndarray | None = _afield("token_ids", True)
    logit_rows: np.ndarray | None = _afield("logit_rows", True)
    verify_widths: np.ndarray | None = _afield("verify_widths", True)
    logit_mode: np.ndarray | None = _afield("logit_mode", True)

    def __attrs_post_init__(self) -> None:
        if self.request_ids is None:
            ids = np.arange(max(len(self.query_start_loc) - 1, 0), dtype=np.int64)
            object.__setattr__(self, "request_ids", freeze(ids))
        trusted = _ALREADY_VALIDATED.get()       # from_arrays: the record (if any) was made with these arrays
        if not trusted:
            validate_arrays(self.to_arrays(), self.config, self.policy, self.pool_blocks).raise_if_invalid()
        given: BatchRequests | None = self.requests
        args = (self.query_start_loc, self.positions, self.request_ids, self.logit_rows, self.verify_widths,
                self.logit_mode)
        if given is None or not (trusted or given.agrees_with(*args)):
            object.__setattr__(self, "requests", BatchRequests.from_arrays(*args))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                    pool_blocks: Mapping[str, int] | PoolBlocks, *,
                    validator: Callable[[Mapping[str, Any]], ValidationReport] | None = None,
                    requests: BatchRequests | None = None) -> PackedBatch:
        """Build from flat ABI field names (``query_start_loc``, ``positions``, ``<pool>_block_table``,
        ``<pool>_slot_mapping``, optional ``request_ids``, ``token_ids``, ``logit_rows``). Validates first,
        so a malformed mapping raises :class:`ABIError` with every issue and nothing is built.

        validator: checks the arrays instead of the full stateless validation, e.g. a serving loop's
        :meth:`dspark_abi.incremental.StepValidator.validate` (which agrees with it, at the cost of what the
        step changes).

        requests: the batch's request record when the caller made it from these very arrays' requests (the
        builder does); by default it is derived from the arrays."""
        if validator is None:
            validate_arrays(arrays, config, policy, pool_blocks).raise_if_invalid()
        else:   # frozen first, so that a stateful validator keeps references to immutable arrays, not copies
            with suppress(ABIError):    # an ndarray subclass: the validator reports it with everything else
                arrays = {k: None if v is None else freeze(v, k) for k, v in arrays.items()}
            validator(arrays).raise_if_invalid()
        token = _ALREADY_VALIDATED.set(True)  # the arrays were just checked; freezing copies them unchanged
        try:
            # every declared field: a per-pool one into its container, any other into its attribute
            own: dict[str, Any] = {f.name: arrays[f.name] if f.required else arrays.get(f.name)
                                   for f in BATCH_FIELDS if f.family is None}
            return cls(config=config, policy=policy, pool_blocks=pool_blocks,
                       tables=RequestTables(**{p: arrays[f.name] for p, f in TABLE_SPECS.items()}),
                       slots=SlotMappings(**{p: arrays[f.name] for p, f in SLOT_SPECS.items()}),
                       requests=requests, **own)  # type: ignore[arg-type]  # None: derived in __attrs_post_init__
        finally:
            _ALREADY_VALIDATED.reset(token)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat ABI field name -> array (the names fixture files use)."""
        out: dict[str, np.ndarray] = {}
        for f in BATCH_FIELDS:     # in ABI order; absent optional fields are left out
            value = getattr(self, f.name) if f.family is None else getattr(self, f.family)[f.pool]
            if value is not None:
                out[f.name] = value
        return out

    # ------------------------------------------------------------------ geometry (R, N, P, L, row_request: StepArrays)
    @property
    def request_lengths(self) -> np.ndarray:
        """[R] int64: new tokens per request (``requests.lengths``)."""
        return self.requests.lengths

    @cached_property
    def request_starts(self) -> np.ndarray:
        """[R] int64: first new position of each request (its cached-token count); -1 for empty requests."""
        return freeze(self.requests.starts)

    def rank(self, r: int) -> RankView:
        """Rank ``r``'s contiguous rows ``[r*L, (r+1)*L)``, its positions and ``local_request_ids``."""
        bad_rank = self.policy.rank_issues(r)
        if bad_rank:
            raise ABIError(bad_rank)
        lo, hi = self.policy.rank_rows(r, self.num_tokens)
        # every declared per-row field ([P] first axis), sliced: the declarations say which they are
        local = {name: array[lo:hi] for name, array in self.to_arrays().items() if BY_NAME[name].shape[0] == "P"}
        return RankView(
            rank=r, row_start=lo, row_stop=hi, positions=local["positions"],
            local_request_ids=self.row_request[lo:hi],   # the batch's one ownership array, sliced
            token_ids=local.get("token_ids"),
            slots=SlotMappings(**{p: local[n] for p, n in SLOT_FIELDS.items()}), requests=self.requests,
            local=local,
        )

    @classmethod
    def from_rank_arrays(cls, per_rank: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                         pool_blocks: Mapping[str, int] | PoolBlocks) -> PackedBatch:
        """Build from arrays with a leading rank axis ``[TP, ...]``, the form a per-rank host entry takes.

        Replicated fields (``query_start_loc``, tables, ``positions_full``/``positions``, slot mappings,
        ``request_ids``, ``logit_rows``) must be identical on every rank; local fields (``positions_local``
        [TP, L], ``token_ids_local`` [TP, L]) must equal each rank's slice of the full ones.
        """
        return cls.from_arrays(merge_rank_arrays(per_rank, policy), config, policy, pool_blocks)

    def with_logit_rows(self, rows: Any) -> PackedBatch:
        """A copy with other logit rows (validated)."""
        return attrs.evolve(self, logit_rows=np.asarray(rows, dtype=np.int32))
