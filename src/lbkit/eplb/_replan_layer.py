"""Re-planning of one layer with few expert moves: the sub-problem kernel and its wrapper.

:func:`replan_layer` (Python) cuts a layer into sub-problems (the layer under the global
policy, each node of it under the hierarchical one), maps the old plan into each and calls
:func:`replan_subproblem` (numba) on clean arrays; :func:`place_slots` then keeps unchanged
replicas in their slots. The steps of a sub-problem live beside it: exchange cycles in
``_replan_cycles.py``, the excess descent in ``_replan_descent.py``, the local search and the
give-back in ``_replan_local.py``, the move accounting in ``_primitives.py``.

Vocabulary: a *sub-problem* has ``E`` local experts with loads ``w``, ``G`` GPUs of ``S`` slots.
``old_exp[g, i]`` is the local expert the previous plan put in slot ``i`` of GPU ``g``, or ``-1``
when that expert now belongs to another sub-problem. A *move* is a replica that a GPU holds in
the new plan and did not hold in the old one (counted with multiplicity): ``sum_{g, e} max(0,
new[g, e] - old[g, e])``. Kernels take ``float64`` loads and ``int64`` indices, also run with
``NUMBA_DISABLE_JIT=1``; ties: the lowest index wins, sorts are stable.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lbkit.core._jit import entry, jit
from lbkit.eplb._plan import Problem
from lbkit.eplb._primitives import REL_TOL, argmax, count_moves, gpu_loads, holds
from lbkit.eplb._replan_cycles import cycles
from lbkit.eplb._replan_descent import descend
from lbkit.eplb._replan_local import local_search, reclaim

__all__ = [
    "MAX_STEPS_PER_SLOT",
    "LayerSetup",
    "ReplanArgs",
    "experts_by_node",
    "layer_setup",
    "level_target",
    "place_rows",
    "place_slots",
    "replan_layer",
    "replan_nodes",
    "replan_nodes_levels",
    "replan_subproblem",
    "subproblem",
    "warmup",
]

#: Steps of every search of a sub-problem per slot (plus 8).
MAX_STEPS_PER_SLOT = 1


class ReplanArgs(NamedTuple):
    """A validated re-planning problem (:func:`lbkit.eplb.replan_experts`)."""

    problem: Problem
    previous: np.ndarray  # (layers, R) int64
    budget: np.ndarray  # (layers,) int64
    total: int | None
    tolerance: float
    scope: str  # "mean" or "layer"
    regroup_tolerance: float
    num_groups: int  # as given (the problem holds (1, 1) under the global policy)
    num_nodes: int
    workers: int = 1  # threads re-planning layers at once


@jit
def place_rows(prev, new, out):
    """Slots of every GPU (rows of ``prev`` and ``new``, ``(G, S)`` expert ids): a replica of
    ``new`` that ``prev`` holds keeps its slot (earliest such slot first), the other replicas
    of ``new`` fill the remaining slots in increasing expert order, lowest slot first."""
    num_gpus, slots = prev.shape
    taken = np.zeros(slots, dtype=np.bool_)
    for g in range(num_gpus):
        for j in range(slots):
            taken[j] = False
            out[g, j] = -1
        for i in range(slots):
            e = prev[g, i]
            for j in range(slots):
                if not taken[j] and new[g, j] == e:
                    taken[j] = True
                    out[g, i] = e
                    break
        rest = np.sort(new[g])
        # drop the kept ones from the sorted rest (each once), then fill the free slots
        used = np.zeros(slots, dtype=np.bool_)
        for i in range(slots):
            if out[g, i] >= 0:
                for r in range(slots):
                    if not used[r] and rest[r] == out[g, i]:
                        used[r] = True
                        break
        r = 0
        for i in range(slots):
            if out[g, i] < 0:
                while used[r]:
                    r += 1
                out[g, i] = rest[r]
                used[r] = True


@entry
def place_slots(prev, new, out):
    """:func:`place_rows`, called from Python."""
    place_rows(prev, new, out)


@jit
def _repack(size, pinned, gpu_exp, pool_e, pool_home, n_pool, cap, load, order):
    """Put the ``n_pool`` replicas of the pool into the free (unpinned) slots.

    Largest replica first (stable: lowest pool position among equal sizes). A replica goes back
    to its home GPU (the GPU it was unpinned from) when that GPU has a free slot and stays at or
    below ``cap``; otherwise to the lightest GPU with a free slot that does not hold its expert
    (lowest GPU among equal loads), or, when every GPU with a free slot holds it, the lightest
    GPU with a free slot.
    """
    num_gpus, slots = gpu_exp.shape
    for g in range(num_gpus):
        for i in range(slots):
            if not pinned[g, i]:
                gpu_exp[g, i] = -1
    gpu_loads(size, gpu_exp, load)
    key = np.empty(n_pool)
    for k in range(n_pool):
        key[k] = -size[pool_e[k]]
    order[:n_pool] = np.argsort(key, kind="mergesort")
    for k in range(n_pool):
        p = order[k]
        e = pool_e[p]
        x = size[e]
        best = -1
        h = pool_home[p]
        if h >= 0 and load[h] + x <= cap and not holds(gpu_exp, h, e, -1):
            for i in range(slots):
                if gpu_exp[h, i] < 0:
                    best = h
                    break
        if best < 0:
            best_dup = True
            for g in range(num_gpus):
                free = False
                for i in range(slots):
                    if gpu_exp[g, i] < 0:
                        free = True
                        break
                if not free:
                    continue
                dup = holds(gpu_exp, g, e, -1)
                if best < 0 or (best_dup and not dup) or (dup == best_dup and load[g] < load[best]):
                    best = g
                    best_dup = dup
        for i in range(slots):
            if gpu_exp[best, i] < 0:
                gpu_exp[best, i] = e
                break
        load[best] += x


@jit
def _restore(w, src_exp, src_cnt, src_cur, src_moves, gpu_exp, cnt, cur, size, load):
    """Set the state (``gpu_exp``, ``cnt``, ``cur``, ``size``, ``load``) to a saved one;
    returns its moves."""
    gpu_exp[:, :] = src_exp
    cnt[:] = src_cnt
    cur[:, :] = src_cur
    for e in range(w.shape[0]):
        size[e] = w[e] / cnt[e]
    gpu_loads(size, gpu_exp, load)
    return src_moves


@jit
def _better(val, moves, best_val, best_moves, limit):
    """Whether ``(val, moves)`` beats ``(best_val, best_moves)``: at or below ``limit`` the
    fewer moves (then the lower value) win, a state at or below it beats one above, and above
    it the lower value (then fewer moves) wins."""
    if val <= limit and best_val <= limit:
        return moves < best_moves or (moves == best_moves and val < best_val)
    if val <= limit or best_val <= limit:
        return val <= limit
    return val < best_val * (1.0 - REL_TOL) or (
        val <= best_val * (1.0 + REL_TOL) and moves < best_moves
    )


@jit
def subproblem(w, old_exp, target, budget, max_steps, gpu_exp):
    """Re-plan one sub-problem from ``old_exp`` with at most ``budget`` moves.

    1. **Counts**: old counts; experts without a replica get one and slots freed by experts
       that left go, one at a time, to the expert with the largest load per replica. Then, while
       a replica is larger than ``target - Q`` (``Q`` = the ``S - 1`` smallest replicas, so no
       GPU holding it could stay at or below ``target``), the largest replica's expert gains a
       replica from the expert that loses least (smallest ``w / (c - 1)``, which must stay at or
       below the same limit); the donor gives up its replica on its most loaded GPU.
    2. **Keep, then fill**: every other old replica stays pinned in its slot; the new replicas
       fill the freed slots (:func:`_repack`).
    3. **Exchange cycles** (:func:`cycles`, counts fixed): cycles of GPUs above ``target``
       each passing a replica to the next, closed by a light GPU, ``m + 1`` moves for ``m``
       GPUs; if some GPU stays above ``target``, the **excess descent** (:func:`descend`)
       continues from there: lower the total excess ``sum_g max(0, load[g] - target)`` by the
       step of largest reduction per move (free steps first, by reduction): a count change
       (any slot of an expert with two or more replicas given to another expert, on a GPU
       above ``target`` or to an expert held by one), a swap of a replica of a GPU above
       ``target`` with a smaller one elsewhere, or a chain (GPUs above ``target`` ``h_1 ..
       h_m``, ``m >= 2``, each passing a replica to the previous one, ``h_1``'s going to a
       light GPU that passes one to ``h_m``). A step's cost is its change in moves; steps
       beyond ``budget`` are skipped; ties: lowest GPU, slot, expert. If that still ends above
       ``target``, the descent alone from the filled state is tried too. A result replaces the
       state before it when it is better (:func:`_better`: fewer moves among states at or
       below ``target``, else the lower maximum).
    4. **Local search** while the most loaded GPU is above ``target`` (:func:`local_search`):
       swaps of its replicas and count changes of its slots, free steps first.
    5. Stop when the maximum is at most ``target``, no step is left or ``max_steps`` were made;
       the result is the best state seen (lowest maximum, then fewest moves).
    6. **Give back** moves that are not needed (:func:`reclaim`).

    Returns the moves of the result; ``budget + 1`` (and ``old_exp`` copied) when even the
    replicas that the sub-problem must receive exceed the budget.

    Runtime complexity: O((G S + E) E) for the counts, O(G S log(G S)) for the fill, then per
    search step O(G S E + H S G S) (:func:`descend`; ``H`` GPUs above ``target``), at most
    ``max_steps`` steps per search.
    """
    num_gpus, slots = old_exp.shape
    num_log = w.shape[0]
    num_phy = num_gpus * slots
    hold = np.zeros((num_gpus, num_log), dtype=np.int64)
    cnt = np.zeros(num_log, dtype=np.int64)
    pinned = np.zeros((num_gpus, slots), dtype=np.bool_)
    for g in range(num_gpus):
        for i in range(slots):
            e = old_exp[g, i]
            gpu_exp[g, i] = e
            if e >= 0:
                hold[g, e] += 1
                cnt[e] += 1
                pinned[g, i] = True
    size = np.empty(num_log)
    load = np.empty(num_gpus)
    cur_tmp = np.zeros(num_log, dtype=np.int64)
    pool_e = np.empty(num_phy, dtype=np.int64)
    pool_home = np.empty(num_phy, dtype=np.int64)
    order = np.empty(num_phy, dtype=np.int64)
    n_pool = 0
    n_free = 0
    for g in range(num_gpus):
        for i in range(slots):
            if gpu_exp[g, i] < 0:
                n_free += 1
    # 1a. Experts without a replica take free slots first (donors if there are too few).
    for e in range(num_log):
        if cnt[e] > 0:
            continue
        if n_free == 0:
            donor = -1
            for d in range(num_log):
                if cnt[d] >= 2 and (donor < 0 or w[d] / (cnt[d] - 1) < w[donor] / (cnt[donor] - 1)):
                    donor = d
            for d in range(num_log):
                size[d] = w[d] / max(cnt[d], 1)
            gpu_loads(size, gpu_exp, load)
            bg = -1
            bi = -1
            for g in range(num_gpus):
                for i in range(slots):
                    if gpu_exp[g, i] == donor and pinned[g, i] and (bg < 0 or load[g] > load[bg]):
                        bg = g
                        bi = i
            gpu_exp[bg, bi] = -1
            pinned[bg, bi] = False
            cnt[donor] -= 1
            n_free += 1
        cnt[e] = 1
        pool_e[n_pool] = e
        pool_home[n_pool] = -1
        n_pool += 1
        n_free -= 1
    # 1b. Remaining free slots: largest load per replica first (lowest expert among equals).
    while n_free > 0:
        best = 0
        for e in range(1, num_log):
            if w[e] * cnt[best] > w[best] * cnt[e]:
                best = e
        cnt[best] += 1
        pool_e[n_pool] = best
        pool_home[n_pool] = -1
        n_pool += 1
        n_free -= 1
    # 1c. Count repair: no replica may exceed target - Q (each change adds one new replica).
    while n_pool < budget and num_phy > num_log:
        for e in range(num_log):
            size[e] = w[e] / cnt[e]
        by_size = np.argsort(size, kind="mergesort")
        q = 0.0
        left = slots - 1
        for k in range(num_log):
            if left == 0:
                break
            take = min(cnt[by_size[k]], left)
            q += take * size[by_size[k]]
            left -= take
        limit = target - q
        recv = argmax(size)
        if size[recv] <= limit * (1.0 + REL_TOL):
            break
        donor = -1
        for d in range(num_log):
            if d != recv and cnt[d] >= 2 and w[d] / (cnt[d] - 1) <= limit:
                if donor < 0 or w[d] * (cnt[donor] - 1) < w[donor] * (cnt[d] - 1):
                    donor = d
        if donor < 0:
            break
        in_pool = -1
        for p in range(n_pool):
            if pool_e[p] == donor:
                in_pool = p
                break
        if in_pool >= 0:  # a new replica of the donor not placed yet: give it to the receiver
            pool_e[in_pool] = recv
        else:  # free the donor's replica on its most loaded GPU (lowest GPU among equals)
            gpu_loads(size, gpu_exp, load)
            bg = -1
            bi = -1
            for g in range(num_gpus):
                for i in range(slots):
                    if gpu_exp[g, i] == donor and (bg < 0 or load[g] > load[bg]):
                        bg = g
                        bi = i
            gpu_exp[bg, bi] = -1
            pinned[bg, bi] = False
            pool_e[n_pool] = recv
            pool_home[n_pool] = -1
            n_pool += 1
        cnt[donor] -= 1
        cnt[recv] += 1
    for e in range(num_log):
        size[e] = w[e] / cnt[e]
    # 2. Fill the freed slots.
    _repack(size, pinned, gpu_exp, pool_e, pool_home, n_pool, target, load, order)
    moves = count_moves(hold, gpu_exp, cur_tmp)
    best_exp = gpu_exp.copy()
    best_val = load[argmax(load)]
    best_moves = moves
    if moves > budget:  # the count repair alone exceeds the budget (only when budget < changes)
        best_val = np.inf
    tol = REL_TOL * target
    cur = np.zeros((num_gpus, num_log), dtype=np.int64)
    for g in range(num_gpus):
        for i in range(slots):
            cur[g, gpu_exp[g, i]] += 1
    filled_exp = gpu_exp.copy()
    filled_moves = moves
    cnt0 = cnt.copy()
    cur0 = cur.copy()
    # 3a. Exchange cycles (counts fixed) from the filled state, the excess descent finishing if
    # they fall short; kept if better than the filled state.
    if best_val > target + tol and moves <= budget:
        moves = cycles(size, gpu_exp, cur, load, target, budget, hold, moves, cur_tmp)
        if load[argmax(load)] > target + tol:
            moves = descend(
                w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves, max_steps, cur_tmp
            )
        val = load[argmax(load)]
        if _better(val, moves, best_val, best_moves, target + tol):
            best_val = val
            best_moves = moves
            best_exp[:, :] = gpu_exp
        else:
            moves = _restore(w, best_exp, cnt0, cur0, best_moves, gpu_exp, cnt, cur, size, load)
    # 3b. Still above the target: the excess descent alone from the filled state.
    if best_val > target + tol and filled_moves <= budget:
        keep_exp = gpu_exp.copy()
        keep_cnt = cnt.copy()
        keep_cur = cur.copy()
        keep_moves = moves
        moves = _restore(w, filled_exp, cnt0, cur0, filled_moves, gpu_exp, cnt, cur, size, load)
        moves = descend(
            w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves, max_steps, cur_tmp
        )
        val = load[argmax(load)]
        if _better(val, moves, best_val, best_moves, target + tol):
            best_val = val
            best_moves = moves
            best_exp[:, :] = gpu_exp
        else:
            moves = _restore(
                w, keep_exp, keep_cnt, keep_cur, keep_moves, gpu_exp, cnt, cur, size, load
            )
    # 4. Local search on the most loaded GPU.
    moves, best_val, best_moves = local_search(
        w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves, max_steps,
        (best_exp, best_val, best_moves), cur_tmp,
    )  # fmt: skip
    if best_val == np.inf:  # nothing within the budget: the caller keeps the old plan
        best_exp[:, :] = old_exp
        best_moves = budget + 1
    if best_val < np.inf:  # 6. give back moves that are not needed
        reclaim(w, hold, best_exp, max(best_val, target), max_steps)
        best_moves = count_moves(hold, best_exp, cur_tmp)
    gpu_exp[:, :] = best_exp
    return best_moves


@entry
def replan_subproblem(w, old_exp, target, budget, max_steps, gpu_exp):
    """:func:`subproblem`, called from Python."""
    return subproblem(w, old_exp, target, budget, max_steps, gpu_exp)


@entry
def replan_nodes(w_nodes, old_nodes, node_experts, prev, order, target, budget, new):
    """Re-plan the sub-problems of one layer (its nodes) in the given ``order`` within one
    ``budget``: each takes what the ones before it left (:func:`subproblem`), and its slots go
    into ``new`` by :func:`place_rows` (unchanged replicas keep their slots).

    ``w_nodes[n]``: loads of node ``n``'s experts (local ids), ``node_experts[n]`` their global
    ids; ``old_nodes[n]``: the old plan of its GPUs in local ids (``-1``: another node's
    expert); ``prev``: the old ``phy2log`` row. Returns the moves, or ``budget + 1`` (``new``
    then holds ``prev``) when a sub-problem cannot be re-planned within what is left.
    """
    return _replan_nodes(w_nodes, old_nodes, node_experts, prev, order, target, budget, new)


@entry
def replan_nodes_levels(
    w_nodes, old_nodes, node_experts, prev, order, targets, budget, w, meets, useful, rows
):
    """:func:`replan_nodes` at the targets of the tolerance levels, loose first, in one call:
    ``rows[k]`` gets the row of ``targets[k]``; returns the moves of each, ``(levels,)``, the
    same as one call per level, or ``-1`` where level ``k`` was not computed: an earlier row
    with moves within the budget and largest GPU load at most ``useful`` already had a largest
    GPU load at most ``meets[k]`` (``w``: the layer's loads, for the rows' GPU loads).
    """
    levels = targets.shape[0]
    num_gpus = old_nodes.shape[0] * old_nodes.shape[1]
    per = old_nodes.shape[2]
    cnt = np.empty(w.shape[0], dtype=np.int64)
    size = np.empty(w.shape[0])
    load = np.empty(num_gpus)
    used = np.full(levels, -1, dtype=np.int64)
    best = np.inf
    for k in range(levels):
        if best < np.inf and best <= meets[k]:
            continue
        used[k] = _replan_nodes(
            w_nodes, old_nodes, node_experts, prev, order, targets[k], budget, rows[k]
        )
        if used[k] < 1 or used[k] > budget:
            continue
        cnt[:] = 0
        for e in rows[k]:
            cnt[e] += 1
        for e in range(w.shape[0]):
            size[e] = w[e] / cnt[e] if cnt[e] > 0 else 0.0
        gpu_loads(size, rows[k].reshape(num_gpus, per), load)
        top = load[argmax(load)]
        if top <= useful:
            best = min(best, top)
    return used


@jit
def _replan_nodes(w_nodes, old_nodes, node_experts, prev, order, target, budget, new):
    """:func:`replan_nodes`."""
    nodes, gpus, per = old_nodes.shape
    phy = gpus * per
    max_steps = MAX_STEPS_PER_SLOT * phy + 8
    out = np.empty((gpus, per), dtype=np.int64)
    glob = np.empty((gpus, per), dtype=np.int64)
    placed = np.empty((gpus, per), dtype=np.int64)
    left = budget
    for q in range(nodes):
        n = order[q]
        used = subproblem(w_nodes[n], old_nodes[n], target, left, max_steps, out)
        if used > left:
            new[:] = prev
            return budget + 1
        left -= used
        for g in range(gpus):
            for i in range(per):
                glob[g, i] = node_experts[n, out[g, i]]
        place_rows(prev[n * phy : (n + 1) * phy].reshape(gpus, per), glob, placed)
        for g in range(gpus):
            for i in range(per):
                new[n * phy + g * per + i] = placed[g, i]
    return budget - left


def experts_by_node(node_of_group: np.ndarray, num_nodes: int, group_size: int) -> np.ndarray:
    """The experts of every node, its groups in increasing order: ``(..., num_nodes, experts
    per node)`` global ids for ``node_of_group`` of shape ``(..., groups)``."""
    lead = node_of_group.shape[:-1]
    groups = np.argsort(node_of_group, axis=-1, kind="stable").reshape(*lead, num_nodes, -1)
    return (groups[..., None] * group_size + np.arange(group_size)).reshape(*lead, num_nodes, -1)


class LayerSetup(NamedTuple):
    """A layer cut into sub-problems for one group-to-node partition (:func:`layer_setup`):
    what :func:`replan_nodes` takes besides the target and the budget."""

    w_nodes: np.ndarray  # (nodes, local experts) loads
    old_nodes: np.ndarray  # (nodes, GPUs per node, S) old plan in local ids, -1: another node's
    node_experts: np.ndarray  # (nodes, local experts) global ids
    order: np.ndarray  # (nodes,) the order the nodes are re-planned in


def layer_setup(
    w: np.ndarray, prev: np.ndarray, node_of_group: np.ndarray | None, args: ReplanArgs
) -> LayerSetup:
    """Cut one layer into its sub-problems: the layer itself under the global policy
    (``node_of_group`` ``None``), else one per node, its groups in increasing order, the most
    loaded node under the old plan first (a GPU holding another node's expert counts as
    infinitely loaded). Independent of the target: a re-plan at several tolerances reuses it."""
    p = args.problem
    experts, slots = w.shape[0], p.num_replicas
    nodes = 1 if node_of_group is None else args.num_nodes
    g_per_node = p.num_gpus // nodes
    per_gpu = slots // p.num_gpus
    if node_of_group is None:  # one sub-problem, the layer: no local ids, no order
        first = np.zeros(1, dtype=np.int64)
        old_nodes = prev.reshape(1, g_per_node, per_gpu)
        return LayerSetup(w[None, :], old_nodes, np.arange(experts)[None, :], first)
    node_experts = experts_by_node(node_of_group, nodes, experts // args.num_groups)
    local = node_experts.shape[1]
    log2local = np.full((nodes, experts), -1, dtype=np.int64)
    log2local[np.arange(nodes)[:, None], node_experts] = np.arange(local)
    old_nodes = log2local[np.arange(nodes)[:, None], prev.reshape(nodes, -1)]
    old_nodes = old_nodes.reshape(nodes, g_per_node, per_gpu)
    w_nodes = w[node_experts]
    held = old_nodes >= 0
    cnt = np.zeros((nodes, local), dtype=np.int64)
    np.add.at(cnt, (np.nonzero(held)[0], old_nodes[held]), 1)
    size = w_nodes / np.maximum(cnt, 1)
    per_slot = np.take_along_axis(size, np.maximum(old_nodes, 0).reshape(nodes, -1), axis=1)
    per_slot = np.where(held, per_slot.reshape(old_nodes.shape), np.inf)
    stale = per_slot.sum(axis=2).max(axis=1)
    order = np.lexsort((np.arange(nodes), -stale))
    return LayerSetup(w_nodes, old_nodes, node_experts, order)


def level_target(node_bound: np.ndarray, fresh_max: float, tol: float) -> float:
    """The largest GPU load a layer's re-plan at per-layer tolerance ``tol`` aims for: ``1 +
    tol`` times the larger of its sub-problems' bounds and the fresh plan's largest load."""
    return max(float(node_bound.max()), fresh_max) * (1.0 + tol)


def replan_layer(
    setup: LayerSetup,
    prev: np.ndarray,
    node_bound: np.ndarray,
    fresh_max: float,
    tol: float,
    budget: int,
) -> tuple[np.ndarray, int]:
    """Re-plan one layer, cut by ``setup`` (:func:`layer_setup`), at per-layer tolerance
    ``tol``; returns ``(phy2log row, moves)``.

    ``moves > budget`` means the budget cannot even pay for the replicas the partition forces.
    """
    target = level_target(node_bound, fresh_max, tol)
    new = np.empty(prev.shape[0], dtype=np.int64)
    w_nodes, old_nodes, node_experts, order = setup
    used = replan_nodes(w_nodes, old_nodes, node_experts, prev, order, target, budget, new)
    return new, int(used)


def warmup() -> None:
    """Compile :func:`replan_nodes`, :func:`replan_nodes_levels`, :func:`replan_subproblem` and
    :func:`place_slots` (or load them from the disk cache) on a tiny input."""
    w = np.array([4.0, 3.0, 2.0, 1.0])
    old = np.array([[0, 1], [2, 3], [0, 1]], dtype=np.int64)
    out = np.empty_like(old)
    replan_subproblem.dispatcher(w, old, 4.0, 10, 16, out)
    placed = np.empty_like(old)
    place_slots.dispatcher(old, out, placed)
    new = np.empty(old.size, dtype=np.int64)
    experts = np.arange(4)[None, :]
    order = np.zeros(1, dtype=np.int64)
    replan_nodes.dispatcher(w[None, :], old[None], experts, old.ravel(), order, 4.0, 10, new)
    rows = np.empty((1, old.size), dtype=np.int64)
    targets = np.array([4.0])
    prev, limit = old.ravel(), np.array([1.0])
    replan_nodes_levels.dispatcher(
        w[None, :], old[None], experts, prev, order, targets, 10, w, limit, 1.0, rows
    )
