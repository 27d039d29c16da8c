"""A lazy safetensors shard index: :class:`ShardIndex` memory-maps safetensors shards, reads only headers up
front and dequantises one tensor to float32 when asked, checked against the name -> format table of
:mod:`dspark_kernels.model.checkpoint_format` (``docs/checkpoints.md``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from dspark_abi.errors import ABIError, Issue, ValidationReport
from dspark_kernels.model import quant
from dspark_kernels.model.checkpoint_format import Kind, TensorFormat

_QUANTISED_KINDS = ("fp8_block", "fp4_block", "int8_channel")
#: safetensors dtype codes -> numpy dtypes (ml_dtypes for the 8-bit floats).
ST_DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": quant.E4M3, "F8_E8M0": quant.UE8M0, "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "I16": np.dtype(np.int16), "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64), "BOOL": np.dtype(np.bool_),
}
_FLOAT_CODES = ("BF16", "F16", "F32", "F64")
_INT_CODES = ("I16", "I32", "I64")
_SCALE_CODES = ("F8_E8M0", "U8", "F32", "BF16", "F16")
#: Largest safetensors JSON header read (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------- shards
@attrs.frozen
class StoredTensor:
    """Where one tensor's bytes are: file, safetensors dtype code, stored shape, absolute offset, length."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _unreadable(path: Path, message: str, fix: str, actual: Any = None) -> ABIError:
    return ABIError([Issue("fixture.unreadable", str(path), message, expected="a safetensors shard",
                           actual=actual, fix=fix)])


def read_header(path: str | Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Parse one safetensors header (no tensor data is read): name -> :class:`StoredTensor`, and metadata.

    Checks the header length, JSON, every entry's dtype/shape/offsets against the file size. Raises
    :class:`ABIError` (``fixture.unreadable``) naming the file and what is wrong.
    """
    path = Path(path)
    redo = "re-download or re-write the shard; a complete safetensors file is required"
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _unreadable(path, "shorter than the 8-byte header length", redo, actual=size)
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise _unreadable(path, f"header length {n} exceeds the file ({size} bytes) or the 100 MB limit",
                                  redo, actual=n)
            raw = fh.read(n)
    except OSError as exc:
        raise _unreadable(path, f"cannot read: {exc.strerror or exc}", "check the path and permissions",
                          actual=type(exc).__name__) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _unreadable(path, f"header is not JSON ({exc})", redo) from None
    if not isinstance(header, dict):
        raise _unreadable(path, "header is not a JSON object", redo)
    start = 8 + n
    tensors: dict[str, StoredTensor] = {}
    meta = header.pop("__metadata__", None) or {}
    for name, entry in header.items():
        try:
            dtype, shape, (lo, hi) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
            lo, hi = int(lo), int(hi)
        except (KeyError, TypeError, ValueError):
            raise _unreadable(path, f"malformed header entry for {name!r}", redo, actual=repr(entry)[:80]) from None
        if any(s < 0 for s in shape) or not 0 <= lo <= hi or start + hi > size:
            raise _unreadable(path, f"{name!r}: bytes [{lo}, {hi}) lie outside the file's data", redo,
                              actual=[lo, hi])
        np_dtype = ST_DTYPES.get(dtype)
        if np_dtype is not None and hi - lo != int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize:
            raise _unreadable(path, f"{name!r}: {hi - lo} bytes do not hold {dtype} {list(shape)}", redo,
                              actual=hi - lo)
        tensors[name] = StoredTensor(name, path, str(dtype), shape, start + lo, hi - lo)
    return tensors, {str(k): str(v) for k, v in meta.items()}


def _map_region(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """Read-only memory map of ``nbytes`` bytes at ``offset`` (the only place tensor bytes are touched)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))


