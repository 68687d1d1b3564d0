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

With :class:`Sessions` (the default workload has them) requests form multi-turn sessions that
resend their history, behind a few shared system prompts, and carry chained 512-token block ids
for prefix caching; the prompt-length distribution stays the one above (the draws are assigned
to sessions by rank, see :func:`synthetic_trace`).

Block reuse, the figure the sessions are calibrated on: the share of prompt tokens found in an
unbounded global LRU prefix cache replaying the trace in order (``apply_prefix_cache(trace)``'s
cached tokens over total tokens), beside the share of requests that reuse more than the common
first block. Mooncake conversation trace: 37.4% of tokens (36.6% of blocks), 38.7% of requests;
:func:`default_workload` (seed 0): 39.1% of tokens (38.5% of blocks), 37.2% of requests (seeds
0-4: 35.8-39.1% of tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, as_rng, check_choice, check_int, check_real
from lbkit.sim.traces import MOONCAKE_BLOCK_TOKENS, Trace

__all__ = [
    "ARRIVALS",
    "DEFAULT_WORKLOAD",
    "INPUT_LN_MU",
    "INPUT_LN_SIGMA",
    "LONG_BUCKETS",
    "OUTPUT_LN_MU",
    "OUTPUT_LN_SIGMA",
    "Lognormal",
    "Sessions",
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


class Sessions(NamedTuple):
    """Prefix structure of :func:`synthetic_trace`: multi-turn sessions and system prompts.

    Defaults are calibrated on the Mooncake conversation trace (``docs/traces.md``).

    Attributes
    ----------
    single_turn_share : float, default 0.694
        Share of sessions with one turn (Mooncake: 5,114 of 7,373 inferred sessions).
    turn_ratio : float, default 0.515
        Sessions of two or more turns have ``2 + Geometric`` turns:
        ``P(m + 1) = turn_ratio * P(m)`` for ``m >= 2`` (Mooncake: 3.06 turns on average).
    turn_ln_mu, turn_ln_sigma : float, default 6.37, 1.47
        Lognormal of the tokens a turn adds to its session's history (the previous answer and
        the new user message), before the lengths are matched to the marginal (Mooncake: the
        positive growth of a request over its session's previous one).
    think_ln_mu, think_ln_sigma : float, default 4.877, 0.981
        Lognormal of the seconds between a session's consecutive arrivals (Mooncake: median
        131 s).
    system_prompt_blocks : tuple of int, default (1, 2, 4, 8)
        Length in 512-token blocks of each system prompt; all begin with a common first block
        (Mooncake: every request starts with block 0).
    system_prompt_weights : tuple of float, default (0.85, 0.08, 0.05, 0.02)
        Probability that a session uses each prompt (normalised).
    """

    single_turn_share: float = 0.73
    turn_ratio: float = 0.515
    turn_ln_mu: float = 6.37
    turn_ln_sigma: float = 1.47
    think_ln_mu: float = 4.877
    think_ln_sigma: float = 0.981
    system_prompt_blocks: tuple[int, ...] = (1, 2, 4, 8)
    system_prompt_weights: tuple[float, ...] = (0.92, 0.04, 0.03, 0.01)

    @property
    def mean_turns(self) -> float:
        """Expected turns per session."""
        return self.single_turn_share + (1.0 - self.single_turn_share) * (
            2.0 + self.turn_ratio / (1.0 - self.turn_ratio)
        )


#: Parameters of :func:`default_workload` (the workload ``lbkit bench`` replays by default).
DEFAULT_WORKLOAD: Mapping[str, Any] = {
    "num_requests": 20_000,
    "rate_per_s": 3.4,
    "arrival": "poisson",
    "long_share": {"64K-256K": 0.03, ">=256K": 0.005},
    "max_tokens": 1_048_576,
    "max_output_tokens": 2000,
    "sessions": Sessions(),
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


def _sessions_iv(sessions: Any) -> Sessions:
    if not isinstance(sessions, Sessions):
        raise TypeError(f"sessions: must be a Sessions or None, got {type(sessions).__name__}")
    check_real(sessions.single_turn_share, "sessions.single_turn_share", min_value=0.0,
               max_value=1.0)  # fmt: skip
    check_real(sessions.turn_ratio, "sessions.turn_ratio", min_value=0.0, max_value=0.99)
    for name in ("turn_ln_mu", "think_ln_mu"):
        check_real(getattr(sessions, name), f"sessions.{name}")
    for name in ("turn_ln_sigma", "think_ln_sigma"):
        check_real(getattr(sessions, name), f"sessions.{name}", min_value=0.0)
    blocks = as_float_array(sessions.system_prompt_blocks, "sessions.system_prompt_blocks",
                            ndim=1)  # fmt: skip
    weights = as_float_array(sessions.system_prompt_weights, "sessions.system_prompt_weights",
                             shape=(blocks.size,))  # fmt: skip
    if blocks.size == 0 or (blocks < 1).any() or (blocks != np.floor(blocks)).any():
        raise ValueError(
            "sessions.system_prompt_blocks: must be a non-empty sequence of integers >= 1, "
            f"got {sessions.system_prompt_blocks!r}"
        )
    if (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(
            "sessions.system_prompt_weights: must be >= 0 with a positive sum, "
            f"got {sessions.system_prompt_weights!r}"
        )
    return sessions


def _session_arrivals(
    gen: np.random.Generator, n: int, rate: float, arrival: str, cv: float, sessions: Sessions
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Arrival, session and turn of the first ``n`` requests of an open stream of sessions.

    Session starts are the renewal process of :func:`synthetic_trace` at rate
    ``rate / mean_turns``; a session's turns follow each other by lognormal think times. Sessions
    still running at the ``n``-th arrival lose their later turns, as in a trace window.
    """
    start_rate = rate / sessions.mean_turns
    count = max(16, math.ceil(1.2 * n / sessions.mean_turns))
    while True:
        multi = gen.random(count) >= sessions.single_turn_share
        extra = gen.geometric(1.0 - sessions.turn_ratio, size=count) + 1  # 2 + Geometric(0..)
        turns = np.where(multi, extra, 1)
        if arrival == "poisson":
            gaps = gen.exponential(1.0 / start_rate, size=count)
        else:
            shape = 1.0 / cv**2
            gaps = gen.gamma(shape, 1.0 / (start_rate * shape), size=count)
        starts = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        total = int(turns.sum())
        session = np.repeat(np.arange(count), turns)
        first = np.cumsum(turns) - turns
        turn = np.arange(total) - np.repeat(first, turns)
        think = np.exp(gen.normal(sessions.think_ln_mu, sessions.think_ln_sigma, size=total))
        think[turn == 0] = 0.0
        elapsed = np.cumsum(think)
        arrival_s = starts[session] + elapsed - np.repeat(elapsed[first], turns)
        if total >= n:
            keep = np.sort(np.argsort(arrival_s, kind="stable")[:n])
            keep = keep[np.argsort(arrival_s[keep], kind="stable")]
            # Complete iff no session could start before the n-th arrival without being drawn.
            if n == 0 or starts[-1] > arrival_s[keep[-1]]:
                return arrival_s[keep], session[keep], turn[keep], count
        count *= 2


def _chained_block_ids(
    total: np.ndarray,
    session: np.ndarray,
    prompt: np.ndarray,
    prompt_blocks: np.ndarray,
    block_tokens: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Chained block ids: a block's id is the identity of its content and of all before it.

    Within a session the prompt only grows, so block ``k`` of a request holds the same tokens as
    block ``k`` of any other request of the session with as many tokens in that block. A block
    lying inside the session's system prompt belongs to the prompt instead (shared across
    sessions), and block 0 of every system prompt is the common preamble. Ids are numbered by
    first appearance.
    """
    blocks = -(-total // block_tokens)
    offsets = np.zeros(total.size + 1, dtype=np.int64)
    np.cumsum(blocks, out=offsets[1:])
    req = np.repeat(np.arange(total.size), blocks)
    k = np.arange(offsets[-1]) - offsets[req]
    end = np.minimum((k + 1) * block_tokens, total[req])
    fill = end - k * block_tokens
    p = prompt[req]
    owner = np.where(  # 0: common preamble, 1..P: system prompts, then sessions
        end <= prompt_blocks[p] * block_tokens,
        np.where(k == 0, 0, 1 + p),
        1 + prompt_blocks.size + session[req],
    )
    # Group equal (owner, k, fill) with a stable sort, so each group's first element is its
    # first appearance: one int64 key when it cannot overflow, else a lexicographic sort.
    spans = (int(owner.max(initial=0)) + 1, int(k.max(initial=0)) + 1, block_tokens + 1)
    if math.prod(spans) < 2**62:
        key = (owner * spans[1] + k) * spans[2] + fill
        order = np.argsort(key, kind="stable")
        key = key[order]
        new = np.ones(order.size, dtype=bool)
        new[1:] = key[1:] != key[:-1]
    else:
        order = np.lexsort((fill, k, owner))
        o, kk, ff = owner[order], k[order], fill[order]
        new = np.ones(order.size, dtype=bool)
        new[1:] = (o[1:] != o[:-1]) | (kk[1:] != kk[:-1]) | (ff[1:] != ff[:-1])
    group = np.cumsum(new) - 1
    first_pos = order[new]
    rank = np.empty(first_pos.size, dtype=np.int64)
    rank[np.argsort(first_pos, kind="stable")] = np.arange(first_pos.size)
    ids = np.empty(order.size, dtype=np.int64)
    ids[order] = rank[group]
    return ids, offsets


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
    sessions: Sessions | None = None,
    rng: Any = None,
) -> Trace:
    """A seeded synthetic trace with lognormal lengths and explicit long-context shares.

    With ``sessions``, requests come in multi-turn sessions that resend their history and start
    with shared system prompts, and the trace carries chained 512-token block ids (Mooncake's
    ``hash_ids``). The prompt lengths are the same draws as without sessions, matched by rank to
    the sessions (below), so their distribution does not change.

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
    sessions : Sessions, optional
        Prefix structure; ``None`` (default): independent requests without hash ids.
    rng : numpy Generator, int seed or None
        ``None`` means seed 0. Draw order: gaps, buckets, inputs, outputs; with ``sessions``
        then session turns, session-start gaps, think times (repeated with twice as many
        sessions if too few requests arrive), system prompts, first-turn lengths and turn
        growth.

    Returns
    -------
    Trace
        ``request_id = arange(n)``; ``source = "synthetic"``; hash ids only with ``sessions``.

    Notes
    -----
    Sessions. Session starts follow the arrival process at ``rate_per_s / mean_turns``; each
    session has ``1`` turn with probability ``single_turn_share``, else ``2 + Geometric`` turns,
    spaced by lognormal think times; the trace keeps the first ``num_requests`` arrivals (later
    turns of sessions still open then are cut, as in a trace window). Each session's turns get
    provisional lengths: a first turn drawn from the input lognormal plus, per later turn, a
    lognormal growth (previous answer and new message). The ``num_requests`` prompt lengths
    drawn as without sessions are then assigned by rank: the request with the ``j``-th smallest
    provisional length gets the ``j``-th smallest draw (stable). The assignment is monotone, so
    a session's prompts never shrink, and the prompt-length distribution is exactly the
    session-less one. A session's token stream is its system prompt (``system_prompt_blocks``
    full blocks, all opening with one common block) followed by the conversation; block ``k`` of
    a request is identified by its owner (the common block, the system prompt if the block lies
    inside it, else the session), ``k`` and how many tokens it holds, so a turn reuses the full
    blocks of its session's previous turns.

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
    if sessions is not None:
        sessions = _sessions_iv(sessions)
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
    if sessions is None:
        return Trace(
            arrival_s=arrival_s, total_tokens=total, output_tokens=output, source="synthetic"
        )

    arrival_s, session, turn, count = _session_arrivals(gen, n, rate, arrival, cv, sessions)
    weights = np.asarray(sessions.system_prompt_weights, dtype=float)
    prompt_blocks = np.asarray(sessions.system_prompt_blocks, dtype=np.int64)
    prompt = gen.choice(prompt_blocks.size, size=count, p=weights / weights.sum())[session]
    first_turn = np.exp(gen.normal(in_mu, in_sigma, size=count))
    growth = np.exp(gen.normal(sessions.turn_ln_mu, sessions.turn_ln_sigma, size=n))
    growth[turn == 0] = 0.0
    # Provisional lengths: cumulative growth within each session (requests in arrival order,
    # so a session's turns appear in turn order).
    by_session = np.argsort(session, kind="stable")
    grown = np.cumsum(growth[by_session])
    starts = np.flatnonzero(turn[by_session] == 0)
    base = np.repeat(grown[starts] - growth[by_session][starts], np.diff(np.append(starts, n)))
    provisional = np.empty(n)
    provisional[by_session] = first_turn[session[by_session]] + grown - base
    assigned = np.empty(n, dtype=np.int64)
    assigned[np.argsort(provisional, kind="stable")] = np.sort(total, kind="stable")
    hash_ids, hash_offsets = _chained_block_ids(
        assigned, session, prompt, prompt_blocks, MOONCAKE_BLOCK_TOKENS
    )
    return Trace(
        arrival_s=arrival_s,
        total_tokens=assigned,
        output_tokens=output,
        hash_ids=hash_ids,
        hash_offsets=hash_offsets,
        source="synthetic",
    )


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
