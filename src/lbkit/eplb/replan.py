"""Re-plan an EPLB placement for new loads while moving few expert replicas.

Moving a replica means copying an expert's weights to another GPU while serving, so a re-plan
should keep what it can. A **move** is a replica that a GPU holds in the new plan and did not hold
in the old one, counted with multiplicity per ``(layer, GPU, expert)``:

    moves = sum over layers l, GPUs g, experts e of max(0, new[l, g, e] - old[l, g, e])

The position of a replica among a GPU's slots is free: unchanged replicas keep their slots.

**Tolerance** (``tolerance_scope``). ``"mean"`` (default): the mean ``moe_lb`` over layers may be at
most ``1 + tolerance`` times that of a fresh default plan for the new loads. Every layer is
re-planned at twelve per-layer tolerances ``t = (0.5, 0.6, ..., 1.4, 1.6, 2) * tolerance`` (a
tighter one is skipped when a looser one already reached it); the candidates of a layer are these
results, the old plan (zero moves) and the fresh plan with its GPUs (and nodes) relabelled to keep
the most replicas in place (an assignment problem). One candidate per layer is chosen exactly (a
dynamic programme over the total moves, a multiple-choice knapsack): the fewest total moves such
that the mean ``moe_lb`` stays within the tolerance, then the lowest mean. Layers where balance is
cheap take a tight result, layers where it costs many moves a loose one. The fresh plan makes the
mean target always reachable when the budgets allow it. ``"layer"``: every layer is re-planned
once at ``t = tolerance``.

Per sub-problem (a layer under the global policy, a node of a layer under the hierarchical one)
and per-layer tolerance ``t``, with a target largest GPU load ``T = (1 + t) * max(bound, fresh)``
(``bound`` from
:func:`lbkit.eplb.lower_bound` of the sub-problem's new loads, hierarchical: the largest node
bound of the layer, so that lighter nodes stop earlier; ``fresh`` the largest GPU load of the
default method's fresh plan for the layer). A layer whose old plan is already within ``t`` of
the fresh plan's ``moe_lb`` is kept as it is (zero drift moves nothing):

1. **Counts** stay as they were unless a replica is too large for any GPU holding it to reach
   ``T``; then that expert gains a replica from the expert that loses least.
2. **Keep, then fill**: every other old replica stays; the new replicas fill the freed slots,
   largest first, each into the lightest GPU with a free slot.
3. **Exchange cycles**: GPUs above ``T`` are fixed by cycles that keep replica counts: ``m``
   GPUs above ``T`` each pass a replica to the next, larger than the one they receive by at
   least their excess, and a light GPU closes the cycle (``m + 1`` moves for ``m`` GPUs; the
   fixed-count lower bound on moves is ``H + k`` for ``H`` GPUs above ``T`` and ``k`` light
   GPUs whose room covers the excess). If some GPU stays above ``T``, the **excess descent**
   continues: the step that lowers the total excess ``sum_g max(0, load_g - T)`` most per
   move: a count change (one slot given from an expert with several replicas to another
   expert: one move), a swap of a replica of a GPU above ``T`` with a smaller one elsewhere
   (two moves), or a chain of exchanges. Only GPUs above ``T`` are ever unloaded; a local
   search on the most loaded GPU follows if the descent stops short.
4. The best state within the movement budget is kept (lowest largest load, then fewest moves),
   then moves that are not needed are given back (a swap or count change that saves a move
   and keeps every GPU at or below that load). A layer whose re-plan is not better than keeping
   the old plan under the new loads keeps the old plan (zero moves).

**Hierarchical policy**: groups stay on the node of the old plan unless that costs balance. The
rule: over every group-to-node assignment (``num_groups / num_nodes`` groups per node; when there
are more than 50 000 assignments, over those reached by exchanging pairs of groups from the old
one), let ``best`` be the smallest largest node load; the assignment kept is the one that moves
the fewest groups among those whose largest node load is at most ``(1 + regroup_tolerance) *
best`` (then the smaller largest node load, then enumeration order). If the layer then stays
above ``T`` and the fresh plan's assignment differs, the layer is also re-planned with the fresh
plan's assignment, kept if its largest GPU load is lower by more than ``t``. Moving a
group moves all of its replicas, typically an eighth of a layer's slots or more.

**Budgets**: ``max_moves`` caps moves per layer (candidates above it are dropped);
``max_moves_total`` caps their sum. With a total budget the candidates of every layer are those
of the mean mode at ``tolerance`` and at :data:`DEFAULT_TOLERANCE` (the default re-plan's), and
the re-plans at ``t = tolerance`` at a ladder of per-layer budgets (factors of 1.5 up to that
layer's moves); one candidate per layer is chosen exactly within the total (the dynamic
programme above, restricted to totals within the budget): the fewest moves reaching the mean
target if any choice within the budget does, else the lowest mean ``moe_lb``. The candidates do
not depend on the total, so a larger total never gives a mean ``moe_lb`` above both a smaller
one's and the target, nor above both the default re-plan's (when its moves fit) and the target.
:func:`replan_tradeoff` returns the curve of (moves, moe_lb) over a few budgets.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_int_array, check_choice, check_int, check_real
from lbkit.eplb import _replan_kernels
from lbkit.eplb._plan import EplbPlan, Problem, _finish_plan, _rebalance_iv
from lbkit.eplb.bounds import lower_bound, moe_lb
from lbkit.eplb.rebalance import rebalance_experts

__all__ = [
    "DEFAULT_REGROUP_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "TOLERANCE_SCOPES",
    "ExpertMoves",
    "ReplanResult",
    "ReplanTradeoff",
    "apply_moves",
    "replan_experts",
    "replan_tradeoff",
]

#: Relative gap of the mean ``moe_lb`` over layers to a fresh default plan's that a re-plan may
#: keep (``tolerance_scope="mean"``; per layer with ``"layer"``).
DEFAULT_TOLERANCE = 0.01

#: Values of ``tolerance_scope=``: the tolerance bounds the mean over layers, or every layer.
TOLERANCE_SCOPES = ("mean", "layer")

#: Relative loss of node balance accepted to keep groups on their old nodes (hierarchical).
DEFAULT_REGROUP_TOLERANCE = 0.005

#: Unpin steps per sub-problem (each releases one or two replicas).
_MAX_STEPS_PER_SLOT = 1

#: Group-to-node assignments enumerated exhaustively up to this many.
_MAX_ASSIGNMENTS = 50_000


class ExpertMoves(NamedTuple):
    """The copies a transfer engine makes to go from the old plan to the new one.

    One entry per move, sorted by layer then slot; all arrays ``int64`` of the same length.

    Attributes
    ----------
    layer : ndarray
        Layer of the move.
    gpu : ndarray
        Destination GPU (``slot // S``).
    slot : ndarray
        Physical slot (column of ``phy2log``) that receives the expert.
    new_expert : ndarray
        Logical expert copied into the slot.
    old_expert : ndarray
        Logical expert the slot held in the old plan (the replica it replaces).
    source_gpu : ndarray
        A GPU that holds ``new_expert`` under the old plan: one that keeps it in the new plan if
        any, then one on the destination's node, lowest index among equals; ``-1`` if none.
    """

    layer: np.ndarray
    gpu: np.ndarray
    slot: np.ndarray
    new_expert: np.ndarray
    old_expert: np.ndarray
    source_gpu: np.ndarray


class ReplanResult(NamedTuple):
    """Result of :func:`replan_experts`.

    Attributes
    ----------
    plan : EplbPlan
        The new plan (torch tensors when ``weight`` was one).
    moves : ExpertMoves
        The moves, ``len(moves.slot) == num_moves.sum()``.
    num_moves : ndarray of int64, shape (layers,)
        Moves per layer.
    moe_lb : ndarray of float64, shape (layers,)
        ``moe_lb`` of the new plan under the new loads.
    previous_moe_lb : ndarray of float64, shape (layers,)
        ``moe_lb`` of the old plan under the new loads (what keeping it would give).
    regrouped : ndarray of bool, shape (layers,)
        Layers whose group-to-node assignment changed (hierarchical policy).
    """

    plan: EplbPlan
    moves: ExpertMoves
    num_moves: np.ndarray
    moe_lb: np.ndarray
    previous_moe_lb: np.ndarray
    regrouped: np.ndarray


class ReplanTradeoff(NamedTuple):
    """Moves against balance over total budgets (:func:`replan_tradeoff`); arrays of one length.

    Attributes
    ----------
    max_moves_total : ndarray of int64
        Total budget.
    num_moves : ndarray of int64
        Moves made (at most the budget).
    mean_moe_lb, worst_moe_lb : ndarray of float64
        Mean and largest ``moe_lb`` over layers under the new loads.
    """

    max_moves_total: np.ndarray
    num_moves: np.ndarray
    mean_moe_lb: np.ndarray
    worst_moe_lb: np.ndarray


class _Replan(NamedTuple):
    problem: Problem
    previous: np.ndarray  # (layers, R) int64
    budget: np.ndarray  # (layers,) int64
    total: int | None
    tolerance: float
    scope: str  # "mean" or "layer"
    regroup_tolerance: float
    num_groups: int  # as given (the problem holds (1, 1) under the global policy)
    num_nodes: int


def _replan_iv(
    weight: Any,
    previous_phy2log: Any,
    num_replicas: Any,
    num_groups: Any,
    num_nodes: Any,
    num_gpus: Any,
    policy: Any,
    max_moves: Any,
    max_moves_total: Any,
    tolerance: Any,
    regroup_tolerance: Any,
    tolerance_scope: Any = "mean",
) -> _Replan:
    problem = _rebalance_iv(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    layers, experts = problem.weight.shape
    slots = problem.num_replicas
    prev = as_int_array(previous_phy2log, "previous_phy2log", ndim=2)
    if prev.shape != (layers, slots):
        raise ValueError(
            f"previous_phy2log: must have shape (layers, num_replicas) = ({layers}, {slots}), "
            f"got {prev.shape}"
        )
    if prev.min() < 0 or prev.max() >= experts:
        bad = np.argwhere((prev < 0) | (prev >= experts))[0]
        raise ValueError(
            f"previous_phy2log: slots must name experts in [0, {experts}) (layer {bad[0]}, slot "
            f"{bad[1]} holds {prev[bad[0], bad[1]]})"
        )
    held = np.zeros((layers, experts), dtype=np.int64)
    np.add.at(held, (np.repeat(np.arange(layers), slots), prev.ravel()), 1)
    if (held == 0).any():
        layer, expert = (int(i) for i in np.argwhere(held == 0)[0])
        raise ValueError(
            f"previous_phy2log: every expert needs a replica (layer {layer} has none of expert "
            f"{expert})"
        )
    if problem.hierarchical:
        _old_partition(prev, experts, int(num_groups), int(num_nodes))  # raises if invalid
    if max_moves is None:
        budget = np.full(layers, slots, dtype=np.int64)
    elif np.ndim(max_moves) == 0:
        budget = np.full(layers, check_int(max_moves, "max_moves", min_value=0), dtype=np.int64)
    else:
        budget = as_int_array(max_moves, "max_moves", shape=(layers,), min_value=0)
    budget = np.minimum(budget, slots)
    total = None
    if max_moves_total is not None:
        total = check_int(max_moves_total, "max_moves_total", min_value=0)
    tolerance = check_real(tolerance, "tolerance", min_value=0.0)
    regroup_tolerance = check_real(regroup_tolerance, "regroup_tolerance", min_value=0.0)
    scope = check_choice(tolerance_scope, "tolerance_scope", TOLERANCE_SCOPES)
    return _Replan(
        problem,
        prev,
        budget,
        total,
        tolerance,
        scope,
        regroup_tolerance,
        int(num_groups),
        int(num_nodes),
    )


def _old_partition(prev: np.ndarray, experts: int, num_groups: int, num_nodes: int) -> np.ndarray:
    """Node of every group in every layer of a hierarchical plan, ``(layers, num_groups)``."""
    layers, slots = prev.shape
    node_of_slot = np.arange(slots) // (slots // num_nodes)
    group = prev // (experts // num_groups)
    lo = np.full((layers, num_groups), num_nodes, dtype=np.int64)
    hi = np.full((layers, num_groups), -1, dtype=np.int64)
    rows = np.repeat(np.arange(layers), slots)
    np.minimum.at(lo, (rows, group.ravel()), np.tile(node_of_slot, layers))
    np.maximum.at(hi, (rows, group.ravel()), np.tile(node_of_slot, layers))
    if (lo != hi).any():
        layer, g = (int(i) for i in np.argwhere(lo != hi)[0])
        raise ValueError(
            "previous_phy2log: the hierarchical policy keeps every group on one node, but group "
            f"{g} of layer {layer} has replicas on nodes {lo[layer, g]} and {hi[layer, g]}"
        )
    per = num_groups // num_nodes
    for layer in range(layers):
        counts = np.bincount(lo[layer], minlength=num_nodes)
        if (counts != per).any():
            raise ValueError(
                f"previous_phy2log: the hierarchical policy puts {per} groups on each node, "
                f"layer {layer} has {counts.tolist()}"
            )
    return lo


_ASSIGNMENT_CACHE: dict[tuple[int, int], np.ndarray] = {}


def _all_assignments(num_groups: int, num_nodes: int) -> np.ndarray | None:
    """Every labelled assignment of groups to nodes with equal counts, in lexicographic order,
    or ``None`` if there are more than :data:`_MAX_ASSIGNMENTS`.

    Built prefix by prefix (every prefix extended by every node with room left, which keeps
    the lexicographic order), so the work is O(count × num_groups × num_nodes) for the
    ``count = num_groups! / (num_groups / num_nodes)!^num_nodes`` assignments, not the
    ``num_groups!`` of enumerating permutations and dropping repeats.
    """
    per = num_groups // num_nodes
    count = math.factorial(num_groups) // math.factorial(per) ** num_nodes
    if count > _MAX_ASSIGNMENTS:
        return None
    key = (num_groups, num_nodes)
    if key not in _ASSIGNMENT_CACHE:
        prefix = np.zeros((1, 0), dtype=np.int64)
        room = np.full((1, num_nodes), per, dtype=np.int64)
        for _ in range(num_groups):
            row, node = np.nonzero(room > 0)  # row-major: children of a prefix by node
            prefix = np.column_stack([prefix[row], node])
            room = room[row]
            room[np.arange(len(row)), node] -= 1
        _ASSIGNMENT_CACHE[key] = prefix
    return _ASSIGNMENT_CACHE[key]


def _choose_partition(
    group_load: np.ndarray, old: np.ndarray, num_nodes: int, regroup_tolerance: float
) -> np.ndarray:
    """Group-to-node assignment of one layer by the rule of the module docstring."""
    if len(group_load) == num_nodes:  # one group per node: every assignment is as good
        return old.copy()
    cands = _all_assignments(len(group_load), num_nodes)
    if cands is None:  # exchanges of two groups from the old assignment, steepest descent
        cands = [old.copy()]
        cur = old.copy()
        while True:
            loads = np.bincount(cur, weights=group_load, minlength=num_nodes)
            best, best_v = None, loads.max()
            for a, b in itertools.combinations(range(len(cur)), 2):
                if cur[a] == cur[b]:
                    continue
                trial = cur.copy()
                trial[a], trial[b] = cur[b], cur[a]
                v = np.bincount(trial, weights=group_load, minlength=num_nodes).max()
                if v < best_v * (1 - 1e-12):
                    best, best_v = trial, v
            if best is None:
                break
            cur = best
            cands.append(cur.copy())
        cands = np.array(cands)
    onehot = cands[:, :, None] == np.arange(num_nodes)[None, None, :]
    node_load = np.einsum("akn,k->an", onehot, group_load)
    top = node_load.max(axis=1)
    moved = (cands != old[None, :]).sum(axis=1)
    ok = top <= top.min() * (1.0 + regroup_tolerance) + 1e-12 * max(top.min(), 1.0)
    order = np.lexsort((np.arange(len(cands)), top, np.where(ok, moved, np.iinfo(np.int64).max)))
    return cands[order[0]]


def _place(prev_gpu: np.ndarray, new_multiset: np.ndarray) -> np.ndarray:
    """Slots of one GPU: kept replicas stay in their slots, new ones fill the others (lowest
    slot first, experts in increasing order)."""
    out = np.full_like(prev_gpu, -1)
    want = {}
    for e in new_multiset.tolist():
        want[e] = want.get(e, 0) + 1
    for i, e in enumerate(prev_gpu.tolist()):
        if want.get(e, 0) > 0:
            out[i] = e
            want[e] -= 1
    rest = sorted(itertools.chain.from_iterable([e] * k for e, k in want.items() if k > 0))
    out[out < 0] = rest
    return out


def _replan_layer(
    w: np.ndarray,
    prev: np.ndarray,
    node_of_group: np.ndarray | None,
    node_bound: np.ndarray,
    fresh_max: float,
    args: _Replan,
    tol: float,
    budget: int,
) -> tuple[np.ndarray, int]:
    """Re-plan one layer with the given partition at per-layer tolerance ``tol``; returns
    ``(phy2log row, moves)``.

    ``moves > budget`` means the budget cannot even pay for the replicas the partition forces.
    """
    p = args.problem
    experts, slots = w.shape[0], p.num_replicas
    nodes = 1 if node_of_group is None else args.num_nodes
    g_per_node = p.num_gpus // nodes
    per_gpu = slots // p.num_gpus
    phy_per_node = slots // nodes
    target = max(float(node_bound.max()), fresh_max) * (1.0 + tol)
    group_size = experts // (1 if node_of_group is None else args.num_groups)
    new = np.empty(slots, dtype=np.int64)
    jobs = []
    for n in range(nodes):
        if node_of_group is None:
            local2log = np.arange(experts)
        else:
            groups = np.flatnonzero(node_of_group == n)
            local2log = (groups[:, None] * group_size + np.arange(group_size)).ravel()
        log2local = np.full(experts, -1, dtype=np.int64)
        log2local[local2log] = np.arange(len(local2log))
        seg = prev[n * phy_per_node : (n + 1) * phy_per_node]
        old_exp = log2local[seg].reshape(g_per_node, per_gpu)
        wl = w[local2log]
        size = wl / np.maximum(np.bincount(old_exp[old_exp >= 0], minlength=len(wl)), 1)
        stale = np.where(old_exp >= 0, size[np.maximum(old_exp, 0)], np.inf).sum(axis=1).max()
        jobs.append((stale / target, n, local2log, old_exp, wl))
    left = budget
    total = 0
    for _, n, local2log, old_exp, wl in sorted(jobs, key=lambda j: (-j[0], j[1])):
        out = np.empty_like(old_exp)
        steps = _MAX_STEPS_PER_SLOT * old_exp.size + 8
        used = _replan_kernels.replan_subproblem(wl, old_exp, target, left, steps, out)
        if used > left:
            return prev.copy(), budget + 1
        left -= used
        total += used
        seg = slice(n * phy_per_node, (n + 1) * phy_per_node)
        placed = np.empty_like(out)
        _replan_kernels.place_slots(prev[seg].reshape(g_per_node, per_gpu), local2log[out], placed)
        new[seg] = placed.ravel()
    return new, total


def _node_bounds(w: np.ndarray, partitions: np.ndarray | None, args: _Replan) -> np.ndarray:
    """Absolute lower bound on the largest GPU load of every sub-problem, ``(layers, nodes)``."""
    p = args.problem
    layers, experts = w.shape
    if partitions is None:
        lb = lower_bound(w, p.num_replicas, 1, 1, p.num_gpus, policy="global")
        return (lb * w.sum(axis=1) / p.num_gpus)[:, None]
    nodes, groups = args.num_nodes, args.num_groups
    group_size = experts // groups
    rows = []
    for layer in range(layers):
        for n in range(nodes):
            g = np.flatnonzero(partitions[layer] == n)
            rows.append(w[layer, (g[:, None] * group_size + np.arange(group_size)).ravel()])
    wn = np.array(rows)
    gpn = p.num_gpus // nodes
    lb = lower_bound(wn, p.num_replicas // nodes, 1, 1, gpn, policy="global")
    return (lb * wn.sum(axis=1) / gpn).reshape(layers, nodes)


class _Context(NamedTuple):
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
    memo: dict[tuple[int, float, int], tuple[np.ndarray, int, bool]]  # _replan_one's results


def _context(args: _Replan) -> _Context:
    p = args.problem
    w, prev = p.weight, args.previous
    layers, experts = w.shape
    partitions = old_parts = fresh_parts = fresh_bounds = None
    if p.hierarchical:
        old_parts = _old_partition(prev, experts, args.num_groups, args.num_nodes)
        group_load = w.reshape(layers, args.num_groups, -1).sum(axis=2)
        partitions = np.array(
            [
                _choose_partition(
                    group_load[i], old_parts[i], args.num_nodes, args.regroup_tolerance
                )
                for i in range(layers)
            ]
        )
    policy = "hierarchical" if p.hierarchical else "global"
    fresh = rebalance_experts(
        w, p.num_replicas, args.num_groups, args.num_nodes, p.num_gpus, policy=policy
    ).phy2log
    fresh_lb = moe_lb(w, fresh, num_gpus=p.num_gpus)
    bounds = _node_bounds(w, partitions, args)
    old_bounds = bounds
    if p.hierarchical:
        old_bounds = _node_bounds(w, old_parts, args)
        fresh_parts = _old_partition(fresh, experts, args.num_groups, args.num_nodes)
        fresh_bounds = _node_bounds(w, fresh_parts, args)
    return _Context(
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


def _row_lb(w: np.ndarray, row: np.ndarray, num_gpus: int) -> float:
    """``moe_lb`` of one layer's ``phy2log`` row (the arithmetic of :func:`moe_lb`, without
    its validation: called for every candidate)."""
    cnt = np.bincount(row, minlength=len(w)).astype(np.float64)
    load = (w[row] / cnt[row]).reshape(num_gpus, -1).sum(axis=1)
    mean = load.mean()
    return float(load.max() / mean) if mean > 0 else 1.0


def _row_max(w: np.ndarray, row: np.ndarray, num_gpus: int) -> float:
    """Largest GPU load of one layer's ``phy2log`` row."""
    cnt = np.bincount(row, minlength=len(w))
    return float((w[row] / cnt[row]).reshape(num_gpus, -1).sum(axis=1).max())


