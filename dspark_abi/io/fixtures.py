"""Fixture files: one packed batch per safetensors file, manifest in the header, hostile files rejected.

Layout (the safetensors format): 8-byte little-endian header length H, H bytes of JSON header,
then the tensor bytes. The header maps tensor name -> {dtype, shape, data_offsets} and carries
``__metadata__ = {"dspark.manifest": "<manifest JSON>"}`` (:class:`~dspark_abi.io.manifest.FixtureManifest`).
ABI tensors use the flat field names of :meth:`PackedBatch.to_arrays`; optional tensors ride along
as ``extra.<name>`` (``extra.hidden`` = input hidden rows, checked by the validator).

:func:`read` checks the file only (structure, manifest, declared tensors) and raises
:class:`ABIError` with a ``fixture.*`` code; :func:`load` also validates the ABI rules and builds a
:class:`PackedBatch`. Reading opens the file read-only and never writes anything.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn, cast

import attrs
import ml_dtypes
import numpy as np
from pydantic import ValidationError

from dspark_abi.batch import PackedBatch
from dspark_abi.config import ModelConfig, issues_from_pydantic
from dspark_abi.errors import ABIError, Issue, ValidationReport
from dspark_abi.io import safe_write
from dspark_abi.io.manifest import (
    ABI_TENSORS,
    EXTRA_PREFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_KEY,
    SUPPORTED_VERSIONS,
    DType,
    Expectation,
    FixtureManifest,
    PoolBlockCounts,
    TensorInfo,
)
from dspark_abi.policy import PaddingPolicy
from dspark_abi.validation import Level, validate_arrays

#: Largest accepted JSON header (bytes); a larger length field is treated as a hostile file.
MAX_HEADER_BYTES = 1 << 20
#: Most dimensions a stored tensor may declare (numpy 1.x arrays hold at most 32).
MAX_DIMS = 32
#: Bound on every dimension and on the product of the non-zero ones: a zero-size tensor cannot declare
#: dimensions numpy would refuse to build (it checks them even when the array holds no element).
MAX_ELEMENTS = 1 << 48

#: numpy dtype name <-> safetensors dtype code (little-endian storage).
_CODE_OF = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
            "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
            "float32": "F32", "float64": "F64"}
_NAME_OF = {code: name for name, code in _CODE_OF.items()}
_INTEGER = {"uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name).newbyteorder("<")


@attrs.frozen(eq=False)
class FixtureFile:
    """A fixture file checked at file level (not yet against the ABI rules).

    Attributes:
        manifest: The file's manifest.
        arrays: ABI tensors by flat field name (read-only).
        extras: Optional tensors by name without the ``extra.`` prefix (read-only).
    """

    manifest: FixtureManifest
    arrays: dict[str, np.ndarray]
    extras: dict[str, np.ndarray]

    @property
    def pool_blocks(self) -> dict[str, int]:
        return self.manifest.pool_blocks.as_dict()

    def validate(self, level: Level = "full") -> ValidationReport:
        """Check the ABI rules on the stored arrays (and ``extra.hidden`` when present)."""
        m = self.manifest
        return validate_arrays(self.arrays, m.config, m.policy, self.pool_blocks, hidden=self.extras.get("hidden"),
                               level=level)


@attrs.frozen(eq=False)
class LoadedFixture:
    """A validated fixture: the batch, its optional tensors (unprefixed names) and the manifest.

    Attributes:
        batch: The validated batch.
        tensors: Optional tensors by name without the ``extra.`` prefix.
        manifest: The file's manifest.
    """

    batch: PackedBatch
    tensors: dict[str, np.ndarray]
    manifest: FixtureManifest


# ---------------------------------------------------------------------------------------------- writing
def save(path: str | os.PathLike[str], batch: PackedBatch, *, tensors: Mapping[str, np.ndarray] | None = None,
         expected: Expectation | None = None, name: str = "", description: str = "") -> Path:
    """Write ``batch`` (and optional ``tensors``, stored as ``extra.<name>``) to ``path``; returns the path."""
    return save_arrays(path, batch.to_arrays(), config=batch.config, policy=batch.policy,
                       pool_blocks=batch.pool_blocks.as_dict(), tensors=tensors, expected=expected, name=name,
                       description=description)


def save_arrays(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], **kwargs: Any) -> Path:
    """Write flat ABI arrays without validating them (conformance vectors store invalid batches too).

    Keyword arguments are those of :func:`encode`. The file is replaced atomically, and only when it is a regular
    file (or a symlink to one, written through): :mod:`dspark_abi.io.safe_write` (its ``WriteTargetError`` is an
    ``OSError``).
    """
    data = encode(arrays, **kwargs)
    safe_write.write_bytes(path, data)
    return Path(path)


def encode(arrays: Mapping[str, np.ndarray], *, config: ModelConfig, policy: PaddingPolicy,
           pool_blocks: Mapping[str, int], tensors: Mapping[str, np.ndarray] | None = None,
           expected: Expectation | None = None, name: str = "", description: str = "") -> bytes:
    """The bytes of a fixture file: a pure function of the inputs.

    Tensors in canonical order (ABI fields, then ``extra.<name>`` by name), canonical manifest JSON,
    header padded with spaces to a multiple of 8 bytes.
    """
    unknown = [k for k in arrays if k not in ABI_TENSORS]
    if unknown:
        raise ValueError(f"arrays {unknown} are not ABI fields; pass optional tensors through tensors=")
    stored = {k: np.asarray(arrays[k]) for k in ABI_TENSORS if k in arrays}
    stored |= {EXTRA_PREFIX + k: np.asarray(v) for k, v in sorted((tensors or {}).items())}
    for k, v in stored.items():
        if v.dtype.name not in _CODE_OF:
            raise ValueError(f"tensor {k!r}: dtype {v.dtype} cannot be stored; use one of {sorted(_CODE_OF)}")
    ids = stored.get("request_ids")
    manifest = FixtureManifest(
        format=FORMAT_NAME, format_version=FORMAT_VERSION, name=name, description=description, config=config,
        policy=policy, pool_blocks=PoolBlockCounts(**{k: int(v) for k, v in pool_blocks.items()}),
        request_ids=None if ids is None else tuple(int(x) for x in ids.reshape(-1).tolist()),
        tensors={k: TensorInfo(dtype=cast(DType, v.dtype.name), shape=v.shape) for k, v in stored.items()},  # checked
        expected=expected,
    )
    return encode_raw(stored, {MANIFEST_KEY: manifest.canonical_json()})


def encode_raw(stored: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> bytes:
    """Safetensors bytes of ``stored`` (in the given order) with ``metadata`` as ``__metadata__``."""
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    blobs, offset = [], 0
    for k, v in stored.items():
        data = np.ascontiguousarray(v, dtype=_np_dtype(v.dtype.name)).tobytes()
        header[k] = {"dtype": _CODE_OF[v.dtype.name], "shape": list(v.shape),
                     "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    return pack_header(header) + b"".join(blobs)


def pack_header(header: Mapping[str, Any]) -> bytes:
    """8-byte length prefix + compact JSON header padded with spaces to a multiple of 8 bytes."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


