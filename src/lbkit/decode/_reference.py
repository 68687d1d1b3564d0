"""Exact reference solvers of the decode balancer (tests, benchmarks and the CLI only).

Brute force over every assignment of a tiny batch (``ranks ** requests`` of them), without
capacities and with every rank eligible, for the objectives of :func:`batch_objective`.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_int_array, check_choice

__all__ = ["OBJECTIVES", "ExactAssignment", "assign_exact", "batch_objective"]

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
