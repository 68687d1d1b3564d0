"""Cold start: the first EPLB plan, and the first router decision, of a fresh process.

Every figure comes from a fresh ``python`` subprocess whose kernel cache is an empty
directory (``NUMBA_CACHE_DIR``, under which lbkit keeps its own disk cache), as on a machine
that has never run lbkit:

1. ``eplb_first``: per shape (58 x 256 DeepSeek-V3 loads), seconds to ``import lbkit.eplb`` and
   for the first ``rebalance_experts`` (the entry kernel runs as plain Python), with the warm
   figure (median of 5 calls after compiling, in the same process) beside it, and whether the
   first plan equals the compiled one.
2. ``background``: the default mode end to end at 288 slots / 32 GPUs: the first call, then a
   call every 5 s until the background compiler's kernels are loaded; seconds until then.
3. ``cached``: a second fresh process on the cache filled by (2): its first call.
4. ``routers``: ``import lbkit.prefill`` / ``lbkit.decode`` and ``lbkit.warmup`` of the package
   (compiling every router kernel; an upper bound on a router's first decision), with an empty
   cache and again with the cache it filled.
5. ``replan_first``: per shape, the first ``replan_experts`` of a fresh process with an empty
   cache (its entry kernels run as plain Python; the old plan and the loads drifted by
   lognormal 0.1 are made first; until its kernels are compiled a re-plan chooses between the
   old and the matched fresh row of each layer), its moves and balance, with the full re-plan
   after compiling beside it (median of 3).
6. With ``--inline``: the first call compiling in the process, as before the entry kernels
   (minutes).

Run: ``python benchmarks/cold_start.py [--quick] [--inline] [--replan-only] [--json out.json]``;
the recorded figures: ``python benchmarks/cold_start.py --inline --json
benchmarks/results/cold_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

from run_record import ROOT, git_commit, load_avg, log

#: (label, num_replicas, num_groups, num_nodes, num_gpus, policy)
SHAPES = (
    ("288/32 global", 288, 8, 4, 32, "global"),
    ("288/32 hierarchical", 288, 8, 4, 32, "hierarchical"),
    ("320/64 global", 320, 8, 8, 64, "global"),
    ("320/64 hierarchical", 320, 8, 8, 64, "hierarchical"),
    ("288/144 global (2 slots)", 288, 8, 8, 144, "global"),
)

_FIRST_PLAN = """
import json, statistics, time
t0 = time.perf_counter()
import lbkit.eplb as E
t1 = time.perf_counter()
w = E.synthetic_expert_load(58, 256, rng=0)
args = (w, {replicas}, {groups}, {nodes}, {gpus})
t2 = time.perf_counter()
first = E.rebalance_experts(*args, policy="{policy}")
t3 = time.perf_counter()
out = dict(import_s=t1 - t0, first_s=t3 - t2)
if {warm}:
    import lbkit
    report = lbkit.warmup(packages=("eplb",))
    out["compile_s"] = report.total_s
    times = []
    for _ in range(5):
        t = time.perf_counter()
        plan = E.rebalance_experts(*args, policy="{policy}")
        times.append(time.perf_counter() - t)
    out["warm_s"] = statistics.median(times)
    out["identical"] = bool((plan.phy2log == first.phy2log).all())
print(json.dumps(out))
"""

_FIRST_REPLAN = """
import json, statistics, time
import lbkit.eplb as E
w = E.synthetic_expert_load(58, 256, rng=0)
w1 = E.drift(w, sigma=0.1, rng=1)
args = ({replicas}, {groups}, {nodes}, {gpus})
old = E.rebalance_experts(w, *args, policy="{policy}").phy2log
t = time.perf_counter()
first = E.replan_experts(w1, old, *args, policy="{policy}")
out = dict(first_s=time.perf_counter() - t)
fresh = E.moe_lb(w1, E.rebalance_experts(w1, *args, policy="{policy}").phy2log, num_gpus={gpus})
out["first_moves"] = float(first.num_moves.sum() / old.size)
out["first_vs_fresh"] = float(first.moe_lb.mean() / fresh.mean())
if {warm}:
    import lbkit
    report = lbkit.warmup(packages=("eplb",))
    out["compile_s"] = report.total_s
    times = []
    for _ in range(3):
        t = time.perf_counter()
        r = E.replan_experts(w1, old, *args, policy="{policy}")
        times.append(time.perf_counter() - t)
    out["warm_s"] = statistics.median(times)
    out["identical"] = bool((r.plan.phy2log == first.plan.phy2log).all())
    out["warm_moves"] = float(r.num_moves.sum() / old.size)
    out["warm_vs_fresh"] = float(r.moe_lb.mean() / fresh.mean())
