"""`dspark-abi`: build, show, validate and check packed-prefill metadata from the command line.

    dspark-abi build --request 3@126 --request 4@30 --tp 2      # readable layout per rank
    dspark-abi build --request 3@126 --tp 2 --json               # machine output
    dspark-abi show batch.safetensors                            # the same for a saved batch
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from collections.abc import Sequence

import numpy as np

from dspark_abi.allocator import BlockAllocator
from dspark_abi.batch import PackedBatch, PoolBlocks
from dspark_abi.builder import BatchBuilder
from dspark_abi.cli_files import add_file_commands
from dspark_abi.errors import ABIError
from dspark_abi.layout import POOL_NAMES
from dspark_abi.policy import PaddingPolicy
from dspark_abi.presets import PRESETS, get_preset

_REQUEST = re.compile(r"^(\d+)@(\d+)$")
#: Short column names for the seven slot mappings in the text layout.
_SHORT = {"ori": "ori", "csa_cmp": "c4", "hca_cmp": "c128", "idx": "idx", "csa_state": "s4",
          "csa_inner_state": "si", "hca_state": "s128"}


def parse_request(text: str) -> tuple[int, int]:
    """'TOKENS@CACHED' -> (new tokens, cached tokens)."""
    m = _REQUEST.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"request {text!r} must look like TOKENS@CACHED, e.g. 3@126")
    return int(m.group(1)), int(m.group(2))


def build_batch(config_name: str, requests: Sequence[tuple[int, int]], tp: int, pool_blocks: int | None = None,
                pad_position: str = "zero") -> PackedBatch:
    """Build a batch of fresh requests (ids 0..R-1) with an allocator sized to fit them."""
    config = get_preset(config_name)
    policy = PaddingPolicy(tp_size=tp, pad_position=pad_position)  # type: ignore[arg-type]
    if pool_blocks is None:  # enough for every request's touched pages, with room to grow
        pool_blocks = max(8, 2 * sum(_pages_needed(config, new, cached) for new, cached in requests))
    builder = BatchBuilder(config, policy, BlockAllocator(config, PoolBlocks.uniform(pool_blocks)))
    for rid, (new, cached) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new)
    return builder.build()


def _pages_needed(config, new: int, cached: int) -> int:  # type: ignore[no-untyped-def]
    worst = 0
    for pl in config.layout:
        lo, hi = config.layout.read_range(pl.name, cached, cached + new)
        worst = max(worst, -(-(hi - lo) // pl.page_size) + 1)
    return worst


def layout_rows(batch: PackedBatch) -> list[dict]:
    """One dict per group row: rank, row, request index and id, position, the seven slots."""
    out = []
    for r in range(batch.tp_size):
        view = batch.rank(r)
        for i in range(batch.local_rows):
            row = view.row_start + i
            req = int(view.local_request_ids[i])
            out.append({
                "rank": r, "row": row, "local_row": i, "request": req,
                "request_id": int(batch.request_ids[req]) if req >= 0 else None,
                "position": int(batch.positions[row]),
                "slots": {p: int(batch.slots[p][row]) for p in POOL_NAMES},
            })
    return out


def render_text(batch: PackedBatch) -> str:
    """Readable layout: geometry header, then per rank each row's request, position and slots."""
    lines = [
        f"config={batch.config.name} TP={batch.tp_size} R={batch.num_requests} N={batch.num_tokens} "
        f"P={batch.padded_rows} L={batch.local_rows}",
        f"query_start_loc={batch.query_start_loc.tolist()}",
    ]
    header = f"{'row':>5} {'req':>4} {'pos':>6} " + " ".join(f"{_SHORT[p]:>7}" for p in POOL_NAMES)
    for r in range(batch.tp_size):
        view = batch.rank(r)
        lines.append(f"rank {r}: rows [{view.row_start}, {view.row_stop}) "
                     f"local_request_ids={view.local_request_ids.tolist()}")
        lines.append("  " + header)
        for row in layout_rows(batch)[r * batch.local_rows:(r + 1) * batch.local_rows]:
            req = "pad" if row["request"] < 0 else str(row["request"])
            slots = " ".join(f"{row['slots'][p]:>7}" for p in POOL_NAMES)
            lines.append(f"  {row['row']:>5} {req:>4} {row['position']:>6} {slots}")
    lines.append("slots: -1 = no write; c4/idx/c128 are written only on ratio boundaries ((p+1) % ratio == 0)")
    return "\n".join(lines)


