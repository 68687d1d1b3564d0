"""numba kernels of engine-side work sharing and context parallelism in the prefill pool.

With work sharing (``P[P_SHARE] > 0``, the index of the mode in ``lbkit.sim.engine.SHARING``)
an engine plans its ranks together at a step's start (:func:`share_work`): the requests that
have not started are pooled and dealt to the least-loaded ranks, and those that change rank are
reported as ``EV_MOVE`` events. With ``"split"`` (``P[P_SHARE] == 3``) ranks left idle then
help the ranks whose step is one partial prompt chunk (:func:`split_chunks`). The step kernels
(:mod:`lbkit.sim._prefill_kernels`) call them; the arrays' rows are named in
:mod:`lbkit.sim._prefill_layout`. Nothing here validates.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.sim._plan_kernels import append, fit_chunk, plan_rank_one, plan_work
from lbkit.sim._prefill_layout import (
    KF_MOE,
    KF_TIME,
    KF_TOK,
    KI_HEAD,
    KI_LAST,
    KI_NREQ,
    KI_SCHED,
    KI_TAIL,
    KI_TOKENS,
    KI_WAIT,
    P_A,
    P_BUDGET,
    P_CP_EFF,
    P_MIN_CHUNK,
    P_MOE,
    P_RANKS,
    P_SHARE,
    RI_NEXT,
    RI_PREFIX,
    RI_RANK,
    RI_REM,
    RI_UNCACHED,
    SCR_HEAD,
    SCR_JOIN,
    SCR_POOL,
)
from lbkit.sim.protocol import EV_MOVE

__all__ = ["share_work", "split_chunks"]


@jit
def share_work(e, RI, KI, KF, EF, P, EVR, EVK, EVT, nev, SCR):
    """Work sharing at a step's start: the engine's un-started requests go, earliest first, to
    the rank with the least planned time (ties: lowest rank), whole while they fit the budget,
    then as a partial chunk that fills the rank. Returns the new event count.

    Each rank keeps its started head, planned first, alone. With ``P[P_SHARE] >= 2``
    (level, split) the step's budget, heads included, is lowered to the level at which the engine's
    requests fill every rank (see the comment below). The queues are rebuilt as: started head,
    requests scheduled this step (in order), then the rank's own unscheduled requests. A
    request that changes rank is reported as an ``EV_MOVE`` event (tokens = new flat rank).
    """
    ranks = np.int64(P[P_RANKS])
    budget = P[P_BUDGET]
    f0 = e * ranks
    full = np.zeros(ranks, dtype=np.bool_)
    # 1. started heads stay (SCR[SCR_HEAD, g], or -1); the rest is pooled (SCR[SCR_POOL, :m],
    # by arrival)
    m = 0
    for g in range(ranks):
        f = f0 + g
        i = KI[KI_HEAD, f]
        KI[KI_SCHED, f] = 0
        KI[KI_LAST, f] = 0
        KF[KF_TIME, f] = 0.0
        SCR[SCR_HEAD, g] = -1
        full[g] = False
        if i >= 0 and RI[RI_REM, i] < RI[RI_UNCACHED, i]:
            SCR[SCR_HEAD, g] = i
            i = RI[RI_NEXT, i]
        while i >= 0:
            SCR[SCR_POOL, m] = i
            m += 1
            i = RI[RI_NEXT, i]
    pool = np.sort(SCR[SCR_POOL, :m])
    heads = 0
    for g in range(ranks):
        heads += SCR[SCR_HEAD, g] >= 0
    if P[P_SHARE] > 1.0 and m > 0:
        # Level target T: the largest step that the engine's work fills on every rank, where a
        # request gives at most T to one rank: T = sum_i min(w_i, T) / ranks over the started
        # heads (w at most the budget) and the pooled requests (the first ones with the fixed
        # cost of an empty rank). Iterating from T = total / ranks decreases to it. With fewer
        # requests than ranks no T > 0 fills every rank: T = total / ranks (short steps, so
        # that new requests join soon).
        level = budget * ranks
        for _ in range(6 if heads + m >= ranks else 1):
            work = 0.0
            for g in range(ranks):
                i = SCR[SCR_HEAD, g]
                if i >= 0:
                    w = P[P_A] + plan_work(P, RI[RI_REM, i], RI[RI_PREFIX, i])
                    work += min(w, budget, level)
            for j in range(m):
                if work > budget * ranks:
                    break
                i = pool[j]
                w = plan_work(P, RI[RI_REM, i], RI[RI_PREFIX, i])
                if j < ranks - heads:
                    w += P[P_A]
                work += min(w, level)
            level = work / ranks
        if level < budget:
            budget = level
    for g in range(ranks):
        i = SCR[SCR_HEAD, g]
        if i >= 0:
            f = f0 + g
            keep = P[P_BUDGET]
            P[P_BUDGET] = budget  # the level caps a started request's chunk too
            _, last, t = plan_rank_one(RI, P, i)
            P[P_BUDGET] = keep
            KI[KI_SCHED, f] = 1
            KI[KI_LAST, f] = last
            KF[KF_TIME, f] = t
            full[g] = last < RI[RI_REM, i]  # a partial head fills the rank
            if t > budget:
                budget = t  # the progress guarantee's overrun sets the step
    if m == 0:
        return nev
    # 2. assign in arrival order (SCR[SCR_JOIN, j]: the flat rank it joins this step, or -1)
    for j in range(m):
        SCR[SCR_JOIN, j] = -1
    for j in range(m):
        i = pool[j]
        placed = False
        while not placed:
            best = -1
            for g in range(ranks):
                if not full[g] and (best < 0 or KF[KF_TIME, f0 + g] < KF[KF_TIME, f0 + best]):
                    best = g
            if best < 0:
                break
            f = f0 + best
            t = KF[KF_TIME, f]
            fixed = P[P_A] if KI[KI_SCHED, f] == 0 else 0.0
            rem = RI[RI_REM, i]
            p = RI[RI_PREFIX, i]
            c = fit_chunk(P, budget - t - fixed, rem, p)
            if rem > 0 and c == 0:
                if KI[KI_SCHED, f] > 0:
                    full[best] = True
                    continue
                c = np.int64(P[P_MIN_CHUNK])  # progress guarantee on an empty rank
                if c > rem:
                    c = rem
            KF[KF_TIME, f] = t + fixed + plan_work(P, c, p)
            KI[KI_SCHED, f] += 1
            KI[KI_LAST, f] = c
            SCR[SCR_JOIN, j] = f
            if c < rem:
                full[best] = True
            placed = True
        if not placed:
            break
    # 3. rebuild the queues: started head, scheduled requests, own unscheduled requests
    for g in range(ranks):
        f = f0 + g
        h = SCR[SCR_HEAD, g]
        KI[KI_HEAD, f] = h
        KI[KI_TAIL, f] = h
        if h >= 0:
            RI[RI_NEXT, h] = -1
    for j in range(m):
        f = SCR[SCR_JOIN, j]
        if f >= 0:
            i = pool[j]
            if RI[RI_RANK, i] != f:
                g = RI[RI_RANK, i]
                KI[KI_NREQ, g] -= 1
                KI[KI_TOKENS, g] -= RI[RI_REM, i]
                KI[KI_WAIT, g] -= 1  # only requests that have not started move
                KI[KI_NREQ, f] += 1
                KI[KI_TOKENS, f] += RI[RI_REM, i]
                KI[KI_WAIT, f] += 1
                RI[RI_RANK, i] = f
                EVR[nev] = i
                EVK[nev] = EV_MOVE
                EVT[nev] = f
                nev += 1
            append(RI, KI, f, i)
    for j in range(m):
        if SCR[SCR_JOIN, j] < 0:
            i = pool[j]
            append(RI, KI, RI[RI_RANK, i], i)
    return nev


@jit
def split_chunks(e, RI, KI, KF, P):
    """Context parallelism after :func:`share_work` (``P[P_SHARE] == 3``): ranks left idle help the
    ranks whose step is one partial prompt chunk (longest first, ties: lowest rank; idle ranks
    in rank order, dealt round robin). A group of ``n`` ranks runs the largest chunk whose work
    at a speed-up of ``n * P_CP_EFF`` fits the budget; each member's time is
    ``a + work / (n * P_CP_EFF)`` (a group whose speed-up would not exceed 1 does not form).
    The chunk stays the prompt's own rank's (its tokens are applied there). ``P_CP_EFF = 1``
    is the optimistic model: the communication of context-parallel attention is free. The
    planned shared work is split the same way (``KF_MOE``; ``KF_TOK`` of the owner is the chunk).
    """
    ranks = np.int64(P[P_RANKS])
    f0 = e * ranks
    idle = 0
    for g in range(ranks):
        if KI[KI_SCHED, f0 + g] == 0:
            idle += 1
    if idle == 0:
        return
    cand = np.empty(ranks, dtype=np.int64)
    nc = 0
    for g in range(ranks):
        f = f0 + g
        if KI[KI_SCHED, f] == 1 and KI[KI_LAST, f] < RI[RI_REM, KI[KI_HEAD, f]]:
            j = nc  # insertion by descending time, ties: lowest rank
            while j > 0 and KF[KF_TIME, f0 + cand[j - 1]] < KF[KF_TIME, f]:
                cand[j] = cand[j - 1]
                j -= 1
            cand[j] = g
            nc += 1
    if nc == 0:
        return
    size = np.ones(ranks, dtype=np.int64)
    owner = np.full(ranks, -1, dtype=np.int64)
    j = 0
    for g in range(ranks):
        if KI[KI_SCHED, f0 + g] == 0:
            owner[g] = cand[j % nc]
            size[cand[j % nc]] += 1
            j += 1
    budget = P[P_BUDGET]
    for c in range(nc):
        g = cand[c]
        n = size[g]
        speedup = n * P[P_CP_EFF]
        if n == 1 or speedup <= 1.0:
            continue
        f = f0 + g
        i = KI[KI_HEAD, f]
        rem = RI[RI_REM, i]
        p = RI[RI_PREFIX, i]
        lo = KI[KI_LAST, f]
        hi = rem
        while lo < hi:  # the largest chunk whose work split n ways fits the budget
            mid = (lo + hi + 1) // 2
            if P[P_A] + plan_work(P, mid, p) / speedup <= budget:
                lo = mid
            else:
                hi = mid - 1
        t = P[P_A] + plan_work(P, lo, p) / speedup
        moe = P[P_MOE] * lo / speedup
        KI[KI_LAST, f] = lo
        KF[KF_TIME, f] = t
        KF[KF_TOK, f] = lo
        KF[KF_MOE, f] = moe
        for h in range(ranks):
            if owner[h] == g:
                KF[KF_TIME, f0 + h] = t
                KF[KF_MOE, f0 + h] = moe
