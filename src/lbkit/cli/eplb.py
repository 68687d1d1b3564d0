"""``lbkit eplb``: plan expert placement and compare methods against the lower bound."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lbkit.cli.checks import (
    MAX_EPLB_GPUS,
    MAX_EPLB_SLOT_LAYERS,
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_REPEAT,
    MAX_REPLICAS,
    MAX_SEED,
    check_count,
    check_input_file,
    check_outputs,
    refuse_ignored,
)

__all__ = ["add_parser", "run"]

EXAMPLE = {
    "num_layers": 58,
    "num_experts": 256,
    "kind": "lognormal",
    "sigma": 1.0,
}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``lbkit eplb`` on the subcommand parser ``sub``; returns its parser."""
    p = sub.add_parser(
        "eplb",
        help="plan expert placement (EPLB) and compare methods",
        description=(
            "Plan the placement of redundant MoE experts on GPUs for an expert-load matrix and "
            "report, for every method, moe_lb (max GPU load / mean GPU load) averaged over layers "
            "and for the worst layer, the plan time, and the lower bound no plan can beat. "
            "Without --load, a built-in DeepSeek-V3-shaped example is used (58 MoE layers x 256 "
            "experts, seeded lognormal loads). Every option and the load file are checked before "
            f"any work; limits: up to {MAX_LAYERS:,} layers of {MAX_EXPERTS:,} experts, "
            f"{MAX_REPLICAS:,} slots on {MAX_EPLB_GPUS:,} GPUs, {MAX_EPLB_SLOT_LAYERS:,} slots "
            "planned in all (layers x slots x --repeat x methods); loads are any finite "
            "non-negative numbers, planned exactly after scaling by a power of two "
            "(docs/cli.md). A bad input ends with one line on stderr and exit status 2."
        ),
    )
    p.add_argument(
        "--load",
        type=Path,
        metavar="PATH",
        help="expert-load matrix: SGLang JSON {'logical_count': [[...]]}, .npy/.npz, or CSV "
        "(one layer per row); 3-D dumps [recordings, layers, experts] are summed (the sums "
        "must stay below the largest float64, 1.8e308)",
    )
    p.add_argument(
        "--format",
        choices=("json", "npy", "npz", "csv"),
        help="with --load: override format detection by suffix",
    )
    p.add_argument(
        "--num-replicas",
        type=int,
        default=288,
        metavar="R",
        help=f"physical expert slots per layer, at least the experts and at most "
        f"{MAX_REPLICAS:,} (default 288)",
    )
    p.add_argument(
        "--num-groups",
        type=int,
        default=8,
        metavar="K",
        help="expert groups, dividing the experts (default 8; hierarchical policy only)",
    )
    p.add_argument(
        "--num-nodes",
        type=int,
        default=4,
        metavar="N",
        help="nodes, dividing the GPUs (default 4; hierarchical policy only)",
    )
    p.add_argument(
        "--num-gpus",
        type=int,
        default=32,
        metavar="G",
        help=f"GPUs, dividing the slots, at most {MAX_EPLB_GPUS:,} (default 32)",
    )
    p.add_argument(
        "--policy",
        choices=("auto", "global", "hierarchical"),
        default="auto",
        help="auto (default): hierarchical when --num-nodes divides --num-groups, as DeepSeek "
        "does; global ignores groups and nodes (giving them is refused)",
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
        help="with --load: keep all-zero (dense) layers; by default they are dropped before "
        "planning",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the built-in example, 0 to 2**32 - 1 (default 0; not with --load)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="N",
        help=f"time each method N times and report the fastest, 1 to {MAX_REPEAT} (default 3)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    p.add_argument(
        "--save-plan",
        type=Path,
        metavar="PATH",
        help="write the default method's plan (phy2log, log2phy, logcnt) as JSON",
    )
    p.set_defaults(run=run)
    return p


def _check_options(args: argparse.Namespace) -> tuple[list[str], bool]:
    """Check every option before any work; returns the methods and whether hierarchical."""
    from lbkit import eplb

    given = getattr(args, "given", frozenset())
    check_count(args, "num_replicas", 1, MAX_REPLICAS, "the most slots lbkit eplb plans")
    check_count(args, "num_gpus", 1, MAX_EPLB_GPUS, "the most GPUs lbkit eplb plans for")
    check_count(args, "num_groups", 1, MAX_EXPERTS, "the most experts lbkit eplb plans")
    check_count(args, "num_nodes", 1, MAX_EPLB_GPUS, "the most GPUs lbkit eplb plans for")
    check_count(args, "repeat", 1, MAX_REPEAT)
    check_count(args, "seed", 0, MAX_SEED)
    if args.num_replicas % args.num_gpus:
        raise ValueError(
            f"--num-gpus: must divide --num-replicas ({args.num_replicas:,}) so that every GPU "
            f"has as many slots, got {args.num_gpus:,}"
        )
    if args.num_gpus % args.num_nodes:
        raise ValueError(
            f"--num-nodes: must divide --num-gpus ({args.num_gpus:,}), got {args.num_nodes:,}"
        )
    if args.policy == "hierarchical" and args.num_groups % args.num_nodes:
        raise ValueError(
            f"--policy hierarchical: needs --num-nodes ({args.num_nodes:,}) to divide "
            f"--num-groups ({args.num_groups:,})"
        )
    hierarchical = args.policy == "hierarchical" or (
        args.policy == "auto" and args.num_groups % args.num_nodes == 0
    )
    if args.policy == "global":
        for dest in ("num_groups", "num_nodes"):
            refuse_ignored(
                given, dest, "ignored by --policy global (groups and nodes constrain only the "
                "hierarchical policy)",
            )  # fmt: skip
    methods = list(eplb.METHODS) if args.methods is None else _split(args.methods)
    if not methods:
        raise ValueError(f"--methods: names no method; choose from {', '.join(eplb.METHODS)}")
    for m in methods:
        if m not in eplb.METHODS:
            raise ValueError(
                f"--methods: unknown method {m!r}; choose from {', '.join(eplb.METHODS)}"
            )
    if args.load is None:
        refuse_ignored(given, "format", "ignored without --load (the built-in example)")
        refuse_ignored(
            given, "keep_zero_layers", "ignored without --load (the built-in example has none)"
        )
    else:
        refuse_ignored(given, "seed", "ignored with --load (it seeds the built-in example)")
    check_outputs({"--json": args.json, "--save-plan": args.save_plan}, {"--load": args.load})
    if args.load is not None:
        check_input_file(args.load, "--load")
    return methods, hierarchical


