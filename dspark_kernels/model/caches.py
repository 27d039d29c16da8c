"""The paged pools of the model: `LayerCaches` (one attention layer's pools) and `ModelCaches` (every layer's,
saved to / loaded from safetensors).

## LayerCaches

Pools are flat ``[blocks * page_size, row]`` arrays (physical row = block * page_size + offset), zero at
allocation, and are **mutated in place** by the attention of either backend; pass
the same object to the next chunk (or to decode). Only the pools of the layer's kind are allocated:

========================  ===========================  ===================================  ===========
pool                      shape                         dtype                                kinds
========================  ===========================  ===================================  ===========
``ori``                   [B*32, D]                     float32 (bf16 values in a2a3, [1])   all
``csa_cmp``               [B*32, D]                     float32 (bf16 values in a2a3, [1])   csa
``idx`` / ``idx_scale``   [B*32, dI] / [B*32]           int8 + float32 dequant (a2a3);       csa
                                                        float32 exact + 1.0 (fp32);
                                                        float32 e2m1 x 2**k values + 1.0
                                                        (deepseek: the official bf16 cache)
``csa_state``             [B*2, 4*D] = [kv 2D | sc 2D]  float32                              csa
``csa_inner_state``       [B*2, 4*dI]                   float32                              csa
``hca_cmp``               [B*32, D]                     float32 (bf16 values in a2a3, [1])   hca
``hca_state``             [B*8, 2*D] = [kv D | sc D]    float32                              hca
========================  ===========================  ===================================  ===========

[1] deepseek: the official bf16 KV caches' values: e4m3 x 2**k in the non-RoPE dims (the release
:data:`~dspark_kernels.model.deepseek_numerics.KV_RELEASE`), bf16 in the RoPE dims.

bf16 pools are held as float32 arrays of bf16-representable values (fast BLAS, exact widening), so the
a2a3 and deepseek contents equal what a bf16 pool would hold. A cache remembers the precision that writes it.

## ModelCaches

A prefill writes these in place; saving them lets a later process continue the same requests (the next chunk,
or decode) with the allocator's tables. One safetensors file holds tensors ``layers.{i}.{pool}`` (the arrays of
:class:`LayerCaches`, e.g. ``layers.1.idx_scale``) and a JSON header with the
format name and version, the full :class:`ModelConfig`, the precision and the pool block counts. Loading
checks all of them against the config the caller expects and reports every mismatch at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dspark_abi import ABIError, Issue, ModelConfig, PoolBlocks
from dspark_abi.config import LayerKind
from dspark_kernels.model.numerics import Precision, check_precision

if TYPE_CHECKING:
    from dspark_kernels.model.plan import StepRows

#: Pools each layer kind uses (``idx`` also owns the ``idx_scale`` array).
POOLS_BY_KIND: dict[str, tuple[str, ...]] = {
    "swa": ("ori",),
    "csa": ("ori", "csa_cmp", "idx", "csa_state", "csa_inner_state"),
    "hca": ("ori", "hca_cmp", "hca_state"),
}


@attrs.define(eq=False)
class LayerCaches:
    """Pools of one layer (see the module table); pools the layer kind does not use are ``None``."""

    config: ModelConfig
    layer: int
    precision: Precision
    pool_blocks: dict[str, int]
    """Physical blocks of each allocated pool."""
    ori: np.ndarray
    csa_cmp: np.ndarray | None = None
    hca_cmp: np.ndarray | None = None
    idx: np.ndarray | None = None
    idx_scale: np.ndarray | None = None
    csa_state: np.ndarray | None = None
    csa_inner_state: np.ndarray | None = None
    hca_state: np.ndarray | None = None

    @property
    def kind(self) -> LayerKind:
        return self.config.layer_kind(self.layer)

    @classmethod
    def allocate(cls, config: ModelConfig, layer: int, pool_blocks: Mapping[str, int] | Any,
                 precision: str = "fp32") -> LayerCaches:
        """Zero pools for layer ``layer`` of ``config``.

        pool_blocks: pool name -> physical blocks (a mapping or a ``PoolBlocks``); only the pools of the
        layer's kind are read. ``precision`` fixes the idx pool dtype and must match the attention calls.
        """
        prec = check_precision(precision)
        if not 0 <= layer < config.num_layers:
            raise ABIError([Issue("config.mismatch", "layer", f"{config.name} has {config.num_layers} layers",
                                  expected=f"0 <= layer < {config.num_layers}", actual=layer)])
        names = POOLS_BY_KIND[config.layer_kind(layer)]
        issues, blocks = [], {}
        for name in names:
            try:
                n = pool_blocks[name]
            except (KeyError, AttributeError, TypeError):
                n = None
            if not isinstance(n, int | np.integer) or n < 1:
                issues.append(Issue("pools.blocks", f"pool_blocks.{name}", "needs a positive block count",
                                    expected=">= 1", actual=None if n is None else repr(n)))
            else:
                blocks[name] = int(n)
        if issues:
            raise ABIError(issues)
        pools = config.layout.pools
        arrays: dict[str, np.ndarray] = {}
        for name in names:
            rows = blocks[name] * pools[name].page_size
            dtype = np.int8 if name == "idx" and prec == "a2a3" else np.float32
            arrays[name] = np.zeros((rows, *pools[name].row_shape), dtype=dtype)
        if "idx" in names:
            arrays["idx_scale"] = np.zeros(blocks["idx"] * pools["idx"].page_size, dtype=np.float32)
        return cls(config=config, layer=layer, precision=prec, pool_blocks=blocks, **arrays)

    def arrays(self) -> dict[str, np.ndarray]:
        """Allocated pool name -> array (the live arrays, not copies)."""
        names = ("ori", "csa_cmp", "hca_cmp", "idx", "idx_scale", "csa_state", "csa_inner_state", "hca_state")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def pool(self, name: str) -> np.ndarray:
        """The allocated array ``name`` (e.g. ``"idx"``); ValueError if the layer's kind has no such pool."""
        array: np.ndarray | None = getattr(self, name)
        if array is None:
            raise ValueError(f"a {self.kind} layer has no {name} pool")
        return array

    def copy(self) -> LayerCaches:
        """A deep copy (pools copied)."""
        out = attrs.evolve(self, pool_blocks=dict(self.pool_blocks))
        for name, array in self.arrays().items():
            setattr(out, name, array.copy())
        return out


