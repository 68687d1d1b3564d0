"""Exact EPLB optima with OR-tools CP-SAT, for small instances (tests, benchmarks, CLI only).

The model of one sub-problem (``E`` experts of loads ``w``, ``G`` GPUs of ``S`` slots):
``y[e, k]`` says expert ``e`` has ``k`` replicas (exactly one ``k`` per expert, ``k <= R - E +
1``); ``z[e, g, k]`` counts the replicas of ``e`` on GPU ``g`` under that choice (zero unless
``y[e, k]``); each GPU holds ``S`` replicas; the load of GPU ``g`` is ``sum w_e z[e, g, k] / k``
and the objective is the largest load. Loads are scaled to integers (``w`` rounded to 1e-9 of
the largest load, times ``lcm(1..kmax)`` so that every ``w_e / k`` is an integer); GPUs are
ordered by load to break symmetry.

With two slots per GPU, :func:`optimal_two_slot` solves far larger instances (hundreds of
experts) by bisection on the largest load ``T`` over an exact feasibility test (a mixed-integer
program, SciPy's HiGHS): for fixed counts the sorted pairing is optimal (the ``k``-th largest
replica with the ``k``-th smallest), and it keeps every pair at most ``T`` if and only if, for
every replica size ``x > T / 2``, at most as many replicas are ``>= x`` as are ``<= T - x``
(replicas above ``T / 2`` cannot share a GPU; Hall's condition on a threshold graph). With
binaries ``y[e, c]`` (expert ``e`` has ``c`` replicas) both counts are linear in ``y``.

OR-tools and SciPy's MILP are imported inside the functions: ``import lbkit.eplb`` never loads
them.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any

import numpy as np

from lbkit.eplb._plan import rebalance_iv

__all__ = [
    "optimal_max_load",
    "optimal_moe_lb",
    "optimal_two_slot",
    "pairing_max_load",
    "two_slot_feasible",
]


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
        found = two_slot_optimum(w, num_gpus, upper_bound)
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
    p = rebalance_iv(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
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


def two_slot_optimum(w: np.ndarray, num_gpus: int, upper_bound: float | None) -> float | None:
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


def two_slot_feasible(
    w: Any, /, *, num_gpus: int, max_load: float, time_limit_s: float | None = None
) -> tuple[np.ndarray | None, bool]:
    """Replica counts whose sorted pairing keeps every GPU at most ``max_load`` (two slots).

    Exact test (see the module docstring): a feasibility MILP with one binary per expert and
    candidate count ``c`` (from ``max(1, ceil(w_e / max_load))`` to that plus the spare slots)
    and one Hall row per candidate replica size above ``max_load / 2``. Sizes are compared with
    a relative tolerance of 1e-12 of ``max_load``.

    Parameters
    ----------
    w : array_like, shape (experts,)
        Non-negative loads.
    num_gpus : int
        GPUs of two slots each (``2 * num_gpus >= experts``).
    max_load : float
        The largest GPU load allowed.
    time_limit_s : float, optional
        HiGHS time limit.

    Returns
    -------
    (ndarray of int64 of shape (experts,) or None, bool)
        Counts summing to ``2 * num_gpus`` (``None`` if there are none) and whether the
        answer is proven (``False`` when the time limit stopped HiGHS first).

    Examples
    --------
    >>> counts, proven = two_slot_feasible([100.0, 1.0, 1.0, 1.0, 1.0], num_gpus=3, max_load=51)
    >>> counts.tolist(), proven
    ([2, 1, 1, 1, 1], True)
    >>> two_slot_feasible([100.0, 1.0, 1.0, 1.0, 1.0], num_gpus=3, max_load=50.9)
    (None, True)
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    w = np.asarray(w, dtype=np.float64)
    num_log = w.shape[0]
    num_phy = 2 * num_gpus
    t = float(max_load)
    if not np.isfinite(t) or t < 0:
        raise ValueError(f"max_load: must be finite and >= 0, got {max_load}")
    eps = 1e-12 * t
    if t <= 0:
        ok = bool((w <= 0).all())
        return (_fill_counts(w, np.ones(num_log, dtype=np.int64), num_phy) if ok else None), True
    low = np.maximum(1, np.ceil(w / t - 1e-12)).astype(np.int64)
    spare = num_phy - int(low.sum())
    if spare < 0:
        return None, True
    opt_e = np.repeat(np.arange(num_log), spare + 1)
    opt_c = (low[:, None] + np.arange(spare + 1)[None, :]).ravel()
    size = w[opt_e] / opt_c
    big = size > 0.5 * t + eps
    if not big.any():
        return _fill_counts(w, low, num_phy), True
    rows = [opt_e, np.full(size.shape[0], num_log)]
    cols = [np.arange(size.shape[0])] * 2
    vals = [np.ones(size.shape[0]), opt_c.astype(np.float64)]
    lo = [np.ones(num_log), [-np.inf]]
    hi = [np.ones(num_log), [float(num_phy)]]
    # Hall rows: replicas >= x (each at most T - x away from a partner) minus replicas <= T - x.
    for k, x in enumerate(np.unique(size[big])):
        demand = np.flatnonzero(size >= x - eps)
        supply = np.flatnonzero(size <= t - x + eps)
        rows.append(np.full(demand.shape[0] + supply.shape[0], num_log + 1 + k))
        cols.append(np.concatenate([demand, supply]))
        vals.append(np.concatenate([opt_c[demand], -opt_c[supply]]).astype(np.float64))
    num_rows = num_log + 1 + k + 1
    lo.append(np.full(k + 1, -np.inf))
    hi.append(np.zeros(k + 1))
    a = coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(num_rows, size.shape[0]),
    ).tocsr()
    options = {} if time_limit_s is None else {"time_limit": float(time_limit_s)}
    res = milp(
        np.zeros(size.shape[0]),
        constraints=LinearConstraint(a, np.concatenate(lo), np.concatenate(hi)),
        integrality=np.ones(size.shape[0]),
        bounds=Bounds(0, 1),
        options=options,
    )
    if res.status == 2:
        return None, True
    if res.x is None:
        return None, False
    chosen = res.x > 0.5
    counts = np.zeros(num_log, dtype=np.int64)
    counts[opt_e[chosen]] = opt_c[chosen]
    return _fill_counts(w, counts, num_phy), True


