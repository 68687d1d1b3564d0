"""Regenerate ``docs/performance.md`` from a benchmark run.

Usage::

    python benchmarks/make_performance.py                 # run everything, then render
    python benchmarks/make_performance.py --render-only   # render from benchmarks/results/*.json
    LBKIT_DEEPSEEK_EPLB=/path/to/eplb.py python benchmarks/make_performance.py
    LBKIT_SGLANG_DEEPSEEK_VEC=/path/to/deepseek_vec.py ...   # SGLang's plans beside ours

Steps:

1. ``pytest benchmarks --benchmark-enable --benchmark-json=benchmarks/results/bench.json``:
   microbenchmarks of decision and plan latency. Comparative figures are ratios of benchmarks
   timed side by side in this one run (a routing call against a bare ``numpy.argmin`` over the
   same array; a plan against DeepSeek's reference implementation when ``LBKIT_DEEPSEEK_EPLB``
   names a copy of its ``eplb.py`` and torch is installed).
2. The balance scripts of :data:`TABLE_SCRIPTS` (EPLB targets and drift, decode streams, trace
   replay, the router replicas' admission latency), each writing ``{"tables": [...]}`` to
   ``benchmarks/results/``.
3. Render the page: method first, then tables. The page is never edited by hand.
4. Refresh the tables that other pages quote from the same results: a block
   ``<!-- table: FILE | TITLE [| COLUMN: V1, V2; COLUMN: V3] -->`` ... ``<!-- end table -->``
   in ``docs/*.md`` is replaced by the rows of table TITLE of ``benchmarks/results/FILE``
   (optionally only the rows whose COLUMN holds one of the values). A test checks that every
   such block matches the committed results.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
BENCH_JSON = RESULTS / "bench.json"

#: Scripts that measure balance and write tables (``{"tables": [...]}``), in page order:
#: (section title, script, arguments, results file).
TABLE_SCRIPTS = (
    (
        "Where prefill goodput falls short of the ideal",
        "prefill_misses.py",
        (),
        "prefill_misses.json",
    ),
    (
        "Lockstep rule: goodput against its growth weights",
        "lockstep_weights.py",
        (),
        "lockstep_weights.json",
    ),
    ("EPLB balance and plan time", "eplb_targets.py", (), "eplb_targets.json"),
    (
        "EPLB with two slots per GPU against the peers",
        "eplb_two_slot_peers.py",
        (),
        "eplb_two_slot_peers.json",
    ),
    ("EPLB re-planning under drift", "eplb_drift.py", (), "eplb_drift.json"),
    (
        "EPLB re-plan time against DeepSeek's fresh plan",
        "eplb_replan_speed.py",
        (),
        "eplb_replan_speed.json",
    ),
    (
        "EPLB re-plan moves against the fixed-count bound",
        "eplb_move_ratio.py",
        (),
        "eplb_move_ratio.json",
    ),
    ("EPLB cold start", "cold_start.py", ("--inline",), "cold_start.json"),
    (
        "EPLB cold start: the first re-plan",
        "cold_start.py",
        ("--replan-only",),
        "cold_start_replan.json",
    ),
    (
        "Decode balance on synthetic streams",
        "bench_decode.py",
        ("--seeds", "10"),
        "decode_streams.json",
    ),
    ("Decode migration", "decode_migration.py", (), "decode_migration.json"),
    ("Trace replay (simulator)", "sim_targets.py", (), "sim_targets.json"),
    ("Router replicas in the simulator", "replica_sync.py", (), "replica_sync.json"),
    (
        "Router replicas: decode balance through a real store",
        "replica_balance.py",
        ("--replicas", "16"),
        "replica_balance.json",
    ),
    (
        "Router replicas: prefill goodput through a real store",
        "replica_goodput.py",
        ("--replicas", "16"),
        "replica_goodput.json",
    ),
    (
        "Router replicas: admission latency on a real store",
        "replica_latency.py",
        (),
        "replica_latency.json",
    ),
)

#: The goodput section, first after the method: (title, script, arguments, results file).
GOODPUT = (
    "Goodput at SLO",
    "goodput_world.py",
    (),
    "goodput_world.json",
)
#: Cache modes of the goodput tables, in column order.
GOODPUT_CACHES = ("none", "global", "local")
#: Trace names of the goodput tables.
GOODPUT_TRACES = {
    "mooncake": "Mooncake conversation trace",
    "azure": "Azure 2023 conversation trace",
    "default": "built-in workload",
}

#: Results rendered but not re-run here (the run takes hours): (title, script, arguments, file).
KEPT_RESULTS = (
    (
        "EPLB with two slots per GPU: the exact optimum",
        "eplb_targets.py",
        ("--only-exact", "--exact-layers", "58", "--exact-gap", "1e-3", "--exact-time-limit", "10"),
        "eplb_targets_two_slot_exact.json",
    ),
)

__all__ = ["goodput_tables", "main", "render", "splice", "splice_docs"]


def run_benchmarks() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "benchmarks",
        "-q",
        "-p",
        "no:cacheprovider",
        "--benchmark-enable",
        f"--benchmark-json={BENCH_JSON}",
        "--benchmark-min-rounds=20",
        "-o",
        "addopts=--benchmark-group-by=group --import-mode=importlib",
    ]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    for _, script, extra, out in (GOODPUT, *TABLE_SCRIPTS):
        path = ROOT / "benchmarks" / script
        if path.exists():
            cmd = [sys.executable, str(path), *extra, "--json", str(RESULTS / out)]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _is_baseline(bench: dict[str, Any]) -> bool:
    info = bench.get("extra_info") or {}
    if "baseline" in info:
        return bool(info["baseline"])
    name = bench["name"].lower()
    return "argmin" in name or "reference" in name or "deepseek" in name


def _bench_tables(data: dict[str, Any]) -> list[str]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for bench in data.get("benchmarks", []):
        groups.setdefault(bench.get("group") or bench["name"], []).append(bench)
    lines: list[str] = []
    for group in sorted(groups):
        rows = sorted(groups[group], key=lambda b: b["stats"]["median"])
        base = next((b for b in rows if _is_baseline(b)), None)
        lines += [f"### `{group}`", ""]
        lines.append("| benchmark | median | min | IQR | rounds | vs baseline |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for b in rows:
            s = b["stats"]
            if base is None:
                ratio = ""
            elif b is base:
                ratio = "baseline"
            else:
                r = s["median"] / base["stats"]["median"]
                ratio = f"{r:.2f}x the time" if r >= 1 else f"{1 / r:.1f}x faster"
            lines.append(
                f"| `{b['name']}` | {_fmt_time(s['median'])} | {_fmt_time(s['min'])} | "
                f"{_fmt_time(s['iqr'])} | {s['rounds']} | {ratio} |"
            )
        extras = [b for b in rows if b.get("extra_info")]
        shown = {k for b in extras for k in b["extra_info"] if k != "baseline"}
        if shown:
            keys = sorted(shown)
            lines += ["", "| benchmark | " + " | ".join(keys) + " |"]
            lines.append("|---|" + "---:|" * len(keys))
            for b in extras:
                vals = [b["extra_info"].get(k, "") for k in keys]
                cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in vals]
                lines.append(f"| `{b['name']}` | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.5g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,}"
    return "" if v is None else str(v)


def _rows(cols: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|")
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


#: A quoted table in a docs page: ``<!-- table: FILE | TITLE [| FILTERS] -->`` ... end marker.
SPLICE = re.compile(
    r"(?P<head><!-- table: (?P<file>[\w.-]+) \| (?P<title>[^|]+?)(?: \| (?P<filter>[^>]+?))? -->\n)"
    r"(?P<body>.*?)(?P<tail><!-- end table -->)",
    re.S,
)


def _quoted(file: str, title: str, filters: str | None, results: Path) -> list[str]:
    data = json.loads((results / file).read_text())
    table = next((t for t in _table_list(data) if t["title"] == title), None)
    if table is None:
        raise KeyError(f"{file}: no table titled {title!r}")
    cols, rows = table["columns"], table["rows"]
    for part in (filters or "").split(";"):
        if part.strip():
            col, _, values = part.partition(":")
            i = cols.index(col.strip())
            keep = {v.strip() for v in values.split(",")}
            rows = [r for r in rows if str(r[i]) in keep]
    return _rows(cols, rows)


def splice(text: str, results: Path = RESULTS) -> str:
    """``text`` with every quoted-table block rebuilt from ``results`` (see the module doc)."""

    def one(m: re.Match[str]) -> str:
        body = _quoted(m["file"], m["title"].strip(), m["filter"], results)
        return m["head"] + "\n".join(body) + "\n" + m["tail"]

    return SPLICE.sub(one, text)


def splice_docs(results: Path = RESULTS) -> list[Path]:
    """Rebuild the quoted tables of ``docs/*.md``; return the pages that changed."""
    changed = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        old = page.read_text()
        new = splice(old, results)
        if new != old:
            page.write_text(new)
            changed.append(page)
    return changed


def goodput_tables(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One table per trace of a ``goodput_world.py`` result: rows = the ideal reference and
    every policy, columns = goodput (requests/s) and its ratio to the ideal per cache mode."""
    tables = []
    for trace, label in GOODPUT_TRACES.items():
        by_cache = {s["cache"]: s for s in data.get("scenarios", []) if s["trace"] == trace}
        modes = [c for c in GOODPUT_CACHES if c in by_cache]
        if not modes:
            continue
        first = by_cache[modes[0]]
        names = list(first["result"]["goodput"])
        peers = data.get("options", {}).get("peers", [])
        cols = ["policy"]
        for c in modes:
            cols += [f"{c}: req/s", f"{c}: vs ideal"]
        rows = []
        for name in ["ideal", *names]:
            row: list[Any] = [name]
            for c in modes:
                res = by_cache[c]["result"]
                r = res["ideal"] if name == "ideal" else res["goodput"].get(name, {})
                rate, ratio = r.get("requests_per_s"), r.get("vs_ideal")
                row += [None if rate is None else round(rate, 3),
                        None if ratio is None else round(ratio, 3)]  # fmt: skip
            rows.append(row)
        best, best_names = ["best peer"], []
        for c in modes:
            g = by_cache[c]["result"]["goodput"]
            top = max((p for p in peers if p in g), key=lambda p: g[p]["requests_per_s"],
                      default=None)  # fmt: skip
            best += [None, None] if top is None else [round(g[top]["requests_per_s"], 3),
                                                      round(g[top]["vs_ideal"], 3)]  # fmt: skip
            best_names.append(f"{c}: {top}")
        rows.append(best)
        same = [s for s in by_cache.values() if s.get("same_as")]
        note = (
            f"{first['requests']:,} requests; wall time per cache mode: "
            + ", ".join(f"{c} {by_cache[c]['wall_s']:,.0f} s" for c in modes)
            + f". Best peer ({', '.join(peers)}) per mode: {'; '.join(best_names)}."
        )
        if same:
            note += (
                " The trace has no block hashes: cache modes "
                + ", ".join(same[0]["same_as"])
                + " are the same run as none."
            )
        tables.append({"title": f"Goodput at SLO: {label}", "note": note, "columns": cols,
                       "rows": rows})  # fmt: skip
    return tables


def _table_list(data: dict[str, Any]) -> list[dict[str, Any]]:
    return data["tables"] if "tables" in data else goodput_tables(data)


def _goodput_section(data: dict[str, Any]) -> list[str]:
    o = data["options"]
    slo = o["slo"]
    capped = o.get("workload_max_requests")
    lines = [
        f"## {GOODPUT[0]}",
        "",
        f"Measured by `{data['command']}` on {data['machine']['cpu_count']} cores shared with "
        f"other work (load average {data['machine']['load_avg_start'][0]:g} at the start, "
        f"{data['machine']['load_avg_end'][0]:g} at the end), {data['wall_s'] / 60:.0f} minutes "
        f"in all; started {data['started']}"
        + (f" at commit {data['commit']}." if data.get("commit") else "."),
        "",
        *[f"- {c}" for c in data.get("caveats", [])],
        *([""] if data.get("caveats") else []),
        "Goodput = the highest arrival rate (requests/s; the trace time-scaled) at which "
        f"{slo['attainment']:.0%} of requests meet the SLO: TTFT <= max({slo['ttft_s']:g} s, "
        f"{slo['ttft_slowdown']:g} x the prefill time alone on an idle rank with the cached "
        f"prefix it could have had) and TPOT <= {slo['tpot_s'] * 1e3:g} ms "
        "(`lbkit.sim.goodput_bench.run_goodput`). Pools: prefill "
        f"{o['prefill']} ranks, decode {o['decode']} ranks (routed by lbkit); cost preset "
        f"`{o['cost']}`; seed {o['seed']}. Ideal = late binding: one central queue served in "
        "SLO-deadline order: an idle engine starts a step at once and takes its share of the "
        "queue per step, and a started request may pause for a more urgent one "
        "(`lbkit.sim.ideal`), with the global cache's hits in both cached modes. "
        "Attainment is not monotone in the rate on a finite trace, so the bisection can stop "
        "at a different crossing for each policy: ratios near 1 are within that noise, and a "
        "policy can show slightly more than 1. Cache modes: none; global (one LRU cache shared by "
        "the pool); local (each prefill rank its own LRU cache of "
        f"{o['local_capacity_blocks']:,} blocks of 512 tokens, `capacity_blocks_for()`). "
        "A goodput of 0 means no rate searched met the SLO.",
        "",
    ]
    if capped:
        lines += [
            f"The built-in workload is cut to its first {capped:,} requests "
            "(`--workload-max-requests`) to keep the whole run within about an hour on this "
            "machine.",
            "",
        ]
    return lines + _tables({"tables": goodput_tables(data)})


def _tables(data: dict[str, Any]) -> list[str]:
    """Render ``{"tables": [{"title", "note", "columns", "rows"}]}`` as Markdown tables."""
    lines: list[str] = []
    for table in data.get("tables", []):
        lines += [f"### {table['title']}", ""]
        if table.get("note"):
            lines += [table["note"], ""]
        lines += [*_rows(table["columns"], table["rows"]), ""]
    return lines


def render() -> str:
    bench = json.loads(BENCH_JSON.read_text()) if BENCH_JSON.exists() else {}
    machine = bench.get("machine_info", {})
    when = bench.get("datetime", _dt.datetime.now(_dt.UTC).isoformat())
    lines = [
        "# Performance",
        "",
        "<!-- Generated by benchmarks/make_performance.py; do not edit by hand. -->",
        "",
        "## Method",
        "",
        "- **Decision and plan latency** are pytest-benchmark microbenchmarks "
        "(`benchmarks/bench_*.py`), run by `python benchmarks/make_performance.py`. Each "
        "comparison is a ratio of two benchmarks timed side by side in the same run on the "
        "same inputs (a routing call against a bare `numpy.argmin` over the same per-rank "
        "array; an EPLB plan against DeepSeek's reference `rebalance_experts` when "
        "`LBKIT_DEEPSEEK_EPLB` names a copy of its `eplb.py`). numba kernels are compiled "
        "before timing. Medians are reported; the machine is shared, so read ratios, not "
        "absolute times.",
        "- **Balance** figures come from the scripts named in each section: seeded synthetic "
        "loads and the public traces (Mooncake conversation, Azure 2023 conversation, "
        "DeepSeek-V3 expert-load dumps), with fixed seeds.",
        "- `moe_lb` = max GPU load / mean GPU load of a layer; balance efficiency = "
        "`sum_t mean_r L[r,t] / sum_t max_r L[r,t]` (see `docs/metrics.md`).",
        "",
        f"Run: {when}; Python {machine.get('python_version', platform.python_version())}, "
        f"{machine.get('cpu', {}).get('brand_raw', platform.processor() or 'unknown CPU')}, "
        f"{os.cpu_count()} cores.",
        "",
    ]
    goodput = RESULTS / GOODPUT[3]
    if goodput.exists():
        lines += _goodput_section(json.loads(goodput.read_text()))
    for title, script, extra, out in TABLE_SCRIPTS:
        path = RESULTS / out
        if path.exists():
            command = " ".join(["python", f"benchmarks/{script}", *extra])
            lines += [f"## {title}", "", f"Measured by `{command}`.", ""]
            lines += _tables(json.loads(path.read_text()))
    for title, script, extra, out in KEPT_RESULTS:
        path = RESULTS / out
        if path.exists():
            command = " ".join(["python", f"benchmarks/{script}", *extra])
            lines += [
                f"## {title}",
                "",
                f"Measured by `{command}` (with `--exact-loads` and `--exact-layers` per load as "
                "the table says; hours of exact solves, so this page keeps the committed "
                f"`benchmarks/results/{out}` instead of re-running it).",
                "",
            ]
            lines += _tables(json.loads(path.read_text()))
    if bench:
        lines += ["## Latency", "", *_bench_tables(bench)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render-only", action="store_true", help="skip running benchmarks")
    args = parser.parse_args(argv)
    if not args.render_only:
        run_benchmarks()
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
    for page in splice_docs():
        print(f"refreshed quoted tables in {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