# ---------------------------------------------------------------------------------------------- reading
def _fail(code: str, message: str, *, field: str = "file", expected: Any = None, actual: Any = None,
          fix: str | None = None) -> NoReturn:
    raise ABIError([Issue(code, field, message, expected=expected, actual=actual, fix=fix)])


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate JSON keys {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"non-finite JSON number {name}")


def _parse_json(text: bytes | str, what: str, code: str) -> Any:
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")  # json.loads(bytes) would also accept UTF-16/32
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        _fail(code, f"{what} is not valid JSON: {exc}", field=what)


def read(path: str | os.PathLike[str]) -> FixtureFile:
    """Read a fixture file, checking structure, manifest and tensors (not the ABI rules).

    Raises :class:`ABIError` with ``fixture.unreadable`` (not safetensors, truncated, oversized or
    corrupt header), ``fixture.version`` (other format or version), ``fixture.manifest`` (invalid
    manifest) or ``fixture.tensors`` (tensors differ from the manifest, float or NaN in an
    integer-valued field, ABI field of rank other than 1 or 2). The file is opened read-only; anything
    but a regular file (directory, FIFO, device) is refused without opening it.
    """
    _check_regular(path, _mode_of(path))
    try:
        # O_NONBLOCK: a FIFO swapped in after the check cannot block open() (no effect on regular files)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            _check_regular(path, info.st_mode)
            size = info.st_size
            if size < 8:
                _fail("fixture.unreadable", "file is shorter than the 8-byte safetensors length prefix",
                      expected=">= 8 bytes", actual=size)
            head = f.read(16)
            f.seek(0)
            (header_len,) = struct.unpack("<Q", f.read(8))
            if head[8:9] != b"{" and (header_len > MAX_HEADER_BYTES or 8 + header_len > size):
                _fail("fixture.unreadable", "not a safetensors file: it does not begin with an 8-byte header length "
                      "followed by a JSON header", expected="8-byte length, then '{'",
                      actual=f"starts with {head!r}", fix="pass a .safetensors fixture file (e.g. one written "
                      "by dspark-abi build --save or dspark prefill --save)")
            if header_len > MAX_HEADER_BYTES:
                _fail("fixture.unreadable", "header length exceeds the cap", expected=f"<= {MAX_HEADER_BYTES}",
                      actual=header_len)
            if 8 + header_len > size:
                _fail("fixture.unreadable", "file is truncated inside the header", expected=8 + header_len,
                      actual=size)
            header = _parse_json(f.read(header_len), "header", "fixture.unreadable")
            entries, manifest = _check_header(header, size - 8 - header_len)
            raw = {name: f.read(nbytes) for name, nbytes in entries}
    except OSError as exc:
        _fail_open(path, exc)
    return _check_tensors(manifest, header, raw)


