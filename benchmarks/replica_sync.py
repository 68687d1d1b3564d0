"""What router replicas cost: decode balance and prefill goodput against K replicas and sync mode.

``K`` replicas of lbkit's policies route one fleet (:mod:`lbkit.sim.replicas`; request ``i``
goes to replica ``i mod K``, round-robin by request index), each seeing the others' load
through one sync mode: ``shared`` (one store, read ``DELAY_S`` = 0.5 ms late), ``reports``
(engine totals broadcast every ``PERIOD_S`` = 1 s), ``polled`` (each replica polls the totals
every ``PERIOD_S`` at a phase of its own) or ``none`` (own admissions only). ``K = 1``
is the single router under every mode (``tests/sim/test_replicas.py``), so it runs once.

- **Decode** (a diagnostic): the built-in workload (``default_workload(rng=0)``, 20,000
  requests) replayed decode-only (each request enters decode at its arrival with its prompt as
  KV) at ``DECODE_RATE`` requests/s, where one router holds about 64 running requests per rank,
  through one engine of 64 ranks, cost preset ``h800_dsv3``, lbkit's decode policy with its
  defaults (``rebalance()`` before every arrival, by the replica whose turn it is). No KV
  capacity: migration under capacities is modelled only with exact views, and this table
  compares the views. Reported over the steady window (the arrivals' span without its first
  quarter): balance efficiency (``sum_t mean_r T_r / sum_t max_r T_r`` of the modelled rank step
  times, as :func:`lbkit.core.metrics.balance_efficiency`; a diagnostic), running requests per
  rank, TPOT p99 and the share of requests with TPOT <= 50 ms at this rate, and the moves.
- **Prefill**: goodput at SLO (SPEC section 8; :func:`lbkit.sim.goodput_bench.prefill_goodput`,
  bisection to 1%) of lbkit's default prefill policy on the first ``PREFILL_REQUESTS`` (6,000)
  requests of the built-in workload: 8 x 8 prefill ranks, global prefix cache, the default SLO
  (TTFT <= max(2 s, 4 x alone), TPOT <= 50 ms, 99%); the decode pool behind it is one lbkit
  router (as in ``lbkit bench``).

Usage::

    nice -n 10 python benchmarks/replica_sync.py --json benchmarks/results/replica_sync.json
    python benchmarks/replica_sync.py --replicas 1,16 --modes shared --parts decode
    python benchmarks/replica_sync.py --tables benchmarks/results/replica_sync.json

Progress goes to stderr. The JSON records the command, the commit, the machine's load average
before and after and the wall time of every cell; ``benchmarks/make_performance.py`` renders
its table ("Router replicas").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lbkit.core import PRESETS
from lbkit.sim.bench import steady_window
from lbkit.sim.engine import simulate_decode
from lbkit.sim.goodput import DEFAULT_SLO, attainment, with_rate
from lbkit.sim.goodput_bench import DEFAULT_GOODPUT_OPTIONS, prefill_goodput, prepare_cache
from lbkit.sim.metrics import decode_metrics
from lbkit.sim.replicas import SYNC_MODES, ReplicaSync, decode_replicas, prefill_replicas
from lbkit.sim.workload import default_workload
from run_record import ROOT, csv_names, git_commit, load_avg, log, save_partial

COST = "h800_dsv3"
SEED = 0
REPLICAS = (1, 4, 16, 32)
#: Round trip of the shared store, seconds.
DELAY_S = 0.0005
#: Interval of the engine reports, seconds.
PERIOD_S = 1.0
#: Decode-only arrival rate, requests/s: one router holds about 64 running requests per rank.
DECODE_RATE = 300.0
DECODE_RANKS = 64
#: Requests of the built-in workload in the prefill goodput search.
PREFILL_REQUESTS = 6000
#: First rate of the single router's prefill search, requests/s (the others start at its goodput).
PREFILL_START_RATE = 6.0
PARTS = ("decode", "prefill")
TABLE_TITLE = "Router replicas: decode balance and prefill goodput against K and sync mode"


def _sync(k: int, mode: str) -> ReplicaSync:
    return ReplicaSync(k=k, mode=mode, delay_s=DELAY_S, period_s=PERIOD_S)


def decode_cell(trace, k: int, mode: str) -> dict[str, Any]:
    """Decode-only replay of ``trace`` under ``K`` replicas; the steady window's figures."""
    make = decode_replicas(_sync(k, mode))
    run = simulate_decode(trace, make, ranks_per_engine=DECODE_RANKS, cost=PRESETS[COST].decode,
                          window_s=steady_window(trace), rng=SEED)  # fmt: skip
    m = decode_metrics(run)
    w = m["window"]
    tpot = run.tpot_s[np.isfinite(run.tpot_s)]
    ttft = np.where(run.finished, 0.0, np.nan)  # decode-only: no TTFT
    only_tpot = attainment(ttft, np.zeros(len(trace)), run.tpot_s, slo=DEFAULT_SLO)
    return {
        "balance_efficiency": w["balance_efficiency"],
        "mean_running_per_rank": m["mean_running_per_rank"],
        "tpot_p50_s": float(np.percentile(tpot, 50)),
        "tpot_p99_s": float(np.percentile(tpot, 99)),
        "tpot_attainment": only_tpot,
        "migrations": run.migrations,
        "finished": int(run.finished.sum()),
    }


