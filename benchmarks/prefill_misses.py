"""Why prefill goodput falls short of the ideal: which requests miss their SLO (``--json PATH``).

Two scenarios of ``benchmarks/goodput_world.py`` where lbkit stays below 0.90 of the ideal
late-binding reference (SPEC section 8), replayed at fixed arrival rates with the defaults of
``lbkit bench`` (8 x 8 prefill ranks, ``h800_dsv3``, SLO defaults, seed 0), TTFT judged alone:

1. **Built-in workload, global cache** (the first 6,000 requests, as in the goodput run): TTFT
   attainment of lbkit, lbkit without the engines' step reports (``lbkit_nosteps``), NVIDIA
   Dynamo's rule and the ideal reference, the latter with its central queue in SLO-deadline
   order (the reference) and in arrival order (FIFO). The gap between the two ideal rows is
   what the order of service buys; the routers commit at arrival to per-rank FIFO queues, and
   with step reports lbkit commits to the engine whose next step starts first.
2. **Mooncake conversation trace, per-rank caches** (each rank its own LRU cache): the SLO's
   slowdown denominator is a request's prefill time alone with the longest prefix any rank held
   when it was routed, so a request routed away from the rank holding its prefix recomputes it.
   For each policy and rate: the misses, those that ran with less than that prefix ("lost
   prefix"; "hopeless there": its time alone where it ran already exceeds its TTFT limit), the
   median prefix tokens lost and the median queued tokens on the holding rank when it was routed
   away (what the router avoided), and the misses that kept their prefix but waited. The last
   column is lbkit's attainment at the same rate with the global cache (any rank hits any
   prefix: a shared KV store, which is what the ideal reference assumes in both cached modes).

Run: ``python benchmarks/prefill_misses.py [--json PATH]`` (a few minutes on 2 cores; prints a
note and writes nothing without the traces in ``../shared/traces``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from lbkit.core import PRESETS
from lbkit.sim.bench import load_bench_trace
from lbkit.sim.engine import simulate_prefill
from lbkit.sim.goodput import attainment, with_rate
from lbkit.sim.goodput_bench import DEFAULT_GOODPUT_OPTIONS, local_caches, prepare_cache
from lbkit.sim.ideal import alone_s, simulate_ideal_prefill
from lbkit.sim.policies import PREFILL_POLICIES
from lbkit.sim.workload import default_workload
from run_record import PUBLIC_TRACES, ROOT, TRACES, git_commit, load_avg, log, write_results

COST = PRESETS["h800_dsv3"]
OPTIONS = DEFAULT_GOODPUT_OPTIONS
POOLS = OPTIONS.pools
#: Built-in workload: requests (as the goodput run) and the arrival rates replayed (requests/s).
WORKLOAD_REQUESTS = 6000
WORKLOAD_RATES = (5.0, 6.7, 8.0, 9.6, 11.5)
#: Mooncake with per-rank caches: policies and rates (lbkit's goodput there is about 1.75).
LOCAL_POLICIES = ("lbkit", "lbkit_nosteps", "dynamo", "sglang_cache_aware")
LOCAL_RATES = (1.2, 2.4, 4.8)


def _alone(trace) -> np.ndarray:
    return alone_s(trace, ranks_per_engine=POOLS.ranks_per_engine, cost=COST.prefill,
                   budget_s=OPTIONS.budget_s)  # fmt: skip


def _run(trace, policy, rank_cache=None):
    return simulate_prefill(
        trace, policy, num_engines=POOLS.prefill_engines, ranks_per_engine=POOLS.ranks_per_engine,
        cost=COST.prefill, budget_s=OPTIONS.budget_s, rng=OPTIONS.seed, rank_cache=rank_cache,
    )  # fmt: skip


def order_table() -> dict:
    opts = dataclasses.replace(OPTIONS, cache="global")
    trace = prepare_cache(default_workload(rng=OPTIONS.seed).head(WORKLOAD_REQUESTS), opts.cache)
    alone = _alone(trace)
    limit = np.maximum(opts.slo.ttft_s, opts.slo.ttft_slowdown * alone)
    none = np.zeros(len(trace))
    rows = []
    for rate in WORKLOAD_RATES:
        t = with_rate(trace, rate)
        row: list = [rate]
        for name in ("lbkit", "lbkit_nosteps", "dynamo"):
            row.append(round(attainment(_run(t, name).ttft_s, alone, none, slo=opts.slo), 4))
        for deadline in (t.arrival_s + limit, None):
            run = simulate_ideal_prefill(
                t, num_engines=POOLS.prefill_engines, ranks_per_engine=POOLS.ranks_per_engine,
                cost=COST.prefill, budget_s=OPTIONS.budget_s, deadline_s=deadline,
            )  # fmt: skip
            row.append(round(attainment(run.ttft_s, alone, none, slo=opts.slo), 4))
        rows.append(row)
    return {
        "title": "Built-in workload, global cache: TTFT attainment by order of service",
        "note": (
            f"First {WORKLOAD_REQUESTS:,} requests of the built-in workload, arrivals scaled to "
            "each rate; share of requests meeting the TTFT SLO (goodput needs 0.99). The ideal "
            "reference serves its central queue in deadline order, or in arrival order (FIFO). "
            "lbkit_nosteps: lbkit without the engines' step reports."
        ),
        "columns": [
            "requests/s",
            "lbkit",
            "lbkit_nosteps",
            "dynamo",
            "ideal (deadline order)",
            "ideal (FIFO order)",
        ],
        "rows": rows,
    }


class _Recorder:
    """A policy wrapper that records, per request, the per-rank cached tokens and the queued
    tokens on each rank when it was routed (the view every policy sees)."""

    def __init__(self, policy):
        self._policy = policy
        self.hits: dict[int, np.ndarray] = {}
        self.queued: dict[int, np.ndarray] = {}

    def route(self, request, total_tokens, cached_tokens, /, *, now_s, view):
        self.hits[request] = np.array(view.hit_tokens)
        self.queued[request] = np.array(view.tokens)
        return self._policy.route(request, total_tokens, cached_tokens, now_s=now_s, view=view)

    def observe(self, requests, kinds, tokens, /, *, now_s):
        self._policy.observe(requests, kinds, tokens, now_s=now_s)


def _median(x) -> float | None:
    return float(np.median(x)) if len(x) else None


def local_table(path: Path) -> dict:
    opts = dataclasses.replace(OPTIONS, cache="local")
    trace = prepare_cache(load_bench_trace(path), opts.cache)
    glob = prepare_cache(load_bench_trace(path), "global")
    glob_alone = _alone(glob)
    none = np.zeros(len(trace))
    caches = local_caches(POOLS.num_prefill_ranks)
    rows = []
    for rate in LOCAL_RATES:
        t = with_rate(trace, rate)
        g = _run(with_rate(glob, rate), "lbkit")
        global_att = attainment(g.ttft_s, glob_alone, none, slo=opts.slo)
        for name in LOCAL_POLICIES:
            factory = PREFILL_POLICIES[name]
            pol = _Recorder(factory(POOLS.prefill_engines, POOLS.ranks_per_engine,
                                    cost=COST.prefill, rng=OPTIONS.seed))  # fmt: skip
            run = _run(t, pol, rank_cache=caches(t))
            n = len(t)
            best = np.array([int(pol.hits[i].max()) for i in range(n)])
            holder = np.array([int(pol.hits[i].argmax()) for i in range(n)])
            queued = np.array([int(pol.queued[i][holder[i]]) for i in range(n)])
            alone = _alone(t.with_cached_tokens(best))
            ran = _alone(t.with_cached_tokens(run.cached_tokens))
            limit = np.maximum(opts.slo.ttft_s, opts.slo.ttft_slowdown * alone)
            miss = ~(run.ttft_s <= limit)
            lost = run.cached_tokens < best
            lm, km = miss & lost, miss & ~lost
            rows.append([
                rate, name, round(attainment(run.ttft_s, alone, none, slo=opts.slo), 4),
                int(miss.sum()), int(lm.sum()), int((lm & (ran > limit)).sum()),
                _median(best[lm] - run.cached_tokens[lm]), _median(queued[lm]),
                int(km.sum()), _median(run.ttft_s[km] - ran[km]), round(global_att, 4),
            ])  # fmt: skip
    return {
        "title": "Mooncake conversation trace, per-rank caches: which requests miss their SLO",
        "note": (
            f"{len(trace):,} requests, arrivals scaled to each rate; per-rank LRU caches. "
            "'lost prefix': ran with fewer cached tokens than the best rank held when routed; "
            "'hopeless there': of those, the ones whose time alone where they ran already "
            "exceeds their TTFT limit; 'holder queue': tokens queued on the rank holding the "
            "prefix when the request was routed away. Last column: lbkit with the global cache "
            "(a shared KV store) at the same rate."
        ),
        "columns": [
            "requests/s",
            "policy",
            "attainment",
            "misses",
            "lost prefix",
            "hopeless there",
            "prefix tokens lost (median)",
            "holder queue, tokens (median)",
            "kept prefix",
            "their wait, s (median)",
            "lbkit, global cache",
        ],
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the tables here")
    args = parser.parse_args(argv)
    path = TRACES / PUBLIC_TRACES["mooncake"]
    if not path.exists():
        print(f"note: {path} not found; nothing measured", file=sys.stderr)
        return 0
    start = time.perf_counter()
    out = {"command": "python benchmarks/prefill_misses.py", "commit": git_commit(ROOT),
           "load_avg_start": load_avg(), "tables": []}  # fmt: skip
    out["tables"].append(order_table())
    log("order table done", start)
    out["tables"].append(local_table(path))
    log("local table done", start)
    write_results(out, args.json, start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
