"""Decode migration: what moving running requests between ranks buys (``--json PATH``).

Admission-time placement cannot undo the imbalance that departures of heavy-tailed prompts leave.
A step-based decode-only replay (:func:`lbkit.sim.streams.replay`) of the Mooncake conversation
trace's prompt and output lengths (in trace order, cycled; Poisson arrivals sized for about 64
requests per rank on 64 ranks) through a :class:`~lbkit.decode.DecodeBalancer`, without and with
``rebalance(k)`` every ``n`` steps (:func:`lbkit.decode.plan_migrations`). KV transfer time is
not charged; the "KV tokens moved" column says what the transfers carry. Figures over the last
three quarters of the steps: count and KV imbalance (``sum_t max_r / sum_t mean_r``) and the
balance efficiency of the ``h800_dsv3`` decode step times. Targets of the simulator issue for the
decode pool: efficiency >= 0.97, both imbalances <= 1.05.

Run: ``python benchmarks/decode_migration.py [--steps 1500] [--json PATH]`` (about a minute;
prints a note and writes nothing without the trace in ``../shared/traces``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from lbkit.core import PRESETS
from lbkit.sim.streams import replay
from lbkit.sim.traces import load_trace

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
TRACE = TRACE / "mooncake_conversation" / "conversation_trace.jsonl"
RANKS = 64
BATCH = 64
#: (policy, migrate every n steps, requests moved each time); n = 0: no migration.
RUNS = (
    ("sum_of_squares", 0, 0),
    ("min_max", 0, 0),
    ("cost", 0, 0),
    ("least_kv", 0, 0),
    ("sum_of_squares", 10, 1),
    ("sum_of_squares", 10, 4),
    ("sum_of_squares", 1, 1),
    ("sum_of_squares", 1, 4),
)


def stream(steps: int):
    tr = load_trace(TRACE)
    kv = np.asarray(tr.total_tokens, dtype=np.int64)
    out = np.maximum(np.asarray(tr.output_tokens, dtype=np.int64), 1)
    counts = np.random.default_rng(0).poisson(BATCH * RANKS / out.mean(), steps)
    arrival = np.repeat(np.arange(steps), counts)
    idx = np.arange(arrival.size) % len(kv)
    return arrival, kv[idx], out[idx]


def table(steps: int) -> dict:
    s = stream(steps)
    cost = PRESETS["h800_dsv3"].decode
    rows = []
    for policy, every, k in RUNS:
        r = replay(s, RANKS, policy, cost=cost, warmup=steps // 4, migrate_every=every,
                   max_migrations=k)  # fmt: skip
        how = "none" if not every else f"{k} per step" if every == 1 else f"{k} per {every} steps"
        rows.append([policy, how,
                     round(r.count_imbalance, 3), round(r.kv_imbalance, 3),
                     round(r.efficiency, 4), round(float(r.num_requests.mean()), 1),
                     r.migrated, round(100 * r.migrated / len(s[0]), 1),
                     round(r.migrated_kv_tokens / max(r.migrated, 1))])  # fmt: skip
        print(*rows[-1], sep=" | ", flush=True)
    return {
        "title": "Decode migration (Mooncake lengths, 64 ranks, about 64 requests per rank)",
        "note": f"{len(s[0])} requests over {steps} steps; step-based replay "
        "(lbkit.sim.streams.replay); migrations by DecodeBalancer.rebalance; KV transfer time "
        "not charged. Targets: efficiency >= 0.97, count and KV imbalance <= 1.05.",
        "columns": ["admission rule", "migrations", "count imbalance", "KV imbalance",
                    "balance efficiency", "batch/rank", "requests moved", "moved % of requests",
                    "KV tokens per move"],
        "rows": rows,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not TRACE.exists():
        print(f"skipped: {TRACE} not found")
        return
    tables = [table(a.steps)]
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"tables": tables}, indent=1) + "\n")


if __name__ == "__main__":
    main()
