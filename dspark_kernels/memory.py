"""How much memory a prefill needs, estimated from the config before anything is allocated, and how much is free.

:func:`estimate_prefill` adds three parts:

* weights: every tensor :func:`~dspark_kernels.model.weight_specs.weight_specs` lists, as :class:`ModelWeights` holds
  it (float32; ``tid2eid`` int64), including all routed experts of every layer; plus the transient of building
  one layer (its experts are read one by one, then stacked: twice that layer's experts at once) and, in
  ``a2a3`` precision, the attention weights' prepared copies. Streaming weights (``resident_layers=1``: a
  checkpoint, or random weights too large to keep, read one layer at a time) count the largest layer without its
  routed experts, one routed expert (the MoE reads one at a time), the head, and no embedding table (only the
  batch's rows are read).
* caches: every pool of every layer at the allocator's block counts (:class:`ModelCaches` layout).
* activations: per padded row, the forward's live [rows, ...] intermediates (residual streams, query heads,
  indexer heads, expert hidden rows); measured on TINY the forward peaks at 24-28 KiB per row where this
  counts 31 KiB (tracemalloc, 512-4096 rows).

:func:`estimate_drafter` does the same for the DSpark drafter beside a target (:mod:`dspark_kernels.drafter`): its
stages' weights (kept or streamed like the target's layers; the embedding and LM head are the target's and counted
there), its own tensors (``main_proj``, Markov and confidence heads) and its window cache
(:func:`drafter_window_bytes`: S more layers of the target's ``ori`` pool), which plays the part of the caches.

:func:`available_bytes` reads ``MemAvailable`` from ``/proc/meminfo`` (or ``os.sysconf`` elsewhere), capped by a
cgroup memory limit when one is set.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import attrs
import numpy as np

from dspark_abi import PoolBlocks
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.config import ModelConfig
from dspark_kernels.model.caches import POOLS_BY_KIND
from dspark_kernels.model.checkpoint_format import QuantFormat
from dspark_kernels.model.weight_specs import weight_specs

#: Bytes per element as :class:`ModelWeights` holds a tensor: floats as float32, ``tid2eid`` as int64.
_ELEMENT_BYTES = {"float": 4, "int": 8}
#: Upper bound of the indexer's score tile (``reference.indexer.SCORE_TILE_ELEMENTS`` float32 values).
_TILE_BYTES = 4 * (1 << 22)
#: One pypto kernel process (python + torch + pypto and its interpreter) besides the layer it is sent; measured:
#: 0.8 GB peak RSS on TINY layers.
KERNEL_PROCESS_BYTES = 1 << 30


@attrs.frozen
class MemoryEstimate:
    """Bytes a run needs: ``weights`` (resident + transient), ``caches`` and ``activations``."""

    weights: int
    caches: int
    activations: int
    routed_experts: int = 0
    """Part of ``weights`` that is routed experts (the bulk of a real model)."""

    @property
    def total(self) -> int:
        return self.weights + self.caches + self.activations

    def describe(self) -> str:
        """'21.3 GiB (weights 20.9 GiB of which routed experts 12.1 GiB, caches 12.0 MiB, activations ...)'."""
        experts = f" of which routed experts {format_bytes(self.routed_experts)}" if self.routed_experts else ""
        return (f"{format_bytes(self.total)} (weights {format_bytes(self.weights)}{experts}, "
                f"caches {format_bytes(self.caches)}, activations {format_bytes(self.activations)})")


def format_bytes(n: float) -> str:
    """Human-readable binary size: '512 B', '3.4 MiB', '21.3 GiB'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _layer_of(name: str) -> int | None:
    return int(name.split(".", 2)[1]) if name.startswith("layers.") else None


