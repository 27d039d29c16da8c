"""Conformance vectors of the persistent form (spec 5.9): ``python -m dspark_abi.conformance.persistent DIR [--check]``.

Each vector is one safetensors file holding persistent tables (tensors ``tables.<name>``, the form
:meth:`~dspark_abi.persistent.PersistentTables.to_arrays` gives) and one persistent step checked against them
(tensors ``step.<name>``, :meth:`~dspark_abi.persistent.PersistentStep.to_arrays`), with a JSON header
(``__metadata__["dspark"]``: config, policy, pool blocks, expected outcome). ``valid/`` steps come from scripted
serving loops of :class:`~dspark_abi.BatchBuilder` (``build_step``); ``invalid/`` ones break one rule of a valid step,
their expected codes stated by hand (never computed by the checker). ``index.json`` lists every file with its
expectation and SHA-256; the bytes depend only on this module, so ``--check`` compares a fresh generation byte for
byte with the committed files. :func:`judge` reads a file and returns the incremental and the stateless report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from safetensors.numpy import load, save

from dspark_abi.allocator import BlockAllocator
from dspark_abi.builder import BatchBuilder
from dspark_abi.config import ModelConfig
from dspark_abi.errors import ValidationReport
from dspark_abi.io.safe_write import write_bytes, write_text
from dspark_abi.layout import POOL_NAMES
from dspark_abi.persistent import PersistentStep, PersistentTables, check_step
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import PoolBlocks
from dspark_abi.presets import TINY, TINY_DSPARK

INDEX_FORMAT = "dspark.persistent_index"
FILE_FORMAT = "dspark.persistent_step"
#: Pools of every vector (file size does not depend on them).
POOLS = PoolBlocks.uniform(512)


@attrs.frozen
class Vector:
    """One vector: its name (``valid/...`` or ``invalid/...``), what it shows, the state and the step, the codes."""

    name: str
    description: str
    config: ModelConfig
    policy: PaddingPolicy
    tables: dict[str, np.ndarray]
    step: dict[str, np.ndarray]
    codes: tuple[str, ...]


Script = list[list[tuple[str, int, int, int]]]      # steps of (kind "prefill" | "verify", id, cached, rows)


def _run(config: ModelConfig, policy: PaddingPolicy, script: Script) -> tuple[PersistentTables, PersistentStep]:
    """Commit every step of ``script`` but the last (all rows accepted); return the tables and the last step."""
    alloc = BlockAllocator(config, POOLS, capacity=4)
    builder = BatchBuilder(config, policy, alloc)
    step = None
    for i, requests in enumerate(script):
        for kind, rid, cached, rows in requests:
            if kind == "verify":
                builder.add_verify(rid, cached, [(rid + k) % 1000 for k in range(rows)])
            else:
                builder.add(rid, cached, rows, [(rid + k) % 1000 for k in range(rows)])
        step = builder.build_step()
        if i < len(script) - 1:
            builder.commit(step)
    if step is None:
        raise ValueError("an empty script")
    return alloc.persistent, step


def _valid() -> Iterator[tuple[str, str, ModelConfig, PaddingPolicy, PersistentTables, PersistentStep]]:
    tp2 = PaddingPolicy(tp_size=2)
    yield ("valid/verify_after_prefill", "two requests prefilled (70 and 45 tokens), then verified with 4 and 2 rows",
           TINY_DSPARK, tp2, *_run(TINY_DSPARK, tp2, [[("prefill", 3, 0, 70), ("prefill", 8, 0, 45)],
                                                       [("verify", 3, 70, 4), ("verify", 8, 45, 2)]]))
    yield ("valid/ring_release", "one request advancing past its window: the step releases the ring pages that left "
           "the reach and maps new ones (released blocks mapped again)", TINY, tp2,
           *_run(TINY, tp2, [[("prefill", 0, 0, 100)], [("prefill", 0, 100, 100)], [("prefill", 0, 200, 60)]]))
    yield ("valid/new_request_joins", "a continuing request and a new one claiming a free slot", TINY,
           PaddingPolicy(tp_size=4), *_run(TINY, PaddingPolicy(tp_size=4),
                                           [[("prefill", 5, 0, 40)], [("prefill", 5, 40, 9), ("prefill", 6, 0, 33)]]))


def _edit(step: dict[str, np.ndarray], name: str, fn: Callable[[np.ndarray], None]) -> dict[str, np.ndarray]:
    out = dict(step)
    out[name] = np.array(step[name])
    fn(out[name])
    return out


def all_vectors() -> Iterator[Vector]:
    """Every vector, valid ones first, in a fixed order."""
    valid = list(_valid())
    for name, description, config, policy, tables, step in valid:
        yield Vector(name, description, config, policy, tables.to_arrays(), step.to_arrays(), ())
    _, _, config, policy, tables, step = valid[1]              # ring_release: it maps and releases ori cells
    arrays, state = step.to_arrays(), tables.to_arrays()
    first_map = arrays["ori_table_mapped"][0]
    held_other = int(state["ori_table"][state["ori_table"] >= 0].max())    # a block a cell holds, not released

    def setter(at: Any, value: int) -> Callable[[np.ndarray], None]:
        def fn(a: np.ndarray) -> None:
            a[at] = value
        return fn

    invalid = [
        ("invalid/stale_generation", "the step's slot generation is one behind (the slot was recycled since)",
         _edit(arrays, "slot_generations", setter(0, int(arrays["slot_generations"][0]) + 1)), ("tables.stale_slot",)),
        ("invalid/slot_out_of_range", "a table slot past the tables' 4 slots",
         _edit(arrays, "table_slots", setter(0, 4)), ("tables.slot",)),
        ("invalid/mapped_block_held", f"an ori cell mapped to block {held_other}, which another cell holds",
         _edit(arrays, "ori_table_mapped", setter((0, 2), held_other)), ("delta.mapped",)),
        ("invalid/mapped_page_held", f"an ori cell mapped on page {int(first_map[1]) - 1}, which the slot holds",
         _edit(arrays, "ori_table_mapped", setter((0, 1), int(first_map[1]) - 1)), ("delta.mapped",)),
        ("invalid/released_wrong_block", "a released ori cell naming another block than the one it holds",
         _edit(arrays, "ori_table_released", setter((0, 2), int(arrays["ori_table_released"][0, 2]) + 1)),
         ("delta.released", "delta.mapped")),         # its real block, mapped again by the delta, is now held
        ("invalid/slot_mismatch", "row 0's ori slot one past its page's cell: row 1's slot, written twice now",
         _edit(arrays, "ori_slot_mapping", setter(0, int(arrays["ori_slot_mapping"][0]) + 1)),
         ("slots.mismatch", "writes.duplicate")),
    ]
    for name, description, bad, codes in invalid:
        yield Vector(name, description, config, policy, state, bad, tuple(sorted(codes)))


def encode(vector: Vector) -> bytes:
    """The file's bytes (deterministic)."""
    tensors = {f"tables.{k}": np.ascontiguousarray(v) for k, v in vector.tables.items()}
    tensors |= {f"step.{k}": np.ascontiguousarray(v) for k, v in vector.step.items()}
    header = {"format": FILE_FORMAT, "config": json.loads(vector.config.model_dump_json()),
              "policy": json.loads(vector.policy.model_dump_json()), "pool_blocks": {p: POOLS[p] for p in POOL_NAMES},
              "expected": {"valid": not vector.codes, "codes": list(vector.codes)}}
    return save(tensors, metadata={"dspark": json.dumps(header, sort_keys=True, separators=(",", ":"))})


