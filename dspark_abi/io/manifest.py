"""The JSON manifest of a fixture file (pydantic): format, version, config, policy, pools, tensors, expectation.

A fixture file is one safetensors file whose ``__metadata__`` header holds this manifest, serialized as
one JSON string under the key :data:`MANIFEST_KEY`. The manifest says which tensors the file holds (with
their dtype and shape), everything needed to validate them (``config``, ``policy``, ``pool_blocks``)
and, for conformance vectors, the expected outcome. ``spec/v1/abi.schema.json`` is generated from
:class:`FixtureManifest` (``python -m dspark_abi.io.schema``).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Annotated, Final, Literal

from pydantic import Field, model_validator

from dspark_abi._base import StrictModel
from dspark_abi.config import ModelConfig
from dspark_abi.errors import CODES
from dspark_abi.fields import BATCH_FIELDS, BY_NAME
from dspark_abi.layout import MAX_POOL_BLOCKS, POOL_NAMES
from dspark_abi.policy import PaddingPolicy

#: Value of the manifest's ``format`` key.
FORMAT_NAME: Final = "dspark.packed_batch"
#: Format version this library writes (the ABI spec version, spec/v1).
FORMAT_VERSION: Final = "1.4"
#: Format versions this library reads: every minor of major 1 up to the one it implements (oldest first).
SUPPORTED_VERSIONS: tuple[str, ...] = ("1.0", "1.1", "1.2", "1.3", "1.4")
#: ``__metadata__`` key holding the manifest JSON string.
MANIFEST_KEY = "dspark.manifest"
#: Name prefix of optional tensors that ride along (hidden states, caches, expected outputs).
EXTRA_PREFIX = "extra."
#: The one extra tensor the validator reads: input hidden rows [P, ...] float, padding rows zero.
HIDDEN_TENSOR = BY_NAME["hidden"].file_name

#: Required ABI tensors, in canonical file order (the declared fields, :data:`dspark_abi.fields.FIELDS`).
REQUIRED_TENSORS: tuple[str, ...] = tuple(f.file_name for f in BATCH_FIELDS if f.required)
#: Optional ABI tensors, in canonical file order.
OPTIONAL_TENSORS: tuple[str, ...] = tuple(f.file_name for f in BATCH_FIELDS if not f.required)
#: Every ABI tensor name a fixture may hold outside the ``extra.`` prefix.
ABI_TENSORS: tuple[str, ...] = REQUIRED_TENSORS + OPTIONAL_TENSORS

DType = Literal["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "bfloat16", "float32", "float64"]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
#: Any registered error code (the schema lists them as an enum; built from CODES, so a str to type checkers).
if TYPE_CHECKING:
    ErrorCode = str
else:
    ErrorCode = Literal[tuple(CODES)]


class TensorInfo(StrictModel):
    """Declared dtype and shape of one stored tensor; the file's header must agree exactly."""

    dtype: DType
    """numpy dtype name of the stored elements (little-endian)."""
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    """Shape of the stored tensor."""


class PoolBlockCounts(StrictModel):
    """Physical block count of each of the seven pools (bound for table entries and slots).

    At most ``(2**31 - 1) // page_size`` blocks, so that every block id and slot fits int32.
    """

    ori: int = Field(ge=1, le=MAX_POOL_BLOCKS["ori"])
    """Blocks of the uncompressed KV pool (32 rows each)."""
    csa_cmp: int = Field(ge=1, le=MAX_POOL_BLOCKS["csa_cmp"])
    """Blocks of the ratio-4 compressed KV pool (32 entries each)."""
    hca_cmp: int = Field(ge=1, le=MAX_POOL_BLOCKS["hca_cmp"])
    """Blocks of the ratio-128 compressed KV pool (32 entries each)."""
    idx: int = Field(ge=1, le=MAX_POOL_BLOCKS["idx"])
    """Blocks of the indexer key cache and its scale (32 entries each)."""
    csa_state: int = Field(ge=1, le=MAX_POOL_BLOCKS["csa_state"])
    """Blocks of the ratio-4 compressor state ring (2 positions each)."""
    csa_inner_state: int = Field(ge=1, le=MAX_POOL_BLOCKS["csa_inner_state"])
    """Blocks of the indexer compressor state ring (2 positions each)."""
    hca_state: int = Field(ge=1, le=MAX_POOL_BLOCKS["hca_state"])
    """Blocks of the ratio-128 compressor state ring (8 positions each)."""

    def as_dict(self) -> dict[str, int]:
        return {p: getattr(self, p) for p in POOL_NAMES}


class Expectation(StrictModel):
    """Expected outcome of validating a conformance vector."""

    valid: bool
    """True when the vector satisfies every rule."""
    codes: tuple[ErrorCode, ...] = ()
    """Exact set of error codes validation must report (sorted, unique); empty when valid."""

    @model_validator(mode="after")
    def _check(self) -> Expectation:
        if list(self.codes) != sorted(set(self.codes)):
            raise ValueError("codes must be sorted and unique")
        if self.valid == bool(self.codes):
            raise ValueError("valid must be true exactly when codes is empty")
        return self


class FixtureManifest(StrictModel):
    """Manifest of a ``dspark.packed_batch`` fixture file (format version 1.4; 1.0 to 1.3 manifests read the same)."""

    format: Literal["dspark.packed_batch"]
    """Format name; readers reject any other value (``fixture.version``)."""
    format_version: Literal["1.0", "1.1", "1.2", "1.3", "1.4"]
    """Format (= ABI spec) version, ``major.minor``: writers write 1.4; readers reject versions they do not
    implement (another major, a newer minor)."""
    name: str = ""
    """Identifier of the fixture (conformance vectors: path below the vectors directory, without suffix)."""
    description: str = ""
    """What the fixture exercises, in one or two sentences."""
    config: ModelConfig
    """Model configuration the batch was built for (fixes table widths, page sizes, limits)."""
    policy: PaddingPolicy
    """TP padding policy of the batch (fixes P, L and the padding sentinels)."""
    pool_blocks: PoolBlockCounts
    """Physical blocks of each pool."""
    request_ids: tuple[Int64, ...] | None = None
    """Copy of the ``request_ids`` tensor (flattened) for readers of the header alone; null when absent."""
    tensors: dict[str, TensorInfo] = Field(json_schema_extra={"propertyNames": {"anyOf": [
        {"enum": list(ABI_TENSORS)}, {"pattern": f"^{re.escape(EXTRA_PREFIX)}.+"}]}})
    """Every stored tensor: ABI field names and ``extra.``-prefixed optional tensors."""
    expected: Expectation | None = None
    """Conformance vectors only: the outcome validation must produce."""

    @model_validator(mode="after")
    def _check_names(self) -> FixtureManifest:
        bad = [n for n in self.tensors if n not in ABI_TENSORS
               and not (n.startswith(EXTRA_PREFIX) and len(n) > len(EXTRA_PREFIX))]
        if bad:
            raise ValueError(f"tensor names {bad} are neither ABI fields nor '{EXTRA_PREFIX}'-prefixed")
        if self.request_ids is not None and "request_ids" not in self.tensors:
            raise ValueError("request_ids is set but the request_ids tensor is not listed")
        return self

    def canonical_json(self) -> str:
        """Deterministic JSON text (sorted keys, no spaces): the bytes written into the file header."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), allow_nan=False)
