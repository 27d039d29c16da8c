"""`dspark`: run a packed prefill end to end from the command line.

    dspark prefill --config tiny --request 3@126 --request 4@30 --tp 2

builds the batch, fills each request's cached context by running its earlier tokens first, runs the
forward (random weights unless ``--weights DIR``) and prints a per-request summary.

Every input is checked before anything is computed or written (requests, --save target, --weights files,
installed extras, the memory the run needs); a mistake ends in one line on stderr with the fix, exit code 2
for usage errors and unreadable files, 1 for invalid input and failed runs.
"""

# The parser's description is this docstring (``dspark --help``); the checks are in dspark_kernels.cli.checks,
# the progress display in dspark_kernels.cli.progress.

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PackedBatch, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.cli.common import (
    Parser,
    UsageError,
    add_batch_arguments,
    add_version,
    check_output,
    printable,
)
from dspark_abi.errors import ABIError
from dspark_abi.io import fixtures, safe_write
from dspark_kernels import memory
from dspark_kernels.api import prefill
from dspark_kernels.cli import generate, speculate
from dspark_kernels.cli.checks import RunError, check_extras, check_memory, check_requests, load_config, load_weights
from dspark_kernels.cli.progress import PROGRESS_DELAY_S, ContextProgress, LayerProgress, progress_mode
from dspark_kernels.model import tp
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.numerics import PRECISIONS
from dspark_kernels.model.prepared import PreparedWeightsCache
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.pypto.errors import PyptoUnavailableError

PROG = "dspark prefill"


# ---------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    # 1. every check before anything is computed or written
    check_extras(args)
    check_output("--save", args.save, "prefill.safetensors")  # a wrong, missing or read-only target: exit 2
    config = load_config(args)
    requests = [(new, cached) for new, cached in args.request]
    check_requests(config, requests, PaddingPolicy(tp_size=args.tp))
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, config.vocab_size, cached + new) for new, cached in requests]
    allocator = BlockAllocator(config, pool_blocks_for(config, [c + n for n, c in requests]))
    context, builder, batch = _plan(config, allocator, requests, prompts, args.tp)
    weights = load_weights(args, config)
    check_memory(config, args, [*(b for _, b in context), batch], allocator.pool_blocks, weights)
    mode = progress_mode(args)
    _announce(args, config, weights, context, batch, mode)

    # 2. the cached context: every request's earlier tokens first (chunks of at most token_cap), then the batch
    caches = ModelCaches.allocate(config, allocator.pool_blocks, precision=args.precision)
    prepared = PreparedWeightsCache(keep=weights.keep_layers)  # the run's prepared weights, shared by its calls
    t_ctx = time.perf_counter()
    with ContextProgress(mode, [(rid, ctx.num_tokens) for rid, ctx in context], config.num_layers) as fill:
        for i, (_, ctx) in enumerate(context):
            prefill(ctx, _token_ids(ctx), weights, caches, precision=args.precision, backend=args.backend,
                    prepared=prepared, on_layer=fill.chunk(i))
    t_ctx = time.perf_counter() - t_ctx
    t0 = time.perf_counter()
    hidden, sampled, rows, logits, target = _run_batch(batch, weights, caches, args,
                                                       LayerProgress("prefill", mode, config.num_layers), prepared)
    elapsed = time.perf_counter() - t0
    builder.commit(batch)                                   # the forward ran: the requests advance

    by_row = {int(r): int(s) for r, s in zip(rows, sampled, strict=True) if r >= 0}
    summary = []
    record = batch.requests
    for i, (new, cached) in enumerate(requests):
        out_row = int(record.logit_row[i])                  # -1: the request asked for no output
        summary.append({"request": i, "new_tokens": new, "cached_tokens": cached,
                        "positions": [cached, cached + new - 1] if new else [],
                        "next_token": by_row.get(out_row) if out_row >= 0 else None})
    if args.save:  # before the summary: a failed write must not follow a printed success
        _save(args.save, batch, hidden, rows, logits, sampled, target)
    features = None if target is None else {"layers": list(config.dspark_target_layers), "shape": list(target.shape),
                                            "reduction": "mean of the hc streams (DeepSeek's h.mean(dim=2))",
                                            "saved_as": "outputs.target_hidden" if args.save else None}
    if args.json:
        print(json.dumps({"config": config.name, "tp": args.tp, "mode": args.mode, "precision": args.precision,
                          "backend": args.backend, "tokens": batch.num_tokens, "seconds": elapsed,
                          "context_seconds": t_ctx, "peak_rss_bytes": memory.peak_rss_bytes(),
                          "requests": summary, "target_hidden": features}, indent=2))
    else:
        print(f"config={config.name} TP={args.tp} mode={args.mode} backend={args.backend} "
              f"precision={args.precision} N={batch.num_tokens} P={batch.padded_rows} L={batch.local_rows}")
        print(f"{'request':>7} {'new':>5} {'cached':>7} {'positions':>13} {'next token':>10}")
        for s in summary:
            span = f"{s['positions'][0]}-{s['positions'][1]}" if s["positions"] else "-"
            nxt = "-" if s["next_token"] is None else str(s["next_token"])
            print(f"{s['request']:>7} {s['new_tokens']:>5} {s['cached_tokens']:>7} {span:>13} {nxt:>10}")
        print(f"prefill {batch.num_tokens} tokens in {elapsed:.3f} s ({batch.num_tokens / elapsed:,.0f} tokens/s); "
              f"context fill {t_ctx:.3f} s; peak memory {memory.format_bytes(memory.peak_rss_bytes())}")
        if features is not None and target is not None:
            print(f"DSpark target hidden: layers {features['layers']} -> [{target.shape[0]}, {target.shape[1]}] "
                  "(the mean of each layer's output hc streams, as DeepSeek's DSpark code; concatenated)")
    if args.save:
        print(f"wrote {args.save}", file=sys.stderr)
    return 0


