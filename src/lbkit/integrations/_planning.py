"""Plan for a serving engine: re-plan from the engine's current map when it can be kept.

Engines hand a policy their current physical-to-logical map together with the new loads. The map
is the natural starting point of :func:`lbkit.eplb.replan_experts` (few replica moves), but an
engine's map is not always one that re-planning can start from:

- its width differs from ``num_replicas``: the engine is changing its slot count (vLLM's elastic
  scale-down passes the old map with the new, smaller ``num_replicas``);
- it holds ``-1``: slots not filled yet (vLLM pads new slots with ``-1`` when scaling up);
- under the hierarchical policy it splits a group across nodes, or puts unequal numbers of
  groups on the nodes: engines start from a linear placement (vLLM: experts in order, then the
  redundant slots ``i % experts``), which the hierarchical rule rarely accepts.

In these cases :func:`plan_for_engine` plans afresh (:func:`lbkit.eplb.rebalance_experts`).
Maps that no engine produces (wrong number of layers, entries outside ``[-1, experts)``, a
logical expert without a slot) raise ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.validation import as_int_array
from lbkit.eplb import EplbPlan, is_valid_placement, rebalance_experts, replan_experts

__all__ = ["EMPTY_SLOT", "is_torch", "plan_for_engine", "usable_previous"]

#: Entry of an engine's map for a slot that holds no expert yet.
EMPTY_SLOT = -1


def _log2phy_logcnt(phy2log: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(log2phy, logcnt)`` of a map, replicas listed in slot order."""
    layers, slots = phy2log.shape
    rows = np.repeat(np.arange(layers), slots)
    logcnt = np.zeros((layers, experts), dtype=np.int64)
    np.add.at(logcnt, (rows, phy2log.ravel()), 1)
    order = np.argsort(phy2log, axis=1, kind="stable")
    by_expert = np.take_along_axis(phy2log, order, axis=1)
    starts = np.cumsum(logcnt, axis=1) - logcnt
    replica = np.arange(slots)[None, :] - np.take_along_axis(starts, by_expert, axis=1)
    log2phy = np.full((layers, experts, int(logcnt.max())), EMPTY_SLOT, dtype=np.int64)
    log2phy[rows, by_expert.ravel(), replica.ravel()] = order.ravel()
    return log2phy, logcnt


def usable_previous(
    previous: Any,
    /,
    *,
    name: str,
    layers: int,
    experts: int,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: str | None,
) -> np.ndarray | None:
    """The engine's map as an ``int64`` array if re-planning can start from it, else ``None``.

    Parameters
    ----------
    previous : array_like of int or torch.Tensor, shape (layers, slots), or None
        The engine's current physical-to-logical map.
    name : str
        The engine's name for the argument, used in error messages.
    layers, experts : int
        Shape of the new loads.
    num_replicas, num_groups, num_nodes, num_gpus : int
        Sizes of the new plan (validated by the caller).
    policy : {None, "global", "hierarchical"}
        As in :func:`lbkit.eplb.rebalance_experts`.

    Returns
    -------
    ndarray of int64, shape (layers, num_replicas), or None
        ``None`` when ``previous`` is ``None`` or is one of the engine states listed in the
        module docstring.

    Raises
    ------
    TypeError
        ``previous`` does not hold integers.
    ValueError
        ``previous`` is not 2-D, has another number of layers than the loads, names an expert
        outside ``[-1, experts)``, or (without ``-1`` entries) leaves a logical expert without a
        slot.

    Runtime complexity: O(layers × (slots log slots + experts × K)) for ``K`` the largest
    replica count, plus the hierarchical check's O(layers × slots) loop.

    Examples
    --------
    >>> sizes = dict(layers=1, experts=3, num_replicas=4, num_groups=1, num_nodes=1, num_gpus=2)
    >>> usable_previous([[0, 1, 2, 0]], name="old", policy=None, **sizes)
    array([[0, 1, 2, 0]])
    >>> usable_previous([[0, 1, 2, -1]], name="old", policy=None, **sizes) is None
    True
    """
    if previous is None:
        return None
    prev = as_int_array(previous, name, ndim=2)
    if prev.shape[0] != layers:
        raise ValueError(
            f"{name}: must have one row per layer of the loads ({layers}), got shape {prev.shape}"
        )
    if prev.shape[1] != num_replicas:
        return None
    if prev.size and (prev.min() < EMPTY_SLOT or prev.max() >= experts):
        bad = np.argwhere((prev < EMPTY_SLOT) | (prev >= experts))[0]
        raise ValueError(
            f"{name}: entries must be logical experts in [0, {experts}) or -1 for an empty slot "
            f"(layer {bad[0]}, slot {bad[1]} holds {prev[bad[0], bad[1]]})"
        )
    if (prev == EMPTY_SLOT).any():
        return None
    log2phy, logcnt = _log2phy_logcnt(prev, experts)
    if (logcnt == 0).any():
        layer, expert = (int(i) for i in np.argwhere(logcnt == 0)[0])
        raise ValueError(
            f"{name}: every logical expert needs a slot (layer {layer} has none of expert {expert})"
        )
    sizes = dict(num_experts=experts, num_gpus=num_gpus, num_groups=num_groups, policy=policy)
    if not is_valid_placement(prev, log2phy, logcnt, num_nodes=num_nodes, **sizes):
        return None
    return prev


