"""Every ABI field declared once: name, dtype, symbolic shape, padding, scope, required or optional, since when.

:data:`FIELDS` is the one list of the arrays a packed batch (or a fixture file) carries, in ABI order (the order of
``PackedBatch.to_arrays()``, of a canonical fixture file and of spec section 4.1). Everything that lists fields reads
it: the validator's presence / dtype / rank / row-count checks, ``PackedBatch.from_arrays`` / ``to_arrays``, the
fixture manifest's tensor names, the per-rank host form (:mod:`dspark_abi.ranks`), upstream's tensor names
(:mod:`dspark_abi.upstream`), the JSON Schema and the spec's field table (:func:`field_table`, written and
drift-checked by :mod:`dspark_abi.io.spec_table`).

A new field is one :class:`FieldSpec` here plus its rules (value rules in :mod:`dspark_abi.rules`, codes in
:mod:`dspark_abi.errors`) and, for a batch field, its attribute on ``PackedBatch``.

Symbols of the shapes: R requests; K the config's ``dspark_block_size``; N live tokens; P = align_up(N, TP) group
rows (rows ``N..P-1`` are padding); L = P / TP rank rows; G logit rows; ``w_<pool>`` the column count of that pool's
table (spec 5.6); ``...`` any trailing axes.
"""

from __future__ import annotations

from typing import Literal

import attrs

from dspark_abi.layout import POOL_NAMES, PoolName

#: replicated: every rank of a TP group holds the whole array (in the per-rank host form: ``[TP, ...]``, identical
#: on every rank). rank_local: rank r holds its L rows ``[r*L, (r+1)*L)`` (per-rank form: ``[TP, L]``).
Scope = Literal["replicated", "rank_local"]
#: What padding rows ``[N, P)`` hold: a :class:`~dspark_abi.policy.PaddingPolicy` attribute naming the value
#: (``pad_slot``, ``pad_position``, ``pad_token_id``), ``"zero"``, or None for a field without a row axis of P.
Padding = Literal["pad_slot", "pad_position", "pad_token_id", "zero"] | None


@attrs.frozen
class FieldSpec:
    """One ABI field.

    Attributes:
        name: Flat ABI name (``PackedBatch.to_arrays()`` key, fixture tensor name unless ``tensor`` says otherwise).
        dtype: numpy dtype name of the elements; ``"floating"`` for any floating dtype (float32, bfloat16, ...).
        shape: Symbolic shape, one symbol per axis (``("R+1",)``, ``("P",)``, ``("R", "w_ori")``, ``("P", "...")``).
        padding: Value of padding rows (see :data:`Padding`).
        scope: Replicated or rank-local in a TP group (see :data:`Scope`).
        required: A batch must carry it (else ``array.missing``).
        since: ABI version that introduced it (``major.minor``).
        meaning: One line: what an entry means (markdown, as the spec's field table shows it).
        padding_doc: What padding rows hold, in words (the spec table's last column).
        pool: The pool of a per-pool field (block table or slot mapping), else None.
        family: ``PackedBatch`` attribute holding the per-pool containers (``"tables"``, ``"slots"``), else None.
        tensor: Name of the fixture tensor when it is not ``name`` (``extra.hidden``).
        in_batch: Carried by ``PackedBatch`` and its flat arrays (False: a side input of validation, ``hidden``).
        per_rank: Name in the per-rank host form (spec 4.3) of the whole (replicated) array, when not ``name``.
        local: Name in the per-rank host form of the ``[TP, L]`` rank slices, when the form has them.
        upstream: Name of upstream's ``l3_prefill_fwd`` tensor holding the whole array (spec 5.7), if any.
        upstream_local: Name of upstream's tensor holding the rank slices, if any.
    """

    name: str
    dtype: str
    shape: tuple[str, ...]
    padding: Padding
    scope: Scope
    required: bool
    since: str
    meaning: str
    padding_doc: str
    pool: PoolName | None = None
    family: Literal["tables", "slots"] | None = None
    tensor: str | None = None
    in_batch: bool = True
    per_rank: str | None = None
    local: str | None = None
    upstream: str | None = None
    upstream_local: str | None = None

    @property
    def ndim(self) -> int:
        """Number of axes (``...`` counts as one: the validator asks for at least this many)."""
        return len(self.shape)

    @property
    def file_name(self) -> str:
        """Name of the tensor in a fixture file."""
        return self.tensor or self.name

    @property
    def per_rank_name(self) -> str:
        """Name of the whole array in the per-rank host form."""
        return self.per_rank or self.name

    def shape_text(self) -> str:
        """The shape as the spec writes it, e.g. ``[R, w_ori]``."""
        return "[" + ", ".join(self.shape) + "]"

    def as_json(self) -> dict[str, object]:
        """The declaration as JSON (the schema's ``x-dspark-fields``)."""
        return {"name": self.name, "tensor": self.file_name, "dtype": self.dtype, "shape": list(self.shape),
                "padding": self.padding, "scope": self.scope, "required": self.required, "since": self.since}


