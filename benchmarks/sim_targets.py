"""Measure the simulator targets: both public traces at utilisation 0.7 and 0.9, plus the default
workload, 16 prefill engines x 4 ranks and one decode engine of 64 ranks; the prefill pool again
with engine-side work sharing (every policy under each engine model) and where balance is lost;
then a decode-only replay of each trace loaded to a realistic batch per rank, and the
balance/TTFT trade-off of the engine-aware rank choice.

Usage: ``python benchmarks/sim_targets.py [--json PATH]`` (tables in the form that
``benchmarks/make_performance.py`` renders). Wall-clock rates are noisy on shared machines.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from lbkit.core import PRESETS
from lbkit.sim.bench import (
    load_bench_trace,
    run_bench,
    run_decode_bench,
    scale_to_decode_batch,
    steady_window,
)
from lbkit.sim.engine import scale_to_utilization, simulate_decode, simulate_prefill
from lbkit.sim.metrics import decode_metrics, prefill_metrics
from lbkit.sim.policies import LBKIT_BUCKET_OPTIONS as LBKIT_OPTIONS
from lbkit.sim.policies import LBKIT_CP_OPTIONS, LbkitPrefill
from lbkit.sim.policies_decode import LbkitDecode
from lbkit.sim.workload import default_workload

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
SCENARIOS = [
    ("mooncake", TRACES / "mooncake_conversation" / "conversation_trace.jsonl"),
    ("azure", TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv"),
]
#: Mean decode batch per rank of the decode-only scenario (decode pools run tens per rank).
DECODE_BATCHES = (32, 64)
#: Wake penalties of the trade-off table (seconds; LBKIT_OPTIONS uses 1.0).
WAKE_PENALTIES = (0.0, 1.0, 3.0, 10.0, 30.0)
#: Engine models of the work-sharing tables: (label, ``simulate_prefill(work_sharing=...)``,
#: ``cp_efficiency``); under "split" (context parallelism) lbkit routes by engine
#: (``LBKIT_CP_OPTIONS``).
ENGINES = (
    ("off", "off", 1.0),
    ("budget", "budget", 1.0),
    ("level", "level", 1.0),
    ("split", "split", 1.0),
    ("split 0.8", "split", 0.8),
)


def _ratio(x, y):
    return round(x / y, 3) if y else None


def _sharing(runs):
    """lbkit and the baselines under each engine model; where lbkit's balance is lost."""
    rows, loss_rows, prefill_rows = [], [], []
    for name, u, trace in runs:
        for eng, sharing, eff in ENGINES:
            rep = run_bench(trace, utilization=u, work_sharing=sharing, cp_efficiency=eff,
                            decode_policies=[]).report  # fmt: skip
            p = rep["prefill"]
            rates = rep["timing"]["requests_per_s"]
            base = [k for k in p if k not in ("lbkit", "lbkit_buckets")]
            best = min(base, key=lambda k: p[k]["ttft_p99_s"])
            lb = p["lbkit"]
            rows.append([name, u, eng, round(lb["balance_efficiency"], 4),
                         round(lb["ttft_p50_s"], 3), round(lb["ttft_p99_s"], 3),
                         _ratio(lb["ttft_p99_s"], p["round_robin"]["ttft_p99_s"]),
                         _ratio(lb["ttft_p99_s"], p[best]["ttft_p99_s"]), best,
                         lb["moves"], round(rates["prefill/lbkit"]),
                         round(min(v for v in rates.values() if v))])  # fmt: skip
            print("sharing", rows[-1], flush=True)
            loss = lb["balance_loss"]
            share = loss["step_time_share_by_busy_ranks"]
            loss_rows.append([name, u, eng, round(loss["total"], 4), round(loss["idle_ranks"], 4),
                              round(loss["unequal_busy_ranks"], 4)]
                             + [round(x, 3) for x in share[1:]]
                             + [round(loss["few_requests_step_time_share"], 3),
                                round(loss["few_requests_balance"], 3),
                                round(loss["few_requests_loss"], 4)])  # fmt: skip
            if eng != "off":
                for pol, m in p.items():
                    prefill_rows.append([name, u, eng, pol, round(m["balance_efficiency"], 4),
                                         round(m["ttft_p50_s"], 3), round(m["ttft_p99_s"], 3),
                                         m["finished"], m["moves"],
                                         round(rates[f"prefill/{pol}"])])  # fmt: skip
    return rows, loss_rows, prefill_rows