#: What a random-weight run of a model whose weights are streamed (FLASH-size) costs, as measured: --config flash
#: --request 3@126 --tp 3 on a 2-core CPU. Said up front, since nothing else shows for the first minutes.
STREAMED_RANDOM_RUN = "about 12 minutes on a 2-core CPU for --config flash --request 3@126"


def _announce(args: argparse.Namespace, config: ModelConfig, weights: ModelWeights,
              context: Sequence[tuple[int, PackedBatch]], batch: PackedBatch, mode: str) -> None:
    """Before the first call, on stderr: a warning for a slow random-weight run, and off a terminal (logs), the
    stages of a run that may take minutes (streamed weights, or a context of several chunks), so it never starts
    silently."""
    if args.weights is None and not weights.keep_layers:
        print(f"{PROG}: note: random {config.name} weights are too large to keep: every layer and expert is "
              f"generated when the run reaches it, so this run is slow ({STREAMED_RANDOM_RUN}); --config tiny runs "
              "in seconds", file=sys.stderr, flush=True)
    if mode == "lines" and (len(context) > 1 or not weights.keep_layers):     # a run that may take minutes
        tokens = sum(ctx.num_tokens for _, ctx in context)
        print(f"{PROG}: {len(context)} context call(s) ({tokens} cached tokens), then the prefill of "
              f"{batch.num_tokens} tokens; {config.num_layers} layers each; progress lines follow once a stage "
              f"has run {PROGRESS_DELAY_S:g} s", file=sys.stderr, flush=True)


