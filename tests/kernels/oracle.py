"""A straightforward loop implementation of DeepSeek-V4 attention for ONE sequence from position 0.

Written directly from DeepSeek's V4 inference ``model.py`` (docs/glossary.md): token loops, no paging, no state
ring, no tiling. Used as the independent oracle of the fp32 reference backend. Only float32 definitions are
shared in spirit (RoPE angles are fp32 products, as DeepSeek builds its tables); no code from the backend is used.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from dspark_abi.config import ModelConfig


def rms(v: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    out = v / np.sqrt(np.mean(v.astype(np.float64) ** 2) + eps)
    return (out if w is None else out * w).astype(np.float32)


def omegas(config: ModelConfig, compressed: bool) -> np.ndarray:
    rd = config.qk_rope_head_dim
    theta = config.compress_rope_theta if compressed else config.rope_theta
    out = []
    sc = config.rope_scaling
    yarn = compressed and sc is not None and sc.original_max_position_embeddings > 0
    if yarn:
        def dim_for(rot: float) -> float:
            return rd * math.log(sc.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low, high = max(math.floor(dim_for(sc.beta_fast)), 0), min(math.ceil(dim_for(sc.beta_slow)), rd - 1)
    for i in range(rd // 2):
        w = np.float32(1.0) / (np.float32(theta) ** (np.float32(2 * i) / np.float32(rd)))
        if yarn:
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            w = w * (1 - ramp) + w / sc.factor * ramp
        out.append(np.float32(w))
    return np.array(out, dtype=np.float32)


def rotate(v: np.ndarray, pos: int, om: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Interleaved RoPE on the last 2*len(om) dims of a 1-D vector (complex multiply)."""
    rd = 2 * om.size
    out = v.astype(np.float32).copy()
    for i in range(om.size):
        ang = np.float32(pos) * om[i]
        c, s = np.cos(ang), np.sin(ang)
        if inverse:
            s = -s
        e, o = v[-rd + 2 * i], v[-rd + 2 * i + 1]
        z = complex(e, o) * complex(c, s)
        out[-rd + 2 * i], out[-rd + 2 * i + 1] = z.real, z.imag
    return out


