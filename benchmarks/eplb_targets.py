"""Measure lbkit.eplb against its targets and print tables (``--json PATH`` for machine output).

1. Global policy, DeepSeek-V3 sizes (58 layers x 256 experts): mean moe_lb gap to the lower
   bound per load family (lognormal sigma 0.5/1.0/1.5, Zipf 0.6/1.0, SGLang DeepSeek-V3 traces),
   greedy and default, at 288/320 slots on 32 GPUs, 320/384 on 64, and 288 on 144 (2 slots).
2. Small instances solved exactly (2 slots: all count vectors with the optimal pairing; 5 slots:
   CP-SAT, 10 s per instance): gap of greedy and default to the optimum, over 12 seeded
   instances per shape (lognormal sigma 0.5/1.0/1.5 and Zipf 1.0 loads, 3 seeds each).
3. Hierarchical policy: node-level imbalance (largest node load / mean) of greedy and default
   beside the best the group constraint allows (optimal group partition), and moe_lb vs bound.
4. Plan time (median after warm-up) at 58 x 256, global and hierarchical, with DeepSeek's code
   timed interleaved when ``LBKIT_DEEPSEEK_EPLB`` is set and torch is importable.
5. With ``--exact-layers N``: two slots per GPU at full size (288 slots, 144 GPUs), the first
   ``N`` layers of every load solved exactly (:func:`lbkit.eplb._reference.optimal_two_slot`,
   HiGHS; minutes per layer for lognormal sigma 0.5, seconds otherwise), beside greedy, the
   default and the lower bound. ``--only-exact`` skips sections 1-4.

``--json PATH`` writes ``{"tables": [{"title", "note", "columns", "rows"}], ...}`` (rendered
by ``benchmarks/make_performance.py``) plus the raw rows of each section.

Run: ``python benchmarks/eplb_targets.py [--quick] [--json out.json]``; the exact two-slot
figures: ``python benchmarks/eplb_targets.py --only-exact --exact-layers 58 --exact-gap 1e-3
--exact-time-limit 10 --json benchmarks/results/eplb_targets_two_slot_exact.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np

import lbkit
from lbkit.eplb import lower_bound, moe_lb, rebalance_experts
from run_record import deepseek_eplb

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
TRACE_DIR = TRACES / "moe_expert_load_deepseek_v3"


def families(rng, quick):
    out = {}
    for s in (0.5, 1.0, 1.5):
        out[f"lognormal-{s}"] = rng.lognormal(0, s, (58, 256)) * 1000
    for a in (0.6, 1.0):
        p = np.arange(1, 257) ** -a
        p /= p.sum()
        out[f"zipf-{a}"] = np.stack(
            [rng.multinomial(1_600_000, rng.permutation(p)) for _ in range(58)]
        ).astype(float)
    files = sorted(TRACE_DIR.glob("*.json")) if TRACE_DIR.is_dir() else []
    for f in files[:2] if quick else files:
        out[f"trace-{f.stem}"] = np.array(json.loads(f.read_text())["logical_count"])[3:]
    return out


def plan_gap(w, r, k, n, g, policy, method):
    plan = rebalance_experts(w, r, k, n, g, method=method, policy=policy)
    return moe_lb(w, plan.phy2log, num_gpus=g), plan


def section_global(rng, quick, report):
    print("\n== global policy, 58 x 256: mean moe_lb gap to the lower bound (worst layer) ==")
    shapes = [(288, 32), (320, 32), (320, 64), (384, 64), (288, 144)]
    fam = families(rng, quick)
    rows = []
    for (r, g), (name, w) in itertools.product(shapes, fam.items()):
        lb = lower_bound(w, r, 8, 1, g, policy="global")
        row = {"slots": r, "gpus": g, "loads": name, "lower_bound_mean": float(lb.mean())}
        for method in ("greedy", "default"):
            v, _ = plan_gap(w, r, 8, 1, g, "global", method)
            row[f"{method}_gap_pct"] = 100 * (v.mean() / lb.mean() - 1)
            row[f"{method}_worst_pct"] = 100 * float((v / lb - 1).max())
        rows.append(row)
        print(
            f"{r:4d} slots {g:4d} GPUs {name:32s} bound {lb.mean():.4f}  greedy "
            f"+{row['greedy_gap_pct']:.3f}% (+{row['greedy_worst_pct']:.2f}%)  default "
            f"+{row['default_gap_pct']:.3f}% (+{row['default_worst_pct']:.2f}%)",
            flush=True,
        )
    report["global"] = rows


SMALL_TWO_SLOT = [(12, 8), (16, 10), (20, 12), (24, 14)]
SMALL_FIVE_SLOT = [(12, 3), (16, 4), (20, 4), (24, 6)]
SMALL_FAMILIES = ("lognormal-0.5", "lognormal-1.0", "lognormal-1.5", "zipf-1.0")


def small_load(family, experts, seed):
    """One seeded small instance: lognormal(0, sigma) * 100 or a permuted Zipf(1.0) profile."""
    rng = np.random.default_rng([experts, seed, SMALL_FAMILIES.index(family)])
    if family.startswith("lognormal"):
        return rng.lognormal(0, float(family.split("-")[1]), (1, experts)) * 100
    return rng.permutation(np.arange(1, experts + 1) ** -1.0)[None, :] * 1000


def section_small(rng, quick, report):
    from lbkit.eplb._reference import optimal_max_load

    print("\n== small instances solved exactly: gap to the optimum ==")
    seeds = 1 if quick else 3
    rows = []
    for (e, g), s in [(c, 2) for c in SMALL_TWO_SLOT] + [(c, 5) for c in SMALL_FIVE_SLOT]:
        gaps = {"greedy": [], "default": []}
        unproven = []
        for family, seed in itertools.product(SMALL_FAMILIES, range(seeds)):
            w = small_load(family, e, seed)
            plans = {m: plan_gap(w, g * s, 1, 1, g, "global", m)[1] for m in gaps}
            top = {m: float(max_gpu_load(w, p, g)[0]) for m, p in plans.items()}
            opt, proven = optimal_max_load(
                w[0], num_gpus=g, slots=s, upper_bound=top["default"], time_limit_s=10
            )
            if not proven:  # CP-SAT's incumbent is no optimum: count it apart
                unproven.append(100 * (top["default"] / opt - 1))
                continue
            for m in gaps:
                gaps[m].append(100 * (top[m] / opt - 1))
        row = {"experts": e, "gpus": g, "slots": s, "proven": len(gaps["default"])}
        row["unproven"] = len(unproven)
        row["default_vs_incumbent_pct"] = float(np.mean(unproven)) if unproven else None
        for m, x in gaps.items():
            row[f"{m}_mean_pct"] = float(np.mean(x)) if x else None
            row[f"{m}_max_pct"] = float(np.max(x)) if x else None
        rows.append(row)
        print(
            f"E={e:2d} G={g:2d} S={s}  proven {row['proven']}/{row['proven'] + len(unproven)}"
            f"  greedy {_pct(row['greedy_mean_pct'])} (max {_pct(row['greedy_max_pct'])})"
            f"  default {_pct(row['default_mean_pct'])} (max {_pct(row['default_max_pct'])})"
            f"  default vs CP-SAT incumbent where unproven {_pct(row['default_vs_incumbent_pct'])}",
            flush=True,
        )
    report["small_exact"] = rows


def section_two_slot_exact(rng, layers, rel_gap, time_limit_s, report, names=None, save=None):
    """Two slots per GPU at full size (288 slots, 144 GPUs): gap to the exact optimum."""
    from lbkit.eplb._reference import optimal_two_slot

    print(
        f"\n== 288 slots on 144 GPUs: exact optimum (first {layers} layers per load, proven to "
        f"{rel_gap:g}) ==",
        flush=True,
    )
    rows = []
    for name, w in families(rng, False).items():
        if names and name not in names:
            continue
        w = w[:layers]
        mean = w.sum(axis=1) / 144
        lb = lower_bound(w, 288, 8, 1, 144, policy="global")
        plans = {
            m: rebalance_experts(w, 288, 8, 1, 144, method=m, policy="global")
            for m in ("greedy", "default")
        }
        top = {m: max_gpu_load(w, p, 144) / mean for m, p in plans.items()}
        opt, low, proven, secs = [], [], [], []
        for layer in range(w.shape[0]):
            t = time.perf_counter()
            best, lo, _, ok = optimal_two_slot(
                w[layer],
                num_gpus=144,
                upper_counts=plans["default"].logcnt[layer],
                lower_bound=lb[layer] * mean[layer],
                rel_gap=rel_gap,
                time_limit_s=time_limit_s,
            )
            secs.append(time.perf_counter() - t)
            opt.append(best / mean[layer])
            low.append(lo / mean[layer])
            proven.append(ok)
        opt, low = np.array(opt), np.array(low)
        row = {
            "loads": name,
            "layers": int(w.shape[0]),
            "proven": int(sum(proven)),
            "optimum_mean": float(opt.mean()),
            "optimum_low_mean": float(low.mean()),
            "lower_bound_mean": float(lb.mean()),
            "solve_s_mean": float(np.mean(secs)),
            "rel_gap": rel_gap,
            "time_limit_s": time_limit_s,
        }
        for m in ("greedy", "default"):
            row[f"{m}_mean"] = float(top[m].mean())
            row[f"{m}_gap_pct"] = 100 * (top[m].mean() / opt.mean() - 1)
            row[f"{m}_worst_pct"] = 100 * float((top[m] / opt - 1).max())
        row["bound_gap_pct"] = 100 * (1 - lb.mean() / opt.mean())
        ok = np.array(proven)
        if ok.any() and not ok.all():  # the same figures over the proven layers only
            for m in ("greedy", "default"):
                row[f"{m}_gap_pct_proven"] = 100 * (top[m][ok].mean() / opt[ok].mean() - 1)
        # per layer: best plan found, proven lower limit, and the plans' largest loads / mean
        row["per_layer"] = {
            "optimum": opt.tolist(),
            "low": low.tolist(),
            "proven": ok.tolist(),
            "default": top["default"].tolist(),
            "greedy": top["greedy"].tolist(),
            "lower_bound": lb.tolist(),
        }
        rows.append(row)
        report["two_slot_exact"] = rows
        if save is not None:  # after each load: the section takes hours in all
            save()
        print(
            f"{name:32s} optimum {row['optimum_mean']:.4f} (proven {row['proven']}/"
            f"{row['layers']}, {row['solve_s_mean']:.0f} s/layer)  default "
            f"+{row['default_gap_pct']:.3f}% (worst +{row['default_worst_pct']:.2f}%)  greedy "
            f"+{row['greedy_gap_pct']:.3f}%  bound -{row['bound_gap_pct']:.2f}%",
            flush=True,
        )
    report["two_slot_exact"] = rows


def _pct(x):
    return "n/a" if x is None else f"{x:+.3f}%"


def max_gpu_load(w, plan, g):
    per = (w / plan.logcnt)[np.arange(len(w))[:, None], plan.phy2log]
    return per.reshape(len(w), g, -1).sum(axis=2).max(axis=1)


def node_imbalance(w, plan, g, n):
    per = (w / plan.logcnt)[np.arange(len(w))[:, None], plan.phy2log]
    node = per.reshape(len(w), n, -1).sum(axis=2)
    return node.max(axis=1) / node.mean(axis=1)


def best_partition(w, k, n):
    group = w.reshape(len(w), k, -1).sum(axis=2)
    per = k // n
    best = np.full(len(w), np.inf)
    for perm in itertools.permutations(range(k)):
        if any(perm[i] > perm[i + 1] for i in range(0, k, per) for _ in [0] if per > 1) or any(
            perm[i] > perm[i + per] for i in range(0, k - per, per)
        ):
            continue
        loads = group[:, list(perm)].reshape(len(w), n, per).sum(axis=2)
        best = np.minimum(best, loads.max(axis=1))
    return best / group.mean(axis=1) / per


def section_hier(rng, quick, report):
    print("\n== hierarchical policy (8 groups): node imbalance and moe_lb ==")
    rows = []
    fam = families(rng, quick)
    for (r, g, n), (name, w) in itertools.product([(320, 32, 4), (320, 64, 8)], fam.items()):
        w = w[w.sum(axis=1) > 0]
        bound_node = (
            best_partition(w, 8, n)
            if n == 4
            else node_imbalance(w, rebalance_experts(w, r, 8, n, g, method="greedy"), g, n)
        )
        lb = lower_bound(w, r, 8, n, g, policy="hierarchical")
        row = {
            "slots": r,
            "gpus": g,
            "nodes": n,
            "loads": name,
            "node_bound_mean": float(bound_node.mean()),
            "lower_bound_mean": float(lb.mean()),
        }
        for m in ("greedy", "default"):
            v, plan = plan_gap(w, r, 8, n, g, "hierarchical", m)
            ni = node_imbalance(w, plan, g, n)
            row[f"{m}_node_mean"], row[f"{m}_node_worst"] = float(ni.mean()), float(ni.max())
            row[f"{m}_moe_lb_mean"] = float(v.mean())
        rows.append(row)
        print(
            f"{g} GPUs/{n} nodes {name:32s} node: greedy {row['greedy_node_mean']:.3f} (worst "
            f"{row['greedy_node_worst']:.3f}) default {row['default_node_mean']:.3f} (worst "
            f"{row['default_node_worst']:.3f}) best {row['node_bound_mean']:.3f} | moe_lb greedy "
            f"{row['greedy_moe_lb_mean']:.4f} default {row['default_moe_lb_mean']:.4f} bound "
            f"{row['lower_bound_mean']:.4f}",
            flush=True,
        )
    report["hierarchical"] = rows


def section_time(rng, report):
    print("\n== plan time, 58 x 256, median of 5 (shared machine: noisy) ==")
    w = rng.lognormal(0, 1.0, (58, 256)) * 1000
    ds, torch = deepseek_eplb()
    if torch is not None:
        torch.set_num_threads(1)
    rows = []
    for r, g, n, policy in [
        (320, 64, 8, "global"),
        (320, 64, 8, "hierarchical"),
        (288, 32, 4, "hierarchical"),
        (384, 64, 8, "global"),
        (288, 32, 4, "global"),
        (288, 144, 1, "global"),
    ]:
        row = {"slots": r, "gpus": g, "policy": policy}
        for m in ("greedy", "default"):
            rebalance_experts(w, r, 8, n, g, method=m, policy=policy)
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                rebalance_experts(w, r, 8, n, g, method=m, policy=policy)
                ts.append(time.perf_counter() - t)
            row[f"{m}_ms"] = 1e3 * float(np.median(ts))
        ours = ts
        if ds is not None:
            groups, nodes = (8, n) if policy == "hierarchical" else (1, 1)
            ts = []
            for _ in range(3):  # interleaved with ours, so both see the same machine load
                t = time.perf_counter()
                ds.rebalance_experts_hierarchical(torch.tensor(w).float(), r, groups, nodes, g)
                ts.append(time.perf_counter() - t)
                t = time.perf_counter()
                rebalance_experts(w, r, 8, n, g, policy=policy)
                ours.append(time.perf_counter() - t)
            row["deepseek_ms"] = 1e3 * float(np.median(ts))
            row["default_ms"] = 1e3 * float(np.median(ours))
            row["speedup_default"] = row["deepseek_ms"] / row["default_ms"]
        rows.append(row)
        extra = (
            f"  deepseek {row['deepseek_ms']:.0f} ms  default is "
            f"{row['speedup_default']:.0f}x faster"
            if "deepseek_ms" in row
            else ""
        )
        print(
            f"{r} slots {g} GPUs {policy:12s} greedy {row['greedy_ms']:.1f} ms  default "
            f"{row['default_ms']:.1f} ms{extra}",
            flush=True,
        )
    report["plan_time"] = rows


def _r(x, nd=3):
    return None if x is None else round(float(x), nd)


def tables(report):
    """The sections as ``{"title", "note", "columns", "rows"}`` tables (docs generator form)."""
    out = []
    if "plan_time" in report:
        cols = ["slots", "GPUs", "policy", "greedy ms", "default ms"]
        ds = any("deepseek_ms" in r for r in report["plan_time"])
        cols += ["DeepSeek ms", "default speed-up"] if ds else []
        rows = []
        for r in report["plan_time"]:
            row = [r["slots"], r["gpus"], r["policy"], _r(r["greedy_ms"], 1)]
            row.append(_r(r["default_ms"], 1))
            if ds:
                row += [_r(r.get("deepseek_ms"), 0), _r(r.get("speedup_default"), 1)]
            rows.append(row)
        out.append(
            {
                "title": "Plan time, 58 layers x 256 experts (lognormal sigma 1.0)",
                "note": "Median wall time of a whole plan on a shared 2-core machine (noisy); "
                "DeepSeek's reference code timed interleaved with lbkit's default in the same "
                "process, torch on one thread.",
                "columns": cols,
                "rows": rows,
            }
        )
    if "global" in report:
        out.append(
            {
                "title": "Global policy, 58 x 256: gap of moe_lb to the lower bound",
                "note": "Mean over layers of moe_lb / lower_bound - 1 (percent), worst layer "
                "in brackets. 288 slots on 144 GPUs is two slots per GPU.",
                "columns": ["slots", "GPUs", "loads", "bound", "greedy %", "default %"],
                "rows": [
                    [
                        r["slots"],
                        r["gpus"],
                        r["loads"],
                        _r(r["lower_bound_mean"], 4),
                        f"{r['greedy_gap_pct']:.3f} ({r['greedy_worst_pct']:.2f})",
                        f"{r['default_gap_pct']:.3f} ({r['default_worst_pct']:.2f})",
                    ]
                    for r in report["global"]
                ],
            }
        )
    if "small_exact" in report:
        out.append(
            {
                "title": "Small instances: gap to the exact optimum",
                "note": "Seeded lognormal (sigma 0.5, 1.0, 1.5) and Zipf(1.0) loads; optimum "
                "by exhaustive pairing (2 slots) or OR-tools CP-SAT (5 slots, 10 s). Gaps "
                "(percent, mean and max) over the instances CP-SAT proved; where it did not, "
                "the last column compares the default with CP-SAT's best plan (negative: "
                "the default is better).",
                "columns": [
                    "experts",
                    "GPUs",
                    "slots",
                    "proven",
                    "greedy mean %",
                    "greedy max %",
                    "default mean %",
                    "default max %",
                    "default vs CP-SAT incumbent %",
                ],
                "rows": [
                    [
                        r["experts"],
                        r["gpus"],
                        r["slots"],
                        f"{r['proven']}/{r['proven'] + r['unproven']}",
                        _r(r["greedy_mean_pct"]),
                        _r(r["greedy_max_pct"]),
                        _r(r["default_mean_pct"]),
                        _r(r["default_max_pct"]),
                        _r(r["default_vs_incumbent_pct"]),
                    ]
                    for r in report["small_exact"]
                ],
            }
        )
    if "two_slot_exact" in report:
        out.append(
            {
                "title": "Two slots per GPU at full size: gap to the exact optimum",
                "note": "288 slots on 144 GPUs, global policy, the first layers of the loads "
                "above (own seeded draw). Optimum by bisection on an exact MILP feasibility "
                "test (HiGHS), proven to the relative gap given, with a time limit per test; "
                "'proven' counts the layers where the bisection closed (elsewhere 'optimum' is "
                "the best plan found). Gaps: mean moe_lb over the layers / mean optimum - 1 "
                "(percent), worst layer in brackets; 'bound' is how far lower_bound stays "
                "below the optimum.",
                "columns": [
                    "loads",
                    "layers proven",
                    "gap, limit",
                    "optimum",
                    "greedy %",
                    "default %",
                    "bound %",
                ],
                "rows": [
                    [
                        r["loads"],
                        f"{r['proven']}/{r['layers']}",
                        f"{r.get('rel_gap', 0):g}, {r.get('time_limit_s', 0):g} s",
                        _r(r["optimum_mean"], 4),
                        f"{r['greedy_gap_pct']:.3f} ({r['greedy_worst_pct']:.2f})",
                        f"{r['default_gap_pct']:.3f} ({r['default_worst_pct']:.2f})",
                        f"-{r['bound_gap_pct']:.2f}",
                    ]
                    for r in report["two_slot_exact"]
                ],
            }
        )
    if "hierarchical" in report:
        out.append(
            {
                "title": "Hierarchical policy (8 groups): node imbalance and moe_lb",
                "note": "Node imbalance = largest node load / mean node load (mean over "
                "layers); 'best' is the optimal group-to-node partition (4 nodes) or the "
                "forced one (8 nodes, one group each).",
                "columns": [
                    "GPUs",
                    "nodes",
                    "loads",
                    "node greedy",
                    "node default",
                    "node best",
                    "moe_lb greedy",
                    "moe_lb default",
                    "bound",
                ],
                "rows": [
                    [
                        r["gpus"],
                        r["nodes"],
                        r["loads"],
                        _r(r["greedy_node_mean"], 4),
                        _r(r["default_node_mean"], 4),
                        _r(r["node_bound_mean"], 4),
                        _r(r["greedy_moe_lb_mean"], 4),
                        _r(r["default_moe_lb_mean"], 4),
                        _r(r["lower_bound_mean"], 4),
                    ]
                    for r in report["hierarchical"]
                ],
            }
        )
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="fewer traces and repetitions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--exact-layers",
        type=int,
        default=0,
        help="layers per load solved exactly at 288 slots on 144 GPUs (HiGHS; slow)",
    )
    parser.add_argument("--exact-gap", type=float, default=1e-4)
    parser.add_argument("--exact-time-limit", type=float, default=300.0)
    parser.add_argument("--only-exact", action="store_true", help="run only that section")
    parser.add_argument("--exact-loads", default="", help="comma-separated load names (all)")
    args = parser.parse_args(argv)
    lbkit.warmup(packages=("eplb",))
    rng = np.random.default_rng(args.seed)
    report: dict = {"seed": args.seed}

    def save():
        if args.json:
            report["tables"] = tables(report)
            args.json.write_text(json.dumps(report, indent=1))

    if not args.only_exact:
        section_time(rng, report)
        section_global(rng, args.quick, report)
        section_small(rng, args.quick, report)
        section_hier(rng, args.quick, report)
    if args.exact_layers:
        # Own generator: the same loads whether or not the other sections run.
        section_two_slot_exact(
            np.random.default_rng([args.seed, 2]),
            args.exact_layers,
            args.exact_gap,
            args.exact_time_limit,
            report,
            [s for s in args.exact_loads.split(",") if s],
            save,
        )
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
