"""The scenario runner behind ``lbkit bench``: every policy on one workload, as SPEC §7 JSON.

:func:`run_bench` time-scales a trace to the target prefill utilisation
(:func:`~lbkit.sim.engine.scale_to_utilization`), replays it through the prefill pool once per
prefill policy, then replays one prefill run's handovers (the ``lbkit`` run, or the first policy's
if ``lbkit`` is not among them) through the decode pool once per decode policy, and (optionally)
plans the built-in EPLB example with each EPLB method. Its ``report`` is JSON-ready and
deterministic: the same trace, seed and options give the same report, except the wall-clock
seconds under the ``"timing"`` key.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.cost import PRESETS, DecodeCost
from lbkit.core.validation import check_choice, check_int, check_real
from lbkit.prefill.buckets import DEFAULT_EDGES
from lbkit.sim import _decode_kernels as K
from lbkit.sim.engine import (
    DECODE_KV_CAPACITY_TOKENS,
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
from lbkit.sim.prefix_cache import DSV3_KV_BYTES_PER_TOKEN
from lbkit.sim.replicas import REPLICAS_ROW, DecodeReplicas, ReplicaSync
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


def _names(policies: Sequence[str] | None, table: Any, kind: str) -> list[str]:
    if policies is None:
        return list(table)
    policies = list(policies)
    out = []
    for p in policies:
        if p not in table:
            raise ValueError(
                f"policies: unknown {kind} policy {p!r}; choose from {', '.join(table)}"
            )
        if p not in out:
            out.append(p)
    return out


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
    pnames = _names(prefill_policies, PREFILL_POLICIES, "prefill")
    dnames = _names(decode_policies, DECODE_POLICIES, "decode")
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


# ------------------------------------------------------------------------ decode-only
def scale_to_decode_batch(
    trace: Trace,
    batch_per_rank: float,
    /,
    *,
    num_engines: int = 1,
    ranks_per_engine: int = 64,
    cost: DecodeCost,
    iterations: int = 8,
    max_kv_tokens: int | None = None,
    kv_watermark_tokens: int = 0,
) -> tuple[Trace, float, float]:
    """Time-scale ``trace`` so a decode-only replay holds ``batch_per_rank`` requests per rank.

    Decode pools are sized so that each rank runs a batch of tens of requests; a prefill pool's
    handovers rarely load a decode engine that much. This picks the arrival time-scale of a
    decode-only replay (:func:`~lbkit.sim.engine.simulate_decode` of a trace): a first guess from
    Little's law (``batch * ranks`` requests in flight, each for ``mean(o - 1)`` steps of the
    cost model's step time at that batch), then a bisection of ``iterations`` replays under
    ``least_requests`` on the logarithm of the scale (the batch, measured in the steady window
    of :func:`steady_window`, falls as arrivals stretch); the closest scale seen wins.

    With a KV capacity (``max_kv_tokens``, ``kv_watermark_tokens`` as in
    :func:`~lbkit.sim.engine.simulate_decode`) the running batch saturates: faster arrivals only
    lengthen the wait queue. When halving the scale stops raising the batch by 1% below the
    target, the target becomes 95% of the largest batch measured (the pool near its
    capacity-bound occupancy, without an ever-growing queue) and the bisection aims at that;
    the returned batch (below the target) tells. Every search is bounded (at most
    ``17 + iterations`` replays).

    Returns
    -------
    (Trace, float, float)
        The scaled trace (arrivals shifted to start at 0), the factor applied to the shifted
        arrival times, and the mean batch per rank measured on the last replay.

    Raises
    ------
    ValueError
        ``batch_per_rank <= 0``, bad pool sizes, or a trace without two distinct arrival times
        or without a request needing a decode step.

    Examples
    --------
    >>> from lbkit.sim.workload import default_workload
    >>> t, f, b = scale_to_decode_batch(default_workload(num_requests=400), 4.0,
    ...                                 ranks_per_engine=8, cost=PRESETS["h800_dsv3"].decode)
    >>> 3.0 < b < 5.0
    True
    """
    from lbkit.sim.engine import simulate_decode

    if not isinstance(trace, Trace):
        raise TypeError(f"trace: must be a Trace, got {type(trace).__name__}")
    target = check_real(batch_per_rank, "batch_per_rank", min_value=0.0, strict_min=True)
    e = check_int(num_engines, "num_engines", min_value=1)
    r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    if not isinstance(cost, DecodeCost):
        raise TypeError(f"cost: must be a DecodeCost, got {type(cost).__name__}")
    iterations = check_int(iterations, "iterations", min_value=0)
    arrival = np.asarray(trace.arrival_s, dtype=np.float64)
    span = float(arrival[-1] - arrival[0]) if len(trace) else 0.0
    steps = np.maximum(np.asarray(trace.output_tokens) - 1, 0)
    if not span > 0 or steps.sum() == 0:
        raise ValueError(
            "trace: needs arrivals over a positive time span and a request with more than one "
            "output token"
        )
    m = float(steps.mean())
    kv = float(np.mean(trace.total_tokens)) + m / 2.0
    step_s = float(cost.step_time(target, target * kv))
    rate = target * r * e / (m * step_s)  # arrivals per second for that many in flight
    factor = (len(trace) / rate) / span
    shifted = arrival - arrival[0]
    scaled = dataclasses.replace(trace, arrival_s=shifted * factor)

    seen: dict[float, float] = {}

    def batch(f: float) -> float:
        if f not in seen:
            t = dataclasses.replace(trace, arrival_s=shifted * f)
            run = simulate_decode(
                t, "least_requests", num_engines=e, ranks_per_engine=r, cost=cost,
                window_s=steady_window(t), max_kv_tokens=max_kv_tokens,
                kv_watermark_tokens=kv_watermark_tokens,
            )  # fmt: skip
            w = run.window_sums
            # running requests: engine steps (summed over engines) of r ranks each
            seen[f] = float(w[K.DACC_TOKENS] / max(w[K.DACC_STEPS] * r, 1.0))
        return seen[f]

    # The batch falls as arrivals stretch (larger factor); bisect on log(factor) inside a
    # bracket grown from the first guess, keeping the closest factor seen.
    lo, hi = factor, factor
    prev = -math.inf
    for _ in range(8):
        b = batch(lo)
        if b >= target:
            break
        if b < prev * SATURATED:  # capacity-bound: aim below the saturated batch
            target = TARGET_SATURATED * max(seen.values())
            lo = max(f for f in seen if seen[f] >= target)
            break
        prev = b
        lo /= 2.0
    for _ in range(8):
        if batch(hi) <= target:
            break
        hi *= 2.0
    best = min((abs(math.log(max(b, 1e-12) / target)), f) for f, b in seen.items())
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        b = batch(mid)
        best = min(best, (abs(math.log(max(b, 1e-12) / target)), mid))
        if b > target:
            lo = mid
        else:
            hi = mid
    factor = best[1]
    scaled = dataclasses.replace(trace, arrival_s=shifted * factor)
    return scaled, factor, batch(factor)


#: Effective bandwidth of a migrated request's KV transfer in the decode-only bench: one 400 Gb/s
#: RDMA NIC per GPU (50 GB/s at line rate) at 80%.
MIGRATION_BYTES_PER_S = 40e9
#: Seconds per KV token of that transfer for DeepSeek-V3 (70,272 bytes per token: 61 layers x
#: 576 values x 2 bytes, MLA in BF16): 1.76 us.
MIGRATION_S_PER_KV_TOKEN = DSV3_KV_BYTES_PER_TOKEN / MIGRATION_BYTES_PER_S

#: Running requests per rank where a decode comparison is meaningful (SPEC section 8).
OCCUPANCY_RANGE = (32.0, 128.0)
#: A calibrated batch below this share of the target counts as capacity-bound.
CAPACITY_BOUND = 0.99
#: Batch gain below which halving the arrival scale counts as saturated (capacity-bound).
SATURATED = 1.01
#: Share of the saturated batch that a capacity-bound calibration aims at.
TARGET_SATURATED = 0.95


def steady_window(trace: Trace, /, *, skip: float = 0.25) -> tuple[float, float]:
    """The arrivals' span without its first ``skip`` share: ``(t0 + skip * span, t_last)``.

    Decode statistics over this window leave out the ramp-up (the pool filling) and the drain
    after the last arrival, where batches are small and imbalance is dominated by integrality.

    Examples
    --------
    >>> steady_window(Trace(arrival_s=[0.0, 4.0], total_tokens=[1, 1], output_tokens=[1, 1]))
    (1.0, 4.0)
    """
    a = trace.arrival_s
    t0, t1 = float(a[0]), float(a[-1])
    return t0 + skip * (t1 - t0), t1


def run_decode_bench(
    trace: Trace,
    /,
    *,
    batch_per_rank: float = 32.0,
    seed: int = 0,
    decode_engines: int = 1,
    decode_ranks: int = 64,
    decode_policies: Sequence[str] | None = None,
    cost: str = "h800_dsv3",
    migrate_every_s: float | None = None,
    max_migrations: int = 1,
    migration_latency_s: float = 0.0,
    migration_s_per_kv_token: float = MIGRATION_S_PER_KV_TOKEN,
    max_kv_tokens: int | None = DECODE_KV_CAPACITY_TOKENS,
    kv_watermark_tokens: int | None = None,
    replicas: Any = None,
) -> dict[str, Any]:
    """Decode-only replay of ``trace`` loaded to ``batch_per_rank``, through every decode policy.

    Each request enters decode at its (time-scaled, see :func:`scale_to_decode_batch`) arrival,
    so the decode pool runs at a realistic batch whatever the prefill pool would deliver.
    A decode comparison says something only where ranks run a realistic batch: each policy's
    entry has ``mean_running_per_rank`` (steady window, waiting requests excluded) and
    ``meaningful`` (``OCCUPANCY_RANGE[0] <= mean_running_per_rank <= OCCUPANCY_RANGE[1]``);
    ``report["meaningful"]`` holds when every policy's does.

    Parameters
    ----------
    max_kv_tokens : int or None, default ``DECODE_KV_CAPACITY_TOKENS``
        Per-rank KV capacity (see :data:`~lbkit.sim.engine.DECODE_KV_CAPACITY_TOKENS` for the
        arithmetic); requests beyond it wait (back-pressure). ``None``: unlimited.
    kv_watermark_tokens : int, optional
        KV tokens kept free at admission; default 1% of ``max_kv_tokens``.
    migrate_every_s : float, optional
        Also run a variant of lbkit's balancer (``"lbkit_migrate"``:
        :class:`~lbkit.sim.policies_decode.LbkitDecode` calling ``rebalance(max_migrations)`` at
        most every ``migrate_every_s`` seconds; moves may cross engines). The ``"lbkit"`` row
        migrates too: its balancer's defaults, ``rebalance()`` before every routing decision.
    max_migrations : int, default 1
        Balance moves per rebalance of ``"lbkit_migrate"``.
    migration_latency_s : float, default 0
    migration_s_per_kv_token : float, default ``MIGRATION_S_PER_KV_TOKEN``
        KV transfer time of a move, for every policy that migrates (see
        :func:`~lbkit.sim.engine.simulate_decode`; the default is 40 GB/s for DeepSeek-V3).
    replicas : ReplicaSync, optional
        Also run the row ``"lbkit_replicas"`` (:data:`lbkit.sim.replicas.REPLICAS_ROW`): the
        ``lbkit`` policy as ``replicas.k`` router replicas under its sync mode
        (:class:`~lbkit.sim.replicas.DecodeReplicas`). With a KV capacity and views that are
        not exact (``not replicas.exact``) its replicas admit only (no migration, which is
        modelled there only with exact views); ``options["replicas"]`` says so.

    Returns
    -------
    dict
        ``{"workload": {...}, "decode": {POLICY: decode metrics}, "timing": {...}}``.

    Examples
    --------
    >>> from lbkit.sim.workload import default_workload
    >>> rep = run_decode_bench(default_workload(num_requests=300), batch_per_rank=4.0,
    ...                        decode_ranks=8, decode_policies=["round_robin", "lbkit"])
    >>> list(rep["decode"]), rep["decode"]["lbkit"]["finished"] > 0
    (['round_robin', 'lbkit'], True)
    """
    from lbkit.sim.engine import simulate_decode

    seed = check_int(seed, "seed", min_value=0)
    de = check_int(decode_engines, "decode_engines", min_value=1)
    dr = check_int(decode_ranks, "decode_ranks", min_value=1)
    dnames = _names(decode_policies, DECODE_POLICIES, "decode")
    check_choice(cost, "cost", tuple(PRESETS))
    dcost = PRESETS[cost].decode
    policies: dict[str, Any] = dict.fromkeys(dnames)
    migration = None
    if migrate_every_s is not None:
        from lbkit.sim.policies_decode import LbkitDecode

        # validates migrate_every_s and max_migrations
        LbkitDecode(de, dr, migrate_every_s=migrate_every_s, max_migrations=max_migrations)
        policies["lbkit_migrate"] = lambda: LbkitDecode(
            de, dr, rng=seed, migrate_every_s=migrate_every_s, max_migrations=max_migrations
        )
    if replicas is not None:
        if not isinstance(replicas, ReplicaSync):
            raise TypeError(f"replicas: must be a ReplicaSync, got {type(replicas).__name__}")
        moves = max_kv_tokens is None or replicas.exact
        every = 0.0 if moves else None
        policies[REPLICAS_ROW] = lambda: DecodeReplicas(de, dr, sync=replicas, rng=seed,
                                                        migrate_every_s=every)  # fmt: skip
        sync_info = {**dataclasses.asdict(replicas), "migration": moves}
    transfer = {
        "migration_latency_s": check_real(
            migration_latency_s, "migration_latency_s", min_value=0.0
        ),
        "migration_s_per_kv_token": check_real(
            migration_s_per_kv_token, "migration_s_per_kv_token", min_value=0.0
        ),
    }
    if migrate_every_s is not None:
        migration = {
            "every_s": float(migrate_every_s),
            "max_migrations": int(max_migrations),
            "latency_s": transfer["migration_latency_s"],
            "s_per_kv_token": transfer["migration_s_per_kv_token"],
        }
    if max_kv_tokens is not None:
        max_kv_tokens = check_int(max_kv_tokens, "max_kv_tokens", min_value=1)
    if kv_watermark_tokens is None:
        kv_watermark_tokens = 0 if max_kv_tokens is None else max_kv_tokens // 100
    capacity = {"max_kv_tokens": max_kv_tokens, "kv_watermark_tokens": kv_watermark_tokens}
    warmup()
    start = time.perf_counter()
    scaled, factor, measured = scale_to_decode_batch(
        trace, batch_per_rank, num_engines=de, ranks_per_engine=dr, cost=dcost, **capacity
    )
    report: dict[str, Any] = {
        "workload": {
            "source": trace.source,
            "requests": len(trace),
            "time_scale": factor,
            "duration_s": float(scaled.arrival_s[-1]),
            "batch_per_rank_target": float(batch_per_rank),
            "batch_per_rank_calibrated": measured,
            # the KV capacity keeps the running batch below the target
            "capacity_bound": bool(measured < CAPACITY_BOUND * batch_per_rank),
        },
        "options": {"decode_engines": de, "decode_ranks": dr, "cost": cost, "seed": seed,
                    "migration": migration, "transfer": transfer,
                    "kv_capacity_tokens": max_kv_tokens,
                    "kv_watermark_tokens": kv_watermark_tokens},
        "decode": {},
    }  # fmt: skip
    if replicas is not None:
        report["options"]["replicas"] = sync_info
    timing: dict[str, Any] = {"calibration_s": time.perf_counter() - start, "decode": {}}
    for name, make in policies.items():
        start = time.perf_counter()
        run = simulate_decode(
            scaled, name if make is None else make(), num_engines=de, ranks_per_engine=dr,
            cost=dcost, rng=seed, window_s=steady_window(scaled), **transfer, **capacity,
        )  # fmt: skip
        timing["decode"][name] = time.perf_counter() - start
        m = decode_metrics(run, total_tokens=scaled.total_tokens)
        lo, hi = OCCUPANCY_RANGE
        m["meaningful"] = bool(lo <= m["mean_running_per_rank"] <= hi)
        report["decode"][name] = m
    report["meaningful"] = all(m["meaningful"] for m in report["decode"].values())
    timing["requests_per_s"] = {
        f"decode/{k}": len(trace) / v if v > 0 else None for k, v in timing["decode"].items()
    }
    report["timing"] = timing
    return report