def sylvester(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return (h / math.sqrt(n)).astype(np.float32)


def compress_sequence(x: np.ndarray, wkv: np.ndarray, wgate: np.ndarray, ape: np.ndarray, norm: np.ndarray,
                      ratio: int, om: np.ndarray, eps: float) -> np.ndarray:
    """Entries [S // ratio, d] of a sequence x [S, X] from position 0 (DeepSeek-V4 ``Compressor``)."""
    d = norm.size
    a = x @ wkv.T
    z = np.stack([x[t] @ wgate.T + ape[t % ratio] for t in range(x.shape[0])]) if len(x) else a
    entries = []
    for j in range(x.shape[0] // ratio):
        kv_slots, sc_slots = [], []
        if ratio == 4:
            for t in range(4 * j - 4, 4 * j):  # A halves of the previous window (absent for j = 0)
                if t >= 0:
                    kv_slots.append(a[t, :d])
                    sc_slots.append(z[t, :d])
            for t in range(4 * j, 4 * j + 4):
                kv_slots.append(a[t, d:])
                sc_slots.append(z[t, d:])
        else:
            for t in range(ratio * j, ratio * j + ratio):
                kv_slots.append(a[t])
                sc_slots.append(z[t])
        kv_s, sc_s = np.stack(kv_slots), np.stack(sc_slots)
        pooled = np.zeros(d, dtype=np.float64)
        for e in range(d):  # softmax over slots, per channel
            wts = np.exp(sc_s[:, e] - sc_s[:, e].max())
            pooled[e] = (wts / wts.sum() * kv_s[:, e]).sum()
        entries.append(rotate(rms(pooled.astype(np.float32), norm, eps), j * ratio, om))
    return np.array(entries, dtype=np.float32).reshape(-1, d)


@attrs.frozen
class OracleResult:
    out: np.ndarray          # [S, X]
    kv: np.ndarray           # [S, D] window kv (roped)
    cmp: np.ndarray          # [S // ratio, D] compressed entries (empty for SWA)
    idx: np.ndarray          # [S // 4, dI] rotated indexer keys (CSA)
    topk: list[list[int]]    # per token, selected entries in (score desc, index asc) order (CSA)


def oracle_attention(config: ModelConfig, layer: int, tensors: dict[str, np.ndarray], x: np.ndarray) -> OracleResult:
    """Attention of one sequence x [S, X] from position 0; ``tensors`` by checkpoint names (no prefix)."""
    c = config
    g = tensors.__getitem__
    eps = c.rms_norm_eps
    ratio = c.compress_ratios[layer]
    om = omegas(c, ratio != 0)
    h_n, d = c.num_attention_heads, c.head_dim
    s_len = x.shape[0]
    kv = np.stack([rotate(rms(x[t] @ g("wkv.weight").T, g("kv_norm.weight"), eps), t, om) for t in range(s_len)])
    cq = np.stack([rms(x[t] @ g("wq_a.weight").T, g("q_norm.weight"), eps) for t in range(s_len)])
    cmp = np.zeros((0, d), np.float32)
    if ratio:
        cmp = compress_sequence(x, g("compressor.wkv.weight"), g("compressor.wgate.weight"), g("compressor.ape"),
                                g("compressor.norm.weight"), ratio, om, eps)
    idx = np.zeros((0, c.index_head_dim), np.float32)
    topk: list[list[int]] = [[] for _ in range(s_len)]
    if ratio == 4:
        hd = sylvester(c.index_head_dim)
        idx = compress_sequence(x, g("indexer.compressor.wkv.weight"), g("indexer.compressor.wgate.weight"),
                                g("indexer.compressor.ape"), g("indexer.compressor.norm.weight"), 4, om, eps) @ hd
        for t in range(s_len):
            qi = (cq[t] @ g("indexer.wq_b.weight").T).reshape(c.index_n_heads, c.index_head_dim)
            qi = np.stack([rotate(qi[h], t, om) for h in range(c.index_n_heads)]) @ hd
            wts = (x[t] @ g("indexer.weights_proj.weight").T) * c.index_weight_scale
            scored = []
            for j in range((t + 1) // 4):
                score = sum(float(wts[h]) * max(float(qi[h] @ idx[j]), 0.0) for h in range(c.index_n_heads))
                scored.append((-score, j))
            topk[t] = [j for _, j in sorted(scored)[: c.index_topk]]
    out = np.zeros((s_len, c.hidden_size), np.float32)
    wo_a = g("wo_a.weight").reshape(c.o_groups, c.o_lora_rank, -1)
    for t in range(s_len):
        q = (cq[t] @ g("wq_b.weight").T).reshape(h_n, d)
        q = np.stack([rotate(rms(q[h], None, eps), t, om) for h in range(h_n)])
        keys = [kv[s] for s in range(max(0, t - c.sliding_window + 1), t + 1)]
        if ratio == 128:
            keys += [cmp[j] for j in range((t + 1) // 128)]
        elif ratio == 4:
            keys += [cmp[j] for j in topk[t]]
        k = np.stack(keys)
        o = np.zeros((h_n, d), np.float32)
        for h in range(h_n):
            logits = (k @ q[h]).astype(np.float64) * c.softmax_scale
            m = logits.max()
            e = np.exp(logits - m)
            o[h] = rotate((e @ k) / (e.sum() + math.exp(float(g("attn_sink")[h]) - m)), t, om, inverse=True)
        groups = o.reshape(c.o_groups, -1)
        y = np.concatenate([wo_a[gi] @ groups[gi] for gi in range(c.o_groups)])
        out[t] = g("wo_b.weight") @ y
    return OracleResult(out, kv, cmp, idx, topk)
