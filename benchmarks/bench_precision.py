"""How far the three precisions are from each other on the same batch: fp32 (exact), a2a3 (the a2a3 kernels'
bf16/int8 numerics) and deepseek (DeepSeek's official inference: bf16, FP8 / FP4 fake quantisation).

Prints, for every pair of precisions (distance of the first from the second, relative to the second):

Weights are random, in the shipped formats (FP8 attention projections, FP4 experts: precision deepseek quantises
the inputs of the Linears whose weights are stored so, as the official inference does).

1. TINY, a whole prefill of three requests (150, 37 and 260 tokens from position 0, random weights): per-row
   relative L2 distance of the final hidden rows (median, max), of the sampled rows' logits, and the fraction
   of sampled rows whose greedy token agrees.
2. TINY, every attention layer on the same post-norm input rows: per-row relative L2 distance of the attention
   outputs (median, max) and, on CSA layers, over the rows with more visible entries than ``index_topk`` (rows
   with at most k candidates select all of them in every precision): the fraction whose top-k sets agree and
   the mean share of one set found in the other.
3. One FLASH-size CSA layer (layer 2, N tokens of one request, default 2600: the last ~550 rows choose 512
   of more entries): the same figures.

Attention figures also compare fp32 with ``deepseek@v4-flash``: precision deepseek with the first V4-Flash
release's KV step (an identity on bf16 values, :data:`~dspark_kernels.model.deepseek_numerics.KV_RELEASE`).

    python benchmarks/bench_precision.py               # all three (~2-4 minutes on 2 cores)
    python benchmarks/bench_precision.py --quick       # TINY only (~10 s)
    python benchmarks/bench_precision.py --json out.json

Nothing here is timed; the figures are deterministic for a given BLAS (seeded weights and inputs).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import tempfile
from collections.abc import Iterator

import numpy as np

from dspark_abi import BatchBuilder, BlockAllocator, PackedBatch, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.config import ModelConfig
from dspark_abi.layout import visible_entries
from dspark_abi.presets import FLASH, TINY
from dspark_kernels import AttentionWeights, LayerCaches, attention
from dspark_kernels.api import prefill
from dspark_kernels.model import deepseek_numerics
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.geometry import INDEX_RATIO
from dspark_kernels.model.numerics import PRECISIONS, check_precision, narrow
from dspark_kernels.model.plan import IndexKeyPools
from dspark_kernels.model.prepared import PreparedWeightsCache
from dspark_kernels.model.rope import rope_at
from dspark_kernels.model.synthetic import write_checkpoint
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.reference.indexer import IndexCandidates, index_query, lightning_topk
from dspark_kernels.reference.projections import low_rank_query

PAIRS = list(itertools.combinations(PRECISIONS, 2))     # (fp32, a2a3), (fp32, deepseek), (a2a3, deepseek)
#: The first release's deepseek numerics (its in-place KV fake quant is an identity on bf16), as a fourth column.
FIRST_RELEASE = "deepseek@v4-flash"
TINY_REQUESTS = {0: 150, 1: 37, 2: 260}


@contextlib.contextmanager
def kv_release(release: str) -> Iterator[None]:
    """Run precision deepseek with another release's KV fake quant (the module constant it reads)."""
    saved = deepseek_numerics.KV_RELEASE
    deepseek_numerics.KV_RELEASE = release  # type: ignore[assignment]
    try:
        yield
    finally:
        deepseek_numerics.KV_RELEASE = saved


def row_rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row ||a - b|| / ||b|| (rows of zeros in b excluded)."""
    a, b = a.reshape(a.shape[0], -1).astype(np.float64), b.reshape(b.shape[0], -1).astype(np.float64)
    norm = np.linalg.norm(b, axis=1)
    keep = norm > 0
    return np.linalg.norm(a - b, axis=1)[keep] / norm[keep]


def summary(rel: np.ndarray) -> dict[str, float]:
    return {"median": float(np.median(rel)), "max": float(rel.max())}


def build(config: ModelConfig, requests: dict[int, int]) -> PackedBatch:
    bb = BatchBuilder(config, PaddingPolicy(), BlockAllocator(config, pool_blocks_for(config, list(requests.values()))))
    for rid, n in requests.items():
        bb.add(rid, num_cached=0, num_new=n, token_ids=np.random.default_rng(rid).integers(0, config.vocab_size, n))
    return bb.build()


def hidden_rows(batch: PackedBatch, seed: int = 7) -> np.ndarray:
    """Post-norm attention input rows [P, X] (O(1) entries), zero on padding rows."""
    x = np.random.default_rng(seed).standard_normal((batch.padded_rows, batch.config.hidden_size), dtype=np.float32)
    x[batch.row_request < 0] = 0
    return x


def topk_sets(batch: PackedBatch, layer: int, x: np.ndarray, weights: AttentionWeights, caches: LayerCaches,
              precision: str, prepared: PreparedWeightsCache) -> np.ndarray:
    """The library's top-k of every row ([P, k] int32, -1 padded) from the caches an attention call wrote."""
    cfg, prec = batch.config, check_precision(precision)
    w = prepared.get(weights, prec)
    xn = narrow(x, prec)  # the attention's input rows in this precision
    pos = batch.positions.astype(np.int64)
    cos, sin = rope_at(cfg, "csa", pos, prec)
    iq = index_query(low_rank_query(xn, w, cfg.rms_norm_eps, prec), xn, w, cos, sin, cfg.index_n_heads,
                     cfg.index_weight_scale, prec)
    return lightning_topk(iq, batch.row_request, IndexKeyPools(caches.pool("idx"), caches.pool("idx_scale")),
                          IndexCandidates.lookup(pos, batch.row_request, batch.tables["idx"]), topk=cfg.index_topk,
                          precision=prec)