def _plan(config: ModelConfig, allocator: BlockAllocator, requests: Sequence[tuple[int, int]],
          prompts: Sequence[np.ndarray], tp: int
          ) -> tuple[list[tuple[int, PackedBatch]], BatchBuilder, PackedBatch]:
    """Every batch of the run, built (and so validated) before any is computed: the context chunks
    (request, batch) in order, then the packed batch and the builder that commits it after its forward.

    A chunk is committed as soon as it is built, so that the request's next chunk continues after it: the run
    owns its allocator, and planning every step before the first forward keeps every check ahead of every write."""
    context = BatchBuilder(config, PaddingPolicy(tp_size=1), allocator)
    chunks = []
    for rid, (_, cached) in enumerate(requests):
        for lo in range(0, cached, context.policy.token_cap):
            hi = min(cached, lo + context.policy.token_cap)
            context.add(rid, num_cached=lo, num_new=hi - lo, token_ids=prompts[rid][lo:hi], logits="none")
            chunk = context.build()                          # an earlier chunk: no logits
            context.commit(chunk)
            chunks.append((rid, chunk))
    builder = BatchBuilder(config, PaddingPolicy(tp_size=tp), allocator)
    for rid, (new, cached) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new, token_ids=prompts[rid][cached:])
    return chunks, builder, builder.build()


def _token_ids(batch: PackedBatch) -> np.ndarray:
    """The batch's token ids (every batch of a run is built from its prompts)."""
    if batch.token_ids is None:
        raise RunError("a batch of the run has no token ids")
    return batch.token_ids


def _save(path: str, batch: PackedBatch, hidden: np.ndarray, rows: np.ndarray, logits: np.ndarray,
          sampled: np.ndarray, target: np.ndarray | None) -> None:
    tensors = {"outputs.hidden": hidden, "outputs.logit_rows": rows.astype(np.int32), "outputs.logits": logits,
               "outputs.sampled": sampled}
    if target is not None:
        tensors["outputs.target_hidden"] = target
    if batch.token_ids is not None:
        tensors["inputs.token_ids"] = batch.token_ids
    try:
        fixtures.save(path, batch, tensors=tensors)
    except safe_write.WriteTargetError as exc:  # the reason the system gave, e.g. a full disk
        raise RunError(f"--save {printable(path)}: {printable(exc.reason)}; {printable(exc.fix)}") from None


