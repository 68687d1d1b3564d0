"""numba kernels of one prefill rank: its step plan, chunk costs, FIFO queue, time alone.

The plan is :func:`lbkit.prefill.plan_chunks`' algorithm (SPEC §2.5) over the prefill pool's
arrays (rows named in :mod:`lbkit.sim._prefill_layout`); the cost coefficients and options are
in ``P``. Plans use the linear cost ``P_B + P_MOE`` per token (a balanced engine: see
:mod:`lbkit.sim.engine`). Plain loops over clean arrays; nothing here validates (the callers,
:class:`lbkit.sim.prefill_pool.PrefillPool` and :mod:`lbkit.sim.ideal`, do).
"""

from __future__ import annotations

import math

import numpy as np

from lbkit.core._jit import jit
from lbkit.core._prefill_cost import MAX_CHUNK
from lbkit.sim._prefill_layout import (
    KI_HEAD,
    KI_TAIL,
    P_A,
    P_ALIGN,
    P_B,
    P_BUDGET,
    P_GAMMA,
    P_K,
    P_MIN_CHUNK,
    P_MOE,
    P_Q,
    P_RANKS,
    RI_NEXT,
    RI_PREFIX,
    RI_REM,
    RI_UNCACHED,
)

__all__ = [
    "append",
    "fit_chunk",
    "local_work",
    "plan_rank",
    "plan_rank_one",
    "plan_work",
    "prefill_alone",
    "solve_chunk",
]


@jit
def plan_work(P, c, p):
    """Planned work of a chunk of ``c`` tokens after a prefix of ``p`` (0 if ``c <= 0``).

    ``QuadraticCost.work`` with the linear coefficient of a balanced engine, ``b + moe`` (every
    rank runs as many tokens, so the shared work per own token is ``moe``), in the operation
    order of ``plan_chunks``' work (``b + 0.0`` is ``b``: ``moe = 0`` changes nothing). With
    ``c`` a request's remaining tokens, its planned work left (work sharing's level).
    """
    if c <= 0:
        return 0.0
    return c * (P[P_B] + P[P_MOE] + P[P_K] * p + P[P_Q] * c) + P[P_GAMMA] * p


@jit
def solve_chunk(P, budget, p):
    """The largest chunk after a prefix of ``p`` whose planned work fits ``budget`` seconds:
    ``QuadraticCost.solve_chunk`` with ``a = 0`` (the variable model ``plan_chunks`` uses),
    align 1, unbounded by the request's tokens (the root of the quadratic, corrected by up to
    three tokens each way, then by bisection where that was not enough)."""
    slack = budget - P[P_GAMMA] * p
    if not slack > 0.0:
        return 0
    beta = P[P_B] + P[P_MOE] + P[P_K] * p
    root = 2.0 * slack / (beta + math.sqrt(beta * beta + 4.0 * P[P_Q] * slack))
    c = np.int64(math.floor(min(root, float(MAX_CHUNK))))
    for _ in range(3):
        c1 = c + 1
        if plan_work(P, c1, p) <= budget:
            c = c1
    for _ in range(3):
        if c > 0 and plan_work(P, c, p) > budget:
            c -= 1
    if (c > 0 and plan_work(P, c, p) > budget) or (
        c < MAX_CHUNK and plan_work(P, c + 1, p) <= budget
    ):
        lo = np.int64(0)  # no chunk: always possible
        hi = np.int64(MAX_CHUNK + 1)  # does not fit
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if plan_work(P, mid, p) <= budget:
                lo = mid
            else:
                hi = mid
        c = lo
    return c


