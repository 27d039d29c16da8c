"""Hostile conformance files: bytes that are not readable fixtures, each with the one code a reader raises.

Crafted from a valid vector's encoding by :func:`hostile_files`; written by :mod:`dspark_abi.conformance.vectors`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import numpy as np

from dspark_abi.config import ModelConfig
from dspark_abi.io.fixtures import encode, encode_raw, pack_header
from dspark_abi.io.manifest import ABI_TENSORS, MANIFEST_KEY
from dspark_abi.policy import PaddingPolicy


def hostile_files(arrays: Mapping[str, np.ndarray], *, config: ModelConfig, policy: PaddingPolicy,
                  pool_blocks: Mapping[str, int]) -> dict[str, tuple[bytes, str, str]]:
    """name -> (file bytes, the one fixture.* code a reader must raise, description), crafted from the encoding
    of a valid batch's flat ``arrays`` (a valid vector's)."""
    good = encode(arrays, config=config, policy=policy, pool_blocks=pool_blocks)
    (hlen,) = struct.unpack("<Q", good[:8])
    header, data = json.loads(good[8:8 + hlen]), good[8 + hlen:]
    doc = json.loads(header["__metadata__"][MANIFEST_KEY])
    stored = {k: arrays[k] for k in ABI_TENSORS if k in arrays}

    def craft(tensors: dict[str, np.ndarray] | None = None, **changes: object) -> bytes:
        d = json.loads(json.dumps(doc))
        for dotted, value in changes.items():  # "config__head_dim" edits doc["config"]["head_dim"]
            *path, last = dotted.split("__")
            target = d
            for key in path:
                target = target[key]
            if value is None:
                del target[last]
            else:
                target[last] = value
        return encode_raw(stored if tensors is None else tensors,
                          {MANIFEST_KEY: json.dumps(d, sort_keys=True, separators=(",", ":"))})

    pos = header["positions"]["data_offsets"]
    overlap = dict(header, positions=dict(header["positions"], data_offsets=[pos[0] - 4, pos[1] - 4]))
    text = json.dumps(header, separators=(",", ":"))
    duplicate = (text[:-1] + ',"positions":' + json.dumps(header["positions"]) + "}").encode()
    unreadable, version, manifest, tensors = "fixture.unreadable", "fixture.version", "fixture.manifest", \
        "fixture.tensors"
    no_positions = {k: v for k, v in stored.items() if k != "positions"}
    return {
        "empty": (b"", unreadable, "Zero bytes."),
        "not_safetensors": (b"query_start_loc,positions\n0,1\n" * 4, unreadable, "A CSV file."),
        "truncated_header": (good[:48], unreadable, "Cut inside the JSON header."),
        "truncated_data": (good[:-4], unreadable, "Last 4 data bytes missing."),
        "trailing_bytes": (good + bytes(8), unreadable, "8 zero bytes after the data section the header describes."),
        "oversized_header": (struct.pack("<Q", 1 << 40) + good[8:], unreadable, "Header length field of 2**40."),
        "header_not_json": (struct.pack("<Q", 16) + b"{not json at all", unreadable, "Header is not JSON."),
        "duplicate_keys": (struct.pack("<Q", len(duplicate)) + duplicate + data, unreadable,
                           "The header names 'positions' twice."),
        "overlapping_offsets": (pack_header(overlap) + data, unreadable, "Tensor data ranges overlap."),
        "unknown_major": (craft(format_version="2.0"), version, "format_version 2.0."),
        "newer_minor": (craft(format_version="1.5"), version, "format_version 1.5 (newer than this reader)."),
        "other_format": (craft(format="other.format"), version, "Manifest of another file format."),
        "no_manifest": (encode_raw(stored, {"format": "pt"}), manifest, "__metadata__ without the manifest key."),
        "bad_manifest": (craft(config__head_dim=None), manifest, "Manifest config lacks head_dim."),
        "request_ids_disagree": (craft(request_ids=[5]), manifest, "Manifest request_ids differ from the tensor."),
        "nan_positions": (craft(dict(stored, positions=np.array([np.nan], np.float32)),
                                tensors__positions__dtype="float32"), tensors, "positions stored as float32 NaN."),
        "dtype_disagrees": (craft(dict(stored, positions=stored["positions"].astype(np.int64))), tensors,
                            "Header says int64, manifest says int32."),
        "rank3_table": (craft(dict(stored, ori_block_table=stored["ori_block_table"][..., None]),
                              tensors__ori_block_table__shape=[*stored["ori_block_table"].shape, 1]), tensors,
                        "A block table of rank 3."),
        "extra_tensor": (craft(dict(stored, bogus=np.zeros(2, np.int32))), tensors,
                         "A tensor the manifest does not list."),
        "missing_tensor": (craft(no_positions), tensors, "The manifest lists positions, the file lacks it."),
        "verify_fields_in_1_1_file": (
            craft(dict(stored, verify_widths=np.zeros(1, np.int32), logit_mode=np.ones(1, np.int8)),
                  format_version="1.1", tensors__verify_widths={"dtype": "int32", "shape": [1]},
                  tensors__logit_mode={"dtype": "int8", "shape": [1]}), manifest,
            "A format_version 1.1 file carrying the 1.2 tensors verify_widths and logit_mode (a 1.1 reader cannot "
            "know their meaning)."),
    }