def weight_bytes_by_layer(config: ModelConfig) -> tuple[int, list[int], list[int], list[int]]:
    """(non-layer bytes, bytes per layer, routed-expert bytes per layer, attention bytes per layer)."""
    other, layers = 0, [0] * config.num_layers
    experts, attn = [0] * config.num_layers, [0] * config.num_layers
    for name, spec in weight_specs(config).items():
        size = int(np.prod(spec.shape)) * _ELEMENT_BYTES[spec.family]
        i = _layer_of(name)
        if i is None:
            other += size
            continue
        layers[i] += size
        if ".ffn.experts." in name:
            experts[i] += size
        elif ".attn." in name:
            attn[i] += size
    return other, layers, experts, attn


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of every weight array of ``config`` as :class:`ModelWeights` holds them once all layers are read."""
    other, layers, _, _ = weight_bytes_by_layer(config)
    return other + sum(layers)


def cache_bytes(config: ModelConfig, pool_blocks: Mapping[str, int] | PoolBlocks, precision: str = "fp32") -> int:
    """Bytes of :meth:`ModelCaches.allocate(config, pool_blocks, precision) <ModelCaches.allocate>`."""
    blocks = pool_blocks.as_dict() if isinstance(pool_blocks, PoolBlocks) else dict(pool_blocks)
    pools, total = config.layout.pools, 0
    for i in range(config.num_layers):
        for name in POOLS_BY_KIND[config.layer_kind(i)]:
            rows = int(blocks[name]) * pools[name].page_size
            item = 1 if name == "idx" and precision == "a2a3" else 4
            total += rows * int(np.prod(pools[name].row_shape)) * item
            if name == "idx":
                total += rows * 4  # idx_scale
    return total


def activation_bytes(config: ModelConfig, rows: int, logit_rows: int = 0) -> int:
    """Bytes of the forward's intermediates for ``rows`` padded rows and ``logit_rows`` sampled rows."""
    c, m = config, config.moe
    per_row = (4 * c.hc_mult * c.hidden_size + 3 * c.num_attention_heads * c.head_dim
               + 2 * c.index_n_heads * c.index_head_dim + 3 * m.num_experts_per_tok * m.moe_intermediate_size
               + 2 * c.hidden_size)
    return 4 * (rows * per_row + logit_rows * c.vocab_size) + _TILE_BYTES


def estimate_prefill(config: ModelConfig, pool_blocks: Mapping[str, int] | PoolBlocks, *, rows: int,
                     logit_rows: int = 0, precision: str = "fp32", resident_layers: int | None = None,
                     weight_copies: int = 1, cache_copies: int = 1, activation_copies: int = 1,
                     kernel_processes: int = 0) -> MemoryEstimate:
    """Memory of prefills of up to ``rows`` padded rows over ``config`` with caches of ``pool_blocks``.

    resident_layers: None keeps every layer once read (random weights), 1 streams a checkpoint layer by layer.
    *_copies: how many of each the run holds at once (TP ranks as threads hold one cache replica each; rank
    processes each hold their own weights and caches). kernel_processes: pypto kernel processes running at once
    (each: :data:`KERNEL_PROCESS_BYTES` plus a copy of the layer's weights and caches), counted as activations.
    """
    other, layers, experts, attn = weight_bytes_by_layer(config)
    if resident_layers is None:
        resident, routed = sum(layers), sum(experts)
        transient = max(experts, default=0)  # one layer's experts, read one by one, then stacked
    else:  # streaming: the layers being run without their experts, one expert at a time, the embedding's rows
        d = config.hidden_size
        one_expert = 3 * config.moe.moe_intermediate_size * d * _ELEMENT_BYTES["float"]
        without_experts = sorted((n - e for n, e in zip(layers, experts, strict=True)), reverse=True)
        resident = sum(without_experts[:resident_layers])
        routed = resident_layers * one_expert if config.moe.n_routed_experts else 0
        resident += routed
        other -= config.vocab_size * d * _ELEMENT_BYTES["float"]  # embed_rows reads [rows, D], not the table
        transient = max(attn, default=0)  # a layer's attention arrays are copied once while they are checked
    if precision != "a2a3":  # fp32 computes with the checkpoint arrays; a2a3 keeps narrowed / int8 copies
        prepared = 0
    else:
        prepared = sum(attn) if resident_layers is None else sum(sorted(attn, reverse=True)[:resident_layers])
    weights = weight_copies * (other + resident + prepared) + transient
    caches = cache_bytes(config, pool_blocks, precision)
    layer_bytes = max(layers, default=0) if resident_layers is None else resident // resident_layers
    per_kernel = KERNEL_PROCESS_BYTES + layer_bytes + caches // max(config.num_layers, 1)
    return MemoryEstimate(weights=weights, caches=cache_copies * caches,
                          activations=activation_copies * activation_bytes(config, rows, logit_rows)
                          + kernel_processes * per_kernel,
                          routed_experts=weight_copies * routed)