def _replan_one(
    args: _Replan, ctx: _Context, layer: int, tol: float, budget: int
) -> tuple[np.ndarray, int, bool]:
    """Re-plan one layer at per-layer tolerance ``tol``: ``(row, moves, regrouped)``; the old
    row with zero moves unless the result is strictly better than keeping it. Memoised in
    ``ctx.memo`` (the total-budget mode asks for some results twice)."""
    key = (layer, tol, budget)
    if key not in ctx.memo:
        ctx.memo[key] = _replan_one_uncached(args, ctx, layer, tol, budget)
    row, used, regrouped = ctx.memo[key]
    return row.copy(), used, regrouped


def _replan_one_uncached(
    args: _Replan, ctx: _Context, layer: int, tol: float, budget: int
) -> tuple[np.ndarray, int, bool]:
    p = args.problem
    w, prev = p.weight[layer], args.previous[layer]
    fresh_max = float(ctx.fresh_max[layer])
    if ctx.old_lb[layer] <= ctx.fresh_lb[layer] * (1.0 + tol):
        return prev.copy(), 0, False  # the old plan is as good as a fresh one: nothing to move
    part = None if ctx.partitions is None else ctx.partitions[layer]
    row, used = _replan_layer(w, prev, part, ctx.bounds[layer], fresh_max, args, tol, budget)
    if used > budget and part is not None:
        part = ctx.old_parts[layer]
        row, used = _replan_layer(
            w, prev, part, ctx.old_bounds[layer], fresh_max, args, tol, budget
        )
    if used > budget:
        row, used = prev.copy(), 0
    if part is not None and not np.array_equal(part, ctx.fresh_parts[layer]):
        # Short of the fresh plan's balance: try the fresh plan's group-to-node assignment.
        lb_row = _row_max(w, row, p.num_gpus)
        if lb_row > fresh_max * (1.0 + tol) * (1.0 + 1e-9):
            fp = ctx.fresh_parts[layer]
            row2, used2 = _replan_layer(
                w, prev, fp, ctx.fresh_bounds[layer], fresh_max, args, tol, budget
            )
            if used2 <= budget and _row_max(w, row2, p.num_gpus) < lb_row * (1.0 - tol):
                row, used, part = row2, used2, fp
    # Never worse than keeping the old plan, and strictly better if anything moves.
    new_lb = _row_lb(w, row, p.num_gpus)
    old_lb = ctx.old_lb[layer]
    if new_lb > old_lb or (used > 0 and new_lb >= old_lb * (1.0 - 1e-12)):
        return prev.copy(), 0, False
    regrouped = part is not None and not np.array_equal(part, ctx.old_parts[layer])
    return row, used, bool(regrouped)


