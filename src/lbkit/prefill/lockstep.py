"""Rank choice for engines that step in lockstep: the earliest estimated finish.

An engine with data-parallel attention and expert-parallel MoE runs all its ranks together: a
step lasts as long as its slowest rank, and every rank takes one chunk of its FIFO queue per
step, sized to a step time budget. So the time a request waits depends on its engine, not only
on its rank. A short prompt put on an idle rank of a busy engine waits for whole steps paced by a
sibling's long chunks; the same prompt on an idle engine finishes in its own time. The plain
least-load rule (:func:`lbkit.prefill.pick_rank`) sees no difference between the two, and breaks
its many ties at zero load by the lowest index: it crowds a quiet pool onto its first engines,
where short prompts share steps with long ones.

This rule scores each rank by when the request would finish there, then adds a charge for
lengthening its engine's work:

- ``x = work_s[r] + request_s[r]``: the rank's queue with the request at its end, in seconds of
  step time on a busy engine (the router's remaining local work of the queue plus the routed-expert
  share of its tokens, as :meth:`lbkit.core.QuadraticCost.predict` plans for a balanced engine);
- ``top = max work_s`` over the rank's engine; on an idle engine (no request anywhere on it) the
  request finishes after ``x``; on a busy one the rank's ``ceil(x / B)`` chunks each take a step
  of up to the budget ``B``, and steps are no longer than the engine's work lasts, so it finishes
  after ``finish = min(max(x, top), ceil(x / B) * B)``;
- ``score = left + finish + weight * max(0, x - top)``: the engine's work grows by
  ``max(0, x - top)``, and every later request of that engine waits in its longer steps.
  Lengthening a busy engine also delays the requests already sharing its steps, so it weighs
  ``growth_weight``; waking an idle engine weighs ``idle_growth_weight`` (smaller: with per-rank
  prefix caches a larger one sends requests away from the busy rank that holds their prefix).
- ``left``: the seconds until the engine's running step ends, when the engine reports its steps
  (``0`` otherwise). A request routed during a step joins the next one, so it first waits out
  the rest of the running step; engines that step in lockstep are out of phase with each
  other, so a short prompt finishes soonest on the engine whose step ends next. Without step
  reports the rule cannot tell the phases apart (``left = 0`` everywhere) and, on a pool where
  every engine is busy, a short prompt waits for up to a whole step more than it needs (built-in
  workload, 8 x 8 ranks, 8 requests/s: 0.9818 of requests meet their SLO without step reports,
  0.9993 with them).

The least score wins; ties go to the lowest flat index. With prefix caches ``request_s`` differs
per rank (a rank holding the request's prefix computes fewer tokens), so the same score trades
prefix affinity against load with the real cost model.

Runtime complexity: O(engines * ranks), one pass.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lbkit.core._jit import jit
from lbkit.core.validation import as_float_array, check_real, to_numpy

__all__ = ["lockstep_rank"]

#: Entries of the coefficient vector of :func:`lockstep_scored`: the cost model's local
#: per-token, per-(token x prefix token), per-token-squared and per-cached-token coefficients,
#: the routed-expert seconds per token of a balanced engine, the step budget and the growth
#: weights of busy and idle engines.
C_B, C_K, C_Q, C_GAMMA, C_MOE, C_BUDGET, C_GROWTH, C_IDLE_GROWTH = range(8)
N_COEF = 8


@jit
def _finish(x, top, busy, budget):
    if not busy:
        return x
    steps = math.ceil(x / budget) * budget
    paced = x if x > top else top
    return paced if paced < steps else steps


@jit
def _score(x, top, busy, budget, growth, idle_growth):
    """The rule's score of a rank whose queue with the request lasts ``x`` (module docstring)."""
    v = _finish(x, top, busy, budget)
    if x > top:
        v += (growth if busy else idle_growth) * (x - top)
    return v


