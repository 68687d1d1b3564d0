"""Validators of an EPLB plan: :func:`check_placement` raises, :func:`is_valid_placement` answers.

Rules, each named in the error message:

1. **shapes**: ``phy2log [L, R]``, ``log2phy [L, E, K]``, ``logcnt [L, E]``, integer entries,
   ``num_gpus`` divides ``R``.
2. **range**: ``phy2log`` entries in ``[0, E)``; ``log2phy`` entries in ``[-1, R)``.
3. **every expert placed**: ``logcnt >= 1``.
4. **counts**: ``logcnt[l, e]`` equals the number of slots of layer ``l`` holding ``e`` (so each
   layer's counts add up to ``R``), and ``K >= max logcnt``.
5. **log2phy**: its first ``logcnt[l, e]`` entries are distinct slots holding ``e``; the rest
   are ``-1``.
6. **hierarchical**: all replicas of the experts of a group are on one node (GPU ``g`` is on node
   ``g // (num_gpus / num_nodes)``), and every node holds the same number of groups.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.validation import as_int_array, check_int
from lbkit.eplb._plan import resolve_policy

__all__ = ["check_placement", "is_valid_placement"]


def check_placement(
    phy2log: Any,
    log2phy: Any,
    logcnt: Any,
    /,
    *,
    num_experts: int,
    num_gpus: int,
    num_groups: int | None = None,
    num_nodes: int | None = None,
    policy: str | None = None,
) -> None:
    """Raise ``ValueError`` naming the first rule (module docstring) that a plan breaks.

    Parameters
    ----------
    phy2log, log2phy, logcnt : array_like of int
        The plan (numpy arrays or torch tensors).
    num_experts : int
        Logical experts ``E`` per layer.
    num_gpus : int
        GPUs; must divide the number of slots.
    num_groups, num_nodes : int, optional
        Needed for the hierarchical rule. Without them only the global rules are checked.
    policy : {None, "global", "hierarchical"}
        ``None`` applies DeepSeek's rule when ``num_groups`` and ``num_nodes`` are given
        (hierarchical when ``num_nodes`` divides ``num_groups``), else the global rules only.

    Runtime complexity: O(L × (R + E × K)).

    Examples
    --------
    >>> check_placement([[0, 1, 1, 0]], [[[0, 3], [1, 2]]], [[2, 2]], num_experts=2, num_gpus=2)
    >>> check_placement([[0, 0, 0, 0]], [[[0, 1, 2, 3], [-1, -1, -1, -1]]], [[4, 0]],
    ...                 num_experts=2, num_gpus=2)
    Traceback (most recent call last):
    ...
    ValueError: logcnt: every expert must have at least one replica (layer 0, expert 1 has 0)
    """
    num_experts = check_int(num_experts, "num_experts", min_value=1)
    num_gpus = check_int(num_gpus, "num_gpus", min_value=1)
    p2l = as_int_array(phy2log, "phy2log", ndim=2)
    layers, slots = p2l.shape
    cnt = as_int_array(logcnt, "logcnt", shape=(layers, num_experts))
    l2p = as_int_array(log2phy, "log2phy", ndim=3)
    if l2p.shape[:2] != (layers, num_experts):
        raise ValueError(f"log2phy: must have shape ({layers}, {num_experts}, K), got {l2p.shape}")
    if slots == 0 or slots % num_gpus:
        raise ValueError(f"num_gpus: must divide the number of slots ({slots}), got {num_gpus}")
    if p2l.size and (p2l.min() < 0 or p2l.max() >= num_experts):
        raise ValueError(f"phy2log: entries must be expert ids in [0, {num_experts})")
    if l2p.size and (l2p.min() < -1 or l2p.max() >= slots):
        raise ValueError(f"log2phy: entries must be slots in [0, {slots}) or -1")
    if (cnt < 1).any():
        layer, expert = (int(i) for i in np.argwhere(cnt < 1)[0])
        raise ValueError(
            "logcnt: every expert must have at least one replica "
            f"(layer {layer}, expert {expert} has {cnt[layer, expert]})"
        )
    held = np.zeros((layers, num_experts), dtype=np.int64)
    np.add.at(held, (np.repeat(np.arange(layers), slots), p2l.ravel()), 1)
    if (held != cnt).any():
        layer, expert = (int(i) for i in np.argwhere(held != cnt)[0])
        raise ValueError(
            f"logcnt: must count the slots holding each expert (layer {layer}, expert {expert}: "
            f"logcnt {cnt[layer, expert]}, phy2log holds it {held[layer, expert]} times)"
        )
    width = l2p.shape[2]
    if cnt.max() > width:
        raise ValueError(f"log2phy: needs K >= max logcnt ({cnt.max()}), got K = {width}")
    filled = np.arange(width)[None, None, :] < cnt[:, :, None]
    if (l2p[~filled] != -1).any():
        raise ValueError("log2phy: entries beyond logcnt[l, e] must be -1")
    if (l2p[filled] < 0).any():
        raise ValueError("log2phy: the first logcnt[l, e] entries must be slots, found -1")
    rows = np.broadcast_to(np.arange(layers)[:, None, None], l2p.shape)
    experts = np.broadcast_to(np.arange(num_experts)[None, :, None], l2p.shape)
    if (p2l[rows[filled], l2p[filled]] != experts[filled]).any():
        raise ValueError("log2phy: lists a slot that phy2log assigns to another expert")
    # Distinct: the listed slots of a layer cover each slot once (counts already add up to R).
    seen = np.zeros((layers, slots), dtype=np.int64)
    np.add.at(seen, (rows[filled], l2p[filled]), 1)
    if (seen != 1).any():
        raise ValueError("log2phy: every slot must be listed exactly once")
    if num_groups is None or num_nodes is None:
        if policy == "hierarchical":
            raise ValueError("policy: 'hierarchical' needs num_groups and num_nodes")
        return
    num_groups = check_int(num_groups, "num_groups", min_value=1)
    num_nodes = check_int(num_nodes, "num_nodes", min_value=1)
    if not resolve_policy(policy, num_groups, num_nodes):
        return
    if num_experts % num_groups:
        raise ValueError(
            f"num_groups: must divide the number of experts ({num_experts}), got {num_groups}"
        )
    if num_gpus % num_nodes:
        raise ValueError(f"num_nodes: must divide num_gpus ({num_gpus}), got {num_nodes}")
    slots_per_node = slots // num_nodes
    node_of_slot = np.arange(slots) // slots_per_node
    group_of = p2l // (num_experts // num_groups)  # (layers, slots)
    node_of_group = np.full((layers, num_groups), -1, dtype=np.int64)
    for layer in range(layers):
        for s in range(slots):
            g, n = group_of[layer, s], node_of_slot[s]
            if node_of_group[layer, g] == -1:
                node_of_group[layer, g] = n
            elif node_of_group[layer, g] != n:
                raise ValueError(
                    f"phy2log: hierarchical policy keeps every group on one node, but group "
                    f"{g} of layer {layer} has replicas on nodes {node_of_group[layer, g]} and {n}"
                )
        per_node = np.bincount(node_of_group[layer], minlength=num_nodes)
        if (per_node != num_groups // num_nodes).any():
            raise ValueError(
                f"phy2log: hierarchical policy puts {num_groups // num_nodes} groups on each "
                f"node, layer {layer} has {per_node.tolist()}"
            )


def is_valid_placement(phy2log: Any, log2phy: Any, logcnt: Any, /, **kwargs: Any) -> bool:
    """``True`` when :func:`check_placement` accepts the plan (same keyword arguments).

    Examples
    --------
    >>> is_valid_placement([[0, 1]], [[[0], [1]]], [[1, 1]], num_experts=2, num_gpus=2)
    True
    >>> is_valid_placement([[0, 0]], [[[0, 1], [-1, -1]]], [[2, 0]], num_experts=2, num_gpus=2)
    False
    """
    try:
        check_placement(phy2log, log2phy, logcnt, **kwargs)
    except ValueError:
        return False
    return True
