"""Tolerances of comparisons between two float32 evaluations of the same math in different summation orders.

Packed vs alone, chunked vs one-shot, permuted rows, TP rank views vs the whole group, threads or processes vs
one process, a vectorized stage vs a loop: both sides run the same formulas, but BLAS blocking, threads and
kernel paths (chosen by row counts, a row's place inside a block, and the CPU) add the products in different
orders. Neither side is exact, and no elementwise ``rtol`` holds: an output that cancels to ~0 keeps the
absolute error of its summands. The bound is absolute, scaled by the output's magnitude and the reduction
length K::

    |a - b| <= order_atol(ref, K, c) = c * eps32 * sqrt(K) * max|ref|        (eps32 = 2**-23)

Derivation. A length-K float32 sum accumulates rounding errors like a random walk: K roundings of at most
u = eps32 / 2 of the running partial sum, about u * sqrt(K) * |sum| in all (Higham and Mary, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019); two orders differ by at most the sum of
their two errors, and the largest difference over an array grows like the largest element does. Measured on
4096 unit-normal dot products (K = 16..2048), ``max|a - b| / (eps32 * sqrt(K) * max|ref|)`` is 0.36-0.48 for
strictly sequential vs reversed order and 0.26-0.52 for sequential vs OpenBLAS, so c = 1 covers even the worst
ordinary pair of orders with a factor ~2 to spare. This project's comparisons use at most 0.26 of the c = 1
bound (0.49 for the K ~ 30 compressor entries, which state c = 2) with OpenBLAS's SkylakeX, Haswell, Sandybridge
and Prescott kernels (``OPENBLAS_CORETYPE``), 1 and 2 threads, and numpy's own SIMD paths from AVX-512 down to
SSE4.2 (``NPY_DISABLE_CPU_FEATURES``).

Chains (x -> matmul -> norm -> matmul ...): K is the sum of the chain's reduction lengths. Each stage adds an
independent relative error ~u * sqrt(K_i) that later stages carry at gain <= 1 (norms and residual adds keep
relative errors, gates and softmax damp them), so the errors add in quadrature: sqrt(K_1 + K_2 + ...). An RMS
norm counts as a reduction over its width: its mean square scales the whole row, largest element included.

Power: any K below 10**5 gives a bound below 4e-5 * max|ref| (c = 1), so one swapped, stale or foreign row
(an O(max|ref|) change) and a 1e-3 relative perturbation of one element fail by >= 25x.

Not for: a computation against itself in the same order (exact), integer results (exact), and roundings that
an fp32 order difference flips (bf16 steps: :func:`bf16_ulp`).
"""

from __future__ import annotations

import math

import numpy as np

from dspark_abi.config import ModelConfig

#: float32 machine epsilon, 2**-23 (twice the unit roundoff).
EPS32 = float(np.finfo(np.float32).eps)

# bf16 policies of the pypto-vs-reference tests: both sides round the same fp32 values to bf16, and an fp32 order
# difference flips a rounding now and then (see :func:`bf16_ulp` for the exact step where one is wanted).
#: One bf16 step relative to the value: 8 significant bits, 2**-8 to 2**-7 of it.
BF16_RTOL = 2.0**-7
#: Absolute floor beside :data:`BF16_RTOL` for values near zero (projections, attention caches, compressor entries).
BF16_ATOL = 1e-6
#: The tighter floor of the hyper-connection mixes and the head, whose near-zero values come from cancelling
#: streams (measured <= 2.2e-8 on x_mixed: 4.5x).
BF16_ATOL_CANCELLING = 1e-7
#: Fraction of bf16 elements allowed to differ at all (accumulation-order rounding flips; measured <= 1 element
#: per case, 0.08 % of 1280, in the hyper-connection tests, none in the MoE).
MAX_DIFFERING_FRACTION = 0.01
#: The same for compressor entries, whose fp32 states flip more roundings under load (measured: 0 on an idle
#: machine, 1.4 % once under load, in a run whose state rows differed from the reference in their last fp32 bits).
MAX_DIFFERING_FRACTION_UNDER_LOAD = 0.05


def order_rel(k: int, c: float = 1.0) -> float:
    """Normwise bound ``c * eps32 * sqrt(k)`` on ``max|a - b| / max|ref|`` of two summation orders.

    k: reduction length (or the summed lengths of a chain); c: the constant of the module docstring.

    >>> order_rel(64) == 8 * 2.0**-23
    True
    """
    return c * EPS32 * math.sqrt(k)


