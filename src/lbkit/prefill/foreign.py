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

With a shared store (:class:`~lbkit.core.replica.ReplicaLink`), a replica publishes its own load
per flat rank as :func:`store_columns` (integers: requests, quota and work in nanoseconds) and
takes the store's view of the others' as its foreign load (:func:`set_from_store`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, as_int_array
from lbkit.prefill.ledger import Ledger

__all__ = ["STORE_NS", "ForeignLoad", "foreign_iv", "set_from_store", "store_columns"]

#: Units of the quota and work a store holds (integers): nanoseconds.
STORE_NS = 1e9


class ForeignLoad(NamedTuple):
    """Load of other routers per flat rank: quota and work (float64, seconds) and requests
    (int64), each of shape (num_ranks,)."""

    quota_s: np.ndarray
    work_s: np.ndarray
    num_requests: np.ndarray


#: Largest foreign load per rank: requests, and seconds of quota or work. Far above any pool,
#: and low enough that no sum with the ledger's own load can overflow.
MAX_FOREIGN_REQUESTS = 2**40
MAX_FOREIGN_S = 2.0**60


def foreign_iv(quota_s: Any, work_s: Any, num_requests: Any, n: int) -> ForeignLoad:
    """Validate a foreign load of ``n`` flat ranks: finite non-negative seconds up to
    :data:`MAX_FOREIGN_S`, non-negative integer requests up to :data:`MAX_FOREIGN_REQUESTS`
    (``ValueError``/``TypeError`` naming the argument)."""
    out = []
    for name, value in (("quota_s", quota_s), ("work_s", work_s)):
        arr = as_float_array(value, name, shape=(n,), nonnegative=True)
        if not (arr <= MAX_FOREIGN_S).all():
            raise ValueError(f"{name}: must be finite and at most 2**60 s")
        out.append(np.array(arr, dtype=np.float64))
    count = as_int_array(
        num_requests, "num_requests", shape=(n,), min_value=0, max_value=MAX_FOREIGN_REQUESTS
    )
    return ForeignLoad(out[0], out[1], count.astype(np.int64, copy=True))


def store_columns(led: Ledger) -> np.ndarray:
    """The ledger's own load per flat rank as a store holds it: rows requests, quota and work
    (nanoseconds), int64, shape (3, num_ranks)."""
    quota, work, count = led.own_flat()
    return np.stack([count, np.rint(quota * STORE_NS).astype(np.int64),
                     np.rint(work * STORE_NS).astype(np.int64)])  # fmt: skip


def set_from_store(led: Ledger, view: np.ndarray) -> None:
    """Make a store's view of the other replicas' load (rows as :func:`store_columns`) the
    ledger's foreign load."""
    led.set_foreign(view[1] / STORE_NS, view[2] / STORE_NS, view[0].copy())
