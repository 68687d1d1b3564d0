"""``rebalance_experts``: the entry point of the expert-parallel load balancer (EPLB).

A drop-in for DeepSeek's ``eplb.rebalance_experts`` with a choice of method: ``"greedy"``
reproduces DeepSeek's published algorithm, ``"default"`` chooses replica counts and packing
jointly and is never worse than greedy on any layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from lbkit.core.validation import check_choice
from lbkit.eplb._plan import EplbPlan
from lbkit.eplb.balanced import balanced_rebalance
from lbkit.eplb.greedy import greedy_rebalance
from lbkit.eplb.replan import replan_experts

__all__ = ["DEFAULT_METHOD", "METHODS", "rebalance_experts"]

#: Planning methods; every one has the signature of :func:`rebalance_experts` minus ``method``.
METHODS: Mapping[str, Callable[..., EplbPlan]] = MappingProxyType(
    {"greedy": greedy_rebalance, "default": balanced_rebalance}
)

#: Method used when ``method`` is not given.
DEFAULT_METHOD = "default"


def rebalance_experts(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    method: str = DEFAULT_METHOD,
    policy: str | None = None,
    previous_phy2log: Any = None,
    max_moves: Any = None,
    workers: Any = None,
) -> EplbPlan:
    """Replicate experts into ``num_replicas`` slots and place the slots on GPUs.

    Parameters
    ----------
    weight : array_like or torch.Tensor, shape (layers, experts)
        Non-negative, finite load of each logical expert (e.g. routed tokens); integer or
        floating. At least one layer and one expert.
    num_replicas : int
        Physical slots per layer ``R``; a multiple of ``num_gpus`` and at least ``experts``.
    num_groups : int
        Expert groups (contiguous blocks of ``experts / num_groups`` experts); must divide
        ``experts``.
    num_nodes : int
        Server nodes; must divide ``num_gpus`` (GPU ``g`` is on node ``g // (num_gpus /
        num_nodes)``).
    num_gpus : int
        GPUs; each holds ``S = R / num_gpus`` slots, slots ``g*S .. (g+1)*S-1`` on GPU ``g``.
    method : {"default", "greedy"}
        A key of :data:`METHODS`.
    policy : {None, "global", "hierarchical"}
        ``None`` follows DeepSeek: hierarchical when ``num_nodes`` divides ``num_groups``, else
        global. Hierarchical keeps every group, with all replicas of its experts, on one node;
        forcing it requires ``num_nodes`` to divide ``num_groups``.
    previous_phy2log : array_like of int, shape (layers, num_replicas), optional
        The plan in service. When given, the new plan keeps what it can of it and moves few
        replicas (:func:`lbkit.eplb.replan_experts`, which also returns the move list and
        offers a total budget and tolerances); ``method`` then does not apply.
    max_moves : int or array_like of int, shape (layers,), optional
        With ``previous_phy2log``: at most this many replica moves per layer.
    workers : int, optional
        Threads that plan blocks of layers (default: the CPUs this process may run on). The
        layers are independent and the compiled kernels release the GIL, so the plan is the
        same for every value; while the kernels are not compiled yet, one thread is used.

    Returns
    -------
    EplbPlan
        ``(phy2log [L, R], log2phy [L, E, K], logcnt [L, E])`` as ``int64`` numpy arrays, or
        CPU ``torch`` tensors when ``weight`` is a tensor (torch is imported only then).

    Raises
    ------
    TypeError
        ``weight`` is not numeric, or a size is not an integer.
    ValueError
        Wrong shape (including zero layers or experts), NaN, infinite or negative loads, sizes
        that do not divide as stated above, ``num_replicas < experts``, unknown ``method`` or
        ``policy``, or a hierarchical policy the sizes do not allow.

    Runtime complexity: see :func:`lbkit.eplb.greedy.greedy_rebalance` and
    :func:`lbkit.eplb.balanced.balanced_rebalance`.

    Examples
    --------
    >>> from lbkit.eplb import rebalance_experts, moe_lb
    >>> weight = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    ...           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    >>> phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8, method="greedy")
    >>> phy2log[0]
    array([ 5,  6,  5,  7,  8,  4,  3,  4, 10,  9, 10,  2,  0,  1, 11,  1])
    >>> greedy = moe_lb(weight, phy2log, num_gpus=8)
    >>> best = moe_lb(weight, rebalance_experts(weight, 16, 4, 2, 8).phy2log, num_gpus=8)
    >>> bool((best <= greedy).all())
    True
    """
    check_choice(method, "method", tuple(METHODS))
    if previous_phy2log is not None:
        return replan_experts(
            weight,
            previous_phy2log,
            num_replicas,
            num_groups,
            num_nodes,
            num_gpus,
            policy=policy,
            max_moves=max_moves,
            workers=workers,
        ).plan
    if max_moves is not None:
        raise ValueError("max_moves: applies only with previous_phy2log (a plan to re-plan from)")
    return METHODS[method](
        weight, num_replicas, num_groups, num_nodes, num_gpus, policy=policy, workers=workers
    )
