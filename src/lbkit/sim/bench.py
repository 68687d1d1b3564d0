"""The scenario runner behind ``lbkit bench``: every policy on one workload, as SPEC §7 JSON.

:func:`run_bench` time-scales a trace to the target prefill utilisation
(:func:`~lbkit.sim.engine.scale_to_utilization`), replays it through the prefill pool once per
prefill policy, then replays one prefill run's handovers (the ``lbkit`` run, or the first policy's
if ``lbkit`` is not among them) through the decode pool once per decode policy, and (optionally)
plans the built-in EPLB example with each EPLB method. Its ``report`` is JSON-ready and
deterministic: the same trace, seed and options give the same report, except the wall-clock
seconds under the ``"timing"`` key.

The decode-only bench (:func:`run_decode_bench`, in :mod:`lbkit.sim._decode_bench`) and its
calibration (:func:`scale_to_decode_batch`, in :mod:`lbkit.sim._decode_calibration`) are
imported from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from lbkit.core.cost import PRESETS
from lbkit.core.validation import check_choice, check_int, check_real
from lbkit.prefill.buckets import DEFAULT_EDGES
from lbkit.sim._bench_common import policy_names
from lbkit.sim._decode_bench import CAPACITY_BOUND as CAPACITY_BOUND
from lbkit.sim._decode_bench import MIGRATION_BYTES_PER_S as MIGRATION_BYTES_PER_S
from lbkit.sim._decode_bench import MIGRATION_S_PER_KV_TOKEN as MIGRATION_S_PER_KV_TOKEN
from lbkit.sim._decode_bench import OCCUPANCY_RANGE, run_decode_bench
from lbkit.sim._decode_calibration import SATURATED as SATURATED
from lbkit.sim._decode_calibration import TARGET_SATURATED as TARGET_SATURATED
from lbkit.sim._decode_calibration import scale_to_decode_batch, steady_window
from lbkit.sim.engine import (
    SHARING,
    DecodeRun,
    PrefillRun,
    scale_to_utilization,
    simulate_decode,
    simulate_prefill,
    warmup,
)
from lbkit.sim.metrics import decode_metrics, prefill_metrics
from lbkit.sim.policies import (
    DEFAULT_PREFILL_POLICY,
    PREFILL_POLICIES,
    context_parallel_policy,
)
from lbkit.sim.policies_decode import DECODE_POLICIES, DEFAULT_DECODE_POLICY
from lbkit.sim.traces import Trace, detect_format, load_trace

__all__ = [
    "EPLB_EXAMPLE",
    "OCCUPANCY_RANGE",
    "BenchResult",
    "load_bench_trace",
    "run_bench",
    "run_decode_bench",
    "scale_to_decode_batch",
    "steady_window",
]


#: The EPLB example of ``lbkit bench`` (the built-in example of ``lbkit eplb``).
EPLB_EXAMPLE = {
    "num_layers": 58,
    "num_experts": 256,
    "sigma": 1.0,
    "num_replicas": 288,
    "num_groups": 8,
    "num_nodes": 4,
    "num_gpus": 32,
}


class BenchResult(NamedTuple):
    """Result of :func:`run_bench`: the JSON ``report`` and the runs behind it (for plots)."""

    report: dict[str, Any]
    prefill_runs: dict[str, PrefillRun]
    decode_runs: dict[str, DecodeRun]


def load_bench_trace(path: str | Path, /, *, format: str | None = None) -> Trace:
    """Read a trace for the bench: Mooncake's 3-second time stamps are spread evenly.

    Raises
    ------
    FileNotFoundError, ValueError
        As :func:`lbkit.sim.load_trace`.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    fmt = format if format is not None else detect_format(path)
    if fmt == "mooncake":
        return load_trace(path, format=fmt, spread="even")
    return load_trace(path, format=fmt)