print(json.dumps(out))
"""

_BACKGROUND = """
import json, time
t0 = time.perf_counter()
import lbkit.eplb as E
from lbkit.eplb import balanced
w = E.synthetic_expert_load(58, 256, rng=0)
t = time.perf_counter()
first = E.rebalance_experts(w, 288, 8, 4, 32)
out = dict(first_s=time.perf_counter() - t, calls_s=[])
while time.perf_counter() - t0 < {limit}:
    time.sleep(5)
    t = time.perf_counter()
    plan = E.rebalance_experts(w, 288, 8, 4, 32)
    out["calls_s"].append(round(time.perf_counter() - t, 3))
    assert (plan.phy2log == first.phy2log).all()
    if balanced.default_plan.is_compiled(w, 288, 1, 1, 32, 64, 1e-3, plan.phy2log, plan.logcnt):
        out["compiled_after_s"] = time.perf_counter() - t0
        break
times = []
for _ in range(5):
    t = time.perf_counter()
    E.rebalance_experts(w, 288, 8, 4, 32)
    times.append(time.perf_counter() - t)
out["warm_s"] = sorted(times)[2]
print(json.dumps(out))
"""

_CACHED = """
import json, time
t0 = time.perf_counter()
import lbkit.eplb as E
t1 = time.perf_counter()
w = E.synthetic_expert_load(58, 256, rng=0)
t2 = time.perf_counter()
E.rebalance_experts(w, 288, 8, 4, 32)
print(json.dumps(dict(import_s=t1 - t0, first_s=time.perf_counter() - t2)))
"""

_ROUTER = """
import json, time
t0 = time.perf_counter()
import lbkit, lbkit.{package}
t1 = time.perf_counter()
report = lbkit.warmup(packages=("{package}",))
compiled = sum(1 for e in report.kernels if e.how == "compiled" and not e.nested)
loaded = sum(1 for e in report.kernels if e.how == "cache" and not e.nested)
print(json.dumps(dict(import_s=t1 - t0, warmup_s=report.total_s, compiled=compiled,
                      loaded=loaded)))
