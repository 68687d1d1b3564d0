"""Slow plain-Python oracles for the EPLB tests.

``greedy_oracle`` restates DeepSeek's published EPLB algorithm from its description, one list
operation at a time, independently of the numba kernels. ``dtype=np.float32`` repeats every
division and running sum in single precision, the way the published code computes (it casts the
loads to ``float32``); ``np.float64`` is what ``method="greedy"`` does.
"""

from __future__ import annotations

import numpy as np

__all__ = ["greedy_oracle", "max_gpu_load", "pack_heaviest_first"]


def pack_heaviest_first(loads: list, num_bins: int, dtype) -> tuple[list[int], list[int]]:
    """Heaviest item first into the lightest bin with room; returns (bin, position) per item.

    Exactly ``len(loads) / num_bins`` items per bin. Equal loads: lower item index first; equal
    bins: lower bin index. With one item per bin, item ``i`` goes to bin ``i``.
    """
    n = len(loads)
    per_bin = n // num_bins
    if per_bin == 1:
        return list(range(n)), [0] * n
    order = sorted(range(n), key=lambda i: (-loads[i], i))
    bin_load = [dtype(0)] * num_bins
    bin_items = [0] * num_bins
    where, pos = [0] * n, [0] * n
    for item in order:
        open_bins = [b for b in range(num_bins) if bin_items[b] < per_bin]
        b = min(open_bins, key=lambda k: (bin_load[k], k))
        where[item], pos[item] = b, bin_items[b]
        bin_load[b] = dtype(bin_load[b] + loads[item])
        bin_items[b] += 1
    return where, pos


def _replicate(loads: list, num_slots: int, dtype):
    """Slot e holds expert e; each extra slot copies the expert with most load per replica."""
    counts = [1] * len(loads)
    slot_expert = list(range(len(loads)))
    slot_rank = [0] * len(loads)
    for _ in range(num_slots - len(loads)):
        per_replica = [dtype(loads[e] / dtype(counts[e])) for e in range(len(loads))]
        top = max(range(len(loads)), key=lambda e: (per_replica[e], -e))
        slot_expert.append(top)
        slot_rank.append(counts[top])
        counts[top] += 1
    return slot_expert, slot_rank, counts


def _layer(w: list, num_slots: int, num_groups: int, num_nodes: int, num_gpus: int, dtype):
    num_experts = len(w)
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_slots // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_slots // num_gpus
    group_load = []
    for g in range(num_groups):
        s = dtype(0)
        for e in range(g * group_size, (g + 1) * group_size):
            s = dtype(s + w[e])
        group_load.append(s)
    node_of_group, pos_of_group = pack_heaviest_first(group_load, num_nodes, dtype)
    # Experts of node n in node order: its groups by position, experts in index order.
    node_experts = [[0] * experts_per_node for _ in range(num_nodes)]
    for g in range(num_groups):
        for j in range(group_size):
            node_experts[node_of_group[g]][pos_of_group[g] * group_size + j] = g * group_size + j
    phy2log = [0] * num_slots
    phyrank = [0] * num_slots
    logcnt = [0] * num_experts
    for n in range(num_nodes):
        local = [w[e] for e in node_experts[n]]
        slot_expert, slot_rank, counts = _replicate(local, slots_per_node, dtype)
        replica_load = [dtype(local[e] / dtype(counts[e])) for e in slot_expert]
        gpu, pos = pack_heaviest_first(replica_load, gpus_per_node, dtype)
        for i, e in enumerate(slot_expert):
            slot = n * slots_per_node + gpu[i] * slots_per_gpu + pos[i]
            phy2log[slot] = node_experts[n][e]
            phyrank[slot] = slot_rank[i]
        for j, e in enumerate(node_experts[n]):
            logcnt[e] = counts[j]
    return phy2log, phyrank, logcnt


def greedy_oracle(weight, num_slots, num_groups, num_nodes, num_gpus, *, hierarchical, dtype):
    """``(phy2log, phyrank, logcnt)`` of the published algorithm, computed in ``dtype``."""
    w = np.asarray(weight, dtype=dtype)
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    rows = [_layer(list(w[i]), num_slots, groups, nodes, num_gpus, dtype) for i in range(len(w))]
    return tuple(np.array([r[k] for r in rows], dtype=np.int64) for k in range(3))


def max_gpu_load(weight, phy2log, logcnt, num_gpus) -> np.ndarray:
    """Largest GPU load of every layer (float64)."""
    w = np.asarray(weight, dtype=np.float64)
    per_replica = w / np.asarray(logcnt)
    slot = np.take_along_axis(per_replica, np.asarray(phy2log), axis=1)
    return slot.reshape(len(w), num_gpus, -1).sum(axis=2).max(axis=1)