_OPEN_FIXES = {
    errno.ENOENT: "the file does not exist: check the path",
    errno.EACCES: "the file is not readable by you: check its permissions",
    errno.EPERM: "the file is not readable by you: check its permissions",
    errno.EISDIR: "this is a directory: pass the .safetensors file inside it (e.g. DIR/*.safetensors)",
}


def _fail_open(path: str | os.PathLike[str], exc: OSError) -> NoReturn:
    _fail("fixture.unreadable", f"cannot open the file: {exc.strerror or exc}", actual=str(path),
          fix=_OPEN_FIXES.get(exc.errno or 0, "check that the file exists and can be read"))


def _mode_of(path: str | os.PathLike[str]) -> int:
    try:
        return os.stat(path).st_mode
    except OSError as exc:
        _fail_open(path, exc)
    except ValueError as exc:  # e.g. an embedded NUL byte
        _fail("fixture.unreadable", f"invalid path: {exc}", actual=repr(path), fix="pass a valid file path")


def _check_regular(path: str | os.PathLike[str], mode: int) -> None:
    """Refuse anything but a regular file, with the fix for what it is instead."""
    if stat.S_ISDIR(mode):
        _fail("fixture.unreadable", "is a directory, not a fixture file", actual=str(path),
              fix=_OPEN_FIXES[errno.EISDIR])
    if not stat.S_ISREG(mode):
        _fail("fixture.unreadable", "is not a regular file (a FIFO, socket or device); it was not opened",
              actual=str(path), fix="not a regular file: pass a .safetensors file saved on disk (copy a stream "
              "to a file first)")


def _check_header(header: Any, data_len: int) -> tuple[list[tuple[str, int]], FixtureManifest]:
    """Validate the safetensors header; return (name, nbytes) in data order and the parsed manifest."""
    if not isinstance(header, dict):
        _fail("fixture.unreadable", "header is not a JSON object", actual=type(header).__name__)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        _fail("fixture.unreadable" if meta is not None else "fixture.manifest",
              "__metadata__ must be an object of strings holding the manifest", field="__metadata__")
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            _fail("fixture.unreadable", "tensor entry needs exactly dtype, shape, data_offsets", field=name)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _NAME_OF:
            _fail("fixture.tensors", "unsupported safetensors dtype", field=name, expected=sorted(_NAME_OF),
                  actual=dtype)
        ints = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in [*shape, *offsets])
        if not ints:
            _fail("fixture.unreadable", "shape and data_offsets must be non-negative integers", field=name)
        if len(shape) > MAX_DIMS:
            _fail("fixture.unreadable", "tensor declares too many dimensions", field=name,
                  expected=f"<= {MAX_DIMS}", actual=len(shape))
        if math.prod(d or 1 for d in shape) > MAX_ELEMENTS:  # before any numpy call: [0, 2**70] is "empty" too
            _fail("fixture.unreadable", "tensor dimensions are implausibly large (even if one of them is 0)",
                  field=name, expected="every dimension and the product of the non-zero ones <= 2**48",
                  actual=shape if len(str(shape)) <= 200 else f"{str(shape)[:200]}...")
        nbytes = int(np.prod(shape, dtype=object)) * _np_dtype(_NAME_OF[dtype]).itemsize
        if offsets[1] - offsets[0] != nbytes:
            _fail("fixture.unreadable", "data_offsets do not span dtype x shape bytes", field=name, expected=nbytes,
                  actual=offsets[1] - offsets[0])
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            _fail("fixture.unreadable", "tensor data overlaps or leaves a gap", field=name, expected=cursor,
                  actual=begin)
        cursor = end
    if cursor != data_len:
        _fail("fixture.unreadable", "data section length differs from the header (truncated or trailing bytes)",
              expected=cursor, actual=data_len)
    return [(name, end - begin) for begin, end, name in spans], _parse_manifest(meta)


