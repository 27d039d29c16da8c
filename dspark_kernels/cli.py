"""`dspark`: run a packed prefill end to end from the command line.

    dspark prefill --config tiny --request 3@126 --request 4@30 --tp 2

builds the batch, fills each request's cached context by running its earlier tokens first, runs the
forward (random weights unless ``--weights DIR``) and prints a per-request summary.

Every input is checked before anything is computed or written (requests, --save target, --weights files,
installed extras, the memory the run needs); a mistake ends in one line on stderr with the fix, exit code 2
for usage errors and unreadable files, 1 for invalid input and failed runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from tqdm import tqdm

from dspark_abi import BatchBuilder, BlockAllocator, ModelConfig, PackedBatch, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.cli import parse_request
from dspark_abi.errors import ABIError
from dspark_abi.presets import PRESETS, get_preset
from dspark_kernels import memory
from dspark_kernels.api import prefill
from dspark_kernels.model_caches import ModelCaches
from dspark_kernels.model_weights import ModelWeights, WeightsError
from dspark_kernels.pypto.errors import PyptoUnavailableError

PROG = "dspark prefill"
#: Off a terminal, a prefill call prints progress lines only once it has run this long (quick runs stay quiet).
PROGRESS_DELAY_S = 2.0
#: Off a terminal, at most this many progress lines per call (one per layer for models of up to 10 layers).
PROGRESS_LINES = 10
#: Share of the available memory a run may be estimated to use (the rest: the interpreter, other processes).
MEMORY_HEADROOM = 0.9


class UsageError(Exception):
    """A wrong flag, a missing extra or an unreadable file: exit code 2."""


class RunError(Exception):
    """Input the run cannot accept, or a run that failed: exit code 1."""


# ---------------------------------------------------------------------------------------------- progress
class LayerProgress:
    """``on_layer(done, total)`` of one prefill call, on stderr.

    mode 'bar': a tqdm bar (a terminal, or ``--progress``); 'lines': plain lines without carriage returns (one
    per layer, at most :data:`PROGRESS_LINES` per call) once the call has run :data:`PROGRESS_DELAY_S`, so logs
    of long runs show progress; 'off': nothing. Use as a context manager (the bar is closed however the call
    ends); it pickles without its bar, so a rank process can report its layers too.
    """

    def __init__(self, label: str, mode: str, total: int):
        self.label, self.mode, self.total = label, mode, total
        self.t0 = time.perf_counter()
        self._bar: Any = None
        self._printed = 0

    def __enter__(self) -> LayerProgress:
        self.t0 = time.perf_counter()
        if self.mode == "bar":
            self._open_bar()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_bar": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.t0 = time.perf_counter()

    def _open_bar(self) -> None:
        # follow the terminal's size; 80 x 24 where it reports 0 x 0 (a bare pty), which tqdm would draw as blanks
        sized = _terminal_has_size()
        self._bar = tqdm(total=self.total, desc=self.label, unit="layer", file=sys.stderr, leave=True,
                         dynamic_ncols=sized, ncols=None if sized else 80, nrows=None if sized else 24)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.mode == "bar":
            if self._bar is None:
                self._open_bar()
            self._bar.total = total
            self._bar.update(done - self._bar.n)
            if done >= total:
                self.close()
        elif self.mode == "lines":
            elapsed = time.perf_counter() - self.t0
            step = PROGRESS_LINES * done // total
            if elapsed < PROGRESS_DELAY_S or (step <= self._printed and done < total):
                return
            self._printed = step
            print(tqdm.format_meter(done, total, elapsed, prefix=self.label,
                                    bar_format="{desc}: layer {n_fmt}/{total_fmt} ({percentage:.0f}%) "
                                               "[{elapsed}<{remaining}]"), file=sys.stderr, flush=True)


def _terminal_has_size() -> bool:
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # not a real terminal (io.UnsupportedOperation is an OSError)
        return False
    return size.columns > 0 and size.lines > 0


def _progress_mode(args: argparse.Namespace) -> str:
    if args.progress is False:
        return "off"
    return "bar" if args.progress or sys.stderr.isatty() else "lines"


# ---------------------------------------------------------------------------------------------- checks
def _check_extras(args: argparse.Namespace) -> None:
    """The optional packages the chosen backend and mode need, and a precision the backend computes."""
    if args.backend == "pypto":
        missing = [m for m in ("pypto", "torch") if not _installed(m)]
        if missing:
            raise UsageError(f"--backend pypto needs {' and '.join(missing)}, which this Python does not have: "
                             "pip install 'dspark[pypto]'")
        if args.precision != "a2a3":
            raise UsageError(f"--backend pypto computes the a2a3 kernels' numerics, not {args.precision}: "
                             "pass --precision a2a3")
    if args.mode != "distributed":
        if args.dist_backend is not None:
            raise UsageError(f"--dist-backend {args.dist_backend} applies to --mode distributed only; add "
                             "--mode distributed or drop --dist-backend")
        return
    args.dist_backend = args.dist_backend or "gloo"
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise UsageError("--mode distributed needs torch, which this Python does not have: "
                         "pip install 'dspark[dist]' (or use --mode threads)") from None
    if not dist.is_available():
        raise UsageError("--mode distributed: this torch build has no torch.distributed: "
                         "pip install 'dspark[dist]' (or use --mode threads)")
    if args.dist_backend == "gloo" and not dist.is_gloo_available():
        raise UsageError("--dist-backend gloo: this torch build has no gloo: pip install 'dspark[dist]'")
    if args.dist_backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not dist.is_nccl_available() or gpus < args.tp:
            have = "no NCCL" if not dist.is_nccl_available() else f"{gpus} CUDA GPU(s)"
            raise UsageError(f"--dist-backend nccl needs a torch build with NCCL and {args.tp} CUDA GPUs (one per "
                             f"rank); this machine has {have}: use --dist-backend gloo")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_save_target(path: str | None) -> None:
    """--save must name a file in an existing, writable directory (checked before anything runs)."""
    if path is None:
        return
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise UsageError(f"--save {path}: is a directory; give a file name, e.g. "
                         f"--save {target / 'prefill.safetensors'}")
    if not parent.exists():
        raise UsageError(f"--save {path}: directory {parent} does not exist; create it (mkdir -p {parent}) "
                         "or save elsewhere")
    if not parent.is_dir():
        raise UsageError(f"--save {path}: {parent} is not a directory; save into a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--save {path}: directory {parent} is not writable; save into a writable directory")


def _check_requests(config: ModelConfig, requests: Sequence[tuple[int, int]], policy: PaddingPolicy) -> None:
    """The request limits of the model and of one prefill, phrased in --request terms."""
    limit = config.max_position_embeddings
    for new, cached in requests:
        if new + cached > limit:
            raise RunError(f"--request {new}@{cached}: {new + cached} tokens exceed the {config.name} model's "
                           f"max_position_embeddings={limit}; use NEW + CACHED <= {limit}")
    total = sum(new for new, _ in requests)
    if total < 1:
        raise RunError("the --request values have no new token to prefill; give at least one request NEW >= 1")
    if total > policy.token_cap:
        raise RunError(f"the --request values add up to {total} new tokens, more than one prefill takes "
                       f"(token_cap={policy.token_cap}); use at most {policy.token_cap} new tokens in total")


def _load_config(args: argparse.Namespace) -> ModelConfig:
    """--config, or the config.json of --weights DIR."""
    if args.weights is None:
        return get_preset(args.config)
    folder = Path(args.weights)
    if not folder.exists():
        raise UsageError(f"--weights {folder}: does not exist; pass the folder that holds the checkpoint's "
                         "*.safetensors files (and its config.json)")
    if not folder.is_dir():
        raise UsageError(f"--weights {folder}: is not a directory; pass the folder that holds it: "
                         f"--weights {folder.parent}")
    hf = folder / "config.json"
    if not hf.exists():
        return get_preset(args.config)
    fix = f"use the config.json that came with the checkpoint, or delete it to use --config {args.config}"
    try:
        data = json.loads(hf.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{hf}: cannot be read ({getattr(exc, 'strerror', None) or exc}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{hf}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); {fix}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{hf}: must hold a JSON object of model settings, not a {type(data).__name__}; {fix}")
    try:
        return ModelConfig.from_hf_config(data, name=folder.name)
    except ABIError as exc:
        bad = [f"{i.field.split(':', 1)[-1]} ({i.message})" for i in exc.issues]
        more = ", ..." if len(bad) > 3 else ""
        raise UsageError(f"{hf}: not a DeepSeek-V4 config: {len(bad)} key(s) missing or invalid: "
                         f"{', '.join(bad[:3])}{more}; {fix}") from None


def _load_weights(args: argparse.Namespace, config: ModelConfig) -> ModelWeights:
    if args.weights is None:
        return ModelWeights.random(config, seed=args.seed)
    folder = Path(args.weights)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"--weights {folder}: holds no *.safetensors files; pass the checkpoint's folder")
    try:
        return ModelWeights.from_safetensors(files, config)
    except WeightsError as exc:
        if exc.unreadable:
            raise UsageError(f"--weights {folder}: {exc.summary()}; re-download or re-convert that file") from None
        has_config = (folder / "config.json").exists()
        fix = ("point --weights at a DeepSeek-V4 checkpoint for this config.json" if has_config else
               f"point --weights at a DeepSeek-V4 checkpoint of --config {config.name}, or pass the --config it "
               "was made for (or put its config.json beside it)")
        raise RunError(f"--weights {folder}: {exc.summary()}; {fix}") from None


def _check_memory(config: ModelConfig, args: argparse.Namespace, batches: Sequence[PackedBatch],
                  pool_blocks: Any) -> None:
    """Refuse a run whose estimated memory exceeds what this machine has available."""
    tp = args.tp
    copies = {"group": (1, 1, 1), "threads": (1, tp, tp), "distributed": (1 + tp, 1 + 2 * tp, tp)}[args.mode]
    need = memory.estimate_prefill(
        config, pool_blocks, rows=max(b.padded_rows for b in batches), logit_rows=len(args.request),
        precision=args.precision, resident_layers=None if args.weights is None else 1,
        weight_copies=copies[0], cache_copies=copies[1], activation_copies=copies[2],
        kernel_processes=0 if args.backend != "pypto" else 1 if args.mode == "group" else tp)
    have = memory.available_bytes()
    if have is None or need.total <= MEMORY_HEADROOM * have:
        return
    what = f"--weights {args.weights} ({config.name})" if args.weights else f"--config {config.name}"
    way_out = "use --config tiny" if config.name != "tiny" else "use fewer or shorter --request values"
    raise RunError(f"{what} with {len(batches)} prefill call(s) needs about {need.describe()}, more than "
                   f"{MEMORY_HEADROOM:.0%} of the {memory.format_bytes(have)} available; {way_out} (or run on a "
                   "machine with more memory)")


# ---------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    # 1. every check before anything is computed or written
    _check_extras(args)
    _check_save_target(args.save)
    config = _load_config(args)
    requests = [(new, cached) for new, cached in args.request]
    _check_requests(config, requests, PaddingPolicy(tp_size=args.tp))
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, config.vocab_size, cached + new) for new, cached in requests]
    allocator = BlockAllocator(config, pool_blocks_for(config, [c + n for n, c in requests]))
    context, batch = _plan(config, allocator, requests, prompts, args.tp)
    weights = _load_weights(args, config)
    _check_memory(config, args, [*(b for _, b in context), batch], allocator.pool_blocks)

    # 2. the cached context: every request's earlier tokens first (chunks of at most token_cap), then the batch
    caches = ModelCaches.allocate(config, allocator.pool_blocks, precision=args.precision)
    mode = _progress_mode(args)
    t_ctx = time.perf_counter()
    for rid, ctx in context:
        with LayerProgress(f"context r{rid}", mode, config.num_layers) as on_layer:
            prefill(ctx, ctx.token_ids, weights, caches, precision=args.precision, backend=args.backend,
                    on_layer=on_layer)
    t_ctx = time.perf_counter() - t_ctx
    t0 = time.perf_counter()
    hidden, sampled, rows, logits = _run_batch(batch, weights, caches, args, LayerProgress("prefill", mode,
                                                                                            config.num_layers))
    elapsed = time.perf_counter() - t0

    by_row = {int(r): int(s) for r, s in zip(rows, sampled, strict=True) if r >= 0}
    summary = []
    for i, (new, cached) in enumerate(requests):
        last = int(batch.query_start_loc[i + 1]) - 1
        summary.append({"request": i, "new_tokens": new, "cached_tokens": cached,
                        "positions": [cached, cached + new - 1] if new else [],
                        "next_token": by_row.get(last) if new else None})
    if args.save:  # before the summary: a failed write must not follow a printed success
        _save(args.save, batch, hidden, rows, logits, sampled)
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
        print(f"wrote {args.save}", file=sys.stderr)
    return 0


def _plan(config: ModelConfig, allocator: BlockAllocator, requests: Sequence[tuple[int, int]],
          prompts: Sequence[np.ndarray], tp: int) -> tuple[list[tuple[int, PackedBatch]], PackedBatch]:
    """Every batch of the run, built (and so validated) before any is computed: the context chunks
    (request, batch) in order, then the packed batch."""
    context = BatchBuilder(config, PaddingPolicy(tp_size=1), allocator)
    chunks = []
    for rid, (_, cached) in enumerate(requests):
        for lo in range(0, cached, context.policy.token_cap):
            hi = min(cached, lo + context.policy.token_cap)
            context.add(rid, num_cached=lo, num_new=hi - lo, token_ids=prompts[rid][lo:hi])
            chunks.append((rid, context.build(logit_rows=None)))
    builder = BatchBuilder(config, PaddingPolicy(tp_size=tp), allocator)
    for rid, (new, cached) in enumerate(requests):
        builder.add(rid, num_cached=cached, num_new=new, token_ids=prompts[rid][cached:])
    return chunks, builder.build()


def _save(path: str, batch: PackedBatch, hidden: np.ndarray, rows: np.ndarray, logits: np.ndarray,
          sampled: np.ndarray) -> None:
    from dspark_abi import fixtures

    tensors = {"outputs.hidden": hidden, "outputs.logit_rows": rows.astype(np.int32), "outputs.logits": logits,
               "outputs.sampled": sampled}
    if batch.token_ids is not None:
        tensors["inputs.token_ids"] = batch.token_ids
    try:
        fixtures.save(path, batch, tensors=tensors)
    except OSError as exc:
        raise RunError(f"--save {path}: cannot write ({exc.strerror or exc}); free space or save elsewhere") from None


def _run_batch(batch: PackedBatch, weights: ModelWeights, caches: ModelCaches, args: argparse.Namespace,
               progress: LayerProgress) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(hidden, sampled, logit rows, logits) of the batch in the chosen execution mode and backend."""
    if args.mode == "group":
        with progress as on_layer:
            res = prefill(batch, batch.token_ids, weights, caches, precision=args.precision, backend=args.backend,
                          on_layer=on_layer)
        return res.hidden, res.sampled, res.logit_rows, res.logits
    from dspark_kernels import tp

    if args.mode == "threads":
        with progress as on_layer:
            results = tp.run_tp_inprocess(batch, batch.token_ids, weights, caches, precision=args.precision,
                                          backend=args.backend, on_layer=on_layer)
    else:  # rank 0's process reports its layers (the progress object travels unopened)
        job = tp.DistributedJob(batch=batch, inputs=batch.token_ids, weights=weights, caches=caches,
                                precision=args.precision, backend=args.backend, on_layer=progress)
        results = tp.launch(job, backend=args.dist_backend, device="cuda" if args.dist_backend == "nccl" else "cpu")
    out = results[0].result
    return out.hidden, out.sampled, out.logit_rows, out.logits


