"""`dspark-abi`: build, show, validate and check packed-prefill metadata from the command line.

    dspark-abi build --request 3@126 --request 4@30 --tp 2      # readable layout per rank
    dspark-abi build --request 3@126 --tp 2 --json               # machine output
    dspark-abi show batch.safetensors                            # the same for a saved batch, valid or not,
                                                                 # then its issues (exit 0/1/2 like validate)

Command-line mistakes end in one line on stderr, ``dspark-abi ...: error: what is wrong and the fix``, exit 2
(usage) or 1 (the batch or the run failed); ``--save`` and ``--png`` say ``wrote PATH`` on stderr, so stdout
holds only the layout (one JSON document with ``--json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from dspark_abi.allocator import BlockAllocator
from dspark_abi.batch import BatchGeometry, PackedBatch
from dspark_abi.builder import BatchBuilder
from dspark_abi.cli.common import (
    CommandError,
    Parser,
    UsageError,
    add_batch_arguments,
    add_version,
    check_output,
    int_in,
    printable,
    run_cli,
)
from dspark_abi.cli.files import add_file_commands, print_result
from dspark_abi.config import ModelConfig
from dspark_abi.conformance.runner import inspect_file
from dspark_abi.errors import Issue
from dspark_abi.fields import FIELDS
from dspark_abi.io import fixtures, safe_write
from dspark_abi.io.fixtures import FixtureFile
from dspark_abi.layout import POOL_NAMES
from dspark_abi.policy import PaddingPolicy
from dspark_abi.pools import SLOT_FIELDS, PoolBlocks
from dspark_abi.presets import get_preset

#: Short column names for the seven slot mappings in the text layout.
_SHORT = {"ori": "ori", "csa_cmp": "c4", "hca_cmp": "c128", "idx": "idx", "csa_state": "s4",
          "csa_inner_state": "si", "hca_state": "s128"}
#: Largest --pool-blocks: the allocator holds a free list per pool (4 bytes a block, seven pools).
CLI_MAX_POOL_BLOCKS = 1 << 20


def _pool_blocks(text: str) -> int:
    try:
        return int_in(text, 1, CLI_MAX_POOL_BLOCKS, "pool blocks")
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"pool blocks must be an integer >= 1 (at most {CLI_MAX_POOL_BLOCKS}), got "
                                         f"{text!r}; leave --pool-blocks out to size the pools to fit") from None


def build_batch(config_name: str, requests: Sequence[tuple[int, int]], tp: int, pool_blocks: int | None = None,
                pad_position: Literal["zero", "continue"] = "zero") -> PackedBatch:
    """Build a batch of fresh requests (ids 0..R-1) with an allocator sized to fit them.

    requests: (new tokens, cached tokens) pairs, the order of ``--request TOKENS@CACHED``.
    """
    config = get_preset(config_name)
    policy = PaddingPolicy(tp_size=tp, pad_position=pad_position)
    if pool_blocks is None:  # enough for every request's touched pages, with room to grow
        pool_blocks = max(8, 2 * sum(_pages_needed(config, new, cached) for new, cached in requests))
    builder = BatchBuilder(config, policy, BlockAllocator(config, PoolBlocks.uniform(pool_blocks)))
    for rid, (new, cached) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new)
    return builder.build()


def _pages_needed(config: ModelConfig, new: int, cached: int) -> int:
    # clipped to the model's context: the builder reports a request beyond it (instead of huge pools being made)
    stop = min(cached + new, config.max_position_embeddings)
    start = min(cached, stop)
    worst = 0
    for pl in config.layout:
        lo, hi = config.layout.read_range(pl.name, start, stop)
        worst = max(worst, -(-(hi - lo) // pl.page_size) + 1)
    return worst


# ---------------------------------------------------------------------------------------------- layout views
_NO_GEOMETRY = frozenset({"array.missing", "array.dtype", "array.shape", "geometry.rows", "qsl.shape", "qsl.start",
                          "qsl.non_monotonic", "qsl.token_count"})


@attrs.frozen(eq=False)
class Layout(BatchGeometry):
    """What the layout views show: geometry, the request of every row, positions and the seven slot mappings.

    From a valid :class:`PackedBatch` (:meth:`of_batch`) or from a fixture's arrays, valid or not, whenever
    their geometry is readable (:meth:`of_fixture`). R, N, P and L come from :class:`BatchGeometry`.

    Attributes:
        config_name: Name of the model configuration.
        tp_size: TP.
        query_start_loc: [R+1] request offsets.
        request_ids: [R] serving request ids.
        positions: [P] position of each group row.
        slots: Pool -> [P] slot mapping.
    """

    config_name: str
    tp_size: int
    query_start_loc: np.ndarray
    request_ids: np.ndarray
    positions: np.ndarray
    slots: dict[str, np.ndarray]

    @classmethod
    def of_batch(cls, batch: PackedBatch) -> Layout:
        ids = batch.request_ids if batch.request_ids is not None else np.arange(batch.num_requests)
        return cls(batch.config.name, batch.tp_size, batch.query_start_loc, ids, batch.positions,
                   {p: batch.slots[p] for p in POOL_NAMES})

    @classmethod
    def of_fixture(cls, fixture: FixtureFile) -> Layout | None:
        """The layout of a fixture's arrays, or None when shape-level issues leave nothing drawable."""
        m, arrays = fixture.manifest, fixture.arrays
        shape_issues = fixture.validate("shape").issues
        if any(i.code in _NO_GEOMETRY and i.field in _LAYOUT_FIELDS for i in shape_issues):
            return None
        qsl = arrays["query_start_loc"]
        ids = arrays.get("request_ids")
        return cls(m.config.name, m.policy.tp_size, qsl, np.arange(len(qsl) - 1) if ids is None else ids,
                   arrays["positions"], {p: arrays[SLOT_FIELDS[p]] for p in POOL_NAMES})

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config_name, "tp_size": self.tp_size, "num_requests": self.num_requests,
                "num_tokens": self.num_tokens, "padded_rows": self.padded_rows, "local_rows": self.local_rows,
                "query_start_loc": self.query_start_loc.tolist(), "request_ids": self.request_ids.tolist(),
                "rows": layout_rows(self)}


