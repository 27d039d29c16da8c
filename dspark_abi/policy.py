"""`PaddingPolicy`: how a packed batch is padded to the TP group's row count, in one object."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationError, model_validator

from dspark_abi._base import StrictModel, align_up
from dspark_abi.config import issues_from_pydantic
from dspark_abi.errors import ABIError, Issue
from dspark_abi.layout import GROUP_CAPACITY

#: Default largest N of a group: upstream's group capacity (:data:`dspark_abi.layout.GROUP_CAPACITY`).
DEFAULT_TOKEN_CAP = GROUP_CAPACITY


class PaddingPolicy(StrictModel):
    """Tensor-parallel padding rules of one TP group.

    The N live tokens are padded to ``P = align_up(N, tp_size)`` rows so that every rank owns
    ``L = P / tp_size`` contiguous rows. Rows ``N..P-1`` are padding rows.
    """

    # An invalid value or combination raises ABIError with one config.invalid issue per problem (field
    # "PaddingPolicy:<key>"), from the constructor and model_validate(_json) alike; a policy nested in a manifest
    # is checked by the manifest's own validation. (Not in the docstring: that is the JSON Schema's description.)
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ABIError(issues_from_pydantic(exc, prefix="PaddingPolicy")) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> PaddingPolicy:
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise ABIError(issues_from_pydantic(exc, prefix="PaddingPolicy")) from None

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> PaddingPolicy:
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as exc:
            raise ABIError(issues_from_pydantic(exc, prefix="PaddingPolicy")) from None

    tp_size: int = Field(default=1, ge=1, le=64)
    """Ranks in the TP group (TP); rank r owns rows [r*L, (r+1)*L)."""
    token_cap: int = Field(default=DEFAULT_TOKEN_CAP, ge=1)
    """Largest N accepted (upstream's group capacity is 8192)."""
    pad_slot: Literal[-1] = -1
    """Slot-mapping value of padding rows in all seven mappings: never write (vLLM's PAD_SLOT_ID)."""
    pad_request_id: Literal[-1] = -1
    """Local request id of padding rows (owned by no request)."""
    pad_position: Literal["zero", "continue"] = "zero"
    """Positions of padding rows: 'zero' puts 0 (always inside every RoPE table); 'continue'
    continues the last live row's position (p_last + 1, p_last + 2, ..., upstream's b1 fixture),
    which must stay < max_position_embeddings."""
    pad_token_id: int = Field(default=0, ge=0)
    """Token id of padding rows (when token ids are given)."""
    allow_empty_requests: bool = True
    """Accept requests with zero new tokens (``query_start_loc[r] == query_start_loc[r+1]``), e.g. repeated
    terminal boundaries: a group with fewer requests than its dispatch's fixed R repeats N at the tail."""
    allow_inactive: bool = False
    """Accept an *inactive* group: ``query_start_loc`` all zero (N = 0, so P = L = 0 rows). Kernels then
    write no cache row and return zero outputs and logits, with every logit row -1. Off by default, where
    N = 0 is the mistake ``qsl.token_count`` reports."""

    @model_validator(mode="after")
    def _inactive_groups_have_empty_requests(self) -> PaddingPolicy:
        if self.allow_inactive and not self.allow_empty_requests:
            raise ValueError("allow_inactive=True needs allow_empty_requests=True: an inactive group's requests "
                             "are all empty")
        return self

    def padded_rows(self, num_tokens: int) -> int:
        """P for N live tokens."""
        return align_up(num_tokens, self.tp_size)

    def rank_issues(self, rank: object, *, whole_group: bool = False) -> list[Issue]:
        """``rank.index`` unless ``rank`` is an integer (Python or numpy, not bool) in ``[0, tp_size)``, or None
        when ``whole_group`` allows it: the one statement of the rank bounds (rank views, plans, kernel checks)."""
        if rank is None and whole_group:
            return []
        if not isinstance(rank, bool | np.bool_) and isinstance(rank, int | np.integer) and 0 <= rank < self.tp_size:
            return []
        bounds = f"0 <= rank < {self.tp_size}"
        return [Issue("rank.index", "rank", f"rank {rank!r} does not exist in a TP-{self.tp_size} group",
                      expected=f"None or {bounds}" if whole_group else bounds, actual=repr(rank))]

    def rank_rows(self, rank: int, num_tokens: int) -> tuple[int, int]:
        """Group rows ``[r * L, (r + 1) * L)`` of rank ``r`` (checked with :meth:`rank_issues`) for N live tokens."""
        local = self.padded_rows(num_tokens) // self.tp_size
        return int(rank) * local, (int(rank) + 1) * local

    def padding_positions(self, last_position: int, count: int) -> np.ndarray:
        """[count] int64 positions of the padding rows after a last live row at ``last_position``: the one home
        of the padding-position rule (the builder writes it, the validator and the kernels' input checks read
        it). 'zero' gives 0s; 'continue' gives last_position + 1, + 2, ..."""
        if self.pad_position == "zero":
            return np.zeros(count, dtype=np.int64)
        return int(last_position) + 1 + np.arange(count, dtype=np.int64)
