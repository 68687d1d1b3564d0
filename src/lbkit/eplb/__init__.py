"""Expert-parallel load balancing (EPLB): replicate hot experts and place replicas on GPUs.

:func:`rebalance_experts` is a drop-in for DeepSeek's ``eplb.rebalance_experts`` (same arguments
and ``(phy2log, log2phy, logcnt)`` result) with a choice of method (:data:`METHODS`):
``"greedy"`` reproduces DeepSeek's published algorithm, ``"default"`` chooses replica counts and
packing jointly and is never worse than greedy on any layer. :func:`moe_lb` measures a plan,
:func:`lower_bound` bounds what any plan can reach, :func:`check_placement` validates a plan.
:func:`read_expert_load` reads engines' load dumps (SGLang JSON, ``.npy``, CSV) and
:func:`synthetic_expert_load` draws seeded DeepSeek-V3-shaped loads.
:func:`replan_experts` re-plans for new loads while moving few replicas, and
:class:`EplbScheduler` accumulates load recordings and decides when re-planning pays.
"""

from lbkit.eplb._plan import EplbPlan
from lbkit.eplb.bounds import lower_bound, moe_lb
from lbkit.eplb.loads import ExpertLoad, logical_from_physical, read_expert_load
from lbkit.eplb.placement import check_placement, is_valid_placement
from lbkit.eplb.rebalance import DEFAULT_METHOD, METHODS, rebalance_experts
from lbkit.eplb.replan import (
    ExpertMoves,
    ReplanResult,
    ReplanTradeoff,
    apply_moves,
    replan_experts,
    replan_tradeoff,
)
from lbkit.eplb.scheduler import EplbScheduler, EplbSchedulerStats, RebalanceDecision
from lbkit.eplb.synthetic import drift, synthetic_expert_load

__all__ = [
    "DEFAULT_METHOD",
    "METHODS",
    "EplbPlan",
    "EplbScheduler",
    "EplbSchedulerStats",
    "ExpertLoad",
    "ExpertMoves",
    "RebalanceDecision",
    "ReplanResult",
    "ReplanTradeoff",
    "apply_moves",
    "check_placement",
    "drift",
    "is_valid_placement",
    "logical_from_physical",
    "lower_bound",
    "moe_lb",
    "read_expert_load",
    "rebalance_experts",
    "replan_experts",
    "replan_tradeoff",
    "synthetic_expert_load",
]
