"""Goodput at SLO: the highest arrival rate at which a policy still serves its users well.

A request **meets its SLO** (SPEC section 8) when

- its time to first token is at most ``max(slo.ttft_s, slo.ttft_slowdown * alone_s)``, where
  ``alone_s`` is its prefill time alone on an idle rank (long prompts get a budget in proportion
  to their own work, short ones at least ``ttft_s``), and
- its time per output token after the first is at most ``slo.tpot_s`` (a request with one output
  token has no TPOT and meets this part).

A refused request, or one still in flight, does not meet it. The **goodput** of a policy is the
highest arrival rate, the trace's arrivals scaled in time, at which at least ``slo.attainment``
of the requests meet their SLO. :func:`find_goodput` finds it by bracketing and bisection on a
log scale to a relative tolerance (1% by default). Attainment is not guaranteed to be monotone
in the rate (a burst may line up differently), so the result is a rate that passes with a rate at
most ``rel_tol`` above it that fails; every evaluated point is returned.

Examples
--------
>>> import numpy as np
>>> slo = Slo(ttft_s=2.0, ttft_slowdown=4.0, tpot_s=0.05)
>>> slo_met([1.0, 3.0, 3.0, 1.0], [0.1, 0.5, 1.0, 0.1], [0.01, 0.01, 0.01, 0.06], slo=slo).tolist()
[True, False, True, False]
>>> def share(rate):  # a made-up attainment curve: served well up to 10 requests/s
...     return 1.0 if rate <= 10.0 else 0.5
>>> r = find_goodput(share, start_rate=3.0, target=0.99)
>>> 9.9 <= r.requests_per_s <= 10.0, r.bracketed
(True, True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, check_int, check_real

__all__ = [
    "DEFAULT_SLO",
    "GoodputSearch",
    "Slo",
    "attainment",
    "find_goodput",
    "rate_of",
    "slo_met",
    "with_rate",
]

#: Largest factor by which the bracketing search moves away from its start rate (2^12).
MAX_BRACKET_STEPS = 12


@dataclasses.dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objective of a request (SPEC section 8 defaults).

    Parameters
    ----------
    ttft_s : float, default 2.0
        TTFT every request may take (seconds, > 0).
    ttft_slowdown : float, default 4.0
        TTFT may also be this multiple of the request's prefill time alone (>= 0).
    tpot_s : float, default 0.05
        Time per output token after the first (seconds, > 0).
    attainment : float, default 0.99
        Share of requests that must meet the SLO for a rate to count (0 < a <= 1).

    Examples
    --------
    >>> Slo().tpot_s
    0.05
    >>> Slo(attainment=1.5)
    Traceback (most recent call last):
    ...
    ValueError: attainment: must be <= 1.0, got 1.5
    """

    ttft_s: float = 2.0
    ttft_slowdown: float = 4.0
    tpot_s: float = 0.05
    attainment: float = 0.99

    def __post_init__(self) -> None:
        pos = {"min_value": 0.0, "strict_min": True}
        object.__setattr__(self, "ttft_s", check_real(self.ttft_s, "ttft_s", **pos))
        object.__setattr__(
            self, "ttft_slowdown", check_real(self.ttft_slowdown, "ttft_slowdown", min_value=0.0)
        )
        object.__setattr__(self, "tpot_s", check_real(self.tpot_s, "tpot_s", **pos))
        object.__setattr__(
            self, "attainment", check_real(self.attainment, "attainment", max_value=1.0, **pos)
        )

    def as_dict(self) -> dict[str, float]:
        """The four figures by name (for JSON reports)."""
        return dataclasses.asdict(self)


#: The SPEC section 8 defaults: TTFT 2 s or 4x the prefill alone, TPOT 50 ms, 99% of requests.
DEFAULT_SLO = Slo()


def _times(value: Any, name: str) -> np.ndarray:
    # Latencies: real, one-dimensional; nan marks "not applicable" and is allowed.
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: must be an array of real numbers") from None
    if a.ndim != 1:
        raise ValueError(f"{name}: must be one-dimensional, got {a.ndim} dimensions")
    if (a < 0).any():
        raise ValueError(f"{name}: must be non-negative (nan where not applicable)")
    return a


