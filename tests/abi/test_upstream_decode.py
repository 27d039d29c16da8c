"""Upstream's decode rectangle (spec 5.8.5): a verify-only step to and from B lanes x S rows, checked both ways."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_abi import BatchBuilder, BlockAllocator, PaddingPolicy, PoolBlocks
from dspark_abi.errors import ABIError
from dspark_abi.presets import TINY_DSPARK
from dspark_abi.upstream import from_upstream_decode, to_upstream_decode

C = TINY_DSPARK
S = C.max_verify_width


def _verify_step(tp=2, widths=(4, 1, 3), starts=(40, 7, 100)):
    builder = BatchBuilder(C, PaddingPolicy(tp_size=tp), BlockAllocator(C, PoolBlocks.uniform(256)))
    for rid, s in enumerate(starts):
        builder.add(10 + rid, 0, s, token_ids=[(rid + i) % 97 for i in range(s)])
    builder.commit(builder.build())
    for rid, (s, w) in enumerate(zip(starts, widths, strict=True)):
        builder.add_verify(10 + rid, s, [(3 * rid + j) % 97 for j in range(w)])
    return builder.build()


def test_round_trip_with_idle_lanes():
    batch = _verify_step()
    rect = to_upstream_decode(batch, lanes=5)
    assert rect["active_widths"].tolist() == [4, 1, 3, 0, 0]
    assert rect["kv_seq_lens"].tolist() == [44, 8, 103, 0, 0]
    assert rect["positions"].reshape(5, S)[:3].tolist() == [[40, 41, 42, 43], [7, 0, 0, 0], [100, 101, 102, 0]]
    inactive = np.tile(np.arange(S), 5) >= np.repeat(rect["active_widths"], S)
    for name, a in rect.items():
        if name.endswith("_slot_mapping"):
            assert (a[inactive] == -1).all() and (a[~inactive] >= 0).all() == (not name.startswith(("csa_cmp",
                                                                                                   "hca_cmp", "idx")))
    back = from_upstream_decode(rect, C, batch.policy, batch.pool_blocks, request_ids=batch.request_ids)
    assert back == batch


def test_prefill_chunks_have_no_decode_form():
    builder = BatchBuilder(C, PaddingPolicy(), BlockAllocator(C, PoolBlocks.uniform(256)))
    builder.add(0, 0, 3, token_ids=[1, 2, 3])
    with pytest.raises(ABIError) as err:
        to_upstream_decode(builder.build())
    assert err.value.codes == {"verify.width"}
    with pytest.raises(ABIError) as err:
        to_upstream_decode(_verify_step(), lane_width=3)
    assert err.value.codes == {"verify.drafts"}
    with pytest.raises(ABIError) as err:
        to_upstream_decode(_verify_step(), lanes=2)
    assert err.value.codes == {"upstream.shape"}


def _edited(**changes):
    batch = _verify_step()
    rect = {k: v.copy() for k, v in to_upstream_decode(batch, lanes=4).items()}
    for name, (index, value) in changes.items():
        rect[name][index] = value
    return batch, rect


@pytest.mark.parametrize(("changes", "code"), [
    ({"active_widths": (0, S + 1)}, "verify.width"),
    ({"kv_seq_lens": (1, 9)}, "positions.not_contiguous"),   # anchor 8 by kv_seq_lens, 7 by its position
    ({"kv_seq_lens": (1, 1)}, "verify.width"),              # anchor 0: nothing committed
    ({"kv_seq_lens": (3, 5)}, "verify.width"),          # an idle lane with a length
    ({"positions": (1, 42)}, "positions.not_contiguous"),
    # a clamped duplicate of the last position on an inactive row must not carry a real slot
    ({"positions": (S + 1, 7), "ori_slot_mapping": (S + 1, 5)}, "padding.slot"),
])
def test_bad_rectangles_are_refused_before_conversion(changes, code):
    batch, rect = _edited(**changes)
    with pytest.raises(ABIError) as err:
        from_upstream_decode(rect, C, batch.policy, batch.pool_blocks)
    assert err.value.codes == {code}


def test_wrong_dtypes_and_shapes_are_upstream_shape():
    batch, rect = _edited()
    with pytest.raises(ABIError) as err:
        from_upstream_decode(rect | {"positions": rect["positions"].astype(np.int64)}, C, batch.policy,
                             batch.pool_blocks)
    assert err.value.codes == {"upstream.shape"}
    with pytest.raises(ABIError) as err:
        from_upstream_decode(rect | {"positions": rect["positions"][:-1]}, C, batch.policy, batch.pool_blocks)
    assert err.value.codes == {"upstream.shape"}
    missing = {k: v for k, v in rect.items() if k != "kv_seq_lens"}
    with pytest.raises(ABIError) as err:
        from_upstream_decode(missing, C, batch.policy, batch.pool_blocks)
    assert err.value.codes == {"array.missing"}