def available_bytes() -> int | None:
    """Memory this process can still allocate: ``MemAvailable`` (Linux) or free pages, capped by a cgroup limit;
    None when unknown."""
    avail = _meminfo_available()
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    limit = _cgroup_headroom()
    if limit is not None:
        avail = limit if avail is None else min(avail, limit)
    return avail


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``getrusage``; file pages it mapped and touched count)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB on Linux


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    """Limit minus usage of this process's cgroup (v2, then v1), or None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            text = Path(limit_file).read_text().strip()
            if text == "max":
                return None
            limit, usage = int(text), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # cgroup v1's "no limit"
            return None
        return max(limit - usage, 0)
    return None


def drafter_window_bytes(config: ModelConfig, pool_blocks: Mapping[str, int] | PoolBlocks) -> int:
    """Bytes of the drafter's window cache (:class:`~dspark_kernels.model.drafter_cache.DrafterWindow`, spec 5.10):
    ``n_mtp_layers`` more layers of the ``ori`` pool, one float32 row of ``head_dim`` per ``ori`` row
    (``pool_blocks.ori * 32`` rows), whatever the number of requests."""
    blocks = pool_blocks.ori if isinstance(pool_blocks, PoolBlocks) else pool_blocks["ori"]
    rows = int(blocks) * config.layout.pools["ori"].page_size
    return config.n_mtp_layers * rows * config.head_dim * 4


def drafter_ring_bytes(config: ModelConfig, requests: int) -> int:
    """Deprecated (the drafter's per-request rings became the ori-backed window cache, 1.4): what the per-request
    rings took, ``requests * (n_mtp_layers * sliding_window * head_dim * 4 + 8)``; use
    :func:`drafter_window_bytes`."""
    warnings.warn("drafter_ring_bytes is deprecated: the drafter's window lives in the ori pool; use "
                  "drafter_window_bytes(config, pool_blocks)", DeprecationWarning, stacklevel=2)
    return requests * (config.n_mtp_layers * config.sliding_window * config.head_dim * 4 + 8)


def estimate_drafter(config: ModelConfig, *, requests: int, streaming: bool,
                     pool_blocks: Mapping[str, int] | PoolBlocks | None = None) -> MemoryEstimate:
    """Memory of the DSpark drafter of a DSpark ``config`` drafting for ``requests`` requests at once (blocks of
    ``dspark_block_size`` rows), beside the target (whose embedding and LM head it shares: not counted here).

    streaming: stages read when they run, one routed expert at a time (a checkpoint), else every stage kept.
    pool_blocks: the target's pools, whose ``ori`` pool the window cache extends (:func:`drafter_window_bytes`);
    default the pools that hold ``requests`` requests of a full ``ori`` ring each
    (:func:`~dspark_abi.allocator.pool_blocks_for` at ``sliding_window`` positions).
    Raises :class:`~dspark_abi.ABIError` (``drafter.config``) for a config without a drafter.
    """
    from dspark_kernels.model.drafter_weights import extra_formats, stage_config  # the drafter's own home

    stages = stage_config(config)
    _, layers, experts, _ = weight_bytes_by_layer(stages)
    own = sum(int(np.prod(f.shape)) * 4 for f in extra_formats(config, QuantFormat.float_checkpoint()))
    head = (config.hc_mult * config.hc_mult * config.hidden_size + config.hc_mult + 1 + config.hidden_size) * 4
    if streaming:
        one_expert = 3 * config.moe.moe_intermediate_size * config.hidden_size * 4
        resident = max(n - e for n, e in zip(layers, experts, strict=True)) + one_expert
        routed = one_expert
    else:
        resident, routed = sum(layers), sum(experts)
    rows = requests * config.dspark_block_size
    if pool_blocks is None:
        pool_blocks = pool_blocks_for(config, [config.sliding_window] * requests, slack=0)
    return MemoryEstimate(weights=own + head + resident, caches=drafter_window_bytes(config, pool_blocks),
                          activations=activation_bytes(stages, rows, rows), routed_experts=routed)