def _fill_counts(w: np.ndarray, counts: np.ndarray, num_phy: int) -> np.ndarray:
    """Hand the slots left to the expert of the smallest replica, one at a time: a replica of
    at most ``T / 2`` only adds partners, so the pairing stays within ``T``."""
    counts = counts.copy()
    for _ in range(num_phy - int(counts.sum())):
        counts[int(np.argmin(w / counts))] += 1
    return counts


def pairing_max_load(w: Any, counts: Any, /) -> float:
    """Largest GPU load of the sorted pairing of the replicas of ``counts`` (two slots).

    Examples
    --------
    >>> pairing_max_load([100.0, 1.0, 1.0, 1.0, 1.0], [2, 1, 1, 1, 1])
    51.0
    """
    w = np.asarray(w, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    items = np.sort(np.repeat(w / counts, counts))
    half = items.shape[0] // 2
    return float((items[:half] + items[::-1][:half]).max())


def optimal_two_slot(
    w: Any,
    /,
    *,
    num_gpus: int,
    upper_counts: Any = None,
    lower_bound: float = 0.0,
    rel_gap: float = 1e-9,
    time_limit_s: float | None = None,
) -> tuple[float, float, np.ndarray, bool]:
    """Smallest possible largest GPU load with two slots per GPU, by bisection on
    :func:`two_slot_feasible`.

    Starts from the counts ``upper_counts`` (e.g. lbkit's plan; the min-max apportionment if
    ``None``) and ``lower_bound``; first tests ``best * (1 - rel_gap)``, so that a plan which
    is already optimal costs one test. A feasible test lowers the best to the pairing of the
    counts found; an infeasible one raises the proven lower limit.

    Parameters
    ----------
    w : array_like, shape (experts,)
    num_gpus : int
    upper_counts : array_like of int, optional
        Counts of a known plan.
    lower_bound : float
        A valid lower bound on the optimum (e.g. ``lbkit.eplb.lower_bound`` times the mean).
    rel_gap : float
        Stop once the proven lower limit is within this relative gap of the best plan.
    time_limit_s : float, optional
        HiGHS time limit per test; a test stopped by it ends the search unproven.

    Returns
    -------
    (float, float, ndarray, bool)
        The best largest GPU load found, the proven lower limit (the optimum lies between),
        its counts, and whether the gap was closed to ``rel_gap``.

    Examples
    --------
    >>> best, low, counts, proven = optimal_two_slot([100.0, 1.0, 1.0, 1.0, 1.0], num_gpus=3)
    >>> best, counts.tolist(), proven
    (51.0, [2, 1, 1, 1, 1], True)
    """
    w = np.asarray(w, dtype=np.float64)
    if upper_counts is None:
        from lbkit.eplb._primitives import apportion_minmax

        upper_counts = np.empty(w.shape[0], dtype=np.int64)
        apportion_minmax(w, 2 * num_gpus, upper_counts)
    counts = np.asarray(upper_counts, dtype=np.int64).copy()
    best = pairing_max_load(w, counts)
    low = float(lower_bound)
    first = True
    while low < best * (1.0 - rel_gap):
        t = best * (1.0 - rel_gap) if first else max(0.5 * (low + best), low)
        first = False
        found, proven = two_slot_feasible(
            w, num_gpus=num_gpus, max_load=t, time_limit_s=time_limit_s
        )
        if not proven:
            return best, low, counts, False
        if found is None:
            low = t
        else:
            counts = found
            best = min(best, pairing_max_load(w, found))
    return best, low, counts, True
