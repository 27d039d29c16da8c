"""The DSpark drafter's attention with the pypto kernels (a2a3): the same contract as
:func:`dspark_kernels.reference.draft_attention.block_attention` in ``precision="a2a3"``.

The draft key set fits the target's kernels as they are: every block row of request r reads its ring slots
``[0, visible[r])`` and the B block rows' own keys, so the sparse-attention kernel gets the rings as its window
pool (``window_rows`` [T, W]: rows ``r*W + slot``, -1 past ``visible[r]``) and the block's own keys as its second,
entry-row pool (``cmp_rows`` [T, B]: rows ``r*B + i``; non-causal, every block row reads all B). Kernels, in order:

=======================================================  ====================================================
stage                                                    kernel
=======================================================  ====================================================
the block rows' own keys (all R*B rows)                  ``projections.run_shared_kv``, then the FP8 step of
                                                         the non-RoPE dims on the host (``kv_fake_quant``, as
                                                         the reference's ``context_keys``)
q path of the query rows                                 ``projections.run_query``
attention core with the sink and inverse RoPE            ``sparse_attention.run_sparse_attention``
grouped o_proj                                           ``o_proj.run_o_proj``
=======================================================  ====================================================

The ring keys are the drafter's (written by ``observe`` on the host, float32 holding the FP8-stepped bf16
values). :func:`block_attention` runs its kernels in this process; the drafter reaches it through
:func:`block_attention_isolated` (one child process per call: pypto leaks per kernel call). Importing this
module imports neither torch nor pypto.
"""

from __future__ import annotations

import numpy as np

from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.backends import PYPTO_PRECISION
from dspark_kernels.model.numerics import Precision
from dspark_kernels.model.prepared import PreparedWeights
from dspark_kernels.pypto.isolate import run_isolated


def context_keys(x: np.ndarray, w: PreparedWeights, cos: np.ndarray, sin: np.ndarray, eps: float) -> np.ndarray:
    """Window keys [T, D] float32 of rows x [T, X] (bf16 values) at the positions whose RoPE is cos / sin
    [T, rd/2]: the shared kv kernel, then the FP8 step on the non-RoPE dims (the reference's ``context_keys``)."""
    from dspark_kernels.pypto.projections import run_shared_kv

    kv = run_shared_kv(x, w.wkv, w.kv_norm, cos, sin, eps).values[-1][:, 0].astype(np.float32)
    return ds.kv_fake_quant(kv, 2 * cos.shape[-1])


def draft_key_rows(visible: np.ndarray, block: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(ring rows [R*B, window] int32 into the flattened rings [R*window, D], -1 past ``visible[r]``; own rows
    [R*B, B] int32 into the block keys [R*B, D]) of every block row, request-major. visible [R] int."""
    r = visible.shape[0]
    slots = np.arange(window)
    ring = np.where(slots[None, :] < visible[:, None], np.arange(r)[:, None] * window + slots[None, :], -1)
    own = np.arange(r)[:, None] * block + np.arange(block)[None, :]
    return (np.repeat(ring, block, axis=0).astype(np.int32), np.repeat(own, block, axis=0).astype(np.int32))


def block_attention(x: np.ndarray, ring: np.ndarray, visible: np.ndarray, w: PreparedWeights, cos: np.ndarray,
                    sin: np.ndarray, *, heads: int, eps: float, scale: float, precision: Precision,
                    rows: slice | None = None) -> np.ndarray:
    """The draft attention output [T, X] float32 (bf16 values) of the block rows ``rows`` (default all R*B).

    x: [R*B, X] the blocks' post-attn_norm rows (bf16 values), request-major; ring: [R, window, D] float32 each
    request's stage ring; visible: [R] int ring slots each request's rows see; cos / sin: [R*B, rd/2] RoPE at the
    block rows' positions; w: the stage's a2a3 :class:`PreparedWeights` (its ``wo_a`` [G, Ro, H*D/G] gives the
    o_proj groups); precision: ``"a2a3"``, the kernels' numerics (the reference's signature).
    """
    from dspark_kernels.pypto.o_proj import run_o_proj
    from dspark_kernels.pypto.projections import run_query
    from dspark_kernels.pypto.sparse_attention import run_sparse_attention

    if precision != PYPTO_PRECISION or w.precision != PYPTO_PRECISION:
        raise ValueError(f"the pypto kernels compute {PYPTO_PRECISION}, not {precision} / weights {w.precision}")
    if w.wq_b_scale is None or w.wo_b_scale is None:
        raise ValueError("the draft attention's a2a3 weights lack the int8 scales of wq_b / wo_b")
    r, window, dim = ring.shape
    block = x.shape[0] // max(r, 1)
    q_rows = slice(0, x.shape[0]) if rows is None else rows
    own = context_keys(x, w, cos, sin, eps)                                                         # (R*B, D)
    ring_rows, own_rows = draft_key_rows(np.asarray(visible, np.int64), block, window)
    q = run_query(x[q_rows], w.wq_a, w.q_norm, w.wq_b, w.wq_b_scale, cos[q_rows], sin[q_rows], heads,
                  eps).values[-3].astype(np.float32)                                                  # (T, H, D)
    o = run_sparse_attention(q, ring_rows[q_rows], own_rows[q_rows], ring.reshape(r * window, dim), own,
                             w.attn_sink, cos[q_rows], sin[q_rows], scale=scale).values[-1].astype(np.float32)
    out: np.ndarray = run_o_proj(o.reshape(o.shape[0], -1), w.wo_a, w.wo_b, w.wo_b_scale,
                                 w.wo_a.shape[0]).values[-1].astype(np.float32)
    return out


def block_attention_isolated(x: np.ndarray, ring: np.ndarray, visible: np.ndarray, w: PreparedWeights,
                             cos: np.ndarray, sin: np.ndarray, *, heads: int, eps: float, scale: float,
                             precision: Precision, rows: slice | None = None) -> np.ndarray:
    """:func:`block_attention` in a child process (only arrays travel)."""
    out: np.ndarray = run_isolated(_block_attention, x, ring, visible, w, cos, sin, heads, eps, scale, precision,
                                   rows)
    return out


def _block_attention(x: np.ndarray, ring: np.ndarray, visible: np.ndarray, w: PreparedWeights, cos: np.ndarray,
                     sin: np.ndarray, heads: int, eps: float, scale: float, precision: Precision,
                     rows: slice | None) -> np.ndarray:
    return block_attention(x, ring, visible, w, cos, sin, heads=heads, eps=eps, scale=scale, precision=precision,
                           rows=rows)