def _eplb(seed: int) -> dict[str, Any]:
    from lbkit import eplb
    from lbkit.eplb.synthetic import synthetic_expert_load

    ex = EPLB_EXAMPLE
    w = synthetic_expert_load(
        ex["num_layers"], ex["num_experts"], kind="lognormal", sigma=ex["sigma"], rng=seed
    )
    sizes = (ex["num_replicas"], ex["num_groups"], ex["num_nodes"], ex["num_gpus"])
    out: dict[str, Any] = {"example": dict(ex, seed=seed), "methods": {}}
    for m in ("greedy", eplb.DEFAULT_METHOD):
        plan = eplb.rebalance_experts(w, *sizes, method=m)
        lb = eplb.moe_lb(w, plan.phy2log, num_gpus=ex["num_gpus"])
        out["methods"][m] = {"moe_lb_mean": float(lb.mean()), "moe_lb_worst": float(lb.max())}
    bound = eplb.lower_bound(w, *sizes)
    out["lower_bound"] = {"moe_lb_mean": float(bound.mean()), "moe_lb_worst": float(bound.max())}
    return out


def run_bench(
    trace: Trace,
    /,
    *,
    utilization: float = 0.8,
    seed: int = 0,
    prefill_engines: int = 8,
    ranks_per_engine: int = 8,
    decode_engines: int = 1,
    decode_ranks: int = 64,
    prefill_policies: Sequence[str] | None = None,
    decode_policies: Sequence[str] | None = None,
    cost: str = "h800_dsv3",
    budget_s: float = 1.0,
    work_sharing: str = "off",
    cp_efficiency: float = 1.0,
    eplb: bool = False,
    rank_cache: Callable[[Trace], Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> BenchResult:
    """Replay ``trace`` through every prefill and decode policy and collect SPEC §7 metrics.

    Parameters
    ----------
    trace : Trace
    utilization : float, default 0.8
        Target offered prefill utilisation ``U > 0`` (see :mod:`lbkit.sim.engine`).
    seed : int, default 0
        Seed of randomised policies (each policy run starts from this seed).
    prefill_engines, ranks_per_engine : int
        Prefill pool (default 8 x 8, SPEC section 8).
    decode_engines, decode_ranks : int
        Decode pool: engines and ranks per engine (default 1 x 64).
    prefill_policies, decode_policies : sequence of str, optional
        Default: all of :data:`~lbkit.sim.policies.PREFILL_POLICIES` /
        :data:`~lbkit.sim.policies_decode.DECODE_POLICIES`.
    cost : str, default "h800_dsv3"
        Cost preset (:data:`lbkit.core.PRESETS`).
    budget_s : float, default 1.0
        Prefill step budget ``tau``.
    work_sharing : {"off", "budget", "level", "split"}, default "off"
        Engine-side sharing of un-started requests among an engine's ranks, for every prefill
        policy (see :func:`~lbkit.sim.engine.simulate_prefill`). With ``"split"`` (context
        parallelism) the ``lbkit`` policies score engines, not ranks
        (:func:`~lbkit.sim.policies.context_parallel_policy`).
    cp_efficiency : float in (0, 1], default 1.0
        Parallel efficiency of context-parallel groups under ``"split"``.
    eplb : bool, default False
        Also plan the EPLB example with ``greedy`` and the default method.
    rank_cache : callable(trace) -> hook, optional
        Per-rank prefix caches (``simulate_prefill(rank_cache=...)``): called with the scaled
        trace once per prefill policy, for a fresh cache state each run.
    progress : callable(label, done, total), optional
        Progress callback (never affects the result).

    Returns
    -------
    BenchResult

    Examples
    --------
    >>> from lbkit.sim.workload import default_workload
    >>> res = run_bench(default_workload(num_requests=300), prefill_engines=2, ranks_per_engine=2,
    ...                 decode_ranks=4, prefill_policies=["round_robin", "lbkit"],
    ...                 decode_policies=["least_kv"])
    >>> sorted(res.report["prefill"]), list(res.report["decode"])
    (['lbkit', 'round_robin'], ['least_kv'])
    >>> res.report["prefill"]["lbkit"]["finished"]
    300
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace: must be a Trace, got {type(trace).__name__}")
    u = check_real(utilization, "utilization", min_value=0.0, strict_min=True)
    seed = check_int(seed, "seed", min_value=0)
    pe = check_int(prefill_engines, "prefill_engines", min_value=1)
    rpe = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    de = check_int(decode_engines, "decode_engines", min_value=1)
    dr = check_int(decode_ranks, "decode_ranks", min_value=1)
    pnames = policy_names(prefill_policies, PREFILL_POLICIES, "prefill")
    dnames = policy_names(decode_policies, DECODE_POLICIES, "decode")
    check_choice(cost, "cost", tuple(PRESETS))
    preset = PRESETS[cost]
    budget = check_real(budget_s, "budget_s", min_value=0.0, strict_min=True)
    sharing = check_choice(work_sharing, "work_sharing", SHARING)
    cp_eff = check_real(cp_efficiency, "cp_efficiency", min_value=0.0, strict_min=True,
                        max_value=1.0)  # fmt: skip
    if len(trace) < 2:
        raise ValueError(f"trace: needs at least 2 requests, got {len(trace)}")
    scaled, factor = scale_to_utilization(trace, u, num_ranks=pe * rpe, cost=preset.prefill)
    summary = trace.summary().as_dict()
    report: dict[str, Any] = {
        "workload": {
            "source": trace.source,
            "requests": len(trace),
            "time_scale": factor,
            "duration_s": float(scaled.arrival_s[-1]),
            "summary": summary,
        },
        "options": {
            "utilization": u,
            "seed": seed,
            "prefill_engines": pe,
            "ranks_per_engine": rpe,
            "decode_engines": de,
            "decode_ranks": dr,
            "cost": cost,
            "budget_s": budget,
            "work_sharing": sharing,
            "cp_efficiency": cp_eff,
            "bucket_edges_tokens": list(DEFAULT_EDGES),
        },
        "prefill": {},
        "decode": {},
    }
    timing: dict[str, Any] = {"prefill": {}, "decode": {}}
    pruns: dict[str, PrefillRun] = {}
    druns: dict[str, DecodeRun] = {}
    start = time.perf_counter()
    warmup()  # compile the kernels once, outside the per-policy timings
    timing["warmup_s"] = time.perf_counter() - start
    for name in pnames:
        cb = (
            None
            if progress is None
            else (lambda d, t, name=name: progress(f"prefill {name}", d, t))
        )
        policy: Any = name
        if sharing == "split" and name in ("lbkit", "lbkit_buckets"):
            policy = context_parallel_policy(name, pe, rpe, cost=preset.prefill, rng=seed)
        start = time.perf_counter()
        run = simulate_prefill(
            scaled,
            policy,
            num_engines=pe,
            ranks_per_engine=rpe,
            cost=preset.prefill,
            budget_s=budget,
            work_sharing=sharing,
            cp_efficiency=cp_eff,
            rng=seed,
            on_progress=cb,
            rank_cache=None if rank_cache is None else rank_cache(scaled),
        )
        timing["prefill"][name] = time.perf_counter() - start
        pruns[name] = run
        report["prefill"][name] = prefill_metrics(run, offered_utilization=u)
    feed = DEFAULT_PREFILL_POLICY if DEFAULT_PREFILL_POLICY in pruns else pnames[0]
    report["options"]["decode_fed_by"] = feed
    for name in dnames:
        cb = (
            None if progress is None else (lambda d, t, name=name: progress(f"decode {name}", d, t))
        )
        start = time.perf_counter()
        run = simulate_decode(
            pruns[feed],
            name,
            num_engines=de,
            ranks_per_engine=dr,
            cost=preset.decode,
            rng=seed,
            on_progress=cb,
        )
        timing["decode"][name] = time.perf_counter() - start
        druns[name] = run
        report["decode"][name] = decode_metrics(run, total_tokens=scaled.total_tokens)
    if eplb:
        if progress is not None:
            progress("eplb", 0, 1)
        start = time.perf_counter()
        report["eplb"] = _eplb(seed)
        timing["eplb"] = time.perf_counter() - start
    timing["requests_per_s"] = {
        f"{kind}/{k}": len(trace) / v if v > 0 else None
        for kind in ("prefill", "decode")
        for k, v in timing[kind].items()
    }
    report["timing"] = timing
    report["defaults"] = {"prefill": DEFAULT_PREFILL_POLICY, "decode": DEFAULT_DECODE_POLICY}
    return BenchResult(report, pruns, druns)
