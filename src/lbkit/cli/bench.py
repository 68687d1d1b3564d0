"""``lbkit bench``: replay a workload through every prefill and decode policy and compare them."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]

_PROGRESS_AFTER_S = 3.0
#: Requests of the built-in workload that ``lbkit bench`` replays without ``--trace`` (each
#: policy's goodput search replays them about ten times; ``--max-requests`` changes it).
BUILTIN_REQUESTS = 6_000
#: DeepSeek-V3's KV cache bytes per token (MLA latent 512 + RoPE key 64 values, 61 layers, BF16).
KV_BYTES_PER_TOKEN = 61 * 576 * 2
#: Default KV transfer bandwidth of a migrated decode request, GB/s.
MIGRATION_GBPS = 40.0


def add_parser(sub: Any) -> None:
    """Register ``lbkit bench`` on the subcommand parser ``sub``."""
    p = sub.add_parser(
        "bench",
        help="simulate prefill and decode pools under every routing policy and compare them",
        description=(
            "Replay a request trace through a simulated prefill pool and decode pool "
            "(deterministic, seeded; see docs/simulator.md). First, per prefill routing policy "
            "(the baselines, the peers' rules of vLLM, SGLang, Dynamo and llm-d, and lbkit), its "
            "goodput at SLO: the highest arrival rate at which --attainment of the requests meet "
            "their TTFT and TPOT objectives, next to the ideal late-binding reference and the "
            "best peer. Then diagnostics: balance efficiency (mean/max rank time per synchronous "
            "step, 1.0 is perfect: a diagnostic, packing work onto fewer engines raises it), TTFT "
            "percentiles at --utilization, and the decode policies replayed at a realistic batch "
            "(--decode-batch); '*' marks the best value of each column. Without --trace, the "
            "built-in workload (Mooncake-calibrated lengths with long-context shares, multi-turn "
            "sessions and shared system prompts) is used. Also plans the built-in EPLB example "
            "with the greedy and default methods."
        ),
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help="trace file: Mooncake JSONL or Azure CSV (default: built-in workload)",
    )
    p.add_argument(
        "--format",
        choices=("mooncake", "azure"),
        help="trace format (default: detected from the first line or the suffix)",
    )
    p.add_argument(
        "--utilization",
        type=float,
        default=0.8,
        metavar="U",
        help="offered prefill utilisation: arrivals are time-scaled so that the "
        "trace's prefill work equals U x duration x prefill ranks (default 0.8)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the built-in workload and of randomised policies (default 0)",
    )
    p.add_argument(
        "--prefill-engines", type=int, default=8, metavar="E", help="prefill engines (default 8)"
    )
    p.add_argument(
        "--ranks-per-engine",
        type=int,
        default=8,
        metavar="R",
        help="DP ranks per prefill engine (default 8)",
    )
    p.add_argument(
        "--decode-engines", type=int, default=1, metavar="E", help="decode engines (default 1)"
    )
    p.add_argument(
        "--decode-ranks",
        type=int,
        default=64,
        metavar="R",
        help="DP ranks per decode engine (default 64)",
    )
    p.add_argument(
        "--policies",
        metavar="LIST",
        help="comma-separated policies to run (each in the pools that know it; default: all)",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        metavar="N",
        help="replay only the first N requests of the trace (the built-in workload: generate N "
        f"requests; default {BUILTIN_REQUESTS:,})",
    )
    p.add_argument(
        "--cost",
        default="h800_dsv3",
        metavar="PRESET",
        help="cost-model preset: h800_dsv3 (default) or unit",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="time budget of a prefill rank's step plan (default 1.0)",
    )
    p.add_argument(
        "--work-sharing",
        choices=("off", "budget", "level", "split"),
        default="off",
        help="engine-side sharing of un-started prefill requests among an engine's ranks at "
        "each step's start: off (each rank its own FIFO queue; the default), budget (idle "
        "ranks take siblings' queued requests up to the budget), level (the same, with the "
        "step budget lowered to the level the engine's requests fill on every rank) or split "
        "(level plus context parallelism: idle ranks share a prompt's chunk; optimistic, no "
        "communication cost)",
    )
    p.add_argument(
        "--cp-efficiency",
        type=float,
        default=1.0,
        metavar="E",
        help="with --work-sharing split: parallel efficiency of context parallelism, in (0, 1]: "
        "n ranks run a prompt chunk n x E times as fast as one (default 1: communication is "
        "free); lbkit then routes by engine (the least mean quota load of the bucket's engines)",
    )
    p.add_argument(
        "--decode-batch",
        type=float,
        default=64.0,
        metavar="B",
        help="the decode comparison replays the trace straight into the decode pool "
        "(decode-only), time-scaled so that each rank holds about B running requests (default "
        "64; decode ranks run 32-128; with the KV capacity of a rank the batch reached may be "
        "lower, and the table says so)",
    )
    p.add_argument(
        "--migrate-every",
        type=float,
        metavar="SECONDS",
        help="with --decode-batch: also run a variant of lbkit's decode balancer (row "
        "lbkit_migrate; moves may cross decode engines): at most every SECONDS of simulated "
        "time it calls DecodeBalancer.rebalance(--max-migrations); 0 = at every arrival (the "
        "lbkit row migrates too, with the balancer's defaults before every routing decision)",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=1,
        metavar="N",
        help="moves per rebalance with --migrate-every (default 1)",
    )
    p.add_argument(
        "--migration-gbps",
        type=float,
        metavar="G",
        default=MIGRATION_GBPS,
        help="KV transfer bandwidth of a migrated request in GB/s, for every decode policy that "
        "migrates (lbkit's by default): a moved request stops decoding until its KV has "
        f"arrived (default {MIGRATION_GBPS:g}: one 400 Gb/s RDMA NIC per GPU at 80%%)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=KV_BYTES_PER_TOKEN,
        metavar="B",
        help=f"KV cache bytes per token for --migration-gbps (default {KV_BYTES_PER_TOKEN:,}: "
        "DeepSeek-V3's MLA cache in BF16, 61 layers x 576 values x 2 bytes)",
    )
    p.add_argument(
        "--cache",
        choices=("none", "global", "local"),
        default="global",
        help="prefix caches of the prefill pool, driven by the trace's block hashes: global (one "
        "cache shared by every rank, DeepSeek's design; the default), local (each rank its own "
        "LRU cache of 512-token blocks sized from its KV memory, the common vLLM and SGLang "
        "deployment) or none",
    )
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=2.0,
        metavar="S",
        help="SLO: a request's TTFT may be S seconds (default 2) ...",
    )
    p.add_argument(
        "--slo-ttft-slowdown",
        type=float,
        default=4.0,
        metavar="X",
        help="... or X times its prefill time alone on an idle rank, whichever is larger "
        "(default 4)",
    )
    p.add_argument(
        "--slo-tpot",
        type=float,
        default=0.05,
        metavar="S",
        help="SLO: time per output token after the first, seconds (default 0.05)",
    )
    p.add_argument(
        "--attainment",
        type=float,
        default=0.99,
        metavar="A",
        help="goodput is the highest arrival rate at which a share A of requests meets its SLO "
        "(default 0.99)",
    )
    p.add_argument(
        "--no-goodput",
        action="store_true",
        help="skip the goodput search (the diagnostics at --utilization only)",
    )
    p.add_argument("--no-eplb", action="store_true", help="skip the EPLB comparison")
    p.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write the report as JSON (SPEC section 7; wall-clock seconds under 'timing')",
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="save a figure (TTFT CDF per policy, balance efficiency over time); "
        "needs matplotlib (pip install 'lbkit[plot]')",
    )
    p.set_defaults(run=run)


class _Progress:
    """A plain stderr progress line: live on a terminal, else one line per stage after 3 s."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.label = ""
        self.shown = False

    def __call__(self, label: str, done: int, total: int) -> None:
        if self.tty:
            frac = done / total if total else 1.0
            bar = "#" * int(frac * 20)
            sys.stderr.write(f"\r  {label:<26} [{bar:<20}] {done:>7,}/{total:,}")
            sys.stderr.flush()
            self.shown = True
        elif label != self.label and time.perf_counter() - self.start > _PROGRESS_AFTER_S:
            print(f"  ... {label}", file=sys.stderr, flush=True)
        self.label = label

    def close(self) -> None:
        if self.tty and self.shown:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


