"""Balance of an EPLB plan (``moe_lb``) and a lower bound on the best achievable balance.

``moe_lb`` of a layer is ``max_g L_g / mean_g L_g`` with ``L_g = sum over the slots of GPU g of
w_e / c_e``. :func:`lower_bound` returns, per layer, a value that no valid plan can beat. For one
sub-problem (``E`` experts of loads ``w``, ``G`` GPUs of ``S`` slots, ``R = G S``) it is the
largest of these bounds on the largest GPU load ``M``, divided by the layer mean ``W / G``:

1. **Mean**: ``M >= W / G``.
2. **Largest replica** (``S = 1`` case of 3): a plan with ``M`` needs ``c_e >= max(1, ceil(w_e /
   M))``; bisection on ``M`` finds the smallest ``M`` with ``sum_e c_e <= R``.
3. **Slot bound**: the GPU holding a replica of size ``p`` holds ``S - 1`` other replicas, whose
   sizes add up to at least ``Q`` = the sum of the ``S - 1`` smallest replicas, so every replica
   must fit in ``M - Q``: ``c_e >= ceil(w_e / (M - Q))``. ``Q`` is bounded below without knowing
   the counts: with ``r_e`` the least counts and ``B = R - sum r_e`` spare slots, no expert has
   more than ``r_e + B`` replicas, each at least ``w_e / (r_e + B)``, so ``Q`` is at least the
   sum of the ``S - 1`` smallest of these values (with multiplicity ``r_e + B``). Raising ``Q``
   raises ``r`` and lowers ``B``; iterating to the fixed point gives a necessary condition that
   is monotone in ``M``, and bisection finds the smallest ``M`` that passes it.
4. **Large replicas**: no GPU holds two replicas larger than ``M / 2``. Each expert either keeps
   replicas above ``M / 2`` (at least ``r_e``, on ``r_e`` different GPUs, at most ``G`` in all)
   or needs ``s_e = max(r_e, ceil(2 w_e / M))`` replicas; the slots this saves are bounded by a
   fractional knapsack (weights ``r_e``, values ``s_e - r_e``, capacity ``G``), and ``M`` fails
   when even then more than ``R`` slots are needed. Checked inside the bisection of 3.

Hierarchical policy: a group-to-node partition fixes each node's experts, ``R / num_nodes`` slots
and ``G / num_nodes`` GPUs; the layer's bound is the minimum over all partitions of the largest
node bound (enumerated exactly over subsets of groups when ``num_groups <= 12``; with more groups,
the best largest node load divided by GPUs per node when the branch and bound proves it), and at
least the global bound. It includes the node-level imbalance that the group constraint forces.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core import metrics
from lbkit.eplb import _bound_kernels as _kernels
from lbkit.eplb._plan import rebalance_iv

__all__ = ["lower_bound", "moe_lb"]


def moe_lb(weight: Any, phy2log: Any, /, *, num_gpus: int) -> np.ndarray:
    """Per-layer ``moe_lb`` = max GPU load / mean GPU load of a plan (1.0 for an idle layer).

    Same as :func:`lbkit.core.metrics.moe_lb`; torch tensors are accepted.

    Parameters
    ----------
    weight : array_like, shape (layers, experts)
        Load of each logical expert.
    phy2log : array_like of int, shape (layers, slots)
        Expert held by each slot; GPU ``g`` holds slots ``g*S .. (g+1)*S-1``.
    num_gpus : int
        Number of GPUs; must divide ``slots``.

    Returns
    -------
    ndarray of float64, shape (layers,)

    Runtime complexity: O(layers × slots).

    Examples
    --------
    >>> moe_lb([[3.0, 1.0]], [[0, 1, 0, 0]], num_gpus=2)
    array([1.])
    """
    return metrics.moe_lb(weight, phy2log, num_gpus=num_gpus)


def lower_bound(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    policy: str | None = None,
) -> np.ndarray:
    """Per-layer lower bound on ``moe_lb`` over every valid plan (see the module docstring).

    Parameters are those of :func:`lbkit.eplb.rebalance_experts` (same validation and policy
    rule).

    Returns
    -------
    ndarray of float64, shape (layers,)
        ``>= 1``; exactly 1.0 for an idle layer.

    Runtime complexity: O(layers × B × F × E log E) for ``B`` bisection steps (<= 100) and ``F``
    fixed-point steps; hierarchical with ``k`` groups on ``n`` nodes multiplies by the number of
    ``k / n``-subsets of groups.

    Examples
    --------
    One hot expert and 6 slots on 3 GPUs: a replica of 50 shares its GPU with one of at least 1.

    >>> lower_bound([[100.0, 1.0, 1.0, 1.0, 1.0]], 6, 1, 1, 3)
    array([1.4711...])
    """
    problem = rebalance_iv(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    w = problem.weight
    out = np.empty(w.shape[0])
    _kernels.lower_bound_layers(
        w, problem.num_replicas, problem.num_groups, problem.num_nodes, problem.num_gpus, out
    )
    mean = w.sum(axis=1) / problem.num_gpus
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(mean > 0, out / np.where(mean > 0, mean, 1.0), 1.0)
    return np.maximum(ratio, 1.0)
