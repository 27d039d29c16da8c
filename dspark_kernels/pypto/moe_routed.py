"""The routed experts of the A2/A3 MoE (upstream's ``expert_routed``) and the W8A8 expert arithmetic the shared
expert reuses (:mod:`dspark_kernels.pypto.moe_shared`): tile and cache constants, ``_w8a8``, ``_swiglu``, ``_down``.
Shapes and symbols as in :mod:`dspark_kernels.pypto.moe`, whose ``launch_experts`` runs this kernel.

``routed`` kernel (NT tiles of TR = :data:`PAIR_TILE` pair rows: all the tiles, or one call's share of them):

* ``x_q`` [T, D] int8, ``x_scale`` [T, 1] fp32 in (the gate's).
* ``pair_rows`` [NT*TR] int32 in: the row of each padded pair slot (pad 0); ``pair_w`` [NT*TR, 1] fp32 in: its
  routing weight (pad 0, so a pad slot computes zeros); ``tile_expert`` [NT] int32 in: each tile's expert, an
  index into the stacks below.
* ``w1``, ``w3`` [U*I, D] int8 and ``w1_scale``, ``w3_scale`` [U, I] fp32 in; ``w2`` [U*D, I] int8 and
  ``w2_scale`` [U, D] fp32 in (the used experts stacked, per-output-channel scales).
* ``pairs`` [NT*TR, D] bf16 out: each padded pair slot's weighted expert output (upstream's ``recv_y``; pad 0).

The per-tile loop reads each tile's expert from ``tile_expert`` and views that expert's rows of the stacks at
that offset (a runtime view offset), gathers its pair rows with ``index_select`` and writes its bf16 outputs
into ``pairs``, which the combine gathers back per slot. ``pairs`` is a kernel output because gathering from a
kernel-internal ``pypto.tensor`` buffer ends the 0.2.0 compiler with SIGSEGV.
Importing this module imports neither torch nor pypto.
"""

# No `from __future__ import annotations` in kernel modules: pypto evaluates kernel annotations as objects.
from functools import lru_cache
from typing import Any

#: Pair rows per expert tile: the cube's 16-row fractal. Each expert's pairs are padded to whole tiles.
PAIR_TILE = 16
#: Expert tiles per routed-experts call. At FLASH sizes (D = 4096, I = 2048) the cost model's device simulation
#: of 242 tiles in one call (L = 128 rows) fails its workspace allocation (F74001 "Slab alloc null") and never
#: returns; 128 tiles ran (16.1M cycles), so longer lists run as several calls.
MAX_TILES_PER_CALL = 128
#: Vector tile (rows, columns) of the experts kernels (the gate's are below).
VEC_ROWS, VEC_COLS = 16, 128
#: Cube tile caps: M rows, K depth and N columns. L0A / L0B hold 64 KB each: an int8 [256, 128] B tile is 32 KB,
#: an fp32 one (the gate's weights) 128 KB, so the K depth shrinks with the operand width (:func:`_cube`).
CUBE_M, CUBE_K, CUBE_N = 128, 256, 128
L0_BYTES = 64 * 1024
#: A2/A3's L1 (512 KB) and cube cores per die (``A2A3.ini``; the cost model: 24 AIC, 48 AIV).
L1_BYTES = 512 * 1024
CUBE_CORES = 24
#: K panel of the expert products kept in L1 (A and B panels together within :data:`L1_BYTES`, single-buffered).
#: The cost model charges each copy into a core's buffer ~1.4k cycles, so a 256-deep panel (one copy per K step)
#: priced the FLASH experts (D = 4096, I = 2048; cycles of the routed calls + combine, L = 16 / L = 128):
#: 9,381,132 / 29,841,516 -> 1024-deep 4,576,068 at L = 16 -> 2048-deep 3,999,813 / 12,580,159; 4096-deep
#: panels spill L1 (17,342,099 at L = 16). At 2048 deep: 64-column N tiles 6,235,599, 256-column 11,696,681;
#: 512-deep L0 steps 3,955,478 / 12,449,201 (1 %: not taken), 128-deep 4,030,970. Also tried: every tile of a
#: routed call in flight (``stitched_kernel``): 3,914,895 / 12,401,701 (1.4 %: not taken); pypto's L1-reuse
#: merge off: no change. Exact either way: int8 products accumulate in int32.
EXPERT_K_PANEL = 2048

def _pypto() -> Any:
    from dspark_kernels.pypto.runtime import pypto

    return pypto


