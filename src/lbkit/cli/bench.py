"""``lbkit bench``: replay a workload through every prefill and decode policy and compare them."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from lbkit.cli.bench_checks import check_options, check_workload, read_trace
from lbkit.cli.bench_report import plot, print_report
from lbkit.cli.checks import MAX_POOL_RANKS, MAX_PREFILL_STEPS, MAX_REQUEST_TOKENS, MAX_REQUESTS

__all__ = ["add_parser", "run"]

_PROGRESS_AFTER_S = 3.0
#: Requests of the built-in workload that ``lbkit bench`` replays without ``--trace`` (each
#: policy's goodput search replays them about ten times; ``--max-requests`` changes it).
BUILTIN_REQUESTS = 6_000
#: DeepSeek-V3's KV cache bytes per token (MLA latent 512 + RoPE key 64 values, 61 layers, BF16).
KV_BYTES_PER_TOKEN = 61 * 576 * 2
#: Default KV transfer bandwidth of a migrated decode request, GB/s.
MIGRATION_GBPS = 40.0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``lbkit bench`` on the subcommand parser ``sub``; returns its parser."""
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
            "with the greedy and default methods. Every option and the trace are checked before "
            "any work; limits: pools of up to "
            f"{MAX_POOL_RANKS:,} ranks, up to {MAX_REQUESTS:,} requests of up to "
            f"{MAX_REQUEST_TOKENS:,} prompt and output tokens each, and up to "
            f"{MAX_PREFILL_STEPS:,} predicted prefill steps per replay (docs/cli.md). A bad "
            "input ends with one line on stderr and exit status 2."
        ),
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help="trace file: Mooncake JSONL or Azure CSV (default: built-in workload); at least 2 "
        "requests with distinct arrival times, no outlier timestamp that leaves the trace idle "
        "for over 90%% of its span",
    )
    p.add_argument(
        "--format",
        choices=("mooncake", "azure"),
        help="trace format, with --trace (default: detected from the first line or the suffix)",
    )
    p.add_argument(
        "--utilization",
        type=float,
        default=0.8,
        metavar="U",
        help="offered prefill utilisation, 0.01 to 10: arrivals are time-scaled so that the "
        "trace's prefill work equals U x duration x prefill ranks (default 0.8)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the built-in workload and of randomised policies, 0 to 2**32 - 1 (default 0)",
    )
    p.add_argument(
        "--prefill-engines",
        type=int,
        default=8,
        metavar="E",
        help=f"prefill engines (default 8; engines x ranks at most {MAX_POOL_RANKS:,})",
    )
    p.add_argument(
        "--ranks-per-engine",
        type=int,
        default=8,
        metavar="R",
        help="DP ranks per prefill engine (default 8)",
    )
    p.add_argument(
        "--decode-engines",
        type=int,
        default=1,
        metavar="E",
        help=f"decode engines (default 1; engines x ranks at most {MAX_POOL_RANKS:,})",
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
        help="replay only the first N requests of the trace, fewer than it holds (the "
        f"built-in workload: generate N requests; default {BUILTIN_REQUESTS:,}); 2 to "
        f"{MAX_REQUESTS:,}",
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
        help="time budget of a prefill rank's step plan, 0.001 to 3600 (default 1.0); a "
        "smaller budget means more simulated steps",
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
        help="with --work-sharing split: parallel efficiency of context parallelism, 0.01 to 1: "
        "n ranks run a prompt chunk n x E times as fast as one (default 1: communication is "
        "free); lbkit then routes by engine (the least mean quota load of the bucket's engines)",
    )
    p.add_argument(
        "--decode-batch",
        type=float,
        default=64.0,
        metavar="B",
        help="the decode comparison replays the trace straight into the decode pool "
        "(decode-only), time-scaled so that each rank holds about B running requests, 0.01 to "
        "4096 (default 64; decode ranks run 32-128; with the KV capacity of a rank the batch "
        "reached may be lower, and the table says so)",
    )
    p.add_argument(
        "--migrate-every",
        type=float,
        metavar="SECONDS",
        help="with --decode-batch: also run a variant of lbkit's decode balancer (row "
        "lbkit_migrate; moves may cross decode engines): at most every SECONDS of simulated "
        "time it calls DecodeBalancer.rebalance(--max-migrations); 0 = at every arrival (the "
        "lbkit row migrates too, with the balancer's defaults before every routing decision); "
        "0 to 86400",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=1,
        metavar="N",
        help="moves per rebalance with --migrate-every, 1 to 4096 (default 1)",
    )
    p.add_argument(
        "--migration-gbps",
        type=float,
        metavar="G",
        default=MIGRATION_GBPS,
        help="KV transfer bandwidth of a migrated request in GB/s, for every decode policy that "
        "migrates (lbkit's by default): a moved request stops decoding until its KV has "
        f"arrived (default {MIGRATION_GBPS:g}: one 400 Gb/s RDMA NIC per GPU at 80%%); 0.001 to "
        "100000",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=KV_BYTES_PER_TOKEN,
        metavar="B",
        help=f"KV cache bytes per token for --migration-gbps (default {KV_BYTES_PER_TOKEN:,}: "
        "DeepSeek-V3's MLA cache in BF16, 61 layers x 576 values x 2 bytes); 1 to 2**24",
    )
    p.add_argument(
        "--cache",
        choices=("none", "global", "local"),
        default="global",
        help="prefix caches of the prefill pool, driven by the trace's block hashes: global (one "
        "cache shared by every rank, DeepSeek's design; the default), local (each rank its own "
        "LRU cache of 512-token blocks sized from its KV memory, the common vLLM and SGLang "
        "deployment) or none; a trace without hash_ids caches nothing (the default becomes "
        "none; giving global or local for it is refused)",
    )
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=2.0,
        metavar="S",
        help="SLO: a request's TTFT may be S seconds, 0.001 to 86400 (default 2) ...",
    )
    p.add_argument(
        "--slo-ttft-slowdown",
        type=float,
        default=4.0,
        metavar="X",
        help="... or X times its prefill time alone on an idle rank, whichever is larger, 0 "
        "to 10000 (default 4)",
    )
    p.add_argument(
        "--slo-tpot",
        type=float,
        default=0.05,
        metavar="S",
        help="SLO: time per output token after the first, seconds, 0.0001 to 3600 (default 0.05)",
    )
    p.add_argument(
        "--attainment",
        type=float,
        default=0.99,
        metavar="A",
        help="goodput is the highest arrival rate at which a share A of requests meets its SLO, "
        "in (0, 1] (default 0.99); the SLO options need the goodput search (not --no-goodput)",
    )
    p.add_argument(
        "--no-goodput",
        action="store_true",
        help="skip the goodput search (the diagnostics at --utilization only)",
    )
    p.add_argument("--no-eplb", action="store_true", help="skip the EPLB comparison")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="K",
        help="also run lbkit as K router replicas in front of each pool (rows lbkit_replicas "
        "of the goodput and decode-only tables; request i goes to replica i mod K), 1 to 1024 "
        "(default 1: one router, no extra rows)",
    )
    p.add_argument(
        "--sync",
        choices=("shared", "reports", "polled", "none"),
        default="shared",
        help="how the replicas see each other's load: shared (one store read --sync-delay "
        "late; the default), reports (engine totals broadcast every --sync-period), polled "
        "(each replica polls the totals every --sync-period at a phase of its own) or none "
        "(own admissions only); needs --replicas K > 1",
    )
    p.add_argument(
        "--sync-delay",
        type=float,
        default=0.0005,
        metavar="S",
        help="--sync shared: round trip of the store, seconds, 0 to 3600 (default 0.0005)",
    )
    p.add_argument(
        "--sync-period",
        type=float,
        default=1.0,
        metavar="S",
        help="--sync reports and polled: interval of the engine reports (of a replica's polls), "
        "seconds, (0, 86400] (default 1)",
    )
    p.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write the report as JSON (SPEC section 7; wall-clock seconds under 'timing'); "
        "checked to be writable before the run",
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="save a figure (TTFT CDF per policy, balance efficiency over time), its format "
        "from the suffix (.png, .pdf, .svg, ...); needs matplotlib (pip install 'lbkit[plot]')",
    )
    p.set_defaults(run=run)
    return p


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


