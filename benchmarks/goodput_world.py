"""Goodput at SLO of every prefill policy, with and without prefix caches, on the public traces and
the built-in workload: the figures behind ``lbkit bench``'s headline table, for the whole suite.

For each trace (Mooncake conversation, Azure 2023 conversation, the built-in workload) and each
cache mode (none, global: one LRU cache shared by the pool; local: each of the 8 x 8 prefill
ranks its own LRU cache of ``capacity_blocks_for()`` blocks) this runs
:func:`lbkit.sim.goodput_bench.run_goodput` for the ideal late-binding reference and every
policy of :data:`lbkit.sim.policies.PREFILL_POLICIES`: default pools (8 x 8 prefill ranks, one
decode engine of 64 ranks), cost preset ``h800_dsv3``, the default SLO. The Azure trace has no
block hashes, so its cached modes are the same run as ``none``: it runs once and the JSON says so.

Usage::

    python benchmarks/goodput_world.py --json benchmarks/results/goodput_world.json
    python benchmarks/goodput_world.py --max-requests 2000 --traces mooncake --caches none

Progress goes to stderr. The JSON records the command, the machine's load average before and
after, and the wall time of every scenario (the machine is shared: wall times are noisy).
``benchmarks/make_performance.py`` renders it as the "Goodput at SLO" section of
``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

from lbkit.core import PRESETS
from lbkit.sim.bench import load_bench_trace
from lbkit.sim.goodput_bench import (
    CACHE_MODES,
    DEFAULT_GOODPUT_OPTIONS,
    PEER_NAMES,
    local_caches,
    prepare_cache,
    run_goodput,
)
from lbkit.sim.policies import PREFILL_POLICIES
from lbkit.sim.prefix_cache import capacity_blocks_for
from lbkit.sim.workload import default_workload
from run_record import PUBLIC_TRACES, ROOT, TRACES, csv_names, git_commit, load_avg, log

#: Trace name -> file (``None``: the built-in workload).
TRACE_FILES = {k: None if v is None else TRACES / v for k, v in PUBLIC_TRACES.items()}
COST = "h800_dsv3"
#: ``lbkit bench``'s defaults: 8 x 8 prefill ranks, one decode engine of 64, the default SLO,
#: seed 0 (the cache mode is set per scenario).
OPTIONS = DEFAULT_GOODPUT_OPTIONS
POOLS = OPTIONS.pools
SEED = OPTIONS.seed
#: Above this size the saved JSON drops the per-policy (rate, attainment) curves.
MAX_JSON_BYTES = 2_000_000


def _trace(name: str, args: argparse.Namespace):
    path = TRACE_FILES[name]
    if path is None:
        trace = default_workload(rng=SEED)
        if args.workload_max_requests is not None:
            trace = trace.head(args.workload_max_requests)
    else:
        trace = load_bench_trace(path)
    if args.max_requests is not None:
        trace = trace.head(args.max_requests)
    return trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the results here")
    ap.add_argument("--traces", metavar="LIST", help=f"of {', '.join(TRACE_FILES)} (default all)")
    ap.add_argument("--caches", metavar="LIST", help=f"of {', '.join(CACHE_MODES)} (default all)")
    ap.add_argument("--policies", metavar="LIST", help="prefill policies (default all)")
    ap.add_argument("--max-requests", type=int, metavar="N",
                    help="replay only the first N requests of every trace")  # fmt: skip
    ap.add_argument("--workload-max-requests", type=int, metavar="N",
                    help="replay only the first N requests of the built-in workload "
                    "(20,000 requests)")  # fmt: skip
    args = ap.parse_args(argv)
    for opt in ("max_requests", "workload_max_requests"):
        v = getattr(args, opt)
        if v is not None and v < 2:
            raise SystemExit(f"--{opt.replace('_', '-')}: must be >= 2, got {v}")
    traces = csv_names(args.traces, TRACE_FILES, "traces")
    caches = csv_names(args.caches, CACHE_MODES, "caches")
    policies = csv_names(args.policies, PREFILL_POLICIES, "policies")
    cost = PRESETS[COST]
    start = time.perf_counter()
    out = {
        "command": " ".join(["python", "benchmarks/goodput_world.py", *sys.argv[1:]])
        if argv is None
        else " ".join(["python", "benchmarks/goodput_world.py", *argv]),
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(ROOT),
        "machine": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_avg_start": load_avg(),
        },
        "options": {
            "cost": COST,
            "prefill": f"{POOLS.prefill_engines} x {POOLS.ranks_per_engine}",
            "decode": f"{POOLS.decode_engines} x {POOLS.decode_ranks}",
            "slo": OPTIONS.slo.as_dict(),
            "seed": SEED,
            "local_capacity_blocks": capacity_blocks_for(),
            "max_requests": args.max_requests,
            "workload_max_requests": args.workload_max_requests,
            "policies": policies,
            "peers": list(PEER_NAMES),
        },
        "notes": [],
        "skipped": [],
        "scenarios": [],
    }
    for name in traces:
        path = TRACE_FILES[name]
        if path is not None and not path.exists():
            msg = f"{name}: {path} not found, skipped"
            print(msg, file=sys.stderr, flush=True)
            out["skipped"].append(msg)
            continue
        trace = _trace(name, args)
        modes = caches
        if trace.hash_ids is None and any(c != "none" for c in caches):
            # No block hashes: no prefix structure, every cached mode is the run without caches.
            modes = ["none"]
            same = [c for c in caches if c != "none"]
            out["notes"].append(
                f"{name}: no block hashes, so cache modes {', '.join(same)} are the same run as "
                f"'none' (cached tokens {int(trace.cached_tokens.sum())}); run once as 'none'"
            )
        for cache in modes:
            t0 = time.perf_counter()
            log(f"{name} cache={cache}: {len(trace):,} requests", start)

            def progress(label, done, total, _n=name, _c=cache):
                log(f"  {_n}/{_c} {label} ({done}/{total})", start)

            res = run_goodput(
                prepare_cache(trace, cache),
                policies=policies,
                cost=cost,
                options=dataclasses.replace(OPTIONS, cache=cache),
                rank_cache=local_caches(POOLS.num_prefill_ranks) if cache == "local" else None,
                progress=progress,
            )
            wall = time.perf_counter() - t0
            scen = {
                "trace": name,
                "source": trace.source,
                "cache": cache,
                "requests": len(trace),
                "wall_s": round(wall, 1),
                "result": res,
            }
            if trace.hash_ids is None and cache == "none" and len(caches) > 1:
                scen["same_as"] = [c for c in caches if c != "none"]
            out["scenarios"].append(scen)
            ideal = res["ideal"]["requests_per_s"]
            best = max(res["goodput"], key=lambda k: res["goodput"][k]["requests_per_s"])
            log(f"{name} cache={cache}: done in {wall:.0f} s; ideal {ideal:.3f} req/s, best "
                 f"{best} {res['goodput'][best]['requests_per_s']:.3f}", start)  # fmt: skip
            _save(out, args.json, start, done=False)
    _save(out, args.json, start, done=True)
    log(f"all done in {out['wall_s']:.0f} s", start)
    return 0


def _save(out: dict, path: Path | None, start: float, *, done: bool) -> None:
    # Written after every scenario (``complete`` false until the end) so that a long run that is
    # stopped keeps what it measured.
    out["complete"] = done
    out["machine"]["load_avg_end"] = load_avg()
    out["wall_s"] = round(time.perf_counter() - start, 1)
    if path is None:
        return
    text = json.dumps(out, indent=1) + "\n"
    if len(text) > MAX_JSON_BYTES:
        for scen in out["scenarios"]:
            for row in [*scen["result"]["goodput"].values(), scen["result"]["ideal"]]:
                row.pop("curve", None)
        if "per-policy curves dropped to keep the file small" not in out["notes"]:
            out["notes"].append("per-policy curves dropped to keep the file small")
        text = json.dumps(out, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