class ShardIndex:
    """Tensors of one checkpoint spread over safetensors shards, mapped lazily.

    Construction reads every shard's header (and ``model.safetensors.index.json`` when a directory has one);
    :meth:`raw` memory-maps one tensor's bytes, :meth:`tensor` dequantises one tensor (and its ``.scale``) to
    float32. Nothing else is read. F8_E4M3 / F8_E8M0 tensors are viewed as ``ml_dtypes`` (safetensors' numpy
    backend cannot return them). Also a weight source for ``ModelWeights`` (:meth:`info`, :meth:`load`).
    """

    def __init__(self, paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]):
        self.unreadable: list[Issue] = []  # ModelWeights' source protocol; errors are raised instead
        files, weight_map = _resolve(paths)
        self._stored: dict[str, StoredTensor] = {}
        issues: list[Issue] = []
        for path in files:
            tensors, _ = read_header(path)
            for name, st in tensors.items():
                if name in self._stored:
                    issues.append(Issue("fixture.tensors", name, f"stored in both {self._stored[name].path.name} "
                                        f"and {path.name}", expected="one shard", actual="two",
                                        fix="remove the stale shard from the directory"))
                self._stored[name] = st
        for name, file in (weight_map or {}).items():
            listed = self._stored.get(name)
            if listed is None or listed.path.name != Path(file).name:
                issues.append(Issue("array.missing", name, f"{INDEX_FILE} lists it in {file} but that shard's header "
                                    "does not hold it", expected=file, actual=listed.path.name if listed else "missing",
                                    fix=f"re-download {file} (or the index)"))
        if issues:
            raise ABIError(issues)

    # ------------------------------------------------------------------ headers
    @property
    def names(self) -> tuple[str, ...]:
        """Every stored tensor name (including ``.scale`` companions), sorted."""
        return tuple(sorted(self._stored))

    def __contains__(self, name: object) -> bool:
        return name in self._stored

    def __len__(self) -> int:
        return len(self._stored)

    def stored(self, name: str) -> StoredTensor:
        """Header entry of ``name``; raises :class:`ABIError` (``array.missing``) when the checkpoint lacks it."""
        st = self._stored.get(name)
        if st is None:
            near = [n for n in self._stored if n.endswith(name.rsplit(".", 2)[-1])][:3]
            raise ABIError([Issue("array.missing", name, "not in any shard", expected="present", actual="missing",
                                  fix="check the checkpoint name" + (f" (similar: {', '.join(near)})" if near else "")
                                  + " or download the missing shard")])
        return st

    def scale_name(self, name: str) -> str | None:
        """The scale companion of ``name`` (``X.scale``, or the V3-style ``X.weight_scale_inv``), if stored."""
        if not name.endswith(".weight"):
            return None
        for cand in (name[: -len(".weight")] + ".scale", name + "_scale_inv"):
            if cand in self._stored:
                return cand
        return None

    def kind(self, name: str) -> Kind:
        """The stored kind of ``name``, inferred from its dtype and its scale companion's shape."""
        st = self.stored(name)
        code = st.dtype
        if code in _FLOAT_CODES:
            return "float"
        if code in _INT_CODES:
            return "int"
        scale = self.scale_name(name)
        if code == "F8_E4M3":
            if scale is None:
                raise ABIError([_no_scale(name, "F8_E4M3")])
            return "fp8_block"
        if code in ("I8", "U8") and len(st.shape) >= 1:
            if scale is None:
                raise ABIError([_no_scale(name, code)])
            s_shape = self._stored[scale].shape
            if len(st.shape) == 2 and s_shape == quant.fp4_scale_shape((st.shape[0], 2 * st.shape[1])):
                return "fp4_block"
            if code == "I8" and s_shape == st.shape[:-1]:
                return "int8_channel"
            raise ABIError([Issue("array.shape", scale, f"scale {list(s_shape)} fits neither FP4 1x32 blocks nor "
                                  f"int8 per-channel scales of {code} {list(st.shape)}",
                                  expected=[list(quant.fp4_scale_shape((st.shape[0], 2 * st.shape[-1]))),
                                            list(st.shape[:-1])], actual=list(s_shape),
                                  fix="store FP4 scales [out, in/32] or int8 scales [out]")])
        raise ABIError([Issue("array.dtype", name, f"stored as {code}, which this loader does not read",
                              expected="F8_E4M3, I8/U8 (+ .scale), BF16, F16, F32, F64 or I16/I32/I64",
                              actual=code, fix="dequantise or convert this tensor to a supported dtype")])

    def logical_shape(self, name: str) -> tuple[int, ...]:
        """Shape of the dequantised tensor (FP4: twice the stored last axis)."""
        st = self.stored(name)
        if self.kind(name) == "fp4_block":
            return st.shape[0], 2 * st.shape[1]
        return st.shape

    def companions(self) -> set[str]:
        """Names that are the scale of a quantised tensor."""
        out = set()
        for name, st in self._stored.items():
            if st.dtype in ("F8_E4M3", "I8", "U8"):
                s = self.scale_name(name)
                if s is not None:
                    out.add(s)
        return out

    # ------------------------------------------------------------------ data
    def raw(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only memory-mapped array of its own dtype (ml_dtypes for F8 codes)."""
        st = self.stored(name)
        np_dtype = ST_DTYPES.get(st.dtype)
        if np_dtype is None:
            raise ABIError([Issue("array.dtype", name, f"stored as {st.dtype}, which this loader does not read",
                                  expected=sorted(ST_DTYPES), actual=st.dtype,
                                  fix="convert this tensor to a supported dtype")])
        return np.asarray(_map_region(st.path, st.offset, st.nbytes)).view(np_dtype).reshape(st.shape)

    def tensor(self, name: str, expect: TensorFormat | None = None) -> np.ndarray:
        """``name`` dequantised: float32 (floats, FP8 blocks, FP4 blocks, int8 channels) or its int dtype.

        Reads only ``name`` and its scale. With ``expect`` the stored kind must be one ``expect.accepts`` and
        the logical shape must equal ``expect.shape``. Raises :class:`ABIError` (``array.missing`` /
        ``array.dtype`` / ``array.shape``) with a fix naming the tensor.
        """
        if expect is not None:
            if expect.name != name:
                raise ValueError(f"expect describes {expect.name!r}, not {name!r}")
            problems = self._check(expect, strict=False)
            if problems:
                raise ABIError(problems)
        kind = self.kind(name)
        if kind == "float":
            return np.array(self.raw(name), dtype=np.float32, copy=True)
        if kind == "int":
            return np.array(self.raw(name))
        scale = self.scale_name(name)
        assert scale is not None  # kind() guarantees a companion
        s_st = self._stored[scale]
        if s_st.dtype not in _SCALE_CODES:
            raise ABIError([Issue("array.dtype", scale, f"scale stored as {s_st.dtype}", expected=list(_SCALE_CODES),
                                  actual=s_st.dtype, fix="store scales as F8_E8M0 (ue8m0) or F32")])
        q, s = self.raw(name), self.raw(scale)
        if kind == "fp8_block":
            if q.ndim != 2:
                raise ABIError([Issue("array.shape", name, "FP8 block weights must be 2-D [out, in]",
                                      expected="[out, in]", actual=list(q.shape), fix="store the weight as [out, in]")])
            want = quant.fp8_scale_shape(q.shape)
            if s.shape != want:
                raise ABIError([Issue("array.shape", scale, f"FP8 scale of {list(q.shape)} must be [ceil(out/128), "
                                      "ceil(in/128)]", expected=list(want), actual=list(s.shape),
                                      fix="store one scale per 128x128 block of the weight")])
            return quant.dequant_fp8_blocks(q, s)
        if kind == "fp4_block":
            return quant.dequant_fp4_blocks(q, s)
        return quant.dequant_int8_channels(q, s, axis=-1)

    def rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """``tensor(name)[rows]`` (float32), reading only those rows when the tensor is stored as a float
        (the embedding: a few of its V rows per prefill)."""
        if self.kind(name) != "float":
            return self.tensor(name)[np.asarray(rows, dtype=np.int64)]
        return np.asarray(self.raw(name)[np.asarray(rows, dtype=np.int64)], dtype=np.float32)

    def int8_parts(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """A W8A8 tensor's stored parts (q [..., in] float32 integers in [-128, 127], scale [...] float32, with
        ``tensor(name) == q * scale[..., None]``), or None when ``name`` is stored in another kind."""
        if self.kind(name) != "int8_channel":
            return None
        scale = self.scale_name(name)
        if scale is None:  # kind() guarantees a companion
            return None
        return (np.asarray(self.raw(name), dtype=np.float32),
                quant.scale_to_float32(np.asarray(self.raw(scale))).reshape(self.stored(name).shape[:-1]))

    # ------------------------------------------------------------------ validation
    def _check(self, fmt: TensorFormat, *, strict: bool) -> list[Issue]:
        name = fmt.name
        if name not in self._stored:
            return [] if fmt.optional else [Issue("array.missing", name, f"required (shipped as {fmt.shipped})",
                                                  expected=list(fmt.shape), actual="missing",
                                                  fix="download the shard holding it or fix the checkpoint names")]
        code = self._stored[name].dtype
        if code not in _FLOAT_CODES + _INT_CODES and not set(fmt.accepts) & set(_QUANTISED_KINDS):
            return [Issue("array.dtype", name, f"stored as {code}; expected {fmt.shipped}", expected=list(fmt.accepts),
                          actual=code, fix=f"store {name} as {fmt.shipped} (it is never quantised)")]
        try:
            kind, shape = self.kind(name), self.logical_shape(name)
        except ABIError as err:
            return list(err.issues)
        allowed = (fmt.kind,) if strict else fmt.accepts
        out = []
        if kind not in allowed:
            out.append(Issue("array.dtype", name, f"stored as {code} ({kind}); expected {fmt.shipped}",
                             expected=list(allowed), actual=kind,
                             fix=f"store {name} as {fmt.shipped}" + ("" if strict else " or a float copy")))
        if shape != fmt.shape:
            out.append(Issue("array.shape", name, "logical shape differs from the config", expected=list(fmt.shape),
                             actual=list(shape), fix="use the checkpoint that matches config.json"))
        scale = self.scale_name(name)
        if kind == "fp8_block" and scale is not None:
            st = self._stored[name]
            want = quant.fp8_scale_shape(st.shape) if len(st.shape) == 2 else None
            got = self._stored[scale].shape
            if got != want:
                out.append(Issue("array.shape", scale, "FP8 scale must be [ceil(out/128), ceil(in/128)]",
                                 expected=list(want) if want else "a 2-D weight", actual=list(got),
                                 fix="store one scale per 128x128 block of the weight"))
        if kind in _QUANTISED_KINDS and scale is not None:
            s_code = self._stored[scale].dtype
            if s_code not in _SCALE_CODES or (strict and fmt.scale_dtype and s_code != fmt.scale_dtype
                                              and not (s_code == "U8" and fmt.scale_dtype == "F8_E8M0")):
                out.append(Issue("array.dtype", scale, f"scale stored as {s_code}",
                                 expected=fmt.scale_dtype or list(_SCALE_CODES), actual=s_code,
                                 fix="store scales as F8_E8M0 (ue8m0) or F32"))
        return out

    def validate(self, formats: Mapping[str, TensorFormat] | Iterable[TensorFormat], *,
                 strict: bool = False) -> ValidationReport:
        """Every missing, mis-typed or mis-shaped tensor of ``formats`` (headers only; no data is read).

        ``strict``: require exactly the shipped kind and scale dtype (else any accepted kind, e.g. a float copy).
        """
        fmts = formats.values() if isinstance(formats, Mapping) else formats
        return ValidationReport(tuple(i for f in fmts for i in self._check(f, strict=strict)))

    def require(self, formats: Mapping[str, TensorFormat] | Iterable[TensorFormat], *, strict: bool = False) -> None:
        """:meth:`validate`, raising :class:`ABIError` with every issue."""
        self.validate(formats, strict=strict).raise_if_invalid()

    # ------------------------------------------------------------------ ModelWeights source protocol
    def info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Logical name -> (logical shape, dtype name) of every tensor but scale companions."""
        skip = self.companions()
        out = {}
        for name, st in self._stored.items():
            if name in skip:
                continue
            try:
                kind = self.kind(name)
            except ABIError:
                out[name] = (st.shape, st.dtype)
                continue
            out[name] = (self.logical_shape(name), "float32" if kind != "int" else str(ST_DTYPES[st.dtype]))
        return out

    def load(self, name: str) -> np.ndarray:
        """:meth:`tensor` (float32 or int)."""
        return self.tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)


def _no_scale(name: str, code: str) -> Issue:
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return Issue("array.missing", base + ".scale", f"{name} is {code} but its scale is not stored",
                 expected="present", actual="missing", fix=f"store {base}.scale next to {name}")


def _resolve(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]
             ) -> tuple[list[Path], dict[str, str] | None]:
    """Shard files of a directory (its index, else every ``*.safetensors``), a file, or a list of files."""
    if isinstance(paths, str | os.PathLike):
        p = Path(paths)
        if p.is_dir():
            index = p / INDEX_FILE
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                    files = sorted({p / str(f) for f in weight_map.values()})
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                    raise _unreadable(index, f"not a readable index ({exc})", "re-download the index") from None
                return files, {str(k): str(v) for k, v in weight_map.items()}
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise _unreadable(p, "no *.safetensors files in the directory", "point at the checkpoint directory")
            return files, None
        return [p], None
    files = [Path(f) for f in paths]
    if not files:
        raise ABIError([Issue("fixture.unreadable", "paths", "no shard files given", expected="one or more files",
                              actual=0, fix="pass the checkpoint directory or its shard files")])
    return files, None