@jit
def lockstep_scored(work, count, lo, hi, ranks, total, hit, hit0, coef, ends, now):
    """Lockstep choice over the slots ``lo:hi`` (whole engines of ``ranks`` contiguous slots).

    ``work[s]`` is a slot's queued work in step seconds, ``count[s]`` its requests (an engine
    is busy when any of its slots holds one). The request has ``total`` prompt tokens and, on
    slot ``s``, ``hit[s]`` of them cached (``hit0`` everywhere when ``hit`` is empty); its
    cost on a slot is the local quota of its uncached tokens plus their routed-expert time.
    ``ends[s // ranks]`` is when the running step of the engine at slot ``s`` ends, so that
    ``max(0, ends[s // ranks] - now)`` of it is left (``ends`` empty: no step reports).
    Returns ``(k, score, cached)``: the offset from ``lo`` of the lowest score (ties: the
    lowest slot), that score and the request's cached tokens there. O(hi - lo).
    """
    b = coef[C_B]
    kk = coef[C_K]
    q = coef[C_Q]
    gamma = coef[C_GAMMA]
    moe = coef[C_MOE]
    budget = coef[C_BUDGET]
    growth = coef[C_GROWTH]
    idle_growth = coef[C_IDLE_GROWTH]
    uniform = hit.shape[0] == 0
    phased = ends.shape[0] > 0
    best_k = -1
    best = np.inf
    best_hit = hit0
    for e0 in range(lo, hi, ranks):
        top = work[e0]
        busy = False
        for s in range(e0, e0 + ranks):
            if work[s] > top:
                top = work[s]
            if count[s] > 0:
                busy = True
        wait = 0.0
        if phased and ends[e0 // ranks] > now:
            wait = ends[e0 // ranks] - now
        for s in range(e0, e0 + ranks):
            p = hit0 if uniform else hit[s]
            rem = total - p
            w = rem * (b + kk * p + q * rem) + gamma * p + moe * rem if rem > 0 else 0.0
            v = wait + _score(work[s] + w, top, busy, budget, growth, idle_growth)
            if v < best:
                best = v
                best_k = s - lo
                best_hit = p
    return best_k, best, best_hit


@jit
def _lockstep_flat(work, busy, left, request, ranks, budget, growth, idle_growth):
    """:func:`lockstep_rank` on clean arrays: ``work`` and ``request`` of shape (n,), ``busy``
    and ``left`` of shape (n // ranks,)."""
    best_k = -1
    best = np.inf
    for e in range(work.shape[0] // ranks):
        e0 = e * ranks
        top = work[e0]
        for s in range(e0 + 1, e0 + ranks):
            if work[s] > top:
                top = work[s]
        for s in range(e0, e0 + ranks):
            v = left[e] + _score(work[s] + request[s], top, busy[e], budget, growth, idle_growth)
            if v < best:
                best = v
                best_k = s
    return best_k


def lockstep_rank(
    work_s: Any,
    request_s: Any,
    /,
    *,
    busy: Any = None,
    step_left_s: Any = None,
    step_budget_s: float = 1.0,
    growth_weight: float = 0.6,
    idle_growth_weight: float = 0.1,
) -> int:
    """Flat index of the rank where a request finishes first, engines stepping in lockstep.

    Parameters
    ----------
    work_s : array_like of float, shape (engines, ranks)
        Queued work per rank, seconds of step time on a busy engine (>= 0).
    request_s : float or array_like of float, shape (engines, ranks)
        The request's own work on each rank, seconds (>= 0); an array when ranks hold
        different cached prefixes of it.
    busy : array_like of bool, shape (engines,), optional
        Engines holding at least one request. Default: engines with positive work somewhere.
    step_left_s : array_like of float, shape (engines,), optional
        Seconds until each engine's running step ends (>= 0; 0 for an engine between steps).
        Default: zeros (no step reports).
    step_budget_s : float, default 1.0
        The engines' step time budget, seconds (> 0).
    growth_weight : float, default 0.6
        Seconds of score per second the request adds to a busy engine's most loaded rank (>= 0).
    idle_growth_weight : float, default 0.1
        The same for an idle engine (>= 0).

    Returns
    -------
    int
        ``engine * ranks + rank`` with the lowest score (see the module docstring); ties go to
        the lowest flat index.

    Runtime complexity: O(engines * ranks).

    Examples
    --------
    Engine 0 is busy (rank 0 holds 5 s of work); a 0.3 s prompt finishes in one 1 s step on its
    idle rank 1, but in 0.3 s on idle engine 1:

    >>> lockstep_rank([[5.0, 0.0], [0.0, 0.0]], 0.3)
    2
    >>> lockstep_rank([[5.0, 0.0], [0.0, 0.0]], 0.3, idle_growth_weight=5.0)
    1

    A rank holding most of the prompt's prefix wins although its engine is busier:

    >>> lockstep_rank([[0.5, 0.0], [0.0, 0.0]], [[0.2, 2.0], [2.0, 2.0]])
    0

    Two busy engines, their steps out of phase: the short prompt goes to the engine whose
    running step ends first.

    >>> lockstep_rank([[3.0, 0.0], [3.0, 0.0]], 0.1, step_left_s=[0.9, 0.2])
    3
    """
    work = as_float_array(work_s, "work_s", allow_empty=False, nonnegative=True)
    if work.ndim != 2:
        raise ValueError(f"work_s: must be 2-D (engines, ranks), got shape {work.shape}")
    req = as_float_array(request_s, "request_s", nonnegative=True)
    if req.ndim == 0:
        req = np.full(work.shape, float(req))
    elif req.shape != work.shape:
        raise ValueError(
            f"request_s: must be a scalar or have the shape of work_s {work.shape}, got {req.shape}"
        )
    if busy is None:
        on = work.max(axis=1) > 0.0
    else:
        on = to_numpy(busy, "busy")
        if on.dtype != np.bool_:
            raise TypeError(f"busy: must be a boolean array, got dtype {on.dtype}")
        if on.shape != (work.shape[0],):
            raise ValueError(f"busy: must have shape ({work.shape[0]},), got {on.shape}")
    if step_left_s is None:
        left = np.zeros(work.shape[0])
    else:
        left = as_float_array(step_left_s, "step_left_s", shape=(work.shape[0],),
                              nonnegative=True)  # fmt: skip
    budget = check_real(step_budget_s, "step_budget_s", min_value=0.0, strict_min=True)
    growth = check_real(growth_weight, "growth_weight", min_value=0.0)
    idle_growth = check_real(idle_growth_weight, "idle_growth_weight", min_value=0.0)
    return int(
        _lockstep_flat(
            np.ascontiguousarray(work.ravel()),
            np.ascontiguousarray(on),
            np.ascontiguousarray(left, dtype=np.float64),
            np.ascontiguousarray(req.ravel(), dtype=np.float64),
            work.shape[1],
            budget,
            growth,
            idle_growth,
        )
    )


def warmup() -> None:
    """Compile this module's kernels on tiny inputs."""
    work = np.array([1.0, 0.0, 0.0, 0.0])
    count = np.array([1, 0, 0, 0], dtype=np.int64)
    coef = np.array([1e-4, 0.0, 0.0, 0.0, 1e-4, 1.0, 0.6, 0.1])
    none = np.zeros(0)
    lockstep_scored(work, count, 0, 4, 2, 100, np.zeros(0, dtype=np.int64), 0, coef, none, 0.0)
    lockstep_scored(work, count, 0, 4, 2, 100, np.zeros(4, dtype=np.int64), 0, coef, none, 0.0)
    _lockstep_flat(work, np.array([True, False]), np.zeros(2), np.full(4, 0.5), 2, 1.0, 0.6, 0.1)
