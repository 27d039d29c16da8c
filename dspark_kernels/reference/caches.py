"""`LayerCaches`: the paged pools one attention layer reads and writes, carried from call to call.

Pools are flat ``[blocks * page_size, row]`` arrays (physical row = block * page_size + offset), zero at
allocation, and are **mutated in place** by :func:`~dspark_kernels.reference.attention.attention`; pass
the same object to the next chunk (or to decode). Only the pools of the layer's kind are allocated:

========================  ===========================  ===================================  ===========
pool                      shape                         dtype                                kinds
========================  ===========================  ===================================  ===========
``ori``                   [B*32, D]                     float32 (bf16 values in a2a3)        all
``csa_cmp``               [B*32, D]                     float32 (bf16 values in a2a3)        csa
``idx`` / ``idx_scale``   [B*32, dI] / [B*32]           int8 + float32 dequant (a2a3);       csa
                                                        float32 exact + 1.0 (fp32)
``csa_state``             [B*2, 4*D] = [kv 2D | sc 2D]  float32                              csa
``csa_inner_state``       [B*2, 4*dI]                   float32                              csa
``hca_cmp``               [B*32, D]                     float32 (bf16 values in a2a3)        hca
``hca_state``             [B*8, 2*D] = [kv D | sc D]    float32                              hca
========================  ===========================  ===================================  ===========

bf16 pools are held as float32 arrays of bf16-representable values (fast BLAS, exact widening), so the
a2a3 contents equal what a bf16 pool would hold. A cache remembers the precision that writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from dspark_abi.config import LayerKind, ModelConfig
from dspark_abi.errors import ABIError, Issue
from dspark_kernels.reference.numerics import Precision, check_precision

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

    def copy(self) -> LayerCaches:
        """A deep copy (pools copied)."""
        return attrs.evolve(self, pool_blocks=dict(self.pool_blocks),
                            **{n: a.copy() for n, a in self.arrays().items()})
