"""Shared plumbing of the EPLB methods: the plan type, input validation and output packing.

Every method validates its inputs once with :func:`rebalance_iv`, runs its kernel on clean
``float64`` / ``int64`` arrays and packs the result with :func:`finish_plan`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, check_choice, check_int

__all__ = ["POLICY_NAMES", "EplbPlan", "Problem"]

#: Accepted values of ``policy=`` (``None`` means DeepSeek's rule).
POLICY_NAMES = ("global", "hierarchical")


class EplbPlan(NamedTuple):
    """Replication and placement plan; unpacks like DeepSeek's ``(phy2log, log2phy, logcnt)``.

    Attributes
    ----------
    phy2log : ndarray of int64, shape (layers, num_replicas)
        Logical expert held by each physical slot; slots ``g*S .. (g+1)*S-1`` are on GPU ``g``
        with ``S = num_replicas / num_gpus``.
    log2phy : ndarray of int64, shape (layers, experts, K)
        Slots holding each expert, padded with ``-1``; ``K`` is the largest replica count.
    logcnt : ndarray of int64, shape (layers, experts)
        Replica count of each expert (>= 1, summing to ``num_replicas`` in every layer).
    """

    phy2log: Any
    log2phy: Any
    logcnt: Any


class Problem(NamedTuple):
    """Validated inputs of a rebalance call."""

    weight: np.ndarray  # float64, (layers, experts)
    num_replicas: int
    num_groups: int  # groups and nodes the kernel sees: (1, 1) under the global policy
    num_nodes: int
    num_gpus: int
    hierarchical: bool
    torch_input: bool


def _is_torch(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach")


def resolve_policy(policy: Any, num_groups: int, num_nodes: int) -> bool:
    """``True`` for the hierarchical policy, ``False`` for the global one."""
    if policy is None:
        return num_groups % num_nodes == 0
    check_choice(policy, "policy", POLICY_NAMES)
    if policy == "hierarchical" and num_groups % num_nodes:
        raise ValueError(
            f"policy: 'hierarchical' requires num_nodes ({num_nodes}) to divide num_groups "
            f"({num_groups})"
        )
    return policy == "hierarchical"


def _sizes_iv(
    num_experts: int, num_replicas: Any, num_groups: Any, num_nodes: Any, num_gpus: Any
) -> tuple[int, int, int, int]:
    num_replicas = check_int(num_replicas, "num_replicas", min_value=1)
    num_groups = check_int(num_groups, "num_groups", min_value=1)
    num_nodes = check_int(num_nodes, "num_nodes", min_value=1)
    num_gpus = check_int(num_gpus, "num_gpus", min_value=1)
    if num_replicas % num_gpus:
        raise ValueError(f"num_gpus: must divide num_replicas ({num_replicas}), got {num_gpus}")
    if num_replicas < num_experts:
        raise ValueError(
            f"num_replicas: must be >= the number of experts ({num_experts}) so that every "
            f"expert has a slot, got {num_replicas}"
        )
    if num_experts % num_groups:
        raise ValueError(
            f"num_groups: must divide the number of experts ({num_experts}), got {num_groups}"
        )
    if num_gpus % num_nodes:
        raise ValueError(f"num_nodes: must divide num_gpus ({num_gpus}), got {num_nodes}")
    return num_replicas, num_groups, num_nodes, num_gpus


def rebalance_iv(
    weight: Any,
    num_replicas: Any,
    num_groups: Any,
    num_nodes: Any,
    num_gpus: Any,
    policy: Any,
) -> Problem:
    """Validate the arguments shared by every EPLB method (see ``rebalance_experts``)."""
    torch_input = _is_torch(weight)
    w = as_float_array(weight, "weight", ndim=2, nonnegative=True)
    if w.shape[0] == 0:
        raise ValueError(f"weight: must have at least one layer, got shape {w.shape}")
    if w.shape[1] == 0:
        raise ValueError(f"weight: must have at least one expert per layer, got shape {w.shape}")
    num_replicas, num_groups, num_nodes, num_gpus = _sizes_iv(
        w.shape[1], num_replicas, num_groups, num_nodes, num_gpus
    )
    hierarchical = resolve_policy(policy, num_groups, num_nodes)
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    return Problem(w, num_replicas, groups, nodes, num_gpus, hierarchical, torch_input)


def _log2phy(phy2log: np.ndarray, phyrank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """``log2phy[l, e, phyrank[l, s]] = s`` for every slot ``s`` holding ``e``; -1 elsewhere."""
    layers, slots = phy2log.shape
    width = int(logcnt.max())
    out = np.full((layers, logcnt.shape[1], width), -1, dtype=np.int64)
    rows = np.repeat(np.arange(layers), slots)
    out[rows, phy2log.ravel(), phyrank.ravel()] = np.tile(np.arange(slots, dtype=np.int64), layers)
    return out


def _slot_ranks(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """Replica rank of each slot: how many earlier slots of its layer hold the same expert."""
    layers, slots = phy2log.shape
    order = np.argsort(phy2log, axis=1, kind="stable")
    sorted_e = np.take_along_axis(phy2log, order, axis=1)
    counts = np.zeros((layers, num_experts), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(layers), slots), phy2log.ravel()), 1)
    starts = np.cumsum(counts, axis=1) - counts
    rank_sorted = np.arange(slots)[None, :] - np.take_along_axis(starts, sorted_e, axis=1)
    ranks = np.empty_like(phy2log)
    np.put_along_axis(ranks, order, rank_sorted, axis=1)
    return ranks


def finish_plan(
    problem: Problem, phy2log: np.ndarray, logcnt: np.ndarray, phyrank: np.ndarray | None = None
) -> EplbPlan:
    """Build ``log2phy`` (replica ranks in slot order unless given) and convert to torch."""
    if phyrank is None:
        phyrank = _slot_ranks(phy2log, logcnt.shape[1])
    plan = EplbPlan(phy2log, _log2phy(phy2log, phyrank, logcnt), logcnt)
    if problem.torch_input:
        import torch  # only reached when the caller passed a torch tensor

        return EplbPlan(*(torch.from_numpy(np.ascontiguousarray(a)) for a in plan))
    return plan
