"""`dspark speculate`: the greedy speculative loop end to end (random weights of a preset).

    dspark speculate --config tiny-dspark --prompt 5 --prompt 23 --max-new-tokens 12 --drafter random

prefills the prompts (seeded random tokens), then runs build -> forward -> accept -> commit steps with a test
drafter (``replay``: the target's own greedy continuation, computed first by plain decoding, so every draft is
right; ``random``: seeded random drafts; ``hits``: right on exactly ``--hits`` drafts of each block), packing
prompts still in prefill into the same dispatches, and prints every request's accepted lengths (tokens per
verify step) and the mean accepted length.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dspark_abi.allocator import pool_blocks_for
from dspark_abi.cli.common import UsageError, int_in
from dspark_abi.presets import PRESETS, get_preset
from dspark_kernels import memory
from dspark_kernels.cli.checks import MEMORY_HEADROOM, RunError, check_distributed
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.speculative import (
    Drafter,
    FixedHitsDrafter,
    RandomDrafter,
    ReplayDrafter,
    TpMode,
    generate,
    greedy_decode,
)

PROG = "dspark speculate"
DRAFTERS = ("replay", "random", "hits")
#: --mode names (as ``dspark prefill``) -> the loop's TP modes
MODES: dict[str, TpMode] = {"group": "single", "threads": "threads", "distributed": "distributed"}


def _at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, 2**31 - 1]``."""
    return lambda text: int_in(text, lo, 2**31 - 1, "the value")


_positive, _count = _at_least(1), _at_least(0)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("speculate", help="greedy speculative decoding with a test drafter; prints accepted lengths",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny-dspark", choices=list(PRESETS), metavar="PRESET",
                   help=f"model preset (default tiny-dspark): {', '.join(PRESETS)}")
    p.add_argument("--prompt", action="append", type=_positive, metavar="TOKENS",
                   help="a request's prompt length (repeat for more requests; default 5, 23 and 40)")
    p.add_argument("--max-new-tokens", type=_positive, default=12, help="tokens to generate per request (default 12)")
    p.add_argument("--drafter", choices=DRAFTERS, default="random", help="replay, random (default) or hits")
    p.add_argument("--hits", type=_count, default=1, help="drafts the hits drafter gets right per block (default 1)")
    p.add_argument("--drafts", type=_count, default=None, metavar="K",
                   help="drafts per verify request (default: the config's dspark_block_size)")
    p.add_argument("--chunk", type=_positive, default=8, help="prefill chunk tokens per step (default 8)")
    p.add_argument("--tp", type=_positive, default=1, help="TP group size (default 1)")
    p.add_argument("--mode", choices=list(MODES), default="group",
                   help="group: whole group in one call; threads: one thread per rank; distributed: one process "
                        "per rank on torch.distributed")
    p.add_argument("--seed", type=_count, default=0, help="seed of random weights, prompts and drafts")
    p.add_argument("--json", action="store_true", help="machine-readable summary (the only output on stdout)")
    p.set_defaults(func=run, prog_name=PROG)


def run(args: argparse.Namespace) -> int:
    check_distributed(args.mode, None, args.tp)
    config = get_preset(args.config)
    block = int(getattr(config, "dspark_block_size", 0))
    k = block if args.drafts is None else args.drafts
    if k > block:
        raise UsageError(f"--drafts {k}: the config {config.name} verifies at most {block} drafts per request "
                         f"(its dspark_block_size); pass --drafts {block} or fewer")
    if args.drafter == "hits" and args.hits > k:
        raise UsageError(f"--hits {args.hits}: more than the {k} drafts per block; pass --hits {k} or fewer")
    lengths = args.prompt or [5, 23, 40]
    if max(lengths) + args.max_new_tokens + k >= config.max_position_embeddings:
        raise UsageError(f"--prompt {max(lengths)} with --max-new-tokens {args.max_new_tokens}: beyond the "
                         f"{config.max_position_embeddings} positions of {config.name}; ask for fewer tokens")
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, config.vocab_size, n) for n in lengths]
    blocks = pool_blocks_for(config, [n + args.max_new_tokens + k + 1 for n in lengths], slack=8)
    rows = len(lengths) * max(args.chunk, k + 1)
    need = memory.estimate_prefill(config, blocks, rows=rows + args.tp, logit_rows=len(lengths) * (k + 1),
                                   cache_copies=2 if args.drafter == "replay" else 1,
                                   activation_copies=args.tp if args.mode != "group" else 1)
    have = memory.available_bytes()
    if have is not None and need.total > MEMORY_HEADROOM * have:
        raise RunError(f"--config {config.name} needs about {need.describe()}, more than {MEMORY_HEADROOM:.0%} of "
                       f"the {memory.format_bytes(have)} available; use --config tiny-dspark or shorter prompts")
    weights = ModelWeights.random(config, args.seed)
    mode = MODES[args.mode]
    drafter: Drafter
    if args.drafter == "random":
        drafter = RandomDrafter(config.vocab_size, seed=args.seed)
    else:
        plain = greedy_decode(prompts, weights, args.max_new_tokens, tp=args.tp, tp_mode=mode)
        streams = {i: np.concatenate([p, plain.tokens[i]]) for i, p in enumerate(prompts)}
        drafter = ReplayDrafter(streams) if args.drafter == "replay" else \
            FixedHitsDrafter(streams, hits=args.hits, vocab_size=config.vocab_size)
    start = time.perf_counter()
    result = generate(prompts, weights, drafter, args.max_new_tokens, k, tp=args.tp, tp_mode=mode,
                      prefill_chunk=args.chunk)
    seconds = time.perf_counter() - start
    summary = {"config": config.name, "drafter": args.drafter, "drafts": k, "tp": args.tp, "mode": args.mode,
               "steps": len(result.steps), "mixed_steps": sum(s.mixed for s in result.steps),
               "requests": [{"request": i, "prompt": int(p.size), "accepted_lengths": result.accepted_lengths[i],
                             "tokens": result.tokens[i].tolist()} for i, p in enumerate(prompts)],
               "mean_accepted_length": result.mean_accepted_length, "seconds": seconds}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{config.name}: {len(prompts)} request(s), drafter {args.drafter}, K = {k}, TP {args.tp} ({args.mode}); "
          f"{summary['steps']} steps ({summary['mixed_steps']} mixed prefill + verify) in {seconds:.2f} s")
    for r in summary["requests"]:
        print(f"  request {r['request']}: prompt {r['prompt']}, accepted lengths {r['accepted_lengths']}")
    print(f"mean accepted length {result.mean_accepted_length:.3f}")
    return 0
