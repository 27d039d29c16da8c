"""pypto cost-model cycles of every prefill stage at FLASH sizes against the A2/A3 roofline; whole layers, a whole
forward as tokens/s per die, and what packing saves.

THESE ARE COST-MODEL ESTIMATES. pypto 0.2.0 in SIM mode compiles each kernel for A2/A3 and runs its cost
model; nothing here ran on an NPU, and the cost model has not been validated against hardware.

Roofline per stage: max(cube cycles, memory cycles) on one die, with the figures of pypto's
``lib/configs/A2A3.ini`` (read at run time): 24 cube cores, one 16x16x16 MAC block per core per cycle (8192
flop/cycle/core; int8 16x32x16: 16384; fp32 operands are counted at the bf16 rate, the ini lists no slower
shape), and 32 bytes/cycle/core of DDR (768 B/cycle for the die). Bytes count each input read once and each
output written once. Ratio = cost-model cycles / roofline cycles (1.0 would be perfect).

Roofline bytes of the sparse attention core count each query's gathered key rows (window + compressed keys
differ per query), those of the indexer each request's candidate keys once. Compressor rows: ``*_state`` is
the [kv | score] projection over all P rows (then scattered to the state ring); ``*_pool`` pools the P/ratio
boundary windows from the ring (then scattered to the compressed pool).

What one run prints:

1. the stage table at ``--rows`` P (default 512, TP = 4, R = 4: the figures the tuning goals are set at);
2. the stage table of one packed call of 64-token requests (``--layer-rows``, default 512 = 8 x 64) and of one
   64-token request, each followed by the whole-layer sums of the SWA, CSA and HCA layers (every kernel call a
   layer makes, as ``dspark_kernels.pypto.attention`` and ``model.layer`` make them: hc_pre and hc_post twice);
3. the whole forward for N = 8192 tokens (43 layers of the FLASH schedule + head) as tokens/s per die next to
   the roofline's tokens/s; N is run as N / P chunked calls of P = ``--layer-rows`` rows (how a chunked prefill
   runs it; no extrapolation: one call of N rows would only amortise fixed costs further);
4. packing: 32 x 64 tokens packed against 32 calls of one 64-token request, whole layer, and the ratio. The
   packed side is 32 x 64 / P calls of P = ``--layer-rows`` rows: an upper bound on one call of 2048 rows (each
   call pays the weights and fixed costs again), so the ratio is a lower bound.

Per die: every rank of a TP group runs the KV side, hc_pre / hc_post and the norms over all P rows and the
query side and the MoE over its L = P / TP rows, in parallel, so a group of TP dies takes (cycles of one die)
per call: tokens/s per die = N / (calls * cycles / f) / TP, f = the ini's cube frequency. All-gathers are not
priced. Key sets (representative of a prefill about 4k tokens deep, the middle of N = 8192): CSA 128 window +
512 top-k keys per query, HCA 128 + 32 compressed entries, indexer 1024 candidates per row.

Stages whose kernels do not exist yet are printed as ``missing`` and the sums name them.

``--round`` prints instead one DSpark draft + verify round (R = 64 requests, K = 5 drafts, contexts of 65,536
positions): the drafter's table over R x B block rows (B = ``dspark_block_size``; its draft attention is the
sparse-attention kernel over the W ring keys plus the B block keys), the verify step's table over R x (1 + K) rows
that deep (indexer candidates and HCA entries follow the depth: 16,384 and 512 per row; the indexer's top-512
sorts them in four column tiles of 4,096 and merges the winners, ``dspark_kernels.pypto.indexer.sort_tiles``), then
per part (three drafter stages, the drafter's head, each verify layer kind times its count in the FLASH schedule,
the verify step's once-per-call stages) and in total, per die, with the round's ms per die and the tokens/s per die
it gives between every first draft rejected (R tokens per round) and every draft accepted (R x (1 + K)). The
drafter's head includes its Markov head (one call: the B block rows left to right) and confidence head; the round
ends with the drafter's observe of the accepted rows (at most K + 1 per request: ``main_x`` and each stage's window
keys, the shared kv kernel at the verify step's P, whose cycles the verify table holds). Not priced: the FP8 step
of the drafter's keys (on the host) and the all-gathers.

Usage: python benchmarks/bench_pypto.py [--quick] [--rows P] [--layer-rows P] [--tp TP] [--requests R]
[--stages ...] [--tables-only] [--round] [--json PATH] [--reuse PATH [--rerun STAGE ...]]   (from the repo root;
``--stages`` prints only their table; --quick: one table at P = 128 = 2 x 64 and one at P = 64, everything else
the same). A full run took 25 minutes on the shared 2-core machine (the P = 64 table 11 of them, the MoE experts
kernel at L = 128 under 3); ``--reuse`` an earlier ``--json`` file with ``--rerun`` the stages a change touched.
"""

import argparse
import configparser
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_abi.layout import KV_PAGE_SIZE, PoolLayout
from dspark_abi.presets import FLASH, FLASH_DSPARK
from dspark_kernels.model.geometry import INDEX_RATIO, coff
from dspark_kernels.pypto.isolate import run_isolated

#: Depth (positions) of the representative requests: every query row sits past this position.
DEPTH = 4096
#: The HCA compression ratio (one compressed entry per this many positions).
HCA_RATIO = 128


def index_candidates(depth: int) -> int:
    """Candidate entries of every indexer row of a request ``depth`` positions deep (one per INDEX_RATIO)."""
    return depth // INDEX_RATIO


def hca_entries(depth: int) -> int:
    """Visible HCA entries of a row ``depth`` positions deep (the dense HCA compressed set)."""
    return depth // HCA_RATIO


#: At DEPTH: 1024 indexer candidates and 32 HCA entries per row.
INDEX_CANDIDATES = index_candidates(DEPTH)
HCA_ENTRIES = hca_entries(DEPTH)
#: The forward estimate's tokens and the packing comparison's requests x tokens.
FORWARD_TOKENS = 8192
PACK_REQUESTS, PACK_TOKENS = 32, 64
#: Rows of one packed call of the layer, forward and packing figures: the largest P at which every kernel
#: compiled within this machine's memory (P = 2048: the indexer's and the attention core's cost-model processes
#: were killed at 10 GB; the entry-row kernel's scheduling pass took 18 minutes).
LAYER_ROWS = 512


def _a2a3_ini() -> configparser.ConfigParser:
    """pypto's A2/A3 platform file (found without importing pypto, which imports torch)."""
    spec = importlib.util.find_spec("pypto")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pypto is not installed (pip install torch==2.13.0 pypto==0.2.0 sympy)")
    ini = configparser.ConfigParser(interpolation=None, strict=False)
    ini.read(Path(next(iter(spec.submodule_search_locations)), "lib", "configs", "A2A3.ini"))
    return ini


def _die_rates() -> tuple[float, float, float, float]:
    """(bf16 flop/cycle, int8 flop/cycle, DDR bytes/cycle, cube MHz) of the whole die, from A2A3.ini."""
    ini = _a2a3_ini()
    cores = ini.getint("SoCInfo", "cube_core_cnt")
    m, n, k = (int(v) for v in ini.get("DtypeMKN", "Default").split(","))
    im, ik, in_ = (int(v) for v in ini.get("DtypeMKN", "DT_INT8").split(","))
    return (cores * 2 * m * n * k, cores * 2 * im * ik * in_, cores * ini.getfloat("AICoreMemoryRates", "ddr_rate"),
            ini.getfloat("AICoreSpec", "cube_freq"))


BF16_FLOP_PER_CYCLE, INT8_FLOP_PER_CYCLE, DDR_BYTES_PER_CYCLE, CUBE_MHZ = _die_rates()


def table_columns(pl: PoolLayout) -> int:
    """Columns of the widest block table a step can carry for a pool: the allocator's ``ring_width`` for the ring
    pools (ori and the state pools, addressed page mod width; the builder may trim further), ``table_width`` for
    the compressed pools."""
    return pl.ring_width if pl.is_ring else pl.table_width