def attention_figures(config: ModelConfig, layer: int, requests: dict[int, int], seed: int = 0) -> dict:
    """One layer on the same input rows in every precision: output distances and top-k agreement per pair."""
    batch = build(config, requests)
    x = hidden_rows(batch)
    weights = AttentionWeights.random(config, layer, seed=seed, stored="shipped")   # FP8 projections, as shipped
    prepared = PreparedWeightsCache()
    live = batch.row_request >= 0
    outs, tops = {}, {}
    for precision in PRECISIONS:
        caches = LayerCaches.allocate(config, layer, batch.pool_blocks, precision)
        outs[precision] = attention(batch, layer, x, weights, caches, precision=precision, prepared=prepared)[live]
        if precision == "deepseek":
            with kv_release("v4-flash"):
                first = LayerCaches.allocate(config, layer, batch.pool_blocks, precision)
                outs[FIRST_RELEASE] = attention(batch, layer, x, weights, first, precision=precision,
                                                prepared=prepared)[live]
        if config.layer_kind(layer) == "csa":
            tops[precision] = topk_sets(batch, layer, x, weights, caches, precision, prepared)[live]
    chooses = visible_entries(batch.positions[live].astype(np.int64), INDEX_RATIO) > config.index_topk
    out: dict = {"layer": layer, "kind": config.layer_kind(layer), "rows": int(live.sum()),
                 "choosing_rows": int(chooses.sum()) if tops else 0, "pairs": {}}
    for a, b in [*PAIRS, ("fp32", FIRST_RELEASE)]:
        fig: dict = {"out": summary(row_rel(outs[a], outs[b]))}
        if tops and chooses.any() and b in tops:
            sets = [(set(p[p >= 0]), set(q[q >= 0])) for p, q in zip(tops[a][chooses], tops[b][chooses], strict=True)]
            fig["topk_agree"] = float(np.mean([p == q for p, q in sets]))
            fig["topk_overlap"] = float(np.mean([len(p & q) / len(q) for p, q in sets]))
        out["pairs"][f"{a}-{b}"] = fig
    return out


def forward_figures(seed: int = 0) -> dict:
    """A whole TINY prefill in every precision: hidden / logits distances and greedy agreement per pair, on a
    checkpoint in the shipped formats (FP8 attention projections, FP4 experts), so deepseek runs its FP8 GEMMs."""
    with tempfile.TemporaryDirectory() as tmp:
        weights = ModelWeights.from_safetensors(write_checkpoint(tmp, TINY, seed=seed), TINY, keep_layers=True)
        return _forward_figures(weights)


def _forward_figures(weights: ModelWeights) -> dict:
    res = {}
    for precision in PRECISIONS:
        batch = build(TINY, TINY_REQUESTS)
        caches = ModelCaches.allocate(TINY, batch.pool_blocks, precision=precision)
        res[precision] = prefill(batch, batch.token_ids, weights, caches, precision=precision)
    live = batch.row_request >= 0
    out: dict = {"rows": int(live.sum()), "sampled_rows": int((res["fp32"].logit_rows >= 0).sum()), "pairs": {}}
    for a, b in PAIRS:
        ra, rb = res[a], res[b]
        active = ra.logit_rows >= 0
        out["pairs"][f"{a}-{b}"] = {"hidden": summary(row_rel(ra.hidden[live], rb.hidden[live])),
                                    "logits": summary(row_rel(ra.logits[active], rb.logits[active])),
                                    "greedy_agree": float(np.mean(ra.sampled[active] == rb.sampled[active]))}
    return out


def _print_pairs(title: str, fig: dict) -> None:
    print(title)
    for pair, f in fig["pairs"].items():
        parts = [f"{name} rel median {v['median']:.2e} max {v['max']:.2e}" for name, v in f.items()
                 if isinstance(v, dict)]
        parts += [f"{name} {v:.3f}" for name, v in f.items() if not isinstance(v, dict)]
        print(f"  {pair:22s} " + "; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="TINY only")
    ap.add_argument("--flash-tokens", type=int, default=2600, help="tokens of the FLASH-size CSA layer")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    figures: dict = {"forward": forward_figures()}
    _print_pairs(f"TINY prefill ({figures['forward']['rows']} rows, {figures['forward']['sampled_rows']} sampled)",
                 figures["forward"])
    figures["tiny_layers"] = [attention_figures(TINY, layer, TINY_REQUESTS) for layer in range(TINY.num_layers)]
    for f in figures["tiny_layers"]:
        _print_pairs(f"TINY layer {f['layer']} ({f['kind']}, {f['rows']} rows, {f['choosing_rows']} choosing)", f)
    if not args.quick:
        layer = next(i for i in range(FLASH.num_layers) if FLASH.layer_kind(i) == "csa")
        f = attention_figures(FLASH, layer, {0: args.flash_tokens})
        figures["flash_layer"] = f
        _print_pairs(f"FLASH layer {layer} ({f['kind']}, {f['rows']} rows, {f['choosing_rows']} choosing)", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