def pool_array_issues(caches: LayerCaches, pool_blocks: Any, field: str = "caches") -> list[Issue]:
    """Issues for every pool of the layer's kind: its block count must be ``pool_blocks[pool]``, its array
    ``[blocks * page_size, *row_shape]`` of the precision's dtype (``idx_scale``: ``[blocks * page_size]``).

    ``field`` prefixes the issue fields (``caches.ori``, or ``caches.layers.3.ori`` for a model's caches).
    Only reads shapes and dtypes, so it is safe to run before any pool is indexed.
    """
    issues = []
    pools = caches.config.layout.pools
    own_blocks = caches.pool_blocks if isinstance(caches.pool_blocks, dict) else {}
    for name in POOLS_BY_KIND[caches.kind]:
        want = pool_blocks[name]
        if own_blocks.get(name) != want:
            issues.append(Issue("config.mismatch", f"{field}.pool_blocks.{name}",
                                "caches and batch disagree on the pool's block count", expected=want,
                                actual=own_blocks.get(name)))
            continue
        shape = (want * pools[name].page_size, *pools[name].row_shape)
        dtype = np.int8 if name == "idx" and caches.precision == "a2a3" else np.float32
        arrays = [(name, getattr(caches, name), shape, dtype)]
        if name == "idx":
            arrays.append(("idx_scale", caches.idx_scale, shape[:1], np.float32))
        for pool, array, expected, expected_dtype in arrays:
            if not isinstance(array, np.ndarray) or array.shape != expected:
                issues.append(Issue("array.shape", f"{field}.{pool}", "pool array does not match its layout",
                                    expected=list(expected), actual=list(getattr(array, "shape", ()))))
            elif array.dtype != expected_dtype:
                issues.append(Issue("array.dtype", f"{field}.{pool}", "pool array has the wrong dtype",
                                    expected=np.dtype(expected_dtype).name, actual=array.dtype.name))
    return issues


FORMAT = "dspark.caches"
FORMAT_VERSION = "1"