#: The ABI fields a :class:`Layout` draws (declared in :mod:`dspark_abi.fields`, named as its attributes or their
#: per-pool family): shape-level issues on them leave no geometry to draw (row ownership, positions, slots).
_LAYOUT_FIELDS = frozenset(f.name for f in FIELDS if {f.name, f.family} & set(attrs.fields_dict(Layout)))


def _layout(batch: PackedBatch | Layout) -> Layout:
    return batch if isinstance(batch, Layout) else Layout.of_batch(batch)


def layout_rows(batch: PackedBatch | Layout) -> list[dict[str, Any]]:
    """One dict per group row: rank, row, request index and id, position, the seven slots."""
    lay = _layout(batch)
    local = max(lay.local_rows, 1)
    row_request = lay.row_request
    ids = np.where(row_request >= 0, lay.request_ids[np.maximum(row_request, 0)], -1)
    columns = zip(range(lay.padded_rows), row_request.tolist(), ids.tolist(), lay.positions.tolist(),
                  *(lay.slots[p].tolist() for p in POOL_NAMES), strict=True)
    return [{"rank": row // local, "row": row, "local_row": row % local, "request": r,
             "request_id": i if r >= 0 else None, "position": pos, "slots": dict(zip(POOL_NAMES, slots, strict=True))}
            for row, r, i, pos, *slots in columns]


