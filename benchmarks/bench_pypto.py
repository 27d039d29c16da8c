"""pypto cost-model cycles of each prefill stage at FLASH head sizes, against the A2/A3 roofline.

THESE ARE COST-MODEL ESTIMATES. pypto 0.2.0 in SIM mode compiles each kernel for A2/A3 and runs its cost
model; nothing here ran on an NPU, and the cost model has not been validated against hardware.

Roofline per stage: max(cube cycles, memory cycles) on the whole chip, with the figures of pypto's
``lib/configs/A2A3.ini``: 24 cube cores, one 16x16x16 bf16 MAC block per core per cycle (8192 flop/cycle/core;
int8 16x32x16: 16384), and 32 bytes/cycle/core of DDR (768 B/cycle for the chip). Bytes count each input read
once and each output written once. Ratio = cost-model cycles / roofline cycles (1.0 would be perfect).

Roofline bytes of the sparse attention core count each query's gathered key rows (window + compressed keys
differ per query), those of the indexer each request's candidate keys once. Compressor rows: ``*_state`` is
the [kv | score] projection over all P rows; ``*_pool`` pools the P/ratio boundary windows from the ring.

Usage: python benchmarks/bench_pypto.py [--quick] [--rows P] [--tp TP] [--requests R] [--stages ...]
(from the repo root; the default run takes about 10 minutes on a 2-core machine, --quick a few).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_abi.layout import PoolLayout
from dspark_abi.presets import FLASH
from dspark_kernels.pypto.isolate import run_isolated

#: Candidate entries of every indexer row (a request about 4k tokens deep) and visible HCA entries of a row
#: at about 4k tokens (the dense HCA compressed set).
INDEX_CANDIDATES = 1024
HCA_ENTRIES = 32

CUBE_CORES = 24
BF16_FLOP_PER_CYCLE = CUBE_CORES * 2 * 16 * 16 * 16
INT8_FLOP_PER_CYCLE = CUBE_CORES * 2 * 16 * 32 * 16
DDR_BYTES_PER_CYCLE = CUBE_CORES * 32


def table_columns(pl: PoolLayout) -> int:
    """Columns of the widest block table a step can carry for a pool: the allocator's ``ring_width`` for the ring
    pools (ori and the state pools, addressed page mod width; the builder may trim further), ``table_width`` for
    the compressed pools."""
    return pl.ring_width if pl.is_ring else pl.table_width


def roofline(bf16_flops: float, int8_flops: float, nbytes: float) -> float:
    return max(bf16_flops / BF16_FLOP_PER_CYCLE + int8_flops / INT8_FLOP_PER_CYCLE, nbytes / DDR_BYTES_PER_CYCLE)


def stage_cycles(stage: str, p_rows: int, tp: int, requests: int) -> int | None:
    """Run one stage's kernel in cost-model-only mode (this runs in a child process)."""
    import ml_dtypes

    c = FLASH
    local = p_rows // tp
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    x, d, h, q, g, ro = c.hidden_size, c.head_dim, c.num_attention_heads, c.q_lora_rank, c.o_groups, c.o_lora_rank
    rd = c.qk_rope_head_dim
    if stage == "lowering":
        from dspark_kernels.pypto.lowering import run_lowering

        qsl = np.linspace(0, p_rows, requests + 1).astype(np.int32)
        return run_lowering(qsl, local, local).cycles
    if stage == "shared_kv":
        from dspark_kernels.pypto.projections import run_shared_kv

        return run_shared_kv(np.zeros((p_rows, x), bf), np.zeros((d, x), bf), np.ones(d, np.float32),
                             np.ones((p_rows, rd // 2), bf), np.zeros((p_rows, rd // 2), bf), c.rms_norm_eps).cycles
    if stage == "query":
        from dspark_kernels.pypto.projections import run_query

        return run_query(np.zeros((local, x), bf), np.zeros((q, x), bf), np.ones(q, np.float32),
                         np.zeros((h * d, q), np.int8), np.ones(h * d, np.float32), np.ones((local, rd // 2), bf),
                         np.zeros((local, rd // 2), bf), h, c.rms_norm_eps).cycles
    if stage == "ori_scatter":
        from dspark_kernels.pypto.paged import run_scatter

        return run_scatter(np.zeros((64 * 32, d), bf), np.zeros((p_rows, d), bf),
                           np.arange(p_rows, dtype=np.int64)).cycles
    if stage == "window":
        from dspark_kernels.pypto.window import run_window

        ori = c.layout.pools["ori"]
        width = table_columns(ori)
        table = rng.permutation(requests * width).astype(np.int32).reshape(requests, width)
        return run_window(np.arange(local, dtype=np.int32) + 1000, np.zeros(local, np.int32), table,
                          c.sliding_window, ring=ori.is_ring).cycles
    if stage in ("cmp4_state", "cmp128_state"):
        from dspark_kernels.pypto.compressor import run_state_rows

        ratio = 4 if stage == "cmp4_state" else 128
        width = (2 if ratio == 4 else 1) * d
        return run_state_rows(np.zeros((p_rows, x), bf), np.zeros((width, x), bf), np.zeros((width, x), bf),
                              np.zeros((ratio, width), np.float32), np.arange(p_rows, dtype=np.int32)).cycles
    if stage in ("cmp4_pool", "cmp128_pool", "idx_cmp_pool"):
        from dspark_kernels.pypto.compressor import run_pool

        ratio = 128 if stage == "cmp128_pool" else 4
        dim = c.index_head_dim if stage == "idx_cmp_pool" else d
        pool = "hca_state" if ratio == 128 else "csa_state"
        layout = c.layout.pools[pool]
        boundaries = p_rows // ratio
        positions = np.arange(1, boundaries + 1, dtype=np.int32) * ratio - 1 + 1024  # one window each
        table = np.arange(requests * table_columns(layout), dtype=np.int32).reshape(requests, -1) % 256
        state = np.zeros((256 * layout.page_size, (4 if ratio == 4 else 2) * dim), np.float32)
        hadamard = np.zeros((dim, dim), np.float32) if stage == "idx_cmp_pool" else None
        return run_pool(positions, np.zeros(boundaries, np.int32), table, state, np.ones(dim, np.float32),
                        np.ones((boundaries, rd // 2), bf), np.zeros((boundaries, rd // 2), bf), ratio=ratio,
                        page=layout.page_size, eps=c.rms_norm_eps, ring=layout.is_ring, hadamard=hadamard).cycles
    if stage == "indexer":
        from dspark_kernels.pypto.indexer import run_indexer

        hi, di, k = c.index_n_heads, c.index_head_dim, c.index_topk
        cand = np.tile(np.arange(INDEX_CANDIDATES, dtype=np.int32), (local, 1))
        return run_indexer(np.zeros((local, q), np.int8), np.ones((local, 1), np.float32),
                           np.zeros((hi * di, q), np.int8), np.ones(hi * di, np.float32), np.zeros((local, x), bf),
                           np.zeros((hi, x), bf), np.ones((local, rd // 2), bf), np.zeros((local, rd // 2), bf),
                           np.zeros((di, di), bf), np.zeros((INDEX_CANDIDATES, di), np.int8),
                           np.ones(INDEX_CANDIDATES, np.float32), cand, heads=hi, topk=k,
                           weight_scale=c.index_weight_scale).cycles
    if stage in ("sparse_attn_csa", "sparse_attn_hca"):
        from dspark_kernels.pypto.sparse_attention import run_sparse_attention

        w_rows = np.tile(np.arange(c.sliding_window, dtype=np.int32), (local, 1))
        k = c.index_topk if stage == "sparse_attn_csa" else HCA_ENTRIES
        cmp_rows = np.tile(np.arange(k, dtype=np.int32), (local, 1))
        return run_sparse_attention(np.zeros((local, h, d), bf), w_rows, cmp_rows, np.zeros((4096, d), bf),
                                    np.zeros((4096, d), bf), np.zeros(h, np.float32), np.ones((local, rd // 2), bf),
                                    np.zeros((local, rd // 2), bf), scale=c.softmax_scale).cycles
    if stage == "o_proj":
        from dspark_kernels.pypto.o_proj import run_o_proj

        return run_o_proj(np.zeros((local, h * d), bf), np.zeros((g * ro, h * d // g), bf),
                          np.zeros((x, g * ro), np.int8), np.ones(x, np.float32), g).cycles
    raise ValueError(stage)


def stage_roofline(stage: str, p_rows: int, tp: int, requests: int) -> float:
    c = FLASH
    local = p_rows // tp
    x, d, h, q, g, ro = c.hidden_size, c.head_dim, c.num_attention_heads, c.q_lora_rank, c.o_groups, c.o_lora_rank
    w = c.sliding_window
    table = requests * table_columns(c.layout.pools["ori"])
    hi, di, k = c.index_n_heads, c.index_head_dim, c.index_topk
    rd = c.qk_rope_head_dim

    def state_rows(width: int, ratio: int) -> float:
        return roofline(2 * 2 * p_rows * x * width, 0, 2 * p_rows * x + 2 * 2 * width * x + 4 * ratio * width
                        + 4 * p_rows + 4 * p_rows * 2 * width)

    def pool(ratio: int, dim: int, index: bool) -> float:
        b, slots = p_rows // ratio, (8 if ratio == 4 else ratio)
        out = b * dim + 4 * b + 2 * dim * dim if index else 2 * b * dim  # int8 + scale (+ Hadamard) or bf16
        # each slot reads its kv and score halves (2 * dim fp32), plus table entries, norm and rope rows
        return roofline(2 * b * dim * dim if index else 0, 0,
                        4 * b * slots * 2 * dim + 4 * b * (2 + slots) + 4 * dim + 2 * b * rd + out)

    def attention(keys: int) -> float:
        return roofline(2 * 2 * local * h * d * (w + keys), 0,
                        2 * local * h * d * 2 + 2 * local * (w + keys) * d + 4 * local * (w + keys) + 4 * h
                        + 2 * local * rd)

    return {
        "lowering": roofline(0, 0, 4 * (requests + 1) + 4 + 4 * local),
        "shared_kv": roofline(2 * p_rows * x * d, 0, 2 * (p_rows * x + d * x + p_rows * d) + 4 * d + 4 * p_rows * 64),
        "query": roofline(2 * local * x * q, 2 * local * q * h * d,
                          2 * local * x + 2 * q * x + h * d * q + 4 * h * d + 2 * local * h * d
                          + local * q + 4 * local),
        "ori_scatter": roofline(0, 0, 2 * 2 * p_rows * d + 4 * p_rows),
        "window": roofline(0, 0, 8 * local + 4 * table + 4 * local * w),
        "cmp4_state": state_rows(2 * d, 4),
        "cmp128_state": state_rows(d, 128),
        "cmp4_pool": pool(4, d, False),
        "cmp128_pool": pool(128, d, False),
        "idx_cmp_pool": pool(4, di, True),
        "indexer": roofline(2 * local * hi * di * di + 2 * local * x * hi,
                            2 * local * q * hi * di + 2 * local * hi * di * INDEX_CANDIDATES,
                            local * q + 4 * local + hi * di * q + 4 * hi * di + 2 * local * x + 2 * hi * x
                            + 2 * local * rd + 2 * di * di + requests * INDEX_CANDIDATES * (di + 4)
                            + 4 * local * INDEX_CANDIDATES + 4 * local * k),
        "sparse_attn_csa": attention(k),
        "sparse_attn_hca": attention(HCA_ENTRIES),
        "o_proj": roofline(2 * local * h * d * ro, 2 * local * g * ro * x,
                           2 * local * h * d + 2 * g * ro * (h * d // g) + x * g * ro + 4 * x + 2 * local * x),
    }[stage]


def stage_rows(stage: str, p_rows: int, tp: int) -> int:
    """Rows a stage's kernel processes: P (KV side), P/ratio (compressor pooling) or L (query side)."""
    if stage in ("cmp4_pool", "idx_cmp_pool"):
        return p_rows // 4
    if stage == "cmp128_pool":
        return p_rows // 128
    return p_rows if stage in ("shared_kv", "ori_scatter", "cmp4_state", "cmp128_state") else p_rows // tp


STAGES = ("lowering", "shared_kv", "query", "ori_scatter", "window", "cmp4_state", "cmp4_pool", "idx_cmp_pool",
          "cmp128_state", "cmp128_pool", "indexer", "sparse_attn_csa", "sparse_attn_hca", "o_proj")
#: Rows (P) of the --quick run.
QUICK_ROWS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512, help="packed group rows P (default 512)")
    parser.add_argument("--tp", type=int, default=4, help="TP group size (default 4: L = P / 4 query rows)")
    parser.add_argument("--requests", type=int, default=4, help="packed requests (default 4)")
    parser.add_argument("--stages", nargs="*", default=list(STAGES), choices=STAGES)
    parser.add_argument("--quick", action="store_true", help=f"P={QUICK_ROWS} rows (a smoke run, a few minutes)")
    args = parser.parse_args()
    if args.quick:
        args.rows = QUICK_ROWS
    os.environ["DSPARK_PYPTO_COST_ONLY"] = "1"  # the child compiles and runs the cost model only
    print("pypto 0.2.0 cost-model estimates for A2/A3 (SIM mode; not measured on hardware)")
    print(f"FLASH head sizes, packed batch P={args.rows} rows, TP={args.tp} (L={args.rows // args.tp}), "
          f"R={args.requests} requests")
    print(f"{'stage':<12} {'rows':>5} {'cost-model cycles':>18} {'roofline cycles':>16} {'ratio':>8} {'wall s':>7}")
    from benchmarks import bench_pypto as importable  # run_isolated needs a module-level function by import path

    for stage in args.stages:
        start = time.perf_counter()
        cycles = run_isolated(importable.stage_cycles, stage, args.rows, args.tp, args.requests, timeout=3000)
        wall = time.perf_counter() - start
        roof = stage_roofline(stage, args.rows, args.tp, args.requests)
        rows = stage_rows(stage, args.rows, args.tp)
        ratio = f"{cycles / roof:8.1f}" if cycles else "     n/a"
        print(f"{stage:<12} {rows:>5} {cycles or 0:>18} {roof:>16.0f} {ratio} {wall:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
