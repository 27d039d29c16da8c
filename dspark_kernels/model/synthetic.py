"""Synthetic checkpoints in the shipped DeepSeek-V4-Flash format, for tests and benchmarks of the streaming loader.

:func:`write_checkpoint` writes a folder a real download looks like: ``config.json`` (the Hugging Face keys,
with ``quantization_config``), one safetensors shard for the globals and one per layer, and
``model.safetensors.index.json``. Every tensor is stored as
:func:`~dspark_kernels.model.checkpoint_format.model_formats` says the official checkpoint ships it: FP8 e4m3
projections with ue8m0 128x128 block scales, FP4 (e2m1, two per byte) routed experts with ue8m0 1x32 scales,
BF16 / F32 floats, I32 ``tid2eid``.

Values are deterministic per tensor name (``seed``): floats and FP8 projections are the random weights of
:meth:`ModelWeights.random <dspark_kernels.model.weights.ModelWeights.random>` encoded in the stored format;
routed experts are uniformly random e2m1 codes with per-block power-of-two scales near ``fan_in ** -0.5 / 2.93``
(2.93 = RMS of the 16 codes), written straight as bytes because encoding a FLASH layer's 6.4 G expert weights
would take minutes. A FLASH-dimension layer is ~3.4 GiB on disk (FP4 experts), written at disk speed; no more
than one tensor is in memory at a time.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import attrs
import ml_dtypes
import numpy as np

from dspark_abi import ModelConfig
from dspark_abi.io import safe_write
from dspark_kernels.model import quant
from dspark_kernels.model.checkpoint_format import QuantFormat, TensorFormat, model_formats
from dspark_kernels.model.drafter_weights import DrafterRandomSource, draft_layout, has_drafter
from dspark_kernels.model.shard_index import INDEX_FILE
from dspark_kernels.model.weights import RandomSource

#: safetensors dtype code of each numpy dtype this writer stores.
_CODES = {np.dtype(quant.E4M3): "F8_E4M3", np.dtype(quant.UE8M0): "F8_E8M0", np.dtype(ml_dtypes.bfloat16): "BF16",
          np.dtype(np.float32): "F32", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32"}
#: Random e2m1 code bytes repeat with this (prime) period, so writing 6.4 G expert weights costs disk bandwidth,
#: not random-number generation; rows (<= 2048 bytes) never repeat within a tensor.
_BYTE_PERIOD = 1_048_573
#: RMS of the 16 e2m1 values, each equally likely in a uniformly random code.
_FP4_CODE_RMS = float(np.sqrt(np.mean(quant.FP4_VALUES ** 2)))


@attrs.frozen
class Entry:
    """One stored tensor: name, safetensors code, stored shape and a producer of its bytes (called once)."""

    name: str
    code: str
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        item = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F32": 4, "I32": 4}[self.code]
        return int(np.prod(self.shape, dtype=np.int64)) * item


def write_safetensors(path: str | Path, entries: Iterable[Entry], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file tensor by tensor: the header first (sizes are known from shapes), then each
    tensor's bytes as its producer makes them, so memory holds one tensor at a time. Written through
    :func:`dspark_abi.io.safe_write.write_with`: a target that is not a regular file is refused, never replaced."""
    entries = list(entries)
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                       # the format aligns the data to 8 bytes

    def write(fh: BinaryIO) -> None:
        fh.write(struct.pack("<Q", len(text)) + text)
        for e in entries:
            data = np.ascontiguousarray(e.produce())
            if data.nbytes != e.nbytes or _CODES.get(data.dtype) not in (e.code, None):
                raise ValueError(f"{e.name}: producer gave {data.dtype} {data.shape}, header says {e.code} {e.shape}")
            fh.write(data.reshape(-1).view(np.uint8).data)  # bytes view: ml_dtypes have no buffer format

    safe_write.write_with(path, write)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), 7])