def render_text(batch: PackedBatch | Layout) -> str:
    """Readable layout: geometry header, then per rank each row's request, position and slots."""
    lay = _layout(batch)
    lines = [
        f"config={printable(lay.config_name)} TP={lay.tp_size} R={lay.num_requests} N={lay.num_tokens} "
        f"P={lay.padded_rows} L={lay.local_rows}",
        f"query_start_loc={lay.query_start_loc.tolist()}",
    ]
    header = f"{'row':>5} {'req':>4} {'pos':>6} " + " ".join(f"{_SHORT[p]:>7}" for p in POOL_NAMES)
    rows = layout_rows(lay)
    for r in range(lay.tp_size):
        mine = rows[r * lay.local_rows:(r + 1) * lay.local_rows]
        lines.append(f"rank {r}: rows [{r * lay.local_rows}, {(r + 1) * lay.local_rows}) "
                     f"local_request_ids={[row['request'] for row in mine]}")
        lines.append("  " + header)
        for row in mine:
            req = "pad" if row["request"] < 0 else str(row["request"])
            slots = " ".join(f"{row['slots'][p]:>7}" for p in POOL_NAMES)
            lines.append(f"  {row['row']:>5} {req:>4} {row['position']:>6} {slots}")
    lines.append("slots: -1 = no write; c4/idx/c128 are written only on ratio boundaries ((p+1) % ratio == 0)")
    return "\n".join(lines)


def render_json(batch: PackedBatch | Layout) -> str:
    return json.dumps(_layout(batch).to_dict(), indent=2)


#: Fields whose issue index is a group row, their first axis P (the picture marks that row's cell).
_ROW_FIELDS = frozenset(f.name for f in FIELDS if f.shape[:1] == ("P",))
#: Color of everything that marks an invalid batch in the picture.
INVALID_COLOR = "#d00000"


def offending_rows(lay: Layout, issues: Sequence[Issue]) -> set[int]:
    """Group rows the issues point at: the row of a per-row field's index, every row of an issue's request."""
    rows = {int(i.index) for i in issues if i.field in _ROW_FIELDS and isinstance(i.index, int)}
    requests = {int(i.request) for i in issues if isinstance(i.request, int)}
    row_request = lay.row_request
    rows |= {int(r) for r in np.flatnonzero(np.isin(row_request, list(requests)))} if requests else set()
    return {r for r in rows if 0 <= r < lay.padded_rows}


