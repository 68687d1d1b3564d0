"""Reason codes of the decode balancer's decisions, documented in one place.

Every decision of :func:`lbkit.decode.pick_rank`, :func:`lbkit.decode.assign_batch` and
:meth:`lbkit.decode.DecodeBalancer.admit` carries one of these strings. A refused request
(rank ``-1``) is never dropped: the caller keeps it and decides (queue, retry, send elsewhere).

``PLACED``
    The request went to the returned rank.
``NO_RANK``
    No rank is eligible (all out of service, draining, or masked by ``eligible``).
``TOO_LONG``
    The request's KV tokens exceed the KV capacity of every eligible rank: it can never be placed
    on these ranks, even when they are empty.
``BATCH_FULL``
    Every eligible rank that could hold the request's KV is at its maximum batch size.
``KV_FULL``
    Every eligible rank that could hold the request's KV lacks the free KV tokens now.
``FULL``
    Each eligible rank lacks either a batch slot or the free KV tokens, but neither reason holds
    for all of them.

When several refusal reasons apply, the first in the order ``NO_RANK``, ``TOO_LONG``,
``BATCH_FULL``, ``KV_FULL``, ``FULL`` is reported.
"""

from __future__ import annotations

__all__ = [
    "BATCH_FULL",
    "FULL",
    "KV_FULL",
    "NO_RANK",
    "PLACED",
    "REASONS",
    "REFUSALS",
    "TOO_LONG",
    "reason_of",
]

PLACED = "placed"
NO_RANK = "no_rank"
TOO_LONG = "too_long"
BATCH_FULL = "batch_full"
KV_FULL = "kv_full"
FULL = "full"

#: Every reason code; ``REASONS[0]`` is the success code.
REASONS: tuple[str, ...] = (PLACED, NO_RANK, TOO_LONG, BATCH_FULL, KV_FULL, FULL)
#: The refusal codes, in the order of precedence.
REFUSALS: tuple[str, ...] = REASONS[1:]


def reason_of(code: int) -> str:
    """Reason string of a kernel result: a rank (>= 0) is ``PLACED``; ``-k`` is ``REASONS[k]``.

    Examples
    --------
    >>> reason_of(3), reason_of(-1), reason_of(-4)
    ('placed', 'no_rank', 'kv_full')
    """
    return PLACED if code >= 0 else REASONS[-code]