def _prefill_scenarios(runs):
    pre_rows, dec_rows, tgt_rows = [], [], []
    for name, u, trace in runs:
        rep = run_bench(trace, utilization=u).report
        rates = rep["timing"]["requests_per_s"]
        for pol, m in rep["prefill"].items():
            pre_rows.append([name, u, pol, round(m["balance_efficiency"], 4),
                             round(m["ttft_p50_s"], 3),
                             round(m["ttft_p99_s"], 3), m["finished"], m["refused"],
                             round(rates[f"prefill/{pol}"])])  # fmt: skip
        ref = next(iter(rep["prefill"].values()))["reference"]
        pre_rows.append([name, u, "perfect (fluid)", 1.0, round(ref["ttft_p50_s"], 3),
                         round(ref["ttft_p99_s"], 3), None, None, None])  # fmt: skip
        for pol, m in rep["decode"].items():
            dec_rows.append([name, u, pol, round(m["balance_efficiency"], 4),
                             round(m["count_imbalance"], 3), round(m["kv_imbalance"], 3),
                             round(m["tpot_p99_s"] * 1e3, 3), round(m["batch_per_rank_mean"], 3),
                             round(m["reference"]["count_imbalance"], 3),
                             round(rates[f"decode/{pol}"])])  # fmt: skip
        p = rep["prefill"]
        base = [k for k in p if k not in ("lbkit", "lbkit_buckets")]
        best = min(p[k]["ttft_p99_s"] for k in base)
        lb, dlb = p["lbkit"], rep["decode"]["lbkit"]
        slow = min(v for v in rates.values() if v)
        tgt_rows.append([name, u, round(lb["balance_efficiency"], 4),
                         round(lb["ttft_p99_s"] / p["round_robin"]["ttft_p99_s"], 3),
                         round(lb["ttft_p99_s"] / best, 3), round(dlb["balance_efficiency"], 4),
                         round(dlb["count_imbalance"], 3), round(dlb["kv_imbalance"], 3),
                         round(dlb["reference"]["count_imbalance"], 3),
                         round(slow)])  # fmt: skip
        print(name, u, tgt_rows[-1], flush=True)
    return pre_rows, dec_rows, tgt_rows


def _decode_only(traces):
    rows, tgt_rows = [], []
    for name, trace in traces:
        for batch in DECODE_BATCHES:
            rep = run_decode_bench(trace, batch_per_rank=float(batch))
            rates = rep["timing"]["requests_per_s"]
            got = rep["workload"]["batch_per_rank_calibrated"]
            for pol, m in rep["decode"].items():
                w = m["window"]
                rows.append([name, batch, pol, round(w["balance_efficiency"], 4),
                             round(w["count_imbalance"], 3), round(w["kv_imbalance"], 3),
                             round(w["batch_per_rank_mean"], 1),
                             round(w["count_imbalance_floor"], 3),
                             round(m["tpot_p99_s"] * 1e3, 2),
                             round(rates[f"decode/{pol}"])])  # fmt: skip
            d = rep["decode"]
            w = d["lbkit"]["window"]
            base = max((k for k in d if k != "lbkit"),
                       key=lambda k: d[k]["window"]["balance_efficiency"])  # fmt: skip
            tgt_rows.append([name, batch, round(got, 1), round(w["balance_efficiency"], 4),
                             round(w["count_imbalance"], 3), round(w["kv_imbalance"], 3),
                             round(w["count_imbalance_floor"], 3),
                             f"{base} {d[base]['window']['balance_efficiency']:.4f}",
                             round(min(v for v in rates.values() if v))])  # fmt: skip
            print(name, "decode-only", batch, tgt_rows[-1], flush=True)
    return rows, tgt_rows


def _wake_sweep(name, trace, u):
    cost = PRESETS["h800_dsv3"].prefill
    scaled, _ = scale_to_utilization(trace, u, num_ranks=64, cost=cost)
    rows = []
    for eng in ("off", "level", "split"):
        for wake in WAKE_PENALTIES:
            # the wake penalty refines the least-load rule (split: the engine-mean rule)
            base = LBKIT_CP_OPTIONS if eng == "split" else LBKIT_OPTIONS
            rule = base["choice"].rule if eng == "split" else "least_load"
            choice = replace(base["choice"], rule=rule, wake_penalty_s=wake)
            pol = LbkitPrefill(16, 4, cost=cost, rng=0, **{**base, "choice": choice})
            m = prefill_metrics(simulate_prefill(scaled, pol, num_engines=16, ranks_per_engine=4,
                                                 cost=cost, rng=0, work_sharing=eng))  # fmt: skip
            rows.append([name, u, eng, wake, round(m["balance_efficiency"], 4),
                         round(m["ttft_p50_s"], 3), round(m["ttft_p99_s"], 3)])  # fmt: skip
            print("wake", rows[-1], flush=True)
    return rows


