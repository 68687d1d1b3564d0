"""numba kernels of the prefill balancer (clean arrays only; see ``apportion.py``).

Plain loops over ``float64`` demands and ``int64`` counts that also run with
``NUMBA_DISABLE_JIT=1``. Tie-breaks: the lowest index wins.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit

__all__ = [
    "divisor_apportion",
    "int_bounds",
    "least_engine",
    "least_scored",
    "partition_min_max",
    "roomy_slot",
    "warmup",
]


@jit
def divisor_apportion(demand, num_engines, lower, upper, offset, out):
    """Divisor-method apportionment with bounds, written into ``out``.

    Starts from ``out = lower`` and gives each further engine to the bucket with the largest
    priority ``demand[j] / (out[j] + offset)`` among buckets below their ``upper`` bound (lowest
    index on ties). ``offset`` 0 is Adams (a non-empty bucket with no engine has infinite
    priority), 0.5 Webster (Sainte-Laguë), 1 D'Hondt (Jefferson). A bucket without demand has
    priority 0. The caller guarantees ``sum(lower) <= num_engines <= sum(upper)``.
    """
    n = demand.shape[0]
    given = 0
    for j in range(n):
        out[j] = lower[j]
        given += lower[j]
    for _ in range(num_engines - given):
        best = -1
        best_p = -1.0
        for j in range(n):
            if out[j] >= upper[j]:
                continue
            d = out[j] + offset
            if demand[j] <= 0.0:
                p = 0.0
            elif d <= 0.0:
                p = np.inf
            else:
                p = demand[j] / d
            if p > best_p:
                best_p = p
                best = j
        out[best] += 1
    return out


@jit
def partition_min_max(demand, num_groups, starts):
    """Split ``demand`` into ``num_groups`` contiguous non-empty groups minimising the max sum.

    Dynamic programme over (groups, prefix length); the smallest split index wins ties. Writes
    the start index of each group into ``starts`` (length ``num_groups``) and returns the
    optimal maximum group sum. Requires ``1 <= num_groups <= len(demand)``.
    """
    n = demand.shape[0]
    best = np.full((num_groups + 1, n + 1), np.inf)
    split = np.zeros((num_groups + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for g in range(1, num_groups + 1):
        for i in range(g, n + 1):
            for k in range(g - 1, i):
                s = 0.0
                for t in range(k, i):
                    s += demand[t]
                v = best[g - 1, k]
                if s > v:
                    v = s
                if v < best[g, i]:
                    best[g, i] = v
                    split[g, i] = k
    i = n
    for g in range(num_groups, 0, -1):
        k = split[g, i]
        starts[g - 1] = k
        i = k
    return best[num_groups, n]


@jit
def _engine_top(load, e0, ranks):
    """Load of the most loaded of the ``ranks`` slots starting at ``e0`` (one engine)."""
    top = load[e0]
    for s in range(e0 + 1, e0 + ranks):
        if load[s] > top:
            top = load[s]
    return top


@jit
def least_scored(load, lo, hi, ranks, wake):
    """Routing choice over the slots ``lo:hi`` (whole engines of ``ranks`` contiguous slots).

    The score of a slot is its load, plus ``wake`` when every rank of its engine is at zero load
    (an idle engine). Returns ``(k, score, top)``: the offset from ``lo`` of the lowest score
    (ties: the lowest slot), that score and the most loaded rank of its engine. O(hi - lo).
    """
    best_k = -1
    best = np.inf
    best_top = 0.0
    for e0 in range(lo, hi, ranks):
        top = _engine_top(load, e0, ranks)
        pen = 0.0 if top > 0.0 else wake
        for s in range(e0, e0 + ranks):
            v = load[s] + pen
            if v < best:
                best = v
                best_k = s - lo
                best_top = top
    return best_k, best, best_top


@jit
def least_engine(load, lo, hi, ranks, wake):
    """Context-parallel choice over the slots ``lo:hi`` (whole engines of ``ranks`` slots).

    An engine's score is its mean load, plus ``wake`` when all its ranks are at zero load (an
    idle engine). Returns ``(k, score)``: the offset from ``lo`` of the least loaded slot (ties:
    the lowest) of the engine with the lowest score (ties: the lowest engine), and that score.
    O(hi - lo).
    """
    best_k = -1
    best = np.inf
    for e0 in range(lo, hi, ranks):
        total = 0.0
        top = load[e0]
        low = e0
        for s in range(e0, e0 + ranks):
            total += load[s]
            if load[s] < load[low]:
                low = s
            if load[s] > top:
                top = load[s]
        mean = total / ranks + (0.0 if top > 0.0 else wake)
        if mean < best:
            best = mean
            best_k = low - lo
    return best_k, best


@jit
def roomy_slot(load, end, ranks, quota):
    """The least loaded slot among ``0:end`` that can take ``quota`` more without exceeding its
    engine's most loaded rank (ties: the lowest slot), or -1. O(end)."""
    best = -1
    best_v = np.inf
    for e0 in range(0, end, ranks):
        top = _engine_top(load, e0, ranks)
        for s in range(e0, e0 + ranks):
            v = load[s]
            # ``v + quota <= top`` as stated (``v <= top - quota`` rounds differently at the
            # boundary: a rank exactly filling its engine's step is a hole)
            if v + quota <= top and v < best_v:
                best_v = v
                best = s
    return best


@jit
def int_bounds(values):
    """``(min, max)`` of a non-empty ``int64`` array in one pass (a router's per-rank cached
    tokens, checked on every route)."""
    lo = values[0]
    hi = values[0]
    for i in range(1, values.shape[0]):
        v = values[i]
        if v < lo:
            lo = v
        elif v > hi:
            hi = v
    return lo, hi


def warmup() -> None:
    """Compile every kernel of this module on tiny inputs."""
    int_bounds(np.array([3, 1, 2], dtype=np.int64))
    demand = np.array([3.0, 0.0, 1.0])
    out = np.zeros(3, dtype=np.int64)
    divisor_apportion(
        demand, 4, np.zeros(3, dtype=np.int64), np.full(3, 4, dtype=np.int64), 0.0, out
    )
    partition_min_max(demand, 2, np.zeros(2, dtype=np.int64))
    load = np.array([0.0, 1.0, 0.0, 0.0])
    least_scored(load, 0, 4, 2, 1.0)
    least_engine(load, 0, 4, 2, 1.0)
    roomy_slot(load, 4, 2, 0.5)
