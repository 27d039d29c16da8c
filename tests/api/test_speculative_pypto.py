"""A mixed speculative step on the pypto backend: a verify request (anchor, one right and one wrong draft) and
another request's final prefill chunk in one dispatch give the reference backend's acceptance (same a2a3
numerics). Each layer's pypto work runs in a child process (dspark_kernels.pypto.isolate); a whole TINY forward
takes minutes there, so the context is prefilled on the reference and only the mixed step runs on pypto."""

import warnings

import numpy as np
import pytest
from tolerances import BF16_RTOL

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy
from dspark_abi.allocator import pool_blocks_for
from dspark_abi.presets import TINY_DSPARK
from dspark_kernels.api import prefill
from dspark_kernels.model.accept import accept_greedy, greedy_matrix
from dspark_kernels.model.caches import ModelCaches
from dspark_kernels.model.weights import ModelWeights
from dspark_kernels.speculative import greedy_decode

pytestmark = pytest.mark.pypto

#: as tests/api/test_prefill_pypto.py: a kernel may round some elements one bf16 step differently from the
#: reference, and the layers carry that on; logits within 1 % of their largest magnitude.
MAX_ABS_OF_SCALE = 1e-2


def test_mixed_verify_step_on_pypto_accepts_as_the_reference():
    cfg = TINY_DSPARK
    weights = ModelWeights.random(cfg, seed=3)
    rng = np.random.default_rng(0)
    prompt, other = rng.integers(0, cfg.vocab_size, 4), rng.integers(0, cfg.vocab_size, 3)
    plain = greedy_decode([prompt], weights, 3, precision="a2a3")          # the reference's continuation
    first, right = int(plain.tokens[0][0]), int(plain.tokens[0][1])
    alloc = BlockAllocator(cfg, pool_blocks_for(cfg, [16, 8], slack=4))
    caches = ModelCaches.allocate(cfg, alloc.pool_blocks, precision="a2a3")
    builder = BatchBuilder(cfg, PaddingPolicy(), alloc)
    builder.add(0, num_cached=0, num_new=4, token_ids=prompt)
    batch = builder.build()
    prefill(batch, batch.token_ids, weights, caches, precision="a2a3")
    builder.commit(batch)
    inputs = np.array([first, right, (right + 1) % cfg.vocab_size])   # anchor, a right and a wrong draft
    builder.add_verify(0, num_cached=4, token_ids=inputs)
    builder.add(1, num_cached=0, num_new=3, token_ids=other)           # another request's final chunk
    step = builder.build()
    ref = prefill(step, step.token_ids, weights, caches.copy(), precision="a2a3")
    out = prefill(step, step.token_ids, weights, caches.copy(), precision="a2a3", backend="pypto")
    np.testing.assert_array_equal(out.logit_rows, ref.logit_rows)
    scale = float(np.abs(ref.logits).max())
    assert np.abs(out.logits - ref.logits).max() <= MAX_ABS_OF_SCALE * scale
    starts, widths = np.array([0]), np.array([3])
    want = accept_greedy(inputs[None], greedy_matrix(ref.sampled, ref.logit_rows, starts, widths, step.padded_rows),
                         widths)
    got = accept_greedy(inputs[None], greedy_matrix(out.sampled, out.logit_rows, starts, widths, step.padded_rows),
                        widths)
    assert want.accepted.tolist() == [2]                  # the right draft kept, the wrong one rejected
    if (got.accepted != want.accepted).any() or (got.bonus != want.bonus).any():
        top2 = np.sort(ref.logits, axis=-1)[:, -2:]
        margin = float((top2[:, 1] - top2[:, 0]).min())
        # one bf16 step of the largest logit (2**-7 relative) can reorder the top two
        assert margin <= BF16_RTOL * scale, (got.accepted, want.accepted, got.bonus, want.bonus)
        warnings.warn(f"pypto and reference accept differently at a near-tie (margin {margin:.3e})", stacklevel=1)


def test_mixed_step_on_pypto_reads_the_persistent_tables_as_the_full_form():
    """The same mixed step (a verify request after a prefilled context, another request's first chunk) on the
    pypto backend, built with ``build_step`` and read through the persistent tables (the kernels get the [S, w_p]
    tables and each request's slot), equals the full form on pypto: logits, samples and every cache array. The
    kernels gather the same cache rows through either table, so the results are bit for bit equal."""
    cfg = TINY_DSPARK
    weights = ModelWeights.random(cfg, seed=3)
    rng = np.random.default_rng(0)
    prompt, other = rng.integers(0, cfg.vocab_size, 4), rng.integers(0, cfg.vocab_size, 3)
    alloc = BlockAllocator(cfg, pool_blocks_for(cfg, [16, 8], slack=4))
    caches = ModelCaches.allocate(cfg, alloc.pool_blocks, precision="a2a3")
    builder = BatchBuilder(cfg, PaddingPolicy(), alloc)
    builder.add(0, num_cached=0, num_new=4, token_ids=prompt)
    first = builder.build_step()
    builder.commit(first)
    prefill(first, first.token_ids, weights, caches, tables=alloc.persistent, precision="a2a3")
    inputs = rng.integers(0, cfg.vocab_size, 3)                         # an anchor and two drafts
    for _ in range(2):
        builder.add_verify(0, num_cached=4, token_ids=inputs)
        builder.add(1, num_cached=0, num_new=3, token_ids=other)
        if _ == 0:
            batch = builder.build()
    step = builder.build_step()
    mirror = alloc.persistent.copy()
    mirror.apply(step)                                                  # the device mirror, advanced by the delta
    full_caches, pers_caches = caches.copy(), caches.copy()
    want = prefill(batch, batch.token_ids, weights, full_caches, precision="a2a3", backend="pypto")
    got = prefill(step, step.token_ids, weights, pers_caches, tables=mirror, precision="a2a3", backend="pypto")
    assert got.batch is step                         # the step's own rows, never its full form
    np.testing.assert_array_equal(got.batch.row_request, batch.row_request)
    for name in ("logit_rows", "logits", "sampled", "hidden"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for name, array in pers_caches.arrays().items():
        np.testing.assert_array_equal(array, full_caches.arrays()[name], err_msg=name)
