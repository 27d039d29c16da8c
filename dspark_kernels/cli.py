"""`dspark`: run a packed prefill end to end from the command line.

    dspark prefill --config tiny --request 3@126 --request 4@30 --tp 2

builds the batch, fills each request's cached context by running its earlier tokens first, runs the
forward (random weights unless ``--weights DIR``) and prints a per-request summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.cli import parse_request, run_cli
from dspark_abi.presets import PRESETS, get_preset
from dspark_kernels.api import prefill
from dspark_kernels.model_caches import ModelCaches
from dspark_kernels.model_weights import ModelWeights


class LayerProgress:
    """A one-line progress bar across layers on stderr (only when stderr is a terminal or forced)."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled, self.t0 = label, enabled, time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * done // total
        bar = "#" * filled + "." * (width - filled)
        end = "\n" if done == total else ""
        print(f"\r{self.label} [{bar}] layer {done}/{total} {time.perf_counter() - self.t0:6.1f}s", end=end,
              file=sys.stderr, flush=True)


def _load_model(args: argparse.Namespace) -> tuple[ModelConfig, ModelWeights]:
    if args.weights is None:
        config = get_preset(args.config)
        return config, ModelWeights.random(config, seed=args.seed)
    folder = Path(args.weights)
    hf = folder / "config.json"
    config = ModelConfig.from_hf_config(json.loads(hf.read_text()), name=folder.name) if hf.exists() \
        else get_preset(args.config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"--weights {folder}: no *.safetensors files found")
    return config, ModelWeights.from_safetensors(files, config)


def run(args: argparse.Namespace) -> int:
    config, weights = _load_model(args)
    requests = [(new, cached) for new, cached in args.request]
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, config.vocab_size, cached + new) for new, cached in requests]
    allocator = BlockAllocator(config, pool_blocks_for(config, [c + n for n, c in requests]))
    caches = ModelCaches.allocate(config, allocator.pool_blocks, precision=args.precision)
    show = args.progress or sys.stderr.isatty()

    # 1. the cached context: run every request's earlier tokens first (chunks of at most token_cap)
    context = BatchBuilder(config, PaddingPolicy(tp_size=1), allocator)
    t_ctx = time.perf_counter()
    for rid, (_, cached) in enumerate(requests):
        for lo in range(0, cached, context.policy.token_cap):
            hi = min(cached, lo + context.policy.token_cap)
            context.add(rid, num_cached=lo, num_new=hi - lo, token_ids=prompts[rid][lo:hi])
            batch = context.build(logit_rows=None)
            prefill(batch, batch.token_ids, weights, caches, precision=args.precision, backend=args.backend,
                    on_layer=LayerProgress(f"context r{rid}", show))
    t_ctx = time.perf_counter() - t_ctx

    # 2. the packed batch itself
    builder = BatchBuilder(config, PaddingPolicy(tp_size=args.tp), allocator)
    for rid, (new, cached) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new, token_ids=prompts[rid][cached:])
    batch = builder.build()
    t0 = time.perf_counter()
    hidden, sampled, rows, logits = _run_batch(batch, weights, caches, args, show)
    elapsed = time.perf_counter() - t0

    by_row = {int(r): int(s) for r, s in zip(rows, sampled, strict=True) if r >= 0}
    summary = []
    for i, (new, cached) in enumerate(requests):
        last = int(batch.query_start_loc[i + 1]) - 1
        summary.append({"request": i, "new_tokens": new, "cached_tokens": cached,
                        "positions": [cached, cached + new - 1] if new else [],
                        "next_token": by_row.get(last) if new else None})
    if args.json:
        print(json.dumps({"config": config.name, "tp": args.tp, "mode": args.mode, "precision": args.precision,
                          "backend": args.backend, "tokens": batch.num_tokens, "seconds": elapsed,
                          "context_seconds": t_ctx, "requests": summary}, indent=2))
    else:
        print(f"config={config.name} TP={args.tp} mode={args.mode} backend={args.backend} "
              f"precision={args.precision} N={batch.num_tokens} P={batch.padded_rows} L={batch.local_rows}")
        print(f"{'request':>7} {'new':>5} {'cached':>7} {'positions':>13} {'next token':>10}")
        for s in summary:
            span = f"{s['positions'][0]}-{s['positions'][1]}" if s["positions"] else "-"
            nxt = "-" if s["next_token"] is None else str(s["next_token"])
            print(f"{s['request']:>7} {s['new_tokens']:>5} {s['cached_tokens']:>7} {span:>13} {nxt:>10}")
        print(f"prefill {batch.num_tokens} tokens in {elapsed:.3f} s ({batch.num_tokens / elapsed:,.0f} tokens/s); "
              f"context fill {t_ctx:.3f} s")
    if args.save:
        from dspark_abi import fixtures

        tensors = {"outputs.hidden": hidden, "outputs.logit_rows": rows.astype(np.int32), "outputs.logits": logits,
                   "outputs.sampled": sampled}
        if batch.token_ids is not None:
            tensors["inputs.token_ids"] = batch.token_ids
        fixtures.save(args.save, batch, tensors=tensors)
        print(f"wrote {args.save}")
    return 0


def _run_batch(batch, weights, caches, args, show):  # type: ignore[no-untyped-def]
    """(hidden, sampled, logit rows, logits) of the batch in the chosen execution mode."""
    if args.mode == "group" or args.tp == 1:
        res = prefill(batch, batch.token_ids, weights, caches, precision=args.precision, backend=args.backend,
                      on_layer=LayerProgress("prefill", show))
        return res.hidden, res.sampled, res.logit_rows, res.logits
    from dspark_kernels import tp

    if args.mode == "threads":
        results = tp.run_tp_inprocess(batch, batch.token_ids, weights, caches, precision=args.precision)
    else:
        job = tp.DistributedJob(batch=batch, inputs=batch.token_ids, weights=weights, caches=caches,
                                precision=args.precision)
        results = tp.launch(job, backend=args.dist_backend)
    out = results[0].result
    return out.hidden, out.sampled, out.logit_rows, out.logits


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prefill", help="build a packed batch, fill cached contexts and run the forward")
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    p.add_argument("--request", action="append", type=parse_request, required=True, metavar="TOKENS@CACHED",
                   help="one request: new tokens @ cached tokens (repeatable)")
    p.add_argument("--tp", type=int, default=1, help="TP group size (default 1)")
    p.add_argument("--mode", choices=["group", "threads", "distributed"], default="group",
                   help="group: whole group in one call; threads: one thread per rank view; "
                        "distributed: one process per rank on torch.distributed")
    p.add_argument("--dist-backend", default="gloo", help="torch.distributed backend for --mode distributed")
    p.add_argument("--backend", choices=["reference", "pypto"], default="reference")
    p.add_argument("--precision", choices=["fp32", "a2a3"], default="fp32")
    p.add_argument("--weights", metavar="DIR", help="safetensors checkpoint folder (default: random weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts")
    p.add_argument("--save", metavar="FILE", help="write a fixture with the batch, inputs and outputs")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.add_argument("--progress", action="store_true", help="force the layer progress bar")
    p.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(make_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