def order_atol(ref: np.ndarray, k: int, c: float = 1.0) -> float:
    """Absolute tolerance ``c * eps32 * sqrt(k) * max|ref|`` of two summation orders (module docstring).

    >>> order_atol(np.array([-2.0, 1.0]), 64)  # 8 eps32 of the largest magnitude, 2
    1.9073486328125e-06
    """
    return order_rel(k, c) * float(np.abs(ref).max(initial=0.0))


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """Spacing of bf16 values just above ``|x|``, elementwise (float64): an fp32 order difference that pushes a
    value across a bf16 rounding boundary moves the rounded value by exactly this step, or half of it below a
    power of two.

    >>> bf16_ulp(np.array([1.0, 1.99, -3.0, 0.0], np.float32)).tolist() == [2**-7, 2**-7, 2**-6, 2**-133]
    True
    """
    a = np.abs(np.asarray(x, dtype=np.float32))
    exponent = np.frexp(a)[1].astype(np.int64)  # a = m * 2**exponent, m in [0.5, 1): spacing 2**(exponent - 8)
    return np.where(a > 0, np.ldexp(1.0, np.maximum(exponent - 8, -133)), 2.0**-133)


def assert_close(actual: np.ndarray, desired: np.ndarray, atol: float | np.ndarray, err_msg: str = "") -> None:
    """Assert ``|actual - desired| <= atol`` elementwise (float64 difference; ``atol`` a scalar or an array that
    broadcasts, e.g. ``bf16_ulp(desired) + order_atol(...)``), naming the worst element on failure.

    >>> assert_close(np.array([1.0, 2.0]), np.array([1.0, 2.5]), np.array([0.0, 0.5]))
    """
    a, d = np.asarray(actual, dtype=np.float64), np.asarray(desired, dtype=np.float64)
    assert a.shape == d.shape, (a.shape, d.shape, err_msg)
    excess = np.abs(a - d) - np.broadcast_to(np.asarray(atol, dtype=np.float64), d.shape)
    if excess.size and excess.max() > 0:
        i = tuple(int(j) for j in np.unravel_index(int(np.argmax(excess)), d.shape))
        diff = abs(float(a[i]) - float(d[i]))
        raise AssertionError(f"{err_msg}: {int((excess > 0).sum())} of {d.size} elements beyond tolerance; worst "
                             f"at {i}: actual {float(a[i])!r}, desired {float(d[i])!r}, |diff| {diff:.3e} > atol "
                             f"{diff - float(excess[i]):.3e}")


def moe_reductions(cfg: ModelConfig) -> int:
    """MoE chain: gate logits (K = D) and the experts' gate/up projections (D) from the same row, then the down
    projection (I): ``2 D + I``; the sum over the few selected experts is negligible."""
    return 2 * cfg.hidden_size + cfg.moe.moe_intermediate_size


def attention_reductions(cfg: ModelConfig) -> int:
    """fp32 reductions chained from an attention input row to its output and cache rows, summed.

    q path ``D + Q`` (wq_a, q_norm), ``Q + hd`` (wq_b, per-head norm); kv path ``D + hd`` (wkv, kv_norm);
    compressor ``D + 128 + hd`` (projections, softmax pooling of up to 128 positions, norm); attention ``hd``
    (q.k) plus the visible keys (window + top-k or one entry per 128 positions); o-proj ``H hd / G`` (wo_a)
    and ``G Ro`` (wo_b). The indexer only chooses the top-k set, which fp32 order differences do not change.
    """
    d, q, hd = cfg.hidden_size, cfg.q_lora_rank, cfg.head_dim
    keys = cfg.sliding_window + max(cfg.index_topk, cfg.max_position_embeddings // 128)
    o_proj = cfg.num_attention_heads * hd // cfg.o_groups + cfg.o_groups * cfg.o_lora_rank
    return (d + q) + (q + hd) + (d + hd) + (d + 128 + hd) + (hd + keys) + o_proj


def hc_pre_reductions(cfg: ModelConfig) -> int:
    """hc_pre / hc_head: the mean square and the mixes over ``hc D`` inputs, then the ``hc``-stream sum."""
    return 2 * cfg.hc_mult * cfg.hidden_size + cfg.hc_mult


def layer_reductions(cfg: ModelConfig) -> int:
    """One layer: hc_pre, attn_norm (D), attention, hc_post (hc + 1), hc_pre, ffn_norm (D), MoE, hc_post."""
    hc_post = cfg.hc_mult + 1
    return (hc_pre_reductions(cfg) + cfg.hidden_size + attention_reductions(cfg) + hc_post
            + hc_pre_reductions(cfg) + cfg.hidden_size + moe_reductions(cfg) + hc_post)


def forward_reductions(cfg: ModelConfig) -> int:
    """A whole forward: every layer, then hc_head, the final norm (D) and the LM head (K = D). Outputs and the
    caches of any layer lie on (a prefix of) this chain."""
    return cfg.num_layers * layer_reductions(cfg) + hc_pre_reductions(cfg) + 2 * cfg.hidden_size