def judge(path: str | Path) -> tuple[ValidationReport, ValidationReport, dict[str, Any]]:
    """(incremental report, stateless report, expected outcome) of one vector file."""
    data = Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(json.loads(data[8: 8 + n])["__metadata__"]["dspark"])
    config = ModelConfig.model_validate_json(json.dumps(header["config"]))
    policy = PaddingPolicy.model_validate_json(json.dumps(header["policy"]))
    pools = PoolBlocks.from_mapping(header["pool_blocks"])
    tensors = load(data)
    tables = PersistentTables.from_arrays(config, pools, {k[7:]: v for k, v in tensors.items()
                                                          if k.startswith("tables.")})
    step = PersistentStep.from_arrays({k[5:]: v for k, v in tensors.items() if k.startswith("step.")}, config,
                                      policy, pools)
    return check_step(step, tables), check_step(step, tables, level="full"), header["expected"]


def generate(directory: Path) -> list[dict[str, Any]]:
    """Write every vector and ``index.json`` into ``directory``; the index entries."""
    entries = []
    for vector in all_vectors():
        data = encode(vector)
        (directory / vector.name).parent.mkdir(parents=True, exist_ok=True)
        write_bytes(directory / f"{vector.name}.safetensors", data)
        entries.append({"file": f"{vector.name}.safetensors", "description": vector.description,
                        "expected": {"valid": not vector.codes, "codes": list(vector.codes)},
                        "sha256": hashlib.sha256(data).hexdigest()})
    write_text(directory / "index.json", json.dumps({"format": INDEX_FORMAT, "vectors": entries}, indent=1) + "\n")
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_abi.conformance.persistent",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed files differ from a fresh "
                        "generation")
    args = parser.parse_args(argv)
    if not args.check:
        print(f"wrote {len(generate(args.directory))} persistent vectors to {args.directory}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = sorted(p.relative_to(tmp) for p in Path(tmp).rglob("*") if p.is_file())
        stale = [str(p) for p in fresh if not (args.directory / p).is_file()
                 or (args.directory / p).read_bytes() != (Path(tmp) / p).read_bytes()]
    if stale:
        print(f"{args.directory}: out of date ({', '.join(stale)}); regenerate with: python -m "
              f"dspark_abi.conformance.persistent {args.directory}")
        return 1
    print(f"{args.directory}: the persistent vectors are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
