"""Candidates of a re-plan: the shared context, every layer re-planned at a per-layer
tolerance, and the old and the fresh plan as candidates of every layer (``replan.py``'s module
docstring states the rules)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, TypeVar

import numpy as np

from lbkit.eplb._regroup import choose_partitions, old_partition
from lbkit.eplb._replan_layer import (
    LayerSetup,
    ReplanArgs,
    experts_by_node,
    layer_setup,
    level_target,
    place_slots,
    replan_layer,
    replan_nodes_levels,
)
from lbkit.eplb._threads import thread_map
from lbkit.eplb.balanced import balanced_rebalance
from lbkit.eplb.bounds import lower_bound, moe_lb

__all__ = [
    "Candidate",
    "Context",
    "context",
    "fresh_plan",
    "map_layers",
    "matched_fresh",
    "regrouped",
    "replan_all",
    "replan_levels",
    "replan_one",
    "row_lb",
]


T = TypeVar("T")
R = TypeVar("R")


def map_layers(args: ReplanArgs, func: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[func(x) for x in items]`` on ``args.workers`` threads, results in order.

    ``func`` works on one layer: it reads the shared problem and context and writes only its
    layer's entries of ``ctx.memo``, and the kernels it calls release the GIL; the results are
    those of the loop in every order the threads may take.
    """
    return thread_map(func, items, args.workers)


def fresh_plan(args: ReplanArgs) -> tuple[np.ndarray, np.ndarray]:
    """The default method's fresh plan for the new loads, on ``args.workers`` threads, and its
    ``moe_lb`` per layer: ``(phy2log, moe_lb)``."""
    p = args.problem
    policy = "hierarchical" if p.hierarchical else "global"
    fresh = balanced_rebalance(
        p.weight,
        p.num_replicas,
        args.num_groups,
        args.num_nodes,
        p.num_gpus,
        policy=policy,
        workers=args.workers,
    ).phy2log
    return fresh, moe_lb(p.weight, fresh, num_gpus=p.num_gpus)