def render_png(batch: PackedBatch | Layout, path: str, issues: Sequence[Issue] = ()) -> None:
    """Picture of the row layout: one colored cell per row and rank, labelled with request and position.

    With ``issues`` (an invalid fixture), the title is a red banner ``INVALID: N issues (codes)`` and the cells of
    the rows they point at (:func:`offending_rows`) get a thick red frame and a red label, so the picture cannot be
    taken for a valid batch's."""
    import matplotlib  # optional (the plot extra), checked by _check_png before any work

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    lay = _layout(batch)
    rows = layout_rows(lay)
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * lay.local_rows), 0.9 * lay.tp_size + 1))
    cmap = plt.get_cmap("tab20")
    bad = offending_rows(lay, issues)
    for row in rows:
        x, y = row["local_row"], lay.tp_size - 1 - row["rank"]
        color = "#dddddd" if row["request"] < 0 else cmap(row["request"] % 20)
        ax.add_patch(Rectangle((x, y), 0.95, 0.9, color=color))
        label = "pad" if row["request"] < 0 else f"r{row['request']}\np{row['position']}"
        if row["row"] in bad:
            ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.87, 0.82, fill=False, edgecolor=INVALID_COLOR,
                                   linewidth=3))
        ax.text(x + 0.47, y + 0.45, label, ha="center", va="center", fontsize=8,
                color=INVALID_COLOR if row["row"] in bad else "black")
    ax.set_xlim(0, max(lay.local_rows, 1))
    ax.set_ylim(0, lay.tp_size)
    ax.set_yticks([lay.tp_size - 1 - r + 0.45 for r in range(lay.tp_size)], [f"rank {r}" for r in range(
        lay.tp_size)])
    ax.set_xticks([])
    geometry = f"N={lay.num_tokens} P={lay.padded_rows} L={lay.local_rows} qsl={lay.query_start_loc.tolist()}"
    if issues:
        codes = sorted({i.code for i in issues})
        shown = ", ".join(codes[:4]) + (", ..." if len(codes) > 4 else "")
        ax.set_title(f"INVALID: {len(issues)} issue{'s' if len(issues) != 1 else ''} ({shown})\n{geometry}",
                     color="white", backgroundcolor=INVALID_COLOR, fontweight="bold")
        for spine in ax.spines.values():
            spine.set_edgecolor(INVALID_COLOR)
            spine.set_linewidth(3)
    else:
        ax.set_title(geometry)
    fig.tight_layout()
    try:
        safe_write.write_with(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------- commands
def _check_png(path: str | None) -> None:
    check_output("--png", path, "layout.png")
    if path is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--png needs matplotlib: pip install 'dspark[plot]'")


def _write(option: str, path: str, write: Callable[[], object]) -> None:
    """Run ``write()``, then say 'wrote PATH' on stderr (stdout stays the layout, e.g. one JSON document)."""
    try:
        write()
    except safe_write.WriteTargetError as exc:
        raise CommandError(f"{option} {printable(path)}: {printable(exc.reason)}; {printable(exc.fix)}") from None
    except OSError as exc:
        raise CommandError(f"{option} {printable(path)}: cannot write: {exc.strerror or exc}") from None
    print(f"wrote {printable(path)}", file=sys.stderr)


def _cmd_build(args: argparse.Namespace) -> int:
    check_output("--save", args.save, "batch.safetensors")
    _check_png(args.png)
    batch = build_batch(args.config, args.request, args.tp, args.pool_blocks, args.pad_position)
    if args.save:
        _write("--save", args.save, lambda: fixtures.save(args.save, batch))
    lay = Layout.of_batch(batch)
    print(render_json(lay) if args.json else render_text(lay))
    if args.png:
        _write("--png", args.png, lambda: render_png(lay, args.png))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    """Layout when the geometry is readable, then every issue; exit 0 valid, 1 invalid, 2 unreadable."""
    _check_png(args.png)
    result, fixture = inspect_file(args.file)
    lay = None if fixture is None else Layout.of_fixture(fixture)
    if args.json:
        doc = result.to_dict() | (lay.to_dict() if lay is not None else {})
        print(json.dumps(doc, indent=2))
    else:
        if lay is not None:
            print(render_text(lay))
        if result.issues:
            print_result(result)
    if args.png:
        if lay is None:
            print(f"--png {printable(args.png)}: not drawn, the file has no readable layout (see the issues)",
                  file=sys.stderr)
        else:
            _write("--png", args.png, lambda: render_png(lay, args.png, result.issues))
    return result.exit_code


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dspark-abi", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build a packed batch from TOKENS@CACHED requests and show its layout")
    add_batch_arguments(build)
    build.add_argument("--pool-blocks", type=_pool_blocks, default=None, metavar="N",
                       help=f"blocks per pool, 1..{CLI_MAX_POOL_BLOCKS} (default: sized to fit)")
    build.add_argument("--pad-position", choices=["zero", "continue"], default="zero",
                       help="positions of the padding rows (TP > 1 pads N to a multiple of TP): 'zero' (default) "
                            "gives them position 0; 'continue' continues the last live row's position (p_last + 1, "
                            "p_last + 2, ...), as upstream's b1 fixture does")
    build.add_argument("--json", action="store_true", help="machine-readable output")
    build.add_argument("--png", metavar="FILE", help="also draw the layout to a PNG (needs matplotlib)")
    build.add_argument("--save", metavar="FILE", help="also write the batch as a fixture file")
    build.set_defaults(func=_cmd_build)
    show = sub.add_parser("show", help="show the layout of a fixture, then its issues (exit 0/1/2 like validate)",
                          description="Show a fixture's layout (also of an invalid batch whose geometry is "
                                      "readable), then every issue: exit 0 valid, 1 invalid, 2 unreadable.")
    show.add_argument("file", metavar="FILE")
    show.add_argument("--json", action="store_true", help="one JSON document: the validate fields plus the layout")
    show.add_argument("--png", metavar="FILE", help="also draw the layout to a PNG (needs matplotlib)")
    show.set_defaults(func=_cmd_show)
    add_file_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``dspark-abi`` program: parse ``argv`` (default ``sys.argv[1:]``), run, return the exit code."""
    return run_cli(make_parser(), argv)
