"""Rank choice for one decode request: the two-dimensional default, its variants and baselines.

A decode engine's ranks step together, and a rank with ``B`` requests holding ``S`` KV tokens
steps in about ``a + b*B + k*S`` seconds (``a + max(b*B, k*S)`` with two overlapping
micro-batches). Balancing only ``B`` lets long contexts pile up on a few ranks; balancing only
``S`` piles up short requests. Both two-dimensional rules balance both. The default,
``"min_max"``, places a request where the larger of its rank's two normalised loads after
placement, ``max((B_r + 1)/Bhat, (S_r + s)/Shat)``, is lowest: the greedy step of minimising the
slowest rank's binding dimension. ``"sum_of_squares"`` places a request of ``s`` KV tokens at

.. math::

    \\arg\\min_r \\; \\frac{2B_r + 1}{\\hat B^2} + \\frac{s\\,(2S_r + s)}{\\hat S^2},

the exact increase of :math:`\\sum_r (B_r/\\hat B)^2 + (S_r/\\hat S)^2`, i.e. the greedy step of
minimising that sum of squares. With common normalisers this is
:math:`\\arg\\min_r B_r/\\hat B^2 + s\\,S_r/\\hat S^2`: a short request goes to a rank with few
requests even if its KV is large, a long one to a rank with little KV.

Why ``min_max`` is the default: on the decode goodput at a TPOT of 50 ms of
``benchmarks/decode_goodput.py`` (one 64-rank engine, KV capacity and back-pressure, 32-128
running requests per rank) it is at least as high as ``sum_of_squares`` on every trace measured
(Mooncake conversation, Azure 2023 conversation, the built-in workload); see
``docs/simulator.md``.

Normalisers (``scale``)
    ``"mean"`` (default): :math:`\\hat B, \\hat S` are the means over eligible ranks *including
    the new request*, so :math:`\\hat B \\ge 1/n > 0`; :math:`\\hat S = 0` only when no eligible
    rank holds KV and ``s = 0``, and then the KV term is 0 for every rank (it is dropped).
    ``"capacity"``: a rank's finite, positive maximum batch and KV tokens; a dimension without
    such a capacity falls back to the mean. Per-rank normalisers make the constant terms differ
    between ranks, which is why the score keeps them.

Every policy shares one signature, ``policy(num_requests, kv_tokens, new_kv_tokens, /, *,
max_batch, max_kv_tokens, eligible, scale, cost, cursor, rng)``, and ignores the knobs it does not
use, so that they are interchangeable (:data:`POLICIES`). Feasibility is common to all: a rank is
a candidate when it is eligible, has a batch slot (``B + 1 <= max_batch``) and free KV
(``S + s <= max_kv_tokens``). Ties go to the lowest rank index, after the secondary score where a
policy has one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.cost import DecodeCost
from lbkit.core.validation import as_rng, check_choice, check_int
from lbkit.decode import _kernels as K
from lbkit.decode._state import params, state_iv
from lbkit.decode.reasons import reason_of

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Decision",
    "cost_weighted",
    "least_kv",
    "least_requests",
    "min_max",
    "pick_rank",
    "random",
    "round_robin",
    "sum_of_squares",
]


class Decision(NamedTuple):
    """A routing decision: ``rank`` (-1 when refused) and ``reason`` (see :mod:`.reasons`)."""

    rank: int
    reason: str


def _decide(
    code: int,
    num_requests: Any,
    kv_tokens: Any,
    new_kv_tokens: Any,
    max_batch: Any,
    max_kv_tokens: Any,
    eligible: Any,
    scale: Any,
    cost: Any,
    cursor: Any,
    rng: Any,
) -> Decision:
    X = state_iv(num_requests, kv_tokens, max_batch, max_kv_tokens, eligible)
    n = X.shape[1]
    s = check_int(new_kv_tokens, "new_kv_tokens", min_value=0)
    P = params(code, scale, cost)
    cursor = check_int(cursor, "cursor", min_value=0, max_value=n - 1)
    if code == K.RANDOM:
        X[K.ROW_KEY] = as_rng(rng).random(n)
    bhat, shat = K.score_means(X, 1.0, float(s), False)
    r = K.choose(
        X, float(s), float(s), code, bool(P[K.P_CAPSCALE]), bhat, shat,
        P[K.P_A], P[K.P_B], P[K.P_K], bool(P[K.P_CMAX]), cursor, False,
    )  # fmt: skip
    return Decision(int(r) if r >= 0 else -1, reason_of(int(r)))


def _policy(code: int, name: str, summary: str) -> Callable[..., Decision]:
    def policy(
        num_requests: Any,
        kv_tokens: Any,
        new_kv_tokens: int,
        /,
        *,
        max_batch: Any = None,
        max_kv_tokens: Any = None,
        eligible: Any = None,
        scale: str = "mean",
        cost: DecodeCost | None = None,
        cursor: int = 0,
        rng: np.random.Generator | int | None = None,
    ) -> Decision:
        return _decide(
            code, num_requests, kv_tokens, new_kv_tokens, max_batch, max_kv_tokens, eligible,
            scale, cost, cursor, rng,
        )  # fmt: skip

    policy.__name__ = policy.__qualname__ = name
    policy.__doc__ = summary + _SHARED_DOC
    return policy


_SHARED_DOC = """

    Parameters
    ----------
    num_requests : array_like of int, shape (ranks,)
        Running requests per rank, ``B_r`` (>= 0).
    kv_tokens : array_like of int, shape (ranks,)
        KV tokens held per rank, ``S_r`` (>= 0).
    new_kv_tokens : int
        KV tokens of the request to place, ``s`` (>= 0; its prompt plus anything generated).
    max_batch, max_kv_tokens : int or array_like of int, shape (ranks,), optional
        Capacities (>= 0); ``None`` means no limit.
    eligible : array_like of bool, shape (ranks,), optional
        False for ranks out of service. Default: all eligible.
    scale : {"mean", "capacity"}
        Normalisers of the two-dimensional scores (see the module documentation).
    cost : DecodeCost, optional
        Step-cost model of the ``"cost"`` policy (default: the ``h800_dsv3`` decode preset with
        ``combine="max"``).
    cursor : int
        First rank that ``"round_robin"`` considers (the caller keeps it: ``rank + 1`` mod
        ranks after each placement).
    rng : numpy Generator, int seed or None
        Randomness of ``"random"`` (``None`` means seed 0).

    Returns
    -------
    Decision
        ``(rank, "placed")``, or ``(-1, reason)`` when no rank is feasible (see
        :mod:`lbkit.decode.reasons`).

    Raises
    ------
    ValueError, TypeError
        Negative counts or tokens, wrong shapes, zero ranks, negative capacities, unknown
        ``scale``, a cursor outside ``[0, ranks)``.

    Runtime complexity: O(ranks).
