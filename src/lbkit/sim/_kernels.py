"""numba kernels of the simulator's engine model (plain loops over clean numpy arrays).

The state of a pool lives in a few 2-D arrays whose rows are named by the constants below, so a
kernel call passes few arguments (numba's dispatch cost grows with their number). The public
wrappers in :mod:`lbkit.sim.engine` validate inputs, allocate the arrays and call these kernels;
nothing here validates.

Prefill pool
------------
Requests: ``RI[RI_*, i]`` (int64) and ``RF[RF_*, i]`` (float64). Ranks (flat index
``engine * ranks_per_engine + rank``): ``KI[KI_*, r]`` and ``KF[KF_*, r]``. Engines: ``EF[EF_*,
e]`` and ``EI[EI_*, e]``. Each rank's queue is a singly linked FIFO list through ``RI_NEXT``.
Cost and options: ``P[P_*]``. Accumulators: ``ACC[ACC_*]`` and, per time bin, ``BINS[BIN_*, j]``.

An engine is *stepping* while ``EF_END < inf``. At a step's start every rank plans its FIFO queue
(:func:`plan_rank`, the algorithm of :func:`lbkit.prefill.plan_chunks`) and records how many head
requests it scheduled and the last one's chunk; the step lasts as long as the slowest rank. At the
step's end the chunks are applied: whole requests leave the queue (their prefill ends then),
the last one may stay with fewer tokens left. Requests routed during a step wait for the next one.
With work sharing (``P[P_SHARE] > 0``, :func:`_share`) the engine plans its ranks together: the
requests that have not started are pooled and dealt to the least-loaded ranks, and those that
change rank are reported as ``EV_MOVE`` events. ``KS`` sums the steps by their number of busy
ranks (where balance efficiency is lost).

Shared expert work (``P_MOE`` seconds per token): plans use the linear cost ``P_B + P_MOE`` (a
balanced engine); at a step's start each rank's planned time ``KF_TIME`` is replaced by its fixed
and local part (``KF_TIME - KF_MOE``) plus the engine's shared part ``P_MOE * sum KF_TOK /
ranks``, which idle ranks pay too. The scheduled requests become running then (``RI_RUN``,
``KI_WAIT``; their prefix enters ``KI_KV``); applied chunks add to ``KI_KV``, and a finished
request's KV leaves it.

Decode pool
-----------
Requests ``DI[DI_*, i]``, ``DF[DF_*, i]``; ranks ``DK[DK_*, r]``; engines ``DE[DE_*, e]``; active
requests of engine ``e`` are ``ACT[e, :DE_NACT]`` (dense, swap-removed). Admitted requests wait in
a per-engine FIFO list (``DI_NEXT``) and join at the next step. One step: every active request
generates one token (its KV grows by one); a request leaves at the end of the step that generated
its last token. A request migrated with a transfer time (``D_MIG_LAT + D_MIG_TOKEN * kv > 0``)
or to another engine stops decoding: it finishes the step it is in (``DF_READY`` set marks it),
then waits in its new engine's transit list (``DE_THEAD``, linked by ``DI_NEXT``,
``DI_POS == -2``) until ``DF_READY`` and joins the first step that starts after that. From the
move on it counts on its new rank (``DK_B``, ``DK_S``: memory is reserved there) and in
``DK_TB``, ``DK_TS``, which step times and KV growth leave out.
Every rank of an engine also pays the shared MoE term ``D_MOE * sum_r B_r / R`` (active
requests). With a KV capacity (``D_CAP < inf``) a step starts only when every rank's KV plus
its growth (one token per active request) fits: otherwise the rank's newest requests
(``DI_SEQ``) are preempted (event ``-1 - i``) and the caller queues them again.
"""

from __future__ import annotations

import math

import numpy as np

from lbkit.core._jit import jit
from lbkit.sim.protocol import EV_FINISH, EV_MOVE, EV_PROGRESS

__all__ = [
    "decode_admit",
    "decode_advance",
    "plan_rank",
    "prefill_admit",
    "prefill_advance",
    "prefill_alone",
]

