"""Exact reference solvers of the decode balancer (tests, benchmarks and the CLI only).

Brute force over every assignment of a tiny batch (``ranks ** requests`` of them), without
capacities and with every rank eligible, for the objectives of :func:`batch_objective`.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_int_array, check_choice

__all__ = [
    "OBJECTIVES",
    "ExactAssignment",
    "assign_exact",
    "batch_objective",
    "best_single_migration",
]

#: ``"max"``: ``max_r max(B_r/Bhat, S_r/Shat)``; ``"sum_of_squares"``: ``sum_r (B_r/Bhat)^2 +
#: (S_r/Shat)^2``; ``Bhat, Shat`` the means of the final state (a KV term with ``Shat = 0`` is 0).
OBJECTIVES = ("max", "sum_of_squares")


class ExactAssignment(NamedTuple):
    """An optimal assignment (``ranks`` in input order) and its objective ``value``."""

    ranks: np.ndarray
    value: float


def batch_objective(num_requests: Any, kv_tokens: Any, /, *, objective: str = "max") -> float:
    """Objective of a final per-rank state, normalised by its own means.

    Examples
    --------
    >>> batch_objective([2, 1], [100, 300])
    1.5
    >>> batch_objective([2, 1], [100, 300], objective="sum_of_squares")
    4.72
    """
    check_choice(objective, "objective", OBJECTIVES)
    b = as_int_array(num_requests, "num_requests", ndim=1, min_value=0, allow_empty=False)
    s = as_int_array(kv_tokens, "kv_tokens", shape=b.shape, min_value=0)
    bhat, shat = b.mean(), s.mean()
    xb = b / bhat if bhat > 0 else np.zeros(b.shape)
    xs = s / shat if shat > 0 else np.zeros(s.shape)
    if objective == "max":
        return float(max(xb.max(), xs.max()))
    return float((xb**2).sum() + (xs**2).sum())


def assign_exact(
    num_requests: Any, kv_tokens: Any, new_kv_tokens: Any, /, *, objective: str = "max"
) -> ExactAssignment:
    """Optimal assignment of a tiny batch by enumeration (lowest assignment in lexicographic
    order among optima).

    Runtime complexity: O(ranks ** requests × (requests + ranks)); keep ``ranks ** requests``
    below about 10**5.

    Examples
    --------
    >>> assign_exact([0, 0], [0, 0], [100, 50, 50]).ranks.tolist()
    [0, 1, 1]
    """
    check_choice(objective, "objective", OBJECTIVES)
    b0 = as_int_array(num_requests, "num_requests", ndim=1, min_value=0, allow_empty=False)
    s0 = as_int_array(kv_tokens, "kv_tokens", shape=b0.shape, min_value=0)
    kv = as_int_array(new_kv_tokens, "new_kv_tokens", ndim=1, min_value=0)
    n, m = b0.shape[0], kv.shape[0]
    if n**m > 10**6:
        raise ValueError(f"new_kv_tokens: {n}**{m} assignments are too many to enumerate")
    best_val, best = np.inf, None
    for choice in itertools.product(range(n), repeat=m):
        idx = np.asarray(choice, dtype=np.int64)
        b = b0 + np.bincount(idx, minlength=n)
        s = s0 + np.bincount(idx, weights=kv, minlength=n).astype(np.int64)
        val = batch_objective(b, s, objective=objective)
        if val < best_val - 1e-12:
            best_val, best = val, idx
    assert best is not None
    return ExactAssignment(best, float(best_val))


def best_single_migration(
    request_rank: Any,
    request_kv_tokens: Any,
    num_ranks: int,
    *,
    eligible: Any = None,
    max_batch: Any = None,
    max_kv_tokens: Any = None,
) -> tuple[float, int, int]:
    """Brute force over every single move of one request to another rank.

    Returns ``(objective after, request, rank)`` of the move with the lowest
    ``sum_r (B_r/Bhat)^2 + (S_r/Shat)^2`` (means over all ranks; a zero-mean term is 0), moves
    only to eligible ranks that stay within the capacities (``None`` = no limit, scalars
    apply to every rank); ``(objective now, -1, -1)`` when no move is allowed.
    """
    rank = [int(x) for x in request_rank]
    kv = [int(x) for x in request_kv_tokens]
    ok = [True] * num_ranks if eligible is None else [bool(x) for x in eligible]

    def cap(value: Any, r: int) -> float:
        if value is None:
            return float("inf")
        return float(value) if np.ndim(value) == 0 else float(value[r])

    def objective(ranks: list[int]) -> float:
        b = [0.0] * num_ranks
        s = [0.0] * num_ranks
        for r, t in zip(ranks, kv, strict=True):
            b[r] += 1
            s[r] += t
        out = 0.0
        for x in (b, s):
            mean = sum(x) / num_ranks
            if mean > 0:
                out += sum((v / mean) ** 2 for v in x)
        return out

    best = (objective(rank), -1, -1)
    b_now = [rank.count(r) for r in range(num_ranks)]
    s_now = [sum(t for q, t in zip(rank, kv, strict=True) if q == r) for r in range(num_ranks)]
    for i in range(len(rank)):
        for r in range(num_ranks):
            if r == rank[i] or not ok[r]:
                continue
            if b_now[r] + 1 > cap(max_batch, r) or s_now[r] + kv[i] > cap(max_kv_tokens, r):
                continue
            moved = rank.copy()
            moved[i] = r
            value = objective(moved)
            if value < best[0]:
                best = (value, i, r)
    return best
