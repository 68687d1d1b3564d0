"""Seeded synthetic traces calibrated on the Mooncake conversation trace.

Lengths are lognormal: ``ln(tokens) ~ Normal(mu, sigma)``. The defaults are maximum-likelihood
fits (mean and standard deviation of the logs) on the 12,031 requests of the Mooncake FAST'25
conversation trace, computed by :func:`fit_lognormal`:

=================  ========  ========
column             mu        sigma
=================  ========  ========
``input_length``   8.7367    1.1991
``output_length``  5.3364    1.3584
=================  ========  ========

Public traces hold almost no request above 128K tokens (Mooncake: 2.1% at or above 64K, none
above 126,195), while the hard cases for a prefill balancer are the long ones. ``long_share``
therefore sets the share of requests in the ``64K-256K`` and ``>=256K`` buckets explicitly: each
request independently falls in ``64K-256K`` with probability ``x``, in ``>=256K`` with
probability ``y`` and otherwise below 64K. Below 64K the input length follows the lognormal
truncated to ``[1, 65535]``; inside a long bucket it is log-uniform over the bucket (capped at
``max_tokens``).

Arrivals are a renewal process of rate ``rate_per_s`` starting at 0: exponential gaps
(``"poisson"``) or gamma gaps with coefficient of variation ``burstiness`` (``"gamma"``; CV 1 is
Poisson, larger is burstier). Input and output lengths are drawn independently (their log
correlation in the Mooncake trace is 0.05).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, as_rng, check_choice, check_int, check_real
from lbkit.sim.traces import Trace

__all__ = [
    "ARRIVALS",
    "DEFAULT_WORKLOAD",
    "INPUT_LN_MU",
    "INPUT_LN_SIGMA",
    "LONG_BUCKETS",
    "OUTPUT_LN_MU",
    "OUTPUT_LN_SIGMA",
    "Lognormal",
    "default_workload",
    "fit_lognormal",
    "synthetic_trace",
]

#: ln(input tokens) of the Mooncake conversation trace: mean and standard deviation.
INPUT_LN_MU = 8.7367
INPUT_LN_SIGMA = 1.1991
#: ln(output tokens) of the Mooncake conversation trace: mean and standard deviation.
OUTPUT_LN_MU = 5.3364
OUTPUT_LN_SIGMA = 1.3584

#: Arrival processes of :func:`synthetic_trace`.
ARRIVALS: tuple[str, ...] = ("poisson", "gamma")
#: Buckets whose share :func:`synthetic_trace` can set, with their ``[low, high)`` token range.
LONG_BUCKETS: Mapping[str, tuple[int, int]] = {
    "64K-256K": (65536, 262144),
    ">=256K": (262144, 2**62),
}

#: Parameters of :func:`default_workload` (the workload ``lbkit bench`` replays by default).
DEFAULT_WORKLOAD: Mapping[str, Any] = {
    "num_requests": 20_000,
    "rate_per_s": 3.4,
    "arrival": "poisson",
    "long_share": {"64K-256K": 0.03, ">=256K": 0.005},
    "max_tokens": 1_048_576,
    "max_output_tokens": 2000,
    "rng": 0,
}


class Lognormal(NamedTuple):
    """Parameters of a lognormal: ``ln(x) ~ Normal(mu, sigma)``."""

    mu: float
    sigma: float


def fit_lognormal(values: Any, /) -> Lognormal:
    """Maximum-likelihood lognormal fit: mean and (population) standard deviation of ``ln(x)``.

    Parameters
    ----------
    values : array_like, shape (n,)
        Positive values (token counts), ``n >= 2``.

    Runtime complexity: O(n).

    Examples
    --------
    >>> fit_lognormal([100, 1000, 10000])
    Lognormal(mu=6.907..., sigma=1.880...)
    """
    x = as_float_array(values, "values", ndim=1)
    if x.size and not (x > 0).all():
        raise ValueError(f"values: must be positive (found {x[x <= 0][0]})")
    if x.size < 2:
        raise ValueError(f"values: need at least 2 values to fit, got {x.size}")
    logs = np.log(x)
    return Lognormal(float(logs.mean()), float(logs.std()))


def _long_share_iv(long_share: Any, max_tokens: int) -> dict[str, float]:
    if long_share is None:
        return {}
    if not isinstance(long_share, Mapping):
        raise TypeError(
            f"long_share: must be a mapping of bucket name to share, got {long_share!r}"
        )
    unknown = [k for k in long_share if k not in LONG_BUCKETS]
    if unknown:
        raise ValueError(
            f"long_share: unknown bucket {unknown[0]!r}; expected {', '.join(LONG_BUCKETS)}"
        )
    shares = {
        k: check_real(v, f"long_share[{k!r}]", min_value=0.0, max_value=1.0)
        for k, v in long_share.items()
    }
    if sum(shares.values()) > 1.0:
        raise ValueError(f"long_share: shares must sum to at most 1, got {sum(shares.values())}")
    for k, share in shares.items():
        low = LONG_BUCKETS[k][0]
        if share > 0 and max_tokens < low:
            raise ValueError(
                f"max_tokens: must be >= {low} to draw requests in bucket {k!r}, got {max_tokens}"
            )
    return shares


def _truncated_lognormal(rng: np.random.Generator, size: int, mu: float, sigma: float, high: float):
    """Lognormal draws conditioned on ``x < high`` (inverse CDF; exact, no rejection loop)."""
    from scipy.special import ndtr, ndtri  # imported here: importing lbkit.sim stays light

    top = ndtr((math.log(high) - mu) / sigma)
    return np.exp(mu + sigma * ndtri(rng.random(size) * top))


def synthetic_trace(
    num_requests: int,
    /,
    *,
    rate_per_s: float,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    input_mu: float = INPUT_LN_MU,
    input_sigma: float = INPUT_LN_SIGMA,
    output_mu: float = OUTPUT_LN_MU,
    output_sigma: float = OUTPUT_LN_SIGMA,
    long_share: Mapping[str, float] | None = None,
    max_tokens: int = 1_048_576,
    max_output_tokens: int = 2000,
    rng: Any = None,
) -> Trace:
    """A seeded synthetic trace with lognormal lengths and explicit long-context shares.

    Parameters
    ----------
    num_requests : int
        Number of requests, ``>= 0``.
    rate_per_s : float
        Mean arrival rate (requests per second), ``> 0``.
    arrival : {"poisson", "gamma"}, default "poisson"
        Inter-arrival distribution (first arrival at 0).
    burstiness : float, default 1.0
        Coefficient of variation of gamma gaps (shape ``1 / burstiness**2``); must stay 1.0 for
        ``"poisson"``.
    input_mu, input_sigma, output_mu, output_sigma : float
        Lognormal parameters of prompt and output lengths (defaults: Mooncake fits).
    long_share : mapping, optional
        ``{"64K-256K": x, ">=256K": y}``: share of requests drawn in those buckets (missing keys
        are 0). ``None`` draws every input from the untruncated lognormal.
    max_tokens : int, default 1,048,576
        Cap on prompt length (lengths are clipped to ``[1, max_tokens]``).
    max_output_tokens : int, default 2000
        Cap on output length (Mooncake's outputs stop at 2,000).
    rng : numpy Generator, int seed or None
        ``None`` means seed 0. Draw order: gaps, buckets, inputs, outputs.

    Returns
    -------
    Trace
        No hash ids; ``request_id = arange(n)``; ``source = "synthetic"``.

    Runtime complexity: O(n).

    Examples
    --------
    >>> t = synthetic_trace(1000, rate_per_s=10.0, long_share={">=256K": 0.1}, rng=1)
    >>> len(t), float(t.arrival_s[0]), t.summary().bucket_request_shares[-1]
    (1000, 0.0, 0.096)
    >>> synthetic_trace(3, rate_per_s=1.0, rng=7) == synthetic_trace(3, rate_per_s=1.0, rng=7)
    True
    """
    n = check_int(num_requests, "num_requests", min_value=0)
    rate = check_real(rate_per_s, "rate_per_s", min_value=0.0, strict_min=True)
    arrival = check_choice(arrival, "arrival", ARRIVALS)
    cv = check_real(burstiness, "burstiness", min_value=0.0, strict_min=True)
    if arrival == "poisson" and cv != 1.0:
        raise ValueError(f"burstiness: only arrival='gamma' takes a burstiness, got {cv}")
    in_mu = check_real(input_mu, "input_mu")
    in_sigma = check_real(input_sigma, "input_sigma", min_value=0.0, strict_min=True)
    out_mu = check_real(output_mu, "output_mu")
    out_sigma = check_real(output_sigma, "output_sigma", min_value=0.0, strict_min=True)
    max_tokens = check_int(max_tokens, "max_tokens", min_value=1)
    max_out = check_int(max_output_tokens, "max_output_tokens", min_value=1)
    shares = _long_share_iv(long_share, max_tokens)
    gen = as_rng(rng)

    if arrival == "poisson":
        gaps = gen.exponential(1.0 / rate, size=n)
    else:
        shape = 1.0 / cv**2
        gaps = gen.gamma(shape, 1.0 / (rate * shape), size=n)
    arrival_s = np.zeros(n)
    np.cumsum(gaps[:-1], out=arrival_s[1:])

    names = list(LONG_BUCKETS)
    probs = [shares.get(k, 0.0) for k in names]
    bucket = np.searchsorted(np.cumsum(probs), gen.random(n), side="right")  # 0.. long, 2: base
    base = bucket == len(names)
    raw = np.empty(n)
    if shares:
        raw[base] = _truncated_lognormal(gen, int(base.sum()), in_mu, in_sigma, 65536.0)
    else:
        raw[base] = np.exp(gen.normal(in_mu, in_sigma, size=int(base.sum())))
    for j, k in enumerate(names):
        sel = bucket == j
        if not sel.any():
            continue
        low, high = LONG_BUCKETS[k]
        high = min(high, max_tokens + 1)
        raw[sel] = np.exp(gen.uniform(math.log(low), math.log(high), size=int(sel.sum())))
    total = np.clip(np.floor(raw), 1, max_tokens).astype(np.int64)
    output = np.exp(gen.normal(out_mu, out_sigma, size=n))
    output = np.clip(np.rint(output), 1, max_out).astype(np.int64)
    return Trace(arrival_s=arrival_s, total_tokens=total, output_tokens=output, source="synthetic")


def default_workload(*, num_requests: int | None = None, rng: Any = None) -> Trace:
    """The workload ``lbkit bench`` replays when given no trace.

    20,000 requests (about 98 minutes at 3.4 req/s, Mooncake's rate; the simulator rescales time
    to its target utilisation), Poisson arrivals (the Azure conversation trace's gaps have a
    coefficient of variation of 1.09), Mooncake-calibrated lognormal lengths, plus 3% of requests
    in ``64K-256K`` and 0.5% at ``>=256K`` (log-uniform up to 1M tokens). The long shares
    exercise the long-context buckets that public traces lack (100 requests at 256K or more),
    without letting them dominate the request count. All parameters are in
    :data:`DEFAULT_WORKLOAD`.

    Parameters
    ----------
    num_requests : int, optional
        Override the request count (e.g. for quick runs); default 20,000.
    rng : numpy Generator, int seed or None
        Default seed 0.

    Examples
    --------
    >>> t = default_workload(num_requests=500)
    >>> len(t), t.source
    (500, 'default_workload')
    """
    params = dict(DEFAULT_WORKLOAD)
    count = params.pop("num_requests")
    if num_requests is not None:
        count = num_requests
    if rng is not None:
        params["rng"] = rng
    return dataclasses.replace(synthetic_trace(count, **params), source="default_workload")
