"""Foreign load of a prefill pool: the work other routers queued on its ranks.

Several router replicas in front of one pool each keep a ledger of the requests *they* routed;
every rank runs the queues of all of them. :meth:`lbkit.prefill.PrefillBalancer.set_foreign_load`
takes the others' load per flat rank, from whatever transport the replicas share (a store such
as :class:`lbkit.replicas.RedisStore`, a broadcast, engine reports): the remaining quota
(``quota_s``, what the least-load rules compare), the step-time work (``work_s``: the quota plus
the routed-expert seconds of the remaining tokens, what the lockstep rule plans with) and the
requests (``num_requests``: a rank holding one makes its engine busy). It counts in every
routing decision and in the rounds' re-plan, but in no request of the ledger: progress, finishes
and reports move only the own requests, and the foreign load changes only when it is set again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, as_int_array

__all__ = ["ForeignLoad", "foreign_iv"]


class ForeignLoad(NamedTuple):
    """Load of other routers per flat rank: quota and work (float64, seconds) and requests
    (int64), each of shape (num_ranks,)."""

    quota_s: np.ndarray
    work_s: np.ndarray
    num_requests: np.ndarray


def foreign_iv(quota_s: Any, work_s: Any, num_requests: Any, n: int) -> ForeignLoad:
    """Validate a foreign load of ``n`` flat ranks: finite non-negative seconds, non-negative
    integer requests (``ValueError``/``TypeError`` naming the argument)."""
    out = []
    for name, value in (("quota_s", quota_s), ("work_s", work_s)):
        arr = as_float_array(value, name, shape=(n,), nonnegative=True)
        if not np.isfinite(arr).all():
            raise ValueError(f"{name}: must be finite")
        out.append(np.array(arr, dtype=np.float64))
    count = as_int_array(num_requests, "num_requests", shape=(n,), min_value=0)
    return ForeignLoad(out[0], out[1], count.astype(np.int64, copy=True))
