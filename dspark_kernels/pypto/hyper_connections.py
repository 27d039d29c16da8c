"""Hyper-connections on A2/A3: ``hc_pre`` (RMS, mixes, gates, 20-step Sinkhorn, stream mix) and ``hc_post``.

Mirrors ``dspark_kernels.reference.hyper_connections`` in ``precision="a2a3"`` (upstream's hc_pre and hc_post
around attention and the FFN). T rows, hc streams, X hidden size, K = hc*X, M = (2 + hc)*hc mix rows; every shape
static per call.

``hc_pre`` kernel arguments:

* ``x``     [T, Kp] fp32 in: ``x_hc`` rows flattened (stream-major), zero-padded to Kp = K rounded up to 512.
* ``fn``    [Mp, Kp] fp32 in: the mixer's ``fn``, rows zero-padded to Mp (a multiple of 16), columns to Kp.
* ``scale`` [1, Mp] fp32 in: the gate scale of each mix column (``s0`` for pre, ``s1`` for post, ``s2`` comb).
* ``base``  [1, Mp] fp32 in: ``base`` per mix column (pad columns 0).
* ``perms`` [2*log2(hc)*hc*hc] int32 in: butterfly partners of the flattened [hc, hc] comb (row sums:
  ``j ^ 2**b``, column sums: ``j ^ hc*2**b``), built by :func:`butterfly_perms`.
* ``x_mixed`` [T, X] bf16 out; ``post`` [T, hc] fp32 out; ``comb`` [T, hc*hc] fp32 out (``comb[t, i*hc + o]``
  carries stream i into stream o).

Reduction orders (the a2a3 reference's, module docstring there):

* sum of squares: 512-column chunks, each reduced by halving folds (views of the lower and upper half added),
  chunk sums added in ascending order; ``rho = 1 / sqrt(ssq * (1/K) + eps)``.
* mix: K cut into :data:`HC_K_SPLITS` slices; each slice is one accumulator chain (a ``pypto.loop`` whose
  body adds a ``k_step``-column matmul to the slice's fp32 buffer), in ascending K order; the slice partials
  are added in ascending order. On A2/A3 the cube realises the a2a3 order itself (4 products per fp32
  rounding, :data:`CUBE_MAD_K`), so ``k_step = slice_width(K)`` (one matmul per slice, the chain stays in the
  cube's accumulator) is the hardware form. The CPU interpreter computes each matmul in torch's fp32 order
  instead, so sim mode defaults to ``k_step = CUBE_MAD_K``: the interpreter then follows the cube's chain
  except that each 4-product partial is rounded to fp32 once before it joins the accumulator (normwise
  2-3x closer to the cube's mixes than one matmul per slice: rms 0.30 vs 0.57 eps32 * max|mix| at K = 512,
  0.6 vs 1.7 at K = 16384). It is a CPU-checking form: the cost model prices it 150x the hardware form.
* gates ``1 / (1 + exp(-z))``; Sinkhorn row / column sums and the stream sum as pairwise trees. The comb
  tile stays [T, hc*hc] (rows of hc*hc fp32): a row or column sum is ``v + v[partner]`` for partners
  ``j ^ 1, j ^ 2`` (rows) or ``j ^ hc, j ^ 2hc`` (columns), which gives every lane the tree's value
  ``(a0 + a1) + (a2 + a3)`` (fp32 addition commutes), so the Sinkhorn needs no [T, hc] tiles, transposes or
  loops (``index_select`` with a static partner table; the 20 rounds are unrolled while tracing).

``hc_post`` kernel: ``out`` [T, X] bf16, ``x`` [T, K] fp32, ``post`` [T, hc] fp32, ``comb`` [T, hc*hc] fp32 in;
``y`` [T, K] fp32 out with ``y[:, o] = post[:, o] * out``, then ``+ comb[:, i*hc + o] * x[:, i]`` for i in turn.

The order constants (``HC_K_SPLITS``, ``CUBE_MAD_K``, ``RMS_CHUNK``) come from :mod:`dspark_kernels.model.numerics`,
shared with the reference (this package never imports the reference). bf16 conversion on the host uses ``ml_dtypes``.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any, Protocol

import attrs
import ml_dtypes
import numpy as np

from dspark_abi.config import ModelConfig
from dspark_kernels.model.numerics import CUBE_MAD_K, HC_K_SPLITS, RMS_CHUNK
from dspark_kernels.pypto._ops import rms_norm
from dspark_kernels.pypto.runtime import LaunchResult, Out, kernel, launch, pypto, run_mode

BF16 = ml_dtypes.bfloat16
#: Mix rows are padded to a multiple of the cube's 16-row fractal.
MIX_ALIGN = 16
#: Vector tiles (rows, columns) of both kernels. Cost model at FLASH sizes, P = 512 rows: hc_post 509k cycles
#: with (8, 512), 363k with (16, 512) / (32, 256) / (64, 128), 296k with (32, 512) or (16, 1024); (64, 512)
#: and (32, 1024) overflow the unified buffer. hc_pre (hardware form): 553k -> 410k (16, 512) -> 308k (32, 512).
VEC_ROWS, VEC_COLS = 32, 512
#: Cube tiles of the mix (fp32 operands; L0A / L0B hold 64 KB: tm * tk * 4 B and Mp * tk * 4 B), and the
#: K steps per L1 panel. (128, 128, 4), (32, 256, 4), (64, 256, 1), (64, 128, 8) all cost 304k-318k cycles.
CUBE_TM, CUBE_TK, CUBE_L1_STEPS = 64, 256, 4


class HcMixer(Protocol):
    """What the host entries read from a mixer (the reference's ``HcWeights``): fn [M, K], scale [3], base [M]."""

    @property
    def fn(self) -> np.ndarray: ...
    @property
    def scale(self) -> np.ndarray: ...
    @property
    def base(self) -> np.ndarray: ...


def padded_width(k: int) -> int:
    """K rounded up to a whole number of :data:`RMS_CHUNK` columns."""
    return -(-k // RMS_CHUNK) * RMS_CHUNK


def slice_width(k: int) -> int:
    """Columns of one K slice of the mix (``k_step`` of the hardware form: one matmul per slice)."""
    return padded_width(k) // HC_K_SPLITS


def default_k_step(k: int) -> int:
    """The mix's chain step for the run mode: :data:`CUBE_MAD_K` in sim mode (the interpreter then follows the
    cube's order), the whole slice on an NPU (the cube keeps the chain in its accumulator)."""
    return CUBE_MAD_K if run_mode() == "sim" else slice_width(k)


def butterfly_perms(hc: int) -> np.ndarray:
    """int32 [2 * log2(hc) * hc*hc]: for b = 0.. the row partners ``j ^ 2**b``, then the column partners
    ``j ^ hc * 2**b`` of the flattened [hc, hc] comb index j = i*hc + o."""
    if hc < 1 or hc & (hc - 1):
        raise ValueError(f"the pypto hc kernels need hc_mult a power of two, got {hc}")
    j = np.arange(hc * hc)
    bits = hc.bit_length() - 1
    rows = [j ^ (1 << b) for b in range(bits)]
    cols = [j ^ (hc << b) for b in range(bits)]
    return np.concatenate(rows + cols).astype(np.int32) if bits else np.zeros(0, np.int32)


def _fold_halves(v: Any, rows: int, width: int) -> Any:
    """[rows, width] (a power of two) -> [rows, 1]: column i plus column i + n/2, level by level."""
    while width > 1:
        width //= 2
        v = pypto.add(pypto.view(v, [rows, width], [0, 0]), pypto.view(v, [rows, width], [0, width]))
    return v


def _inv_rms(x: Any, rows: int, kp: int, k: int, norm_eps: float) -> Any:
    """``1 / sqrt(ssq * (1/k) + eps)`` of x [T, Kp] fp32 (zero-padded): [T, 1]. Sum of squares: halving folds
    inside each :data:`RMS_CHUNK`-column chunk, chunk sums added in ascending order."""
    ssq = None
    for c in range(kp // RMS_CHUNK):
        chunk = pypto.view(x, [rows, RMS_CHUNK], [0, c * RMS_CHUNK])
        part = _fold_halves(pypto.mul(chunk, chunk), rows, RMS_CHUNK)                     # [T, 1]
        ssq = part if ssq is None else pypto.add(ssq, part)
    mean_sq = pypto.add(pypto.mul(ssq, 1.0 / k), norm_eps)
    return pypto.div(pypto.full(mean_sq.shape, 1.0, pypto.DT_FP32), pypto.sqrt(mean_sq))


def _sigmoid(z: Any) -> Any:
    """The a2a3 kernels' logistic function ``1 / (1 + exp(-z))`` (fp32)."""
    return pypto.div(pypto.full(z.shape, 1.0, pypto.DT_FP32), pypto.add(pypto.exp(pypto.neg(z)), 1.0))


def bf16_then_norm(v: Any, weight: Any, eps: float) -> Any:
    """``rms(bf16(v), weight)`` in fp32: the RMSNorm of a bf16 narrowing point (x_mixed, the hc_head output).

    v: [T, X] fp32; weight: [1, X] fp32. The bf16 value is formed by its own cast (pypto 0.2.0 cannot cast a
    tensor that is also stored to an output), so a kernel may store ``cast(v, BF16)`` besides.
    """
    return rms_norm(pypto.cast(pypto.cast(v, pypto.DT_BF16), pypto.DT_FP32), weight, eps)


def _butterfly(v: Any, perms: Any, first: int, count: int, width: int, op: Any) -> Any:
    """``v = op(v, v[:, partner])`` for ``count`` partner tables of ``perms`` starting at table ``first``."""
    for b in range(count):
        partner = pypto.view(perms, [width], [(first + b) * width])
        v = op(v, pypto.index_select(v, 1, partner))
    return v


def _sinkhorn(logits: Any, perms: Any, bits: int, width: int, eps: float, iters: int) -> Any:
    """Row softmax + eps, a column normalisation, then ``iters - 1`` (row, column) rounds on [T, hc*hc] fp32.

    Unrolled while tracing (a plain helper: the kernel parser rejects an empty ``range`` loop, iters = 1).
    """
    row_max = _butterfly(logits, perms, 0, bits, width, pypto.maximum)
    e = pypto.exp(pypto.sub(logits, row_max))
    cmb = pypto.add(pypto.div(e, _butterfly(e, perms, 0, bits, width, pypto.add)), eps)
    cmb = pypto.div(cmb, pypto.add(_butterfly(cmb, perms, bits, bits, width, pypto.add), eps))
    for _ in range(iters - 1):
        cmb = pypto.div(cmb, pypto.add(_butterfly(cmb, perms, 0, bits, width, pypto.add), eps))
        cmb = pypto.div(cmb, pypto.add(_butterfly(cmb, perms, bits, bits, width, pypto.add), eps))
    return cmb


def _pair_tree(terms: list[Any]) -> Any:
    """Adjacent-pair tree sum of a power-of-two number of tensors: (t0 + t1) + (t2 + t3)."""
    while len(terms) > 1:
        terms = [pypto.add(terms[i], terms[i + 1]) for i in range(0, len(terms), 2)]
    return terms[0]


def _stream_mix(x: Any, pre: Any, rows: int, hc: int, hidden: int) -> Any:
    """``sum_h pre[:, h] * x[:, h]`` as an adjacent-pair tree; x [T, hc*X], pre [T, hc] -> [T, X] fp32.

    (A plain helper: the kernel parser evaluates a list comprehension without the module's names.)
    """
    terms = [pypto.mul(pypto.view(x, [rows, hidden], [0, h * hidden]), pypto.view(pre, [rows, 1], [0, h]))
             for h in range(hc)]
    return _pair_tree(terms)


@lru_cache(maxsize=16)
def hc_pre_kernel(rows: int, hc: int, hidden: int, mix_rows: int, k_step: int, eps: float, norm_eps: float,
                  iters: int) -> Any:
    """The hc_pre jit kernel for one geometry (module docstring); ``k_step`` divides K_padded / 4."""
    k = hc * hidden
    kp = padded_width(k)
    mp = -(-mix_rows // MIX_ALIGN) * MIX_ALIGN
    split = kp // HC_K_SPLITS
    if split % k_step:
        raise ValueError(f"k_step={k_step} must divide the mix slice width {split}")
    steps = split // k_step
    width = hc * hc
    bits = hc.bit_length() - 1
    n_perm = max(1, 2 * bits * width)
    # cube tiles: fp32 operands, L0A / L0B hold 64 KB (tm * tk * 4 B and tn * tk * 4 B)
    tk = min(CUBE_TK, max(16, k_step))
    tm = CUBE_TM

    @kernel
    def hc_pre(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
               x: pypto.Tensor([rows, kp], pypto.DT_FP32), fn: pypto.Tensor([mp, kp], pypto.DT_FP32),
               scale: pypto.Tensor([1, mp], pypto.DT_FP32), base: pypto.Tensor([1, mp], pypto.DT_FP32),
               perms: pypto.Tensor([n_perm], pypto.DT_INT32), norm_w: pypto.Tensor([1, hidden], pypto.DT_FP32),
               x_normed: pypto.Tensor([rows, hidden], pypto.DT_BF16),
               x_mixed: pypto.Tensor([rows, hidden], pypto.DT_BF16), post: pypto.Tensor([rows, hc], pypto.DT_FP32),
               comb: pypto.Tensor([rows, width], pypto.DT_FP32)):
        _sizes = (rows, kp, mp, n_perm, hidden, hc, width)  # closure capture: the annotations read these
        pypto.set_cube_tile_shapes([tm, tm], [tk, CUBE_L1_STEPS * tk], [mp, mp])
        pypto.set_vec_tile_shapes(VEC_ROWS, VEC_COLS)
        rho = _inv_rms(x, rows, kp, k, norm_eps)                                           # [T, 1]
        # mix: one accumulator chain per K slice, slices added in ascending order
        partials = []
        for s in range(HC_K_SPLITS):
            acc = pypto.tensor([rows, mp], pypto.DT_FP32, f"hc_mix_slice{s}")
            for g in pypto.loop(steps):
                k0 = s * split + g * k_step
                prod = pypto.matmul(pypto.view(x, [rows, k_step], [0, k0]), pypto.view(fn, [mp, k_step], [0, k0]),
                                    pypto.DT_FP32, b_trans=True)                           # [T, Mp]
                if g == 0:
                    acc[:] = prod
                else:
                    acc[:] = pypto.add(acc, prod)
            partials.append(acc)
        mixes = partials[0]
        for part in partials[1:]:
            mixes = pypto.add(mixes, part)
        z = pypto.add(pypto.mul(pypto.mul(mixes, rho), scale), base)                      # [T, Mp]
        gates = pypto.view(z, [rows, 2 * hc], [0, 0])
        sig = _sigmoid(gates)
        pre = pypto.add(pypto.view(sig, [rows, hc], [0, 0]), eps)
        post_t = pypto.mul(pypto.view(sig, [rows, hc], [0, hc]), 2.0)
        # Sinkhorn on the flattened [T, hc*hc] comb: butterflies give every lane its row / column tree sum
        cmb = _sinkhorn(pypto.view(z, [rows, width], [0, 2 * hc]), perms, bits, width, eps, iters)
        # stream mix: (y0 + y1) + (y2 + y3), bf16
        mixed = _stream_mix(x, pre, rows, hc, hidden)
        # the sub-block's RMSNorm (attn_norm / ffn_norm) of the bf16 x_mixed, fused: bf16(rms(bf16(mixed), w))
        x_normed[:] = pypto.cast(bf16_then_norm(mixed, norm_w, norm_eps), pypto.DT_BF16)
        x_mixed[:] = pypto.cast(mixed, pypto.DT_BF16)
        post[:] = post_t
        comb[:] = cmb

    return hc_pre


@lru_cache(maxsize=16)
def hc_post_kernel(rows: int, hc: int, hidden: int) -> Any:
    """The hc_post jit kernel for one geometry (module docstring)."""
    k = hc * hidden

    @kernel
    def hc_post(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
                out: pypto.Tensor([rows, hidden], pypto.DT_BF16), x: pypto.Tensor([rows, k], pypto.DT_FP32),
                post: pypto.Tensor([rows, hc], pypto.DT_FP32), comb: pypto.Tensor([rows, hc * hc], pypto.DT_FP32),
                y: pypto.Tensor([rows, k], pypto.DT_FP32)):
        _sizes = (rows, hidden, hc, k)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(VEC_ROWS, VEC_COLS)
        o_row = pypto.cast(out, pypto.DT_FP32)
        for o in range(hc):
            acc = pypto.mul(o_row, pypto.view(post, [rows, 1], [0, o]))
            for i in range(hc):
                acc = pypto.add(acc, pypto.mul(pypto.view(x, [rows, hidden], [0, i * hidden]),
                                               pypto.view(comb, [rows, 1], [0, i * hc + o])))
            pypto.assemble(acc, [0, o * hidden], y)

    return hc_post


def hc_head_rows(x: Any, fn: Any, scale: Any, base: Any, *, rows: int, hc: int, hidden: int, eps: float,
                 norm_eps: float) -> Any:
    """Traced: the head's stream reduction ``sum_h pre[:, h] * x[:, h]`` [T, X] fp32 (before its bf16 narrowing).

    x [T, Kp] fp32 and fn [Hp, Kp] fp32 (zero-padded, :func:`hc_head_args`), scale / base [1, Hp]. ``pre =
    sigmoid((x @ fn.T) * rho * scale + base) + eps`` with ``rho`` from :func:`_inv_rms`; the caller sets the tiles
    (:func:`set_hc_head_tiles`).
    """
    rho = _inv_rms(x, rows, x.shape[1], hc * hidden, norm_eps)                               # [T, 1]
    mixes = pypto.matmul(x, fn, pypto.DT_FP32, b_trans=True)                                 # [T, Hp]
    z = pypto.add(pypto.mul(pypto.mul(mixes, rho), scale), base)
    pre = pypto.add(_sigmoid(pypto.view(z, [rows, hc], [0, 0])), eps)                         # [T, hc]
    return _stream_mix(x, pre, rows, hc, hidden)


def set_hc_head_tiles(mix_cols: int) -> None:
    """Traced: tiles of :func:`hc_head_rows` (fp32 cube operands as hc_pre's mix, N = the Hp mix columns)."""
    pypto.set_cube_tile_shapes([CUBE_TM, CUBE_TM], [CUBE_TK, CUBE_L1_STEPS * CUBE_TK], [mix_cols, mix_cols])
    pypto.set_vec_tile_shapes(VEC_ROWS, VEC_COLS)


@lru_cache(maxsize=16)
def hc_head_kernel(rows: int, hc: int, hidden: int, eps: float, norm_eps: float) -> Any:
    """The hc_head jit kernel for one geometry: y [T, X] bf16 (module docstring of :func:`run_hc_head`)."""
    kp, hp = hc_head_layout(hc, hidden)

    @kernel
    def hc_head(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
                x: pypto.Tensor([rows, kp], pypto.DT_FP32), fn: pypto.Tensor([hp, kp], pypto.DT_FP32),
                scale: pypto.Tensor([1, hp], pypto.DT_FP32), base: pypto.Tensor([1, hp], pypto.DT_FP32),
                y: pypto.Tensor([rows, hidden], pypto.DT_BF16)):
        _sizes = (rows, kp, hp, hidden)  # closure capture: the annotations read these
        set_hc_head_tiles(hp)
        y[:] = pypto.cast(hc_head_rows(x, fn, scale, base, rows=rows, hc=hc, hidden=hidden, eps=eps,
                                       norm_eps=norm_eps), pypto.DT_BF16)

    return hc_head


def hc_head_layout(hc: int, hidden: int) -> tuple[int, int]:
    """(Kp, Hp) of the head's padded inputs: K = hc*X rounded up to :data:`RMS_CHUNK` columns, the hc mix rows
    to :data:`MIX_ALIGN`."""
    return padded_width(hc * hidden), -(-hc // MIX_ALIGN) * MIX_ALIGN


def hc_head_args(x_hc: np.ndarray, weights: HcMixer) -> list[np.ndarray]:
    """The zero-padded inputs (x [T, Kp], fn [Hp, Kp], scale [1, Hp], base [1, Hp]) of :func:`hc_head_rows`.

    x_hc: [T, hc, X] fp32; weights: the head mixer (fn [hc, hc*X], scale [1], base [hc]). ValueError when the
    shapes disagree.
    """
    x_hc = np.asarray(x_hc, dtype=np.float32)
    rows, hc, hidden = x_hc.shape
    fn = np.asarray(weights.fn, dtype=np.float32)
    k = hc * hidden
    if fn.shape != (hc, k) or np.size(weights.base) != hc or np.size(weights.scale) < 1:
        raise ValueError(f"the head mixer (fn {fn.shape}, scale {np.shape(weights.scale)}, base "
                         f"{np.shape(weights.base)}) does not match x_hc {x_hc.shape}: want fn [{hc}, {k}], "
                         f"scale [1], base [{hc}]")
    kp, hp = hc_head_layout(hc, hidden)
    x_p = np.zeros((rows, kp), np.float32)
    x_p[:, :k] = x_hc.reshape(rows, k)
    fn_p = np.zeros((hp, kp), np.float32)
    fn_p[:hc, :k] = fn
    scale_p = np.zeros((1, hp), np.float32)
    scale_p[0, :hc] = np.asarray(weights.scale, np.float32).reshape(-1)[0]
    base_p = np.zeros((1, hp), np.float32)
    base_p[0, :hc] = np.asarray(weights.base, np.float32)
    return [x_p, fn_p, scale_p, base_p]


def run_hc_head(x_hc: np.ndarray, weights: HcMixer, *, eps: float, norm_eps: float) -> LaunchResult:
    """hc_head on numpy arrays; ``values[-1]`` = y [T, X] bf16.

    x_hc: [T, hc, X] fp32 (padding rows zero give zero rows); weights: the head mixer (``HcWeights`` with fn
    [hc, hc*X], scale [1], base [hc]); eps: ``hc_eps``; norm_eps: ``rms_norm_eps`` (the mix's RMS).
    """
    rows, hc, hidden = np.shape(x_hc)
    jit = hc_head_kernel(rows, hc, hidden, float(eps), float(norm_eps))
    return launch(jit, [*hc_head_args(x_hc, weights), Out((rows, hidden), BF16, "y")])


def hc_head(x_hc: np.ndarray, weights: HcMixer, config: ModelConfig) -> np.ndarray:
    """The reference's ``hc_head(x_hc, weights, config, precision="a2a3")`` through the kernel: [T, X] fp32
    holding bf16 values."""
    y = run_hc_head(x_hc, weights, eps=config.hc_eps, norm_eps=config.rms_norm_eps).values[-1]
    return y.astype(np.float32)


def _mix_columns(values: np.ndarray, hc: int, mp: int) -> np.ndarray:
    """[1, Mp] fp32: the three gate scales spread over their mix columns (pre, post, comb), pad 0."""
    row = np.zeros((1, mp), np.float32)
    row[0, :hc] = values[0]
    row[0, hc:2 * hc] = values[1]
    row[0, 2 * hc:(2 + hc) * hc] = values[2]
    return row


def run_hc_pre(x_hc: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, *, eps: float,
               norm_eps: float, iters: int, k_step: int | None = None, norm: np.ndarray | None = None
               ) -> LaunchResult:
    """hc_pre on numpy arrays; ``values[-3:]`` = x_mixed [T, X] bf16, post [T, hc], comb [T, hc*hc], and
    ``values[-4]`` = x_normed [T, X] bf16, ``bf16(rms(x_mixed, norm))`` (unweighted when ``norm`` is None).

    x_hc: [T, hc, X] float32; fn: [(2+hc)*hc, hc*X]; scale: [3]; base: [(2+hc)*hc]; ``k_step``: the mix's chain
    step (None: :func:`default_k_step`; it must divide :func:`slice_width`); norm: [X] fp32, the sub-block's
    RMSNorm weight (``attn_norm`` / ``ffn_norm``).
    """
    x_hc = np.asarray(x_hc, dtype=np.float32)
    rows, hc, hidden = x_hc.shape
    fn = np.asarray(fn, dtype=np.float32)
    mix_rows, k = fn.shape
    if k != hc * hidden or mix_rows != (2 + hc) * hc:
        raise ValueError(f"fn {fn.shape} does not match x_hc {x_hc.shape}: want [{(2 + hc) * hc}, {hc * hidden}]")
    perms = butterfly_perms(hc)
    kp = padded_width(k)
    mp = -(-mix_rows // MIX_ALIGN) * MIX_ALIGN
    x_p = np.zeros((rows, kp), np.float32)
    x_p[:, :k] = x_hc.reshape(rows, k)
    fn_p = np.zeros((mp, kp), np.float32)
    fn_p[:mix_rows, :k] = fn
    base_p = np.zeros((1, mp), np.float32)
    base_p[0, :mix_rows] = np.asarray(base, dtype=np.float32)
    step = default_k_step(k) if k_step is None else int(k_step)
    norm_w = np.ones((1, hidden), np.float32) if norm is None else np.asarray(norm, np.float32).reshape(1, hidden)
    jit = hc_pre_kernel(rows, hc, hidden, mix_rows, step, float(eps), float(norm_eps), int(iters))
    return launch(jit, [x_p, fn_p, _mix_columns(np.asarray(scale, np.float32), hc, mp), base_p,
                        perms if perms.size else np.zeros(1, np.int32), norm_w, Out((rows, hidden), BF16, "x_normed"),
                        Out((rows, hidden), BF16, "x_mixed"), Out((rows, hc), np.float32, "post"),
                        Out((rows, hc * hc), np.float32, "comb")])


@attrs.frozen
class HcPreResult:
    """hc_pre outputs as the reference's ``HcPre``, plus the fused norm and the cost-model cycles of the call.

    x_mixed: [T, X] fp32 holding bf16 values; post: [T, hc] fp32; comb: [T, hc, hc] fp32 (``comb[t, i, o]``);
    x_normed: [T, X] fp32 holding bf16 values, ``bf16(rms(x_mixed, norm))`` (the layer's attn_norm / ffn_norm).
    """

    x_mixed: np.ndarray
    post: np.ndarray
    comb: np.ndarray
    cycles: int | None
    x_normed: np.ndarray | None = None


def hc_pre(x_hc: np.ndarray, weights: HcMixer, config: ModelConfig, *, k_step: int | None = None,
           norm: np.ndarray | None = None) -> HcPreResult:
    """The reference's ``hc_pre(x_hc, weights, config, precision="a2a3")`` through the pypto kernel, and with
    ``norm`` [X] the layer's following ``narrow(rms_norm(x_mixed, norm, rms_norm_eps))`` fused (``x_normed``).

    x_hc: [T, hc, X] fp32 (padding rows zero); weights: an ``HcWeights`` (``fn``, ``scale``, ``base``);
    config: its ``hc_eps``, ``rms_norm_eps`` and ``hc_sinkhorn_iters`` are used; k_step: see :func:`run_hc_pre`.
    """
    result = run_hc_pre(x_hc, weights.fn, weights.scale, weights.base, eps=config.hc_eps,
                        norm_eps=config.rms_norm_eps, iters=config.hc_sinkhorn_iters, k_step=k_step, norm=norm)
    x_normed, x_mixed, post, comb = result.values[-4:]
    hc = post.shape[1]
    return HcPreResult(x_mixed=x_mixed.astype(np.float32), post=post, comb=comb.reshape(-1, hc, hc),
                       cycles=result.cycles, x_normed=None if norm is None else x_normed.astype(np.float32))


def run_hc_post(out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray) -> LaunchResult:
    """hc_post on numpy arrays; ``values[-1]`` = y [T, hc*X] fp32.

    out: [T, X] bf16-valued (ValueError otherwise: the kernel reads bf16 as upstream's does); x_hc: [T, hc, X]
    fp32; post: [T, hc]; comb: [T, hc, hc] or [T, hc*hc].
    """
    x_hc = np.asarray(x_hc, dtype=np.float32)
    rows, hc, hidden = x_hc.shape
    out = np.asarray(out, dtype=np.float32)
    out_bf16 = out.astype(BF16)
    if not np.array_equal(out_bf16.astype(np.float32), out, equal_nan=True):
        raise ValueError("hc_post's sub-block output must hold bf16 values (the a2a3 attention / MoE output)")
    jit = hc_post_kernel(rows, hc, hidden)
    return launch(jit, [out_bf16, x_hc.reshape(rows, hc * hidden), np.asarray(post, np.float32).reshape(rows, hc),
                        np.asarray(comb, np.float32).reshape(rows, hc * hc),
                        Out((rows, hc * hidden), np.float32, "y")])


def hc_post(out: np.ndarray, x_hc: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """The reference's ``hc_post(out, x_hc, post, comb, precision="a2a3")`` through the kernel: [T, hc, X] fp32."""
    y = run_hc_post(out, x_hc, post, comb).values[-1]
    return y.reshape(np.shape(x_hc))
