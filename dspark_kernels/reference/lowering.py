"""Stage 1 (reference): the request of every query row.

Both backends read the ABI's own answer, ``batch.row_request`` (the batch's request record, computed once per
batch), through the plan's rows. The pypto kernel :mod:`dspark_kernels.pypto.lowering` computes the same ids from
``query_start_loc`` on the device and is checked against them; a forward does not run it.
"""

from __future__ import annotations

import numpy as np

from dspark_kernels.model.plan import BatchPlan


def local_request_ids(plan: BatchPlan) -> np.ndarray:
    """[rows] int32 request of each of the plan's query rows (``[P]`` or the rank's ``[L]``); -1 on padding."""
    return plan.query_request