def _cube(m: int, k: int, n: int, operand_bytes: int = 1) -> None:
    """Cube tiles of an [m, k] x [n, k]^T product whose operands take ``operand_bytes`` per element: both
    operand tiles fit L0A / L0B (an fp32 [256, 128] tile, 128 KB, fails to compile at FLASH's hidden size), and
    both K panels (:data:`EXPERT_K_PANEL` deep at most) fit L1."""
    from dspark_kernels.pypto._ops import tile

    tm, tn = tile(m, CUBE_M), tile(n, CUBE_N)
    tk = tile(k, min(CUBE_K, L0_BYTES // (max(tm, tn) * operand_bytes)))
    panel = max(tk, tile(k, min(EXPERT_K_PANEL, L1_BYTES // ((tm + tn) * operand_bytes))))
    _pypto().set_cube_tile_shapes([tm, tm], [tk, panel], [tn, tn])


def _pow2_floor(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def _w8a8(x_q: Any, x_scale: Any, w_q: Any, w_scale: Any) -> Any:
    """``(x_q @ w_q.T in int32) * x_scale (per row) * w_scale (per column)``: fp32."""
    pypto = _pypto()
    _cube(x_q.shape[0], x_q.shape[1], w_q.shape[0])
    acc = pypto.cast(pypto.matmul(x_q, w_q, pypto.DT_INT32, b_trans=True), pypto.DT_FP32)
    return pypto.mul(pypto.mul(acc, x_scale), w_scale)


def _swiglu(gate: Any, up: Any, limit: float) -> Any:
    """``gate * (1 / (1 + exp(-gate))) * up`` after the clamp (``limit`` 0: none)."""
    pypto = _pypto()
    if limit > 0:
        gate = pypto.minimum(gate, pypto.full(gate.shape, limit, pypto.DT_FP32))
        up = pypto.maximum(pypto.minimum(up, pypto.full(up.shape, limit, pypto.DT_FP32)),
                           pypto.full(up.shape, -limit, pypto.DT_FP32))
    sig = pypto.div(pypto.full(gate.shape, 1.0, pypto.DT_FP32), pypto.add(pypto.exp(pypto.neg(gate)), 1.0))
    return pypto.mul(pypto.mul(gate, sig), up)


def _down(h: Any, row_w: Any, w_q: Any, w_scale: Any) -> Any:
    """w2: h re-quantised per row, ``(h_q @ w_q.T in int32) * (h_scale * row_w) * w_scale``: fp32."""
    from dspark_kernels.pypto._ops import int8_rows

    pypto = _pypto()
    h_q, h_scale = int8_rows(h)
    row = h_scale if row_w is None else pypto.mul(h_scale, row_w)
    _cube(h_q.shape[0], h_q.shape[1], w_q.shape[0])
    acc = pypto.cast(pypto.matmul(h_q, w_q, pypto.DT_INT32, b_trans=True), pypto.DT_FP32)
    return pypto.mul(pypto.mul(acc, row), w_scale)


@lru_cache(maxsize=16)
def routed_kernel(rows: int, hidden: int, inter: int, used: int, tiles: int, limit: float) -> Any:
    """The routed experts jit kernel for one geometry: ``tiles`` expert tiles into their ``pairs`` rows."""
    from dspark_kernels.pypto.runtime import kernel, pypto

    tr = PAIR_TILE

    @kernel
    def routed(  # type: ignore[no-untyped-def]  # pypto forbids a return annotation
               x_q: pypto.Tensor([rows, hidden], pypto.DT_INT8), x_scale: pypto.Tensor([rows, 1], pypto.DT_FP32),
               pair_rows: pypto.Tensor([tiles * tr], pypto.DT_INT32),
               pair_w: pypto.Tensor([tiles * tr, 1], pypto.DT_FP32),
               tile_expert: pypto.Tensor([tiles], pypto.DT_INT32),
               w1: pypto.Tensor([used * inter, hidden], pypto.DT_INT8),
               w1_scale: pypto.Tensor([used, inter], pypto.DT_FP32),
               w3: pypto.Tensor([used * inter, hidden], pypto.DT_INT8),
               w3_scale: pypto.Tensor([used, inter], pypto.DT_FP32),
               w2: pypto.Tensor([used * hidden, inter], pypto.DT_INT8),
               w2_scale: pypto.Tensor([used, hidden], pypto.DT_FP32),
               pairs: pypto.Tensor([tiles * tr, hidden], pypto.DT_BF16)):
        _sizes = (rows, hidden, inter, used, tiles)  # closure capture: the annotations read these
        pypto.set_vec_tile_shapes(VEC_ROWS, VEC_COLS)
        for i in pypto.loop(tiles):
            e = tile_expert[i]
            pick = pypto.view(pair_rows, [tr], [i * tr])
            xt, xs = pypto.index_select(x_q, 0, pick), pypto.index_select(x_scale, 0, pick)   # [TR, D], [TR, 1]
            gate = _w8a8(xt, xs, pypto.view(w1, [inter, hidden], [e * inter, 0]),
                         pypto.view(w1_scale, [1, inter], [e, 0]))
            up = _w8a8(xt, xs, pypto.view(w3, [inter, hidden], [e * inter, 0]),
                       pypto.view(w3_scale, [1, inter], [e, 0]))
            y = _down(_swiglu(gate, up, limit), pypto.view(pair_w, [tr, 1], [i * tr, 0]),
                      pypto.view(w2, [hidden, inter], [e * hidden, 0]), pypto.view(w2_scale, [1, hidden], [e, 0]))
            pypto.assemble(pypto.cast(y, pypto.DT_BF16), [i * tr, 0], pairs)

    return routed