def _parse_manifest(meta: dict[str, str]) -> FixtureManifest:
    if MANIFEST_KEY not in meta:
        _fail("fixture.manifest", f"__metadata__ has no {MANIFEST_KEY!r} key", field="__metadata__",
              expected=MANIFEST_KEY, actual=sorted(meta))
    text = meta[MANIFEST_KEY]
    doc = _parse_json(text, "manifest", "fixture.manifest")
    if not isinstance(doc, dict):
        _fail("fixture.manifest", "manifest is not a JSON object", field="manifest")
    fmt, version = doc.get("format"), doc.get("format_version")
    if fmt != FORMAT_NAME:
        _fail("fixture.version", "not a packed-batch fixture", field="manifest.format", expected=FORMAT_NAME,
              actual=fmt)
    if version not in SUPPORTED_VERSIONS:
        _fail("fixture.version", f"format_version {version!r} is not one this reader implements (a newer minor "
              "or another major)", field="manifest.format_version", expected=list(SUPPORTED_VERSIONS), actual=version)
    try:
        return FixtureManifest.model_validate_json(text)
    except ValidationError as exc:
        raise ABIError(issues_from_pydantic(exc, prefix="manifest", code="fixture.manifest")) from None


def _check_tensors(manifest: FixtureManifest, header: dict[str, Any], raw: dict[str, bytes]) -> FixtureFile:
    issues: list[Issue] = []

    def bad(name: str, message: str, expected: Any, actual: Any) -> None:
        issues.append(Issue("fixture.tensors", name, message, expected=expected, actual=actual))

    declared, stored = set(manifest.tensors), set(raw)
    for name in sorted(declared - stored):
        bad(name, "tensor listed in the manifest is missing from the file", "present", "missing")
    for name in sorted(stored - declared):
        bad(name, "tensor in the file is not listed in the manifest", "absent", "present")
    arrays, extras = {}, {}
    for name in sorted(declared & stored):
        info, entry = manifest.tensors[name], header[name]
        dtype, shape = _NAME_OF[entry["dtype"]], tuple(entry["shape"])
        if (dtype, shape) != (info.dtype, info.shape):
            bad(name, "dtype/shape in the header differ from the manifest", [info.dtype, list(info.shape)],
                [dtype, list(shape)])
            continue
        value = np.frombuffer(raw[name], dtype=_np_dtype(dtype)).reshape(shape)
        if name.startswith(EXTRA_PREFIX):
            extras[name[len(EXTRA_PREFIX):]] = value
            continue
        if dtype not in _INTEGER:
            nan = np.issubdtype(value.dtype, np.floating) and not np.isfinite(value.astype(np.float64)).all()
            bad(name, "integer-valued ABI field stored as " + dtype + (" (contains NaN/inf)" if nan else ""),
                "an integer dtype", dtype)
        elif value.ndim not in (1, 2):
            bad(name, "ABI fields have rank 1 or 2", "1 or 2", value.ndim)
        else:
            arrays[name] = value
    ids = arrays.get("request_ids")
    if manifest.request_ids is not None and ids is not None and list(manifest.request_ids) != ids.reshape(-1).tolist():
        issues.append(Issue("fixture.manifest", "manifest.request_ids", "differs from the request_ids tensor",
                            expected=ids.reshape(-1).tolist(), actual=list(manifest.request_ids)))
    if issues:
        raise ABIError(issues)
    return FixtureFile(manifest, arrays, extras)


def load(path: str | os.PathLike[str]) -> LoadedFixture:
    """Read a fixture file, validate every ABI rule and build its :class:`PackedBatch`.

    Raises :class:`ABIError`: ``fixture.*`` codes for file problems (see :func:`read`), ABI codes for
    rule violations (all of them, not only the first).
    """
    fixture = read(path)
    m = fixture.manifest
    if "hidden" in fixture.extras:
        fixture.validate().raise_if_invalid()
    batch = PackedBatch.from_arrays(fixture.arrays, m.config, m.policy, fixture.pool_blocks)
    return LoadedFixture(batch=batch, tensors=dict(fixture.extras), manifest=m)
