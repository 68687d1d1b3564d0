"""Microbenchmarks of ``lbkit.prefill`` (pytest-benchmark; groups ``<function>|<size>``).

The routing call is measured beside a bare ``numpy.argmin`` over the same number of ranks, in one
run and with the same rounds and iterations, so that their ratio can be read off the table::

    python -m pytest benchmarks/bench_prefill.py --benchmark-enable -p no:cacheprovider

Under the default ``--benchmark-disable`` each body runs once (and checks its result).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import lbkit
from lbkit.core import PRESETS
from lbkit.prefill import (
    DEFAULT_EDGES,
    Buckets,
    PrefillBalancer,
    RankChoice,
    allocate_engines,
    pick_rank,
    plan_chunks,
    rebalance,
)
from lbkit.prefill.lockstep import (
    C_BUDGET,
    C_GROWTH,
    C_IDLE_GROWTH,
    N_COEF,
    lockstep_rank,
    lockstep_scored,
)

COST = PRESETS["h800_dsv3"].prefill
ROUNDS, ITERATIONS = 30, 1000  # 30k routed requests per benchmark: the ledger stays small


@pytest.fixture(scope="module", autouse=True)
def _warm():
    lbkit.warmup(packages=("prefill",))


#: Rank-choice options of the routing benchmark: the plain least quota load, the engine-aware
#: choice of the simulator's ``lbkit`` policy (wake penalty and hole filling), and the choice by
#: engine for context-parallel engines.
OPTIONS = {
    "default": RankChoice(),
    "plain": RankChoice(rule="least_load"),
    "engine_aware": RankChoice(rule="least_load", wake_penalty_s=1.0, fill_holes=True),
    "context_parallel": RankChoice(rule="engine_mean"),
}


def _pool(ranks: int, choice: RankChoice | None = None) -> PrefillBalancer:
    """One bucket's engines holding all ``ranks`` ranks (4 per engine), with a warm ledger."""
    buckets = Buckets(edges=DEFAULT_EDGES, initial_engines=(ranks // 4, 0, 0, 0))
    bal = PrefillBalancer(ranks // 4, 4, cost=COST, choice=choice, buckets=buckets)
    rng = np.random.default_rng(0)
    for i in range(4 * ranks):
        bal.route(f"w{i}", int(rng.integers(256, 16000)), 0, now_s=0.0)
    return bal


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("ranks", [64])
def bench_route(benchmark, ranks, options):
    bal = _pool(ranks, OPTIONS[options])
    ids = itertools.count()

    def route():
        return bal.route(next(ids), 8000, 1024, now_s=1.0)

    benchmark.group = f"prefill_route|{ranks}"
    benchmark.pedantic(route, rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=1)
    bal._check()
    assert bal.statistics().routed == 4 * ranks + next(ids)


@pytest.mark.parametrize("ranks", [64])
def bench_route_per_rank_cache(benchmark, ranks):
    # The default rule given the request's cached tokens on every rank (local prefix caches),
    # with every engine's running step reported (steps ending between 1 s and 2 s).
    bal = _pool(ranks, RankChoice())
    for e in range(ranks // 4):
        bal.step_started(e, 1.0 + e / (ranks // 4), now_s=0.0)
    ids = itertools.count()
    hits = (np.random.default_rng(1).integers(0, 16, size=ranks) * 512).astype(np.int64)

    def route():
        return bal.route(next(ids), 8704, hits, now_s=1.0)

    benchmark.group = f"prefill_route|{ranks}"
    benchmark.pedantic(route, rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=1)
    bal._check()
    assert bal.statistics().routed == 4 * ranks + next(ids)


def _lockstep_inputs(ranks: int):
    """A warm 8-rank-per-engine ledger's arrays, a request and its per-rank cached tokens."""
    rng = np.random.default_rng(2)
    work = rng.random(ranks) * 3.0
    work[rng.random(ranks) < 0.3] = 0.0
    count = (work > 0).astype(np.int64)
    hits = (rng.integers(0, 16, size=ranks) * 512).astype(np.int64)
    coef = np.zeros(N_COEF)
    coef[:5] = COST.b, COST.k, COST.q, COST.gamma, float(COST.moe_s_per_token)
    coef[C_BUDGET], coef[C_GROWTH], coef[C_IDLE_GROWTH] = 1.0, 0.6, 0.1
    return work, count, hits, coef


@pytest.mark.parametrize("ranks", [64])
def bench_lockstep_decision(benchmark, ranks):
    # The decision inside route(): the lockstep kernel over the ledger's arrays, with the
    # request's cached tokens on every rank (what a router's prefix index gives) and the time
    # left in each engine's running step (the engines' step reports).
    work, count, hits, coef = _lockstep_inputs(ranks)
    ends = 1.0 + np.random.default_rng(3).random(ranks // 8)  # each engine's step end

    def decide():
        return lockstep_scored(work, count, 0, ranks, 8, 8704, hits, 0, coef, ends, 1.2)

    benchmark.group = f"prefill_route|{ranks}"
    k, score, hit = benchmark.pedantic(decide, rounds=ROUNDS, iterations=ITERATIONS,
                                       warmup_rounds=1)  # fmt: skip
    assert 0 <= k < ranks and hit == hits[k] and np.isfinite(score)


@pytest.mark.parametrize("ranks", [64])
def bench_lockstep_rank(benchmark, ranks):
    # The pure function with validation: per-rank work and the request's per-rank seconds.
    work, _, hits, _ = _lockstep_inputs(ranks)
    rem = 8704 - hits
    request = rem * (COST.b + COST.k * hits + COST.q * rem) + COST.gamma * hits
    work2, request2 = work.reshape(-1, 8), request.reshape(-1, 8)
    benchmark.group = f"prefill_route|{ranks}"
    got = benchmark.pedantic(lockstep_rank, args=(work2, request2), rounds=ROUNDS,
                             iterations=ITERATIONS, warmup_rounds=1)  # fmt: skip
    assert 0 <= got < ranks


@pytest.mark.parametrize("ranks", [64])
def bench_route_long_queues(benchmark, ranks):
    # route() with per-rank caches on a pool whose ranks each hold about 200 queued requests:
    # the ledger's exact per-rank sums are updated incrementally, so the cost does not grow
    # with the queues.
    bal = _pool(ranks, RankChoice())
    for i in range(200 * ranks):
        bal.route(f"q{i}", 4096, 0, now_s=0.5)
    ids = itertools.count()
    hits = (np.random.default_rng(1).integers(0, 16, size=ranks) * 512).astype(np.int64)

    def route():
        return bal.route(next(ids), 8704, hits, now_s=1.0)

    benchmark.group = f"prefill_route|{ranks}"
    benchmark.pedantic(route, rounds=ROUNDS, iterations=ITERATIONS // 10, warmup_rounds=1)
    assert bal.statistics().routed == 204 * ranks + next(ids)


@pytest.mark.parametrize("ranks", [64])
def bench_reassign(benchmark, ranks):
    # An engine moves a queued request between two of its ranks and back (work sharing).
    bal = _pool(ranks)
    rid = bal.requests_on(0, 0)[-1]

    def move():
        bal.reassign(rid, 1, now_s=1.0)
        bal.reassign(rid, 0, now_s=1.0)

    benchmark.group = f"prefill_reassign|{ranks}"
    benchmark.pedantic(move, rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=1)
    bal._check()
    assert bal.requests_on(0, 0)[-1] == rid


@pytest.mark.parametrize("ranks", [64])
def bench_numpy_argmin(benchmark, ranks):
    loads = np.random.default_rng(0).random(ranks)
    benchmark.group = f"prefill_route|{ranks}"
    got = benchmark.pedantic(
        np.argmin, args=(loads,), rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=1
    )
    assert got == loads.argmin()


@pytest.mark.parametrize("ranks", [64, 1024])
def bench_pick_rank(benchmark, ranks):
    loads = np.random.default_rng(0).random(ranks)
    benchmark.group = f"pick_rank|{ranks}"
    assert benchmark(pick_rank, loads) == loads.argmin()


@pytest.mark.parametrize("engines", [16, 256])
def bench_allocate_engines(benchmark, engines):
    demand = np.array([8.0, 3.0, 1.5, 0.4])
    benchmark.group = f"allocate_engines|{engines}"
    assert benchmark(allocate_engines, demand, engines).engines.sum() == engines


@pytest.mark.parametrize("engines", [16, 256])
def bench_rebalance(benchmark, engines):
    home = np.repeat(np.arange(4), engines // 4)
    demand = np.array([8.0, 3.0, 1.5, 0.4])
    benchmark.group = f"rebalance|{engines}"
    res = benchmark(rebalance, home, demand, now_s=100.0)
    assert len(res.moves) <= 2


@pytest.mark.parametrize("queue", [4, 64])
def bench_plan_chunks(benchmark, queue):
    rng = np.random.default_rng(0)
    rem = rng.integers(64, 4096, size=queue)
    pre = rng.integers(0, 32768, size=queue)
    benchmark.group = f"plan_chunks|{queue}"
    plan = benchmark(plan_chunks, rem, pre, cost=COST, budget_s=0.5)
    assert plan.step_time_s <= 0.5 or plan.overrun