def _check_args(args: argparse.Namespace) -> None:
    if not (args.utilization > 0 and math.isfinite(args.utilization)):
        raise ValueError(f"--utilization: must be a finite number > 0, got {args.utilization}")
    for opt in ("prefill_engines", "ranks_per_engine", "decode_engines", "decode_ranks"):
        if getattr(args, opt) < 1:
            raise ValueError(f"--{opt.replace('_', '-')}: must be >= 1, got {getattr(args, opt)}")
    if args.max_requests is not None and args.max_requests < 2:
        raise ValueError(f"--max-requests: must be >= 2, got {args.max_requests}")
    if args.seed < 0:
        raise ValueError(f"--seed: must be >= 0, got {args.seed}")
    if not (args.budget > 0 and math.isfinite(args.budget)):
        raise ValueError(f"--budget: must be a finite number > 0, got {args.budget}")
    if not (0 < args.cp_efficiency <= 1):
        raise ValueError(f"--cp-efficiency: must be in (0, 1], got {args.cp_efficiency}")
    if args.cp_efficiency != 1.0 and args.work_sharing != "split":
        raise ValueError("--cp-efficiency: needs --work-sharing split")
    if not (args.decode_batch > 0 and math.isfinite(args.decode_batch)):
        raise ValueError(f"--decode-batch: must be a finite number > 0, got {args.decode_batch}")
    if args.migrate_every is not None:
        if not (args.migrate_every >= 0 and math.isfinite(args.migrate_every)):
            raise ValueError(
                f"--migrate-every: must be a finite number >= 0, got {args.migrate_every}"
            )
    if args.max_migrations < 1:
        raise ValueError(f"--max-migrations: must be >= 1, got {args.max_migrations}")
    if not (args.migration_gbps > 0 and math.isfinite(args.migration_gbps)):
        raise ValueError(
            f"--migration-gbps: must be a finite number > 0, got {args.migration_gbps}"
        )
    for opt in ("slo_ttft", "slo_tpot"):
        v = getattr(args, opt)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"--{opt.replace('_', '-')}: must be a finite number > 0, got {v}")
    if not (args.slo_ttft_slowdown >= 0 and math.isfinite(args.slo_ttft_slowdown)):
        raise ValueError(
            f"--slo-ttft-slowdown: must be a finite number >= 0, got {args.slo_ttft_slowdown}"
        )
    if not (0 < args.attainment <= 1):
        raise ValueError(f"--attainment: must be in (0, 1], got {args.attainment}")
    if args.kv_bytes_per_token < 1:
        raise ValueError(f"--kv-bytes-per-token: must be >= 1, got {args.kv_bytes_per_token}")


