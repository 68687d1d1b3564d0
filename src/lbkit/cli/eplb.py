"""``lbkit eplb``: plan expert placement and compare methods against the lower bound."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["add_parser", "run"]

EXAMPLE = {
    "num_layers": 58,
    "num_experts": 256,
    "kind": "lognormal",
    "sigma": 1.0,
}


def add_parser(sub: Any) -> None:
    """Register ``lbkit eplb`` on the subcommand parser ``sub``."""
    p = sub.add_parser(
        "eplb",
        help="plan expert placement (EPLB) and compare methods",
        description=(
            "Plan the placement of redundant MoE experts on GPUs for an expert-load matrix and "
            "report, for every method, moe_lb (max GPU load / mean GPU load) averaged over layers "
            "and for the worst layer, the plan time, and the lower bound no plan can beat. "
            "Without --load, a built-in DeepSeek-V3-shaped example is used (58 MoE layers x 256 "
            "experts, seeded lognormal loads)."
        ),
    )
    p.add_argument(
        "--load",
        type=Path,
        metavar="PATH",
        help="expert-load matrix: SGLang JSON {'logical_count': [[...]]}, .npy/.npz, or CSV "
        "(one layer per row); 3-D dumps [recordings, layers, experts] are summed",
    )
    p.add_argument(
        "--format", choices=("json", "npy", "npz", "csv"), help="override format detection"
    )
    p.add_argument(
        "--num-replicas",
        type=int,
        default=288,
        metavar="R",
        help="physical expert slots in total (default 288)",
    )
    p.add_argument(
        "--num-groups", type=int, default=8, metavar="K", help="expert groups (default 8)"
    )
    p.add_argument("--num-nodes", type=int, default=4, metavar="N", help="nodes (default 4)")
    p.add_argument("--num-gpus", type=int, default=32, metavar="G", help="GPUs (default 32)")
    p.add_argument(
        "--policy",
        choices=("auto", "global", "hierarchical"),
        default="auto",
        help="auto (default): hierarchical when num_groups %% num_nodes == 0, as DeepSeek does",
    )
    p.add_argument(
        "--methods",
        default=None,
        metavar="LIST",
        help="comma-separated methods to compare (default: all)",
    )
    p.add_argument(
        "--keep-zero-layers",
        action="store_true",
        help="keep all-zero (dense) layers; by default they are dropped before planning",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in example (default 0)")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="N",
        help="time each method N times and report the fastest (default 3)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    p.add_argument(
        "--save-plan",
        type=Path,
        metavar="PATH",
        help="write the default method's plan (phy2log, log2phy, logcnt) as JSON",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Execute ``lbkit eplb`` for parsed ``args``."""
    from lbkit import eplb
    from lbkit.eplb.loads import read_expert_load
    from lbkit.eplb.synthetic import synthetic_expert_load

    if args.repeat < 1:
        raise ValueError(f"--repeat: must be >= 1, got {args.repeat}")
    if args.load is not None:
        loaded = read_expert_load(
            args.load, format=args.format, drop_zero_layers=not args.keep_zero_layers
        )
        weight, source = loaded.weight, str(args.load)
        dropped = loaded.num_layers_read - len(loaded.layers)
    else:
        weight = synthetic_expert_load(
            EXAMPLE["num_layers"],
            EXAMPLE["num_experts"],
            kind=EXAMPLE["kind"],
            sigma=EXAMPLE["sigma"],
            rng=args.seed,
        )
        source = (
            f"built-in example ({EXAMPLE['num_layers']} x {EXAMPLE['num_experts']}, "
            f"lognormal sigma {EXAMPLE['sigma']}, seed {args.seed})"
        )
        dropped = 0
    methods = list(eplb.METHODS) if args.methods is None else _split(args.methods)
    for m in methods:
        if m not in eplb.METHODS:
            raise ValueError(
                f"--methods: unknown method {m!r}; choose from {', '.join(eplb.METHODS)}"
            )
    policy = None if args.policy == "auto" else args.policy
    sizes = (args.num_replicas, args.num_groups, args.num_nodes, args.num_gpus)
    bound = np.asarray(eplb.lower_bound(weight, *sizes, policy=policy), dtype=np.float64)
    # DeepSeek's rule, which rebalance_experts applies to policy=None (validated just above).
    hierarchical = policy == "hierarchical" or (
        policy is None and args.num_groups % args.num_nodes == 0
    )
    resolved = "hierarchical" if hierarchical else "global"

    report: dict[str, Any] = {
        "source": source,
        "num_layers": int(weight.shape[0]),
        "num_experts": int(weight.shape[1]),
        "dropped_zero_layers": int(dropped),
        "num_replicas": args.num_replicas,
        "num_groups": args.num_groups,
        "num_nodes": args.num_nodes,
        "num_gpus": args.num_gpus,
        "policy": resolved,
        "lower_bound": _summary(bound),
        "methods": {},
    }
    plans = {}
    for m in methods:
        eplb.rebalance_experts(weight[:1], *sizes, method=m, policy=policy)  # compile, untimed
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            plan = eplb.rebalance_experts(weight, *sizes, method=m, policy=policy)
            best = min(best, time.perf_counter() - start)
        plans[m] = plan
        lb = np.asarray(eplb.moe_lb(weight, plan.phy2log, num_gpus=args.num_gpus))
        entry = _summary(lb)
        entry["gap_to_bound"] = float(lb.mean() / bound.mean() - 1.0)
        entry["plan_time_s"] = best
        report["methods"][m] = entry

    _print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.save_plan is not None:
        chosen = eplb.DEFAULT_METHOD if eplb.DEFAULT_METHOD in plans else methods[0]
        plan = plans[chosen]
        args.save_plan.write_text(
            json.dumps(
                {
                    "method": chosen,
                    "policy": resolved,
                    "num_gpus": args.num_gpus,
                    "phy2log": plan.phy2log.tolist(),
                    "log2phy": plan.log2phy.tolist(),
                    "logcnt": plan.logcnt.tolist(),
                }
            )
            + "\n"
        )
    return 0


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _summary(per_layer: np.ndarray) -> dict[str, Any]:
    return {
        "moe_lb_mean": float(per_layer.mean()),
        "moe_lb_worst": float(per_layer.max()),
        "per_layer": [round(float(x), 6) for x in per_layer],
    }