@attrs.define(eq=False)
class ModelCaches:
    """One :class:`LayerCaches` per layer of ``config`` (index = layer), all with the same precision and blocks."""

    config: ModelConfig
    precision: Precision
    pool_blocks: PoolBlocks
    layers: list[LayerCaches]

    @classmethod
    def allocate(cls, config: ModelConfig, pool_blocks: PoolBlocks | Mapping[str, int], *,
                 precision: str = "fp32") -> ModelCaches:
        """Zero pools for every layer. ``pool_blocks``: blocks per pool, as the batch's allocator was given."""
        prec = check_precision(precision)
        blocks = PoolBlocks.from_mapping(pool_blocks)
        layers = [LayerCaches.allocate(config, i, blocks.as_dict(), prec) for i in range(config.num_layers)]
        return cls(config=config, precision=prec, pool_blocks=blocks, layers=layers)

    def __getitem__(self, layer: int) -> LayerCaches:
        return self.layers[layer]

    def copy(self) -> ModelCaches:
        """A deep copy (every pool copied): a TP rank's replica, or a snapshot to compare against."""
        return attrs.evolve(self, layers=[lc.copy() for lc in self.layers])

    def arrays(self) -> dict[str, np.ndarray]:
        """``layers.{i}.{pool}`` -> live array (the names the saved file uses)."""
        return {f"layers.{i}.{n}": a for i, lc in enumerate(self.layers) for n, a in lc.arrays().items()}

    def issues_for(self, batch: StepRows, precision: str, layers: range | list[int]) -> list[Issue]:
        """Every reason these caches cannot serve ``batch`` at ``precision`` over ``layers`` (empty = fine)."""
        issues = []
        if self.config != batch.config:
            issues.append(Issue("config.mismatch", "caches.config", "caches were allocated for another config",
                                expected=batch.config.name, actual=self.config.name))
            return issues
        if self.precision != precision:
            issues.append(Issue("config.mismatch", "caches.precision", "caches hold another precision's values",
                                expected=precision, actual=self.precision))
        used = {p for i in layers for p in POOLS_BY_KIND[self.config.layer_kind(i)]}
        for pool in sorted(used):
            if self.pool_blocks[pool] != batch.pool_blocks[pool]:
                issues.append(Issue("config.mismatch", f"caches.pool_blocks.{pool}",
                                    "the batch's tables address a pool of another size",
                                    expected=batch.pool_blocks[pool], actual=self.pool_blocks[pool]))
        return issues + self.structure_issues(layers)

    def structure_issues(self, layers: range | list[int]) -> list[Issue]:
        """Issues for the per-layer objects of ``layers``: one :class:`LayerCaches` per layer of the config, of
        this config, layer and precision, each pool array of the shape and dtype its layout and ``pool_blocks``
        give (a pool replaced by a shorter array is ``array.shape``). Reads shapes only, never pool rows."""
        n = self.config.num_layers
        if not isinstance(self.layers, list | tuple) or len(self.layers) != n:
            got = len(self.layers) if isinstance(self.layers, list | tuple) else type(self.layers).__name__
            return [Issue("array.shape", "caches.layers",
                          f"caches need one LayerCaches per layer of {self.config.name}", expected=n, actual=got)]
        issues = []
        for i in layers:
            lc, field = self.layers[i], f"caches.layers.{i}"
            if not isinstance(lc, LayerCaches):
                issues.append(Issue("config.mismatch", field, "caches of a layer must be a LayerCaches",  # type: ignore[unreachable]  # runtime guard
                                    expected="LayerCaches", actual=type(lc).__name__))
            elif lc.config != self.config or lc.layer != i:
                issues.append(Issue("config.mismatch", field, "these pools belong to another layer or config",
                                    expected=f"{self.config.name} layer {i}",
                                    actual=f"{lc.config.name} layer {lc.layer}"))
            elif lc.precision != self.precision:
                issues.append(Issue("config.mismatch", f"{field}.precision",
                                    "a layer holds another precision's values", expected=self.precision,
                                    actual=lc.precision))
            else:
                issues += pool_array_issues(lc, self.pool_blocks, field)
        return issues

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        """Write every pool of every layer and the header (config, precision, blocks) to ``path``."""
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": self.config.model_dump_json(),
                "precision": self.precision, "pool_blocks": json.dumps(self.pool_blocks.as_dict())}
        save_file({n: np.ascontiguousarray(a) for n, a in self.arrays().items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, config: ModelConfig, *, precision: str | None = None) -> ModelCaches:
        """Read caches saved by :meth:`save`, checking format, config, precision (if given), every array's
        presence, shape and dtype; raises one :class:`ABIError` with every issue (nothing is returned)."""
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
        except (OSError, SafetensorError) as exc:
            raise ABIError([Issue("array.missing", "caches", f"cannot read {path}: {exc}",
                                  expected="a safetensors caches file", actual=type(exc).__name__)]) from None
        issues = _header_issues(meta, config, precision)
        if issues:
            raise ABIError(issues)
        blocks = PoolBlocks.from_mapping(json.loads(meta["pool_blocks"]))
        out = cls.allocate(config, blocks, precision=meta["precision"])
        for name, want in out.arrays().items():
            got = tensors.get(name)
            if got is None:
                issues.append(Issue("array.missing", name, "pool missing from the caches file",
                                    expected=list(want.shape), actual="missing"))
            elif got.shape != want.shape or got.dtype != want.dtype:
                issues.append(Issue("array.shape" if got.shape != want.shape else "array.dtype", name,
                                    "pool differs from what the config and blocks imply",
                                    expected=f"{list(want.shape)} {want.dtype}",
                                    actual=f"{list(got.shape)} {got.dtype}"))
            else:
                want[...] = got
        if issues:
            raise ABIError(issues)
        return out


def _header_issues(meta: dict[str, str], config: ModelConfig, precision: str | None) -> list[Issue]:
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        return [Issue("config.mismatch", "caches.format", "not a caches file of a known format version",
                      expected=f"{FORMAT} v{FORMAT_VERSION}",
                      actual=f"{meta.get('format')} v{meta.get('format_version')}")]
    issues = []
    try:
        saved = ModelConfig.model_validate_json(meta.get("config", ""))
    except ValueError:
        saved = None
    if saved != config:
        issues.append(Issue("config.mismatch", "caches.config", "caches were saved for another config",
                            expected=config.name, actual=getattr(saved, "name", "unreadable")))
    if precision is not None and meta.get("precision") != precision:
        issues.append(Issue("config.mismatch", "caches.precision", "caches were saved at another precision",
                            expected=precision, actual=meta.get("precision")))
    try:
        PoolBlocks.from_mapping(json.loads(meta.get("pool_blocks", "")))
    except (ValueError, TypeError, AttributeError):
        issues.append(Issue("pools.blocks", "caches.pool_blocks", "header lacks valid pool block counts",
                            expected="7 positive counts", actual=meta.get("pool_blocks")))
    return issues