# ------------------------------------------------------------------------------------------------ the pool families
#: Per pool: the meaning of its block table's entries (ring tables: column ``j mod w``; compressed: column j).
_TABLE_MEANING: dict[PoolName, str] = {
    "ori": "ring: page `j = p div 32` → `ori` block, in column `j mod w_ori`; -1 unmapped",
    "csa_cmp": "ratio-4 entry page `c div 32` → block, in column `c div 32`",
    "hca_cmp": "ratio-128 entry page `c div 32` → block, in column `c div 32`",
    "idx": "ratio-4 entry page `c div 32` → indexer cache (and scale) block, in column `c div 32`",
    "csa_state": "ring: state page `j = p div 2` → ratio-4 state block, in column `j mod w_csa_state`",
    "csa_inner_state": "ring: state page `j = p div 2` → indexer-compressor state block, in column "
                       "`j mod w_csa_inner_state`",
    "hca_state": "ring: state page `j = p div 8` → ratio-128 state block, in column `j mod w_hca_state`",
}
#: Per pool: which rows its slot mapping sets (every live row, or ratio boundaries only).
_SLOT_MEANING: dict[PoolName, str] = {
    "ori": "`ori` slot written by the row (every live row)",
    "csa_cmp": "`csa_cmp` slot of entry `(p+1)/4 − 1` on ratio-4 boundaries, else -1",
    "hca_cmp": "`hca_cmp` slot of entry `(p+1)/128 − 1` on ratio-128 boundaries, else -1",
    "idx": "`idx` slot (cache and scale) of entry `(p+1)/4 − 1` on ratio-4 boundaries, else -1",
    "csa_state": "`csa_state` slot of position p (every live row)",
    "csa_inner_state": "`csa_inner_state` slot of position p (every live row)",
    "hca_state": "`hca_state` slot of position p (every live row)",
}
#: Upstream's name of a pool's block table (its compressor state tables say ``compress_state``).
_UPSTREAM_TABLE: dict[PoolName, str] = {p: f"{p}_block_table" for p in POOL_NAMES} | {
    p: f"{p.removesuffix('_state')}_compress_state_block_table" for p in ("csa_state", "csa_inner_state", "hca_state")}
#: Upstream's name of a pool's slot mapping (the indexer's is ``csa_idx``).
_UPSTREAM_SLOT: dict[PoolName, str] = {p: f"{p}_slot_mapping_full" for p in POOL_NAMES} | {
    "idx": "csa_idx_slot_mapping_full"}


def _block_table(pool: PoolName) -> FieldSpec:
    return FieldSpec(f"{pool}_block_table", "int32", ("R", f"w_{pool}"), None, "replicated", True, "1.0",
                     _TABLE_MEANING[pool], "– (request axis)" if pool == "ori" else "–", pool=pool, family="tables",
                     upstream=_UPSTREAM_TABLE[pool])


def _slot_mapping(pool: PoolName) -> FieldSpec:
    return FieldSpec(f"{pool}_slot_mapping", "int64", ("P",), "pad_slot", "replicated", True, "1.0",
                     _SLOT_MEANING[pool], "-1", pool=pool, family="slots", upstream=_UPSTREAM_SLOT[pool])


