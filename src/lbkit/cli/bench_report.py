"""The report of ``lbkit bench``: its tables on stdout and its ``--plot`` figure."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["plot", "print_report"]


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


def print_report(r: dict[str, Any], wall: float) -> None:
    """Print the tables of a ``lbkit bench`` report ``r`` on stdout."""
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


def plot(res: Any, path: Path) -> None:
    """Save the figure of ``--plot`` (a :class:`~lbkit.sim.bench.BenchResult`) to ``path``."""
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
