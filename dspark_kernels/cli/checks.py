"""The checks and loaders ``dspark prefill`` runs before anything is computed or written: installed extras,
the requests, the config (``--config`` or the checkpoint's config.json), the weights and the memory the run needs.

Each failure is one line: :class:`~dspark_abi.cli.common.UsageError` (exit 2: a flag, a missing extra, an
unreadable file) or :class:`RunError` (exit 1: input the run cannot accept).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_abi import ModelConfig, PackedBatch, PaddingPolicy
from dspark_abi.cli.common import UsageError
from dspark_abi.errors import ABIError
from dspark_abi.presets import get_preset
from dspark_kernels import memory
from dspark_kernels.model.weight_specs import WeightsError
from dspark_kernels.model.weights import ModelWeights

#: Share of the available memory a run may be estimated to use (the rest: the interpreter, other processes).
MEMORY_HEADROOM = 0.9
#: Random weights are kept in memory (every layer built once) when the whole model takes at most this share of
#: the available memory; larger models (FLASH) are streamed layer by layer and expert by expert, like a checkpoint.
KEEP_RANDOM_SHARE = 0.5


class RunError(Exception):
    """Input the run cannot accept, or a run that failed: exit code 1."""


def check_extras(args: argparse.Namespace) -> None:
    """The optional packages the chosen backend and mode need, and a precision the backend computes."""
    if args.backend == "pypto":
        missing = [m for m in ("pypto", "torch") if not _installed(m)]
        if missing:
            raise UsageError(f"--backend pypto needs {' and '.join(missing)}, which this Python does not have: "
                             "pip install 'dspark[pypto]'")
        if args.precision != "a2a3":
            raise UsageError(f"--backend pypto computes the a2a3 kernels' numerics, not {args.precision}: "
                             "pass --precision a2a3")
    args.dist_backend = check_distributed(args.mode, args.dist_backend, args.tp)


def check_distributed(mode: str, dist_backend: str | None, tp: int) -> str | None:
    """The torch.distributed backend a ``--mode distributed`` run uses (gloo unless named), after checking that
    this Python and machine have it; None for the other modes, which take no ``--dist-backend``."""
    if mode != "distributed":
        if dist_backend is not None:
            raise UsageError(f"--dist-backend {dist_backend} applies to --mode distributed only; add "
                             "--mode distributed or drop --dist-backend")
        return None
    dist_backend = dist_backend or "gloo"
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise UsageError("--mode distributed needs torch, which this Python does not have: "
                         "pip install 'dspark[dist]' (or use --mode threads)") from None
    if not dist.is_available():
        raise UsageError("--mode distributed: this torch build has no torch.distributed: "
                         "pip install 'dspark[dist]' (or use --mode threads)")
    if dist_backend == "gloo" and not dist.is_gloo_available():
        raise UsageError("--dist-backend gloo: this torch build has no gloo: pip install 'dspark[dist]'")
    if dist_backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not dist.is_nccl_available() or gpus < tp:
            have = "no NCCL" if not dist.is_nccl_available() else f"{gpus} CUDA GPU(s)"
            raise UsageError(f"--dist-backend nccl needs a torch build with NCCL and {tp} CUDA GPUs (one per "
                             f"rank); this machine has {have}: use --dist-backend gloo")
    return dist_backend


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_requests(config: ModelConfig, requests: Sequence[tuple[int, int]], policy: PaddingPolicy) -> None:
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


#: --config when it is not given.
DEFAULT_PRESET = "tiny"


def load_config(args: argparse.Namespace) -> ModelConfig:
    """--config (default tiny), or the config.json of --weights DIR (then a --config given is ignored: a note on
    stderr says so)."""
    if args.weights is None:
        return get_preset(args.config or DEFAULT_PRESET)
    folder = Path(args.weights)
    if not folder.exists():
        raise UsageError(f"--weights {folder}: does not exist; pass the folder that holds the checkpoint's "
                         "*.safetensors files (and its config.json)")
    if not folder.is_dir():
        raise UsageError(f"--weights {folder}: is not a directory; pass the folder that holds it: "
                         f"--weights {folder.parent}")
    hf = folder / "config.json"
    if not hf.exists():
        return get_preset(args.config or DEFAULT_PRESET)
    if args.config is not None:
        print(f"dspark prefill: note: --config {args.config} is ignored: the model is the one {hf} describes",
              file=sys.stderr)
    fix = ("use the config.json that came with the checkpoint, or delete it to use --config "
           f"{args.config or DEFAULT_PRESET}")
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


def load_weights(args: argparse.Namespace, config: ModelConfig) -> ModelWeights:
    """--weights DIR (streamed: memory-mapped, a layer and its used experts at a time), else random weights,
    kept in memory when the whole model fits and streamed the same way when it does not (``--config flash``)."""
    if args.weights is None:
        have = memory.available_bytes()
        keep = have is None or memory.weight_bytes(config) <= KEEP_RANDOM_SHARE * have
        return ModelWeights.random(config, seed=args.seed, keep_layers=keep)
    folder = Path(args.weights)
    if not any(folder.glob("*.safetensors")):
        raise UsageError(f"--weights {folder}: holds no *.safetensors files; pass the checkpoint's folder")
    try:
        return ModelWeights.from_safetensors(folder, config)
    except WeightsError as exc:
        if exc.unreadable:
            raise UsageError(f"--weights {folder}: {exc.summary()}; re-download or re-convert that file") from None
        has_config = (folder / "config.json").exists()
        fix = ("point --weights at a DeepSeek-V4 checkpoint for this config.json" if has_config else
               f"point --weights at a DeepSeek-V4 checkpoint of --config {config.name}, or pass the --config it "
               "was made for (or put its config.json beside it)")
        raise RunError(f"--weights {folder}: {exc.summary()}; {fix}") from None


def check_memory(config: ModelConfig, args: argparse.Namespace, batches: Sequence[PackedBatch],
                  pool_blocks: Any, weights: ModelWeights) -> None:
    """Refuse a run whose estimated memory exceeds what this machine has available."""
    tp = args.tp
    copies = {"group": (1, 1, 1), "threads": (1, tp, tp), "distributed": (1 + tp, 1 + 2 * tp, tp)}[args.mode]
    need = memory.estimate_prefill(
        config, pool_blocks, rows=max(b.padded_rows for b in batches), logit_rows=len(args.request),
        precision=args.precision, resident_layers=None if weights.keep_layers else 1,
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
