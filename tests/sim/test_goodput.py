"""Goodput at SLO: the SLO test, the rate search, and the ideal late-binding reference."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.core.cost import QuadraticCost
from lbkit.sim import simulate_prefill
from lbkit.sim.goodput import Slo, attainment, find_goodput, rate_of, slo_met, with_rate
from lbkit.sim.goodput_bench import (
    GoodputOptions,
    Pools,
    ideal_goodput,
    prefill_goodput,
    prepare_cache,
)
from lbkit.sim.ideal import alone_s, simulate_ideal_prefill
from lbkit.sim.traces import Trace, load_azure
from lbkit.sim.workload import default_workload

UNIT = PRESETS["unit"].prefill


# ------------------------------------------------------------------ SLO
def test_slo_met_by_hand():
    slo = Slo(ttft_s=2.0, ttft_slowdown=4.0, tpot_s=0.05)
    # TTFT limits: max(2, 4 * alone) = 2, 2, 4, 2, 40; TPOT limit 0.05; nan TTFT never meets.
    ttft = [2.0, 2.01, 3.9, np.nan, 39.0]
    alone = [0.1, 0.1, 1.0, 0.1, 10.0]
    tpot = [0.05, 0.01, np.nan, 0.01, 0.051]
    assert slo_met(ttft, alone, tpot, slo=slo).tolist() == [True, False, True, False, False]
    assert attainment(ttft, alone, tpot, slo=slo) == pytest.approx(2 / 5)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), loose=st.floats(1.0, 4.0))
def test_a_looser_slo_is_met_by_at_least_as_many(seed, loose):
    rng = np.random.default_rng(seed)
    ttft, alone, tpot = (
        rng.exponential(2.0, 50),
        rng.exponential(0.5, 50),
        rng.exponential(0.04, 50),
    )
    strict = Slo()
    wide = Slo(ttft_s=2.0 * loose, ttft_slowdown=4.0 * loose, tpot_s=0.05 * loose)
    a, b = slo_met(ttft, alone, tpot, slo=strict), slo_met(ttft, alone, tpot, slo=wide)
    assert (b | ~a).all()  # every request meeting the strict SLO meets the looser one


def test_slo_validation():
    with pytest.raises(ValueError, match="ttft_s: must be > 0"):
        Slo(ttft_s=0.0)
    with pytest.raises(ValueError, match="attainment"):
        Slo(attainment=0.0)
    with pytest.raises(ValueError, match="equal lengths"):
        slo_met([1.0], [1.0, 2.0], [0.0])
    with pytest.raises(ValueError, match="tpot_s: must be non-negative"):
        slo_met([1.0], [1.0], [-1.0])
    with pytest.raises(TypeError, match="slo: must be a Slo"):
        slo_met([1.0], [1.0], [0.0], slo=0.99)


# ------------------------------------------------------------------ the search
@settings(max_examples=60, deadline=None)
@given(
    threshold=st.floats(0.01, 1e4),
    start=st.floats(0.01, 1e4),
    rel_tol=st.sampled_from([0.01, 0.05]),
)
def test_find_goodput_brackets_a_step(threshold, start, rel_tol):
    calls = []

    def evaluate(rate):
        calls.append(rate)
        return 1.0 if rate <= threshold else 0.0

    r = find_goodput(evaluate, start_rate=start, target=0.99, rel_tol=rel_tol)
    ratio = max(threshold, start) / min(threshold, start)
    if ratio > 2.0**12:  # beyond the bracketing range
        assert not r.bracketed
        return
    assert r.bracketed
    assert r.requests_per_s <= threshold < r.requests_per_s * (1 + rel_tol) * (1 + 1e-12)
    assert [c for c, _ in r.evaluations] == calls
    assert len(calls) <= 13 + math.ceil(math.log2(math.log(2.0) / math.log1p(rel_tol))) + 1


def test_find_goodput_nothing_passes():
    r = find_goodput(lambda rate: 0.0, start_rate=1.0)
    assert r.requests_per_s == 0.0 and not r.bracketed and math.isnan(r.attainment)


def test_find_goodput_checks_evaluate():
    with pytest.raises(ValueError, match="evaluate: must return an attainment"):
        find_goodput(lambda rate: 2.0, start_rate=1.0)
    with pytest.raises(ValueError, match="start_rate"):
        find_goodput(lambda rate: 1.0, start_rate=0.0)


def test_rate_and_scaling():
    t = Trace(arrival_s=[0.0, 2.0, 4.0], total_tokens=[10, 10, 10], output_tokens=[1, 1, 1])
    assert rate_of(t.arrival_s) == 0.5
    assert rate_of(with_rate(t, 3.0).arrival_s) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="requests_per_s"):
        with_rate(t, -1.0)


# ------------------------------------------------------------------ the ideal reference
def _model_ideal(trace, engines, ranks, cost, budget, deadline=None, level=False):
    """Plain-Python model of the ideal late-binding pool (module docstring of lbkit.sim.ideal),
    without the kernel's data structures: the queue is a sorted list, the level share recomputed
    from the queue at each step start."""
    n = len(trace)
    rem = (trace.total_tokens - trace.cached_tokens).astype(int).tolist()
    pref = trace.cached_tokens.astype(int).tolist()
    key = list(range(n)) if deadline is None else list(deadline)
    moe = cost.moe_s_per_token
    b_plan = cost.b + moe

    def plan(c, p):
        return 0.0 if c <= 0 else c * (b_plan + cost.k * p + cost.q * c) + cost.gamma * p

    def work(c, p):  # the rank's local work (the shared expert work is added per step)
        return 0.0 if c <= 0 else c * (cost.b + cost.k * p + cost.q * c) + cost.gamma * p

    def fit(room, r, p):
        c = 0
        while c < r and plan(c + 1, p) <= room:
            c += 1
        return c

    queue: list[int] = []
    partial = [[-1] * ranks for _ in range(engines)]
    end = [math.inf] * engines
    finish = [math.nan] * n
    arrived = 0
    while True:
        t_arr = trace.arrival_s[arrived] if arrived < n else math.inf
        t = min(t_arr, min(end))
        if t == math.inf:
            break
        end = [math.inf if x == t else x for x in end]
        while arrived < n and trace.arrival_s[arrived] <= t:
            queue.append(arrived)
            arrived += 1
        queue.sort(key=lambda i: (key[i], i))
        for e in range(engines):
            if end[e] < math.inf or (not queue and all(x < 0 for x in partial[e])):
                continue
            planned = [cost.a] * ranks
            local = [0.0] * ranks
            toks = [0] * ranks
            open_ = [True] * ranks
            ran = [False] * ranks
            done = []
            share = sum(plan(rem[i], pref[i]) for i in queue) / (engines * ranks)
            while True:
                cands = [r for r in range(ranks) if open_[r]]
                if not cands:
                    break
                best = min(cands, key=lambda r: (planned[r], r))
                p = -1 if ran[best] else partial[e][best]
                h = -1
                if queue and (
                    not level or planned[best] == cost.a or planned[best] - cost.a < share
                ):
                    h = queue[0]
                room = budget - planned[best]
                if (
                    h >= 0
                    and p >= 0
                    and not ((key[h], h) < (key[p], p) and fit(room, rem[h], pref[h]) == rem[h])
                ):
                    h = -1
                if h < 0 and p < 0:
                    open_[best] = False
                    continue
                i = h if h >= 0 else p
                c = fit(room, rem[i], pref[i])
                if c == 0:
                    if planned[best] > cost.a:
                        open_[best] = False
                        continue
                    c = min(1, rem[i])
                planned[best] += plan(c, pref[i])
                local[best] += work(c, pref[i])
                toks[best] += c
                if h >= 0:
                    queue.pop(0)
                else:
                    ran[best] = True
                rem[i] -= c
                pref[i] += c
                if rem[i] == 0:
                    done.append(i)
                    if h < 0:
                        partial[e][best] = -1
                else:
                    partial[e][best] = i
                    open_[best] = False
            step = cost.a + max(local) + moe * sum(toks) / ranks
            end[e] = t + step
            for i in done:
                finish[i] = t + step
    return np.array(finish)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), engines=st.integers(1, 3), ranks=st.integers(1, 3),
       edf=st.booleans(), level=st.booleans(), moe=st.sampled_from([0.0, 0.6]))  # fmt: skip
def test_ideal_kernel_matches_model(seed, engines, ranks, edf, level, moe):
    cost = QuadraticCost(a=1.0, b=1.0 - moe, k=0.001, q=0.0005, b_moe=moe / 1.05, moe_lb=1.05)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 14))
    arrival = np.sort(rng.integers(0, 40, n)).astype(float) * 50.0
    total = rng.integers(1, 4000, n)
    cached = np.minimum(rng.integers(0, 2000, n) * rng.integers(0, 2, n), total - 1)
    t = Trace(arrival_s=arrival, total_tokens=total, output_tokens=np.ones(n, dtype=np.int64),
              cached_tokens=cached)  # fmt: skip
    deadline = arrival + rng.uniform(0, 3000, n) if edf else None
    run = simulate_ideal_prefill(t, num_engines=engines, ranks_per_engine=ranks, cost=cost,
                                 budget_s=1500.0, deadline_s=deadline, level=level)  # fmt: skip
    want = _model_ideal(t, engines, ranks, cost, 1500.0, deadline, level)
    np.testing.assert_allclose(run.finish_s, want, rtol=1e-12)
    assert np.isfinite(run.finish_s).all()  # nothing refused, nothing lost
    assert (run.ttft_s >= alone_s(t, ranks_per_engine=ranks, cost=cost, budget_s=1500.0)
            - 1e-9).all()  # fmt: skip


def test_alone_matches_the_engine():
    t = default_workload(num_requests=400, rng=3)
    cost = PRESETS["h800_dsv3"].prefill  # with shared expert work (b_moe > 0)
    assert cost.moe_s_per_token > 0
    run = simulate_prefill(t, "least_tokens", num_engines=2, ranks_per_engine=4, cost=cost)
    np.testing.assert_allclose(alone_s(t, ranks_per_engine=4, cost=cost), run.alone_s,
                               rtol=1e-12)  # fmt: skip


def test_goodput_is_deterministic():
    preset = PRESETS["h800_dsv3"]
    trace = prepare_cache(default_workload(num_requests=400, rng=5), "global")
    pools = Pools(prefill_engines=2, ranks_per_engine=2, decode_ranks=4)
    kw = dict(cost=preset, start_rate=0.5)
    a = prefill_goodput(trace, "power_of_two", **kw, options=GoodputOptions(pools=pools, seed=3))
    b = prefill_goodput(trace, "power_of_two", **kw, options=GoodputOptions(pools=pools, seed=3))
    assert a.search == b.search and a.metrics == b.metrics


AZURE_SMALL = Path(__file__).parent / "data" / "azure_small.csv"


@pytest.mark.parametrize("seed", [0, 1, 2, "azure"])
def test_ideal_goodput_is_at_least_every_policys(seed):
    """On small seeded cases (and a short-prompt trace) the ideal reference serves at least the
    rate of every policy (a FIFO central queue, or steps filled to the budget, would not: see
    lbkit.sim.ideal)."""
    preset = PRESETS["h800_dsv3"]
    if seed == "azure":
        trace = load_azure(AZURE_SMALL)
    else:
        trace = prepare_cache(default_workload(num_requests=1500, rng=seed), "none")
    pools = Pools(prefill_engines=2, ranks_per_engine=4, decode_ranks=8)
    kw = dict(cost=preset, options=GoodputOptions(pools=pools, cache="none", rel_tol=0.02))
    ideal = ideal_goodput(trace, start_rate=1.0, **kw)
    assert ideal.search.bracketed and ideal.search.requests_per_s > 0
    for policy in ("round_robin", "least_requests", "least_tokens", "vllm", "dynamo"):
        got = prefill_goodput(trace, policy, start_rate=ideal.search.requests_per_s, **kw)
        assert got.search.requests_per_s <= ideal.search.requests_per_s, policy
        assert got.metrics["attainment"] >= 0.99
    # lbkit's lockstep rule keeps short prompts off engines paced by long chunks, which the
    # ideal's per-step shares do not: on these small pools it can beat the reference (seed 1:
    # lbkit_buckets 0.261 against 0.229 requests/s), so there the ideal is no bound.
    for policy in ("lbkit_buckets", "lbkit"):
        got = prefill_goodput(trace, policy, start_rate=ideal.search.requests_per_s, **kw)
        assert got.search.requests_per_s <= 1.25 * ideal.search.requests_per_s, policy
        assert got.metrics["attainment"] >= 0.99