def render_json(batch: PackedBatch) -> str:
    return json.dumps({
        "config": batch.config.name, "tp_size": batch.tp_size, "num_requests": batch.num_requests,
        "num_tokens": batch.num_tokens, "padded_rows": batch.padded_rows, "local_rows": batch.local_rows,
        "query_start_loc": batch.query_start_loc.tolist(), "request_ids": batch.request_ids.tolist(),
        "rows": layout_rows(batch),
    }, indent=2)


def render_png(batch: PackedBatch, path: str) -> None:
    """Picture of the row layout: one colored cell per row and rank, labelled with request and position."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # optional extra
        raise SystemExit("--png needs matplotlib: pip install 'dspark[plot]'") from exc
    rows = layout_rows(batch)
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * batch.local_rows), 0.9 * batch.tp_size + 1))
    cmap = plt.get_cmap("tab20")
    for row in rows:
        x, y = row["local_row"], batch.tp_size - 1 - row["rank"]
        color = "#dddddd" if row["request"] < 0 else cmap(row["request"] % 20)
        ax.add_patch(plt.Rectangle((x, y), 0.95, 0.9, color=color))
        label = "pad" if row["request"] < 0 else f"r{row['request']}\np{row['position']}"
        ax.text(x + 0.47, y + 0.45, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, batch.local_rows)
    ax.set_ylim(0, batch.tp_size)
    ax.set_yticks([batch.tp_size - 1 - r + 0.45 for r in range(batch.tp_size)], [f"rank {r}" for r in range(
        batch.tp_size)])
    ax.set_xticks([])
    ax.set_title(f"N={batch.num_tokens} P={batch.padded_rows} L={batch.local_rows} "
                 f"qsl={batch.query_start_loc.tolist()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _emit(batch: PackedBatch, args: argparse.Namespace) -> int:
    print(render_json(batch) if args.json else render_text(batch))
    if getattr(args, "png", None):
        render_png(batch, args.png)
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    batch = build_batch(args.config, args.request, args.tp, args.pool_blocks, args.pad_position)
    if args.save:
        from dspark_abi import fixtures

        fixtures.save(args.save, batch)
    return _emit(batch, args)


def _cmd_show(args: argparse.Namespace) -> int:
    from dspark_abi import fixtures

    return _emit(fixtures.load(args.file).batch, args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-abi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build a packed batch from TOKENS@CACHED requests and show its layout")
    build.add_argument("--config", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    build.add_argument("--request", action="append", type=parse_request, required=True, metavar="TOKENS@CACHED",
                       help="one request: new tokens @ already cached tokens (repeatable)")
    build.add_argument("--tp", type=int, default=1, help="TP group size (default 1)")
    build.add_argument("--pool-blocks", type=int, default=None, help="blocks per pool (default: sized to fit)")
    build.add_argument("--pad-position", choices=["zero", "continue"], default="zero")
    build.add_argument("--json", action="store_true", help="machine-readable output")
    build.add_argument("--png", metavar="FILE", help="also draw the layout to a PNG (needs matplotlib)")
    build.add_argument("--save", metavar="FILE", help="also write the batch as a fixture file")
    build.set_defaults(func=_cmd_build)
    show = sub.add_parser("show", help="show the layout of a saved batch fixture")
    show.add_argument("file")
    show.add_argument("--json", action="store_true")
    show.add_argument("--png", metavar="FILE")
    show.set_defaults(func=_cmd_show)
    add_file_commands(sub)
    return parser


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse, run the chosen subcommand, print ABI errors to stderr with exit code 1."""
    if hasattr(signal, "SIGPIPE"):  # `dspark... | head` ends quietly, like other command-line tools
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ABIError as exc:
        print(str(exc), file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(make_parser(), argv)


if __name__ == "__main__":
    np.set_printoptions(linewidth=120)
    sys.exit(main())