# ---------------------------------------------------------------- prefill layout
RI_REM, RI_PREFIX, RI_NEXT, RI_RANK, RI_UNCACHED, RI_REPORTED = 0, 1, 2, 3, 4, 5
#: ``RI_RUN``: 1 once a step that computes the request's first chunk has started (vLLM's
#: "running"; 0 while it waits).
RI_RUN = 6
N_RI = 7
RF_ARRIVAL, RF_FINISH, RF_QREPORT, RF_Q0 = 0, 1, 2, 3
N_RF = 4
KI_HEAD, KI_TAIL, KI_NREQ, KI_TOKENS, KI_SCHED, KI_LAST = 0, 1, 2, 3, 4, 5
#: ``KI_WAIT``: requests not yet running; ``KI_KV``: KV tokens of the running requests (their
#: prefix plus the tokens computed so far).
KI_WAIT, KI_KV = 6, 7
N_KI = 8
KF_TIME, KF_BUSY = 0, 1
#: ``KF_TOK``: tokens the rank's plan computes this step; ``KF_MOE``: the shared-expert seconds
#: its planned time ``KF_TIME`` includes (the balanced-engine guess, replaced at the step's start
#: by the engine's actual shared work).
KF_TOK, KF_MOE = 2, 3
N_KF = 4
EF_END, EF_READY = 0, 1
N_EF = 2
EI_NREQ, EI_STEPS = 0, 1
N_EI = 2
P_A, P_B, P_K, P_Q, P_GAMMA, P_BUDGET, P_MIN_CHUNK, P_ALIGN, P_RANKS, P_REPORT = range(10)
P_BIN_S, P_SHARE, P_CP_EFF = 10, 11, 12
#: ``P_MOE``: shared (routed-expert) seconds per token, ``b_moe * moe_lb`` (SPEC §8).
P_MOE = 13
N_P = 14
ACC_MEAN, ACC_MAX, ACC_STEPS, ACC_TOKENS, ACC_OVERRUNS, ACC_EVENTS_TOTAL = range(6)
ACC_MOVES, ACC_FEW_MEAN, ACC_FEW_MAX, ACC_FEW_STEPS = 6, 7, 8, 9
N_ACC = 10
BIN_MEAN, BIN_MAX = 0, 1
N_BIN = 2
#: ``KS[KS_*, k]``: steps with ``k`` busy ranks, and their sums of mean and max rank time.
KS_STEPS, KS_MEAN, KS_MAX = 0, 1, 2
N_KS = 3


# ---------------------------------------------------------------- decode layout
DI_RANK, DI_LEFT, DI_KV, DI_NEXT, DI_POS = 0, 1, 2, 3, 4
#: ``DI_SEQ``: admission order (the newest request of a rank is preempted first).
DI_SEQ = 5
N_DI = 6
DF_JOIN, DF_FINISH, DF_READY = 0, 1, 2
N_DF = 3
DK_B, DK_S, DK_PB, DK_PS, DK_TB, DK_TS = 0, 1, 2, 3, 4, 5
N_DK = 6
DE_END, DE_READY, DE_NACT, DE_PHEAD, DE_PTAIL, DE_STEPS, DE_THEAD = 0, 1, 2, 3, 4, 5, 6
N_DE = 7
D_A, D_B, D_K, D_MAX, D_RANKS, D_BIN_S, D_W0, D_W1 = 0, 1, 2, 3, 4, 5, 6, 7
D_MIG_LAT, D_MIG_TOKEN = 8, 9
#: ``D_CAP``: per-rank KV capacity (``inf``: none); ``D_STOP`` > 0: return after a step end
#: where requests finished (the wait queue is offered then); ``D_MOE``: shared MoE seconds per
#: token of the engine, ``b_moe * moe_lb``.
D_CAP, D_STOP, D_MOE = 10, 11, 12
N_D = 13
#: ``DI_POS`` of a request in transit (migrated, not decoding until ``DF_READY``).
POS_TRANSIT = -2
DACC_MEAN, DACC_MAX, DACC_TIME, DACC_BIMB, DACC_SIMB, DACC_STEPS, DACC_TOKENS = range(7)
DACC_BFLOOR = 7
N_DACC = 8
#: ``ACC[DACC_W + DACC_*]``: the same sums over the steps that start in ``[D_W0, D_W1)``.
DACC_W = N_DACC
DBIN_MEAN, DBIN_MAX = 0, 1


# ---------------------------------------------------------------- prefill
@jit
def _work(P, c, p):
    # Planned work of one chunk: QuadraticCost.work with the linear coefficient of a balanced
    # engine, b + moe (every rank runs as many tokens, so the shared work per own token is moe),
    # in the same operation order as plan_chunks' _work (b + 0.0 is b: moe = 0 changes nothing).
    if c <= 0:
        return 0.0
    return c * (P[P_B] + P[P_MOE] + P[P_K] * p + P[P_Q] * c) + P[P_GAMMA] * p


