"""Group-to-node assignments of a hierarchical re-plan.

Groups stay on the node of the old plan unless that costs balance: over every assignment of
``num_groups / num_nodes`` groups per node (when there are more than :data:`MAX_ASSIGNMENTS`,
over those reached by exchanging pairs of groups from the old one), let ``best`` be the
smallest largest node load; the assignment kept is the one that moves the fewest groups among
those whose largest node load is at most ``(1 + regroup_tolerance) * best`` (then the smaller
largest node load, then enumeration order).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

__all__ = ["MAX_ASSIGNMENTS", "all_assignments", "choose_partitions", "old_partition"]

#: Group-to-node assignments enumerated exhaustively up to this many.
MAX_ASSIGNMENTS = 50_000


def old_partition(prev: np.ndarray, experts: int, num_groups: int, num_nodes: int) -> np.ndarray:
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


def all_assignments(num_groups: int, num_nodes: int) -> np.ndarray | None:
    """Every labelled assignment of groups to nodes with equal counts, in lexicographic order,
    or ``None`` if there are more than :data:`MAX_ASSIGNMENTS`.

    Built prefix by prefix (every prefix extended by every node with room left, which keeps
    the lexicographic order), so the work is O(count × num_groups × num_nodes) for the
    ``count = num_groups! / (num_groups / num_nodes)!^num_nodes`` assignments, not the
    ``num_groups!`` of enumerating permutations and dropping repeats.
    """
    per = num_groups // num_nodes
    count = math.factorial(num_groups) // math.factorial(per) ** num_nodes
    if count > MAX_ASSIGNMENTS:
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


_MEMBERS_CACHE: dict[tuple[int, int], np.ndarray] = {}


def _members(num_groups: int, num_nodes: int) -> np.ndarray:
    """``m[j, n, a]``: the ``j``-th group (increasing) that assignment ``a`` of
    :func:`all_assignments` puts on node ``n``; ``(num_groups / num_nodes, num_nodes, A)``."""
    key = (num_groups, num_nodes)
    if key not in _MEMBERS_CACHE:
        cands = all_assignments(num_groups, num_nodes)
        by_node = np.argsort(cands, axis=1, kind="stable")  # groups of node 0, then 1, ...
        per = num_groups // num_nodes
        _MEMBERS_CACHE[key] = by_node.reshape(len(cands), num_nodes, per).transpose(2, 1, 0).copy()
    return _MEMBERS_CACHE[key]


def _exchange_candidates(group_load: np.ndarray, old: np.ndarray, num_nodes: int) -> np.ndarray:
    """The assignments reached from ``old`` by steepest descent over exchanges of two groups
    (``old`` first), when there are too many to enumerate."""
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
    return np.array(cands)


def _pick(cands: np.ndarray, top: np.ndarray, old: np.ndarray, regroup_tolerance: float):
    """The rule of the module docstring over ``cands`` with largest node loads ``top``."""
    moved = (cands != old[None, :]).sum(axis=1)
    ok = top <= top.min() * (1.0 + regroup_tolerance) + 1e-12 * max(top.min(), 1.0)
    order = np.lexsort((np.arange(len(cands)), top, np.where(ok, moved, np.iinfo(np.int64).max)))
    return cands[order[0]]


def _pick_all(cands: np.ndarray, top: np.ndarray, old: np.ndarray, regroup_tolerance: float):
    """:func:`_pick` of every layer at once: ``top`` and ``old`` are ``(layers, A)`` and
    ``(layers, groups)``; returns the index of the assignment kept in each layer (fewest
    groups moved among those within the tolerance, then the smallest largest node load, then
    the first)."""
    moved = (cands[None, :, :] != old[:, None, :]).sum(axis=2)
    best = top.min(axis=1, keepdims=True)
    ok = top <= best * (1.0 + regroup_tolerance) + 1e-12 * np.maximum(best, 1.0)
    key = np.where(ok, moved, np.iinfo(np.int64).max)
    tied = key == key.min(axis=1, keepdims=True)
    low = np.where(tied, top, np.inf)
    tied &= low == low.min(axis=1, keepdims=True)
    return np.argmax(tied, axis=1)  # the first of the ties


def choose_partitions(
    group_load: np.ndarray, old: np.ndarray, num_nodes: int, regroup_tolerance: float
) -> np.ndarray:
    """Group-to-node assignment of every layer by the rule of the module docstring.

    ``group_load`` and ``old`` are ``(layers, groups)``; returns ``(layers, groups)``. The node
    loads of every enumerated assignment are summed for all layers at once, each node's groups
    in increasing order (:func:`_members`), the same way for every layer.
    """
    layers, num_groups = group_load.shape
    if num_groups == num_nodes:  # one group per node: every assignment is as good
        return old.copy()
    cands = all_assignments(num_groups, num_nodes)
    out = np.empty_like(old)
    if cands is None:
        for i in range(layers):
            mine = _exchange_candidates(group_load[i], old[i], num_nodes)
            onehot = mine[:, :, None] == np.arange(num_nodes)[None, None, :]
            top = np.einsum("akn,lk->lan", onehot, group_load[i : i + 1]).max(axis=2)[0]
            out[i] = _pick(mine, top, old[i], regroup_tolerance)
        return out
    members = _members(num_groups, num_nodes)
    loads = group_load[:, members[0]]  # (layers, nodes, assignments)
    for j in range(1, members.shape[0]):  # each node's groups added in increasing order
        loads += group_load[:, members[j]]
    top = loads[:, 0].copy()  # (layers, assignments): the largest node load
    for n in range(1, num_nodes):
        np.maximum(top, loads[:, n], out=top)
    return cands[_pick_all(cands, top, old, regroup_tolerance)]
