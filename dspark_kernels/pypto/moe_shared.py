"""The shared expert and the combine of the A2/A3 MoE (upstream's ``expert_shared`` and ``combine``). Shapes and
symbols as in :mod:`dspark_kernels.pypto.moe`, whose ``launch_experts`` runs this kernel after the routed calls.

``combine`` kernel (the host concatenates the routed calls' ``pairs``: NP = all the tiles' pair slots):

* ``x_q``, ``x_scale`` in as above.
* ``s1``, ``s3`` [SI, D] int8, ``s1_scale``, ``s3_scale`` [1, SI] fp32; ``s2`` [D, SI] int8, ``s2_scale`` [1, D]
  fp32 in: the shared expert (absent when the layer has none).
* ``pairs`` [NP, D] bf16 in; ``slot_pos`` [K*T] int32 in: the padded slot of pair (t, k) at ``k*T + t``.
* ``out`` [T, D] bf16 out: ``bf16(shared + pairs[slot_pos[0]] + pairs[slot_pos[1]] + ...)``.

The shared expert clamps with ``swiglu_limit`` like the routed experts (upstream's kernel and DeepSeek's DSpark
release). Importing this module imports neither torch nor pypto.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

from dspark_kernels.pypto.moe_routed import VEC_COLS, VEC_ROWS, _down, _swiglu, _w8a8


@lru_cache(maxsize=16)
def combine_kernel(rows: int, hidden: int, pair_slots: int, slots: int, shared: int, limit: float) -> Any:
    """The shared expert + combine jit kernel for one geometry; ``shared`` 0 = no shared expert."""
    from dspark_kernels.pypto.runtime import kernel, pypto

    si = max(shared, 1)

    @kernel
    def combine(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
                x_q: pypto.Tensor([rows, hidden], pypto.DT_INT8), x_scale: pypto.Tensor([rows, 1], pypto.DT_FP32),
                s1: pypto.Tensor([si, hidden], pypto.DT_INT8), s1_scale: pypto.Tensor([1, si], pypto.DT_FP32),
                s3: pypto.Tensor([si, hidden], pypto.DT_INT8), s3_scale: pypto.Tensor([1, si], pypto.DT_FP32),
                s2: pypto.Tensor([hidden, si], pypto.DT_INT8), s2_scale: pypto.Tensor([1, hidden], pypto.DT_FP32),
                pairs: pypto.Tensor([pair_slots, hidden], pypto.DT_BF16),
                slot_pos: pypto.Tensor([slots * rows], pypto.DT_INT32),
                out: pypto.Tensor([rows, hidden], pypto.DT_BF16)):
        _sizes = (rows, hidden, pair_slots, slots, si)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(VEC_ROWS, VEC_COLS)
        if shared > 0:
            h = _swiglu(_w8a8(x_q, x_scale, s1, s1_scale), _w8a8(x_q, x_scale, s3, s3_scale), limit)
            acc = pypto.cast(pypto.cast(_down(h, None, s2, s2_scale), pypto.DT_BF16), pypto.DT_FP32)
        else:
            acc = pypto.full([rows, hidden], 0.0, pypto.DT_FP32)
        for k in range(slots):  # slot order, as the reference adds them
            back = pypto.index_select(pairs, 0, pypto.view(slot_pos, [rows], [k * rows]))       # [T, D]
            acc = pypto.add(acc, pypto.cast(back, pypto.DT_FP32))
        out[:] = pypto.cast(acc, pypto.DT_BF16)

    return combine