"""

sum_of_squares = _policy(
    K.SUM_OF_SQUARES,
    "sum_of_squares",
    """Greedy step of minimising ``sum_r (B_r/Bhat)^2 + (S_r/Shat)^2``.

    Examples
    --------
    >>> # rank 0: 4 short requests; rank 1: 2 long ones
    >>> b, s = np.array([4, 2]), np.array([4000, 12000])
    >>> sum_of_squares(b, s, 100)   # short: fewer requests matter more
    Decision(rank=1, reason='placed')
    >>> sum_of_squares(b, s, 9000)  # long: less KV matters more
    Decision(rank=0, reason='placed')""",
)

min_max = _policy(
    K.MIN_MAX,
    "min_max",
    """Greedy step of minimising ``max_r max(B_r/Bhat, S_r/Shat)`` (L-infinity; the default).

    Picks the rank whose own normalised maximum after placement is lowest, which also minimises
    the maximum over all ranks; ties go to the lower sum of both normalised loads.

    Examples
    --------
    >>> min_max([4, 2], [4000, 12000], 9000)
    Decision(rank=0, reason='placed')""",
)

cost_weighted = _policy(
    K.COST,
    "cost",
    """Lowest modelled step time after placement, ``cost.step_time(B_r + 1, S_r + s)``.

    With ``combine="max"`` a rank is charged only its binding dimension; ties (e.g. every rank
    bound by its request count) go to the lower ``b*B + k*S``.

    Examples
    --------
    >>> from lbkit.core import DecodeCost
    >>> unit = DecodeCost(a=1.0, b=1.0, k=0.001, combine="max")
    >>> cost_weighted([4, 2], [4000, 1000], 500, cost=unit)
    Decision(rank=1, reason='placed')""",
)

round_robin = _policy(
    K.ROUND_ROBIN,
    "round_robin",
    """Baseline: the first feasible rank at or after ``cursor`` (cyclically).

    Examples
    --------
    >>> round_robin([0, 0, 0], [0, 0, 0], 10, cursor=2)
    Decision(rank=2, reason='placed')
    >>> round_robin([0, 5, 0], [0, 0, 0], 10, cursor=1, max_batch=5)
    Decision(rank=2, reason='placed')""",
)

least_requests = _policy(
    K.LEAST_REQUESTS,
    "least_requests",
    """Baseline: the feasible rank with the fewest requests (KV ignored).

    Examples
    --------
    >>> least_requests([3, 1, 1], [0, 9000, 10], 10)
    Decision(rank=1, reason='placed')""",
)

least_kv = _policy(
    K.LEAST_KV,
    "least_kv",
    """Baseline: the feasible rank with the fewest KV tokens (request count ignored).

    Examples
    --------
    >>> least_kv([9, 1], [100, 200], 10)
    Decision(rank=0, reason='placed')""",
)

random = _policy(
    K.RANDOM,
    "random",
    """Baseline: a feasible rank drawn uniformly with ``rng``.

    Examples
    --------
    >>> random([0, 0, 0], [0, 0, 0], 1, rng=1).reason
    'placed'
    >>> random([0, 0], [0, 0], 1, eligible=np.array([False, True]), rng=7)
    Decision(rank=1, reason='placed')""",
)

#: Every rank-choice policy by name; all share :func:`pick_rank`'s signature.
POLICIES: Mapping[str, Callable[..., Decision]] = MappingProxyType(
    {
        "sum_of_squares": sum_of_squares,
        "min_max": min_max,
        "cost": cost_weighted,
        "round_robin": round_robin,
        "least_requests": least_requests,
        "least_kv": least_kv,
        "random": random,
    }
)

#: The policy :func:`pick_rank` and :class:`~lbkit.decode.DecodeBalancer` use by default.
DEFAULT_POLICY = "min_max"

#: Kernel code of each policy name.
POLICY_CODES: Mapping[str, int] = MappingProxyType(
    {
        "sum_of_squares": K.SUM_OF_SQUARES,
        "min_max": K.MIN_MAX,
        "cost": K.COST,
        "round_robin": K.ROUND_ROBIN,
        "least_requests": K.LEAST_REQUESTS,
        "least_kv": K.LEAST_KV,
        "random": K.RANDOM,
    }
)


def pick_rank(
    num_requests: Any,
    kv_tokens: Any,
    new_kv_tokens: int,
    /,
    *,
    policy: str = DEFAULT_POLICY,
    max_batch: Any = None,
    max_kv_tokens: Any = None,
    eligible: Any = None,
    scale: str = "mean",
    cost: DecodeCost | None = None,
    cursor: int = 0,
    rng: np.random.Generator | int | None = None,
) -> Decision:
    """Rank for one decode request under ``policy`` (default: the two-dimensional rule).

    Parameters
    ----------
    num_requests : array_like of int, shape (ranks,)
        Running requests per rank, ``B_r`` (>= 0).
    kv_tokens : array_like of int, shape (ranks,)
        KV tokens held per rank, ``S_r`` (>= 0).
    new_kv_tokens : int
        KV tokens of the request to place, ``s`` (>= 0).
    policy : str, default ``DEFAULT_POLICY``
        A key of :data:`POLICIES`.
    max_batch, max_kv_tokens : int or array_like of int, shape (ranks,), optional
        Capacities per rank (>= 0); ``None`` means no limit.
    eligible : array_like of bool, shape (ranks,), optional
        False for ranks out of service.
    scale : {"mean", "capacity"}
        Normalisers of the two-dimensional scores.
    cost : DecodeCost, optional
        Step-cost model of ``policy="cost"``.
    cursor : int
        Start rank of ``"round_robin"``.
    rng : numpy Generator, int seed or None
        Randomness of ``"random"``.

    Returns
    -------
    Decision
        ``(rank, "placed")`` or ``(-1, reason)``; a refused request is the caller's to keep.

    Raises
    ------
    ValueError, TypeError
        Unknown policy or any invalid argument (see the policies' documentation).

    Runtime complexity: O(ranks).

    Examples
    --------
    >>> b, s = np.array([4, 2, 3]), np.array([4000, 12000, 6000])
    >>> pick_rank(b, s, 100), pick_rank(b, s, 9000)  # rank 2's larger load is the lowest
    (Decision(rank=2, reason='placed'), Decision(rank=2, reason='placed'))
    >>> [pick_rank(b, s, kv, policy="sum_of_squares").rank for kv in (100, 9000)]
    [1, 0]
    >>> pick_rank(b, s, 100, policy="least_kv")
    Decision(rank=0, reason='placed')
    >>> pick_rank(b, s, 9000, max_kv_tokens=[30000, 30000, 14000])  # rank 2 has no room
    Decision(rank=0, reason='placed')
    >>> pick_rank(b, s, 9000, max_kv_tokens=12000)
    Decision(rank=-1, reason='kv_full')
    >>> pick_rank(b, s, 20000, max_kv_tokens=15000)
    Decision(rank=-1, reason='too_long')
    >>> pick_rank(b, s, 100, max_batch=[4, 2, 3])
    Decision(rank=-1, reason='batch_full')
    """
    fn = POLICIES[check_choice(policy, "policy", tuple(POLICIES))]
    return fn(
        num_requests, kv_tokens, new_kv_tokens, max_batch=max_batch, max_kv_tokens=max_kv_tokens,
        eligible=eligible, scale=scale, cost=cost, cursor=cursor, rng=rng,
    )  # fmt: skip
