"""Decode goodput at SLO of every decode policy, lbkit's rule variants with and without migration.

The decode pool alone (SPEC section 8): one engine of 64 ranks, cost preset ``h800_dsv3``, a KV
capacity of ``DECODE_KV_CAPACITY_TOKENS`` per rank with a 1% watermark (back-pressure: a request
that fits no rank waits in the pool's FIFO queue; KV growth that fills a rank preempts its newest
requests). Each trace is replayed *decode-only* (:func:`lbkit.sim.engine.simulate_decode` of a
trace: a request enters decode at its arrival with its prompt as KV), its arrivals scaled in time
to a rate; the goodput of a policy is the highest rate at which at least 99% of the requests meet
``TPOT <= 50 ms`` (``(finish - arrival) / (o - 1)``, so waiting counts), found by
:func:`lbkit.sim.goodput.find_goodput` to 1%. A request that can never run (its prompt above a
rank's admission limit, or prompt plus output above the capacity) fails the SLO under every
policy. At the goodput rate each row reports ``mean_running_per_rank`` (steady window: the
arrivals' span without its first quarter), the TPOT percentiles, the waits and preemptions and,
with migration, the moves and KV tokens moved.

Rows: every policy of :data:`lbkit.sim.policies_decode.DECODE_POLICIES` (``lbkit`` is
``DecodeBalancer`` with its default arguments, ``rebalance()`` before every routing decision), the
variants of lbkit's rule that :class:`~lbkit.decode.DecodeBalancer` offers (``policy``: sum of
squares, min-max, cost; ``scale``) admission-only and with each kind of migration (room for a
waiting request, balance moves; :data:`VARIANTS`), and the reference ``pooled (perfect
balance)``: the engine as one rank at its mean load, without fragmentation of the KV capacity
(every step costs the mean rank; see :func:`pooled_cost`). A migrated
request's KV transfer is charged: it stops decoding for ``MIGRATION_LATENCY_S +
KV_BYTES_PER_TOKEN * kv_tokens / LINK_BYTES_PER_S`` (DeepSeek-V3's MLA cache in BF16, 70,272
bytes per token: 61 layers x 576 values x 2 bytes; one 400 Gb/s RDMA NIC per GPU, 50 GB/s at
line rate, taken at 40 GB/s effective). The non-lbkit rows are the *peers* here: on the decode
pool the selection rules of vLLM's DP balancer (``4*waiting + running`` with no per-rank
waiting: least requests), SGLang's ``shortest_queue`` (least requests) and ``total_tokens`` and
Dynamo's decode blocks (least KV) reduce to ``least_requests`` and ``least_kv``, here with exact
views (no refresh interval), which favours them.

Usage::

    python benchmarks/decode_goodput.py --json benchmarks/results/decode_goodput.json
    python benchmarks/decode_goodput.py --max-requests 3000 --traces mooncake --rows lbkit,min_max
    python benchmarks/decode_goodput.py --tables benchmarks/results/decode_goodput.json

Progress goes to stderr. The JSON records the command, the commit, the machine's load average
before and after and the wall time of every scenario (the machine is shared: wall times are
noisy), and the table that ``docs/simulator.md`` quotes ("Decode goodput at SLO";
``benchmarks/make_performance.py --render-only`` splices it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lbkit.core import PRESETS, DecodeCost
from lbkit.sim.bench import OCCUPANCY_RANGE, load_bench_trace, steady_window
from lbkit.sim.engine import (
    DECODE_KV_CAPACITY_TOKENS,
    DECODE_KV_WATERMARK_TOKENS,
    simulate_decode,
)
from lbkit.sim.goodput import DEFAULT_SLO, attainment, find_goodput, with_rate
from lbkit.sim.metrics import decode_metrics
from lbkit.sim.policies_decode import DECODE_POLICIES, DEFAULT_DECODE_POLICY, LbkitDecode
from lbkit.sim.workload import default_workload
from run_record import (
    PUBLIC_TRACES,
    ROOT,
    TRACES,
    csv_names,
    git_commit,
    load_avg,
    log,
    save_partial,
)

#: Trace name -> file under ``--trace-dir`` (default ``TRACES``; ``None``: the built-in workload).
TRACE_FILES = PUBLIC_TRACES
COST = "h800_dsv3"
ENGINES, RANKS = 1, 64
SEED = 0
REL_TOL = 0.01
#: KV bytes per token of DeepSeek-V3 (MLA, BF16): 61 layers x (512 + 64) values x 2 bytes.
KV_BYTES_PER_TOKEN = 70_272
#: Effective bandwidth of one KV transfer: a 400 Gb/s RDMA NIC per GPU at 80% of line rate.
LINK_BYTES_PER_S = 40e9
#: Fixed cost of one transfer (connection set-up, the first step it misses is charged anyway).
MIGRATION_LATENCY_S = 0.001
S_PER_KV_TOKEN = KV_BYTES_PER_TOKEN / LINK_BYTES_PER_S
#: Running requests per rank of the Little's-law first guess of the search.
GUESS_BATCH = 48.0

#: The reference row: the engine as one rank at its mean load (see :func:`pooled_cost`).
POOLED = "pooled (perfect balance)"

#: Admission only: no ``rebalance`` calls.
_ADMIT = {"max_migrations": 0, "make_room": False}
#: lbkit variants: row name -> DecodeBalancer options (``rebalance()`` before every routing
#: decision unless both migrations are off). The ``lbkit`` row is the defaults: ``min_max``,
#: room and one balance move.
VARIANTS: dict[str, dict[str, Any]] = {
    "sum_of_squares": {"policy": "sum_of_squares", **_ADMIT},
    "sum_of_squares/capacity": {"policy": "sum_of_squares", "scale": "capacity", **_ADMIT},
    "min_max": {"policy": "min_max", **_ADMIT},
    "min_max/capacity": {"policy": "min_max", "scale": "capacity", **_ADMIT},
    "cost": {"policy": "cost", **_ADMIT},
    "min_max+balance": {"policy": "min_max", "max_migrations": 1, "make_room": False},
    "min_max+room": {"policy": "min_max", "max_migrations": 0, "make_room": True},
    "sum_of_squares+room+balance": {"policy": "sum_of_squares"},
}


def _factory(row: str) -> Callable[[], Any] | str:
    """A fresh policy for one replay: a simulator policy name, or an lbkit variant."""
    if row in DECODE_POLICIES:
        return row
    v = VARIANTS[row]
    every = None if v.get("max_migrations", 1) == 0 and not v.get("make_room", True) else 0.0
    return lambda: LbkitDecode(ENGINES, RANKS, rng=SEED, migrate_every_s=every, **v)


def pooled_cost() -> DecodeCost:
    """The decode cost of one rank standing for the whole engine at its mean load.

    ``R`` ranks at the mean ``B/R, S/R`` step in ``a + (b*B + k*S + b_moe*moe_lb*B) / R``: the
    cost of a single rank holding every request with ``b, k, b_moe`` divided by ``R``.
    """
    c = PRESETS[COST].decode
    return dataclasses.replace(c, b=c.b / RANKS, k=c.k / RANKS, b_moe=c.b_moe / RANKS)


def replay(trace, row: str, rate: float):
    """Decode-only replay of ``trace`` at ``rate`` under ``row``; (DecodeRun, attainment)."""
    t = with_rate(trace, rate)
    if row == POOLED:
        # Perfect balance: every step costs the mean rank, and the pool's KV is one capacity
        # (no request waits while the pool has room for it in total).
        pool = {"ranks_per_engine": 1, "cost": pooled_cost(),
                "max_kv_tokens": RANKS * DECODE_KV_CAPACITY_TOKENS,
                "kv_watermark_tokens": RANKS * DECODE_KV_WATERMARK_TOKENS}  # fmt: skip
        make: Any = "least_requests"
    else:
        pool = {"ranks_per_engine": RANKS, "cost": PRESETS[COST].decode,
                "max_kv_tokens": DECODE_KV_CAPACITY_TOKENS,
                "kv_watermark_tokens": DECODE_KV_WATERMARK_TOKENS}  # fmt: skip
        make = _factory(row)
    run = simulate_decode(
        t, make if isinstance(make, str) else make(), num_engines=ENGINES,
        window_s=steady_window(t), migration_latency_s=MIGRATION_LATENCY_S,
        migration_s_per_kv_token=S_PER_KV_TOKEN, rng=SEED, **pool,
    )  # fmt: skip
    n = len(t)
    # A decode-only replay has no TTFT: 0 for a request that finished, nan (fails) otherwise.
    ttft = np.where(run.finished, 0.0, np.nan)
    return run, attainment(ttft, np.zeros(n), run.tpot_s, slo=DEFAULT_SLO)


def start_rate(trace) -> float:
    """Little's-law guess: ``GUESS_BATCH`` running per rank at the cost model's step time."""
    steps = np.maximum(np.asarray(trace.output_tokens) - 1, 0)
    m = float(steps.mean())
    kv = float(np.mean(trace.total_tokens)) + m / 2.0
    step_s = float(PRESETS[COST].decode.step_time(GUESS_BATCH, GUESS_BATCH * kv))
    return GUESS_BATCH * RANKS * ENGINES / (m * step_s)


def goodput(trace, row: str, rate0: float) -> dict[str, Any]:
    """The goodput search of ``row`` and what the pool looks like at the rate found."""
    seen: dict[float, Any] = {}

    def evaluate(rate: float) -> float:
        run, met = replay(trace, row, rate)
        seen[rate] = run
        return met

    s = find_goodput(evaluate, start_rate=rate0, target=DEFAULT_SLO.attainment, rel_tol=REL_TOL)
    out: dict[str, Any] = {"requests_per_s": s.requests_per_s, "attainment": s.attainment,
                           "bracketed": s.bracketed, "evaluations": len(s.evaluations)}  # fmt: skip
    if s.requests_per_s > 0:
        run = seen[s.requests_per_s]
        m = decode_metrics(run, total_tokens=with_rate(trace, s.requests_per_s).total_tokens)
        tpot = run.tpot_s[np.isfinite(run.tpot_s)]
        lo, hi = OCCUPANCY_RANGE
        w = m["window"]
        running = m["mean_running_per_rank"] / (RANKS if row == POOLED else 1)
        out.update({
            "mean_running_per_rank": running,
            "meaningful": bool(lo <= running <= hi),
            "tpot_p50_s": float(np.percentile(tpot, 50)),
            "tpot_p99_s": float(np.percentile(tpot, 99)),
            "balance_efficiency": w["balance_efficiency"],
            "count_imbalance": w["count_imbalance"],
            "kv_imbalance": w["kv_imbalance"],
            "waited": m["waited"],
            "wait_p99_s": m["wait_p99_s"],
            "preemptions": m["preemptions"],
            "refused": m["refused"],
            "migrations": run.migrations,
            "migration_s_per_move": run.migration_s / run.migrations if run.migrations else 0.0,
        })  # fmt: skip
    out["curve"] = [[r, a] for r, a in s.evaluations]
    return out


def _trace(name: str, path: Path | None, max_requests: int | None):
    trace = default_workload(rng=SEED) if path is None else load_bench_trace(path)
    return trace if max_requests is None else trace.head(max_requests)


#: Title of the table that ``docs/simulator.md`` quotes (``benchmarks/make_performance.py``).
TABLE_TITLE = "Decode goodput at TPOT 50 ms (decode-only replay, 1 x 64 ranks)"


def tables(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The quoted table of a results file: per row and trace the goodput (requests/s), its ratio
    to the best peer, the running requests per rank and the moves at that rate."""
    scen = data["scenarios"]
    cols = ["policy"]
    for sc in scen:
        t = sc["trace"]
        cols += [f"{t} req/s", f"{t} vs best peer", f"{t} running/rank", f"{t} moves"]
    rows = []
    for row in scen[0]["goodput"] if scen else []:
        cells: list[Any] = [row]
        for sc in scen:
            g = sc["goodput"].get(row, {})
            vs, run = g.get("vs_best_peer"), g.get("mean_running_per_rank")
            cells += [round(g["requests_per_s"], 1), None if vs is None else round(vs, 3),
                      None if run is None else round(run, 1), g.get("migrations")]  # fmt: skip
        rows.append(cells)
    return [{"title": TABLE_TITLE, "columns": cols, "rows": rows}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the results here")
    ap.add_argument("--tables", type=Path, metavar="PATH",
                    help="rebuild the quoted table of a results file from its scenarios and "
                    "exit")  # fmt: skip
    ap.add_argument("--traces", metavar="LIST", help=f"of {', '.join(TRACE_FILES)} (default all)")
    rows_known = [*DECODE_POLICIES, *VARIANTS, POOLED]
    ap.add_argument("--rows", metavar="LIST", help=f"of {', '.join(rows_known)} (default all)")
    ap.add_argument(
        "--max-requests",
        type=int,
        metavar="N",
        help="replay only the first N requests of every trace",
    )
    ap.add_argument("--trace-dir", type=Path, default=TRACES, metavar="DIR",
                    help="folder of the public traces (default ../shared/traces)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.tables is not None:
        data = json.loads(args.tables.read_text())
        data["tables"] = tables(data)
        args.tables.write_text(json.dumps(data, indent=1) + "\n")
        return 0
    if args.max_requests is not None and args.max_requests < 2:
        raise SystemExit(f"--max-requests: must be >= 2, got {args.max_requests}")
    traces = csv_names(args.traces, TRACE_FILES, "traces")
    rows = csv_names(args.rows, rows_known, "rows")
    peers = [r for r in DECODE_POLICIES if r != DEFAULT_DECODE_POLICY]
    start = time.perf_counter()
    out: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/decode_goodput.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(ROOT),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "load_avg_start": load_avg()},
        "options": {
            "cost": COST, "decode": f"{ENGINES} x {RANKS}", "slo_tpot_s": DEFAULT_SLO.tpot_s,
            "attainment": DEFAULT_SLO.attainment, "rel_tol": REL_TOL, "seed": SEED,
            "kv_capacity_tokens": DECODE_KV_CAPACITY_TOKENS,
            "kv_watermark_tokens": DECODE_KV_WATERMARK_TOKENS,
            "migration_latency_s": MIGRATION_LATENCY_S,
            "migration_s_per_kv_token": S_PER_KV_TOKEN,
            "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "link_bytes_per_s": LINK_BYTES_PER_S,
            "max_requests": args.max_requests, "peers": peers,
            "variants": VARIANTS,
        },
        "scenarios": [],
    }  # fmt: skip
    for name in traces:
        path = None if TRACE_FILES[name] is None else args.trace_dir / TRACE_FILES[name]
        if path is not None and not path.exists():
            log(f"{name}: {path} not found, skipped", start)
            continue
        trace = _trace(name, path, args.max_requests)
        rate0 = start_rate(trace)
        t0 = time.perf_counter()
        res: dict[str, Any] = {}
        for row in rows:
            t1 = time.perf_counter()
            res[row] = goodput(trace, row, rate0)
            res[row]["wall_s"] = round(time.perf_counter() - t1, 1)
            g = res[row]
            log(f"{name} {row}: {g['requests_per_s']:.2f} req/s, running/rank "
                 f"{g.get('mean_running_per_rank', math.nan):.1f}, tpot p99 "
                 f"{1e3 * g.get('tpot_p99_s', math.nan):.1f} ms, moves {g.get('migrations')}, "
                 f"{g['wall_s']} s", start)  # fmt: skip
        best_peer = max((res[p]["requests_per_s"] for p in peers if p in res), default=None)
        for g in res.values():
            g["vs_best_peer"] = g["requests_per_s"] / best_peer if best_peer else None
        out["scenarios"].append(
            {
                "trace": name,
                "source": trace.source,
                "requests": len(trace),
                "start_rate": rate0,
                "best_peer_requests_per_s": best_peer,
                "wall_s": round(time.perf_counter() - t0, 1),
                "goodput": res,
            }
        )
        save_partial(out, args.json, start, tables, done=False)
    save_partial(out, args.json, start, tables, done=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
