"""Stage 1 (reference): the request of every query row.

The reference reads the ABI's own answer: ``batch.row_request`` (:func:`dspark_abi.lowering.lower_local_request_ids`
over all group rows, O(P + R), computed once per batch), through the plan's rows. The pypto backend computes the
same ids with its kernel from ``query_start_loc`` (:mod:`dspark_kernels.pypto.lowering`), once per plan.
"""

from __future__ import annotations

import numpy as np

from dspark_kernels.model.plan import BatchPlan


def local_request_ids(plan: BatchPlan) -> np.ndarray:
    """[rows] int32 request of each of the plan's query rows (``[P]`` or the rank's ``[L]``); -1 on padding."""
    return plan.query_request
