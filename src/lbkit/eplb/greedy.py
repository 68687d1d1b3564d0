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
exactly as they do there, and the plans are identical. The only differences left are ties: the
published code's ``torch`` sorts and ``argmax`` do not promise an order among equal values, where
this method takes the lower index; and a group's load, which ``torch`` may sum in another order.
Replicas of one expert are equal, so ``log2phy`` may list an expert's slots in another order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.eplb import _kernels
from lbkit.eplb._plan import EplbPlan, _finish_plan, _rebalance_iv

__all__ = ["greedy_rebalance"]


def greedy_rebalance(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    policy: str | None = None,
) -> EplbPlan:
    """Plan replicas with DeepSeek's greedy algorithm (see the module docstring).

    Parameters and returns as in :func:`lbkit.eplb.rebalance_experts`.

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
    problem = _rebalance_iv(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    layers, experts = problem.weight.shape
    phy2log = np.empty((layers, problem.num_replicas), dtype=np.int64)
    phyrank = np.empty_like(phy2log)
    logcnt = np.empty((layers, experts), dtype=np.int64)
    _kernels.greedy_plan(
        problem.weight.astype(np.float32),
        problem.num_replicas,
        problem.num_groups,
        problem.num_nodes,
        problem.num_gpus,
        phy2log,
        phyrank,
        logcnt,
    )
    return _finish_plan(problem, phy2log, logcnt, phyrank)