def plan_for_engine(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    previous: Any,
    previous_name: str,
    policy: str | None,
    method: str,
    tolerance: float | None,
    tolerance_scope: str,
    as_torch: bool,
) -> EplbPlan:
    """Re-plan from ``previous`` when :func:`usable_previous` accepts it, else plan afresh.

    Parameters
    ----------
    weight : ndarray of float64, shape (layers, experts)
        New loads, validated by the caller (finite, non-negative).
    num_replicas, num_groups, num_nodes, num_gpus : int
        As in :func:`lbkit.eplb.rebalance_experts`.
    previous : array_like of int or torch.Tensor, shape (layers, slots), or None
        The engine's current map.
    previous_name : str
        The engine's name for ``previous`` (error messages).
    policy : {None, "global", "hierarchical"}
        As in :func:`lbkit.eplb.rebalance_experts`.
    method : str
        Fresh-plan method (a key of :data:`lbkit.eplb.METHODS`).
    tolerance, tolerance_scope
        As in :func:`lbkit.eplb.replan_experts`; ``tolerance=None`` keeps its default.
    as_torch : bool
        Return CPU ``torch`` tensors (torch is imported only then) instead of numpy arrays.

    Returns
    -------
    EplbPlan
        ``(phy2log [L, R], log2phy [L, E, K], logcnt [L, E])``, all ``int64``.

    Raises
    ------
    TypeError, ValueError
        What :func:`usable_previous`, :func:`lbkit.eplb.rebalance_experts` and
        :func:`lbkit.eplb.replan_experts` reject.

    Runtime complexity: that of :func:`lbkit.eplb.replan_experts` or
    :func:`lbkit.eplb.rebalance_experts`, plus :func:`usable_previous`.

    Examples
    --------
    >>> weight = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]], dtype=float)
    >>> knobs = dict(policy=None, method="default", tolerance=None, tolerance_scope="mean",
    ...              as_torch=False, previous_name="old")
    >>> fresh = plan_for_engine(weight, 16, 4, 2, 8, previous=None, **knobs)
    >>> again = plan_for_engine(weight, 16, 4, 2, 8, previous=fresh.phy2log, **knobs)
    >>> bool((again.phy2log == fresh.phy2log).all())  # same loads: nothing moves
    True
    """
    layers, experts = weight.shape
    prev = None
    if layers and experts:  # else rebalance_experts raises with its own message
        prev = usable_previous(
            previous,
            name=previous_name,
            layers=layers,
            experts=experts,
            num_replicas=num_replicas,
            num_groups=num_groups,
            num_nodes=num_nodes,
            num_gpus=num_gpus,
            policy=policy,
        )
    if prev is None:
        plan = rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_gpus, method=method, policy=policy
        )
    else:
        knobs = {} if tolerance is None else {"tolerance": tolerance}
        plan = replan_experts(
            weight,
            prev,
            num_replicas,
            num_groups,
            num_nodes,
            num_gpus,
            policy=policy,
            tolerance_scope=tolerance_scope,
            **knobs,
        ).plan
    if not as_torch:
        return plan
    import torch  # only reached when the engine passed torch tensors

    return EplbPlan(*(torch.from_numpy(np.ascontiguousarray(a)) for a in plan))


def is_torch(value: Any) -> bool:
    """``True`` for a ``torch.Tensor``, recognised without importing torch.

    Examples
    --------
    >>> is_torch(np.zeros(2))
    False
    """
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach")
