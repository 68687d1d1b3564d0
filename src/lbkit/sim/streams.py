"""Seeded decode streams replayed through a :class:`~lbkit.decode.DecodeBalancer`.

A stream is a decode-only workload in engine steps: arrivals per step (Poisson), each request
with a lognormal prompt (its KV tokens on arrival) and a lognormal number of output tokens; a
request leaves after generating them. Departures depend only on the stream, never on the
placement, so every policy replays the same requests and only the placement differs. Used by the
decode property tests and by ``benchmarks/bench_decode.py`` to compare decode policies without
the prefill pool of :mod:`lbkit.sim.engine`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lbkit.core import DecodeCost, balance_efficiency, imbalance
from lbkit.core.validation import check_int
from lbkit.decode import DecodeBalancer

__all__ = ["StreamResult", "make_stream", "replay"]


class StreamResult(NamedTuple):
    """Per-step per-rank loads of a replay and their balance figures.

    Attributes
    ----------
    num_requests, kv_tokens : ndarray of int64, shape (ranks, steps)
        Requests and KV tokens per rank after each step's admissions (warm-up steps left out).
    count_imbalance, kv_imbalance : float
        ``sum_t max_r x / sum_t mean_r x`` of requests and of KV tokens (1 is perfect).
    efficiency : float
        :func:`lbkit.core.balance_efficiency` of the per-rank step times that ``cost`` models.
    refused : int
        Requests the balancer refused.
    migrated : int
        Requests moved between ranks by :meth:`~lbkit.decode.DecodeBalancer.rebalance`.
    migrated_kv_tokens : int
        KV tokens those moves carried (what a transfer engine copies).
    """

    num_requests: np.ndarray
    kv_tokens: np.ndarray
    count_imbalance: float
    kv_imbalance: float
    efficiency: float
    refused: int
    migrated: int
    migrated_kv_tokens: int


def make_stream(
    seed: int,
    /,
    *,
    steps: int = 300,
    rate: float = 6.0,
    kv_median: float = 6000.0,
    kv_sigma: float = 1.0,
    out_median: float = 60.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A seeded decode stream.

    Parameters
    ----------
    seed : int
        Seed of ``numpy.random.default_rng``; the same seed gives the same stream.
    steps : int, default 300
        Engine steps with arrivals.
    rate : float, default 6.0
        Mean arrivals per step (Poisson).
    kv_median : float, default 6000.0
        Median prompt length, tokens (lognormal, at least 1).
    kv_sigma : float, default 1.0
        Sigma of the prompt length's logarithm.
    out_median : float, default 60.0
        Median output length, tokens (lognormal with sigma 1, at least 1).

    Returns
    -------
    arrival_step, kv_tokens, output_tokens : ndarray of int64, shape (requests,)
        Arrival steps in non-decreasing order, prompt lengths and output lengths.

    Runtime complexity: ``O(steps + requests)``.

    Examples
    --------
    >>> arrival, kv, out = make_stream(0, steps=10, rate=2.0)
    >>> arrival.shape == kv.shape == out.shape, bool((kv >= 1).all()), bool((out >= 1).all())
    (True, True, True)
    """
    rng = np.random.default_rng(seed)
    counts = rng.poisson(rate, steps)
    arrival = np.repeat(np.arange(steps), counts)
    m = arrival.size
    kv = np.maximum(1, rng.lognormal(np.log(kv_median), kv_sigma, m)).astype(np.int64)
    out = np.maximum(1, rng.lognormal(np.log(out_median), 1.0, m)).astype(np.int64)
    return arrival, kv, out


def replay(
    stream: tuple[np.ndarray, np.ndarray, np.ndarray],
    num_ranks: int,
    policy: str,
    /,
    *,
    cost: DecodeCost,
    lookahead_steps: int = 0,
    warmup: int = 50,
    migrate_every: int = 0,
    max_migrations: int = 1,
) -> StreamResult:
    """Replay ``stream`` through a :class:`~lbkit.decode.DecodeBalancer` of ``num_ranks`` ranks.

    Each step: departures of the requests whose outputs are done, then the step's arrivals in
    order (``admit`` with the request's true output length as its expected output), then every
    ``migrate_every`` steps ``rebalance(max_migrations)``, then the loads are recorded and the
    balancer steps (every KV grows by one token).

    Parameters
    ----------
    stream : tuple of ndarray
        ``(arrival_step, kv_tokens, output_tokens)`` as from :func:`make_stream`.
    num_ranks : int
        Decode ranks.
    policy : str
        A key of :data:`lbkit.decode.POLICIES`.
    cost : DecodeCost
        Step-time model of the efficiency figure.
    lookahead_steps : int, default 0
        Passed to the balancer.
    warmup : int, default 50
        First steps left out of the figures (the engine fills up).
    migrate_every : int, default 0
        Steps between migrations of running requests (0: none; KV transfer time not modelled).
    max_migrations : int, default 1
        Most requests moved each time.

    Returns
    -------
    StreamResult

    Runtime complexity: ``O(steps * ranks + requests * admit)``.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> cost = PRESETS["h800_dsv3"].decode
    >>> r = replay(make_stream(0, steps=80, rate=4.0), 4, "sum_of_squares", cost=cost, warmup=20)
    >>> r.num_requests.shape, r.refused, r.count_imbalance >= 1.0
    ((4, 60), 0, True)
    >>> m = replay(make_stream(0, steps=80, rate=4.0), 4, "sum_of_squares", cost=cost, warmup=20,
    ...            migrate_every=1)
    >>> m.migrated > 0, m.kv_imbalance <= r.kv_imbalance
    (True, True)
    """
    arrival, kv, out = stream
    migrate_every = check_int(migrate_every, "migrate_every", min_value=0)
    max_migrations = check_int(max_migrations, "max_migrations", min_value=0)
    steps = int(arrival.max()) + 1 if arrival.size else 1
    bal = DecodeBalancer(num_ranks, policy=policy, cost=cost, lookahead_steps=lookahead_steps)
    ends: dict[int, list[int]] = {}
    b_log = np.zeros((num_ranks, steps), dtype=np.int64)
    s_log = np.zeros((num_ranks, steps), dtype=np.int64)
    i = 0
    moved_kv = 0
    for t in range(steps):
        for rid in ends.pop(t, []):
            bal.finish(rid)
        while i < arrival.size and arrival[i] == t:
            d = bal.admit(i, int(kv[i]), expected_output_tokens=int(out[i]))
            if d.rank >= 0:
                ends.setdefault(t + int(out[i]), []).append(i)
            i += 1
        if migrate_every and t % migrate_every == 0:
            moved_kv += sum(m.kv_tokens for m in bal.rebalance(max_migrations))
        b_log[:, t] = bal.num_requests()
        s_log[:, t] = bal.kv_tokens()
        bal.step()
    b, s = b_log[:, warmup:], s_log[:, warmup:]
    times = cost.step_time(b, s)
    st = bal.statistics()
    return StreamResult(
        b,
        s,
        imbalance(b),
        imbalance(s),
        balance_efficiency(times),
        st.refused,
        st.migrated,
        moved_kv,
    )
