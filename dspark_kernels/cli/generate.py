"""`dspark generate`: speculative generation end to end with the DSpark drafter.

    dspark generate --prompts 3 --prompt-len 16 --max-new-tokens 16 --drafter dspark --adaptive 0

prefills the prompts (token ids from --prompt / --prompt-file, or seeded random prompts), then loops draft ->
verify -> accept -> commit -> drafter advance, packed (prompts still in prefill share the verify dispatches), and
prints the acceptance summary: per-position acceptance, mean accepted length, verify rows per generated token and
wall time per step. The model is the embedded TINY-DSpark preset with random target and drafter weights unless
--checkpoint DIR names a DeepSeek-V4-Flash-DSpark checkpoint (its config.json, target and mtp.* drafter tensors).

Before the first step every start-up check runs (speculative.check_deployment): each failure is one coded line
on stderr (exit 1); flag mistakes are one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dspark_abi import ModelConfig
from dspark_abi.cli.common import UsageError, int_in, printable
from dspark_abi.presets import get_preset
from dspark_kernels import memory
from dspark_kernels.cli.checks import MEMORY_HEADROOM, RunError, check_distributed
from dspark_kernels.model.weight_specs import WeightsError
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.speculative import (
    FEATURE_REDUCTIONS,
    TP_MODES,
    ConditionedDrafter,
    Drafter,
    GenerateResult,
    RandomDrafter,
    ReplayDrafter,
    StepRecord,
    check_deployment,
    checkpoint_drafter_issues,
    generate,
    greedy_decode,
)

PROG = "dspark generate"
DRAFTERS = ("dspark", "replay", "random")
#: The preset of the embedded default model (random target and drafter weights).
DEFAULT_PRESET = "tiny-dspark"
#: Random prompts when no prompt is given.
DEFAULT_PROMPTS, DEFAULT_PROMPT_LEN = 3, 16


class StartupError(RunError):
    """The start-up checks failed: every issue, one coded line each (exit 1)."""

    def __init__(self, issues: list[Any]):
        super().__init__("; ".join(str(i) for i in issues))
        self.issues = issues


def _at_least(lo: int) -> Callable[[str], int]:
    return lambda text: int_in(text, lo, 2**31 - 1, "the value")


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number (a raw confidence logit, e.g. 0), got {text!r}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="speculative generation with the DSpark drafter; prints the acceptance",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("prompts (token ids, or random ones for a demo)")
    src.add_argument("--prompt", action="append", metavar="IDS",
                     help="one prompt's token ids, comma or space separated (repeat for more requests)")
    src.add_argument("--prompt-file", metavar="FILE",
                     help="prompts' token ids: a JSON list of lists, or one prompt per line (ids separated by commas "
                          "or spaces)")
    src.add_argument("--prompts", type=_at_least(1), default=None, metavar="N",
                     help=f"N random prompts (default {DEFAULT_PROMPTS} when no prompt is given)")
    src.add_argument("--prompt-len", type=_at_least(1), default=None, metavar="L",
                     help=f"tokens of each random prompt (default {DEFAULT_PROMPT_LEN})")
    p.add_argument("--max-new-tokens", type=_at_least(1), default=16, help="tokens to generate per request "
                   "(default 16)")
    p.add_argument("--drafter", choices=DRAFTERS, default="dspark",
                   help="dspark (default: the checkpoint's drafter), replay (the target's own greedy continuation, "
                        "computed first: every draft right) or random (seeded random drafts)")
    width = p.add_argument_group("verify width")
    width.add_argument("--drafts", type=_at_least(0), default=None, metavar="K",
                       help="drafts per verify request, at most the checkpoint's dspark_block_size (default: it); "
                            "with --adaptive the most drafts")
    width.add_argument("--adaptive", type=_threshold, default=None, metavar="THRESHOLD",
                       help="adaptive width: verify drafts while the drafter's raw confidence logit is >= THRESHOLD "
                            "(0 = probability 0.5), at least --min-drafts (dspark drafter only)")
    width.add_argument("--min-drafts", type=_at_least(0), default=1, help="fewest drafts of an adaptive width "
                       "(default 1)")
    p.add_argument("--features", choices=FEATURE_REDUCTIONS, default="mean",
                   help="target feature reduction fed to the drafter: mean (DeepSeek's, default) or hc_head "
                        "(upstream pypto-lib's; refused unless --allow-hc-head)")
    p.add_argument("--allow-hc-head", action="store_true", help="feed the hc_head reduction knowingly")
    p.add_argument("--checkpoint", metavar="DIR", help="DeepSeek-V4-Flash-DSpark checkpoint folder (config.json, "
                   f"target and mtp.* tensors); default: the embedded {DEFAULT_PRESET} random weights")
    p.add_argument("--config", default=None, metavar="PRESET",
                   help=f"preset of the random weights (default {DEFAULT_PRESET}); not with --checkpoint")
    p.add_argument("--chunk", type=_at_least(1), default=16, help="prefill chunk tokens per step (default 16)")
    p.add_argument("--tp", type=_at_least(1), default=1, help="TP group size (default 1)")
    p.add_argument("--tp-mode", choices=TP_MODES, default="single",
                   help="single: the group in one call; threads: one thread per rank; distributed: one process per "
                        "rank on torch.distributed (the drafter runs on this process)")
    p.add_argument("--seed", type=_at_least(0), default=0, help="seed of random weights, prompts and drafts")
    p.add_argument("--json", action="store_true", help="machine-readable summary (the only output on stdout)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="force the progress bar (default: on a terminal)")
    shown.add_argument("--no-progress", dest="progress", action="store_false", help="no progress output")
    p.set_defaults(func=run, prog_name=PROG)


# ---------------------------------------------------------------------------------------------- inputs
def _ids(text: str, where: str) -> np.ndarray:
    parts = text.replace(",", " ").split()
    try:
        ids = np.array([int(t) for t in parts], np.int64)
    except ValueError:
        raise UsageError(f"{where}: token ids are integers separated by commas or spaces, got "
                         f"{printable(text[:40])!r}") from None
    if ids.size == 0:
        raise UsageError(f"{where}: an empty prompt; give at least one token id")
    return ids


def _prompt_file(path: str) -> list[np.ndarray]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompt-file {printable(path)}: cannot be read "
                         f"({getattr(exc, 'strerror', None) or exc}); pass a readable text or JSON file") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--prompt-file {printable(path)}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                             "write a list of lists of token ids") from None
        if not isinstance(data, list) or not all(isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p) for p in data) or not data:
            raise UsageError(f"--prompt-file {printable(path)}: must hold a non-empty JSON list of non-empty lists "
                             "of integer token ids")
        return [np.array(p, np.int64) for p in data]
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"--prompt-file {printable(path)}: holds no prompt; write one prompt's ids per line")
    return [_ids(line, f"--prompt-file {printable(path)} line {k + 1}") for k, line in enumerate(lines)]


def _model(args: argparse.Namespace) -> tuple[ModelConfig, ModelWeights]:
    if args.checkpoint is None:
        try:
            config = get_preset(args.config or DEFAULT_PRESET)
        except KeyError as exc:
            raise UsageError(f"--config {printable(args.config)}: {exc.args[0]}") from None
        if not config.dspark_block_size:
            raise UsageError(f"--config {config.name}: not a DSpark model (no drafter); use --config tiny-dspark "
                             "or flash-dspark")
        _check_memory(config, args)
        return config, ModelWeights.random(config, seed=args.seed)
    if args.config is not None:
        raise UsageError("--config applies to random weights only: --checkpoint DIR brings its own config.json; "
                         "drop one of them")
    from dspark_kernels.cli.checks import load_config, load_weights

    shim = argparse.Namespace(weights=args.checkpoint, config=None, seed=args.seed)
    config = load_config(shim)
    return config, load_weights(shim, config)


def _check_memory(config: ModelConfig, args: argparse.Namespace) -> None:
    """Refuse a random-weight run whose target weights alone exceed the memory available (flash-dspark)."""
    have = memory.available_bytes()
    need = memory.weight_bytes(config)
    if have is not None and need > MEMORY_HEADROOM * have:
        raise RunError(f"--config {config.name}: its random weights take about {memory.format_bytes(need)}, more "
                       f"than {MEMORY_HEADROOM:.0%} of the {memory.format_bytes(have)} available; use --config "
                       f"{DEFAULT_PRESET} or --checkpoint DIR (streamed)")


def _drafter(args: argparse.Namespace, config: ModelConfig, weights: ModelWeights,
             prompts: list[np.ndarray]) -> Drafter | ConditionedDrafter:
    if args.drafter == "random":
        return RandomDrafter(config.vocab_size, seed=args.seed)
    if args.drafter == "replay":
        plain = greedy_decode(prompts, weights, args.max_new_tokens, tp=args.tp,
                              tp_mode="threads" if args.tp_mode == "distributed" else args.tp_mode)
        return ReplayDrafter({i: np.concatenate([p, plain.tokens[i]]) for i, p in enumerate(prompts)})
    from dspark_kernels.drafter import DSparkDrafter

    # the drafter runs in this process: its ranks as threads beside a threads group, else computed as one
    mode: Literal["single", "threads"] = "threads" if args.tp_mode == "threads" else "single"
    if args.checkpoint is None:
        return DSparkDrafter.random(config, weights, seed=args.seed, tp=args.tp, tp_mode=mode)
    missing = checkpoint_drafter_issues(args.checkpoint)
    if missing:
        issue = missing[0]
        raise RunError(f"--checkpoint {printable(args.checkpoint)}: {issue.message}; {issue.fix}")
    try:
        return DSparkDrafter.from_checkpoint(args.checkpoint, config, weights, tp=args.tp, tp_mode=mode)
    except WeightsError as exc:
        raise RunError(f"--checkpoint {printable(args.checkpoint)}: the drafter's tensors: {exc.summary()}; "
                       "use the checkpoint as published, or --drafter replay|random") from None


# ---------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    check_distributed("distributed" if args.tp_mode == "distributed" else "group", None, args.tp)
    given = args.prompt is not None or args.prompt_file is not None
    if given and (args.prompts is not None or args.prompt_len is not None):
        raise UsageError("--prompts/--prompt-len make random prompts: drop them, or drop --prompt/--prompt-file")
    if args.adaptive is not None and args.drafter != "dspark":
        raise UsageError(f"--adaptive needs the dspark drafter's confidence head, not --drafter {args.drafter}; "
                         "use --drafts K")
    config, weights = _model(args)
    k = config.dspark_block_size if args.drafts is None else args.drafts
    if given:
        prompts = [*(_ids(t, f"--prompt {printable(t[:20])}") for t in args.prompt or []),
                   *(_prompt_file(args.prompt_file) if args.prompt_file else [])]
    else:
        rng = np.random.default_rng(args.seed + 1)
        prompts = [rng.integers(0, config.vocab_size, args.prompt_len or DEFAULT_PROMPT_LEN)
                   for _ in range(args.prompts or DEFAULT_PROMPTS)]
    drafter = _drafter(args, config, weights, prompts)
    issues = check_deployment(config, weights, drafter, k, adaptive=args.adaptive, min_drafts=args.min_drafts,
                              features=args.features, allow_hc_head=args.allow_hc_head)
    if issues:
        raise StartupError(issues)
    total = len(prompts) * args.max_new_tokens
    progress = _Progress(total, shown=not args.json and (args.progress or (args.progress is None
                                                                           and sys.stderr.isatty())))
    start = time.perf_counter()
    try:
        result = generate(prompts, weights, drafter, args.max_new_tokens, k, adaptive=args.adaptive,
                          min_drafts=args.min_drafts, features=args.features, allow_hc_head=args.allow_hc_head,
                          tp=args.tp, tp_mode=args.tp_mode, prefill_chunk=args.chunk,
                          slack=8 + -(-len(prompts) * (k + 1) // 64), on_step=progress.step)
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    summary = _summary(args, config, k, prompts, result, seconds)
    if args.json:
        print(json.dumps(summary))
        return 0
    _print(summary)
    return 0


class _Progress:
    """Generated tokens out of all on stderr (a tqdm bar), on a terminal or with --progress."""

    def __init__(self, total: int, shown: bool):
        self.bar: Any = None
        self.done = 0
        if shown:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="generate", unit="tok", file=sys.stderr, leave=False)

    def step(self, record: StepRecord, caches: object) -> None:
        if self.bar is not None:
            made = sum(v.accepted for v in record.verify) + sum(
                int(record.batch.requests.logit_row[k] >= 0) for k, r in enumerate(record.batch.requests.ids)
                if int(r) in record.prefill_ids)
            self.bar.update(made)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _summary(args: argparse.Namespace, config: ModelConfig, k: int, prompts: list[np.ndarray],
             result: GenerateResult, seconds: float) -> dict[str, Any]:
    return {"config": config.name, "checkpoint": args.checkpoint, "drafter": args.drafter, "drafts": k,
            "adaptive": args.adaptive, "min_drafts": args.min_drafts if args.adaptive is not None else None,
            "features": args.features, "tp": args.tp, "tp_mode": args.tp_mode,
            "requests": [{"request": i, "prompt": int(p.size), "tokens": result.tokens[i].tolist(),
                          "accepted_lengths": result.accepted_lengths[i]} for i, p in enumerate(prompts)],
            **result.summary(), "wall_seconds": seconds}


def _print(s: dict[str, Any]) -> None:
    width = f"adaptive >= {s['adaptive']:g}, {s['min_drafts']}..{s['drafts']} drafts" if s["adaptive"] is not None \
        else f"K = {s['drafts']}"
    print(f"{s['config']}: {len(s['requests'])} request(s), drafter {s['drafter']}, {width}, TP {s['tp']} "
          f"({s['tp_mode']}); {s['steps']} steps ({s['mixed_steps']} mixed prefill + verify) in "
          f"{s['wall_seconds']:.2f} s")
    for r in s["requests"]:
        print(f"  request {r['request']}: prompt {r['prompt']}, {len(r['tokens'])} tokens, accepted lengths "
              f"{r['accepted_lengths']}")
    by_position = "  ".join(f"{i + 1}: {a:.3f}" for i, a in enumerate(s["acceptance_by_position"])) or "-"
    print(f"acceptance by draft position: {by_position}")

    def fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
        return "-" if x is None else format(x * scale, spec)

    print(f"mean accepted length {fmt(s['mean_accepted_length'], '.3f')}; verify rows per generated token "
          f"{fmt(s['verify_rows_per_token'], '.3f')}; {fmt(s['seconds_per_step'], '.1f', 1e3)} ms per step "
          f"(max {fmt(s['max_step_seconds'], '.1f', 1e3)} ms)")


def issue_lines(exc: StartupError) -> list[str]:
    """One coded line per start-up failure."""
    return [" ".join(str(i).split()) for i in exc.issues]


__all__ = ["StartupError", "add_parser", "issue_lines", "run"]