def slo_met(ttft_s: Any, alone_s: Any, tpot_s: Any, /, *, slo: Slo = DEFAULT_SLO) -> np.ndarray:
    """Which requests meet ``slo`` (see the module docstring).

    Parameters
    ----------
    ttft_s : array_like, shape (n,)
        Time to first token of each request, seconds; ``nan`` for a request that was refused or
        did not finish (never meets the SLO).
    alone_s : array_like, shape (n,)
        Prefill time of each request alone on an idle rank, seconds.
    tpot_s : array_like, shape (n,)
        Time per output token after the first, seconds; ``nan`` where the request has a single
        output token (nothing to meet). Pass ``np.zeros(n)`` to judge TTFT alone.

    Returns
    -------
    ndarray of bool, shape (n,)

    Runtime complexity: O(n).
    """
    if not isinstance(slo, Slo):
        raise TypeError(f"slo: must be a Slo, got {type(slo).__name__}")
    ttft = _times(ttft_s, "ttft_s")
    alone = as_float_array(alone_s, "alone_s", ndim=1, nonnegative=True)
    tpot = _times(tpot_s, "tpot_s")
    if not (ttft.shape == alone.shape == tpot.shape):
        raise ValueError(
            f"ttft_s, alone_s, tpot_s: must have equal lengths, got {ttft.shape[0]}, "
            f"{alone.shape[0]}, {tpot.shape[0]}"
        )
    limit = np.maximum(slo.ttft_s, slo.ttft_slowdown * alone)
    with np.errstate(invalid="ignore"):
        ttft_ok = ttft <= limit  # nan (refused, unfinished) compares False
        tpot_ok = np.isnan(tpot) | (tpot <= slo.tpot_s)
    return ttft_ok & tpot_ok


def attainment(ttft_s: Any, alone_s: Any, tpot_s: Any, /, *, slo: Slo = DEFAULT_SLO) -> float:
    """Share of requests that meet ``slo`` (1.0 for no requests); see :func:`slo_met`.

    Examples
    --------
    >>> attainment([1.0, 9.0], [0.1, 0.1], [0.01, 0.01])
    0.5
    """
    met = slo_met(ttft_s, alone_s, tpot_s, slo=slo)
    return float(met.mean()) if met.size else 1.0


class GoodputSearch(NamedTuple):
    """Result of :func:`find_goodput`.

    Attributes
    ----------
    requests_per_s : float
        The highest rate found to pass (0.0 if no rate tried passed).
    attainment : float
        Attainment measured at that rate (``nan`` if none passed).
    evaluations : tuple of (float, float)
        Every (rate, attainment) evaluated, in order.
    bracketed : bool
        Whether a failing rate at most ``rel_tol`` above the result was found (False: the
        search hit its bounds, e.g. every rate passed up to ``max_rate``).
    """

    requests_per_s: float
    attainment: float
    evaluations: tuple[tuple[float, float], ...]
    bracketed: bool