def _fp4_entries(fmt: TensorFormat, seed: int) -> list[Entry]:
    out, inp = fmt.shape
    scale_shape = quant.fp4_scale_shape((out, inp))
    base = fmt.name.removesuffix(".weight")

    def codes() -> np.ndarray:
        return np.resize(_rng(seed, fmt.name).integers(0, 256, _BYTE_PERIOD, dtype=np.uint8), (out, inp // 2))

    def scales() -> np.ndarray:
        # 2**e or 2**(e+1) per block with 2**e <= fan_in**-0.5 / rms(codes): weights of RMS ~ fan_in**-0.5
        e = int(np.floor(np.log2(inp ** -0.5 / _FP4_CODE_RMS)))
        bump = _rng(seed, base + ".scale").integers(0, 2, scale_shape, dtype=np.uint8)
        return (np.uint8(127 + e) + bump).view(quant.UE8M0)

    return [Entry(fmt.name, "I8", (out, inp // 2), lambda: codes().view(np.int8)),
            Entry(base + ".scale", "F8_E8M0", scale_shape, scales)]


def tensor_entries(source: RandomSource | _CheckpointValues, fmt: TensorFormat, seed: int) -> list[Entry]:
    """The stored tensor(s) of ``fmt`` in its shipped kind (a quantised weight brings its ``.scale``)."""
    if fmt.kind == "fp4_block":
        return _fp4_entries(fmt, seed)
    def values() -> np.ndarray:  # deferred until written
        return source.load(fmt.name)
    if fmt.kind == "int":
        return [Entry(fmt.name, "I32", fmt.shape, lambda: values().astype(np.int32))]
    if fmt.kind == "float":
        code = "F32" if fmt.shipped == "F32" else "BF16"
        dtype = np.float32 if code == "F32" else ml_dtypes.bfloat16
        return [Entry(fmt.name, code, fmt.shape, lambda: values().astype(dtype))]
    if fmt.kind != "fp8_block":
        raise ValueError(f"{fmt.name}: the synthetic writer stores shipped kinds, not {fmt.kind}")
    scale_code = fmt.scale_dtype or "F8_E8M0"
    encoded: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def part(i: int) -> np.ndarray:   # the weight and its scale come from one encoding, made when first written
        if not encoded:
            encoded["q"] = quant.quant_fp8_blocks(values(), scale_dtype="ue8m0" if scale_code == "F8_E8M0"
                                                  else "float32")
        q, s = encoded["q"]
        if i == 1:
            encoded.clear()
        return (q, s)[i]

    base = fmt.name.removesuffix(".weight")
    return [Entry(fmt.name, "F8_E4M3", fmt.shape, lambda: part(0)),
            Entry(base + ".scale", scale_code, quant.fp8_scale_shape((fmt.shape[0], fmt.shape[1])), lambda: part(1))]


def short_schedule(config: ModelConfig, ratios: tuple[int, ...] = (0, 4, 128), *, hash_layers: int = 1,
                   name: str | None = None) -> ModelConfig:
    """``config``'s dimensions with a short layer schedule (one SWA, CSA and HCA layer by default, the first
    ``hash_layers`` hash-routed, the last two the DSpark targets): a checkpoint of the real tensor sizes that
    fits a disk and a test (FLASH: ~3.4 GiB per layer)."""
    data = config.model_dump()
    data |= {"name": name or f"{config.name}-{len(ratios)}l", "compress_ratios": tuple(ratios),
             "dspark_target_layers": tuple(range(max(len(ratios) - 2, 0), len(ratios)))}
    data["moe"] = data["moe"] | {"num_hash_layers": hash_layers}
    return ModelConfig.model_validate(data)


class _CheckpointValues:
    """The random value of every checkpoint name: the target's (:class:`RandomSource`) and, for ``mtp.*`` names of
    a DSpark config, the drafter's (:class:`~dspark_kernels.model.drafter_weights.DrafterRandomSource`, the values
    ``DrafterWeights.random`` holds)."""

    def __init__(self, config: ModelConfig, seed: int):
        self.target = RandomSource(config, seed, share_layers=False)
        self.drafter = DrafterRandomSource(config, seed) if has_drafter(config) else None

    def load(self, name: str) -> np.ndarray:
        if name.startswith("mtp.") and self.drafter is not None:
            return self.drafter.load_checkpoint_name(name)
        return self.target.load(name)


def write_checkpoint(folder: str | Path, config: ModelConfig, *, seed: int = 0,
                     quant_format: QuantFormat | None = None, drafter_only: bool = False) -> Path:
    """Write a checkpoint of ``config`` in the shipped format into ``folder`` (created; regular files overwritten).
    A DSpark config (a block size and target layers) also gets its drafter's ``mtp.*`` tensors, one shard per draft
    stage after the layers' (:func:`~dspark_kernels.model.checkpoint_format.draft_formats`); ``drafter_only``
    writes only those (the drafter's shards of a target checkpoint written before: pass both folders' shard files
    to the loaders).

    Every target is checked before the first byte is written (:func:`dspark_abi.io.safe_write.check_target`:
    a directory, device, FIFO or socket in the folder's place of a file raises ``WriteTargetError``).

    Shards: ``model-00000-of-0000N.safetensors`` holds embed, norm, head and hc_head; shard ``i + 1`` holds
    layer i; then one shard per draft stage s (``mtp.{s}.*``). Returns the folder. ``quant_format`` defaults to
    V4-Flash's (FP8 blocks, FP4 experts).
    """
    q = quant_format or QuantFormat(quantized=True)
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    draft = draft_layout(config) if has_drafter(config) else None
    if drafter_only and draft is None:
        raise ValueError(f"{config.name} has no DSpark drafter to write")
    formats = model_formats(config, q, draft)
    source = _CheckpointValues(config, seed)
    groups: list[list[TensorFormat]] = []
    if not drafter_only:
        groups.append([f for n, f in formats.items() if not n.startswith(("layers.", "mtp."))])
        groups += [[f for n, f in formats.items() if n.startswith(f"layers.{i}.")] for i in range(config.num_layers)]
    if draft is not None:
        groups += [[f for n, f in formats.items() if n.startswith(f"mtp.{s}.")] for s in range(draft.stages)]
    total = len(groups)
    files = [f"model-{k:05d}-of-{total:05d}.safetensors" for k in range(total)]
    for name in [*files, INDEX_FILE, "config.json"]:        # all of them before the first (large) write
        safe_write.check_target(root / name)
    weight_map: dict[str, str] = {}
    for file, group in zip(files, groups, strict=True):
        entries = [e for f in group for e in tensor_entries(source, f, seed)]
        write_safetensors(root / file, entries, metadata={"format": "pt"})
        weight_map |= {e.name: file for e in entries}
    safe_write.write_text(root / INDEX_FILE, json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    safe_write.write_text(root / "config.json", json.dumps(config.to_hf_config() | q.to_hf_config(), indent=1))
    return root