"""


def _run(code: str, cache: str, mode: str, timeout: float = 3600) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, LBKIT_JIT=mode)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    for name in ("LBKIT_CACHE_DIR", "LBKIT_JIT_CACHE", "NUMBA_DISABLE_JIT"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="first shape only, no warm figure")
    parser.add_argument("--inline", action="store_true", help="also time in-process compiling")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--replan-only", action="store_true", help="only the first re-plans")
    args = parser.parse_args()
    start = time.perf_counter()
    result: dict = {"commit": git_commit(ROOT), "load_avg_before": load_avg()}
    shapes = SHAPES[:1] if args.quick else SHAPES
    result["replan_first"] = replan_rows(shapes[:4], not args.quick, start)
    if args.replan_only:
        result["load_avg_after"] = load_avg()
        result["tables"] = [
            replan_table(result, f"load average {result['load_avg_before'][0]:g} at the start")
        ]
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(result, indent=1) + "\n")
        return
    rows = []
    for label, replicas, groups, nodes, gpus, policy in shapes:
        with tempfile.TemporaryDirectory() as cache:
            code = _FIRST_PLAN.format(
                replicas=replicas,
                groups=groups,
                nodes=nodes,
                gpus=gpus,
                policy=policy,
                warm=not args.quick,
            )
            row = {"shape": label, **_run(code, cache, "python"), "load_avg": load_avg()}
        rows.append(row)
        log(f"eplb first plan {label}: {row}", start)
    result["eplb_first"] = rows
    with tempfile.TemporaryDirectory() as cache:
        result["background"] = _run(_BACKGROUND.format(limit=1800), cache, "background")
        log(f"background: {result['background']}", start)
        _wait_for_compiler(cache)  # it also compiles the re-planning kernels
        result["cached"] = _run(_CACHED, cache, "python")
        log(f"cached: {result['cached']}", start)
    routers = []
    for package in ("prefill", "decode"):
        with tempfile.TemporaryDirectory() as cache:
            cold = _run(_ROUTER.format(package=package), cache, "inline")
            warm = _run(_ROUTER.format(package=package), cache, "inline")
        routers.append({"package": package, "empty_cache": cold, "filled_cache": warm})
        log(f"{package}: {routers[-1]}", start)
    result["routers"] = routers
    if args.inline:
        with tempfile.TemporaryDirectory() as cache:
            result["inline"] = _run(_CACHED, cache, "inline")
        log(f"inline (compiling in the process): {result['inline']}", start)
    result["load_avg_after"] = load_avg()
    result["tables"] = tables(result)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


def replan_rows(shapes, warm: bool, start: float) -> list[dict]:
    """The first re-plan of a fresh process with an empty cache, per shape (module docstring)."""
    rows = []
    for label, replicas, groups, nodes, gpus, policy in shapes:
        with tempfile.TemporaryDirectory() as cache:
            code = _FIRST_REPLAN.format(
                replicas=replicas, groups=groups, nodes=nodes, gpus=gpus, policy=policy, warm=warm
            )
            row = {"shape": label, **_run(code, cache, "python"), "load_avg": load_avg()}
        rows.append(row)
        log(f"eplb first re-plan {label}: {row}", start)
    return rows


def replan_table(result: dict, load: str) -> dict:
    """The table of the first re-plans (``result["replan_first"]``)."""
    return {
        "title": "EPLB cold start: the first re-plan of a fresh process",
        "note": (
            "58 x 256 DeepSeek-V3-shaped loads (lognormal, seed 0), the old plan a fresh "
            "plan of them, re-planned for the loads drifted by lognormal 0.1 (seed 1) "
            "with the defaults (mean scope, 1%); each row a fresh process with an empty "
            "kernel cache (`LBKIT_JIT=python`: until the re-planning kernels are "
            "compiled, each layer chooses between its old row and the fresh plan "
            "matched to it). Moves = share of all replicas; vs fresh = mean moe_lb over "
            "a fresh plan's. Compile = `lbkit.warmup(packages=('eplb',))` afterwards; "
            f"warm = median of 3 full re-plans after it ({load})."
        ),
        "columns": [
            "shape",
            "first re-plan (s)",
            "moves %",
            "vs fresh",
            "compile (s)",
            "warm re-plan (s)",
            "warm moves %",
            "warm vs fresh",
            "load (1 min)",
        ],
        "rows": [
            [
                r["shape"],
                round(r["first_s"], 1),
                _pct(r.get("first_moves")),
                _ratio(r.get("first_vs_fresh")),
                round(r["compile_s"], 1) if "compile_s" in r else None,
                round(r["warm_s"], 2) if "warm_s" in r else None,
                _pct(r.get("warm_moves")),
                _ratio(r.get("warm_vs_fresh")),
                (r.get("load_avg") or [None])[0],
            ]
            for r in result["replan_first"]
        ],
    }


def _pct(v: float | None) -> float | None:
    return None if v is None else round(100.0 * v, 1)


def _ratio(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def tables(result: dict) -> list[dict]:
    """The figures of a run as ``{"title", "note", "columns", "rows"}`` tables."""
    load = (
        f"load average {result['load_avg_before'][0]:g} at the start"
        if result.get("load_avg_before")
        else "load average unknown"
    )
    out = [
        {
            "title": "EPLB cold start: the first plan of a fresh process",
            "note": (
                "58 x 256 DeepSeek-V3-shaped loads (lognormal, seed 0); each row a fresh process "
                "with an empty kernel cache (`LBKIT_JIT=python`: the entry kernels run as Python "
                "until compiled). Compile = `lbkit.warmup(packages=('eplb',))` afterwards in the "
                "same process (every EPLB kernel); warm = median of 5 plans after it; identical = "
                "the first plan equals the compiled one. 2 cores shared with other work "
                f"({load}; load = the 1-minute load average after each row)."
            ),
            "columns": [
                "shape",
                "import (s)",
                "first plan (s)",
                "compile (s)",
                "warm plan (ms)",
                "identical",
                "load (1 min)",
            ],
            "rows": [
                [
                    r["shape"],
                    round(r["import_s"], 2),
                    round(r["first_s"], 2),
                    round(r["compile_s"], 1) if "compile_s" in r else None,
                    round(r["warm_s"] * 1e3, 1) if "warm_s" in r else None,
                    r.get("identical"),
                    (r.get("load_avg") or [None])[0],
                ]
                for r in result["eplb_first"]
            ],
        }
    ]
    if result.get("replan_first"):
        out.append(replan_table(result, load))
    bg, cached = result["background"], result["cached"]
    calls = sorted(bg["calls_s"][:-1]) or [float("nan")]
    life = [
        ["first plan, empty cache (runs as Python)", round(bg["first_s"], 2)],
        ["plans while the background process compiles (median)", round(calls[len(calls) // 2], 2)],
        ["compiled kernels loaded after", round(bg.get("compiled_after_s", float("nan")), 1)],
        ["warm plan", round(bg["warm_s"], 3)],
        ["next process, cache filled: import", round(cached["import_s"], 2)],
        ["next process, cache filled: first plan", round(cached["first_s"], 2)],
    ]
    if "inline" in result:
        life.append(
            [
                "first plan compiling in the process (LBKIT_JIT=inline)",
                round(result["inline"]["first_s"], 1),
            ]
        )
    out.append(
        {
            "title": "EPLB cold start: the default mode end to end",
            "note": (
                "288 slots / 32 GPUs (hierarchical, 4 nodes), 58 x 256; a fresh process with an "
                "empty kernel cache in the default mode (`LBKIT_JIT=background`), a plan every "
                "5 s until the background process's kernels are loaded; then a second fresh "
                "process on the cache it filled. Seconds."
            ),
            "columns": ["step", "seconds"],
            "rows": life,
        }
    )
    out.append(
        {
            "title": "Router cold start: import and warmup",
            "note": (
                "A fresh process: `import lbkit.PACKAGE`, then `lbkit.warmup(packages=(PACKAGE,))`"
                " (every kernel of the package, an upper bound on a router's first decision), "
                "with an empty kernel cache and again on the cache the first run filled."
            ),
            "columns": [
                "package",
                "import (s)",
                "warmup, empty cache (s)",
                "kernels compiled",
                "warmup, cache filled (s)",
                "kernels loaded",
            ],
            "rows": [
                [
                    r["package"],
                    round(r["empty_cache"]["import_s"], 2),
                    round(r["empty_cache"]["warmup_s"], 1),
                    r["empty_cache"]["compiled"],
                    round(r["filled_cache"]["warmup_s"], 2),
                    r["filled_cache"]["loaded"],
                ]
                for r in result["routers"]
            ],
        }
    )
    return out


def _wait_for_compiler(cache: str, limit_s: float = 1800.0) -> None:
    """Wait until no background compiler holds ``compile.lock`` under ``cache``."""
    import fcntl
    from pathlib import Path

    deadline = time.monotonic() + limit_s
    for lock in Path(cache).rglob("compile.lock"):
        with open(lock) as f:
            while time.monotonic() < deadline:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(f, fcntl.LOCK_UN)
                    break
                except BlockingIOError:
                    time.sleep(2)


if __name__ == "__main__":
    main()
