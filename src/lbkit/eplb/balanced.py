"""lbkit's default EPLB method: replica counts and packing chosen jointly, never worse than greedy.

Per sub-problem (a layer under the global policy; a node of a layer under the hierarchical one):

1. **Counts**: the min-max apportionment (one replica each, then each further replica to the
   expert with the largest load per replica), which minimises the largest replica.
2. **Packing**: LPT with exactly ``S`` replicas per GPU (heaviest replica to the lightest GPU with
   a free slot, avoiding a second replica of an expert on one GPU), then a local search that
   swaps a replica of the most loaded GPU with a lighter one elsewhere while that lowers the
   larger of the two loads.
3. **Count search**: move one replica to the expert of the largest replica on the most loaded GPU
   (from the expert that loses least), or away from an expert sitting twice on it; repack and
   keep the change when the largest GPU load drops, for a few rounds.
   **Second start** (more than 32 replicas, 3 or more slots per GPU): the same search from
   counts that keep the largest expert on one GPU fewer (the others apportioned over the rest,
   that expert's count frozen, the eight heaviest experts added to the receivers, a quarter of
   the trials). With one dominant expert, as on the hottest node of a Zipf 1.0 layer, the
   apportionment spreads it over nearly every GPU and leaves too few slots to fill them
   evenly; single moves from there do not reach the plans that dedicate a GPU to the rest.
4. **Exact search** (sub-problems of at most ``EXACT_MAX_REPLICAS = 32`` replicas): a branch
   and bound over every count vector and packing lowers the maximum to the optimum (within the
   stop gap) unless its node budget runs out.
5. **Duplicates**: swaps that separate two replicas of one expert without raising the maximum;
   for sub-problems of at most 32 replicas, the exact search then looks for a duplicate-free
   plan (other counts included) whose maximum is no higher, so a duplicate left there is one
   that no plan of equal balance avoids (unless the search budget ran out).

Every search stops once the sub-problem is within ``STOP_GAP`` of its lower bound.

**Two slots per GPU** (sub-problems of more than 32 replicas): for fixed counts the sorted
pairing (the ``k``-th largest replica with the ``k``-th smallest) is optimal, and it is scored in
``O(E)``, so steps 2-4 give way to a count search on it: from the apportionment, each step moves
the one replica (any donor with two or more; receivers: the experts of the pairs at the maximum,
the eight whose new replica would be the largest still below the partner at the maximum, the
largest and the three smallest) that lowers the largest pair most, or the number of pairs at it.
A second start builds counts for a bisected cap by Hall's condition (replicas above ``cap / 2``
need distinct partners of at most ``cap`` minus their size: each shortfall is fixed by the change
that gains most partners per added replica) and runs the same search from them; the better plan
is kept. Then swaps separate duplicates where the maximum allows.

Hierarchical policy: groups go to nodes by an exact cardinality-constrained partition minimising
the largest node load (branch and bound; each node holds ``num_groups / num_nodes`` groups and a
fixed budget of ``num_replicas / num_nodes`` slots), then each node is solved as above, in
decreasing order of its lower bound; a node also stops as soon as its largest GPU load is at
most the largest one already reached on the layer (it cannot change the layer's balance).

Finally the greedy plan is computed as well and kept for any layer where its largest GPU load is
strictly lower, so the default is never worse than greedy on any layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core._jit import entry, jit
from lbkit.eplb._bound_kernels import subproblem_bound
from lbkit.eplb._count_search import solve_subproblem
from lbkit.eplb._exact import EXACT_MAX_REPLICAS
from lbkit.eplb._partition import PARTITION_BUDGET, partition_groups
from lbkit.eplb._plan import EplbPlan, finish_plan, rebalance_iv
from lbkit.eplb._threads import on_blocks, resolve_workers
from lbkit.eplb._two_slot import solve_two_slot
from lbkit.eplb.greedy import greedy_plan

__all__ = [
    "COUNT_SEARCH_EVALS",
    "STOP_GAP",
    "balanced_rebalance",
    "default_plan",
    "two_slot_plan",
    "uses_two_slot_plan",
    "warmup",
]

#: Trial plans of the replica-count search per sub-problem.
COUNT_SEARCH_EVALS = 64

#: The searches stop once a sub-problem's largest GPU load is within this relative gap of its
#: lower bound (``bounds.py``); no plan can do better than the bound. 1e-3 rather than 5e-4 makes
#: hierarchical plans on 8 nodes about 1.7x faster for under 0.05 points of moe_lb.
STOP_GAP = 1e-3


def _max_gpu_load(weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int):
    per_replica = weight / logcnt
    slot_load = np.take_along_axis(per_replica, phy2log, axis=1)
    return slot_load.reshape(phy2log.shape[0], num_gpus, -1).sum(axis=2).max(axis=1)


def balanced_rebalance(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    policy: str | None = None,
    workers: Any = None,
) -> EplbPlan:
    """Plan replicas with lbkit's default method (see the module docstring).

    Parameters and returns as in :func:`lbkit.eplb.rebalance_experts`. Blocks of layers are
    planned on ``workers`` threads once the kernels are compiled (:mod:`lbkit.eplb._threads`);
    the plan does not depend on ``workers``.

    Runtime complexity: per layer, that of
    :func:`lbkit.eplb._count_search.solve_subproblem` (or, two slots per GPU,
    :func:`lbkit.eplb._two_slot.solve_two_slot`) on each node, plus the group partition (at
    most ``PARTITION_BUDGET`` search nodes) and the greedy plan. Compiled, a plan of 58 x 256
    experts on 288 slots / 32 GPUs takes tens of milliseconds (``benchmarks/cold_start.py``
    records it beside the first call's time).

    Examples
    --------
    >>> weight = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    ...           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    >>> from lbkit.eplb import moe_lb
    >>> plan = balanced_rebalance(weight, 16, 4, 2, 8, policy="global")
    >>> moe_lb(weight, plan.phy2log, num_gpus=8)
    array([1.0532..., 1.1903...])
    """
    problem = rebalance_iv(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    w = problem.weight
    layers, experts = w.shape
    workers = resolve_workers(workers, layers)
    sizes = (problem.num_replicas, problem.num_groups, problem.num_nodes, problem.num_gpus)
    phy2log = np.empty((layers, problem.num_replicas), dtype=np.int64)
    logcnt = np.empty((layers, experts), dtype=np.int64)
    w32 = w.astype(np.float32)
    g_phy2log = np.empty_like(phy2log)
    g_rank = np.empty_like(phy2log)
    g_logcnt = np.empty_like(logcnt)
    if uses_two_slot_plan(problem.num_replicas, problem.num_nodes, problem.num_gpus):
        kernel, knobs = two_slot_plan, (STOP_GAP,)
    else:
        kernel, knobs = default_plan, (COUNT_SEARCH_EVALS, STOP_GAP)

    def plan(rows: slice) -> None:
        kernel(w[rows], *sizes, *knobs, phy2log[rows], logcnt[rows])
        greedy_plan(w32[rows], *sizes, g_phy2log[rows], g_rank[rows], g_logcnt[rows])

    if workers > 1 and not (
        kernel.is_compiled(w, *sizes, *knobs, phy2log, logcnt)
        and greedy_plan.is_compiled(w32, *sizes, g_phy2log, g_rank, g_logcnt)
    ):
        workers = 1  # kernels running as Python hold the GIL: threads would only add overhead
    on_blocks(plan, layers, workers)
    ours = _max_gpu_load(w, phy2log, logcnt, problem.num_gpus)
    theirs = _max_gpu_load(w, g_phy2log, g_logcnt, problem.num_gpus)
    use_greedy = theirs < ours * (1.0 - 1e-12)
    if use_greedy.any():
        phy2log[use_greedy] = g_phy2log[use_greedy]
        logcnt[use_greedy] = g_logcnt[use_greedy]
    return finish_plan(problem, phy2log, logcnt)


def uses_two_slot_plan(num_replicas: int, num_nodes: int, num_gpus: int) -> bool:
    """Whether the sub-problems (one per node) are solved by :func:`two_slot_plan`: two slots
    per GPU and more than ``EXACT_MAX_REPLICAS`` replicas per node.

    Examples
    --------
    >>> uses_two_slot_plan(288, 1, 144), uses_two_slot_plan(288, 1, 32)
    (True, False)
    """
    return num_replicas == 2 * num_gpus and num_replicas // num_nodes > EXACT_MAX_REPLICAS


# --------------------------------------------------------------------------------------------
# Kernels: the per-layer driver. Which sub-problem solver runs depends only on the sizes, so
# there are two entry kernels and each compiles only its own solver.
# --------------------------------------------------------------------------------------------


@jit
def _layer_nodes(w, num_groups, num_nodes, gpus_per_node, slots, local2log, w_node, node_bound):
    """Groups of one layer to nodes by :func:`partition_groups`; each node's experts
    (``local2log``), loads (``w_node``) and lower bound (``node_bound``, 0 for one node).
    Returns the nodes in decreasing order of their bound (stable)."""
    group_size = w.shape[0] // num_groups
    group_load = np.empty(num_groups)
    node_of_group = np.empty(num_groups, dtype=np.int64)
    for g in range(num_groups):
        s = 0.0
        for j in range(group_size):
            s += w[g * group_size + j]
        group_load[g] = s
    partition_groups(group_load, num_nodes, PARTITION_BUDGET, node_of_group)
    for n in range(num_nodes):
        k = 0
        for g in range(num_groups):
            if node_of_group[g] == n:
                for j in range(group_size):
                    local2log[n, k] = g * group_size + j
                    w_node[n, k] = w[g * group_size + j]
                    k += 1
        if num_nodes > 1:
            node_bound[n] = subproblem_bound(w_node[n], gpus_per_node, slots, 0.0)
        else:
            node_bound[n] = 0.0
    return np.argsort(-node_bound, kind="mergesort")


@jit
def _write_node(n, local2log_n, cnt, gpu_exp, phy2log_layer, logcnt_layer):
    """Write node ``n``'s counts and packing into the layer's plan."""
    gpus_per_node, slots = gpu_exp.shape
    for j in range(cnt.shape[0]):
        logcnt_layer[local2log_n[j]] = cnt[j]
    for gl in range(gpus_per_node):
        for i in range(slots):
            slot = (n * gpus_per_node + gl) * slots + i
            phy2log_layer[slot] = local2log_n[gpu_exp[gl, i]]


@entry
def default_plan(
    weight, num_phy, num_groups, num_nodes, num_gpus, max_evals, stop_gap, phy2log, logcnt
):
    """Default plan for every layer (``num_groups = num_nodes = 1`` for the global policy).

    Hierarchical: groups to nodes by :func:`partition_groups`, then the nodes are solved in
    decreasing order of their lower bound, each with the largest load reached so far on the
    layer as its target (:func:`solve_subproblem`). The layer's largest load is no higher
    than if every node were solved to its own bound: a node that stops at the target stays at
    or below the largest load reached on another node, and the others run unchanged.
    """
    num_layers, num_log = weight.shape
    slots = num_phy // num_gpus
    log_per_node = num_log // num_nodes
    gpus_per_node = num_gpus // num_nodes
    w_node = np.empty((num_nodes, log_per_node))
    local2log = np.empty((num_nodes, log_per_node), dtype=np.int64)
    node_bound = np.zeros(num_nodes)
    cnt = np.empty(log_per_node, dtype=np.int64)
    gpu_exp = np.empty((gpus_per_node, slots), dtype=np.int64)
    for layer in range(num_layers):
        order = _layer_nodes(
            weight[layer],
            num_groups,
            num_nodes,
            gpus_per_node,
            slots,
            local2log,
            w_node,
            node_bound,
        )
        reached = 0.0
        for n in order:
            v = solve_subproblem(
                w_node[n], gpus_per_node, slots, max_evals, stop_gap, reached, cnt, gpu_exp
            )
            reached = max(reached, v)
            _write_node(n, local2log[n], cnt, gpu_exp, phy2log[layer], logcnt[layer])


@entry
def two_slot_plan(weight, num_phy, num_groups, num_nodes, num_gpus, stop_gap, phy2log, logcnt):
    """:func:`default_plan` for two slots per GPU (:func:`uses_two_slot_plan`): the nodes are
    solved by :func:`lbkit.eplb._two_slot.solve_two_slot`, in the same order and with the same
    targets."""
    num_layers, num_log = weight.shape
    log_per_node = num_log // num_nodes
    gpus_per_node = num_gpus // num_nodes
    w_node = np.empty((num_nodes, log_per_node))
    local2log = np.empty((num_nodes, log_per_node), dtype=np.int64)
    node_bound = np.zeros(num_nodes)
    cnt = np.empty(log_per_node, dtype=np.int64)
    gpu_exp = np.empty((gpus_per_node, 2), dtype=np.int64)
    for layer in range(num_layers):
        order = _layer_nodes(
            weight[layer], num_groups, num_nodes, gpus_per_node, 2, local2log, w_node, node_bound
        )
        reached = 0.0
        for n in order:
            v = solve_two_slot(w_node[n], gpus_per_node, stop_gap, reached, cnt, gpu_exp)
            reached = max(reached, v)
            _write_node(n, local2log[n], cnt, gpu_exp, phy2log[layer], logcnt[layer])


def warmup() -> None:
    """Compile :func:`default_plan` and :func:`two_slot_plan` (or load them from the disk
    cache) on tiny inputs."""
    w = np.array([[4.0, 3.0, 2.0, 1.0]])
    phy2log = np.empty((1, 8), dtype=np.int64)
    logcnt = np.empty((1, 4), dtype=np.int64)
    default_plan.dispatcher(w, 8, 2, 2, 4, 8, 1e-4, phy2log, logcnt)
    two_slot_plan.dispatcher(w, 8, 2, 2, 4, 1e-4, phy2log, logcnt)