@jit
def plan_rank(RI, P, head):
    """Plan one step of the FIFO queue starting at ``head``: (count, last chunk, step time).

    Mirrors :func:`lbkit.prefill.plan_chunks`: the fixed cost once, then each head request the
    largest chunk that fits the budget left (only the last may be partial, aligned down, and at
    least ``min_chunk``); if nothing fits, ``min_chunk`` tokens of the head (progress guarantee).
    """
    if head < 0:
        return 0, 0, 0.0
    budget = P[P_BUDGET]
    align = np.int64(P[P_ALIGN])
    min_chunk = np.int64(P[P_MIN_CHUNK])
    total = P[P_A]
    count = 0
    last = 0
    i = head
    while i >= 0:
        r = RI[RI_REM, i]
        p = RI[RI_PREFIX, i]
        left = budget - total
        c = 0
        if left > 0:
            c = solve_chunk(P, left, p)
            if c > r:
                c = r
        while c < r and total + plan_work(P, c + 1, p) <= budget:
            c += 1
        while c > 0 and total + plan_work(P, c, p) > budget:
            c -= 1
        if c < r:
            c = (c // align) * align
            if c >= min_chunk:
                count += 1
                last = c
                total += plan_work(P, c, p)
            break
        count += 1
        last = c
        total += plan_work(P, c, p)
        i = RI[RI_NEXT, i]
    if count == 0:
        r = RI[RI_REM, head]
        c = min_chunk if min_chunk < r else r
        total = P[P_A] + plan_work(P, c, RI[RI_PREFIX, head])
        return 1, c, total
    return count, last, total


@jit
def prefill_alone(RI, P, out):
    """Seconds each request's prefill takes alone on an idle rank (steps of the plan), into out.

    The request is alone in its engine of ``P_RANKS`` ranks: a step of chunk ``c`` lasts its
    plan's fixed and local work plus the shared work ``moe * c / ranks``.
    """
    n = RI.shape[1]
    moe = P[P_MOE]
    ranks = P[P_RANKS]
    tmp = np.empty((RI.shape[0], 1), dtype=np.int64)
    for i in range(n):
        tmp[RI_REM, 0] = RI[RI_UNCACHED, i]
        tmp[RI_PREFIX, 0] = RI[RI_PREFIX, i]
        tmp[RI_NEXT, 0] = -1
        t = 0.0
        while tmp[RI_REM, 0] > 0:
            _, c, s = plan_rank(tmp, P, 0)
            t += s - moe * c + moe * c / ranks
            tmp[RI_REM, 0] -= c
            tmp[RI_PREFIX, 0] += c
        out[i] = t


@jit
def local_work(P, c, p):
    """Local work of ``c`` tokens after a prefix of ``p``: ``QuadraticCost.work`` (0 if ``c <=
    0``); with ``c`` the tokens a request has left, its quota (what a router can move; the
    progress-report thresholds)."""
    if c <= 0:
        return 0.0
    return c * (P[P_B] + P[P_K] * p + P[P_Q] * c) + P[P_GAMMA] * p


@jit
def fit_chunk(P, room, rem, p):
    """The largest chunk of a request (``rem`` tokens left after a prefix of ``p``) whose planned
    work fits ``room`` seconds, by :func:`plan_rank`'s rule for one request: whole, or aligned
    down and at least ``min_chunk`` (else 0). Work sharing and the ideal reference
    (:mod:`lbkit.sim.ideal`) fill ranks with it. The chunk starts from :func:`solve_chunk`'s
    root, whose rounding error is far below a token for any prompt, so its three-token
    correction finds the same chunk as an unbounded search would.
    """
    c = 0
    if room > 0:
        c = solve_chunk(P, room, p)
        if c > rem:
            c = rem
    while c > 0 and plan_work(P, c, p) > room:
        c -= 1
    if c < rem:
        align = np.int64(P[P_ALIGN])
        c = (c // align) * align
        if c < np.int64(P[P_MIN_CHUNK]):
            c = 0
    return c


@jit
def plan_rank_one(RI, P, i):
    """:func:`plan_rank` of request ``i`` alone (its successors ignored)."""
    nxt = RI[RI_NEXT, i]
    RI[RI_NEXT, i] = -1
    out = plan_rank(RI, P, i)
    RI[RI_NEXT, i] = nxt
    return out


@jit
def append(RI, KI, f, i):
    """Append request ``i`` to the FIFO queue of flat rank ``f`` (links only, no counts)."""
    RI[RI_NEXT, i] = -1
    tail = KI[KI_TAIL, f]
    if tail < 0:
        KI[KI_HEAD, f] = i
    else:
        RI[RI_NEXT, tail] = i
    KI[KI_TAIL, f] = i
