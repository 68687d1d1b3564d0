"""Metrics of a simulated run (SPEC §5), as JSON-ready dictionaries.

Definitions (formulas in ``docs/metrics.md``):

- **balance efficiency** of a pool: ``sum over engine steps of mean_r L[r] / sum of max_r L[r]``,
  ``L[r]`` the modelled time of rank ``r`` in the step (a ratio of sums over all steps and
  engines, so longer steps weigh more). 1.0 is perfect.
- **count / KV imbalance** of the decode pool: ``max_r B_r / mean_r B_r`` (and for ``S_r``) at
  each step, averaged over steps weighted by step duration.
- **TTFT** = prefill end - arrival; **TTFT slowdown** = TTFT / the request's prefill time alone on
  an idle rank; **TPOT** = (decode end - handover) / (output tokens - 1). Percentiles p50, p90,
  p99 (linear interpolation) overall and per length bucket, over finished requests; refused and
  unfinished requests are counted beside them.
- **perfect-balance reference**: the same requests on a fluid pool whose ``N`` ranks share the
  queued work perfectly: request ``i`` waits ``V_i / N`` (``V_i`` the work queued ahead of it,
  drained at ``N`` rank-seconds per second) and then runs alone (``alone_i``). Its TTFT is
  ``V_i / N + alone_i``; its balance efficiency is 1.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lbkit.prefill.buckets import DEFAULT_EDGES
from lbkit.sim import _decode_kernels as K
from lbkit.sim.engine import DecodeRun, PrefillRun
from lbkit.sim.traces import bucket_labels

__all__ = [
    "decode_metrics",
    "fluid_ttft_s",
    "percentiles",
    "prefill_metrics",
]


def _num(x: float) -> float | None:
    """JSON-safe float (``None`` for nan)."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def percentiles(values: np.ndarray, /, *, prefix: str, unit: str = "_s") -> dict[str, Any]:
    """``{prefix_p50<unit>, _p90, _p99, _mean}`` of the finite values (``None`` when empty).

    Examples
    --------
    >>> percentiles(np.array([1.0, 2.0, 3.0, np.nan]), prefix="ttft")
    {'ttft_p50_s': 2.0, 'ttft_p90_s': 2.8, 'ttft_p99_s': 2.98, 'ttft_mean_s': 2.0}
    """
    v = values[np.isfinite(values)]
    if v.size == 0:
        return {f"{prefix}_{k}{unit}": None for k in ("p50", "p90", "p99", "mean")}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {
        f"{prefix}_p50{unit}": float(p50),
        f"{prefix}_p90{unit}": float(p90),
        f"{prefix}_p99{unit}": float(p99),
        f"{prefix}_mean{unit}": float(v.mean()),
    }


def fluid_ttft_s(arrival_s: np.ndarray, alone_s: np.ndarray, /, *, num_ranks: int) -> np.ndarray:
    """TTFT of each request on a perfectly balanced fluid pool of ``num_ranks`` ranks.

    Requests are taken in arrival order; the work queued ahead of request ``i`` is
    ``V_i = max(0, V_{i-1} + alone_{i-1} - N (t_i - t_{i-1}))`` and its TTFT is
    ``V_i / N + alone_i``.

    Examples
    --------
    >>> fluid_ttft_s(np.array([0.0, 0.0, 10.0]), np.array([4.0, 4.0, 1.0]), num_ranks=2)
    array([4., 6., 1.])
    """
    n = arrival_s.shape[0]
    out = np.empty(n)
    backlog = 0.0
    prev_t = arrival_s[0] if n else 0.0
    prev_w = 0.0
    for i, (t, w) in enumerate(zip(arrival_s.tolist(), alone_s.tolist(), strict=True)):
        backlog = max(0.0, backlog + prev_w - num_ranks * (t - prev_t))
        out[i] = backlog / num_ranks + w
        prev_t, prev_w = t, w
    return out


def _buckets(total_tokens: np.ndarray, edges: tuple[int, ...]) -> np.ndarray:
    return np.searchsorted(np.asarray(edges), total_tokens, side="right")