def run(args: argparse.Namespace) -> int:
    """Execute ``lbkit bench`` for parsed ``args``."""
    _check_args(args)
    from lbkit.sim.bench import load_bench_trace, run_bench, run_decode_bench
    from lbkit.sim.policies import PREFILL_POLICIES
    from lbkit.sim.policies_decode import DECODE_POLICIES
    from lbkit.sim.workload import default_workload

    if args.trace is not None:
        trace = load_bench_trace(args.trace, format=args.format)
        if args.max_requests is not None:
            trace = trace.head(args.max_requests)
    else:
        trace = default_workload(num_requests=args.max_requests or BUILTIN_REQUESTS, rng=args.seed)
    pp = dp = None
    if args.policies is not None:
        names = [t.strip() for t in args.policies.split(",") if t.strip()]
        unknown = [n for n in names if n not in PREFILL_POLICIES and n not in DECODE_POLICIES]
        if unknown or not names:
            known = sorted(set(PREFILL_POLICIES) | set(DECODE_POLICIES))
            raise ValueError(
                f"--policies: unknown policy {unknown[0] if unknown else ''!r}; "
                f"choose from {', '.join(known)}"
            )
        pp = [n for n in names if n in PREFILL_POLICIES] or ["lbkit"]
        dp = [n for n in names if n in DECODE_POLICIES] or ["lbkit"]
    from lbkit.core import PRESETS
    from lbkit.sim.goodput import Slo
    from lbkit.sim.goodput_bench import (
        GoodputOptions,
        Pools,
        local_caches,
        prepare_cache,
        run_goodput,
    )

    cache = args.cache
    if trace.hash_ids is None and cache != "none":
        cache = "none"  # no block hashes: nothing to cache (e.g. the Azure traces)
    prepared = prepare_cache(trace, cache)
    slo = Slo(
        ttft_s=args.slo_ttft,
        ttft_slowdown=args.slo_ttft_slowdown,
        tpot_s=args.slo_tpot,
        attainment=args.attainment,
    )
    pools = Pools(
        prefill_engines=args.prefill_engines,
        ranks_per_engine=args.ranks_per_engine,
        decode_engines=args.decode_engines,
        decode_ranks=args.decode_ranks,
    )
    options = GoodputOptions(
        pools=pools, slo=slo, cache=cache, budget_s=args.budget, seed=args.seed
    )
    rank_cache = local_caches(pools.num_prefill_ranks) if cache == "local" else None
    progress = _Progress()
    start = time.perf_counter()
    try:
        goodput = None
        if not args.no_goodput:
            goodput = run_goodput(
                prepared,
                policies=pp if pp is not None else list(PREFILL_POLICIES),
                cost=PRESETS[args.cost],
                options=options,
                rank_cache=rank_cache,
                progress=progress,
            )
        res = run_bench(
            prepared,
            utilization=args.utilization,
            seed=args.seed,
            prefill_engines=args.prefill_engines,
            ranks_per_engine=args.ranks_per_engine,
            decode_engines=args.decode_engines,
            decode_ranks=args.decode_ranks,
            prefill_policies=pp,
            decode_policies=[],
            cost=args.cost,
            budget_s=args.budget,
            work_sharing=args.work_sharing,
            cp_efficiency=args.cp_efficiency,
            eplb=not args.no_eplb,
            rank_cache=rank_cache,
            progress=progress,
        )
        progress("decode", 0, 1)
        decode = run_decode_bench(
            trace,
            batch_per_rank=args.decode_batch,
            seed=args.seed,
            decode_engines=args.decode_engines,
            decode_ranks=args.decode_ranks,
            decode_policies=dp,
            cost=args.cost,
            migrate_every_s=args.migrate_every,
            max_migrations=args.max_migrations,
            migration_s_per_kv_token=args.kv_bytes_per_token / (args.migration_gbps * 1e9),
        )
    finally:
        progress.close()
    report = res.report
    report["options"]["cache"] = cache
    report["options"]["slo"] = slo.as_dict()
    if goodput is not None:
        report["goodput"] = goodput["goodput"]
        report["ideal"] = goodput["ideal"]
        report["goodput_details"] = {k: v for k, v in goodput.items()
                                     if k not in ("goodput", "ideal")}  # fmt: skip
    report["decode"] = decode["decode"]
    report["decode_run"] = {k: v for k, v in decode.items() if k not in ("decode", "timing")}
    report["timing"]["decode"] = decode.get("timing")  # wall-clock: kept apart (determinism)
    wall = time.perf_counter() - start
    res.report["timing"]["wall_s"] = wall
    _print_report(res.report, wall)
    if args.json is not None:
        args.json.write_text(json.dumps(res.report, indent=2) + "\n")
    if args.plot is not None:
        _plot(res, args.plot)
    return 0


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "s":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:,.0f}"
    if kind == "ms":
        return f"{v * 1e3:.2f}"
    if kind == "r":
        return f"{v:.4f}"
    if kind == "x":
        return f"{v:.1f}"
    return f"{int(v):,}"


