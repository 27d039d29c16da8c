"""The DSpark drafter's observe with the pypto kernels (a2a3): the same contracts as
:func:`dspark_kernels.reference.observe.main_x` and :func:`dspark_kernels.reference.draft_attention.context_keys`
in ``precision="a2a3"``.

* ``main_x`` (main_proj [D, T*D] + RMSNorm with main_norm, bf16 out): ``projections.run_linear_norm``, the shared
  kv kernel without RoPE.
* each stage's window keys of the main_x rows (wkv, kv_norm, RoPE): ``projections.run_shared_kv``, then the FP8
  step of the non-RoPE dims on the host.

The FP8 step (``kv_fake_quant``: e4m3 with power-of-two scales in blocks of 64) is the drafter's own: the target's
a2a3 path has none (its caches hold the shared kv kernel's bf16 rows; only ``"deepseek"`` applies the step, in
numpy), so the keys take it on the host exactly as the pypto draft attention does for the block rows' own keys
(:func:`dspark_kernels.pypto.draft_attention.context_keys`, reused here). The drafter reaches these through the
``*_isolated`` functions (one child process per call: pypto leaks per kernel call). Importing this module imports
neither torch nor pypto.
"""

from __future__ import annotations

import numpy as np

from dspark_kernels.model.backends import PYPTO_PRECISION
from dspark_kernels.model.numerics import Precision, bf16_round
from dspark_kernels.model.prepared import PreparedWeights
from dspark_kernels.pypto.isolate import run_isolated


def _check(precision: Precision) -> None:
    if precision != PYPTO_PRECISION:
        raise ValueError(f"the pypto kernels compute {PYPTO_PRECISION}, not {precision}")


def main_x(features: np.ndarray, main_proj: np.ndarray, main_norm: np.ndarray, eps: float, precision: Precision,
           fp8: bool = False) -> np.ndarray:
    """``main_x`` [n, D] float32 (bf16 values) of target features [n, T*D] (bf16 values) through the linear + norm
    kernel; main_proj [D, T*D] is read in bf16 (the reference's a2a3). ``fp8`` matters only in deepseek."""
    from dspark_kernels.pypto.projections import run_linear_norm

    _check(precision)
    if features.shape[0] == 0:
        return np.zeros((0, main_proj.shape[0]), np.float32)
    out: np.ndarray = run_linear_norm(features, bf16_round(main_proj), main_norm, eps).values[-1]
    return out.astype(np.float32)


def context_keys(x: np.ndarray, w: PreparedWeights, cos: np.ndarray, sin: np.ndarray, eps: float,
                 precision: Precision) -> np.ndarray:
    """Window keys [T, D] float32 of rows x [T, X] (bf16 values): the shared kv kernel, then the FP8 step on the
    host (the reference's ``context_keys`` in a2a3)."""
    from dspark_kernels.pypto.draft_attention import context_keys as kernel_keys

    _check(precision)
    if x.shape[0] == 0:
        return np.zeros((0, w.wkv.shape[0]), np.float32)
    return kernel_keys(x, w, cos, sin, eps)


def main_x_isolated(features: np.ndarray, main_proj: np.ndarray, main_norm: np.ndarray, eps: float,
                    precision: Precision, fp8: bool = False) -> np.ndarray:
    """:func:`main_x` in a child process (only arrays travel)."""
    out: np.ndarray = run_isolated(main_x, features, main_proj, main_norm, eps, precision, fp8)
    return out


def context_keys_isolated(x: np.ndarray, w: PreparedWeights, cos: np.ndarray, sin: np.ndarray, eps: float,
                          precision: Precision) -> np.ndarray:
    """:func:`context_keys` in a child process (only arrays travel)."""
    out: np.ndarray = run_isolated(context_keys, x, w, cos, sin, eps, precision)
    return out