#: Migration settings of the decode-only migration table: (seconds between rebalances, moves).
MIGRATIONS = ((0.05, 1), (0.02, 1), (0.0, 1))
#: KV bytes per token of DeepSeek-V3 (MLA cache in BF16: 61 layers x (512 + 64) values x 2 bytes).
KV_BYTES_PER_TOKEN = 61 * 576 * 2
#: KV transfer models of the migration table: (label, latency s, seconds per KV token). 40 GB/s is
#: about what one 400 Gb/s RDMA link per GPU delivers between nodes; 10 GB/s a congested link.
TRANSFERS = (
    ("not modelled", 0.0, 0.0),
    ("40 GB/s", 0.5e-3, KV_BYTES_PER_TOKEN / 40e9),
    ("10 GB/s", 0.5e-3, KV_BYTES_PER_TOKEN / 10e9),
)


def _decode_migration(traces):
    """lbkit's decode balancer migrating requests (DecodeBalancer.rebalance), decode-only."""
    cost = PRESETS["h800_dsv3"].decode
    rows = []
    for name, trace in traces:
        for batch in DECODE_BATCHES:
            scaled, _, _ = scale_to_decode_batch(trace, float(batch), num_engines=1,
                                                 ranks_per_engine=64, cost=cost)  # fmt: skip
            cases = [(None, 0, *TRANSFERS[0])]
            cases += [(every, k, *tr) for tr in TRANSFERS for every, k in MIGRATIONS]
            for every, k, label, lat, per_token in cases:
                pol = LbkitDecode(1, 64, migrate_every_s=every, max_migrations=max(k, 1))
                run = simulate_decode(scaled, pol, num_engines=1, ranks_per_engine=64, cost=cost,
                                      window_s=steady_window(scaled), migration_latency_s=lat,
                                      migration_s_per_kv_token=per_token)  # fmt: skip
                m = decode_metrics(run, total_tokens=scaled.total_tokens)
                w = m["window"]
                moved = run.migrations
                ok = (w["balance_efficiency"] >= 0.97 and w["count_imbalance"] <= 1.05
                      and w["kv_imbalance"] <= 1.05)  # fmt: skip
                rows.append([name, batch, "none" if every is None else f"{k} every {every} s",
                             "-" if every is None else label,
                             round(w["balance_efficiency"], 4), round(w["count_imbalance"], 3),
                             round(w["kv_imbalance"], 3), round(w["batch_per_rank_mean"], 1),
                             round(1e3 * m["tpot_p50_s"], 2), round(1e3 * m["tpot_p99_s"], 2),
                             moved, round(100 * moved / len(trace), 1),
                             round(pol.migrated_kv_tokens / max(moved, 1)),
                             round(1e3 * run.migration_s / max(moved, 1), 1),
                             "yes" if ok else "no"])  # fmt: skip
                print(name, "migration", rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs, traces = [], []
    for name, path in SCENARIOS:
        if path.exists():
            trace = load_bench_trace(path)
            traces.append((name, trace))
            runs += [(name, u, trace) for u in (0.7, 0.9)]
    runs.append(("default", 0.8, default_workload()))
    pre_rows, dec_rows, tgt_rows = _prefill_scenarios(runs)
    share_rows, loss_rows, share_pre_rows = _sharing(runs)
    do_rows, do_tgt = _decode_only(traces)
    mig_rows = _decode_migration(traces)
    sweep = [row for name, trace in traces for u in (0.7, 0.9)
             for row in _wake_sweep(name, trace, u)]  # fmt: skip
    tables = [
        {"title": "Simulator targets (lbkit)",
         "note": "Targets: prefill balance >= 0.95; p99 TTFT <= 0.5 x round robin's and <= 1.0 x "
                 "the best baseline's; decode balance >= 0.97, count and KV imbalance <= 1.05; "
                 ">= 20,000 requests/s per policy (wall clock, noisy). Count floor: the smallest "
                 "count imbalance integer request counts allow at the decode pool's load.",
         "columns": ["trace", "U", "prefill balance", "p99 / round robin", "p99 / best baseline",
                     "decode balance", "count imb", "KV imb", "count floor", "slowest req/s"],
         "rows": tgt_rows},
        {"title": "Prefill targets with engine-side work sharing (lbkit)",
         "note": "Engine models (simulate_prefill work_sharing): off = each rank plans its own "
                 "FIFO queue; budget = at each step's start the engine deals the requests that "
                 "have not started, earliest first, to its least-loaded ranks up to the step "
                 "budget; level = the same with the step budget lowered to the largest step the "
                 "engine's requests fill on every rank; split = level plus context parallelism "
                 "(idle ranks share a prompt's chunk; no communication cost) and lbkit routes "
                 "by engine (LBKIT_CP_OPTIONS: the bucket's engine with the least mean quota "
                 "load); split 0.8 = the same with a parallel efficiency of 0.8 (n ranks run a "
                 "chunk 0.8 n times as fast as one). Every policy runs under the same engine "
                 "model; p99 ratios are against round robin and the best baseline (by p99) "
                 "under that model. Moves: requests the engines moved between ranks (reported "
                 "to lbkit's ledger).",
         "columns": ["trace", "U", "engine", "prefill balance", "TTFT p50", "TTFT p99",
                     "p99 / round robin", "p99 / best baseline", "best baseline", "moves",
                     "lbkit req/s", "slowest req/s"],
         "rows": share_rows},
        {"title": "Where lbkit's prefill balance is lost",
         "note": "Loss = 1 - balance = sum over engine steps of (max - mean rank time) / sum of "
                 "max: from idle ranks (a rank with nothing to run while a sibling steps) and "
                 "from busy ranks that end early. k busy: share of the step time (sum of max) "
                 "in steps with k of the 4 ranks busy. Few requests: steps of engines holding "
                 "fewer requests than ranks, which no plan inside the engine can fill (a "
                 "request runs on one rank): their share of the step time, their balance, and "
                 "the loss they account for.",
         "columns": ["trace", "U", "engine", "loss", "idle ranks", "unequal busy", "k=1",
                     "k=2", "k=3", "k=4", "few requests share", "few requests balance",
                     "few requests loss"],
         "rows": loss_rows},
        {"title": "Decode targets at a realistic batch (decode-only replay, lbkit)",
         "note": "Each trace enters the 64-rank decode engine directly, time-scaled so that the "
                 "mean batch per rank is about the target; statistics over the steady window "
                 "(steps starting after the first quarter of the arrivals, before the last "
                 "arrival). Best baseline: the baseline with the highest balance.",
         "columns": ["trace", "batch target", "batch (calibrated)", "balance", "count imb",
                     "KV imb", "count floor", "best baseline balance", "slowest req/s"],
         "rows": do_tgt},
        {"title": "Decode-only replay with migration (lbkit)",
         "note": "The decode-only replay above with lbkit's balancer migrating running requests "
                 "(LbkitDecode(migrate_every_s=..., max_migrations=...): DecodeBalancer.rebalance "
                 "at most every so many seconds, checked at each arrival; one engine step takes "
                 "about 0.03-0.04 s here). Transfer: the KV transfer time of a move "
                 "(simulate_decode migration_latency_s=0.5 ms, migration_s_per_kv_token = "
                 "70,272 bytes per token of DeepSeek-V3's BF16 MLA cache over the bandwidth), "
                 "during which the request does not decode; 'not modelled': it keeps decoding. "
                 "TPOT in ms over all requests; transfer ms: mean per move. Met: balance >= 0.97 "
                 "and both imbalances <= 1.05.",
         "columns": ["trace", "batch target", "migration", "transfer", "balance", "count imb",
                     "KV imb", "batch/rank", "TPOT p50", "TPOT p99", "moves",
                     "moves per 100 requests", "KV tokens per move", "transfer ms per move",
                     "met"],
         "rows": mig_rows},
        {"title": "Prefill pool, 16 engines x 4 ranks",
         "note": "TTFT in seconds; perfect (fluid) = queued work shared by all ranks.",
         "columns": ["trace", "U", "policy", "balance", "TTFT p50", "TTFT p99", "finished",
                     "refused", "req/s"],
         "rows": pre_rows},
        {"title": "Prefill pool with work sharing, 16 engines x 4 ranks",
         "note": "Every policy under the engine model of the engine column; TTFT in seconds.",
         "columns": ["trace", "U", "engine", "policy", "balance", "TTFT p50", "TTFT p99",
                     "finished", "moves", "req/s"],
         "rows": share_pre_rows},
        {"title": "Decode pool, 1 engine x 64 ranks (fed by the lbkit prefill run)",
         "note": "TPOT in ms; count floor = ceil(mean)/mean of integer request counts.",
         "columns": ["trace", "U", "policy", "balance", "count imb", "KV imb", "TPOT p99",
                     "batch/rank", "count floor", "req/s"],
         "rows": dec_rows},
        {"title": "Decode-only replay, 1 engine x 64 ranks, steady window",
         "note": "TPOT in ms over all requests; the other columns over the steady window.",
         "columns": ["trace", "batch target", "policy", "balance", "count imb", "KV imb",
                     "batch/rank", "count floor", "TPOT p99", "req/s"],
         "rows": do_rows},
        {"title": "Engine-aware rank choice: prefill balance against TTFT (lbkit)",
         "note": "wake_penalty_s: extra seconds a rank of an idle engine counts (under split, "
                 "which lbkit scores by engine: an idle engine); the other options as in "
                 "LBKIT_OPTIONS (split: LBKIT_CP_OPTIONS); engine: work sharing off, level or "
                 "split. Balance rises only as requests queue on engines that already step.",
         "columns": ["trace", "U", "engine", "wake penalty (s)", "balance", "TTFT p50",
                     "TTFT p99"],
         "rows": sweep},
    ]  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"tables": tables}, indent=1) + "\n")


if __name__ == "__main__":
    main()