def run(args: argparse.Namespace) -> int:
    """Execute ``lbkit bench`` for parsed ``args`` (checked first: see :mod:`.bench_checks`)."""
    resolved = check_options(args)
    pp, dp = resolved["prefill_policies"], resolved["decode_policies"]
    from lbkit.sim.bench import run_bench, run_decode_bench
    from lbkit.sim.policies import PREFILL_POLICIES
    from lbkit.sim.workload import default_workload

    if args.trace is not None:
        trace = read_trace(args)
    else:
        trace = default_workload(num_requests=args.max_requests or BUILTIN_REQUESTS, rng=args.seed)
        check_workload(trace, args, source="the built-in workload")
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
                replicas=resolved["replicas"],
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
            replicas=resolved["replicas"],
        )
    finally:
        progress.close()
    report = res.report
    report["options"]["cache"] = cache
    report["options"]["slo"] = slo.as_dict()
    sync = resolved["replicas"]
    report["options"]["replicas"] = None if sync is None else {
        "k": sync.k, "mode": sync.mode, "delay_s": sync.delay_s, "period_s": sync.period_s,
    }  # fmt: skip
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
    print_report(res.report, wall)
    if args.json is not None:
        args.json.write_text(json.dumps(res.report, indent=2) + "\n")
    if args.plot is not None:
        plot(res, args.plot)
    return 0
