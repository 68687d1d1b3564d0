"""The per-rank chunk plan: how many tokens of each head request one step runs.

A rank dequeues its requests first in, first out. One step under a time budget ``tau`` pays the
fixed cost ``a`` once, then takes the head requests in order: each gets the largest chunk that
fits the budget left (``QuadraticCost.solve_chunk`` on its prefix = cached + already prefilled
tokens), capped at what remains of it. A request that fits entirely is scheduled whole and the
next one is considered; the first that does not fit gets the partial chunk that fits (rounded down
to ``align``, and only if it is at least ``min_chunk``) and ends the step. So only the last
scheduled request may be partial, which keeps every other request's KV contiguous and finished.

If nothing fits, the head request still gets ``min_chunk`` tokens (or its whole remainder if that
is smaller): the progress guarantee, so that a budget below one token's cost cannot stall the
queue. The plan is flagged as a budget overrun when that chunk exceeds the budget (it always does
with ``align = 1``; with ``align > 1`` a misaligned chunk that fits may have been left out).

The rank plans for a balanced engine (``QuadraticCost.predict``): its tokens cost
``b + b_moe * moe_lb`` each, the routed experts' share included.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.validation import as_int_array, check_int, check_real

__all__ = ["ChunkPlan", "plan_chunks"]


class ChunkPlan(NamedTuple):
    """Result of :func:`plan_chunks`.

    Attributes
    ----------
    chunk_tokens : ndarray of int64, shape (scheduled,)
        Tokens of each scheduled head request, in queue order; all but the last are whole.
    step_time_s : float
        Predicted step time ``a + sum of chunk work``, seconds (0.0 for an empty queue).
    overrun : bool
        True when the progress guarantee forced a chunk beyond the budget
        (``step_time_s > budget_s``); never otherwise.
    """

    chunk_tokens: np.ndarray
    step_time_s: float
    overrun: bool


def _work(cost: QuadraticCost, c: int, p: int) -> float:
    # A chunk's share of the step in a balanced engine (QuadraticCost.predict without ``a``):
    # local work plus the routed experts' b_moe * moe_lb per token; with b_moe = 0 (b + 0.0 == b)
    # the formula of QuadraticCost.work, evaluated on Python scalars in the same order.
    return (
        c * (cost.linear_s_per_token + cost.k * p + cost.q * c) + cost.gamma * p if c > 0 else 0.0
    )


def _plan_chunks_iv(remaining_tokens, prefix_tokens, cost, budget_s, min_chunk, align):
    rem = as_int_array(remaining_tokens, "remaining_tokens", ndim=1, min_value=1)
    pre = as_int_array(prefix_tokens, "prefix_tokens", ndim=1, min_value=0)
    if pre.shape != rem.shape:
        raise ValueError(
            f"prefix_tokens: must have the length of remaining_tokens ({rem.shape[0]}), "
            f"got {pre.shape[0]}"
        )
    if not isinstance(cost, QuadraticCost):
        raise TypeError(f"cost: must be a QuadraticCost, got {type(cost).__name__}")
    budget = check_real(budget_s, "budget_s", min_value=0.0)
    min_chunk = check_int(min_chunk, "min_chunk", min_value=1)
    align = check_int(align, "align", min_value=1)
    return rem, pre, budget, min_chunk, align


def plan_chunks(
    remaining_tokens: Any,
    prefix_tokens: Any,
    /,
    *,
    cost: QuadraticCost,
    budget_s: float,
    min_chunk: int = 1,
    align: int = 1,
) -> ChunkPlan:
    """Plan one step of a rank's FIFO queue under a time budget.

    Parameters
    ----------
    remaining_tokens : array_like of int, shape (n,)
        Tokens still to prefill of each queued request, head first (each >= 1).
    prefix_tokens : array_like of int, shape (n,)
        Tokens of each request already in KV (cached prefix + prefilled so far).
    cost : QuadraticCost
        Step-cost model of the rank.
    budget_s : float
        Time budget of the step, seconds (including the fixed cost).
    min_chunk : int, default 1
        Smallest partial chunk worth scheduling; also the progress chunk.
    align : int, default 1
        Partial chunks are rounded down to a multiple of ``align`` (whole remainders are not).

    Returns
    -------
    ChunkPlan
        Chunk per scheduled head request, predicted step time and the overrun flag.
        Among the FIFO schedules in which only the last request may be partial, the plan runs
        the most tokens without exceeding the budget (taking a request whole always beats
        cutting it, since nothing may follow a cut).

    Runtime complexity: O(scheduled requests).

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> cost = PRESETS["unit"].prefill  # a = 1 s, b = 1 s/token, ...
    >>> p = plan_chunks([100, 500, 800], [0, 0, 0], cost=cost, budget_s=400.0)
    >>> p.chunk_tokens, round(p.step_time_s, 3), p.overrun
    (array([100, 260]), 399.8, False)
    >>> plan_chunks([50], [0], cost=cost, budget_s=0.5, min_chunk=8)
    ChunkPlan(chunk_tokens=array([8]), step_time_s=9.032, overrun=True)
    """
    rem, pre, budget, min_chunk, align = _plan_chunks_iv(
        remaining_tokens, prefix_tokens, cost, budget_s, min_chunk, align
    )
    n = rem.shape[0]
    if n == 0:
        return ChunkPlan(np.zeros(0, dtype=np.int64), 0.0, False)
    variable = replace(cost, a=0.0)
    total = cost.a
    chunks: list[int] = []
    for i in range(n):
        r, p = int(rem[i]), int(pre[i])
        left = budget - total
        c = min(int(variable.solve_chunk(left, p)), r) if left > 0 else 0
        # Exact against the running sum: the solver fits ``left = budget - total``, which
        # rounds, so a token more may still fit (or the last one may not).
        while c < r and total + _work(cost, c + 1, p) <= budget:
            c += 1
        while c > 0 and total + _work(cost, c, p) > budget:
            c -= 1
        if c < r:
            c = (c // align) * align
            if c >= min_chunk:
                chunks.append(c)
                total += _work(cost, c, p)
            break
        chunks.append(c)
        total += _work(cost, c, p)
    if not chunks:
        c = min(min_chunk, int(rem[0]))
        chunks.append(c)
        total = cost.a + _work(cost, c, int(pre[0]))
    return ChunkPlan(np.asarray(chunks, dtype=np.int64), float(total), total > budget)