def _print_report(r: dict[str, Any]) -> None:
    out = sys.stdout
    print(f"lbkit eplb: {r['source']}", file=out)
    dropped = (
        f", {r['dropped_zero_layers']} all-zero layers dropped" if r["dropped_zero_layers"] else ""
    )
    print(
        f"  {r['num_layers']} layers x {r['num_experts']} experts{dropped}; {r['num_replicas']} "
        f"slots on {r['num_gpus']} GPUs ({r['num_replicas'] // r['num_gpus']} per GPU), "
        f"{r['num_nodes']} nodes, {r['num_groups']} groups; policy {r['policy']}",
        file=out,
    )
    print("", file=out)
    header = (
        f"  {'method':<12}{'moe_lb mean':>12}{'moe_lb worst':>14}{'vs bound':>10}{'plan time':>12}"
    )
    print(header, file=out)
    print("  " + "-" * (len(header) - 2), file=out)
    best = min(e["moe_lb_mean"] for e in r["methods"].values())
    for name, e in r["methods"].items():
        mark = " *" if e["moe_lb_mean"] == best else ""
        print(
            f"  {name:<12}{e['moe_lb_mean']:>12.4f}{e['moe_lb_worst']:>14.4f}"
            f"{e['gap_to_bound'] * 100:>+9.2f}%{_ms(e['plan_time_s']):>12}{mark}",
            file=out,
        )
    lb = r["lower_bound"]
    print(f"  {'lower bound':<12}{lb['moe_lb_mean']:>12.4f}{lb['moe_lb_worst']:>14.4f}", file=out)
    print("", file=out)
    print(
        "  moe_lb = max GPU load / mean GPU load per layer (1.0 is perfect); * best mean.", file=out
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"