#: Block table of each pool, ``[R, w_pool]`` int32 (one declaration family over POOL_NAMES).
TABLE_SPECS: dict[PoolName, FieldSpec] = {p: _block_table(p) for p in POOL_NAMES}
#: Slot mapping of each pool, ``[P]`` int64.
SLOT_SPECS: dict[PoolName, FieldSpec] = {p: _slot_mapping(p) for p in POOL_NAMES}

# ------------------------------------------------------------------------------------------------ every field
#: Every ABI field, in ABI order.
FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("query_start_loc", "int32", ("R+1",), None, "replicated", True, "1.0",
              "prefix offsets `[0, q_0, q_0+q_1, ..., N]`; request r owns rows `[qsl[r], qsl[r+1])`",
              "not covered: `qsl[R] = N`", upstream="query_start_loc"),
    FieldSpec("positions", "int32", ("P",), "pad_position", "replicated", True, "1.0",
              "absolute in-request position of each row (`s_r + k` for the k-th new token of r)",
              '0 (`pad_position = "zero"`) or `positions[N-1] + 1 + (t - N)` (`"continue"`)',
              per_rank="positions_full", local="positions_local", upstream="position_ids_full",
              upstream_local="position_ids_local"),
    *TABLE_SPECS.values(),
    *SLOT_SPECS.values(),
    FieldSpec("request_ids", "int64", ("R",), None, "replicated", False, "1.0",
              "serving id of each request, pairwise distinct; absent means `0..R-1`", "–"),
    FieldSpec("token_ids", "int64", ("P",), "pad_token_id", "rank_local", False, "1.0",
              "input token id of each row (MoE hash routing)", "`pad_token_id` (default 0)",
              local="token_ids_local", upstream_local="input_ids"),
    FieldSpec("logit_rows", "int32", ("G",), None, "replicated", False, "1.0",
              "group rows to sample, in `[0, N)`; -1 = inactive entry (e.g. a zero-length request)", "–",
              upstream="logit_row_indices"),
    FieldSpec("verify_widths", "int32", ("R",), None, "replicated", False, "1.2",
              "0 = request r is a prefill chunk; w in `1..1+K` = a verify request of w rows (anchor at the first "
              "uncached position, then w − 1 drafts); absent means all 0", "–"),
    FieldSpec("logit_mode", "int8", ("R",), None, "replicated", False, "1.2",
              "output intent of request r: 0 none, 1 its last row, 2 every row (verify requests); `logit_rows` "
              "must list exactly these rows (-1 for 0); absent means 1.1's `logit_rows` alone", "–"),
    FieldSpec("hidden", "floating", ("P", "..."), "zero", "replicated", False, "1.0",
              "input hidden state rows (`x_hc`), replicated on every rank", "0", tensor="extra.hidden",
              in_batch=False),
)
#: The fields a ``PackedBatch`` carries (its flat arrays), in ABI order.
BATCH_FIELDS: tuple[FieldSpec, ...] = tuple(f for f in FIELDS if f.in_batch)
#: Field name -> declaration.
BY_NAME: dict[str, FieldSpec] = {f.name: f for f in FIELDS}
#: Flat ABI field name of each pool's block table (``[R, width] int32``).
TABLE_FIELDS: dict[PoolName, str] = {p: f.name for p, f in TABLE_SPECS.items()}
#: Flat ABI field name of each pool's slot mapping (``[P] int64``).
SLOT_FIELDS: dict[PoolName, str] = {p: f.name for p, f in SLOT_SPECS.items()}


# ------------------------------------------------------------------------------------------------ the persistent form
def _delta(pool: PoolName, kind: Literal["mapped", "released"]) -> FieldSpec:
    what = "maps (the page was unmapped, the block free or released by this very delta)" if kind == "mapped" else \
        "releases (the cell holds the block; the front pages of the slot's run)"
    return FieldSpec(f"{pool}_table_{kind}", "int32", (f"M_{pool}" if kind == "mapped" else f"K_{pool}", "3"), None,
                     "replicated", True, "1.3", f"rows (slot, logical page, block) of the `{pool}` cells the step "
                     f"{what}; the column is the page's column in the persistent table (section 5.1)", "–",
                     pool=pool)