def prefill_cell(trace, k: int, mode: str, start_rate: float) -> dict[str, Any]:
    """Prefill goodput at SLO of lbkit's default policy under ``K`` replicas."""
    g = prefill_goodput(trace, prefill_replicas(_sync(k, mode)), cost=PRESETS[COST],
                        options=DEFAULT_GOODPUT_OPTIONS, start_rate=start_rate)  # fmt: skip
    return {
        "requests_per_s": g.search.requests_per_s,
        "bracketed": g.search.bracketed,
        "evaluations": len(g.search.evaluations),
        "attainment": g.metrics.get("attainment"),
        "ttft_p99_s": g.metrics.get("ttft_p99_s"),
    }


def tables(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rendered table: one row per (K, mode), figures relative to one router."""
    cells = data["cells"]
    one = next((c for c in cells if c["replicas"] == 1), None)

    def ratio(c: dict, part: str, key: str) -> float | None:
        if one is None or part not in c or part not in one or not one[part][key]:
            return None
        return round(c[part][key] / one[part][key], 3)

    cols = ["replicas", "sync", "decode balance eff.", "decode vs one router", "running/rank",
            "TPOT p99 ms", "TPOT <= 50 ms", "moves", "prefill goodput req/s",
            "prefill vs one router"]  # fmt: skip
    rows = []
    for c in cells:
        d, p = c.get("decode"), c.get("prefill")
        rows.append([
            c["replicas"], c["mode"] if c["replicas"] > 1 else "(one router)",
            None if d is None else round(d["balance_efficiency"], 3),
            ratio(c, "decode", "balance_efficiency"),
            None if d is None else round(d["mean_running_per_rank"], 1),
            None if d is None else round(1e3 * d["tpot_p99_s"], 1),
            None if d is None else round(d["tpot_attainment"], 3),
            None if d is None else d["migrations"],
            None if p is None else round(p["requests_per_s"], 3),
            ratio(c, "prefill", "requests_per_s"),
        ])  # fmt: skip
    o = data["options"]
    note = (
        f"Sync: shared = one store read {o['delay_s'] * 1e3:g} ms late; reports = engine totals "
        f"broadcast every {o['period_s']:g} s; polled = engine totals polled by each replica "
        f"every {o['period_s']:g} s, replica j at (n + j/K) x {o['period_s']:g} s; none = own "
        "admissions only. Arrivals split "
        "round-robin by request index. Decode: built-in workload "
        f"({o['decode_requests']:,} requests) decode-only at {o['decode_rate']:g} requests/s on "
        f"1 x {o['decode_ranks']} ranks without KV capacity, lbkit's decode defaults; steady "
        "window; balance efficiency is a diagnostic; the rate, chosen for about 64 running "
        "requests per rank, is above one router's TPOT goodput, so the TPOT columns compare "
        "the modes and are not goodput. Prefill: goodput at SLO of lbkit's default "
        f"policy, first {o['prefill_requests']:,} requests of the built-in workload, 8 x 8 "
        "ranks, global cache, default SLO, the decode pool routed by one lbkit router."
    )
    return [{"title": TABLE_TITLE, "note": note, "columns": cols, "rows": rows}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the results here")
    ap.add_argument("--replicas", metavar="LIST", help="replica counts (default 1,4,16,32)")
    ap.add_argument("--modes", metavar="LIST", help=f"of {', '.join(SYNC_MODES)} (default all)")
    ap.add_argument("--parts", metavar="LIST", help=f"of {', '.join(PARTS)} (default both)")
    ap.add_argument("--tables", type=Path, metavar="PATH",
                    help="rebuild the table of a results file from its cells and exit")  # fmt: skip
    args = ap.parse_args(argv)
    if args.tables is not None:
        data = json.loads(args.tables.read_text())
        data["tables"] = tables(data)
        args.tables.write_text(json.dumps(data, indent=1) + "\n")
        return 0
    ks = REPLICAS
    if args.replicas is not None:
        try:
            ks = tuple(int(x) for x in args.replicas.split(","))
            for k in ks:
                ReplicaSync(k=k)
        except ValueError as exc:
            raise SystemExit(f"--replicas: {exc}") from None
    modes = csv_names(args.modes, SYNC_MODES, "modes")
    parts = csv_names(args.parts, PARTS, "parts")
    start = time.perf_counter()
    dtrace = with_rate(default_workload(rng=SEED), DECODE_RATE)
    ptrace = prepare_cache(default_workload(rng=SEED).head(PREFILL_REQUESTS),
                           DEFAULT_GOODPUT_OPTIONS.cache)  # fmt: skip
    out: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/replica_sync.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(ROOT),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "load_avg_start": load_avg()},
        "options": {
            "cost": COST, "seed": SEED, "delay_s": DELAY_S, "period_s": PERIOD_S,
            "decode_rate": DECODE_RATE, "decode_ranks": DECODE_RANKS,
            "decode_requests": len(dtrace), "prefill_requests": len(ptrace),
            "prefill_cache": DEFAULT_GOODPUT_OPTIONS.cache, "slo": DEFAULT_SLO.as_dict(),
            "split": "round-robin by request index",
        },
        "cells": [],
    }  # fmt: skip
    rate0 = PREFILL_START_RATE
    for k in ks:
        for mode in modes if k > 1 else modes[:1]:
            cell: dict[str, Any] = {"replicas": k, "mode": mode}
            t0 = time.perf_counter()
            if "decode" in parts:
                cell["decode"] = decode_cell(dtrace, k, mode)
                d = cell["decode"]
                log(f"K={k} {mode} decode: balance {d['balance_efficiency']:.4f}, running/rank "
                    f"{d['mean_running_per_rank']:.1f}, tpot p99 {1e3 * d['tpot_p99_s']:.1f} ms",
                    start)  # fmt: skip
            if "prefill" in parts:
                cell["prefill"] = prefill_cell(ptrace, k, mode, rate0)
                if k == 1 and cell["prefill"]["requests_per_s"] > 0:
                    rate0 = cell["prefill"]["requests_per_s"]
                log(f"K={k} {mode} prefill goodput {cell['prefill']['requests_per_s']:.3f} req/s",
                    start)  # fmt: skip
            cell["wall_s"] = round(time.perf_counter() - t0, 1)
            out["cells"].append(cell)
            save_partial(out, args.json, start, tables, done=False)
    save_partial(out, args.json, start, tables, done=True)
    for t in out["tables"]:
        print(t["title"])
        for row in [t["columns"], *t["rows"]]:
            print(" | ".join("" if v is None else str(v) for v in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
