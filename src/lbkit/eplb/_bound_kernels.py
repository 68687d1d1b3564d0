"""Kernels of :func:`lbkit.eplb.lower_bound`: a lower bound on the largest GPU load of a
sub-problem (mean and slot bound, by bisection) and per layer (hierarchical: over group
partitions).
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import entry, jit
from lbkit.eplb._partition import PARTITION_BUDGET, partition_groups
from lbkit.eplb._primitives import argmax

__all__ = ["PLAN_BOUND_TOL", "lower_bound_layers", "subproblem_bound", "warmup"]


#: Relative precision of :func:`subproblem_bound` where a plan only compares against it (the
#: stopping tests are at ``1 + stop_gap`` of it, ``stop_gap`` 1e-4): about 35 bisection steps
#: instead of 60.
PLAN_BOUND_TOL = 1e-9


@jit
def _big_replica_feasible(w, r, num_phy, num_gpus, cap):
    """Necessary condition from replicas larger than ``cap / 2``: no GPU holds two of them.

    With least counts ``r``, an expert either keeps replicas above ``cap / 2`` (at least ``r_e``
    of them, all on different GPUs) or needs ``s_e = max(r_e, ceil(2 w_e / cap))`` replicas. So
    ``sum_e s_e - (savings) <= R``, where the savings ``s_e - r_e`` of the experts kept large
    weigh ``r_e`` each against a capacity of ``num_gpus``; the fractional knapsack bounds them.
    """
    num_log = w.shape[0]
    half = 0.5 * cap
    total_small = 0
    ratio = np.zeros(num_log)
    for e in range(num_log):
        small = r[e]
        if w[e] / r[e] > half:
            small = max(r[e], int(np.ceil(w[e] / half)))
            if w[e] / small > half:  # guard against rounding
                small += 1
            ratio[e] = (small - r[e]) / r[e]
        total_small += small
    if total_small <= num_phy:
        return True
    # Only the experts kept large have a positive ratio: sort those few (stable, by index).
    kept = np.empty(num_log, dtype=np.int64)
    n_kept = 0
    for e in range(num_log):
        if ratio[e] > 0.0:
            kept[n_kept] = e
            n_kept += 1
    kept = kept[:n_kept]
    order = kept[np.argsort(-ratio[kept], kind="mergesort")]
    room = float(num_gpus)
    saved = 0.0
    for k in range(n_kept):
        e = order[k]
        if room <= 0.0:
            break
        take = min(float(r[e]), room)
        saved += take * ratio[e]
        room -= take
    return total_small - saved <= num_phy + 1e-9


@jit
def _smallest_first(m, k, out):
    """The ``min(k, len(m))`` first indices of ``m``'s stable ascending order (the prefix of
    ``np.argsort(m, kind="mergesort")``) into ``out``, by insertion into a sorted buffer;
    returns how many. O(E k) worst case, O(E) when the buffer rarely changes (``k`` is
    ``S - 1``: small)."""
    n = 0
    if k <= 0:
        return 0
    for e in range(m.shape[0]):
        x = m[e]
        if n == k and not x < m[out[n - 1]]:
            continue  # not below the k-th smallest: an equal later index comes after it
        pos = n if n < k else k - 1
        while pos > 0 and x < m[out[pos - 1]]:
            out[pos] = out[pos - 1]
            pos -= 1
        out[pos] = e
        if n < k:
            n += 1
    return n


@jit
def _slot_bound_feasible(w, num_phy, slots, cap):
    """Necessary condition for a plan with largest GPU load ``cap`` (see ``bounds.py``)."""
    num_log = w.shape[0]
    q = 0.0
    r = np.empty(num_log, dtype=np.int64)
    m = np.empty(num_log)
    first = np.empty(max(slots - 1, 1), dtype=np.int64)
    for _ in range(200):
        room = cap - q
        if room <= 0.0:
            return False
        total = 0
        for e in range(num_log):
            need = int(np.ceil(w[e] / room)) if w[e] > 0.0 else 1
            if need < 1:
                need = 1
            r[e] = need
            total += need
            if total > num_phy:
                return False
        spare = num_phy - total
        if not _big_replica_feasible(w, r, num_phy, num_phy // slots, cap):
            return False
        if slots == 1:
            return True
        # Smallest possible replica of each expert and how many of them there can be.
        for e in range(num_log):
            m[e] = w[e] / (r[e] + spare)
        n_first = _smallest_first(m, slots - 1, first)
        need_items = slots - 1
        q_new = 0.0
        for k in range(n_first):
            e = first[k]
            take = r[e] + spare
            if take > need_items:
                take = need_items
            q_new += take * m[e]
            need_items -= take
            if need_items == 0:
                break
        if q_new <= q * (1.0 + 1e-15):
            return True
        q = q_new
    return True


@jit
def subproblem_bound(w, num_gpus, slots, rel_tol):
    """Lower bound on the largest GPU load of one sub-problem: max of the mean and the slot bound
    (largest replica plus the ``slots - 1`` smallest replicas), found by bisection.

    The bisection stops once the bracket is within ``rel_tol`` of its lower end (``0.0``: to the
    last bit; :data:`PLAN_BOUND_TOL` for a stopping test); the lower end is returned, so the
    result is a lower bound either way."""
    num_log = w.shape[0]
    num_phy = num_gpus * slots
    total = 0.0
    wmax = 0.0
    for e in range(num_log):
        total += w[e]
        if w[e] > wmax:
            wmax = w[e]
    if total <= 0.0:
        return 0.0
    mean = total / num_gpus
    lo = mean
    if not _slot_bound_feasible(w, num_phy, slots, lo):
        # Most layers pass at the mean; the others need a bisection.
        hi = total
        for _ in range(100):
            if hi - lo <= rel_tol * lo:
                break
            mid = 0.5 * (lo + hi)
            if mid <= lo or mid >= hi:
                break
            if _slot_bound_feasible(w, num_phy, slots, mid):
                hi = mid
            else:
                lo = mid
    return lo


@jit
def _enumerate_bound(sub_bound, num_groups, num_nodes, per_node):
    """min over group-to-node partitions of max over nodes of ``sub_bound[mask]`` (bit masks)."""
    best = np.inf
    mask = np.zeros(num_nodes, dtype=np.int64)
    cnt = np.zeros(num_nodes, dtype=np.int64)
    choice = np.full(num_groups, -1, dtype=np.int64)
    k = 0
    while k >= 0:
        if choice[k] >= 0:
            n = choice[k]
            mask[n] ^= 1 << k
            cnt[n] -= 1
        n = choice[k] + 1
        moved = False
        while n < num_nodes:
            if cnt[n] < per_node:
                if cnt[n] == 0:
                    ok = True
                    for mm in range(n):
                        if cnt[mm] == 0:
                            ok = False
                            break
                    if not ok:
                        n += 1
                        continue
                if cnt[n] + 1 == per_node and sub_bound[mask[n] | (1 << k)] >= best:
                    n += 1
                    continue
                moved = True
                break
            n += 1
        if not moved:
            choice[k] = -1
            k -= 1
            continue
        choice[k] = n
        mask[n] |= 1 << k
        cnt[n] += 1
        if k == num_groups - 1:
            v = 0.0
            for nn in range(num_nodes):
                if sub_bound[mask[nn]] > v:
                    v = sub_bound[mask[nn]]
            if v < best:
                best = v
        else:
            k += 1
    return best


@entry
def lower_bound_layers(weight, num_phy, num_groups, num_nodes, num_gpus, out):
    """Per-layer lower bound on the largest GPU load (absolute units, not divided by the mean).

    Global (``num_nodes == 1``): :func:`subproblem_bound`. Hierarchical with at most 12 groups:
    the minimum over group-to-node partitions of the largest within-node bound (enumerated
    exactly over bit masks of groups), and at least the global bound. With more groups: the
    global bound and, when :func:`partition_groups` proves its partition optimal, the smallest
    possible largest node load divided by the GPUs per node.
    """
    num_layers, num_log = weight.shape
    slots = num_phy // num_gpus
    gpus_per_node = num_gpus // num_nodes
    group_size = num_log // num_groups
    per_node = num_groups // num_nodes
    group_load = np.empty(num_groups)
    node_of_group = np.empty(num_groups, dtype=np.int64)
    nload = np.empty(num_nodes)
    for layer in range(num_layers):
        w = weight[layer]
        glob = subproblem_bound(w, num_gpus, slots, 0.0)
        if num_nodes == 1:
            out[layer] = glob
            continue
        if num_groups > 12:
            for g in range(num_groups):
                s = 0.0
                for j in range(group_size):
                    s += w[g * group_size + j]
                group_load[g] = s
            if partition_groups(group_load, num_nodes, PARTITION_BUDGET, node_of_group):
                nload[:] = 0.0
                for g in range(num_groups):
                    nload[node_of_group[g]] += group_load[g]
                glob = max(glob, nload[argmax(nload)] / gpus_per_node)
            out[layer] = glob
            continue
        # Bound of every subset of groups with `per_node` members, indexed by bit mask.
        sub = np.zeros(1 << num_groups)
        wn = np.empty(per_node * group_size)
        for mask_v in range(1 << num_groups):
            bits = 0
            for g in range(num_groups):
                if (mask_v >> g) & 1:
                    bits += 1
            if bits != per_node:
                continue
            k = 0
            for g in range(num_groups):
                if (mask_v >> g) & 1:
                    for j in range(group_size):
                        wn[k] = w[g * group_size + j]
                        k += 1
            sub[mask_v] = subproblem_bound(wn, gpus_per_node, slots, 0.0)
        out[layer] = max(_enumerate_bound(sub, num_groups, num_nodes, per_node), glob)


def warmup() -> None:
    """Compile :func:`lower_bound_layers` (or load it from the disk cache) on a tiny input."""
    w = np.array([[4.0, 3.0, 2.0, 1.0]])
    out = np.empty(1)
    lower_bound_layers.dispatcher(w, 8, 2, 2, 4, out)
    lower_bound_layers.dispatcher(w, 8, 1, 1, 4, out)
