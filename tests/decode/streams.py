"""Seeded decode streams replayed through a DecodeBalancer (tests and benchmarks).

A stream: arrivals per step (Poisson), each with a lognormal prompt (KV tokens on arrival) and a
lognormal number of output tokens; a request leaves after generating them. Departures depend
only on the stream, never on the placement, so every policy serves the same requests.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lbkit.core import DecodeCost, balance_efficiency, imbalance
from lbkit.decode import DecodeBalancer

__all__ = ["StreamResult", "make_stream", "replay"]


class StreamResult(NamedTuple):
    """Per-step per-rank loads of a replay and their balance figures."""

    num_requests: np.ndarray  # (ranks, steps)
    kv_tokens: np.ndarray  # (ranks, steps)
    count_imbalance: float  # sum_t max_r B / sum_t mean_r B
    kv_imbalance: float
    efficiency: float  # balance_efficiency of the modelled step times
    refused: int


def make_stream(seed, *, steps=300, rate=6.0, kv_median=6000.0, kv_sigma=1.0, out_median=60.0):
    """``(arrival_step, kv_tokens, output_tokens)`` arrays of a seeded stream."""
    rng = np.random.default_rng(seed)
    counts = rng.poisson(rate, steps)
    arrival = np.repeat(np.arange(steps), counts)
    m = arrival.size
    kv = np.maximum(1, rng.lognormal(np.log(kv_median), kv_sigma, m)).astype(np.int64)
    out = np.maximum(1, rng.lognormal(np.log(out_median), 1.0, m)).astype(np.int64)
    return arrival, kv, out


def replay(stream, num_ranks, policy, *, cost: DecodeCost, lookahead_steps=0, warmup=50):
    """Replay ``stream`` through a balancer; loads are recorded after each step's admissions.

    ``warmup`` first steps are left out of the figures (the engine fills up).
    """
    arrival, kv, out = stream
    steps = int(arrival.max()) + 1 if arrival.size else 1
    bal = DecodeBalancer(num_ranks, policy=policy, cost=cost, lookahead_steps=lookahead_steps)
    ends: dict[int, list[int]] = {}
    b_log = np.zeros((num_ranks, steps), dtype=np.int64)
    s_log = np.zeros((num_ranks, steps), dtype=np.int64)
    i = 0
    for t in range(steps):
        for rid in ends.pop(t, []):
            bal.finish(rid)
        while i < arrival.size and arrival[i] == t:
            d = bal.admit(i, int(kv[i]), expected_output_tokens=int(out[i]))
            if d.rank >= 0:
                ends.setdefault(t + int(out[i]), []).append(i)
            i += 1
        b_log[:, t] = bal.num_requests()
        s_log[:, t] = bal.kv_tokens()
        bal.step()
    b, s = b_log[:, warmup:], s_log[:, warmup:]
    times = cost.step_time(b, s)
    return StreamResult(
        b, s, imbalance(b), imbalance(s), balance_efficiency(times), bal.statistics().refused
    )
