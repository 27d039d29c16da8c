"""Frozen value objects of the metadata ABI: `RequestTables`, `SlotMappings`, `PoolBlocks`, `PackedBatch`.

Symbols (defined once, used everywhere): R requests; N live tokens = ``query_start_loc[-1]``;
TP ranks; P = align_up(N, TP) group rows; L = P / TP rank-local rows. Rows ``N..P-1`` are padding.
Every array is stored as a read-only copy: mutating the caller's array afterwards changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from functools import cached_property
from typing import Any

import attrs
import numpy as np

from dspark_abi._base import array_eq
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_abi.layout import POOL_NAMES, PoolName
from dspark_abi.policy import PaddingPolicy

#: Set only by :meth:`PackedBatch.from_arrays` right after it validated the very arrays being frozen.
_ALREADY_VALIDATED: ContextVar[bool] = ContextVar("dspark_already_validated", default=False)

TABLE_FIELDS: dict[PoolName, str] = {p: f"{p}_block_table" for p in POOL_NAMES}
SLOT_FIELDS: dict[PoolName, str] = {p: f"{p}_slot_mapping" for p in POOL_NAMES}


def _ro(value: Any) -> Any:
    """Freeze an array without changing its dtype (dtype errors are the validator's job)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray) and not value.flags.writeable and value.base is None \
            and value.flags.c_contiguous:
        return value  # already a private frozen buffer (e.g. produced by the builder)
    out = np.array(value, copy=True, order="C")
    out.flags.writeable = False
    return out


def _afield(doc: str, optional: bool = False) -> Any:
    kw: dict[str, Any] = {"converter": _ro, "eq": attrs.cmp_using(eq=array_eq), "metadata": {"doc": doc}}
    if optional:
        kw["default"] = None
    return attrs.field(**kw)


@attrs.frozen
class RequestTables:
    """The seven per-request block tables, each ``[R, width]`` int32, request axis on dim 0.

    Entry ``[r, i]`` is the physical block of logical page ``i`` of request ``r``; ``-1`` = unmapped.
    Widths come from ``ModelConfig.layout`` (FLASH: 512, 128, 4, 128, 8192, 8192, 2048).
    """

    ori: np.ndarray = _afield("[R, ceil(max_pos/32)] int32: page pos//32 -> kv block; -1 unmapped")
    csa_cmp: np.ndarray = _afield("[R, ceil(max_pos/4/32)] int32: ratio-4 entry page c//32 -> block; -1 unmapped")
    hca_cmp: np.ndarray = _afield("[R, ceil(max_pos/128/32)] int32: ratio-128 entry page c//32 -> block")
    idx: np.ndarray = _afield("[R, ceil(max_pos/4/32)] int32: indexer entry page c//32 -> idx cache block")
    csa_state: np.ndarray = _afield("[R, ceil(max_pos/2)] int32: state page pos//2 -> ratio-4 state block")
    csa_inner_state: np.ndarray = _afield("[R, ceil(max_pos/2)] int32: pos//2 -> indexer state block")
    hca_state: np.ndarray = _afield("[R, ceil(max_pos/8)] int32: pos//8 -> ratio-128 state block")

    def __getitem__(self, pool: str) -> np.ndarray:
        return getattr(self, pool)  # type: ignore[no-any-return]

    def items(self) -> list[tuple[PoolName, np.ndarray]]:
        return [(p, getattr(self, p)) for p in POOL_NAMES]


@attrs.frozen
class SlotMappings:
    """The seven slot mappings, each ``[P]`` int64: flat physical row written by each group row, -1 = no write.

    ori and the three state mappings are set on every live token; csa_cmp, idx and hca_cmp only on
    ratio boundaries ((p+1) % ratio == 0). Padding rows are -1 everywhere.
    """

    ori: np.ndarray = _afield("[P] int64: kv_cache row of position p; -1 on padding")
    csa_cmp: np.ndarray = _afield("[P] int64: csa_cmp row of entry (p+1)/4-1 on boundaries, else -1")
    hca_cmp: np.ndarray = _afield("[P] int64: hca_cmp row of entry (p+1)/128-1 on boundaries, else -1")
    idx: np.ndarray = _afield("[P] int64: idx cache/scale row of entry (p+1)/4-1 on boundaries, else -1")
    csa_state: np.ndarray = _afield("[P] int64: csa_compress_state row of p (page 2); -1 on padding")
    csa_inner_state: np.ndarray = _afield("[P] int64: csa_inner_compress_state row of p (page 2)")
    hca_state: np.ndarray = _afield("[P] int64: hca_compress_state row of p (page 8); -1 on padding")

    def __getitem__(self, pool: str) -> np.ndarray:
        return getattr(self, pool)  # type: ignore[no-any-return]

    def items(self) -> list[tuple[PoolName, np.ndarray]]:
        return [(p, getattr(self, p)) for p in POOL_NAMES]


@attrs.frozen
class PoolBlocks:
    """Physical block count of each pool (the bound for table entries and slots)."""

    ori: int
    csa_cmp: int
    hca_cmp: int
    idx: int
    csa_state: int
    csa_inner_state: int
    hca_state: int

    @classmethod
    def from_mapping(cls, blocks: Mapping[str, int] | PoolBlocks) -> PoolBlocks:
        if isinstance(blocks, PoolBlocks):
            return blocks
        missing = [p for p in POOL_NAMES if p not in blocks]
        extra = [k for k in blocks if k not in POOL_NAMES]
        bad = [p for p in POOL_NAMES if p in blocks and (not isinstance(blocks[p], int | np.integer) or blocks[p] < 1)]
        if missing or extra or bad:
            raise ABIError([Issue("pools.blocks", "pool_blocks", "every pool needs a positive integer block count",
                                  expected=list(POOL_NAMES), actual={"missing": missing, "extra": extra, "bad": bad})])
        return cls(**{p: int(blocks[p]) for p in POOL_NAMES})

    @classmethod
    def uniform(cls, blocks: int) -> PoolBlocks:
        return cls(**dict.fromkeys(POOL_NAMES, blocks))

    def __getitem__(self, pool: str) -> int:
        return getattr(self, pool)  # type: ignore[no-any-return]

    def as_dict(self) -> dict[str, int]:
        return {p: getattr(self, p) for p in POOL_NAMES}


@attrs.frozen
class RankView:
    """One rank's share of a packed batch: group rows ``[row_start, row_stop)`` (L of them)."""

    rank: int
    row_start: int
    row_stop: int
    positions: np.ndarray
    """[L] int32: the rank's slice of ``positions`` (position_ids_local)."""
    local_request_ids: np.ndarray
    """[L] int32: request owning each local row; -1 on padding rows."""
    token_ids: np.ndarray | None
    """[L] int64 or None: the rank's slice of token ids (input_ids)."""
    slots: SlotMappings
    """The rank's [L] slices of the seven slot mappings (for inspection; kernels write with the full ones)."""


@attrs.frozen(eq=True)
class PackedBatch:
    """The whole metadata of one packed prefill call of one TP group. Constructing one validates it.

    Build with :class:`dspark_abi.BatchBuilder` (serving code) or directly from arrays; any violation
    raises :class:`ABIError` listing every issue. Read-only; change with ``attrs.evolve`` (re-validates).
    """

    config: ModelConfig
    policy: PaddingPolicy
    pool_blocks: PoolBlocks = attrs.field(converter=PoolBlocks.from_mapping)
    query_start_loc: np.ndarray = _afield("[R+1] int32: [0, q0, q0+q1, ..., N], non-decreasing")
    positions: np.ndarray = _afield("[P] int32: absolute in-request position; padding rows per policy")
    tables: RequestTables = attrs.field()
    slots: SlotMappings = attrs.field()
    request_ids: np.ndarray | None = _afield("[R] int64: serving request ids, unique; default 0..R-1", True)
    token_ids: np.ndarray | None = _afield("[P] int64: token ids (MoE hash routing); padding = pad_token_id", True)
    logit_rows: np.ndarray | None = _afield("[M] int32: group rows in [0, N) to sample; -1 = inactive", True)

    def __attrs_post_init__(self) -> None:
        if self.request_ids is None:
            ids = np.arange(max(len(self.query_start_loc) - 1, 0), dtype=np.int64)
            object.__setattr__(self, "request_ids", _ro(ids))
        if _ALREADY_VALIDATED.get():
            return
        from dspark_abi.validate import validate_arrays

        validate_arrays(self.to_arrays(), self.config, self.policy, self.pool_blocks).raise_if_invalid()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                    pool_blocks: Mapping[str, int] | PoolBlocks) -> PackedBatch:
        """Build from flat ABI field names (``query_start_loc``, ``positions``, ``<pool>_block_table``,
        ``<pool>_slot_mapping``, optional ``request_ids``, ``token_ids``, ``logit_rows``). Validates first,
        so a malformed mapping raises :class:`ABIError` with every issue and nothing is built."""
        from dspark_abi.validate import validate_arrays

        validate_arrays(arrays, config, policy, pool_blocks).raise_if_invalid()
        token = _ALREADY_VALIDATED.set(True)  # the arrays were just checked; freezing copies them unchanged
        try:
            return cls(
                config=config, policy=policy, pool_blocks=pool_blocks,
                query_start_loc=arrays["query_start_loc"], positions=arrays["positions"],
                tables=RequestTables(**{p: arrays[f] for p, f in TABLE_FIELDS.items()}),
                slots=SlotMappings(**{p: arrays[f] for p, f in SLOT_FIELDS.items()}),
                request_ids=arrays.get("request_ids"), token_ids=arrays.get("token_ids"),
                logit_rows=arrays.get("logit_rows"),
            )
        finally:
            _ALREADY_VALIDATED.reset(token)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat ABI field name -> array (the names fixture files use)."""
        out: dict[str, np.ndarray] = {"query_start_loc": self.query_start_loc, "positions": self.positions}
        out.update({TABLE_FIELDS[p]: a for p, a in self.tables.items()})
        out.update({SLOT_FIELDS[p]: a for p, a in self.slots.items()})
        for name in ("request_ids", "token_ids", "logit_rows"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    # ------------------------------------------------------------------ geometry
    @property
    def num_requests(self) -> int:
        """R."""
        return len(self.query_start_loc) - 1

    @property
    def num_tokens(self) -> int:
        """N, live tokens."""
        return int(self.query_start_loc[-1])

    @property
    def tp_size(self) -> int:
        """TP."""
        return self.policy.tp_size

    @property
    def padded_rows(self) -> int:
        """P = align_up(N, TP)."""
        return self.policy.padded_rows(self.num_tokens)

    @property
    def local_rows(self) -> int:
        """L = P / TP."""
        return self.padded_rows // self.tp_size

    @property
    def request_lengths(self) -> np.ndarray:
        """[R] int64: new tokens per request."""
        return np.diff(self.query_start_loc.astype(np.int64))

    @cached_property
    def row_request(self) -> np.ndarray:
        """[P] int32: request owning each group row; -1 on padding rows."""
        from dspark_abi.lowering import lower_local_request_ids

        return lower_local_request_ids(self.query_start_loc, 0, self.padded_rows)

    @cached_property
    def request_starts(self) -> np.ndarray:
        """[R] int64: first new position of each request (its cached-token count); -1 for empty requests."""
        qsl = self.query_start_loc.astype(np.int64)
        out = np.full(self.num_requests, -1, dtype=np.int64)
        live = qsl[1:] > qsl[:-1]
        out[live] = self.positions[qsl[:-1][live]]
        out.flags.writeable = False
        return out

    def rank(self, r: int) -> RankView:
        """Rank ``r``'s contiguous rows ``[r*L, (r+1)*L)``, its positions and ``local_request_ids``."""
        if not 0 <= r < self.tp_size:
            raise ABIError([Issue("rank.index", "rank", f"rank {r} does not exist in a TP-{self.tp_size} group",
                                  expected=f"0 <= rank < {self.tp_size}", actual=r)])
        from dspark_abi.lowering import lower_local_request_ids

        lo, hi = r * self.local_rows, (r + 1) * self.local_rows
        return RankView(
            rank=r, row_start=lo, row_stop=hi, positions=self.positions[lo:hi],
            local_request_ids=lower_local_request_ids(self.query_start_loc, lo, self.local_rows),
            token_ids=None if self.token_ids is None else self.token_ids[lo:hi],
            slots=SlotMappings(**{p: a[lo:hi] for p, a in self.slots.items()}),
        )

    @classmethod
    def from_rank_arrays(cls, per_rank: Mapping[str, Any], config: ModelConfig, policy: PaddingPolicy,
                         pool_blocks: Mapping[str, int] | PoolBlocks) -> PackedBatch:
        """Build from arrays with a leading rank axis ``[TP, ...]``, the form a per-rank host entry takes.

        Replicated fields (``query_start_loc``, tables, ``positions_full``/``positions``, slot mappings,
        ``request_ids``, ``logit_rows``) must be identical on every rank; local fields (``positions_local``
        [TP, L], ``token_ids_local`` [TP, L]) must equal each rank's slice of the full ones.
        """
        from dspark_abi.ranks import merge_rank_arrays

        return cls.from_arrays(merge_rank_arrays(per_rank, policy), config, policy, pool_blocks)

    def with_logit_rows(self, rows: Any) -> PackedBatch:
        """A copy with other logit rows (validated)."""
        return attrs.evolve(self, logit_rows=np.asarray(rows, dtype=np.int32))