#: Per pool, the cells a persistent step maps (``[M_pool, 3]`` int32 rows (slot, page, block)).
MAPPED_SPECS: dict[PoolName, FieldSpec] = {p: _delta(p, "mapped") for p in POOL_NAMES}
#: Per pool, the cells a persistent step releases (``[K_pool, 3]`` int32 rows (slot, page, block)).
RELEASED_SPECS: dict[PoolName, FieldSpec] = {p: _delta(p, "released") for p in POOL_NAMES}
#: The fields a persistent step (spec 1.3, section 5.9) carries instead of the seven block tables, in ABI order;
#: every field of :data:`BATCH_FIELDS` but the tables comes with them unchanged.
PERSISTENT_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("table_slots", "int32", ("R",), None, "replicated", True, "1.3",
              "slot (row) of request r in every persistent table; pairwise distinct", "–"),
    FieldSpec("slot_generations", "int64", ("R",), None, "replicated", True, "1.3",
              "generation of that slot the step was built against (advanced whenever the slot is released)", "–"),
    FieldSpec("table_widths", "int32", ("7",), None, "replicated", True, "1.3",
              "columns of each pool's table in the step's full form, pools in ABI order (`to_full`)", "–"),
    *MAPPED_SPECS.values(),
    *RELEASED_SPECS.values(),
)
#: The per-row and per-request fields a persistent step shares with the full form (every batch field but the tables).
SHARED_FIELDS: tuple[FieldSpec, ...] = tuple(f for f in BATCH_FIELDS if f.family != "tables")
#: Markers around the generated table of the persistent fields in spec/v1/abi.md section 5.9.
PERSISTENT_BEGIN = ("<!-- persistent fields table: generated from dspark_abi.fields "
                    "(python -m dspark_abi.io.spec_table) -->")
PERSISTENT_END = "<!-- end of persistent fields table -->"

# ------------------------------------------------------------------------------------------------ the spec's table
#: Markers around the generated table in spec/v1/abi.md section 4.1.
TABLE_BEGIN = "<!-- fields table: generated from dspark_abi.fields (python -m dspark_abi.io.spec_table) -->"
TABLE_END = "<!-- end of fields table -->"


def field_table(fields: tuple[FieldSpec, ...] = FIELDS) -> str:
    """The markdown table of spec section 4.1, one row per declaration."""
    lines = ["| name | shape | dtype | scope | since | meaning | value on padding rows |",
             "|---|---|---|---|---|---|---|"]
    for f in fields:
        name = f"`{f.name}`"
        if not f.required:
            name += " (optional" + (f"; fixture tensor `{f.tensor}`" if f.tensor else "") + ")"
        scope = "rank-local" if f.scope == "rank_local" else "replicated"
        lines.append(f"| {name} | {f.shape_text()} | {f.dtype} | {scope} | {f.since} | {f.meaning} | "
                     f"{f.padding_doc} |")
    return "\n".join(lines) + "\n"


def with_field_table(text: str, fields: tuple[FieldSpec, ...] = FIELDS) -> str:
    """``text`` (the spec) with the tables between :data:`TABLE_BEGIN` and :data:`TABLE_END` (``fields``) and between
    :data:`PERSISTENT_BEGIN` and :data:`PERSISTENT_END` (:data:`PERSISTENT_FIELDS`) regenerated."""
    text = _with_table(text, TABLE_BEGIN, TABLE_END, field_table(fields))
    return _with_table(text, PERSISTENT_BEGIN, PERSISTENT_END, field_table(PERSISTENT_FIELDS))


def _with_table(text: str, begin: str, end: str, table: str) -> str:
    head, sep, rest = text.partition(begin + "\n")
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"the spec lacks the markers {begin!r} ... {end!r}")
    return head + begin + "\n" + table + end + tail