def roofline(bf16_flops: float, int8_flops: float, nbytes: float) -> float:
    return max(bf16_flops / BF16_FLOP_PER_CYCLE + int8_flops / INT8_FLOP_PER_CYCLE, nbytes / DDR_BYTES_PER_CYCLE)


def boundaries(p_rows: int, ratio: int) -> int:
    """Boundary rows a compressor pools per call: P / ratio, at least one (a 64-row call closes a ratio-128
    window every other call: :func:`stage_weight` counts the kernel at 64 / 128 in the sums)."""
    return max(1, p_rows // ratio)


def stage_weight(stage: str, p_rows: int) -> float:
    """Average calls per layer of a stage's kernel at P rows (below 1 only for ratio-128 boundaries, P < 128)."""
    return min(1.0, p_rows / 128) if stage in ("cmp128_pool", "cmp128_entry_scatter") else 1.0


# ---------------------------------------------------------------------------------------------------------------
# stages: (row count, label); cycles in the child process; rooflines in the parent

#: (stage, rows kind, label). Rows: P all group rows, L the rank's query rows, B4 / B128 the boundary rows of a
#: ratio, M the logit rows (one per request).
STAGE_TABLE = (
    ("lowering", "L", "1 lowering (request ids, O(L+R))"),
    ("hc_pre", "P", "hc_pre: RMS, mixes, gates, Sinkhorn, stream mix, fused attn_norm / ffn_norm"),
    ("shared_kv", "P", "2 shared kv (all P rows)"),
    ("query", "L", "2 q path (bf16 wq_a, int8 wq_b, RMS, RoPE)"),
    ("ori_scatter", "P", "3 ori scatter through slot mappings"),
    ("window", "L", "3 window rows"),
    ("cmp4_state", "P", "4 compressor ratio 4: [kv | score] rows"),
    ("cmp4_state_scatter", "P", "4 ratio 4: state ring scatter"),
    ("cmp4_pool", "B4", "4 compressor ratio 4: window pooling from the ring"),
    ("cmp4_entry_scatter", "B4", "4 ratio 4: csa_cmp scatter"),
    ("idx_state", "P", "5 indexer key compressor: [kv | score] rows"),
    ("idx_state_scatter", "P", "5 indexer key compressor: state ring scatter"),
    ("idx_cmp_pool", "B4", "5 indexer key compressor: pooling + Hadamard + int8"),
    ("idx_scatter", "B4", "5 idx scatter (int8)"),
    ("idx_scale_scatter", "B4", "5 idx_scale scatter (fp32 rows padded to 32 B)"),
    ("cmp128_state", "P", "4 compressor ratio 128: [kv | score] rows"),
    ("cmp128_state_scatter", "P", "4 ratio 128: state ring scatter"),
    ("cmp128_pool", "B128", "4 compressor ratio 128: window pooling"),
    ("cmp128_entry_scatter", "B128", "4 ratio 128: hca_cmp scatter"),
    ("idx_candidates", "L", "5 indexer candidates through the idx table"),
    ("indexer", "L", "5 lightning indexer: queries, scores, top-512"),
    ("csa_entry_rows", "L", "6 CSA top-k entry rows"),
    ("hca_entry_rows", "L", "6 HCA entry rows (every visible entry)"),
    ("sparse_attn_swa", "L", "6 sparse attention core, SWA (128 window keys)"),
    ("sparse_attn_csa", "L", "6 sparse attention core, CSA (640 keys per query)"),
    ("sparse_attn_hca", "L", "6 sparse attention core, HCA (160 keys per query)"),
    ("o_proj", "L", "7 grouped o_proj (int8 activations)"),
    ("hc_post", "P", "hc_post (fp32 stream update)"),
    ("moe_gate", "L", "MoE gate: sqrtsoftplus, top-6 of 256, int8 activations"),
    ("moe_experts", "L", "MoE routed experts (by expert tile) + shared expert + combine"),
    ("hc_head", "P", "head: hc_head (the DSpark target features)"),
    ("final_hidden", "P", "head: hc_head + final RMSNorm"),
    ("lm_head", "M", "head: LM head over the logit rows (vocabulary shard V / TP)"),
    ("greedy", "M", "head: greedy sampling over the gathered vocabulary"),
)
STAGES = tuple(name for name, _, _ in STAGE_TABLE)
#: Kernels only the DSpark drafter calls (``--round``): its non-causal attention core over the W ring keys of
#: committed context plus the B block rows' own keys (the sparse-attention kernel with the block rows as its
#: second key set).
DRAFT_TABLE = (("draft_attn", "L", "draft: sparse attention core over W ring + B block keys (non-causal)"),
               ("markov", "R", "draft: Markov head, B block rows left to right in one call (bias, first max)"),
               ("confidence", "P", "draft: confidence head ([h ; markov_w1[previous]] @ proj)"),
               ("main_x", "P", "observe: main_proj [T*D -> D] + RMSNorm of the accepted rows"))
_ROWS_KIND = {name: kind for name, kind, _ in STAGE_TABLE + DRAFT_TABLE}
LABELS = {name: label for name, _, label in STAGE_TABLE + DRAFT_TABLE}

#: Kernel calls of one layer of each kind (hc_pre / hc_post run around attention and around the MoE; the
#: attn_norm / ffn_norm RMSNorms are fused into hc_pre).
_SIDES = (("hc_pre", 2), ("shared_kv", 1), ("ori_scatter", 1), ("query", 1), ("window", 1), ("o_proj", 1),
          ("hc_post", 2), ("moe_gate", 1), ("moe_experts", 1))
LAYER_STAGES: dict[str, tuple[tuple[str, int], ...]] = {
    "swa": (*_SIDES, ("sparse_attn_swa", 1)),
    "csa": (*_SIDES, ("cmp4_state", 1), ("cmp4_state_scatter", 1), ("cmp4_pool", 1), ("cmp4_entry_scatter", 1),
            ("idx_state", 1), ("idx_state_scatter", 1), ("idx_cmp_pool", 1), ("idx_scatter", 1),
            ("idx_scale_scatter", 1), ("idx_candidates", 1), ("indexer", 1), ("csa_entry_rows", 1),
            ("sparse_attn_csa", 1)),
    "hca": (*_SIDES, ("cmp128_state", 1), ("cmp128_state_scatter", 1), ("cmp128_pool", 1),
            ("cmp128_entry_scatter", 1), ("hca_entry_rows", 1), ("sparse_attn_hca", 1)),
}
#: Once per forward call: stage 1 (once per plan), the head, and hc_head after each DSpark target layer (the
#: drafter's target features; FLASH_DSPARK has the FLASH schedule and three target layers).
FORWARD_ONCE = (("lowering", 1), ("final_hidden", 1), ("lm_head", 1), ("greedy", 1),
                ("hc_head", len(FLASH_DSPARK.dspark_target_layers)))
#: Distinct expert weight stacks the MoE experts kernel is given: its tiles keep their count and the uniform
#: routing's tile sizes, their expert index is taken modulo this. The cost model prices a tile the same for
#: every expert index (75 tiles at L = 16: 3,999,813 cycles with 4, 16 and 64 stacks), so the figure holds for
#: all 256 experts while the child process holds 16 x 24 MB of int8 weights instead of 6 GB.
EXPERT_STACKS = 16
#: Seconds one stage's child process may take (the slowest, the MoE experts at L = 128, took 92-157 s).
STAGE_TIMEOUT_S = 3000


def stage_rows(stage: str, p_rows: int, tp: int, requests: int = 1, logit_rows: int | None = None) -> int:
    """Rows a stage's kernel processes (:data:`STAGE_TABLE`'s rows kind; M = ``logit_rows``, default one per
    request)."""
    kind = _ROWS_KIND[stage]
    if kind == "P":
        return p_rows
    if kind == "L":
        return p_rows // tp
    if kind == "M":
        return requests if logit_rows is None else logit_rows
    if kind == "R":
        return requests
    return boundaries(p_rows, 4 if kind == "B4" else 128)


def _require(module: str, *names: str) -> Any:
    """The module holding a stage's kernel (in the child), or NotImplementedError (a builtin, so it reaches the
    parent as itself: the stage's row prints ``missing``) while the kernel is not written."""
    if importlib.util.find_spec(module) is None:
        raise NotImplementedError(f"{module} does not exist")
    mod = importlib.import_module(module)
    for name in names:
        if not hasattr(mod, name):
            raise NotImplementedError(f"{module}.{name} does not exist")
    return mod


def stage_cycles(stage: str, p_rows: int, tp: int, requests: int, depth: int = DEPTH,
                 logit_rows: int | None = None) -> int | None:
    """Run one stage's kernel in cost-model-only mode (this runs in a child process); query rows ``depth``
    positions deep, ``logit_rows`` the head's rows (default one per request)."""
    import ml_dtypes

    c = FLASH
    local = p_rows // tp
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    x, d, h, q, g, ro = c.hidden_size, c.head_dim, c.num_attention_heads, c.q_lora_rank, c.o_groups, c.o_lora_rank
    rd, hc = c.qk_rope_head_dim, c.hc_mult
    # query rows sit past DEPTH, request by request (the rank's rows of the packed group)
    q_pos = depth + np.arange(local, dtype=np.int32) % max(1, p_rows // requests)
    q_req = (np.arange(local) * requests // max(1, local)).astype(np.int32)
    if stage == "lowering":
        from dspark_kernels.pypto.lowering import run_lowering

        qsl = np.linspace(0, p_rows, requests + 1).astype(np.int32)
        return run_lowering(qsl, local, local).cycles
    if stage in ("hc_pre", "hc_post"):
        from dspark_kernels.pypto import hyper_connections as hcm

        x_hc = np.zeros((p_rows, hc, x), np.float32)
        if stage == "hc_post":
            return hcm.run_hc_post(np.zeros((p_rows, x), np.float32), x_hc, np.zeros((p_rows, hc), np.float32),
                                   np.zeros((p_rows, hc, hc), np.float32)).cycles
        m = (2 + hc) * hc  # the hardware form of the mix chain (one matmul per K slice), as on an NPU
        return hcm.run_hc_pre(x_hc, np.zeros((m, hc * x), np.float32), np.ones(3, np.float32), np.zeros(m, np.float32),
                              eps=c.hc_eps, norm_eps=c.rms_norm_eps, iters=c.hc_sinkhorn_iters,
                              k_step=hcm.slice_width(hc * x), norm=np.ones(x, np.float32)).cycles
    if stage == "shared_kv":
        from dspark_kernels.pypto.projections import run_shared_kv

        return run_shared_kv(np.zeros((p_rows, x), bf), np.zeros((d, x), bf), np.ones(d, np.float32),
                             np.ones((p_rows, rd // 2), bf), np.zeros((p_rows, rd // 2), bf), c.rms_norm_eps).cycles
    if stage == "query":
        from dspark_kernels.pypto.projections import run_query

        return run_query(np.zeros((local, x), bf), np.zeros((q, x), bf), np.ones(q, np.float32),
                         np.zeros((h * d, q), np.int8), np.ones(h * d, np.float32), np.ones((local, rd // 2), bf),
                         np.zeros((local, rd // 2), bf), h, c.rms_norm_eps).cycles
    if stage.endswith("scatter"):
        from dspark_kernels.pypto.paged import run_scatter

        n, width, dtype = _scatter_geometry(stage, p_rows)
        return run_scatter(np.zeros((max(n, 64 * KV_PAGE_SIZE), width), dtype), np.zeros((n, width), dtype),
                           np.arange(n, dtype=np.int64)).cycles
    if stage == "window":
        from dspark_kernels.pypto.window import run_window

        ori = c.layout.pools["ori"]
        width = table_columns(ori)
        table = rng.permutation(requests * width).astype(np.int32).reshape(requests, width)
        return run_window(np.arange(local, dtype=np.int32) + 1000, np.zeros(local, np.int32), table,
                          c.sliding_window, ring=ori.is_ring).cycles
    if stage in ("cmp4_state", "cmp128_state", "idx_state"):
        from dspark_kernels.pypto.compressor import run_state_rows

        ratio = 128 if stage == "cmp128_state" else 4
        width = coff(ratio) * (c.index_head_dim if stage == "idx_state" else d)
        return run_state_rows(np.zeros((p_rows, x), bf), np.zeros((width, x), bf), np.zeros((width, x), bf),
                              np.zeros((ratio, width), np.float32), np.arange(p_rows, dtype=np.int32)).cycles
    if stage in ("cmp4_pool", "cmp128_pool", "idx_cmp_pool"):
        from dspark_kernels.pypto.compressor import run_pool

        ratio = 128 if stage == "cmp128_pool" else 4
        dim = c.index_head_dim if stage == "idx_cmp_pool" else d
        pool = "hca_state" if ratio == 128 else ("csa_inner_state" if stage == "idx_cmp_pool" else "csa_state")
        layout = c.layout.pools[pool]
        b = boundaries(p_rows, ratio)
        positions = np.arange(1, b + 1, dtype=np.int32) * ratio - 1 + 1024  # one window each
        table = np.arange(requests * table_columns(layout), dtype=np.int32).reshape(requests, -1) % 256
        state = np.zeros((256 * layout.page_size, 2 * coff(ratio) * dim), np.float32)
        hadamard = np.zeros((dim, dim), np.float32) if stage == "idx_cmp_pool" else None
        return run_pool(positions, np.zeros(b, np.int32), table, state, np.ones(dim, np.float32),
                        np.ones((b, rd // 2), bf), np.zeros((b, rd // 2), bf), ratio=ratio,
                        page=layout.page_size, eps=c.rms_norm_eps, ring=layout.is_ring, hadamard=hadamard).cycles
    if stage in ("idx_candidates", "csa_entry_rows", "hca_entry_rows"):
        from dspark_kernels.pypto.entry_rows import run_entry_rows

        pool = {"idx_candidates": "idx", "csa_entry_rows": "csa_cmp", "hca_entry_rows": "hca_cmp"}[stage]
        layout = c.layout.pools[pool]
        table = np.arange(requests * table_columns(layout), dtype=np.int32).reshape(requests, -1)
        if stage == "csa_entry_rows":  # the indexer's top-k: distinct visible entries per row
            top = np.tile(np.arange(c.index_topk, dtype=np.int32), (local, 1))
            return run_entry_rows(q_pos, q_req, table, top, ring=layout.is_ring).cycles
        ratio, columns = ((INDEX_RATIO, index_candidates(depth)) if stage == "idx_candidates"
                          else (HCA_RATIO, hca_entries(depth)))
        return run_entry_rows(q_pos, q_req, table, None, ring=layout.is_ring, ratio=ratio, columns=columns).cycles
    if stage == "indexer":
        from dspark_kernels.model.plan import IndexKeyPools, RopeRows
        from dspark_kernels.pypto.indexer import IndexerWeights, run_indexer

        hi, di, k = c.index_n_heads, c.index_head_dim, c.index_topk
        n_cand = index_candidates(depth)
        cand = np.tile(np.arange(n_cand, dtype=np.int32), (local, 1))
        weights = IndexerWeights(np.zeros((hi * di, q), np.int8), np.ones(hi * di, np.float32), np.zeros((hi, x), bf),
                                 np.zeros((di, di), bf), hi, c.index_weight_scale)
        return run_indexer((np.zeros((local, q), np.int8), np.ones((local, 1), np.float32)), np.zeros((local, x), bf),
                           weights, RopeRows(np.ones((local, rd // 2), bf), np.zeros((local, rd // 2), bf)),
                           IndexKeyPools(np.zeros((n_cand, di), np.int8), np.ones(n_cand, np.float32)), cand,
                           topk=k).cycles
    if stage.startswith("sparse_attn_"):
        from dspark_kernels.pypto.sparse_attention import run_sparse_attention

        w_rows = np.tile(np.arange(c.sliding_window, dtype=np.int32), (local, 1))
        k = {"sparse_attn_csa": c.index_topk, "sparse_attn_hca": hca_entries(depth), "sparse_attn_swa": 0}[stage]
        cmp_rows = np.tile(np.arange(k, dtype=np.int32), (local, 1)) if k else None
        return run_sparse_attention(np.zeros((local, h, d), bf), w_rows, cmp_rows, np.zeros((4096, d), bf),
                                    np.zeros((max(4096, k), d), bf) if k else None, np.zeros(h, np.float32),
                                    np.ones((local, rd // 2), bf), np.zeros((local, rd // 2), bf),
                                    scale=c.softmax_scale).cycles
    if stage == "draft_attn":  # each request's W ring rows, then its B block rows as the second key set
        from dspark_kernels.pypto.sparse_attention import run_sparse_attention

        b = FLASH_DSPARK.dspark_block_size
        row_request = np.arange(local) * requests // max(1, local)
        ring_rows = (row_request[:, None] * c.sliding_window + np.arange(c.sliding_window)).astype(np.int32)
        own_rows = (row_request[:, None] * b + np.arange(b)).astype(np.int32)
        return run_sparse_attention(np.zeros((local, h, d), bf), ring_rows, own_rows,
                                    np.zeros((requests * c.sliding_window, d), bf), np.zeros((requests * b, d), bf),
                                    np.zeros(h, np.float32), np.ones((local, rd // 2), bf),
                                    np.zeros((local, rd // 2), bf), scale=c.softmax_scale).cycles
    if stage in ("markov", "confidence", "main_x"):
        return _drafter_cycles(stage, p_rows, requests)
    if stage == "o_proj":
        from dspark_kernels.pypto.o_proj import run_o_proj

        return run_o_proj(np.zeros((local, h * d), bf), np.zeros((g * ro, h * d // g), bf),
                          np.zeros((x, g * ro), np.int8), np.ones(x, np.float32), g).cycles
    if stage.startswith("moe_"):
        return _moe_cycles(stage, local)
    if stage in ("hc_head", "final_hidden", "lm_head", "greedy"):
        return _head_cycles(stage, p_rows, tp, requests, logit_rows)
    raise ValueError(stage)


def _drafter_cycles(stage: str, p_rows: int, requests: int) -> int | None:
    """The drafter's own kernels at FLASH-DSpark sizes: the Markov head over R requests' B block rows (one call),
    the confidence head over the P block rows, ``main_x`` over P observed rows."""
    import ml_dtypes

    c, bf = FLASH_DSPARK, ml_dtypes.bfloat16
    x, v, rank, b = c.hidden_size, c.vocab_size, c.dspark_markov_rank, c.dspark_block_size
    if stage == "main_x":
        from dspark_kernels.pypto.projections import run_linear_norm

        width = len(c.dspark_target_layers) * x
        return run_linear_norm(np.zeros((p_rows, width), bf), np.zeros((x, width), bf), np.ones(x, np.float32),
                               c.rms_norm_eps).cycles
    from dspark_kernels.pypto.markov import run_confidence, run_markov

    w1 = np.zeros((v, rank), np.float32)
    if stage == "markov":
        return run_markov(np.zeros((requests, b, v), np.float32), np.zeros(requests, np.int64), w1, w1).cycles
    return run_confidence(np.zeros((p_rows, x), np.float32), np.zeros(p_rows, np.int64), w1,
                          np.zeros(x + rank, np.float32)).cycles


def _scatter_geometry(stage: str, p_rows: int) -> tuple[int, int, Any]:
    """(rows written, row width, dtype) of a scatter stage: the pool rows each kernel call writes."""
    import ml_dtypes

    c, bf = FLASH, ml_dtypes.bfloat16
    d, di = c.head_dim, c.index_head_dim
    return {
        "ori_scatter": (p_rows, d, bf),
        "cmp4_state_scatter": (p_rows, 2 * coff(4) * d, np.float32),
        "idx_state_scatter": (p_rows, 2 * coff(4) * di, np.float32),
        "cmp128_state_scatter": (p_rows, 2 * coff(128) * d, np.float32),
        "cmp4_entry_scatter": (boundaries(p_rows, 4), d, bf),
        "cmp128_entry_scatter": (boundaries(p_rows, 128), d, bf),
        "idx_scatter": (boundaries(p_rows, 4), di, np.int8),
        "idx_scale_scatter": (boundaries(p_rows, 4), 32 // 4, np.float32),  # one fp32 per row, padded to 32 B
    }[stage]


def uniform_routing(tokens: int, seed: int = 0) -> np.ndarray:
    """[T, k] int64 expert ids: each row picks ``num_experts_per_tok`` distinct of the E experts uniformly."""
    m = FLASH.moe
    keys = np.random.default_rng(seed).random((tokens, m.n_routed_experts))
    return np.argsort(keys, axis=1)[:, : m.num_experts_per_tok].astype(np.int64)


def routed_tiles(rows: int) -> int:
    """Expert tiles (:data:`dspark_kernels.pypto.moe.PAIR_TILE` pair rows each) of :func:`uniform_routing`."""
    moe = _require("dspark_kernels.pypto.moe", "ExpertTiles")
    k = FLASH.moe.num_experts_per_tok
    tiles = moe.ExpertTiles.build(uniform_routing(rows), np.full((rows, k), 1.0 / k, np.float32),
                                  FLASH.moe.n_routed_experts)
    return len(tiles.tile_expert)


def _moe_cycles(stage: str, rows: int, stacks: int = EXPERT_STACKS) -> int | None:
    """The MoE's kernels over L rows (a learned-gate layer); the experts over the uniform routing's tiles."""
    import attrs

    moe = _require("dspark_kernels.pypto.moe", "launch_gate", "launch_experts", "ExpertTiles", "Int8Experts")
    c, m = FLASH, FLASH.moe
    x, inter, e, k = c.hidden_size, m.moe_intermediate_size, m.n_routed_experts, m.num_experts_per_tok
    if stage == "moe_gate":
        return moe.launch_gate(np.zeros((rows, x), np.float32), np.ones(x, np.float32), np.zeros((e, x), np.float32),
                               np.zeros(e, np.float32), None, None, slots=k, eps=c.rms_norm_eps,
                               route_scale=m.routed_scaling_factor, renormalise=m.norm_topk_prob)[-1]
    routed = moe.ExpertTiles.build(uniform_routing(rows), np.full((rows, k), 1.0 / k, np.float32), e)
    u = min(stacks, len(routed.experts))
    routed = attrs.evolve(routed, tile_expert=(routed.tile_expert % u).astype(np.int32), experts=routed.experts[:u])
    si = m.n_shared_experts * inter
    shared = (np.zeros((si, x), np.int8), np.ones((1, si), np.float32), np.zeros((si, x), np.int8),
              np.ones((1, si), np.float32), np.zeros((x, si), np.int8), np.ones((1, x), np.float32)) if si else None
    w = moe.Int8Experts(np.zeros((u * inter, x), np.int8), np.ones((u, inter), np.float32),
                        np.zeros((u * inter, x), np.int8), np.ones((u, inter), np.float32),
                        np.zeros((u * x, inter), np.int8), np.ones((u, x), np.float32), shared)
    return moe.launch_experts(np.zeros((rows, x), np.int8), np.ones(rows, np.float32), routed, w, slots=k,
                              limit=float(m.swiglu_limit))[-1]


def _price(stage: str, p_rows: int, tp: int, requests: int, depth: int = DEPTH, logit_rows: int | None = None
           ) -> tuple[int | None, str]:
    """(cycles, note) of one stage from a child process."""
    from benchmarks.bench_pypto import stage_cycles as child  # run_isolated needs a function by import path

    note = f"{routed_tiles(p_rows // tp)} expert tiles" if stage == "moe_experts" else ""
    return run_isolated(child, stage, p_rows, tp, requests, depth, logit_rows, timeout=STAGE_TIMEOUT_S), note


def _head_cycles(stage: str, p_rows: int, tp: int, requests: int, logit_rows: int | None = None) -> int | None:
    """The head kernels: over all P rows (hc_head, final_hidden) or the M logit rows (default M = R, each
    request's last row; M = P: every row, as a verify step and a draft need)."""
    import attrs

    c = FLASH
    x, hc, v = c.hidden_size, c.hc_mult, c.vocab_size
    mixer = attrs.make_class("Mixer", ["fn", "scale", "base"])(np.zeros((hc, hc * x), np.float32),
                                                               np.ones(1, np.float32), np.zeros(hc, np.float32))
    x_hc = np.zeros((p_rows, hc, x), np.float32)
    if stage == "hc_head":
        hcm = _require("dspark_kernels.pypto.hyper_connections", "run_hc_head")
        return hcm.run_hc_head(x_hc, mixer, eps=c.hc_eps, norm_eps=c.rms_norm_eps).cycles
    head = _require("dspark_kernels.pypto.head", "run_final_hidden", "run_logits", "run_greedy")
    if stage == "final_hidden":
        weights = attrs.make_class("Head", ["hc", "norm"])(mixer, np.ones(x, np.float32))
        return head.run_final_hidden(x_hc, weights, eps=c.hc_eps, norm_eps=c.rms_norm_eps).cycles
    if logit_rows is None:
        rows = (np.arange(requests) + 1) * (p_rows // requests) - 1  # each request's last row
    else:
        rows = np.linspace(0, p_rows - 1, logit_rows).astype(np.int64)
    if stage == "lm_head":
        return head.run_logits(np.zeros((p_rows, x), np.float32), rows, np.zeros((-(-v // tp), x), np.float32)).cycles
    return head.run_greedy(np.zeros((rows.size, v), np.float32), rows).cycles


def stage_roofline(stage: str, p_rows: int, tp: int, requests: int, depth: int = DEPTH,
                   logit_rows: int | None = None) -> float:
    c = FLASH
    n_cand, n_hca = index_candidates(depth), hca_entries(depth)
    m_rows = requests if logit_rows is None else logit_rows
    local = p_rows // tp
    x, d, h, q, g, ro = c.hidden_size, c.head_dim, c.num_attention_heads, c.q_lora_rank, c.o_groups, c.o_lora_rank
    w = c.sliding_window
    table = requests * table_columns(c.layout.pools["ori"])
    hi, di, k = c.index_n_heads, c.index_head_dim, c.index_topk
    rd, hc = c.qk_rope_head_dim, c.hc_mult
    kh = hc * x  # hc streams of the hidden size
    mix = -(-(2 + hc) * hc // 16) * 16  # hc_pre's mix rows, padded to the cube's 16

    def state_rows(width: int, ratio: int) -> float:
        return roofline(2 * 2 * p_rows * x * width, 0, 2 * p_rows * x + 2 * 2 * width * x + 4 * ratio * width
                        + 4 * p_rows + 4 * p_rows * 2 * width)

    def pool(ratio: int, dim: int, index: bool) -> float:
        b, slots = boundaries(p_rows, ratio), (8 if ratio == 4 else ratio)
        out = b * dim + 4 * b + 2 * dim * dim if index else 2 * b * dim  # int8 + scale (+ Hadamard) or bf16
        # each slot reads its kv and score halves (2 * dim fp32), plus table entries, norm and rope rows
        return roofline(2 * b * dim * dim if index else 0, 0,
                        4 * b * slots * 2 * dim + 4 * b * (2 + slots) + 4 * dim + 2 * b * rd + out)

    def attention(keys: int) -> float:
        return roofline(2 * 2 * local * h * d * (w + keys), 0,
                        2 * local * h * d * 2 + 2 * local * (w + keys) * d + 4 * local * (w + keys) + 4 * h
                        + 2 * local * rd)

    def scatter() -> float:
        n, width, dtype = _scatter_geometry(stage, p_rows)
        return roofline(0, 0, 2 * n * width * np.dtype(dtype).itemsize + 4 * n)

    def entry_rows(columns: int, given: bool) -> float:
        # positions + request ids, each request's table pages once, (given entries), the rows written
        pages = requests * -(-columns // KV_PAGE_SIZE)
        return roofline(0, 0, 8 * local + 4 * pages + (4 * local * columns if given else 0) + 4 * local * columns)

    if stage.endswith("scatter"):
        return scatter()
    fixed = {
        "lowering": lambda: roofline(0, 0, 4 * (requests + 1) + 4 + 4 * local),
        "hc_pre": lambda: roofline(2 * p_rows * kh * mix, 0, 4 * p_rows * kh + 4 * mix * kh + 8 * mix
                                   + 2 * p_rows * x + 4 * p_rows * (hc + hc * hc)),
        "hc_post": lambda: roofline(0, 0, 2 * p_rows * x + 8 * p_rows * kh + 4 * p_rows * (hc + hc * hc)),
        "shared_kv": lambda: roofline(2 * p_rows * x * d, 0,
                                      2 * (p_rows * x + d * x + p_rows * d) + 4 * d + 4 * p_rows * 64),
        "query": lambda: roofline(2 * local * x * q, 2 * local * q * h * d,
                                  2 * local * x + 2 * q * x + h * d * q + 4 * h * d + 2 * local * h * d
                                  + local * q + 4 * local),
        "window": lambda: roofline(0, 0, 8 * local + 4 * table + 4 * local * w),
        "cmp4_state": lambda: state_rows(coff(4) * d, 4),
        "cmp128_state": lambda: state_rows(coff(128) * d, 128),
        "idx_state": lambda: state_rows(coff(4) * di, 4),
        "cmp4_pool": lambda: pool(4, d, False),
        "cmp128_pool": lambda: pool(128, d, False),
        "idx_cmp_pool": lambda: pool(4, di, True),
        "idx_candidates": lambda: entry_rows(n_cand, False),
        "csa_entry_rows": lambda: entry_rows(k, True),
        "hca_entry_rows": lambda: entry_rows(n_hca, False),
        "indexer": lambda: roofline(2 * local * hi * di * di + 2 * local * x * hi,
                                    2 * local * q * hi * di + 2 * local * hi * di * n_cand,
                                    local * q + 4 * local + hi * di * q + 4 * hi * di + 2 * local * x + 2 * hi * x
                                    + 2 * local * rd + 2 * di * di + requests * n_cand * (di + 4)
                                    + 4 * local * n_cand + 4 * local * k),
        "sparse_attn_swa": lambda: attention(0),
        "sparse_attn_csa": lambda: attention(k),
        "sparse_attn_hca": lambda: attention(n_hca),
        "draft_attn": lambda: attention(FLASH_DSPARK.dspark_block_size),
        "markov": lambda: _markov_roofline(requests),
        "confidence": lambda: roofline(0, 0, 4 * p_rows * x + 2 * p_rows * FLASH_DSPARK.dspark_markov_rank
                                       + 4 * (x + FLASH_DSPARK.dspark_markov_rank) + 8 * p_rows),
        "main_x": lambda: _main_x_roofline(p_rows),
        "o_proj": lambda: roofline(2 * local * h * d * ro, 2 * local * g * ro * x,
                                   2 * local * h * d + 2 * g * ro * (h * d // g) + x * g * ro + 4 * x
                                   + 2 * local * x),
        "moe_gate": lambda: roofline(2 * local * x * c.moe.n_routed_experts, 0,
                                     2 * local * x + 4 * c.moe.n_routed_experts * (x + 1) + local * x
                                     + 4 * local + 8 * local * c.moe.num_experts_per_tok),
        "moe_experts": lambda: _experts_roofline(local),
        "hc_head": lambda: roofline(2 * p_rows * kh * hc, 0, 4 * p_rows * kh + 4 * hc * kh + 2 * p_rows * x),
        "final_hidden": lambda: roofline(2 * p_rows * kh * hc, 0, 4 * p_rows * kh + 4 * hc * kh + 4 * x
                                         + 2 * p_rows * x),
        "lm_head": lambda: _lm_head_roofline(m_rows, tp),
        "greedy": lambda: roofline(0, 0, 4 * m_rows * c.vocab_size + 8 * m_rows),
    }
    return fixed[stage]()


def expected_experts(tokens: int) -> float:
    """Distinct routed experts ``tokens`` rows touch when each picks ``num_experts_per_tok`` of ``E`` uniformly
    (the expert weights a call must read): ``E * (1 - (1 - k/E) ** tokens)``."""
    e, k = FLASH.moe.n_routed_experts, FLASH.moe.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def _experts_roofline(tokens: int) -> float:
    """k routed + the shared experts per row (int8 W8A8: w1, w3 [I, X], w2 [X, I], fp32 per-channel scales);
    bytes: the weights of every expert the rows touch (uniform routing), int8 rows in, bf16 rows out."""
    c, m = FLASH, FLASH.moe
    x, inter, k = c.hidden_size, m.moe_intermediate_size, m.num_experts_per_tok
    per_expert = 3 * inter * x + 4 * (2 * inter + x)
    experts = expected_experts(tokens) + m.n_shared_experts
    return roofline(0, 2 * tokens * (k + m.n_shared_experts) * 3 * inter * x,
                    experts * per_expert + tokens * (x + 4) + 2 * tokens * x)


def _markov_roofline(requests: int) -> float:
    """B steps of R rows: the [R, r] x [r, V] bias product each (bf16 markov_w2 read once), the base logits read
    and the ids written once, the gathered markov_w1 rows."""
    c = FLASH_DSPARK
    b, v, rank = c.dspark_block_size, c.vocab_size, c.dspark_markov_rank
    return roofline(2 * b * requests * rank * v, 0, 2 * v * rank + 4 * b * requests * v + 2 * b * requests * rank
                    + 4 * requests + 4 * b * requests)


def _main_x_roofline(rows: int) -> float:
    """[P, T*D] x [D, T*D]^T in bf16 and the norm: features, main_proj and main_x once."""
    c = FLASH_DSPARK
    x, width = c.hidden_size, len(c.dspark_target_layers) * c.hidden_size
    return roofline(2 * rows * width * x, 0, 2 * (rows * width + x * width + rows * x) + 4 * x)


def _lm_head_roofline(rows: int, tp: int) -> float:
    """One vocabulary shard's bf16 weights against the logit rows (fp32 logits out)."""
    c = FLASH
    shard = -(-c.vocab_size // tp)
    return roofline(2 * rows * c.hidden_size * shard, 0, 2 * shard * c.hidden_size + 2 * rows * c.hidden_size
                    + 4 * rows * shard)


# ---------------------------------------------------------------------------------------------------------------
# runs, sums, printing


#: Stages whose kernel shapes or inputs involve the request count R (tables, request ids, logit rows); the others
#: compile the same kernel for any R at a given P, so a second table at the same P reuses their cycles.
REQUEST_DEPENDENT = frozenset({"lowering", "window", "cmp4_pool", "cmp128_pool", "idx_cmp_pool", "idx_candidates",
                               "csa_entry_rows", "hca_entry_rows", "lm_head", "greedy"})


def _failure(exc: BaseException) -> str:
    """A short reason for a failed stage: the compiler's or the child's own error line where there is one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    keys = [line for line in lines if "exceeds" in line or "Error:" in line or "Errcode" in line]
    return (keys[0] if keys else lines[0] if lines else type(exc).__name__)[:160]


def measure(stages: list[str], p_rows: int, tp: int, requests: int, title: str,
            same_p: dict[str, dict[str, Any]] | None = None,
            earlier: dict[str, dict[str, Any]] | None = None, depth: int = DEPTH,
            logit_rows: int | None = None) -> dict[str, dict[str, Any]]:
    """Cost-model cycles (child processes) and rooflines of ``stages`` at one geometry; prints the table.

    same_p: a table at the same P (another R): its cycles are reused for the stages outside
    :data:`REQUEST_DEPENDENT` (rooflines are recomputed).
    earlier: the same geometry's table from an earlier run (``--reuse``): its cycles are taken for every stage
    it priced (the stages to run again are left out of it by the caller).
    """
    print(f"\n{title}: FLASH, P={p_rows} rows, TP={tp} (L={p_rows // tp}), R={requests} requests")
    print(f"{'stage':<22} {'rows':>5} {'cost-model cycles':>18} {'roofline cycles':>16} {'ratio':>8} {'wall s':>7}")
    out: dict[str, dict[str, Any]] = {}
    for stage in stages:
        start = time.perf_counter()
        if earlier is not None and stage in earlier:
            kept_note = earlier[stage]["note"].removeprefix("(earlier run) ")  # a reused file keeps one mark
            cycles, note = earlier[stage]["cycles"], f"(earlier run) {kept_note}"
        elif same_p is not None and stage in same_p and stage not in REQUEST_DEPENDENT:
            kept = same_p[stage]
            cycles, note = kept["cycles"], f"(the R={kept['requests']} kernel) {kept['note']}"
        else:
            try:
                cycles, note = _price(stage, p_rows, tp, requests, depth, logit_rows)
            except NotImplementedError as exc:
                cycles, note = None, f"missing ({exc})"
            except Exception as exc:  # a failing stage is reported in its row; the others still run
                cycles, note = None, f"failed: {_failure(exc)}"
        wall = time.perf_counter() - start
        roof = stage_roofline(stage, p_rows, tp, requests, depth, logit_rows)
        rows = stage_rows(stage, p_rows, tp, requests, logit_rows)
        ratio = f"{cycles / roof:8.1f}" if cycles else "     n/a"
        shown = f"{cycles:>18,}" if cycles else f"{'n/a':>18}"
        print(f"{stage:<22} {rows:>5} {shown} {roof:>16,.0f} {ratio} {wall:>7.1f} {note}", flush=True)
        out[stage] = {"rows": rows, "requests": requests, "cycles": cycles, "roofline": roof, "note": note}
    return out


def _sum(table: dict[str, dict[str, Any]], calls: tuple[tuple[str, int], ...], p_rows: int
         ) -> tuple[float, float, list[str]]:
    """(cycles, roofline cycles, stages without cycles) of a list of (stage, calls)."""
    cycles = roof = 0.0
    missing = []
    for stage, n in calls:
        weight = n * stage_weight(stage, p_rows)
        row = table.get(stage)
        if row is None or row["cycles"] is None:
            missing.append(stage)
        else:
            cycles += weight * row["cycles"]
        roof += weight * (row["roofline"] if row else 0.0)
    return cycles, roof, missing


def layer_sums(table: dict[str, dict[str, Any]], p_rows: int) -> dict[str, dict[str, Any]]:
    """Whole-layer cycles per layer kind at one geometry; prints them."""
    print(f"whole layer per die (every kernel call of one layer at P={p_rows}):")
    print(f"{'layer':<6} {'cost-model cycles':>18} {'roofline cycles':>16} {'ratio':>7}  {'us':>8}  missing")
    sums = {}
    for kind, calls in LAYER_STAGES.items():
        cycles, roof, missing = _sum(table, calls, p_rows)
        sums[kind] = {"cycles": cycles, "roofline": roof, "missing": missing}
        print(f"{kind:<6} {cycles:>18,.0f} {roof:>16,.0f} {cycles / roof:>7.1f}  {cycles / CUBE_MHZ:>8.0f}  "
              f"{', '.join(missing) or '-'}")
    return sums


def forward_cycles(table: dict[str, dict[str, Any]], sums: dict[str, dict[str, Any]], p_rows: int
                   ) -> tuple[float, float, list[str]]:
    """(cycles, roofline cycles, missing stages) of one forward call: the FLASH schedule's layers (``sums``, one
    entry per layer kind) + the head and stage 1 (``table``)."""
    kinds = [FLASH.layer_kind(i) for i in range(FLASH.num_layers)]
    once_cycles, once_roof, once_missing = _sum(table, FORWARD_ONCE, p_rows)
    cycles = once_cycles + sum(sums[k]["cycles"] for k in kinds)
    roof = once_roof + sum(sums[k]["roofline"] for k in kinds)
    return cycles, roof, sorted(set(once_missing).union(*(sums[k]["missing"] for k in set(kinds))))


def forward_estimate(table: dict[str, dict[str, Any]], sums: dict[str, dict[str, Any]], p_rows: int, tp: int,
                     tokens: int = FORWARD_TOKENS, requests: int | None = None) -> dict[str, Any]:
    """The whole forward for ``tokens`` as tokens / P calls of P rows (``table`` / ``sums`` at P), and the roofline
    of one call of all ``tokens`` rows (``requests`` requests: default ``tokens / PACK_TOKENS``)."""
    cycles, roof, missing = forward_cycles(table, sums, p_rows)
    calls = math.ceil(tokens / p_rows)
    per_s = CUBE_MHZ * 1e6
    rate = tokens / (calls * cycles / per_s) / tp
    peak = tokens / (calls * roof / per_s) / tp
    big_r = max(1, tokens // PACK_TOKENS) if requests is None else requests
    one = {s: {"cycles": None, "roofline": stage_roofline(s, tokens, tp, big_r)} for s in STAGES}
    one_sums = {k: dict(zip(("cycles", "roofline", "missing"), _sum(one, calls_k, tokens), strict=True))
                for k, calls_k in LAYER_STAGES.items()}
    one_roof = forward_cycles(one, one_sums, tokens)[1]
    one_peak = tokens / (one_roof / per_s) / tp
    kinds = [FLASH.layer_kind(i) for i in range(FLASH.num_layers)]
    schedule = " + ".join(f"{kinds.count(k)} {k.upper()}" for k in LAYER_STAGES)
    print(f"\nwhole forward, N={tokens} tokens as {calls} call(s) of P={p_rows} rows, TP={tp} "
          f"({schedule} layers + head, stage 1 once per call; cube clock {CUBE_MHZ:.0f} MHz):")
    print(f"  cycles per call {cycles:,.0f} (roofline {roof:,.0f}, ratio {cycles / roof:.1f}); "
          f"{calls * cycles / CUBE_MHZ / 1e3:,.1f} ms for N tokens")
    print(f"  tokens/s per die: {rate:,.0f} (cost model)   roofline peak: {peak:,.0f}   "
          f"missing: {', '.join(missing) or '-'}")
    print(f"  roofline peak of one call of all {tokens} rows (R={big_r}): {one_peak:,.0f} tokens/s per die "
          f"({one_roof:,.0f} cycles)")
    return {"calls": calls, "cycles_per_call": cycles, "roofline_per_call": roof, "tokens_per_s_per_die": rate,
            "roofline_tokens_per_s_per_die": peak, "missing": missing,
            "one_call_roofline": one_roof, "one_call_roofline_tokens_per_s_per_die": one_peak}


def packing(chunk: dict[str, dict[str, Any]], single: dict[str, dict[str, Any]], chunk_rows: int,
            requests: int = PACK_REQUESTS, tokens: int = PACK_TOKENS) -> dict[str, Any]:
    """Whole layer: ``requests`` x ``tokens`` rows packed, as calls of ``chunk_rows`` rows (``chunk``'s table;
    one call when ``chunk_rows`` holds them all), against ``requests`` calls of one request (``single``)."""
    calls = max(1, requests * tokens // chunk_rows)
    how = "one call" if calls == 1 else f"{calls} calls of P={chunk_rows} ({chunk_rows // tokens} requests each)"
    print(f"\npacking: {requests} requests x {tokens} tokens packed ({how}) vs {requests} calls of one request "
          f"(P={tokens}), whole layer, cycles per die:")
    print(f"{'layer':<6} {'packed':>14} {f'{requests} x single':>16} {'single/packed':>14}  missing")
    out = {}
    for kind, layer in LAYER_STAGES.items():
        one, _, miss_p = _sum(chunk, layer, chunk_rows)
        each, _, miss_s = _sum(single, layer, tokens)
        packed, separate = calls * one, requests * each
        ratio = separate / packed if packed else float("nan")
        missing = sorted(set(miss_p) | set(miss_s))
        out[kind] = {"packed": packed, "separate": separate, "ratio": ratio, "missing": missing, "calls": calls}
        print(f"{kind:<6} {packed:>14,.0f} {separate:>16,.0f} {ratio:>14.2f}  {', '.join(missing) or '-'}")
    return out


#: One draft + verify round (``--round``): requests, drafts per verify step K and the context every request has.
ROUND_REQUESTS, ROUND_DRAFTS, ROUND_CONTEXT = 64, 5, 65536
#: Kernel calls of one drafter stage (a V4 block: hc_pre / hc_post around attention and around the MoE; the
#: block rows' keys are the target's shared kv kernel) and of the drafter's head over every block row (hc_head for
#: the confidence head's input, hc_head + RMSNorm, then the LM head's vocabulary shard).
DRAFT_STAGE_CALLS = (("hc_pre", 2), ("shared_kv", 1), ("query", 1), ("draft_attn", 1), ("o_proj", 1),
                     ("hc_post", 2), ("moe_gate", 1), ("moe_experts", 1))
DRAFT_HEAD_CALLS = (("hc_head", 1), ("final_hidden", 1), ("lm_head", 1), ("markov", 1), ("confidence", 1))
#: Kernel calls of the drafter's observe of a round's accepted rows (at most K + 1 per request): ``main_x`` and
#: each stage's window keys, the target's shared kv kernel at the verify step's rows (its cycles are the verify
#: table's: the same kernel at the same P).
OBSERVE_CALLS = (("main_x", 1), ("shared_kv", FLASH_DSPARK.n_mtp_layers))
#: Per-round work no kernel prices: the FP8 step of the drafter's keys (the window keys of the observed rows and
#: the block rows' own keys; on the host, as no a2a3 kernel has it) and the all-gathers.
ROUND_UNPRICED = ("the FP8 step of the drafter's window and block keys (host)",)


def round_geometries(requests: int = ROUND_REQUESTS, drafts: int = ROUND_DRAFTS) -> dict[str, list[int]]:
    """{"draft": [P, R], "verify": [P, R], "observe": [P, R]} of one round: R x B block rows, R x (1 + K) verify
    rows, and as many observed rows (every draft accepted: the most the drafter observes)."""
    return {"draft": [requests * FLASH_DSPARK.dspark_block_size, requests],
            "verify": [requests * (1 + drafts), requests], "observe": [requests * (1 + drafts), requests]}


def draft_round(tp: int, requests: int = ROUND_REQUESTS, drafts: int = ROUND_DRAFTS, context: int = ROUND_CONTEXT,
                earlier: dict[tuple[int, int], dict[str, dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Cost-model cycles of one speculative round at FLASH sizes: the drafter's stages and head over R x B block
    rows, then the target's verify step over R x (1 + K) rows ``context`` positions deep (every layer of the
    FLASH schedule, the head over every row, hc_head after each DSpark target layer); per die of a TP group.
    earlier: an earlier ``--round --json`` run's tables by (P, R) (``--reuse``)."""
    b, stages = FLASH_DSPARK.dspark_block_size, FLASH_DSPARK.n_mtp_layers
    geometry = round_geometries(requests, drafts)
    (p_draft, _), (p_verify, _), (p_observe, _) = geometry["draft"], geometry["verify"], geometry["observe"]
    old = earlier or {}
    draft_names = sorted({n for n, _ in DRAFT_STAGE_CALLS + DRAFT_HEAD_CALLS}, key=list(LABELS).index)
    draft = measure(draft_names, p_draft, tp, requests,
                    f"draft: {stages} drafter stages + head, R={requests} x B={b} block rows",
                    earlier=old.get((p_draft, requests)), depth=context, logit_rows=p_draft)
    verify = measure(list(STAGES), p_verify, tp, requests,
                     f"verify: R={requests} x (1 + K={drafts}) rows, {context} positions deep",
                     earlier=old.get((p_verify, requests)), depth=context, logit_rows=p_verify)
    observe = measure(["main_x"], p_observe, tp, requests,
                      f"observe: main_x of R={requests} x (1 + K={drafts}) accepted rows (the keys: the verify "
                      f"table's shared kv)", earlier=old.get((p_observe, requests)), depth=context)
    observed = {**observe, "shared_kv": verify["shared_kv"]}
    per_stage = [(f"draft stage x{stages}", stages, _sum(draft, DRAFT_STAGE_CALLS, p_draft)),
                 ("draft head", 1, _sum(draft, DRAFT_HEAD_CALLS, p_draft))]
    sums = layer_sums(verify, p_verify)
    kinds = [FLASH.layer_kind(i) for i in range(FLASH.num_layers)]
    per_stage += [(f"verify {k.upper()} layer x{kinds.count(k)}", kinds.count(k),
                   (sums[k]["cycles"], sums[k]["roofline"], sums[k]["missing"])) for k in LAYER_STAGES]
    per_stage.append(("verify once (stage 1, head, hc_head x3)", 1, _sum(verify, FORWARD_ONCE, p_verify)))
    per_stage.append((f"observe (main_x, {stages} stages' keys)", 1, _sum(observed, OBSERVE_CALLS, p_observe)))
    print(f"\none draft + verify round per die (TP={tp}, cube clock {CUBE_MHZ:.0f} MHz):")
    print(f"{'part':<42} {'cost-model cycles':>18} {'roofline cycles':>16} {'ratio':>7} {'us':>9}  missing")
    rows: dict[str, Any] = {}
    total = total_roof = 0.0
    missing: set[str] = set()
    for name, n, (cycles, roof, miss) in per_stage:
        cycles, roof = n * cycles, n * roof
        total, total_roof = total + cycles, total_roof + roof
        missing.update(miss)
        rows[name] = {"cycles": cycles, "roofline": roof, "missing": miss}
        print(f"{name:<42} {cycles:>18,.0f} {roof:>16,.0f} {cycles / roof:>7.1f} {cycles / CUBE_MHZ:>9.0f}  "
              f"{', '.join(miss) or '-'}")
    print(f"{'round total':<42} {total:>18,.0f} {total_roof:>16,.0f} {total / total_roof:>7.1f} "
          f"{total / CUBE_MHZ:>9.0f}  {', '.join(sorted(missing)) or '-'}")
    tokens = (requests, requests * (1 + drafts))  # every first draft rejected .. every draft accepted
    rates = [[n / (cycles / (CUBE_MHZ * 1e6)) / tp for n in tokens] for cycles in (total, total_roof)]
    print(f"per round {total / CUBE_MHZ / 1e3:,.1f} ms per die: {tokens[0]} to {tokens[1]} tokens, "
          f"{rates[0][0]:,.0f} to {rates[0][1]:,.0f} tokens/s per die (roofline {rates[1][0]:,.0f} to "
          f"{rates[1][1]:,.0f})")
    print(f"not priced: {', '.join(ROUND_UNPRICED)}; all-gathers are not priced")
    return {"requests": requests, "drafts": drafts, "context": context, "block": b, "draft": draft,
            "verify": verify, "observe": observe, "parts": rows, "cycles": total, "roofline": total_roof,
            "missing": sorted(missing),
            "ms_per_die": total / CUBE_MHZ / 1e3, "tokens_per_round": list(tokens),
            "tokens_per_s_per_die": rates[0], "roofline_tokens_per_s_per_die": rates[1]}


def _earlier_tables(path: Path, tp: int, rerun: set[str]) -> dict[tuple[int, int], dict[str, dict[str, Any]]]:
    """{(P, R): {stage: row}} of an earlier ``--json`` file: the rows with cycles, minus ``rerun``."""
    try:
        old = json.loads(path.read_text())
        if old["tp"] != tp:
            raise SystemExit(f"--reuse {path}: it was run at TP={old['tp']}, not TP={tp}")
        tables: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
        for name, geometry in old["geometries"].items():   # tables of the same geometry (verify, observe) merge
            tables.setdefault((int(geometry[0]), int(geometry[1])), {}).update(old.get(name, {}))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--reuse {path}: not a bench_pypto --json file ({exc})") from None
    return {geometry: {stage: row for stage, row in rows.items() if row.get("cycles") and stage not in rerun}
            for geometry, rows in tables.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512, help="group rows P of the stage table (default 512)")
    parser.add_argument("--tp", type=int, default=4, help="TP group size (default 4: L = P / 4 query rows)")
    parser.add_argument("--requests", type=int, default=4, help="packed requests of the stage table (default 4)")
    parser.add_argument("--layer-rows", type=int, default=LAYER_ROWS,
                        help=f"P of one packed call of {PACK_TOKENS}-token requests: the whole-layer, forward and "
                             f"packing figures (default {LAYER_ROWS}; {PACK_REQUESTS * PACK_TOKENS} prices the "
                             f"packing comparison in one call where memory allows)")
    parser.add_argument("--stages", nargs="*", choices=STAGES,
                        help="only these stages' table at --rows (implies --tables-only; default every stage)")
    parser.add_argument("--tables-only", action="store_true",
                        help="only the stage table at --rows (no layer sums, forward or packing)")
    parser.add_argument("--quick", action="store_true",
                        help=f"P=128: the stage table is the packed call (2 x {PACK_TOKENS}); single at {PACK_TOKENS}")
    parser.add_argument("--round", action="store_true",
                        help=f"only one draft + verify round: R={ROUND_REQUESTS}, K={ROUND_DRAFTS}, contexts of "
                             f"{ROUND_CONTEXT} positions (the drafter's stages + head, then the verify step)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--reuse", type=Path, metavar="JSON",
                        help="take the cycles of every stage an earlier --json file priced at the same geometry "
                             "(P, R, TP) instead of running its kernel again; the layer, forward and packing "
                             "figures are recomputed")
    parser.add_argument("--rerun", nargs="*", default=[], choices=list(LABELS), metavar="STAGE",
                        help="with --reuse: run these stages' kernels again (e.g. the ones a change touched)")
    args = parser.parse_args()
    earlier = _earlier_tables(args.reuse, args.tp, set(args.rerun)) if args.reuse else {}
    if args.stages:
        args.tables_only = True
    else:
        args.stages = list(STAGES)
    if args.quick:
        args.rows, args.requests, args.layer_rows = 2 * PACK_TOKENS, 2, 2 * PACK_TOKENS
    chunk_requests = args.layer_rows // PACK_TOKENS
    os.environ["DSPARK_PYPTO_COST_ONLY"] = "1"  # the child compiles and runs the cost model only
    print("pypto 0.2.0 cost-model estimates for A2/A3 (SIM mode; not measured on hardware)")
    print(f"roofline per die from A2A3.ini: {BF16_FLOP_PER_CYCLE:.0f} bf16 / {INT8_FLOP_PER_CYCLE:.0f} int8 "
          f"flop/cycle, {DDR_BYTES_PER_CYCLE:.0f} B/cycle DDR, {CUBE_MHZ:.0f} MHz")
    figures: dict[str, Any] = {"rows": args.rows, "tp": args.tp, "requests": args.requests, "geometries": {}}
    if args.round:
        figures["round"] = draft_round(args.tp, earlier=earlier)
        figures["geometries"] = round_geometries()
        for part in ("draft", "verify", "observe"):
            figures[part] = figures["round"].pop(part)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
        return

    def table(name: str, p_rows: int, requests: int, title: str, **kw: Any) -> dict[str, dict[str, Any]]:
        figures["geometries"][name] = [p_rows, requests]
        return measure(args.stages, p_rows, args.tp, requests, title, earlier=earlier.get((p_rows, requests)), **kw)

    figures["table"] = table("table", args.rows, args.requests, "stage table")
    if not args.tables_only:
        if args.layer_rows == args.rows and chunk_requests == args.requests:
            chunk = figures["table"]
        else:
            chunk = table("chunk", args.layer_rows, chunk_requests,
                          f"one packed call: {chunk_requests} requests x {PACK_TOKENS} tokens",
                          same_p=figures["table"] if args.layer_rows == args.rows else None)
        sums = layer_sums(chunk, args.layer_rows)
        single = table("single", PACK_TOKENS, 1, f"one request of {PACK_TOKENS} tokens")
        figures["single_layers"] = layer_sums(single, PACK_TOKENS)
        figures["chunk"], figures["single"], figures["layers"] = chunk, single, sums
        figures["forward"] = forward_estimate(chunk, sums, args.layer_rows, args.tp)
        figures["packing"] = packing(chunk, single, args.layer_rows)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
