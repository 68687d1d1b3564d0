"""DeepSeek's published EPLB algorithm (``method="greedy"``), reproduced step by step.

Global policy, per layer:

1. **Replicate**: every expert gets one slot (slot ``e`` holds expert ``e``); each further slot
   goes to the expert with the largest load per replica ``w_e / c_e`` (lowest index on ties).
2. **Pack**: replicas are taken heaviest first (stable order: lower slot first on ties) and each
   goes to the lightest GPU that still has a free slot (lowest GPU on ties); with one slot per GPU
   slot ``i`` goes to GPU ``i``. A replica's position on its GPU is its packing order.

Hierarchical policy: expert groups (contiguous blocks of ``E / num_groups`` experts) are first
packed to nodes by the same rule on group loads (``num_groups / num_nodes`` groups per node); each
node then replicates its own experts into ``num_replicas / num_nodes`` slots and packs them onto
its ``num_gpus / num_nodes`` GPUs as above. Replica ranks in ``log2phy`` are creation order.

**dtype**: like the published code, the method casts the loads to ``float32`` and divides and
sums in ``float32`` (every operation correctly rounded), so loads above 2**24 lose precision
exactly as they do there, and the plans are identical. A layer whose largest load is above 2**64
(where float32 sums would overflow to infinity) is first scaled by a power of two, which changes
no rounding: its plan is that of the same loads in a smaller unit. The only differences left are
ties: the published code's ``torch`` sorts and ``argmax`` do not promise an order among equal
values, where this method takes the lower index; and a group's load, which ``torch`` may sum in
another order.
Replicas of one expert are equal, so ``log2phy`` may list an expert's slots in another order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core._jit import entry, jit
from lbkit.eplb._plan import EplbPlan, finish_plan, rebalance_iv
from lbkit.eplb._threads import on_blocks, resolve_workers

__all__ = ["balanced_packing", "greedy_plan", "greedy_rebalance", "warmup"]


def greedy_rebalance(
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
    """Plan replicas with DeepSeek's greedy algorithm (see the module docstring).

    Parameters and returns as in :func:`lbkit.eplb.rebalance_experts` (blocks of layers on
    ``workers`` threads once the kernel is compiled; the plan does not depend on it).

    Runtime complexity: O(layers × (R × E + R log R + R × G)) for ``R`` replicas, ``E`` experts
    and ``G`` GPUs.

    Examples
    --------
    DeepSeek's README example (hierarchical policy: 4 groups on 2 nodes):

    >>> weight = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    ...           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    >>> plan = greedy_rebalance(weight, 16, 4, 2, 8)
    >>> plan.phy2log
    array([[ 5,  6,  5,  7,  8,  4,  3,  4, 10,  9, 10,  2,  0,  1, 11,  1],
           [ 7, 10,  6,  8,  6, 11,  8,  9,  2,  4,  5,  1,  5,  0,  3,  1]])
    """
    problem = rebalance_iv(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    layers, experts = problem.weight.shape
    phy2log = np.empty((layers, problem.num_replicas), dtype=np.int64)
    phyrank = np.empty_like(phy2log)
    logcnt = np.empty((layers, experts), dtype=np.int64)
    w32 = _as_float32(problem.weight)
    sizes = (problem.num_replicas, problem.num_groups, problem.num_nodes, problem.num_gpus)
    workers = resolve_workers(workers, layers)
    if workers > 1 and not greedy_plan.is_compiled(w32, *sizes, phy2log, phyrank, logcnt):
        workers = 1  # the kernel running as Python holds the GIL

    def plan(rows: slice) -> None:
        greedy_plan(w32[rows], *sizes, phy2log[rows], phyrank[rows], logcnt[rows])

    on_blocks(plan, layers, workers)
    return finish_plan(problem, phy2log, logcnt, phyrank)


#: Loads are scaled into float32 by a power of two when a layer's largest load is above this:
#: any sum of up to 2**60 such loads stays below float32's largest finite value (about 2**128).
_FLOAT32_SCALE_ABOVE = 2.0**64


def _as_float32(w: np.ndarray) -> np.ndarray:
    """``w`` as float32, each layer whose largest load is above 2**64 first multiplied by a power
    of two that brings it to 2**64. A power of two changes no rounding of a float32 operation
    (unless a result leaves the normal range), so such a layer gets the plan of the same loads
    in a smaller unit, instead of infinite loads; layers within the range are cast unchanged,
    bit for bit as the published code casts them."""
    top = w.max(axis=1) if w.size else np.zeros(w.shape[0])
    big = top > _FLOAT32_SCALE_ABOVE
    if not big.any():
        return w.astype(np.float32)
    _, exp = np.frexp(top[big])  # top = m * 2**exp with 0.5 <= m < 1
    scaled = w.copy()
    scaled[big] = np.ldexp(w[big], (65 - exp)[:, None])  # largest load now in [2**64, 2**65)
    return scaled.astype(np.float32)


# --------------------------------------------------------------------------------------------
# Kernels: DeepSeek's published algorithm, step by step, in the dtype of `weight` (float32 when
# called by `greedy_rebalance`, as the published code computes).
# --------------------------------------------------------------------------------------------


@jit
def balanced_packing(x, num_packs, pack_index, rank_in_pack):
    """Pack ``n`` items into ``num_packs`` packs of ``n / num_packs`` items each.

    Items are taken heaviest first (stable: lower index first among equal loads); each goes to
    the lightest pack that still has room (lowest pack index among equal loads). With one item
    per pack, item ``i`` goes to pack ``i`` (identity), as in the published algorithm.
    """
    n = x.shape[0]
    per_pack = n // num_packs
    if per_pack == 1:
        for i in range(n):
            pack_index[i] = i
            rank_in_pack[i] = 0
        return
    order = np.argsort(-x, kind="mergesort")
    pack_load = np.zeros(num_packs, dtype=x.dtype)
    pack_n = np.zeros(num_packs, dtype=np.int64)
    for k in range(n):
        item = order[k]
        best = -1
        for p in range(num_packs):
            if pack_n[p] < per_pack and (best < 0 or pack_load[p] < pack_load[best]):
                best = p
        pack_index[item] = best
        rank_in_pack[item] = pack_n[best]
        pack_load[best] += x[item]
        pack_n[best] += 1


@jit
def _greedy_replicate(w, num_phy, phy2log, phyrank, cnt, cnt_f):
    """Replicate: slot ``i < E`` holds expert ``i``; each further slot goes to the expert with the
    largest load per replica (lowest index among equal values). ``cnt_f`` mirrors ``cnt`` in the
    dtype of ``w`` so that the divisions happen in that dtype."""
    num_log = w.shape[0]
    for e in range(num_log):
        phy2log[e] = e
        phyrank[e] = 0
        cnt[e] = 1
        cnt_f[e] = 1
    for i in range(num_log, num_phy):
        best = 0
        best_v = w[0] / cnt_f[0]
        for e in range(1, num_log):
            v = w[e] / cnt_f[e]
            if v > best_v:
                best = e
                best_v = v
        phy2log[i] = best
        phyrank[i] = cnt[best]
        cnt[best] += 1
        cnt_f[best] += 1


@jit
def _greedy_layer(w, num_phy, num_groups, num_nodes, num_gpus, phy2log, phyrank, logcnt):
    num_log = w.shape[0]
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    slots = num_phy // num_gpus
    log_per_node = num_log // num_nodes
    phy_per_node = num_phy // num_nodes
    gpus_per_node = num_gpus // num_nodes

    # Step 1: groups to nodes, a group's position in its node given by its packing rank.
    group_load = np.zeros(num_groups, dtype=w.dtype)
    for g in range(num_groups):
        for j in range(group_size):
            group_load[g] += w[g * group_size + j]
    gpack = np.empty(num_groups, dtype=np.int64)
    grank = np.empty(num_groups, dtype=np.int64)
    balanced_packing(group_load, num_nodes, gpack, grank)
    log2mlog = np.empty(num_log, dtype=np.int64)
    mlog2log = np.empty(num_log, dtype=np.int64)
    for e in range(num_log):
        g = e // group_size
        m = (gpack[g] * groups_per_node + grank[g]) * group_size + e % group_size
        log2mlog[e] = m
        mlog2log[m] = e

    # Steps 2 and 3 per node: replicate within the node, then pack its replicas to its GPUs.
    w_node = np.empty(log_per_node, dtype=w.dtype)
    p2m = np.empty(phy_per_node, dtype=np.int64)
    prank = np.empty(phy_per_node, dtype=np.int64)
    mcnt = np.empty(log_per_node, dtype=np.int64)
    mcnt_f = np.empty(log_per_node, dtype=w.dtype)
    x = np.empty(phy_per_node, dtype=w.dtype)
    pidx = np.empty(phy_per_node, dtype=np.int64)
    ridx = np.empty(phy_per_node, dtype=np.int64)
    for n in range(num_nodes):
        for j in range(log_per_node):
            w_node[j] = w[mlog2log[n * log_per_node + j]]
        _greedy_replicate(w_node, phy_per_node, p2m, prank, mcnt, mcnt_f)
        for i in range(phy_per_node):
            x[i] = w_node[p2m[i]] / mcnt_f[p2m[i]]
        balanced_packing(x, gpus_per_node, pidx, ridx)
        for i in range(phy_per_node):
            slot = n * phy_per_node + pidx[i] * slots + ridx[i]
            phy2log[slot] = mlog2log[n * log_per_node + p2m[i]]
            phyrank[slot] = prank[i]
        for j in range(log_per_node):
            logcnt[mlog2log[n * log_per_node + j]] = mcnt[j]


@entry
def greedy_plan(weight, num_phy, num_groups, num_nodes, num_gpus, phy2log, phyrank, logcnt):
    """DeepSeek's greedy plan for every layer (``num_groups = num_nodes = 1`` for global).

    Loads, divisions and running sums use the dtype of ``weight``."""
    for layer in range(weight.shape[0]):
        _greedy_layer(
            weight[layer],
            num_phy,
            num_groups,
            num_nodes,
            num_gpus,
            phy2log[layer],
            phyrank[layer],
            logcnt[layer],
        )


def warmup() -> None:
    """Compile :func:`greedy_plan` (or load it from the disk cache) on a tiny input."""
    w = np.array([[4.0, 3.0, 2.0, 1.0]], dtype=np.float32)
    phy2log = np.empty((1, 8), dtype=np.int64)
    greedy_plan.dispatcher(
        w, 8, 2, 2, 4, phy2log, np.empty_like(phy2log), np.empty((1, 4), dtype=np.int64)
    )
