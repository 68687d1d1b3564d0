"""Offered prefill utilisation of a trace, and the time scaling that sets it.

The prefill work of a trace is ``W = sum_i (cost.quota(uncached_i, cached_i) + b_moe * moe_lb *
uncached_i)`` rank-seconds (local plus shared work, the fixed cost per step excluded); arrivals
spanning ``D`` seconds offer ``W / (D * N)`` to ``N`` prefill ranks. The trace is time-scaled by
``f = W / (U * N * D)`` so that this offered utilisation (the pool's busy share) equals ``U``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.validation import check_int, check_real
from lbkit.sim.traces import Trace

__all__ = ["prefill_work_s", "scale_to_utilization", "utilization_factor"]


def prefill_work_s(trace: Trace, cost: QuadraticCost) -> np.ndarray:
    """Quota of every request: ``cost.quota(total - cached, cached)`` seconds of one rank.

    Local work only (what a router can move); the shared expert work is not in it.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace: must be a Trace, got {type(trace).__name__}")
    if not isinstance(cost, QuadraticCost):
        raise TypeError(f"cost: must be a QuadraticCost, got {type(cost).__name__}")
    return np.asarray(
        cost.quota(trace.total_tokens - trace.cached_tokens, trace.cached_tokens), dtype=np.float64
    ).reshape(-1)


def utilization_factor(
    trace: Trace, utilization: float, /, *, num_ranks: int, cost: QuadraticCost
) -> float:
    """Time-scaling factor ``f = W / (U * N * D)`` that makes the offered utilisation ``U``.

    ``W`` is the trace's prefill work in rank-seconds: its total quota (local work) plus the
    shared expert work ``b_moe * moe_lb`` per uncached token (which some rank of the engine
    runs), so that ``U`` is the pool's busy share; ``D`` is the span of its arrivals, ``N =
    num_ranks``. Multiplying every arrival by ``f`` makes ``W / (f D N) = U``.

    Raises
    ------
    ValueError
        ``utilization <= 0``, ``num_ranks < 1``, fewer than two distinct arrival times.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> t = Trace(arrival_s=[0.0, 10.0], total_tokens=[1000, 1000], output_tokens=[1, 1])
    >>> utilization_factor(t, 0.5, num_ranks=2, cost=PRESETS["unit"].prefill)
    300.0
    """
    u = check_real(utilization, "utilization", min_value=0.0, strict_min=True)
    n = check_int(num_ranks, "num_ranks", min_value=1)
    work = float(prefill_work_s(trace, cost).sum())
    work += cost.moe_s_per_token * float((trace.total_tokens - trace.cached_tokens).sum())
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) if len(trace) else 0.0
    if not span > 0:
        raise ValueError(
            "trace: arrivals must span a positive time to be scaled to a utilisation "
            f"(got {len(trace)} requests over {span} s)"
        )
    return work / (u * n * span)


def scale_to_utilization(
    trace: Trace, utilization: float, /, *, num_ranks: int, cost: QuadraticCost
) -> tuple[Trace, float]:
    """The trace time-scaled to offered prefill utilisation ``utilization``, and the factor.

    Arrivals are shifted to start at 0 before scaling.
    """
    f = utilization_factor(trace, utilization, num_ranks=num_ranks, cost=cost)
    shifted = trace.arrival_s - trace.arrival_s[0]
    return dataclasses.replace(trace, arrival_s=shifted * f), f
