"""Exact EPLB optima with OR-tools CP-SAT, for small instances (tests, benchmarks, CLI only).

The model of one sub-problem (``E`` experts of loads ``w``, ``G`` GPUs of ``S`` slots):
``y[e, k]`` says expert ``e`` has ``k`` replicas (exactly one ``k`` per expert, ``k <= R - E +
1``); ``z[e, g, k]`` counts the replicas of ``e`` on GPU ``g`` under that choice (zero unless
``y[e, k]``); each GPU holds ``S`` replicas; the load of GPU ``g`` is ``sum w_e z[e, g, k] / k``
and the objective is the largest load. Loads are scaled to integers (``w`` rounded to 1e-9 of
the largest load, times ``lcm(1..kmax)`` so that every ``w_e / k`` is an integer); GPUs are
ordered by load to break symmetry.

OR-tools is imported inside the functions: ``import lbkit.eplb`` never loads it.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any

import numpy as np

from lbkit.eplb._plan import _rebalance_iv

__all__ = ["optimal_max_load", "optimal_moe_lb"]


def optimal_max_load(
    w: Any,
    /,
    *,
    num_gpus: int,
    slots: int,
    time_limit_s: float = 30.0,
    forbid_duplicates: bool = False,
    max_load: float | None = None,
    upper_bound: float | None = None,
) -> tuple[float, bool]:
    """Smallest possible largest GPU load of one sub-problem.

    Parameters
    ----------
    w : array_like, shape (experts,)
        Non-negative loads.
    num_gpus, slots : int
        GPUs and slots per GPU (``num_gpus * slots >= experts``).
    time_limit_s : float
        CP-SAT time limit (seconds of solver time).
    forbid_duplicates : bool
        Also require at most one replica of an expert per GPU.
    max_load : float, optional
        Only decide whether a plan with largest load ``<= max_load`` (relative 1e-9) exists;
        returns ``(max_load or inf, proven)``.
    upper_bound : float, optional
        The largest load of a known plan (e.g. lbkit's). An optimal plan's replicas are no
        larger, so ``c_e >= w_e / upper_bound``: this narrows the count domains.

    Returns
    -------
    (float, bool)
        The optimum (``inf`` when infeasible) and whether CP-SAT proved it.

    Examples
    --------
    >>> optimal_max_load([100.0, 1.0, 1.0, 1.0, 1.0], num_gpus=3, slots=2)
    (51.0, True)
    """
    w = np.asarray(w, dtype=np.float64)
    if slots == 2 and not forbid_duplicates and max_load is None:
        found = _two_slot_optimum(w, num_gpus, upper_bound)
        if found is not None:
            return found, True
    from ortools.sat.python import cp_model

    num_log = w.shape[0]
    num_phy = num_gpus * slots
    kmax = num_phy - num_log + 1
    if forbid_duplicates:
        kmax = min(kmax, num_gpus)
    top = float(w.max()) if num_log else 0.0
    if top <= 0.0:
        return 0.0, True
    unit = top * 1e-9
    w_int = np.rint(w / unit).astype(np.int64)
    cap_load = min(x for x in (upper_bound, max_load, np.inf) if x is not None)
    lo = np.ones(num_log, dtype=np.int64)
    if np.isfinite(cap_load) and cap_load > 0:
        lo = np.maximum(1, np.ceil(w / (cap_load * (1 + 1e-9)) - 1e-9)).astype(np.int64)
    if lo.sum() > num_phy:
        return float("inf"), True
    hi = np.minimum(lo + (num_phy - lo.sum()), kmax)
    if (lo > hi).any():
        return float("inf"), True
    kmax = int(hi.max())
    lcm = math.lcm(*range(1, kmax + 1))
    model = cp_model.CpModel()
    dom = {e: range(int(lo[e]), int(hi[e]) + 1) for e in range(num_log)}
    y = {(e, k): model.NewBoolVar(f"y{e}_{k}") for e in range(num_log) for k in dom[e]}
    cap = 1 if forbid_duplicates else slots
    z = {}
    for e in range(num_log):
        model.AddExactlyOne(y[e, k] for k in dom[e])
        for k in dom[e]:
            zs = []
            for g in range(num_gpus):
                v = model.NewIntVar(0, min(cap, k), f"z{e}_{g}_{k}")
                model.Add(v <= min(cap, k) * y[e, k])
                z[e, g, k] = v
                zs.append(v)
            model.Add(sum(zs) == k * y[e, k])
    bound = int(w_int.sum()) * lcm
    loads = []
    for g in range(num_gpus):
        model.Add(sum(z[e, g, k] for e in range(num_log) for k in dom[e]) == slots)
        load = model.NewIntVar(0, bound, f"load{g}")
        model.Add(
            load
            == sum(int(w_int[e]) * (lcm // k) * z[e, g, k] for e in range(num_log) for k in dom[e])
        )
        loads.append(load)
    for g in range(num_gpus - 1):
        model.Add(loads[g] >= loads[g + 1])
    if max_load is not None:
        model.Add(loads[0] <= math.floor(max_load * (1 + 1e-9) / unit * lcm))
    else:
        model.Minimize(loads[0])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE:
        return float("inf"), True
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return float("nan"), False
    if max_load is not None:
        return float(max_load), True
    value = solver.Value(loads[0]) * unit / lcm
    return float(value), status == cp_model.OPTIMAL


def optimal_moe_lb(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    policy: str | None = None,
    time_limit_s: float = 30.0,
) -> tuple[np.ndarray, bool]:
    """Optimal ``moe_lb`` per layer (small instances): global, or hierarchical as the minimum
    over group-to-node partitions of the largest node optimum.

    Returns
    -------
    (ndarray of float64 of shape (layers,), bool)
        Optimal ``moe_lb`` per layer and whether every sub-problem was proven optimal.

    Examples
    --------
    >>> value, proven = optimal_moe_lb([[100.0, 1.0, 1.0, 1.0, 1.0]], 6, 1, 1, 3)
    >>> value, proven
    (array([1.4711...]), True)
    """
    p = _rebalance_iv(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    w = p.weight
    slots = p.num_replicas // p.num_gpus
    gpus_per_node = p.num_gpus // p.num_nodes
    group_size = w.shape[1] // p.num_groups
    per_node = p.num_groups // p.num_nodes
    out = np.ones(w.shape[0])
    proven_all = True
    for layer in range(w.shape[0]):
        mean = w[layer].sum() / p.num_gpus
        if mean <= 0:
            continue
        cache: dict[tuple[int, ...], float] = {}

        def node_opt(groups: tuple[int, ...], layer: int = layer, cache=cache) -> float:
            nonlocal proven_all
            if groups not in cache:
                idx = np.concatenate(
                    [np.arange(g * group_size, (g + 1) * group_size) for g in groups]
                )
                sub = w[layer, idx]
                ub = _heuristic_max_load(sub, gpus_per_node * slots, gpus_per_node)
                value, proven = optimal_max_load(
                    sub,
                    num_gpus=gpus_per_node,
                    slots=slots,
                    time_limit_s=time_limit_s,
                    upper_bound=ub,
                )
                proven_all &= proven
                cache[groups] = value
            return cache[groups]

        best = float("inf")
        for parts in _partitions(tuple(range(p.num_groups)), per_node):
            best = min(best, max(node_opt(part) for part in parts))
        out[layer] = best / mean
    return out, proven_all


def _two_slot_optimum(w: np.ndarray, num_gpus: int, upper_bound: float | None) -> float | None:
    """Exact optimum with two slots per GPU, or ``None`` if there are too many count vectors.

    For fixed counts, pairing the largest replica with the smallest, the second largest with
    the second smallest, and so on minimises the largest pair (exchange argument), so the
    optimum is the best such pairing over all count vectors with ``c_e >= w_e / upper_bound``.
    """
    num_log = w.shape[0]
    num_phy = 2 * num_gpus
    lo = np.ones(num_log, dtype=np.int64)
    if upper_bound is not None and upper_bound > 0:
        lo = np.maximum(1, np.ceil(w / (upper_bound * (1 + 1e-9)) - 1e-9)).astype(np.int64)
    spare = num_phy - int(lo.sum())
    if spare < 0:
        return None
    if math.comb(spare + num_log - 1, num_log - 1) > 300_000:
        return None
    best = np.inf if upper_bound is None else upper_bound * (1 + 1e-9)
    cnt = lo.copy()

    def visit(e: int, left: int) -> None:
        nonlocal best
        if e == num_log - 1:
            cnt[e] = lo[e] + left
            items = np.sort(np.repeat(w / cnt, cnt))
            best = min(best, float((items[:num_gpus] + items[::-1][:num_gpus]).max()))
            return
        for k in range(left + 1):
            cnt[e] = lo[e] + k
            visit(e + 1, left - k)
        cnt[e] = lo[e]

    visit(0, spare)
    return best


def _heuristic_max_load(w: np.ndarray, num_replicas: int, num_gpus: int) -> float:
    """Largest GPU load of lbkit's default plan for one sub-problem (an upper bound)."""
    from lbkit.eplb.balanced import balanced_rebalance

    plan = balanced_rebalance(w[None, :], num_replicas, 1, 1, num_gpus, policy="global")
    per_replica = w / plan.logcnt[0]
    return float(per_replica[plan.phy2log[0]].reshape(num_gpus, -1).sum(axis=1).max())


def _partitions(items: tuple[int, ...], size: int):
    """All partitions of ``items`` into blocks of ``size`` (blocks in order of first item)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in combinations(rest, size - 1):
        block = (first, *others)
        remaining = tuple(i for i in rest if i not in others)
        for tail in _partitions(remaining, size):
            yield [block, *tail]