@jit
def _solve(P, budget, p):
    # QuadraticCost.solve_chunk with a = 0 (the variable model plan_chunks uses), align 1.
    slack = budget - P[P_GAMMA] * p
    if not slack > 0.0:
        return 0
    beta = P[P_B] + P[P_MOE] + P[P_K] * p
    root = 2.0 * slack / (beta + math.sqrt(beta * beta + 4.0 * P[P_Q] * slack))
    c = np.int64(math.floor(min(root, 2.0**62)))
    for _ in range(3):
        c1 = c + 1
        if _work(P, c1, p) <= budget:
            c = c1
    for _ in range(3):
        if c > 0 and _work(P, c, p) > budget:
            c -= 1
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
            c = _solve(P, left, p)
            if c > r:
                c = r
        while c > 0 and total + _work(P, c, p) > budget:
            c -= 1
        if c < r:
            c = (c // align) * align
            if c >= min_chunk:
                count += 1
                last = c
                total += _work(P, c, p)
            break
        count += 1
        last = c
        total += _work(P, c, p)
        i = RI[RI_NEXT, i]
    if count == 0:
        r = RI[RI_REM, head]
        c = min_chunk if min_chunk < r else r
        total = P[P_A] + _work(P, c, RI[RI_PREFIX, head])
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
def _quota(P, rem, p):
    # Local work left (what a router can move; the report thresholds).
    if rem <= 0:
        return 0.0
    return rem * (P[P_B] + P[P_K] * p + P[P_Q] * rem) + P[P_GAMMA] * p


@jit
def _plan_quota(P, rem, p):
    # Planned work left on a balanced engine (local plus moe per token; work sharing's level).
    if rem <= 0:
        return 0.0
    return rem * (P[P_B] + P[P_MOE] + P[P_K] * p + P[P_Q] * rem) + P[P_GAMMA] * p


@jit
def _chunk(P, room, rem, p):
    # The largest chunk of a request (rem tokens left after a prefix p) that fits ``room``
    # seconds, by plan_rank's rule for one request: whole, or aligned down and >= min_chunk.
    c = 0
    if room > 0:
        c = _solve(P, room, p)
        if c > rem:
            c = rem
    while c > 0 and _work(P, c, p) > room:
        c -= 1
    if c < rem:
        align = np.int64(P[P_ALIGN])
        c = (c // align) * align
        if c < np.int64(P[P_MIN_CHUNK]):
            c = 0
    return c


@jit
def _share(e, RI, KI, KF, EF, P, EVR, EVK, EVT, nev, SCR):
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
    # 1. started heads stay (SCR[2, g], or -1); the rest is pooled (SCR[0, :m], by arrival)
    m = 0
    for g in range(ranks):
        f = f0 + g
        i = KI[KI_HEAD, f]
        KI[KI_SCHED, f] = 0
        KI[KI_LAST, f] = 0
        KF[KF_TIME, f] = 0.0
        SCR[2, g] = -1
        full[g] = False
        if i >= 0 and RI[RI_REM, i] < RI[RI_UNCACHED, i]:
            SCR[2, g] = i
            i = RI[RI_NEXT, i]
        while i >= 0:
            SCR[0, m] = i
            m += 1
            i = RI[RI_NEXT, i]
    pool = np.sort(SCR[0, :m])
    heads = 0
    for g in range(ranks):
        heads += SCR[2, g] >= 0
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
                i = SCR[2, g]
                if i >= 0:
                    w = P[P_A] + _plan_quota(P, RI[RI_REM, i], RI[RI_PREFIX, i])
                    work += min(w, budget, level)
            for j in range(m):
                if work > budget * ranks:
                    break
                i = pool[j]
                w = _plan_quota(P, RI[RI_REM, i], RI[RI_PREFIX, i])
                if j < ranks - heads:
                    w += P[P_A]
                work += min(w, level)
            level = work / ranks
        if level < budget:
            budget = level
    for g in range(ranks):
        i = SCR[2, g]
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
    # 2. assign in arrival order (SCR[1, j]: the flat rank it joins this step, or -1)
    for j in range(m):
        SCR[1, j] = -1
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
            c = _chunk(P, budget - t - fixed, rem, p)
            if rem > 0 and c == 0:
                if KI[KI_SCHED, f] > 0:
                    full[best] = True
                    continue
                c = np.int64(P[P_MIN_CHUNK])  # progress guarantee on an empty rank
                if c > rem:
                    c = rem
            KF[KF_TIME, f] = t + fixed + _work(P, c, p)
            KI[KI_SCHED, f] += 1
            KI[KI_LAST, f] = c
            SCR[1, j] = f
            if c < rem:
                full[best] = True
            placed = True
        if not placed:
            break
    # 3. rebuild the queues: started head, scheduled requests, own unscheduled requests
    for g in range(ranks):
        f = f0 + g
        h = SCR[2, g]
        KI[KI_HEAD, f] = h
        KI[KI_TAIL, f] = h
        if h >= 0:
            RI[RI_NEXT, h] = -1
    for j in range(m):
        f = SCR[1, j]
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
            _append(RI, KI, f, i)
    for j in range(m):
        if SCR[1, j] < 0:
            i = pool[j]
            _append(RI, KI, RI[RI_RANK, i], i)
    return nev


@jit
def _split(e, RI, KI, KF, P):
    """Context parallelism after :func:`_share` (``P[P_SHARE] == 3``): ranks left idle help the
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
            if P[P_A] + _work(P, mid, p) / speedup <= budget:
                lo = mid
            else:
                hi = mid - 1
        t = P[P_A] + _work(P, lo, p) / speedup
        moe = P[P_MOE] * lo / speedup
        KI[KI_LAST, f] = lo
        KF[KF_TIME, f] = t
        KF[KF_TOK, f] = lo
        KF[KF_MOE, f] = moe
        for h in range(ranks):
            if owner[h] == g:
                KF[KF_TIME, f0 + h] = t
                KF[KF_MOE, f0 + h] = moe


@jit
def _append(RI, KI, f, i):
    RI[RI_NEXT, i] = -1
    tail = KI[KI_TAIL, f]
    if tail < 0:
        KI[KI_HEAD, f] = i
    else:
        RI[RI_NEXT, tail] = i
    KI[KI_TAIL, f] = i


@jit
def plan_rank_one(RI, P, i):
    """:func:`plan_rank` of request ``i`` alone (its successors ignored)."""
    nxt = RI[RI_NEXT, i]
    RI[RI_NEXT, i] = -1
    out = plan_rank(RI, P, i)
    RI[RI_NEXT, i] = nxt
    return out


@jit
def _start_step(e, RI, KI, KF, EF, EI, P, ACC, BINS, KS, EVR, EVK, EVT, nev, SCR):
    ranks = np.int64(P[P_RANKS])
    start = EF[EF_READY, e]
    if P[P_SHARE] > 0.0:
        nev0 = nev
        nev = _share(e, RI, KI, KF, EF, P, EVR, EVK, EVT, nev, SCR)
        ACC[ACC_MOVES] += nev - nev0
    else:
        for f in range(e * ranks, (e + 1) * ranks):
            count, last, t = plan_rank(RI, P, KI[KI_HEAD, f])
            KI[KI_SCHED, f] = count
            KI[KI_LAST, f] = last
            KF[KF_TIME, f] = t
    # The scheduled requests are running from now on; each rank's tokens and planned shared work.
    moe = P[P_MOE]
    for f in range(e * ranks, (e + 1) * ranks):
        count = KI[KI_SCHED, f]
        c = 0
        i = KI[KI_HEAD, f]
        for s in range(count):
            c += RI[RI_REM, i] if s < count - 1 else KI[KI_LAST, f]
            if RI[RI_RUN, i] == 0:
                RI[RI_RUN, i] = 1
                KI[KI_WAIT, f] -= 1
                KI[KI_KV, f] += RI[RI_PREFIX, i]
            i = RI[RI_NEXT, i]
        KF[KF_TOK, f] = c
        KF[KF_MOE, f] = moe * c
    if P[P_SHARE] > 2.0:
        _split(e, RI, KI, KF, P)
    # Rank time: the plan's fixed and local work, plus the engine's actual shared work, which
    # every rank pays (idle ones too); the plan (busy ranks, overruns) is the planned time.
    tokens = 0.0
    for f in range(e * ranks, (e + 1) * ranks):
        tokens += KF[KF_TOK, f]
    shared = moe * tokens / ranks
    longest = 0.0
    total = 0.0
    busy = 0
    for f in range(e * ranks, (e + 1) * ranks):
        plan = KF[KF_TIME, f]
        t = plan - KF[KF_MOE, f] + shared
        KF[KF_BUSY, f] += t
        total += t
        if plan > 0.0:
            busy += 1
        if t > longest:
            longest = t
        if plan > P[P_BUDGET]:
            ACC[ACC_OVERRUNS] += 1.0
    mean = total / ranks
    EF[EF_END, e] = start + longest
    EI[EI_STEPS, e] += 1
    ACC[ACC_MEAN] += mean
    ACC[ACC_MAX] += longest
    ACC[ACC_STEPS] += 1.0
    if EI[EI_NREQ, e] < ranks:
        ACC[ACC_FEW_MEAN] += mean
        ACC[ACC_FEW_MAX] += longest
        ACC[ACC_FEW_STEPS] += 1.0
    KS[KS_STEPS, busy] += 1.0
    KS[KS_MEAN, busy] += mean
    KS[KS_MAX, busy] += longest
    j = np.int64(start / P[P_BIN_S])
    if j >= BINS.shape[1]:
        j = BINS.shape[1] - 1
    BINS[BIN_MEAN, j] += mean
    BINS[BIN_MAX, j] += longest
    return nev


@jit
def _end_step(e, RI, RF, KI, EF, EI, P, ACC, EVR, EVK, EVT, nev):
    ranks = np.int64(P[P_RANKS])
    end = EF[EF_END, e]
    frac = P[P_REPORT]
    for f in range(e * ranks, (e + 1) * ranks):
        count = KI[KI_SCHED, f]
        for s in range(count):
            i = KI[KI_HEAD, f]
            c = RI[RI_REM, i] if s < count - 1 else KI[KI_LAST, f]
            RI[RI_REM, i] -= c
            RI[RI_PREFIX, i] += c
            KI[KI_TOKENS, f] -= c
            KI[KI_KV, f] += c
            ACC[ACC_TOKENS] += c
            done = RI[RI_UNCACHED, i] - RI[RI_REM, i]
            if RI[RI_REM, i] == 0:
                RF[RF_FINISH, i] = end
                KI[KI_KV, f] -= RI[RI_PREFIX, i]  # its KV leaves for decode
                nxt = RI[RI_NEXT, i]
                KI[KI_HEAD, f] = nxt
                if nxt < 0:
                    KI[KI_TAIL, f] = -1
                RI[RI_NEXT, i] = -1
                KI[KI_NREQ, f] -= 1
                EI[EI_NREQ, e] -= 1
                EVR[nev] = i
                EVK[nev] = EV_FINISH
                EVT[nev] = done - RI[RI_REPORTED, i]
                RI[RI_REPORTED, i] = done
                nev += 1
            else:
                q = _quota(P, RI[RI_REM, i], RI[RI_PREFIX, i])
                if RF[RF_QREPORT, i] - q >= frac * RF[RF_Q0, i]:
                    EVR[nev] = i
                    EVK[nev] = EV_PROGRESS
                    EVT[nev] = done - RI[RI_REPORTED, i]
                    RI[RI_REPORTED, i] = done
                    RF[RF_QREPORT, i] = q
                    nev += 1
        KI[KI_SCHED, f] = 0
        KI[KI_LAST, f] = 0
    EF[EF_READY, e] = end
    EF[EF_END, e] = np.inf
    return nev


@jit
def prefill_admit(i, f, t, RI, KI, EF, EI, P):
    """Append request ``i`` to the FIFO queue of flat rank ``f`` at time ``t`` (it waits)."""
    RI[RI_RANK, i] = f
    _append(RI, KI, f, i)
    KI[KI_NREQ, f] += 1
    KI[KI_WAIT, f] += 1
    KI[KI_TOKENS, f] += RI[RI_REM, i]
    e = f // np.int64(P[P_RANKS])
    EI[EI_NREQ, e] += 1
    if EF[EF_END, e] == np.inf:
        EF[EF_READY, e] = t


@jit
def prefill_advance(t_until, RI, RF, KI, KF, EF, EI, P, ACC, BINS, KS, EVR, EVK, EVT, SCR):
    """Run every engine's steps up to ``t_until``; return (events written, finished flag).

    A step that ends at or before ``t_until`` is applied; a new step starts only strictly before
    ``t_until`` (requests arriving at ``t_until`` may still join it). Stops early, with flag 0,
    when the event buffer could overflow; call again after draining it. ``SCR`` is int64 scratch
    space of shape (3, max(requests, ranks_per_engine)) for work sharing (``P[P_SHARE] > 0``).
    """
    nev = 0
    cap = EVR.shape[0]
    ranks = np.int64(P[P_RANKS])
    for e in range(EF.shape[1]):
        while True:
            if EF[EF_END, e] < np.inf:
                if EF[EF_END, e] > t_until:
                    break
                need = 0
                for f in range(e * ranks, (e + 1) * ranks):
                    need += KI[KI_SCHED, f]
                if nev + need > cap:
                    return nev, 0
                nev = _end_step(e, RI, RF, KI, EF, EI, P, ACC, EVR, EVK, EVT, nev)
            elif EI[EI_NREQ, e] > 0 and EF[EF_READY, e] < t_until:
                if P[P_SHARE] > 0.0 and nev + EI[EI_NREQ, e] > cap:
                    return nev, 0
                nev = _start_step(e, RI, KI, KF, EF, EI, P, ACC, BINS, KS, EVR, EVK, EVT, nev,
                                  SCR)  # fmt: skip
            else:
                break
    ACC[ACC_EVENTS_TOTAL] += nev
    return nev, 1


# ---------------------------------------------------------------- decode
@jit
def _rank_time(D, b, s, shared):
    """Rank time of ``b`` requests holding ``s`` KV tokens plus the engine's ``shared`` MoE
    seconds (``b_moe * moe_lb * sum_r B_r / R``, paid by every rank of the engine)."""
    if D[D_MAX] > 0.0:
        x = D[D_B] * b
        y = D[D_K] * s
        t = D[D_A] + (x if x > y else y)
    else:
        t = D[D_A] + D[D_B] * b + D[D_K] * s
    if shared > 0.0:
        t += shared
    return t


@jit
def _preempt(e, f, t, DI, DF, DK, DE, ACT, EVR, nev):
    """Preempt the newest active request of rank ``f`` (engine ``e``, between steps) at ``t``:
    it leaves the active set and frees its KV; ``EVR`` gets ``-1 - i`` and ``DF_JOIN`` the
    time. Returns the new event count."""
    nact = np.int64(DE[DE_NACT, e])
    best = np.int64(-1)
    for k in range(nact):
        i = ACT[e, k]
        if DI[DI_RANK, i] == f and (best < 0 or DI[DI_SEQ, i] > DI[DI_SEQ, ACT[e, best]]):
            best = k
    i = ACT[e, best]
    nact -= 1
    last = ACT[e, nact]
    ACT[e, best] = last
    DI[DI_POS, last] = best
    DE[DE_NACT, e] = nact
    DI[DI_POS, i] = -1
    DI[DI_RANK, i] = -1
    DF[DF_JOIN, i] = t
    DK[DK_B, f] -= 1
    DK[DK_S, f] -= DI[DI_KV, i]
    EVR[nev] = -1 - i
    return nev + 1


@jit
def _decode_start(e, DI, DF, DK, DE, ACT, D, ACC, BINS, EVR, nev):
    ranks = np.int64(D[D_RANKS])
    # pending requests join
    i = np.int64(DE[DE_PHEAD, e])
    nact = np.int64(DE[DE_NACT, e])
    while i >= 0:
        nxt = DI[DI_NEXT, i]
        ACT[e, nact] = i
        DI[DI_POS, i] = nact
        DI[DI_NEXT, i] = -1
        nact += 1
        i = nxt
    DE[DE_PHEAD, e] = -1
    DE[DE_PTAIL, e] = -1
    # migrated requests whose KV has arrived join
    start = DE[DE_READY, e]
    prev = np.int64(-1)
    i = np.int64(DE[DE_THEAD, e])
    while i >= 0:
        nxt = DI[DI_NEXT, i]
        if DF[DF_READY, i] <= start:
            if prev < 0:
                DE[DE_THEAD, e] = nxt
            else:
                DI[DI_NEXT, prev] = nxt
            f = DI[DI_RANK, i]
            DK[DK_TB, f] -= 1
            DK[DK_TS, f] -= DI[DI_KV, i]
            ACT[e, nact] = i
            DI[DI_POS, i] = nact
            DI[DI_NEXT, i] = -1
            DF[DF_READY, i] = np.nan
            nact += 1
        else:
            prev = i
        i = nxt
    DE[DE_NACT, e] = nact
    # KV capacity: the step's growth (one token per active request) must fit every rank
    cap = D[D_CAP]
    if cap < np.inf:
        for f in range(e * ranks, (e + 1) * ranks):
            while DK[DK_B, f] > DK[DK_TB, f] and DK[DK_S, f] + DK[DK_B, f] - DK[DK_TB, f] > cap:
                nev = _preempt(e, f, start, DI, DF, DK, DE, ACT, EVR, nev)
                D[D_STOP] = 1.0
    shared = 0.0
    if D[D_MOE] > 0.0:
        for f in range(e * ranks, (e + 1) * ranks):
            shared += DK[DK_B, f] - DK[DK_TB, f]
        shared = D[D_MOE] * shared / ranks
    longest = 0.0
    total = 0.0
    bmax = 0.0
    btot = 0.0
    smax = 0.0
    stot = 0.0
    for f in range(e * ranks, (e + 1) * ranks):
        DK[DK_PB, f] = 0
        DK[DK_PS, f] = 0
        b = DK[DK_B, f] - DK[DK_TB, f]
        s = DK[DK_S, f] - DK[DK_TS, f]
        t = _rank_time(D, b, s, shared)
        total += t
        if t > longest:
            longest = t
        btot += b
        stot += s
        if b > bmax:
            bmax = b
        if s > smax:
            smax = s
    DE[DE_END, e] = start + longest
    mean = total / ranks
    bimb = bmax * ranks / btot if btot > 0 else 1.0
    simb = smax * ranks / stot if stot > 0 else 1.0
    # Integer counts: the best possible max/mean is ceil(mean)/mean.
    floor = math.ceil(btot / ranks) * ranks / btot if btot > 0 else 1.0
    o = 0
    while True:
        ACC[o + DACC_MEAN] += mean
        ACC[o + DACC_MAX] += longest
        ACC[o + DACC_TIME] += longest
        ACC[o + DACC_BIMB] += longest * bimb
        ACC[o + DACC_SIMB] += longest * simb
        ACC[o + DACC_BFLOOR] += longest * floor
        ACC[o + DACC_STEPS] += 1.0
        ACC[o + DACC_TOKENS] += btot
        if o > 0 or not (D[D_W0] <= start < D[D_W1]):
            break
        o = DACC_W
    j = np.int64(start / D[D_BIN_S])
    if j >= BINS.shape[1]:
        j = BINS.shape[1] - 1
    BINS[DBIN_MEAN, j] += mean
    BINS[DBIN_MAX, j] += longest
    return nev


@jit
def _decode_end(e, DI, DF, DK, DE, ACT, D, EVR, nev):
    ranks = np.int64(D[D_RANKS])
    end = DE[DE_END, e]
    for f in range(e * ranks, (e + 1) * ranks):
        DK[DK_S, f] += DK[DK_B, f] - DK[DK_PB, f] - DK[DK_TB, f]
    k = 0
    nact = np.int64(DE[DE_NACT, e])
    while k < nact:
        i = ACT[e, k]
        DI[DI_KV, i] += 1
        DI[DI_LEFT, i] -= 1
        leaving = not np.isnan(DF[DF_READY, i])
        if leaving:  # migrated during the step: its token counts on the new rank
            f = DI[DI_RANK, i]
            DK[DK_S, f] += 1
            DK[DK_TS, f] += 1
        if DI[DI_LEFT, i] == 0 or leaving:
            nact -= 1
            last = ACT[e, nact]
            ACT[e, k] = last
            DI[DI_POS, last] = k
            DI[DI_POS, i] = -1
            if DI[DI_LEFT, i] == 0:
                f = DI[DI_RANK, i]
                DK[DK_B, f] -= 1
                DK[DK_S, f] -= DI[DI_KV, i]
                if leaving:
                    DK[DK_TB, f] -= 1
                    DK[DK_TS, f] -= DI[DI_KV, i]
                    DF[DF_READY, i] = np.nan
                DF[DF_FINISH, i] = end
                EVR[nev] = i
                nev += 1
            else:  # its KV cannot arrive before it leaves this step
                if DF[DF_READY, i] < end:
                    DF[DF_READY, i] = end
                _to_transit(DI, DE, DI[DI_RANK, i] // np.int64(D[D_RANKS]), i)
        else:
            k += 1
    DE[DE_NACT, e] = nact
    DE[DE_READY, e] = end
    DE[DE_END, e] = np.inf
    DE[DE_STEPS, e] += 1
    return nev


@jit
def decode_admit(i, f, t, seq, DI, DF, DK, DE, D):
    """Admit request ``i`` to flat rank ``f`` at time ``t`` (``seq``: admission order); it joins
    the engine's next step."""
    DI[DI_RANK, i] = f
    DI[DI_SEQ, i] = seq
    DF[DF_JOIN, i] = t
    kv = DI[DI_KV, i]
    DK[DK_B, f] += 1
    DK[DK_S, f] += kv
    DK[DK_PB, f] += 1
    DK[DK_PS, f] += kv
    e = f // np.int64(D[D_RANKS])
    tail = np.int64(DE[DE_PTAIL, e])
    if tail < 0:
        DE[DE_PHEAD, e] = i
    else:
        DI[DI_NEXT, tail] = i
    DE[DE_PTAIL, e] = i
    if DE[DE_END, e] == np.inf:
        DE[DE_READY, e] = t


@jit
def _unlink(DI, DE, head, tail, e, i):
    """Remove ``i`` from engine ``e``'s list starting at ``DE[head, e]`` (linked by
    ``DI_NEXT``; ``tail`` is the row of its last element, or -1 if the list keeps none)."""
    prev = np.int64(-1)
    j = np.int64(DE[head, e])
    while j != i:
        prev = j
        j = DI[DI_NEXT, j]
    nxt = DI[DI_NEXT, i]
    if prev < 0:
        DE[head, e] = nxt
    else:
        DI[DI_NEXT, prev] = nxt
    if tail >= 0 and DE[tail, e] == i:
        DE[tail, e] = prev


@jit
def _to_transit(DI, DE, e, i):
    """Put ``i`` at the head of engine ``e``'s transit list."""
    DI[DI_POS, i] = POS_TRANSIT
    DI[DI_NEXT, i] = np.int64(DE[DE_THEAD, e])
    DE[DE_THEAD, e] = i


@jit
def decode_migrate(i, g, t, DI, DF, DK, DE, ACT, D):
    """Move running request ``i`` to flat rank ``g`` at time ``t``.

    Within an engine and without a transfer time the request keeps decoding (a request waiting
    for the engine's next step moves its pending counts too: the step's KV growth skips it
    wherever it is). Otherwise it stops decoding until ``t + D_MIG_LAT + D_MIG_TOKEN * kv``
    and then joins the first step of ``g``'s engine: a request in a running step finishes that
    step first, a pending one enters the transit list at once, and one already moving restarts
    its transfer towards ``g``. Returns 0, or -1 when ``i`` is not running (finished, refused
    or not yet admitted); nothing changes then (nor when ``g`` is its rank).
    """
    f = DI[DI_RANK, i]
    if f < 0 or DI[DI_LEFT, i] <= 0:
        return -1
    if f == g:
        return 0
    ranks = np.int64(D[D_RANKS])
    e = f // ranks
    eg = g // ranks
    kv = DI[DI_KV, i]
    DK[DK_B, f] -= 1
    DK[DK_S, f] -= kv
    DK[DK_B, g] += 1
    DK[DK_S, g] += kv
    DI[DI_RANK, i] = g
    pos = DI[DI_POS, i]
    delay = D[D_MIG_LAT] + D[D_MIG_TOKEN] * kv
    pause = delay > 0.0 or e != eg  # another engine: it joins that engine's next step
    if pos == POS_TRANSIT or (pos >= 0 and not np.isnan(DF[DF_READY, i])):
        # already moving: the transfer restarts towards g
        DK[DK_TB, f] -= 1
        DK[DK_TS, f] -= kv
        if pos == POS_TRANSIT and e != eg:
            _unlink(DI, DE, DE_THEAD, -1, e, i)
            _to_transit(DI, DE, eg, i)
    elif pos < 0:  # pending: joined since the current step started
        DK[DK_PB, f] -= 1
        DK[DK_PS, f] -= kv
        if not pause:
            DK[DK_PB, g] += 1
            DK[DK_PS, g] += kv
            return 0
        _unlink(DI, DE, DE_PHEAD, DE_PTAIL, e, i)
        _to_transit(DI, DE, eg, i)
    elif not pause:
        return 0
    elif DE[DE_END, e] == np.inf:  # active between steps: leaves the active set now
        nact = np.int64(DE[DE_NACT, e]) - 1
        last = ACT[e, nact]
        ACT[e, pos] = last
        DI[DI_POS, last] = pos
        DE[DE_NACT, e] = nact
        _to_transit(DI, DE, eg, i)
    # else: in the running step; _decode_end moves it to its new engine's transit list
    DK[DK_TB, g] += 1
    DK[DK_TS, g] += kv
    DF[DF_READY, i] = t + delay
    return 0


@jit
def _next_start(e, DI, DF, DE):
    """When idle engine ``e`` (no step running) may start its next step: at ``DE_READY`` if it
    has active or pending requests, else when the first migrated request's KV has arrived (not
    before ``DE_READY``); ``inf`` when it has nothing to run."""
    if DE[DE_NACT, e] > 0 or DE[DE_PHEAD, e] >= 0:
        return DE[DE_READY, e]
    first = np.inf
    i = np.int64(DE[DE_THEAD, e])
    while i >= 0:
        if DF[DF_READY, i] < first:
            first = DF[DF_READY, i]
        i = DI[DI_NEXT, i]
    if first < DE[DE_READY, e]:
        first = DE[DE_READY, e]
    return first


@jit
def decode_advance(t_until, DI, DF, DK, DE, ACT, D, ACC, BINS, EVR):
    """Run the decode engines' steps up to ``t_until``; return (events, finished flag, time).

    Step ends and starts of all engines are taken in time order (at equal times ends first,
    then the lowest engine): a request migrated to another engine leaves its step's end for
    that engine's transit list, which may start the engine's next step. Events ``EVR[:events]``
    are finished requests ``i`` and preempted ones ``-1 - i``. The flag is 0 when the call
    returns early: the event buffer is full, a step start at ``time`` preempted requests, or
    ``D[D_STOP] > 0`` and a step end at ``time`` finished requests (the caller offers its
    wait queue, then calls again).
    """
    nev = 0
    cap = EVR.shape[0]
    engines = DE.shape[1]
    n = DI.shape[1]
    last_t = -np.inf
    while True:
        best = -1
        best_t = np.inf
        best_end = False
        for e in range(engines):
            if DE[DE_END, e] < np.inf:
                te = DE[DE_END, e]
                if te <= t_until and (te < best_t or (te == best_t and not best_end)):
                    best, best_t, best_end = e, te, True
            else:
                te = _next_start(e, DI, DF, DE)
                if te < t_until and te < best_t:
                    best, best_t, best_end = e, te, False
        if best < 0:
            return nev, 1, last_t
        if best_end:
            if nev + DE[DE_NACT, best] > cap:
                return nev, 0, last_t
            before = nev
            nev = _decode_end(best, DI, DF, DK, DE, ACT, D, EVR, nev)
            last_t = best_t
            if nev > before and D[D_STOP] > 0.0:
                return nev, 0, last_t
        else:
            if D[D_CAP] < np.inf and nev + n > cap:  # room for every preemption
                return nev, 0, last_t
            DE[DE_READY, best] = best_t
            before = nev
            nev = _decode_start(best, DI, DF, DK, DE, ACT, D, ACC, BINS, EVR, nev)
            last_t = best_t
            if nev > before:  # preempted: the caller queues them before any later offer
                return nev, 0, last_t