def _balance_loss(run: PrefillRun) -> dict[str, Any]:
    """Where balance efficiency is lost: ``1 - eta`` split into idle ranks and unequal busy
    ranks, the steps by number of busy ranks, and the steps of engines holding fewer requests
    than ranks (which no plan can fill, since a request runs on one rank)."""
    mx = run.step_max_s
    if run.busy_steps is None or not mx > 0:
        return {}
    r = run.ranks_per_engine
    idle = sum(run.busy_max_s[k] * (r - k) / r for k in range(r + 1)) / mx
    return {
        "total": 1.0 - run.step_mean_s / mx,
        "idle_ranks": float(idle),
        "unequal_busy_ranks": float(1.0 - run.step_mean_s / mx - idle),
        "steps_by_busy_ranks": run.busy_steps.tolist(),
        "step_time_share_by_busy_ranks": (run.busy_max_s / mx).tolist(),
        "few_requests_step_time_share": run.few_max_s / mx,
        "few_requests_balance": run.few_mean_s / run.few_max_s if run.few_max_s > 0 else 1.0,
        "few_requests_loss": (run.few_max_s - run.few_mean_s) / mx,
    }


def prefill_metrics(
    run: PrefillRun,
    /,
    *,
    edges: tuple[int, ...] = DEFAULT_EDGES,
    offered_utilization: float | None = None,
) -> dict[str, Any]:
    """Balance, latency and counts of a prefill run, with the perfect-balance reference.

    Raises
    ------
    AssertionError
        Conservation fails (arrived != finished + refused + in flight), or the tokens the engines
        computed differ from the uncached tokens of finished requests plus in-flight progress
        (cannot happen unless the engine model is broken).
    """
    trace = run.trace
    arrived = run.num_arrived
    routed = run.rank >= 0
    finished = run.finished
    refused = int(run.refused.sum())
    n_fin = int(finished.sum())
    in_flight = int((routed & ~finished).sum())
    assert arrived == n_fin + refused + in_flight, "prefill conservation"
    uncached = trace.total_tokens - run.cached_tokens  # what each request hit where it ran
    assert run.tokens_computed >= int(uncached[finished].sum()), "prefill work conservation"
    if in_flight == 0:
        assert run.tokens_computed == int(uncached[finished].sum()), "prefill work conservation"
    ttft = np.where(finished, run.ttft_s, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        slowdown = ttft / run.alone_s
    num_ranks = run.num_engines * run.ranks_per_engine
    first = float(trace.arrival_s[0]) if len(trace) else 0.0
    elapsed = max(run.end_s - first, 1e-12)
    out: dict[str, Any] = {
        "balance_efficiency": run.step_mean_s / run.step_max_s if run.step_max_s > 0 else 1.0,
        **percentiles(ttft, prefix="ttft"),
        "ttft_slowdown_p50": None,
        "ttft_slowdown_p99": None,
        "finished": n_fin,
        "refused": refused,
        "in_flight": in_flight,
        "arrived": arrived,
        "steps": run.num_steps,
        "budget_overruns": run.overruns,
        "tokens_computed": run.tokens_computed,
        "busy_utilization": float(run.rank_busy_s.sum() / (num_ranks * elapsed)),
        "end_s": run.end_s,
        "work_sharing": run.work_sharing,
        "moves": run.moves,
        "balance_loss": _balance_loss(run),
    }
    sd = slowdown[np.isfinite(slowdown)]
    if sd.size:
        out["ttft_slowdown_p50"], out["ttft_slowdown_p99"] = (
            float(x) for x in np.percentile(sd, [50, 99])
        )
    if offered_utilization is not None:
        out["offered_utilization"] = float(offered_utilization)
    labels = bucket_labels(tuple(edges))
    b = _buckets(trace.total_tokens, tuple(edges))
    per: dict[str, Any] = {}
    for j, label in enumerate(labels):
        sel = b == j
        if not sel.any():
            continue
        entry = {"requests": int(sel.sum()), "finished": int((sel & finished).sum())}
        entry.update(percentiles(ttft[sel], prefix="ttft"))
        sdb = slowdown[sel]
        sdb = sdb[np.isfinite(sdb)]
        entry["ttft_slowdown_p99"] = float(np.percentile(sdb, 99)) if sdb.size else None
        per[label] = entry
    out["per_bucket"] = per
    ref = fluid_ttft_s(trace.arrival_s, run.alone_s, num_ranks=num_ranks)
    out["reference"] = {
        "balance_efficiency": 1.0,
        **percentiles(ref[routed], prefix="ttft"),
        "note": "fluid pool: queued work shared perfectly by all ranks, then the request alone",
    }
    return {k: _num(v) if isinstance(v, float) else v for k, v in out.items()}


def decode_metrics(run: DecodeRun, /, *, total_tokens: np.ndarray | None = None,
                   edges: tuple[int, ...] = DEFAULT_EDGES) -> dict[str, Any]:  # fmt: skip
    """Balance, imbalance, TPOT and counts of a decode run, with the perfect-balance reference.

    ``mean_running_per_rank`` is the mean over engine steps of the requests decoding per rank
    (waiting and in-transit ones excluded), over the run's window when it has one, else over
    the whole run (SPEC section 10). Back-pressure: ``waited`` requests spent time in the wait
    queue (``wait_*_s`` over admitted requests), ``preemptions``, ``refused_by_reason``.

    Raises
    ------
    AssertionError
        Conservation fails (arrived != finished + refused + in flight).
    """
    arrived_mask = run.arrived
    finished = run.finished
    refused = run.refused
    arrived = int(arrived_mask.sum())
    n_fin = int(finished.sum())
    n_ref = int(refused.sum())
    in_flight = int((arrived_mask & ~finished & ~refused).sum())
    assert arrived == n_fin + n_ref + in_flight, "decode conservation"
    tpot = np.where(finished, run.tpot_s, np.nan)
    steps = max(run.num_steps, 1)
    t_total = run.step_time_s
    first = float(np.nanmin(run.handover_s)) if arrived else 0.0
    elapsed = max(run.end_s - first, 1e-12)
    out: dict[str, Any] = {
        "balance_efficiency": run.step_mean_s / run.step_max_s if run.step_max_s > 0 else 1.0,
        "count_imbalance": run.count_imbalance_s / t_total if t_total > 0 else 1.0,
        "kv_imbalance": run.kv_imbalance_s / t_total if t_total > 0 else 1.0,
        **percentiles(tpot, prefix="tpot"),
        "finished": n_fin,
        "refused": n_ref,
        "in_flight": in_flight,
        "arrived": arrived,
        "single_token": int((run.rank == -2).sum()),
        "steps": run.num_steps,
        "step_time_mean_s": t_total / steps,
        # steps sum over engines, each stepping ranks_per_engine ranks
        "batch_per_rank_mean": run.tokens_generated / (steps * run.ranks_per_engine),
        "busy_fraction": t_total / (run.num_engines * elapsed),
        "end_s": run.end_s,
        "migrations": run.migrations,
        "migration_s": run.migration_s,
        "kv_capacity_tokens": run.kv_capacity_tokens,
        "preemptions": run.preemptions,
        "refused_by_reason": run.refused_by_reason,
    }
    if run.wait_s is not None:
        admitted = arrived_mask & ~refused & (run.rank != -2)
        out["waited"] = int((run.wait_s[admitted] > 0).sum())
        out.update(percentiles(np.where(admitted, run.wait_s, np.nan), prefix="wait"))
    if total_tokens is not None:
        per: dict[str, Any] = {}
        b = _buckets(np.asarray(total_tokens), tuple(edges))
        for j, label in enumerate(bucket_labels(tuple(edges))):
            sel = (b == j) & arrived_mask
            if sel.any():
                per[label] = {"requests": int(sel.sum()), **percentiles(tpot[sel], prefix="tpot")}
        out["per_bucket"] = per
    if run.window_sums is not None:
        w = run.window_sums.tolist()
        wt = w[K.DACC_TIME]
        ws = max(w[K.DACC_STEPS], 1.0)
        mx = w[K.DACC_MAX]
        out["window"] = {
            "start_s": run.window_s[0],
            "stop_s": run.window_s[1],
            "steps": int(w[K.DACC_STEPS]),
            "balance_efficiency": w[K.DACC_MEAN] / mx if mx > 0 else 1.0,
            "count_imbalance": w[K.DACC_BIMB] / wt if wt > 0 else 1.0,
            "kv_imbalance": w[K.DACC_SIMB] / wt if wt > 0 else 1.0,
            "count_imbalance_floor": w[K.DACC_BFLOOR] / wt if wt > 0 else 1.0,
            "batch_per_rank_mean": w[K.DACC_TOKENS] / (ws * run.ranks_per_engine),
            "note": "the same sums over the steps that start inside the window (steady state)",
        }
    window = out.get("window")
    out["mean_running_per_rank"] = (
        window["batch_per_rank_mean"] if window is not None else out["batch_per_rank_mean"]
    )
    out["reference"] = {
        "balance_efficiency": 1.0,
        "count_imbalance": run.count_floor_s / t_total if t_total > 0 else 1.0,
        "kv_imbalance": 1.0,
        "step_time_mean_s": run.step_mean_s / steps,
        "note": "the same steps with every rank at the mean load; count imbalance floor "
        "ceil(mean)/mean of integer request counts",
    }
    return {k: _num(v) if isinstance(v, float) else v for k, v in out.items()}


def balance_series(
    bin_s: float, mean_s: np.ndarray, max_s: np.ndarray, /
) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, balance efficiency per bin) over the bins that saw a step."""
    ok = max_s > 0
    t = np.arange(mean_s.shape[0]) * bin_s
    return t[ok], mean_s[ok] / max_s[ok]