# ---------------------------------------------------------------------------------------------- parser
class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) pointing at --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (numpy seeds are non-negative), got {value}; "
                                         "pass e.g. --seed 0")
    return value


def _tp_size(text: str) -> int:
    bounds = {type(m).__name__: m for m in PaddingPolicy.model_fields["tp_size"].metadata}
    lo, hi = bounds["Ge"].ge, bounds["Le"].le
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"TP group size must be an integer in {lo}..{hi}, got {text!r}")
    return value


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dspark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prefill", help="build a packed batch, fill cached contexts and run the forward")
    p.add_argument("--config", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    p.add_argument("--request", action="append", type=parse_request, required=True, metavar="TOKENS@CACHED",
                   help="one request: new tokens @ cached tokens (repeatable)")
    p.add_argument("--tp", type=_tp_size, default=1, help="TP group size (default 1)")
    p.add_argument("--mode", choices=["group", "threads", "distributed"], default="group",
                   help="group: whole group in one call; threads: one thread per rank view; "
                        "distributed: one process per rank on torch.distributed")
    p.add_argument("--dist-backend", choices=["gloo", "nccl"], default=None,
                   help="torch.distributed backend for --mode distributed: gloo (CPU, default) or nccl (one CUDA "
                        "GPU per rank)")
    p.add_argument("--backend", choices=["reference", "pypto"], default="reference",
                   help="attention backend: reference (numpy) or pypto (needs --precision a2a3 and the pypto extra)")
    p.add_argument("--precision", choices=["fp32", "a2a3"], default="fp32")
    p.add_argument("--weights", metavar="DIR", help="safetensors checkpoint folder (default: random weights)")
    p.add_argument("--seed", type=_seed, default=0, help="seed (>= 0) of random weights and prompts")
    p.add_argument("--save", metavar="FILE", help="write a fixture with the batch, inputs and outputs")
    p.add_argument("--json", action="store_true", help="machine-readable summary (the only output on stdout)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="force the progress bar (default: a bar on a terminal, else a line per layer of calls "
                            f"that run over {PROGRESS_DELAY_S:g} s)")
    shown.add_argument("--no-progress", dest="progress", action="store_false", help="no progress output")
    p.set_defaults(func=run, progress=None)
    return parser


# ---------------------------------------------------------------------------------------------- errors
def _fail(message: str, code: int) -> int:
    text = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
    print(f"{PROG}: error: {text}", file=sys.stderr, flush=True)
    return code


def _abi_line(exc: ABIError, args: argparse.Namespace) -> str:
    """One line for an ABIError: the first issue (message, expected, actual), then how many more."""
    if not exc.issues:
        return str(exc)
    first = exc.issues[0]
    text = str(first)
    if first.code == "builder.request":  # its registered hint is generic: name the --request to change
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
    try:
        return int(args.func(args))
    except UsageError as exc:
        return _fail(str(exc), 2)
    except RunError as exc:
        return _fail(str(exc), 1)
    except ABIError as exc:
        return _fail(_abi_line(exc, args), 1)
    except MemoryError:
        return _fail("ran out of memory; use --config tiny or fewer and shorter --request values", 1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except PyptoUnavailableError as exc:  # found by the pypto kernel process: a tool or version it needs
        return _fail(f"--backend pypto: {exc}", 2)
    except Exception as exc:  # a failed run (pypto kernel process, rank process) or a bug: one line + a log file
        return _fail(_logged(exc, f"the {args.backend} prefill failed"), 1)


if __name__ == "__main__":
    sys.exit(main())
