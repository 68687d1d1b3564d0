"""Cardinality-constrained partition of expert groups to nodes (hierarchical policy), shared
by the default method and the lower bound.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._primitives import REL_TOL, argmax

__all__ = ["PARTITION_BUDGET", "partition_groups"]

#: Partial assignments the branch and bound of :func:`partition_groups` may visit per layer.
PARTITION_BUDGET = 2_000_000


@jit
def partition_groups(group_load, num_nodes, node_budget, node_of_group):
    """Cardinality-constrained partition of groups to nodes minimising the largest node load.

    Depth-first branch and bound over groups in decreasing load order (stable), starting from
    the LPT partition; a group only opens the first empty node (symmetry). Exact unless the
    search visits more than ``node_budget`` partial assignments, in which case the best
    partition found is returned. Returns ``True`` when the result is proven optimal.
    """
    num_groups = group_load.shape[0]
    per_node = num_groups // num_nodes
    order = np.argsort(-group_load, kind="mergesort")
    # LPT start.
    nload = np.zeros(num_nodes)
    ncount = np.zeros(num_nodes, dtype=np.int64)
    for k in range(num_groups):
        g = order[k]
        best = -1
        for n in range(num_nodes):
            if ncount[n] < per_node and (best < 0 or nload[n] < nload[best]):
                best = n
        node_of_group[g] = best
        nload[best] += group_load[g]
        ncount[best] += 1
    best_val = nload[argmax(nload)]
    if per_node == 1 or num_nodes == 1:
        return True
    # Iterative DFS: choice[k] = node tried for the k-th group in order.
    choice = np.full(num_groups, -1, dtype=np.int64)
    cur = np.zeros(num_nodes)
    cnt = np.zeros(num_nodes, dtype=np.int64)
    k = 0
    visited = 0
    tol = REL_TOL * best_val
    while k >= 0:
        g = order[k]
        if choice[k] >= 0:  # undo the previous choice for this depth
            n = choice[k]
            cur[n] -= group_load[g]
            cnt[n] -= 1
        n = choice[k] + 1
        moved = False
        while n < num_nodes:
            # Symmetry: a group may open only the first empty node.
            if cnt[n] < per_node and cur[n] + group_load[g] < best_val - tol:
                if cnt[n] == 0:
                    first_empty = True
                    for m in range(n):
                        if cnt[m] == 0:
                            first_empty = False
                            break
                    if not first_empty:
                        n += 1
                        continue
                moved = True
                break
            n += 1
        visited += 1
        if visited > node_budget:
            return False
        if not moved:
            choice[k] = -1
            k -= 1
            continue
        choice[k] = n
        cur[n] += group_load[g]
        cnt[n] += 1
        if k == num_groups - 1:
            best_val = cur[argmax(cur)]
            tol = REL_TOL * best_val
            for kk in range(num_groups):
                node_of_group[order[kk]] = choice[kk]
            # keep searching for strictly better partitions
        else:
            k += 1
    return True
