"""The DSpark drafter's attention (reference): the window keys of committed context rows, and the draft block's
non-causal attention over them (DeepSeek's ``DSparkAttention`` of the V4-Flash-DSpark release).

Context keys (:func:`context_keys`), one per committed row at absolute position p, per stage:
``kv = rms_norm(main_x @ wkv.T, kv_norm)``, RoPE at p (theta ``rope_theta``, no YaRN: the stage is an SWA layer),
then the non-RoPE dims FP8 quantise-dequantised in blocks of 64 (:func:`~dspark_kernels.model.deepseek_numerics.
kv_fake_quant`; the release trained with it, so it is applied in every precision). Stored at ring slot
``p % window``.

Block attention (:func:`block_attention`), for R requests' blocks of B rows at positions a_r .. a_r + B - 1
(a_r = last committed position + 1): every row of request r attends to the same keys, its ring slots
``[0, min(window, a_r))`` (the last ``window`` committed rows) plus all B block rows' own keys (computed as the
context keys are, from the block rows' normalised hidden state, never stored): **non-causal** inside the block.
The q path, the softmax with the sink and the inverse RoPE of the output are the target's SWA attention's
(:func:`~dspark_kernels.reference.projections.query_heads`, :func:`~dspark_kernels.reference.sparse_attention.
sparse_attention`), the grouped output projection too (:func:`~dspark_kernels.reference.o_proj.output_projection`).
"""

from __future__ import annotations

import numpy as np

from dspark_kernels.model import deepseek_numerics as ds
from dspark_kernels.model.numerics import Precision
from dspark_kernels.model.prepared import PreparedWeights
from dspark_kernels.reference.o_proj import output_projection
from dspark_kernels.reference.projections import low_rank_query, query_heads, shared_kv
from dspark_kernels.reference.sparse_attention import sparse_attention


def context_keys(x: np.ndarray, w: PreparedWeights, cos: np.ndarray, sin: np.ndarray, eps: float,
                 precision: Precision) -> np.ndarray:
    """Window keys [T, D] float32 of rows x [T, X] (``main_x`` or a block's normed rows) at the positions whose
    RoPE is cos / sin [T, rd/2]: the target's shared kv, then the FP8 step on the non-RoPE dims."""
    kv = shared_kv(x, w, cos, sin, eps, precision)
    return kv if precision == "deepseek" else ds.kv_fake_quant(kv, 2 * cos.shape[-1])  # deepseek: done inside


def block_key_rows(visible: np.ndarray, block: int, window: int) -> np.ndarray:
    """[R*B, window + B] int64 rows of the per-call key table every block row reads: request r's ring slots
    ``[0, visible[r])`` (rows ``r*window + slot``, -1 past ``visible[r]``) and its B block rows (rows
    ``R*window + r*B + i``). visible [R] int (1..window)."""
    r = visible.shape[0]
    slots = np.arange(window)
    ring = np.where(slots[None, :] < visible[:, None], np.arange(r)[:, None] * window + slots[None, :], -1)
    own = r * window + np.arange(r)[:, None] * block + np.arange(block)[None, :]            # (R, B)
    per_request = np.concatenate([ring, own], axis=1)                                        # (R, W + B)
    return np.repeat(per_request, block, axis=0).astype(np.int64)                            # (R*B, W + B)


def block_attention(x: np.ndarray, ring: np.ndarray, visible: np.ndarray, w: PreparedWeights, cos: np.ndarray,
                    sin: np.ndarray, *, heads: int, eps: float, scale: float, precision: Precision,
                    rows: slice | None = None) -> np.ndarray:
    """The draft attention output [T, X] float32 of the block rows ``rows`` (default all R*B).

    x: [R*B, X] the blocks' post-attn_norm rows, request-major (row r*B + i = request r's block row i);
    ring: [R, window, D] float32 each request's stage ring (slot = position % window); visible: [R] int ring slots
    each request's rows see, ``min(window, a_r)``; cos / sin: [R*B, rd/2] RoPE at the block rows' positions.
    The block's own keys are computed from all R*B rows (every rank of a TP group does); ``rows`` selects the
    query rows (a rank's share).
    """
    r, window, _ = ring.shape
    block = x.shape[0] // max(r, 1)
    q_rows = slice(0, x.shape[0]) if rows is None else rows
    own = context_keys(x, w, cos, sin, eps, precision)                                       # (R*B, D)
    keys = np.concatenate([ring.reshape(r * window, -1), own])                               # (R*W + R*B, D)
    key_rows = block_key_rows(np.asarray(visible, np.int64), block, window)[q_rows]          # (T, W + B)
    lrq = low_rank_query(x[q_rows], w, eps, precision)
    q = query_heads(lrq, w, cos[q_rows], sin[q_rows], heads, eps, precision)                 # (T, H, D)
    request = np.arange(x.shape[0]) // block
    o = sparse_attention(q, request[q_rows], key_rows, keys, None, None, w.attn_sink, cos[q_rows], sin[q_rows],
                         scale=scale, precision=precision)                                   # (T, H, D)
    return output_projection(o.reshape(o.shape[0], -1), w, precision)