def _table(title: str, rows: dict[str, dict[str, Any]], cols: list[tuple[str, str, str, str]],
           extra: list[tuple[str, dict[str, Any]]] = ()) -> None:  # fmt: skip
    """cols: (key, header, format kind, best: 'max' | 'min' | '')."""
    out = sys.stdout
    print(title, file=out)
    width = max([len(k) for k in rows] + [len(n) for n, _ in extra] + [8]) + 2
    head = f"  {'policy':<{width}}" + "".join(f"{h:>{max(len(h) + 2, 10)}}" for _, h, _, _ in cols)
    print(head, file=out)
    print("  " + "-" * (len(head) - 2), file=out)
    best: dict[str, Any] = {}
    for key, _, _, rule in cols:
        vals = [r[key] for r in rows.values() if r.get(key) is not None]
        if rule and vals and len(rows) > 1:
            best[key] = max(vals) if rule == "max" else min(vals)
    for name, r in [*rows.items(), *extra]:
        cells = []
        for key, h, kind, _ in cols:
            v = r.get(key)
            mark = "*" if key in best and v == best[key] and name in rows else " "
            cells.append(f"{_fmt(v, kind) + mark:>{max(len(h) + 2, 10)}}")
        print(f"  {name:<{width}}" + "".join(cells), file=out)
    print("", file=out)