def _check_load(weight: np.ndarray, name: str, args: argparse.Namespace, hierarchical: bool):
    layers, experts = weight.shape
    if layers > MAX_LAYERS:
        raise ValueError(f"{name}: {layers:,} layers, more than lbkit eplb plans ({MAX_LAYERS:,})")
    if experts > MAX_EXPERTS:
        raise ValueError(
            f"{name}: {experts:,} experts per layer, more than lbkit eplb plans ({MAX_EXPERTS:,})"
        )
    if args.num_replicas < experts:
        raise ValueError(
            f"--num-replicas: must be at least the {experts:,} experts of {name} so that every "
            f"expert has a slot, got {args.num_replicas:,}"
        )
    if hierarchical and experts % args.num_groups:
        raise ValueError(
            f"--num-groups: must divide the {experts:,} experts of {name}, got {args.num_groups:,}"
        )


def _check_work(layers: int, name: str, args: argparse.Namespace, methods: list[str]) -> None:
    work = layers * args.num_replicas * args.repeat * len(methods)
    if work > MAX_EPLB_SLOT_LAYERS:
        raise ValueError(
            f"--num-replicas x --repeat: {name}'s {layers:,} layers x {args.num_replicas:,} "
            f"slots x {args.repeat} repetitions x {len(methods)} methods = {work:,} slots to "
            f"plan, more than lbkit eplb plans in one run ({MAX_EPLB_SLOT_LAYERS:,}); lower "
            f"--repeat, name fewer --methods, or plan fewer layers or slots"
        )


def _scaled(weight: np.ndarray) -> np.ndarray:
    """``weight`` times a power of two that brings its largest load into [0.5, 1).

    Exact (a power-of-two scale changes no ratio, sum order or comparison), so plans, ``moe_lb``
    and the bound are those of the loads as given, and no sum of loads can overflow.
    """
    top = float(weight.max()) if weight.size else 0.0
    if top == 0.0:
        return weight
    return np.ldexp(weight, -math.frexp(top)[1])


def run(args: argparse.Namespace) -> int:
    """Execute ``lbkit eplb`` for parsed ``args`` (every option checked before any work)."""
    methods, hierarchical = _check_options(args)
    from lbkit import eplb
    from lbkit.eplb.loads import read_expert_load
    from lbkit.eplb.synthetic import synthetic_expert_load

    if args.load is not None:
        loaded = read_expert_load(
            args.load, format=args.format, drop_zero_layers=not args.keep_zero_layers
        )
        weight, source = loaded.weight, str(args.load)
        dropped = loaded.num_layers_read - len(loaded.layers)
        _check_load(weight, args.load.name, args, hierarchical)
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
    _check_work(weight.shape[0], args.load.name if args.load else "the built-in example", args,
                methods)  # fmt: skip
    weight = _scaled(weight)
    resolved = "hierarchical" if hierarchical else "global"
    # Groups and nodes matter only to the hierarchical policy; the global one plans without.
    groups, nodes = (args.num_groups, args.num_nodes) if hierarchical else (1, 1)
    sizes = (args.num_replicas, groups, nodes, args.num_gpus)
    bound = np.asarray(eplb.lower_bound(weight, *sizes, policy=resolved), dtype=np.float64)

    report: dict[str, Any] = {
        "source": source,
        "num_layers": int(weight.shape[0]),
        "num_experts": int(weight.shape[1]),
        "dropped_zero_layers": int(dropped),
        "num_replicas": args.num_replicas,
        "num_groups": args.num_groups if hierarchical else None,
        "num_nodes": args.num_nodes if hierarchical else None,
        "num_gpus": args.num_gpus,
        "policy": resolved,
        "lower_bound": _summary(bound),
        "methods": {},
    }
    plans = {}
    for m in methods:
        eplb.rebalance_experts(weight[:1], *sizes, method=m, policy=resolved)  # compile, untimed
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            plan = eplb.rebalance_experts(weight, *sizes, method=m, policy=resolved)
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
    topology = (
        f"{r['num_nodes']} nodes, {r['num_groups']} groups; policy hierarchical"
        if r["policy"] == "hierarchical"
        else "policy global (no group or node constraint)"
    )
    print(
        f"  {r['num_layers']} layers x {r['num_experts']} experts{dropped}; {r['num_replicas']} "
        f"slots on {r['num_gpus']} GPUs ({r['num_replicas'] // r['num_gpus']} per GPU), "
        f"{topology}",
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