def _replan_all(
    args: _Replan, budgets: np.ndarray, ctx: _Context | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-plan every layer at the per-layer tolerance: ``(phy2log, moves, regrouped)``."""
    ctx = _context(args) if ctx is None else ctx
    layers = args.previous.shape[0]
    phy2log = args.previous.copy()
    moves = np.zeros(layers, dtype=np.int64)
    regrouped = np.zeros(layers, dtype=bool)
    for layer in range(layers):
        phy2log[layer], moves[layer], regrouped[layer] = _replan_one(
            args, ctx, layer, args.tolerance, int(budgets[layer])
        )
    return phy2log, moves, regrouped


def _gpu_counts(row: np.ndarray, num_gpus: int, experts: int) -> np.ndarray:
    """Replicas of every expert on every GPU of one layer, ``(num_gpus, experts)``."""
    out = np.zeros((num_gpus, experts), dtype=np.int64)
    np.add.at(out, (np.arange(len(row)) // (len(row) // num_gpus), row), 1)
    return out


def _matched_fresh(prev: np.ndarray, fresh: np.ndarray, args: _Replan) -> tuple[np.ndarray, int]:
    """The fresh plan's row with its GPUs (and, hierarchical, nodes) relabelled to keep the most
    replicas of the old row in place (an assignment problem); ``(row, moves)``."""
    from scipy.optimize import linear_sum_assignment  # here: importing lbkit.eplb stays light

    p = args.problem
    experts, gpus = p.weight.shape[1], p.num_gpus
    per = len(prev) // gpus
    nodes = args.num_nodes if p.hierarchical else 1
    gpn = gpus // nodes
    a, b = _gpu_counts(prev, gpus, experts), _gpu_counts(fresh, gpus, experts)
    keep = np.minimum(a[:, None, :], b[None, :, :]).sum(axis=2)  # (old GPU, fresh GPU)
    node_keep = keep.reshape(nodes, gpn, nodes, gpn).sum(axis=(1, 3))
    _, node_of = linear_sum_assignment(-node_keep)  # fresh node given to each old node
    row = np.empty_like(prev)
    for n in range(nodes):
        m = int(node_of[n])
        sub = keep[n * gpn : (n + 1) * gpn, m * gpn : (m + 1) * gpn]
        _, gpu_of = linear_sum_assignment(-sub)
        for i in range(gpn):
            g, f = n * gpn + i, m * gpn + int(gpu_of[i])
            row[g * per : (g + 1) * per] = _place(
                prev[g * per : (g + 1) * per], fresh[f * per : (f + 1) * per]
            )
    moves = int(np.maximum(_gpu_counts(row, gpus, experts) - a, 0).sum())
    return row, moves


def _select(moves: np.ndarray, lb: np.ndarray, cap: float, limit: int | None = None) -> np.ndarray:
    """Exact choice of one candidate per layer with at most ``limit`` total moves (default: no
    limit): the fewest total moves such that ``sum(lb) <= cap``, then the smallest ``sum(lb)``;
    the choice with the smallest ``sum(lb)`` (then fewest moves) if none fits. ``moves`` (int)
    and ``lb`` are ``(layers, C)``; ``lb = inf`` marks a missing candidate, and some candidate
    of every layer must have at most ``limit`` moves (column 0 has zero moves in every
    caller). Dynamic programme over the total moves (a multiple-choice knapsack); ties: lowest
    candidate index.

    Runtime complexity: O(layers × C × min(limit, total moves of the largest candidates)).
    """
    layers, width = lb.shape
    ok = np.isfinite(lb)
    m = np.where(ok, moves, 0).astype(np.int64)
    top = int(np.where(ok, m, 0).max(axis=1).sum())
    if limit is not None:
        ok &= m <= limit
        top = min(top, int(limit))
    best = np.zeros(top + 1)  # best[t]: smallest sum of lb with exactly t moves so far
    best[1:] = np.inf
    arg = np.zeros((layers, top + 1), dtype=np.int16)  # candidate index
    for i in range(layers):
        nxt = np.full(top + 1, np.inf)
        for c in range(width):
            if not ok[i, c]:
                continue
            k = int(m[i, c])
            cand = np.full(top + 1, np.inf)
            cand[k:] = best[: top + 1 - k] + lb[i, c]
            better = cand < nxt
            nxt[better] = cand[better]
            arg[i, better] = c
        best = nxt
    fits = np.flatnonzero(best <= cap)
    t = int(fits[0]) if len(fits) else int(np.argmin(best))
    choice = np.empty(layers, dtype=np.int64)
    for i in range(layers - 1, -1, -1):
        choice[i] = arg[i, t]
        t -= int(m[i, choice[i]])
    return choice


#: Per-layer tolerances tried in the mean mode, as multiples of ``tolerance``. A layer's moves
#: fall in steps as its tolerance loosens, and the choice over layers can only use the steps it
#: is shown: twelve levels instead of five (0.5, 0.75, 1, 1.4, 2) cut the moves by 2-4% (288
#: slots / 32 GPUs, drift 0.05-0.1, seeds 1-5) for about twice the time.
_LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.6, 2.0)

#: One candidate of one layer: ``(moves, moe_lb, phy2log row, regrouped)``.
_Candidate = tuple[int, float, np.ndarray, bool]


def _mean_candidates(
    args: _Replan, ctx: _Context, tolerance: float, budgets: np.ndarray
) -> list[list[_Candidate]]:
    """Candidates of every layer in the mean mode at ``tolerance`` (module docstring): the old
    row first, the matched fresh plan, then the re-plans at the per-layer levels."""
    p = args.problem
    prev = args.previous
    layers = prev.shape[0]
    levels = sorted({tolerance * f for f in _LEVELS}, reverse=True)  # loose first
    cands: list[list[_Candidate]] = []
    for layer in range(layers):
        budget = int(budgets[layer])
        w = p.weight[layer]
        opts: list[_Candidate] = [(0, float(ctx.old_lb[layer]), prev[layer], False)]
        if ctx.old_lb[layer] > ctx.fresh_lb[layer] * (1.0 + min(levels)):
            row, used = _matched_fresh(prev[layer], ctx.fresh[layer], args)
            if used <= budget:
                f_lb = _row_lb(w, row, p.num_gpus)
                parts = ctx.old_parts
                regroup = parts is not None and not np.array_equal(
                    _old_partition(row[None, :], len(w), args.num_groups, args.num_nodes)[0],
                    parts[layer],
                )
                opts.append((used, f_lb, row, bool(regroup)))
        reached = np.inf
        for tol in levels:
            if reached <= ctx.fresh_lb[layer] * (1.0 + tol) * (1.0 + 1e-12):
                continue  # a looser level's result already meets this one
            row, used, regroup = _replan_one(args, ctx, layer, tol, budget)
            v = _row_lb(w, row, p.num_gpus)
            reached = min(reached, v)
            if used > 0:
                opts.append((used, v, row, regroup))
        cands.append(opts)
    return cands


def _choose(
    cands: list[list[_Candidate]], cap: float, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One candidate per layer by :func:`_select`: ``(phy2log, moves, regrouped)``."""
    layers = len(cands)
    width = max(len(c) for c in cands)
    m = np.zeros((layers, width), dtype=np.int64)
    v = np.full((layers, width), np.inf)
    for i, opts in enumerate(cands):
        for j, (used, lb, _, _) in enumerate(opts):
            m[i, j], v[i, j] = used, lb
    choice = _select(m, v, cap, limit)
    phy2log = np.stack([cands[i][choice[i]][2] for i in range(layers)])
    regrouped = np.array([cands[i][choice[i]][3] for i in range(layers)], dtype=bool)
    return phy2log, m[np.arange(layers), choice], regrouped


def _replan_mean(args: _Replan, budgets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean mode: candidates per layer, then the fewest moves with the mean ``moe_lb`` within
    ``tolerance`` of the fresh plan's (module docstring)."""
    ctx = _context(args)
    cands = _mean_candidates(args, ctx, args.tolerance, budgets)
    return _choose(cands, float(ctx.fresh_lb.sum()) * (1.0 + args.tolerance))


def _budget_ladder(limit: int) -> list[int]:
    out = {0, limit}
    b = 1.0
    while b < limit:
        out.add(int(b))
        b *= 1.5
    return sorted(out)


def _replan_total(args: _Replan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-plan under the total budget ``args.total`` (module docstring). The candidates do not
    depend on the total, so that (mean scope) a larger total never gives a mean ``moe_lb``
    above both a smaller total's and the tolerance target, and never above both the default
    re-plan's (when its moves fit) and the target."""
    p = args.problem
    ctx = _context(args)
    layers = p.weight.shape[0]
    cap = float(ctx.fresh_lb.sum()) * (1.0 + args.tolerance)
    first = _replan_all(args, args.budget, ctx)
    if args.scope == "mean":
        cands = _mean_candidates(args, ctx, args.tolerance, args.budget)
    elif first[1].sum() <= args.total:
        return first
    else:
        cands = [[(0, float(ctx.old_lb[i]), args.previous[i], False)] for i in range(layers)]
    if args.tolerance != DEFAULT_TOLERANCE or args.scope != "mean":
        # The default re-plan's candidates: never worse than the default when it fits.
        extra = _mean_candidates(args, ctx, DEFAULT_TOLERANCE, args.budget)
        for opts, more in zip(cands, extra, strict=True):
            opts.extend(more[1:])
    ladders = [[b for b in _budget_ladder(int(first[1][i])) if b > 0] or [0] for i in range(layers)]
    runs = [first]
    for k in range(max(len(lad) for lad in ladders)):
        b = np.array([lad[min(k, len(lad) - 1)] for lad in ladders], dtype=np.int64)
        runs.append(_replan_all(args, b, ctx))
    for run in runs:
        for i in range(layers):
            if run[1][i] > 0:
                v = float(moe_lb(p.weight[i : i + 1], run[0][i : i + 1], num_gpus=p.num_gpus)[0])
                cands[i].append((int(run[1][i]), v, run[0][i], bool(run[2][i])))
    if args.scope != "mean":
        cap = -np.inf  # layer scope: the lowest mean within the total
    return _choose(cands, cap, args.total)


def _moves_list(prev: np.ndarray, new: np.ndarray, num_gpus: int, num_nodes: int) -> ExpertMoves:
    slots = prev.shape[1]
    per_gpu = slots // num_gpus
    gpus_per_node = num_gpus // max(num_nodes, 1)
    layer_idx, slot_idx = np.nonzero(prev != new)
    src = np.full(len(slot_idx), -1, dtype=np.int64)
    for k, (layer, s) in enumerate(zip(layer_idx.tolist(), slot_idx.tolist(), strict=True)):
        e = new[layer, s]
        old_gpus = np.unique(np.flatnonzero(prev[layer] == e) // per_gpu)
        if len(old_gpus) == 0:
            continue
        keeps = np.isin(old_gpus, np.flatnonzero(new[layer] == e) // per_gpu)
        dest_node = (s // per_gpu) // gpus_per_node
        same = old_gpus // gpus_per_node == dest_node
        src[k] = old_gpus[np.lexsort((old_gpus, ~same, ~keeps))[0]]
    return ExpertMoves(
        layer_idx.astype(np.int64),
        (slot_idx // per_gpu).astype(np.int64),
        slot_idx.astype(np.int64),
        new[layer_idx, slot_idx],
        prev[layer_idx, slot_idx],
        src,
    )


def replan_experts(
    weight: Any,
    previous_phy2log: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    policy: str | None = None,
    max_moves: Any = None,
    max_moves_total: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    tolerance_scope: str = "mean",
    regroup_tolerance: float = DEFAULT_REGROUP_TOLERANCE,
) -> ReplanResult:
    """Plan replicas for new loads starting from ``previous_phy2log``, moving few replicas.

    Parameters
    ----------
    weight : array_like or torch.Tensor, shape (layers, experts)
        New load of each logical expert, as in :func:`lbkit.eplb.rebalance_experts`.
    previous_phy2log : array_like of int, shape (layers, num_replicas)
        The plan in service: expert held by each physical slot. Every expert must have a slot in
        every layer; under the hierarchical policy every group must sit on one node with
        ``num_groups / num_nodes`` groups per node.
    num_replicas, num_groups, num_nodes, num_gpus : int
        As in :func:`lbkit.eplb.rebalance_experts` (same validation and policy rule).
    policy : {None, "global", "hierarchical"}
        As in :func:`lbkit.eplb.rebalance_experts`.
    max_moves : int or array_like of int, shape (layers,), optional
        Moves allowed per layer (default: unlimited). ``0`` keeps the old plan.
    max_moves_total : int, optional
        Moves allowed over all layers (default: unlimited); combined with ``max_moves``. The
        fewest moves reaching the tolerance target within it, else the lowest mean ``moe_lb``
        within it (module docstring); never worse than the default re-plan when that one fits.
    tolerance : float, default :data:`DEFAULT_TOLERANCE`
        Relative gap to a fresh default plan on the new loads that the re-plan may keep: of
        the mean ``moe_lb`` over layers (``tolerance_scope="mean"``), or the per-layer target
        of every sub-problem, ``max(lower bound, fresh plan)`` (``"layer"``; module docstring).
    tolerance_scope : {"mean", "layer"}, default "mean"
        ``"mean"``: fewest moves with ``mean(moe_lb) <= (1 + tolerance) * mean(fresh moe_lb)``
        (guaranteed unless ``max_moves`` excludes the fresh plan for a layer); ``"layer"``:
        one re-plan per layer at the tolerance (three to eleven times faster, more moves).
    regroup_tolerance : float, default :data:`DEFAULT_REGROUP_TOLERANCE`
        Hierarchical policy: node balance given up to keep groups on their nodes (module
        docstring).

    Returns
    -------
    ReplanResult
        ``plan`` (a valid placement), ``moves`` (one entry per move; applying them to the old
        plan gives the new one, see :func:`apply_moves`), ``num_moves``, ``moe_lb`` and
        ``previous_moe_lb`` per layer, ``regrouped``. Per layer, ``moe_lb <=
        previous_moe_lb`` (strictly where replicas move), ``num_moves <= max_moves`` and the
        sum is at most ``max_moves_total``.

    Raises
    ------
    TypeError
        Non-numeric arrays or non-integer sizes or budgets.
    ValueError
        Everything :func:`lbkit.eplb.rebalance_experts` rejects; ``previous_phy2log`` of the
        wrong shape, naming unknown experts, missing an expert or (hierarchical) splitting a
        group across nodes; negative budgets or tolerances; an unknown ``tolerance_scope``.

    Runtime complexity: O(layers × (lower bound + C × G² × S² + U × R × (E + R))) for ``C``
    exchange cycles of ``G`` GPUs of ``S`` slots, and ``U`` descent steps (only where the cycles
    fall short) over ``R`` slots and ``E`` experts per sub-problem, times
    the twelve per-layer tolerances in the mean scope, plus O(layers × 14 × total moves) for
    the choice; with ``max_moves_total``, the mean scope twice (at ``tolerance`` and the
    default) plus about ``log1.5(moves per layer)`` times the layer scope.

    Examples
    --------
    >>> import numpy as np
    >>> from lbkit.eplb import rebalance_experts, synthetic_expert_load, drift
    >>> w = synthetic_expert_load(4, 64, rng=0)
    >>> old = rebalance_experts(w, 80, 8, 2, 16, policy="global")
    >>> new_w = drift(w, sigma=0.1, rng=1)
    >>> r = replan_experts(new_w, old.phy2log, 80, 8, 2, 16, policy="global")
    >>> bool((r.moe_lb <= r.previous_moe_lb).all()), int(r.num_moves.sum()) < 4 * 80 // 4
    (True, True)
    >>> fresh = rebalance_experts(new_w, 80, 8, 2, 16, policy="global").phy2log
    >>> bool(r.moe_lb.mean() <= 1.01 * moe_lb(new_w, fresh, num_gpus=16).mean())
    True
    >>> bool(np.array_equal(apply_moves(old.phy2log, r.moves), r.plan.phy2log))
    True
    """
    args = _replan_iv(
        weight,
        previous_phy2log,
        num_replicas,
        num_groups,
        num_nodes,
        num_gpus,
        policy,
        max_moves,
        max_moves_total,
        tolerance,
        regroup_tolerance,
        tolerance_scope,
    )
    p = args.problem
    if args.total is not None:
        phy2log, moves, regrouped = _replan_total(args)
    elif args.scope == "mean":
        phy2log, moves, regrouped = _replan_mean(args, args.budget)
    else:
        phy2log, moves, regrouped = _replan_all(args, args.budget)
    logcnt = np.zeros_like(p.weight, dtype=np.int64)
    layers, slots = phy2log.shape
    np.add.at(logcnt, (np.repeat(np.arange(layers), slots), phy2log.ravel()), 1)
    plan = _finish_plan(p, phy2log, logcnt)
    return ReplanResult(
        plan,
        _moves_list(args.previous, phy2log, p.num_gpus, args.num_nodes),
        moves,
        moe_lb(p.weight, phy2log, num_gpus=p.num_gpus),
        moe_lb(p.weight, args.previous, num_gpus=p.num_gpus),
        regrouped,
    )


def apply_moves(previous_phy2log: Any, moves: ExpertMoves, /) -> np.ndarray:
    """Apply a move list to the old ``phy2log`` (a transfer engine's job, for checking).

    Raises ``ValueError`` when a move's ``old_expert`` is not what the slot holds.

    Examples
    --------
    >>> moves = ExpertMoves(*(np.array([v]) for v in (0, 1, 2, 0, 1, 0)))
    >>> apply_moves([[0, 1, 1, 1]], moves)
    array([[0, 1, 0, 1]])
    """
    out = as_int_array(previous_phy2log, "previous_phy2log", ndim=2).copy()
    if len(moves.layer) and (out[moves.layer, moves.slot] != moves.old_expert).any():
        raise ValueError("moves: old_expert must be what previous_phy2log holds in the slot")
    out[moves.layer, moves.slot] = moves.new_expert
    return out


def replan_tradeoff(
    weight: Any,
    previous_phy2log: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    fractions: Any = (0.0, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
    policy: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    tolerance_scope: str = "mean",
    regroup_tolerance: float = DEFAULT_REGROUP_TOLERANCE,
) -> ReplanTradeoff:
    """Moves against balance: :func:`replan_experts` at total budgets of ``fractions`` of all
    replicas (``layers × num_replicas``).

    Runtime complexity: ``len(fractions)`` calls of :func:`replan_experts` with a total budget.

    Examples
    --------
    >>> from lbkit.eplb import rebalance_experts, synthetic_expert_load, drift
    >>> w = synthetic_expert_load(4, 64, rng=0)
    >>> old = rebalance_experts(w, 80, 8, 2, 16, policy="global").phy2log
    >>> t = replan_tradeoff(drift(w, sigma=0.3, rng=1), old, 80, 8, 2, 16, policy="global",
    ...                     fractions=(0.0, 0.05, 1.0))
    >>> int(t.num_moves[0]), bool(t.mean_moe_lb[2] <= t.mean_moe_lb[0])
    (0, True)
    """
    rows = []
    layers = np.shape(previous_phy2log)[0] if np.ndim(previous_phy2log) == 2 else 0
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.ndim != 1 or len(fr) == 0 or (fr < 0).any() or not np.isfinite(fr).all():
        raise ValueError("fractions: must be a non-empty 1-D sequence of non-negative numbers")
    for f in fr.tolist():
        total = math.floor(f * layers * int(num_replicas))
        r = replan_experts(
            weight,
            previous_phy2log,
            num_replicas,
            num_groups,
            num_nodes,
            num_gpus,
            policy=policy,
            max_moves_total=total,
            tolerance=tolerance,
            tolerance_scope=tolerance_scope,
            regroup_tolerance=regroup_tolerance,
        )
        rows.append((total, int(r.num_moves.sum()), float(r.moe_lb.mean()), float(r.moe_lb.max())))
    cols = list(zip(*rows, strict=True))
    return ReplanTradeoff(
        np.array(cols[0], dtype=np.int64),
        np.array(cols[1], dtype=np.int64),
        np.array(cols[2]),
        np.array(cols[3]),
    )