def find_goodput(
    evaluate: Callable[[float], float],
    /,
    *,
    start_rate: float,
    target: float = DEFAULT_SLO.attainment,
    rel_tol: float = 0.01,
    lower_rate: float | None = None,
    upper_rate: float | None = None,
) -> GoodputSearch:
    """Highest rate at which ``evaluate(rate)`` (an attainment in [0, 1]) is at least ``target``.

    Brackets from ``start_rate`` by factors of 2 (at most :data:`MAX_BRACKET_STEPS` times, and
    within ``[lower_rate, upper_rate]`` when given), then bisects on a log scale until the
    failing and passing rates are within ``rel_tol`` of each other.

    Parameters
    ----------
    evaluate : callable(rate) -> float
        Attainment at an arrival rate (requests per second). Called ``O(log(1/rel_tol))`` times.
    start_rate : float
        First rate tried (> 0); a good guess (e.g. a known lower bound) saves evaluations.
    target : float, default 0.99
    rel_tol : float, default 0.01
    lower_rate, upper_rate : float, optional
        Known bounds: a rate below ``lower_rate`` is taken as passing without being evaluated is
        *not* assumed; the bounds only stop the bracketing.

    Returns
    -------
    GoodputSearch

    Runtime complexity: O(bracketing steps + log2(log(hi/lo) / log(1 + rel_tol))) evaluations.
    """
    rate = check_real(start_rate, "start_rate", min_value=0.0, strict_min=True)
    target = check_real(target, "target", min_value=0.0, strict_min=True, max_value=1.0)
    rel_tol = check_real(rel_tol, "rel_tol", min_value=0.0, strict_min=True)
    lo_bound = 0.0 if lower_rate is None else check_real(lower_rate, "lower_rate", min_value=0.0)
    hi_bound = math.inf if upper_rate is None else check_real(upper_rate, "upper_rate")
    if not lo_bound <= rate <= hi_bound:
        raise ValueError(
            f"start_rate: must lie within [lower_rate, upper_rate], got {rate} outside "
            f"[{lo_bound}, {hi_bound}]"
        )
    evals: list[tuple[float, float]] = []

    def run(r: float) -> float:
        a = float(evaluate(r))
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"evaluate: must return an attainment in [0, 1], got {a} at {r}")
        evals.append((r, a))
        return a

    a = run(rate)
    if a >= target:
        lo, lo_a, hi = rate, a, math.nan
        for _ in range(MAX_BRACKET_STEPS):
            nxt = min(lo * 2.0, hi_bound)
            if nxt <= lo:
                break
            a = run(nxt)
            if a < target:
                hi = nxt
                break
            lo, lo_a = nxt, a
        if math.isnan(hi):
            return GoodputSearch(lo, lo_a, tuple(evals), False)
    else:
        hi, lo, lo_a = rate, math.nan, math.nan
        for _ in range(MAX_BRACKET_STEPS):
            nxt = max(hi / 2.0, lo_bound)
            if nxt >= hi or nxt <= 0.0:
                break
            a = run(nxt)
            if a >= target:
                lo, lo_a = nxt, a
                break
            hi = nxt
        if math.isnan(lo):
            return GoodputSearch(0.0, math.nan, tuple(evals), False)
    while hi > lo * (1.0 + rel_tol):
        mid = math.sqrt(lo * hi)
        a = run(mid)
        if a >= target:
            lo, lo_a = mid, a
        else:
            hi = mid
    return GoodputSearch(lo, lo_a, tuple(evals), True)


def rate_of(arrival_s: Any, /) -> float:
    """Mean arrival rate of a trace, requests per second: ``(n - 1) / span`` (``inf`` if the
    span is 0, ``nan`` for fewer than 2 requests).

    Examples
    --------
    >>> rate_of([0.0, 0.5, 1.0, 2.0])
    1.5
    """
    t = as_float_array(arrival_s, "arrival_s", ndim=1)
    if t.shape[0] < 2:
        return math.nan
    span = float(t[-1] - t[0])
    return math.inf if span <= 0 else (t.shape[0] - 1) / span


def with_rate(trace: Any, requests_per_s: float, /) -> Any:
    """``trace`` with its arrivals scaled in time so that :func:`rate_of` is ``requests_per_s``.

    Examples
    --------
    >>> from lbkit.sim.traces import Trace
    >>> t = Trace(arrival_s=[0.0, 1.0, 2.0], total_tokens=[10, 10, 10], output_tokens=[1, 1, 1])
    >>> with_rate(t, 4.0).arrival_s.tolist()
    [0.0, 0.25, 0.5]
    """
    r = check_real(requests_per_s, "requests_per_s", min_value=0.0, strict_min=True)
    check_int(len(trace), "len(trace)", min_value=2)
    base = rate_of(trace.arrival_s)
    if not math.isfinite(base):
        raise ValueError("trace: its arrivals span no time, so no rate can be set by scaling")
    return trace.time_scaled(base / r)