def _bucket_table(pre: dict[str, dict[str, Any]]) -> None:
    """TTFT p50 and p99 per length bucket: what a short prompt waits under each policy."""
    labels: list[str] = []
    for m in pre.values():
        labels += [b for b in m.get("per_bucket", {}) if b not in labels]
    if not labels:
        return
    counts = {b: next(m["per_bucket"][b]["requests"] for m in pre.values()
                      if b in m.get("per_bucket", {})) for b in labels}  # fmt: skip
    rows = {
        name: {f"{b}|{q}": m.get("per_bucket", {}).get(b, {}).get(f"ttft_{q}_s")
               for b in labels for q in ("p50", "p99")}
        for name, m in pre.items()
    }  # fmt: skip
    cols = [(f"{b}|{q}", f"{b} {q}" if q == "p50" else "p99", "s", "min")
            for b in labels for q in ("p50", "p99")]  # fmt: skip
    _table(
        "Prefill TTFT by prompt length (seconds; requests per bucket: "
        + ", ".join(f"{b} {counts[b]:,}" for b in labels)
        + ")",
        rows,
        cols,
    )


def _goodput_table(r: dict[str, Any]) -> None:
    """The headline: goodput at SLO per policy, with the ideal reference and the best peer."""
    g = r
    slo = g["slo"]
    ideal = g["ideal"]
    rows = {name: dict(row) for name, row in g["goodput"].items()}
    best = g.get("best_peer_requests_per_s")
    _table(
        f"Goodput at SLO (requests/s at which {slo['attainment']:.0%} of requests meet TTFT <= "
        f"max({slo['ttft_s']:g} s, {slo['ttft_slowdown']:g} x prefill alone) and TPOT <= "
        f"{slo['tpot_s'] * 1e3:g} ms; cache {g['cache']}; ideal = late binding, "
        f"{ideal['requests_per_s']:.3f} requests/s; best peer "
        + ("-" if best is None else f"{best:.3f}")
        + "; latencies at each policy's goodput)",
        rows,
        [
            ("requests_per_s", "goodput", "r", "max"),
            ("vs_ideal", "vs ideal", "r", "max"),
            ("vs_best_peer", "vs best peer", "r", "max"),
            ("ttft_p50_s", "TTFT p50", "s", ""),
            ("ttft_p99_s", "TTFT p99", "s", ""),
            ("tpot_p99_s", "TPOT p99 ms", "ms", ""),
            ("cached_share", "cached", "r", ""),
        ],
        [("ideal", ideal)],
    )


