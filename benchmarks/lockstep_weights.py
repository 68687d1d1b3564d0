"""Goodput of the lockstep rule against its growth weights: the evidence for the defaults.

The lockstep rule (:mod:`lbkit.prefill.lockstep`) charges a request for the time it adds to an
engine's busiest rank: ``growth_weight`` on a busy engine, ``idle_growth_weight`` on an idle one
it wakes. This runs lbkit's default policy (with the engines' step reports) under a few weight
pairs on every scenario of ``benchmarks/goodput_world.py`` (the Mooncake and Azure traces and
the first 6,000 requests of the built-in workload; no cache, one global cache, per-rank caches;
8 x 8 prefill ranks, ``h800_dsv3``, the default SLO, seed 0) and reports goodput at SLO
(:func:`lbkit.sim.goodput_bench.prefill_goodput`, bisection to 1%) and its ratio to the
default pair's. The Azure trace has no block hashes: it runs without a cache only.

Run: ``python benchmarks/lockstep_weights.py [--json PATH] [--weights 0.6/0.1,1.5/0.1]
[--seed N]`` (``--seed``: the simulator's seed and the built-in workload's draw, default 0)
(about an hour on 2 cores; prints a note and measures only the built-in workload without the
traces in ``../shared/traces``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from lbkit.core import PRESETS
from lbkit.prefill import RankChoice
from lbkit.sim.bench import load_bench_trace
from lbkit.sim.goodput_bench import (
    DEFAULT_GOODPUT_OPTIONS,
    local_caches,
    prefill_goodput,
    prepare_cache,
)
from lbkit.sim.policies import LbkitPrefill
from lbkit.sim.workload import default_workload
from run_record import PUBLIC_TRACES, ROOT, TRACES, git_commit, load_avg, log, write_results

COST = PRESETS["h800_dsv3"]
OPTIONS = DEFAULT_GOODPUT_OPTIONS
#: Weight pairs (busy, idle) measured by default; the first is the balancer's default.
WEIGHTS = ((0.6, 0.1), (0.1, 0.1), (1.5, 0.1), (0.6, 0.3))
#: Scenarios: (trace, cache mode, first rate of the search, requests/s).
SCENARIOS = (
    ("mooncake", "none", 12.0),
    ("mooncake", "global", 18.0),
    ("mooncake", "local", 1.8),
    ("azure", "none", 180.0),
    ("default", "none", 5.0),
    ("default", "global", 9.0),
    ("default", "local", 0.3),
)
WORKLOAD_REQUESTS = 6000


def _factory(busy: float, idle: float):
    choice = RankChoice(growth_weight=busy, idle_growth_weight=idle)

    def make(num_engines, ranks_per_engine, *, cost, rng=None):
        return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, choice=choice)

    return make


def _weights(text: str | None) -> tuple[tuple[float, float], ...]:
    if text is None:
        return WEIGHTS
    out = []
    for part in text.split(","):
        try:
            busy, idle = (float(v) for v in part.split("/"))
        except ValueError:
            raise SystemExit(f"--weights: expected BUSY/IDLE pairs, got {part!r}") from None
        out.append((busy, idle))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the table here")
    ap.add_argument("--weights", metavar="LIST", help="BUSY/IDLE pairs, the default first")
    ap.add_argument("--seed", type=int, default=OPTIONS.seed, help="simulator and workload seed")
    args = ap.parse_args(argv)
    seed = args.seed
    weights = _weights(args.weights)
    start = time.perf_counter()
    out = {
        "command": " ".join(["python", "benchmarks/lockstep_weights.py", *(argv or sys.argv[1:])]),
        "commit": git_commit(ROOT),
        "load_avg_start": load_avg(),
        "tables": [],
    }
    rows = []
    for trace_name, cache, start_rate in SCENARIOS:
        rel = PUBLIC_TRACES[trace_name]
        if rel is None:
            trace = default_workload(rng=seed).head(WORKLOAD_REQUESTS)
        elif (TRACES / rel).exists():
            trace = load_bench_trace(TRACES / rel)
        else:
            print(f"note: {TRACES / rel} not found; {trace_name} skipped", file=sys.stderr)
            continue
        opts = dataclasses.replace(OPTIONS, cache=cache, seed=seed)
        trace = prepare_cache(trace, cache)
        hook = local_caches(opts.pools.num_prefill_ranks) if cache == "local" else None
        base = None
        for busy, idle in weights:
            g = prefill_goodput(trace, _factory(busy, idle), cost=COST, options=opts,
                                start_rate=start_rate, rank_cache=hook)  # fmt: skip
            rate = round(g.search.requests_per_s, 3)
            base = rate if base is None else base
            rows.append([trace_name, cache, f"{busy}/{idle}", rate,
                         round(rate / base, 3) if base else None])  # fmt: skip
            log(f"{trace_name}/{cache} {busy}/{idle}: {rate} req/s", start)
    out["tables"].append({
        "title": "Lockstep rule: goodput against its growth weights",
        "note": (
            "lbkit's default prefill policy (with the engines' step reports) with the growth "
            "weights of busy and idle engines given; goodput at SLO as in the goodput tables "
            f"(8 x 8 prefill ranks, h800_dsv3, default SLO, seed {seed}; the built-in workload's "
            f"first {WORKLOAD_REQUESTS:,} requests). 'vs default': against the first pair, "
            f"{weights[0][0]}/{weights[0][1]}, the balancer's default."
        ),
        "columns": ["trace", "cache", "weights (busy/idle)", "req/s", "vs default"],
        "rows": rows,
    })  # fmt: skip
    write_results(out, args.json, start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