def _node_bounds(w: np.ndarray, partitions: np.ndarray | None, args: ReplanArgs) -> np.ndarray:
    """Absolute lower bound on the largest GPU load of every sub-problem, ``(layers, nodes)``."""
    p = args.problem
    layers, experts = w.shape
    if partitions is None:
        lb = lower_bound(w, p.num_replicas, 1, 1, p.num_gpus, policy="global")
        return (lb * w.sum(axis=1) / p.num_gpus)[:, None]
    nodes = args.num_nodes
    local = experts_by_node(partitions, nodes, experts // args.num_groups)
    wn = w[np.arange(layers)[:, None, None], local].reshape(layers * nodes, -1)
    gpn = p.num_gpus // nodes
    lb = lower_bound(wn, p.num_replicas // nodes, 1, 1, gpn, policy="global")
    return (lb * wn.sum(axis=1) / gpn).reshape(layers, nodes)


def _bounds_like(
    w: np.ndarray, parts: np.ndarray, known: np.ndarray, bounds: np.ndarray, args: ReplanArgs
) -> np.ndarray:
    """:func:`_node_bounds` under ``parts``, reusing the rows of ``bounds`` (under ``known``)
    of the layers where the two partitions are the same."""
    differ = np.flatnonzero((parts != known).any(axis=1))
    out = bounds.copy()
    if len(differ):
        out[differ] = _node_bounds(w[differ], parts[differ], args)
    return out


class Context(NamedTuple):
    """What every re-plan of a problem shares: partitions, bounds and the fresh plan."""

    partitions: np.ndarray | None  # (layers, groups) node of each group, chosen by the rule
    old_parts: np.ndarray | None
    fresh_parts: np.ndarray | None
    bounds: np.ndarray  # (layers, nodes) under ``partitions``
    old_bounds: np.ndarray
    fresh_bounds: np.ndarray | None
    fresh: np.ndarray  # (layers, R) fresh default plan
    fresh_lb: np.ndarray  # (layers,) its moe_lb
    fresh_max: np.ndarray  # (layers,) its largest GPU load
    old_lb: np.ndarray  # (layers,) moe_lb of the old plan under the new loads
    memo: dict[tuple, tuple]  # replan_one's results, the old rows' moe_lb, the layer setups


def context(args: ReplanArgs) -> Context:
    p = args.problem
    w, prev = p.weight, args.previous
    layers, experts = w.shape
    partitions = old_parts = fresh_parts = fresh_bounds = None
    if p.hierarchical:
        old_parts = old_partition(prev, experts, args.num_groups, args.num_nodes)
        group_load = w.reshape(layers, args.num_groups, -1).sum(axis=2)
        partitions = choose_partitions(
            group_load, old_parts, args.num_nodes, args.regroup_tolerance
        )
    fresh, fresh_lb = fresh_plan(args)
    bounds = _node_bounds(w, partitions, args)
    old_bounds = bounds
    if p.hierarchical:
        old_bounds = _bounds_like(w, old_parts, partitions, bounds, args)
        fresh_parts = old_partition(fresh, experts, args.num_groups, args.num_nodes)
        fresh_bounds = _bounds_like(w, fresh_parts, partitions, bounds, args)
    return Context(
        partitions,
        old_parts,
        fresh_parts,
        bounds,
        old_bounds,
        fresh_bounds,
        fresh,
        fresh_lb,
        fresh_lb * w.sum(axis=1) / p.num_gpus,
        moe_lb(w, prev, num_gpus=p.num_gpus),
        {},
    )


def _row_loads(w: np.ndarray, row: np.ndarray, num_gpus: int) -> np.ndarray:
    """GPU loads of one layer's ``phy2log`` row, ``(num_gpus,)``."""
    cnt = np.bincount(row, minlength=len(w)).astype(np.float64)
    return (w[row] / cnt[row]).reshape(num_gpus, -1).sum(axis=1)


def _rows_loads(w: np.ndarray, rows: np.ndarray, num_gpus: int) -> np.ndarray:
    """:func:`_row_loads` of every row of ``rows`` ``(n, slots)`` at once, ``(n, num_gpus)``:
    the same arithmetic in the same order, so the same bits."""
    n, experts = rows.shape[0], len(w)
    flat = (rows + np.arange(n)[:, None] * experts).ravel()
    cnt = np.bincount(flat, minlength=n * experts).astype(np.float64)
    return (w[rows] / cnt[flat].reshape(rows.shape)).reshape(n, num_gpus, -1).sum(axis=2)


def _lb_of(load: np.ndarray) -> float:
    """``moe_lb`` of GPU loads: largest over mean (1 when all are zero)."""
    mean = load.mean()
    return float(load.max() / mean) if mean > 0 else 1.0


def row_lb(w: np.ndarray, row: np.ndarray, num_gpus: int) -> float:
    """``moe_lb`` of one layer's ``phy2log`` row (the arithmetic of :func:`moe_lb`, without
    its validation: called for every candidate)."""
    return _lb_of(_row_loads(w, row, num_gpus))


def replan_one(
    args: ReplanArgs, ctx: Context, layer: int, tol: float, budget: int
) -> tuple[np.ndarray, int, bool, float]:
    """Re-plan one layer at per-layer tolerance ``tol``: ``(row, moves, regrouped, moe_lb of
    the row)``; the old row with zero moves unless the result is strictly better than keeping
    it. Memoised in ``ctx.memo`` (the total-budget mode asks for some results twice)."""
    key = (layer, tol, budget)
    if key not in ctx.memo:
        ctx.memo[key] = _replan_one_uncached(args, ctx, layer, tol, budget)
    row, used, regrouped, lb = ctx.memo[key]
    if lb is None:  # the old row
        if ("old", layer) not in ctx.memo:
            p = args.problem
            ctx.memo["old", layer] = (row_lb(p.weight[layer], row, p.num_gpus),)
        lb = ctx.memo["old", layer][0]
    return row.copy(), used, regrouped, lb


def _setup(args: ReplanArgs, ctx: Context, layer: int, part: np.ndarray | None) -> LayerSetup:
    """:func:`layer_setup` of one layer under partition ``part``, memoised in ``ctx.memo`` (every
    tolerance of the layer re-plans from the same cut)."""
    key = ("setup", layer, None if part is None else part.tobytes())
    if key not in ctx.memo:
        ctx.memo[key] = layer_setup(args.problem.weight[layer], args.previous[layer], part, args)
    return ctx.memo[key]


def replan_levels(args: ReplanArgs, ctx: Context, layer: int, tols: list, budget: int) -> None:
    """Memoise :func:`replan_one` of one layer at the tolerances ``tols`` (loose first; the same
    results): the sub-problems of the levels under the layer's partition in one kernel call
    (:func:`replan_nodes_levels`), the rest of each as :func:`replan_one` does it. Saves the
    Python around a call per level where the kernels are short (hierarchical sub-problems).

    A level is left out when an earlier row certainly meets it (``_Levels.compute`` would skip
    it): its largest GPU load is within the level's tolerance of the fresh plan's and below
    the old row's, both by a margin of ``1e-9`` that covers the kernel's other summation order.
    Whatever is left out and still wanted is computed by :func:`replan_one` on demand.
    """
    todo = [t for t in tols if (layer, t, budget) not in ctx.memo and not _keeps_old(ctx, layer, t)]
    if len(todo) < 2:
        return
    p = args.problem
    w, prev, fresh_max = p.weight[layer], args.previous[layer], float(ctx.fresh_max[layer])
    part = None if ctx.partitions is None else ctx.partitions[layer]
    targets = np.array([level_target(ctx.bounds[layer], fresh_max, t) for t in todo])
    mean = w.sum() / p.num_gpus
    meets = np.array([ctx.fresh_lb[layer] * (1.0 + t) for t in todo]) * mean * (1.0 - 1e-9)
    useful = float(ctx.old_lb[layer] * mean * (1.0 - 1e-9))
    rows = np.empty((len(todo), prev.shape[0]), dtype=np.int64)
    w_nodes, old_nodes, node_experts, order = _setup(args, ctx, layer, part)
    used = replan_nodes_levels(
        w_nodes, old_nodes, node_experts, prev, order, targets, budget, w, meets, useful, rows
    )
    done = np.flatnonzero(used >= 0)
    loads = _rows_loads(w, rows[done], p.num_gpus)
    for k, load in zip(done, loads, strict=True):
        result = _finish(args, ctx, layer, todo[k], budget, part, rows[k], int(used[k]), load)
        ctx.memo[layer, todo[k], budget] = result


def _keeps_old(ctx: Context, layer: int, tol: float) -> bool:
    """Whether the old row is as good as a fresh plan at ``tol``: nothing to move."""
    return bool(ctx.old_lb[layer] <= ctx.fresh_lb[layer] * (1.0 + tol))


def _replan_one_uncached(
    args: ReplanArgs, ctx: Context, layer: int, tol: float, budget: int
) -> tuple[np.ndarray, int, bool, float | None]:
    prev = args.previous[layer]
    if _keeps_old(ctx, layer, tol):
        return prev.copy(), 0, False, None
    part = None if ctx.partitions is None else ctx.partitions[layer]
    setup = _setup(args, ctx, layer, part)
    fresh_max = float(ctx.fresh_max[layer])
    row, used = replan_layer(setup, prev, ctx.bounds[layer], fresh_max, tol, budget)
    return _finish(args, ctx, layer, tol, budget, part, row, used)


def _finish(
    args: ReplanArgs,
    ctx: Context,
    layer: int,
    tol: float,
    budget: int,
    part: np.ndarray | None,
    row: np.ndarray,
    used: int,
    load: np.ndarray | None = None,
) -> tuple[np.ndarray, int, bool, float | None]:
    """:func:`replan_one`'s result from the re-plan ``(row, used)`` under the layer's partition
    ``part`` (``load``: its GPU loads if known): the old partition when that exceeds the budget,
    the fresh plan's when that is better balanced, never worse than the old row."""
    p = args.problem
    w, prev = p.weight[layer], args.previous[layer]
    fresh_max = float(ctx.fresh_max[layer])
    if used > budget and part is not None:
        part = ctx.old_parts[layer]
        setup = _setup(args, ctx, layer, part)
        row, used = replan_layer(setup, prev, ctx.old_bounds[layer], fresh_max, tol, budget)
        load = None
    if used > budget:
        row, used, load = prev.copy(), 0, None
    if load is None:
        load = _row_loads(w, row, p.num_gpus)
    if part is not None and not np.array_equal(part, ctx.fresh_parts[layer]):
        # Short of the fresh plan's balance: try the fresh plan's group-to-node assignment.
        lb_row = float(load.max())
        if lb_row > fresh_max * (1.0 + tol) * (1.0 + 1e-9):
            fp = ctx.fresh_parts[layer]
            setup = _setup(args, ctx, layer, fp)
            row2, used2 = replan_layer(setup, prev, ctx.fresh_bounds[layer], fresh_max, tol, budget)
            load2 = _row_loads(w, row2, p.num_gpus)
            if used2 <= budget and float(load2.max()) < lb_row * (1.0 - tol):
                row, used, part, load = row2, used2, fp, load2
    # Never worse than keeping the old plan, and strictly better if anything moves.
    new_lb = _lb_of(load)
    old_lb = ctx.old_lb[layer]
    if new_lb > old_lb or (used > 0 and new_lb >= old_lb * (1.0 - 1e-12)):
        return prev.copy(), 0, False, None
    regrouped = part is not None and not np.array_equal(part, ctx.old_parts[layer])
    return row, used, bool(regrouped), new_lb


def replan_all(
    args: ReplanArgs, budgets: np.ndarray, ctx: Context | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-plan every layer at the per-layer tolerance: ``(phy2log, moves, regrouped)``."""
    ctx = context(args) if ctx is None else ctx
    layers = args.previous.shape[0]
    phy2log = args.previous.copy()
    moves = np.zeros(layers, dtype=np.int64)
    regrouped = np.zeros(layers, dtype=bool)
    results = map_layers(
        args,
        lambda layer: replan_one(args, ctx, layer, args.tolerance, int(budgets[layer])),
        range(layers),
    )
    for layer, (row, used, regroup, _) in enumerate(results):
        phy2log[layer], moves[layer], regrouped[layer] = row, used, regroup
    return phy2log, moves, regrouped


def regrouped(row: np.ndarray, old_part: np.ndarray | None, args: ReplanArgs) -> bool:
    """Whether one layer's ``phy2log`` row puts some expert group on another node than the old
    plan's ``old_part`` (``None`` under the global policy: never)."""
    if old_part is None:
        return False
    experts = args.problem.weight.shape[1]
    part = old_partition(row[None, :], experts, args.num_groups, args.num_nodes)[0]
    return not np.array_equal(part, old_part)


def _gpu_counts(row: np.ndarray, num_gpus: int, experts: int) -> np.ndarray:
    """Replicas of every expert on every GPU of one layer, ``(num_gpus, experts)``."""
    gpu = np.arange(len(row)) // (len(row) // num_gpus)
    return np.bincount(gpu * experts + row, minlength=num_gpus * experts).reshape(num_gpus, -1)


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``out[g, f] = sum_e min(a[g, e], b[f, e])`` for count matrices ``a`` and ``b`` (int64):
    ``min(x, y)`` is the number of levels ``k >= 1`` with ``x >= k`` and ``y >= k``, so every
    level adds one for each pair of a row of ``a`` and a row of ``b`` reaching it on a common
    column. The pairs are joined on the column (sparse: a few per column), not multiplied as
    dense matrices (no BLAS call, whose threads would spin on every core for a tiny product).
    """
    rows_a, rows_b = a.shape[0], b.shape[0]
    out = np.zeros(rows_a * rows_b, dtype=np.int64)
    for k in range(1, int(min(a.max(), b.max())) + 1):
        ga, ea = np.nonzero(a >= k)
        eb, gb = np.nonzero((b >= k).T)  # by column, then row
        lo = np.searchsorted(eb, ea, side="left")
        n = np.searchsorted(eb, ea, side="right") - lo
        first = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
        out += np.bincount(np.repeat(ga, n) * rows_b + gb[first], minlength=rows_a * rows_b)
    return out.reshape(rows_a, rows_b)


def matched_fresh(prev: np.ndarray, fresh: np.ndarray, args: ReplanArgs) -> tuple[np.ndarray, int]:
    """The fresh plan's row with its GPUs (and, hierarchical, nodes) relabelled to keep the most
    replicas of the old row in place (an assignment problem); ``(row, moves)``."""
    from scipy.optimize import linear_sum_assignment  # here: importing lbkit.eplb stays light

    p = args.problem
    experts, gpus = p.weight.shape[1], p.num_gpus
    per = len(prev) // gpus
    nodes = args.num_nodes if p.hierarchical else 1
    gpn = gpus // nodes
    a, b = _gpu_counts(prev, gpus, experts), _gpu_counts(fresh, gpus, experts)
    keep = _overlap(a, b)  # (old GPU, fresh GPU): replicas kept in place
    node_keep = keep.reshape(nodes, gpn, nodes, gpn).sum(axis=(1, 3))
    _, node_of = linear_sum_assignment(-node_keep)  # fresh node given to each old node
    matched = np.empty((gpus, per), dtype=np.int64)  # fresh GPU matched to each old GPU
    for n in range(nodes):
        m = int(node_of[n])
        sub = keep[n * gpn : (n + 1) * gpn, m * gpn : (m + 1) * gpn]
        _, gpu_of = linear_sum_assignment(-sub)
        for i in range(gpn):
            f = m * gpn + int(gpu_of[i])
            matched[n * gpn + i] = fresh[f * per : (f + 1) * per]
    placed = np.empty_like(matched)
    place_slots(prev.reshape(gpus, per), matched, placed)
    row = placed.ravel()
    moves = int(np.maximum(_gpu_counts(row, gpus, experts) - a, 0).sum())
    return row, moves


#: One candidate of one layer: ``(moves, moe_lb, phy2log row, regrouped)``.
Candidate = tuple[int, float, np.ndarray, bool]
