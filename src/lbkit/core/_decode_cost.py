"""The decode step-cost model :class:`DecodeCost`.

Part of :mod:`lbkit.core.cost` (import :class:`DecodeCost` from there), whose docstring states
the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from lbkit.core._cost_common import check_moe, per_rank, scalar_or_array, shared_s_of
from lbkit.core.validation import as_float_array, check_choice, check_real

__all__ = ["DecodeCost"]


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """Decode step cost of one rank with ``B`` requests holding ``S`` KV tokens.

    Local work ``b*B + k*S`` (``combine="sum"``) or ``max(b*B, k*S)`` (``combine="max"``: two
    micro-batches overlap attention against MoE and communication); every rank of an engine of
    ``R`` ranks also pays the shared routed-expert cost ``b_moe * moe_lb * sum_r B_r / R``.
    Rank time ``T_r = a + local_r + shared``; the engine's step takes ``max_r T_r``.

    Parameters
    ----------
    a : float
        Fixed cost of a step, seconds.
    b : float
        Local seconds per running request (its token's MLA projections, dense layers, shared
        expert, LM head, and its side of the all-to-all).
    k : float
        Seconds per KV token attended.
    combine : {"sum", "max"}, default "sum"
    b_moe : float, default 0
        Routed-expert seconds per request as if one GPU did all of it.
    moe_lb : float, default 1
        EPLB imbalance ``max GPU load / mean GPU load`` of the routed experts (>= 1).

    Examples
    --------
    >>> DecodeCost(a=1.0, b=1.0, k=0.001).step_time(10, 5000)
    16.0
    >>> DecodeCost(a=1.0, b=1.0, k=0.001, combine="max").step_time([10, 2], [5000, 100])
    array([11.,  3.])
    >>> moe = DecodeCost(a=1.0, b=1.0, k=0.001, b_moe=0.5, moe_lb=1.2)
    >>> moe.step_time(10, 5000), moe.engine_step_s([10, 2], [5000, 100])  # shared 0.6 * 12 / 2
    (22.0, 19.6)
    """

    a: float
    b: float
    k: float
    combine: str = "sum"
    b_moe: float = 0.0
    moe_lb: float = 1.0

    def __post_init__(self) -> None:
        for field in ("a", "b", "k"):
            object.__setattr__(self, field, check_real(getattr(self, field), field, min_value=0.0))
        check_choice(self.combine, "combine", ("sum", "max"))
        check_moe(self)

    @property
    def moe_s_per_token(self) -> float:
        """Effective shared seconds per request (one token each) of the engine, ``b_moe*moe_lb``."""
        return self.b_moe * self.moe_lb

    def _local(self, n: np.ndarray, s: np.ndarray) -> np.ndarray:
        if self.combine == "sum":
            return self.b * n + self.k * s
        return np.maximum(self.b * n, self.k * s)

    def step_time(self, num_requests: Any, kv_tokens: Any) -> Any:
        """Seconds of one decode step of a rank in a balanced engine; vectorised over ranks.

        Each element is a rank whose engine's ranks all run as many requests as it does, so its
        shared cost is ``b_moe * moe_lb * num_requests``: ``a + local + b_moe*moe_lb*B``.
        Arguments broadcast. See :meth:`engine_step_s` for an engine of unequal ranks.
        """
        n = as_float_array(num_requests, "num_requests", nonnegative=True)
        s = as_float_array(kv_tokens, "kv_tokens", nonnegative=True)
        return scalar_or_array(self.a + self._local(n, s) + self.moe_s_per_token * n)

    def shared_s(self, total_requests: Any, num_ranks: Any) -> Any:
        """Shared seconds every rank pays, ``b_moe * moe_lb * total_requests / num_ranks``.

        Examples
        --------
        >>> DecodeCost(a=1.0, b=1.0, k=0.0, b_moe=0.5, moe_lb=1.2).shared_s([64, 640], 64)
        array([0.6, 6. ])
        """
        return shared_s_of(self.moe_s_per_token, total_requests, num_ranks, "total_requests")

    def rank_step_s(self, num_requests: Any, kv_tokens: Any) -> np.ndarray:
        """Time ``T_r = a + local_r + shared`` of every rank of one engine step.

        Parameters
        ----------
        num_requests : array_like, shape (ranks,)
            Running requests ``B_r`` of each rank (at least one rank).
        kv_tokens : array_like, shape (ranks,)
            KV tokens ``S_r`` they hold; broadcasts against ``num_requests``.

        Returns
        -------
        ndarray of float64, shape (ranks,)

        Runtime complexity: O(ranks).

        Examples
        --------
        >>> DecodeCost(a=1.0, b=1.0, k=0.001, b_moe=0.5, moe_lb=1.2).rank_step_s([10, 2], 0)
        array([14.6,  6.6])
        """
        n = per_rank(num_requests, "num_requests")
        if n.ndim != 1:
            raise ValueError(f"num_requests: must have shape (ranks,), got shape {n.shape}")
        s = as_float_array(kv_tokens, "kv_tokens", nonnegative=True)
        if s.ndim > 1 or (s.ndim == 1 and s.shape != n.shape and s.shape != (1,)):
            raise ValueError(
                f"kv_tokens: must broadcast to the shape of num_requests {n.shape}, "
                f"got shape {s.shape}"
            )
        s = np.broadcast_to(s, n.shape)
        return self.a + self._local(n, s) + self.moe_s_per_token * n.sum() / n.shape[0]

    def engine_step_s(self, num_requests: Any, kv_tokens: Any) -> float:
        """Seconds of one synchronous engine step, ``max_r (a + local_r) + shared``.

        Same arguments as :meth:`rank_step_s`, of which this is the maximum.

        Examples
        --------
        >>> cost = DecodeCost(a=1.0, b=1.0, k=0.001, b_moe=0.5, moe_lb=1.2)
        >>> cost.engine_step_s([10, 2], [0, 0])
        14.6
        >>> cost.engine_step_s([4, 4], [800, 800]) == cost.step_time(4, 800)
        True
        """
        return float(self.rank_step_s(num_requests, kv_tokens).max())

    def with_combine(self, combine: str) -> DecodeCost:
        """The same coefficients (shared cost included) with another combiner."""
        return replace(self, combine=combine)