def _print_report(r: dict[str, Any], wall: float) -> None:
    w, o = r["workload"], r["options"]
    if "goodput" in r:
        _goodput_table({"goodput": r["goodput"], "ideal": r["ideal"], **r["goodput_details"]})
    print(
        f"lbkit bench: {w['source']}, {w['requests']:,} requests; prefill {o['prefill_engines']} "
        f"x {o['ranks_per_engine']} ranks at utilisation {o['utilization']:g} (arrivals x "
        f"{w['time_scale']:.4g}, {w['duration_s']:,.0f} s); decode {o['decode_engines']} x "
        f"{o['decode_ranks']} ranks fed by the {o['decode_fed_by']} prefill run; cost "
        f"{o['cost']}, seed {o['seed']}\n"
    )
    pre = r["prefill"]
    if pre:
        ref = next(iter(pre.values()))["reference"]
        _table(
            "Prefill (TTFT in seconds; slowdown = TTFT / prefill time alone)",
            pre,
            [
                ("balance_efficiency", "balance", "r", "max"),
                ("ttft_p50_s", "TTFT p50", "s", "min"),
                ("ttft_p90_s", "p90", "s", "min"),
                ("ttft_p99_s", "p99", "s", "min"),
                ("ttft_slowdown_p99", "slowdown p99", "x", "min"),
                ("finished", "finished", "n", ""),
                ("refused", "refused", "n", ""),
                ("in_flight", "in flight", "n", ""),
            ],
            [("perfect (fluid)", ref)],
        )
        _bucket_table(pre)
    if r.get("decode"):
        d = {**r["decode_run"], "decode": r["decode"]}
        w = d["workload"]
        rows = {
            k: {**m["window"], "tpot_p99_s": m["tpot_p99_s"], "migrations": m["migrations"],
                "mean_running_per_rank": m.get("mean_running_per_rank")}
            for k, m in d["decode"].items()
        }  # fmt: skip
        first = next(iter(rows.values()))
        mig = d["options"].get("migration")
        note = ""
        if mig is not None:
            transfer = (
                "transfer time not modelled"
                if mig["s_per_kv_token"] == 0
                else f"KV transfer {mig['s_per_kv_token'] * 1e6:.3g} us per token"
            )
            note = (
                f"; lbkit_migrate: up to {mig['max_migrations']} move(s) every "
                f"{mig['every_s']:g} s, {transfer}"
            )
        cols = [
            ("balance_efficiency", "balance", "r", "max"),
            ("count_imbalance", "count imb", "r", "min"),
            ("kv_imbalance", "KV imb", "r", "min"),
            ("count_imbalance_floor", "count floor", "r", ""),
            ("mean_running_per_rank", "running/rank", "x", ""),
            ("tpot_p99_s", "TPOT p99", "ms", "min"),
        ]
        cols.append(("migrations", "moves", "n", ""))
        bound = " (the KV capacity bounds the batch)" if w.get("capacity_bound") else ""
        verdict = (
            "meaningful: every policy's ranks run 32-128 requests"
            if d.get("meaningful")
            else "NOT MEANINGFUL as a decode comparison: ranks run outside 32-128 requests"
        )
        _table(
            f"Decode-only replay at about {w['batch_per_rank_target']:g} requests per rank"
            f"{bound} (arrivals x {w['time_scale']:.4g}; steady window: steps from "
            f"{first['start_s']:.0f} s to {first['stop_s']:.0f} s; TPOT in ms, waits under "
            f"back-pressure included{note}; {verdict})",
            rows,
            cols,
        )
    if "eplb" in r:
        e = r["eplb"]
        _table(
            f"EPLB (built-in example {e['example']['num_layers']} x "
            f"{e['example']['num_experts']}; moe_lb = max/mean GPU load)",
            e["methods"],
            [("moe_lb_mean", "moe_lb mean", "r", "min"), ("moe_lb_worst", "worst", "r", "min")],
            [("lower bound", e["lower_bound"])],
        )
    rates = [v for v in r["timing"]["requests_per_s"].values() if v]
    slowest = min(rates) if rates else float("nan")
    print(
        f"  '*' best in column. Wall time {wall:.1f} s; slowest policy replay "
        f"{slowest:,.0f} requests/s."
    )


def _plot(res: Any, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot: needs matplotlib; install it with pip install 'lbkit[plot]'"
        ) from None
    import numpy as np

    report = res.report
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.8))
    if "goodput" in report:
        rows = {"ideal": report["ideal"], **report["goodput"]}
        for name, row in rows.items():
            pts = sorted({r: a for r, a in row["curve"]}.items())
            if pts:
                x, y = zip(*pts, strict=True)
                ax0.plot(x, y, marker=".", label=name, lw=2.0 if name in ("ideal", "lbkit") else 1)
        target = report["options"]["slo"]["attainment"]
        ax0.axhline(target, color="grey", ls=":", lw=1)
        ax0.set_xscale("log")
        ax0.set_xlabel("arrival rate (requests/s)")
        ax0.set_ylabel("share of requests meeting the SLO")
        ax0.set_title("SLO attainment against arrival rate")
        ax0.legend(fontsize=7, ncol=2)
    for name, run in res.prefill_runs.items():
        ttft = np.sort(run.ttft_s[run.finished])
        if ttft.size:
            ax1.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (s)")
    ax1.set_ylabel("share of requests")
    ax1.set_title(f"Prefill TTFT CDF at utilisation {report['options']['utilization']:g}")
    ax1.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