def _run_batch(batch: PackedBatch, weights: ModelWeights, caches: ModelCaches, args: argparse.Namespace,
               progress: LayerProgress, prepared: PreparedWeightsCache
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(hidden, sampled, logit rows, logits, target hidden) of the batch in the chosen execution mode and backend
    (``prepared``: the run's prepared weights; a rank process prepares its own)."""
    tokens = _token_ids(batch)
    if args.mode == "group":
        with progress as on_layer:
            res = prefill(batch, tokens, weights, caches, precision=args.precision, backend=args.backend,
                          prepared=prepared, on_layer=on_layer)
        return res.hidden, res.sampled, res.logit_rows, res.logits, res.target_hidden
    if args.mode == "threads":
        with progress as on_layer:
            results = tp.run_tp_inprocess(batch, tokens, weights, caches, precision=args.precision,
                                          backend=args.backend, prepared=prepared, on_layer=on_layer)
    else:  # rank 0's process reports its layers (the progress object travels unopened)
        job = tp.DistributedJob(batch=batch, inputs=tokens, weights=weights, caches=caches,
                                precision=args.precision, backend=args.backend, on_layer=progress)
        results = tp.launch(job, backend=args.dist_backend, device="cuda" if args.dist_backend == "nccl" else "cpu")
    out = results[0].result
    return out.hidden, out.sampled, out.logit_rows, out.logits, out.target_hidden


# ---------------------------------------------------------------------------------------------- parser
def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (numpy seeds are non-negative), got {value}; "
                                         "pass e.g. --seed 0")
    return value


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dspark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prefill", help="build a packed batch, fill cached contexts and run the forward")
    add_batch_arguments(p, config_note="With --weights DIR holding a config.json, that config is the model's and "
                                       "--config is ignored (a note on stderr says so).")
    p.set_defaults(config=None)  # None: not given (tiny, or the config.json of --weights DIR)
    p.add_argument("--mode", choices=["group", "threads", "distributed"], default="group",
                   help="group: whole group in one call; threads: one thread per rank view; "
                        "distributed: one process per rank on torch.distributed")
    p.add_argument("--dist-backend", choices=["gloo", "nccl"], default=None,
                   help="torch.distributed backend for --mode distributed: gloo (CPU, default) or nccl (one CUDA "
                        "GPU per rank)")
    p.add_argument("--backend", choices=["reference", "pypto"], default="reference",
                   help="attention backend: reference (numpy) or pypto (needs --precision a2a3 and the pypto extra)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="fp32: exact math; a2a3: the a2a3 kernels' bf16/int8 numerics; deepseek: the official "
                        "inference's bf16 activations with FP8/FP4 fake quantisation (docs/kernels.md)")
    p.add_argument("--weights", metavar="DIR", help="safetensors checkpoint folder (default: random weights); its "
                   "config.json, when present, is the model's config and --config is ignored")
    p.add_argument("--seed", type=_seed, default=0, help="seed (>= 0) of random weights and prompts")
    p.add_argument("--save", metavar="FILE", help="write a fixture with the batch, inputs and outputs")
    p.add_argument("--json", action="store_true", help="machine-readable summary (the only output on stdout)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="force the progress bar (default: a bar on a terminal, else a line per layer of calls "
                            f"that run over {PROGRESS_DELAY_S:g} s)")
    shown.add_argument("--no-progress", dest="progress", action="store_false", help="no progress output")
    p.set_defaults(func=run, progress=None)
    speculate.add_parser(sub)
    generate.add_parser(sub)
    return parser


# ---------------------------------------------------------------------------------------------- errors
def _fail(message: str, code: int, prog: str = PROG) -> int:
    text = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
    print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    return code


def _abi_line(exc: ABIError, args: argparse.Namespace) -> str:
    """One line for an ABIError: the first issue (message, expected, actual), then how many more."""
    if not exc.issues:
        return str(exc)
    first = exc.issues[0]
    text = str(first)
    # its registered hint is generic: name the --request to change (commands without --request keep it)
    if first.code == "builder.request" and hasattr(args, "request"):
        text = text.removesuffix(first.hint) + "change that --request value"
        if first.request is not None and 0 <= first.request < len(args.request):
            new, cached = args.request[first.request]
            text = f"--request {new}@{cached}: {text}"
    if len(exc.issues) > 1:
        text += f" (and {len(exc.issues) - 1} more: {', '.join(sorted({i.code for i in exc.issues[1:]}))})"
    return text


def _logged(exc: BaseException, what: str) -> str:
    """'WHAT: first line of the error (full report in FILE)': the full text goes to a log file, not the screen."""
    fd, path = tempfile.mkstemp(prefix="dspark-prefill-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        log.write("".join(traceback.format_exception(exc)))
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return f"{what}: {type(exc).__name__}: {first.strip()} (full report in {path})"


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `dspark ... | head` ends quietly, like other command-line tools
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        args = make_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error argparse already printed in one line (2)
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    prog = getattr(args, "prog_name", PROG)
    try:
        return int(args.func(args))
    except UsageError as exc:
        return _fail(str(exc), 2, prog)
    except generate.StartupError as exc:      # every failed start-up check: one coded line each
        for line in generate.issue_lines(exc):
            print(f"{prog}: error: {line}", file=sys.stderr)
        return 1
    except RunError as exc:
        return _fail(str(exc), 1, prog)
    except ABIError as exc:
        return _fail(_abi_line(exc, args), 1, prog)
    except MemoryError:
        return _fail("ran out of memory; use --config tiny or fewer and shorter --request values", 1, prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except PyptoUnavailableError as exc:  # found by the pypto kernel process: a tool or version it needs
        return _fail(f"--backend pypto: {exc}", 2, prog)
    except Exception as exc:  # a failed run (pypto kernel process, rank process) or a bug: one line + a log file
        what = f"the {args.backend} prefill failed" if args.command == "prefill" else "the run failed"
        return _fail(_logged(exc, what), 1, prog)
