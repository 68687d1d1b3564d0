"""numba kernels of the prefill pool's engine steps: admission, step start and end, advance.

An engine is *stepping* while ``EF_END < inf``. At a step's start every rank plans its FIFO queue
(:func:`lbkit.sim._plan_kernels.plan_rank`, the algorithm of :func:`lbkit.prefill.plan_chunks`)
and records how many head requests it scheduled and the last one's chunk; the step lasts as long
as the slowest rank. At the step's end the chunks are applied: whole requests leave the queue
(their prefill ends then), the last one may stay with fewer tokens left. Requests routed during
a step wait for the next one. With work sharing (``P[P_SHARE] > 0``) the engine plans its ranks
together (:mod:`lbkit.sim._sharing_kernels`). ``KS`` sums the steps by their number of busy
ranks (where balance efficiency is lost).

Shared expert work (``P_MOE`` seconds per token): plans use the linear cost ``P_B + P_MOE`` (a
balanced engine); at a step's start each rank's planned time ``KF_TIME`` is replaced by its fixed
and local part (``KF_TIME - KF_MOE``) plus the engine's shared part ``P_MOE * sum KF_TOK /
ranks``, which idle ranks pay too. The scheduled requests become running then (``RI_RUN``,
``KI_WAIT``; their prefix enters ``KI_KV``); applied chunks add to ``KI_KV``, and a finished
request's KV leaves it.

The arrays' rows are named in :mod:`lbkit.sim._prefill_layout`;
:class:`lbkit.sim.prefill_pool.PrefillPool` allocates them and is the only caller. Nothing here
validates.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.sim._bins import add_step
from lbkit.sim._plan_kernels import append, local_work, plan_rank
from lbkit.sim._prefill_layout import (
    ACC_EVENTS_TOTAL,
    ACC_FEW_MAX,
    ACC_FEW_MEAN,
    ACC_FEW_STEPS,
    ACC_MAX,
    ACC_MEAN,
    ACC_MOVES,
    ACC_OVERRUNS,
    ACC_STEPS,
    ACC_TOKENS,
    EF_END,
    EF_READY,
    EI_NREQ,
    EI_STEPS,
    KF_BUSY,
    KF_MOE,
    KF_TIME,
    KF_TOK,
    KI_HEAD,
    KI_KV,
    KI_LAST,
    KI_NREQ,
    KI_SCHED,
    KI_TAIL,
    KI_TOKENS,
    KI_WAIT,
    KS_MAX,
    KS_MEAN,
    KS_STEPS,
    P_BIN_S,
    P_BUDGET,
    P_MOE,
    P_RANKS,
    P_REPORT,
    P_SHARE,
    RF_FINISH,
    RF_Q0,
    RF_QREPORT,
    RI_NEXT,
    RI_PREFIX,
    RI_RANK,
    RI_REM,
    RI_REPORTED,
    RI_RUN,
    RI_UNCACHED,
)
from lbkit.sim._sharing_kernels import share_work, split_chunks
from lbkit.sim.protocol import EV_FINISH, EV_PROGRESS

__all__ = ["end_step", "prefill_admit", "prefill_advance", "start_step"]


@jit
def start_step(e, RI, KI, KF, EF, EI, P, ACC, BINS, KS, EVR, EVK, EVT, nev, SCR):
    """Start a step of engine ``e`` at ``EF_READY``: plan its ranks (or share the engine's work),
    mark the scheduled requests running, set the step's end and add its balance sums. Returns
    the new event count (work sharing's ``EV_MOVE`` events)."""
    ranks = np.int64(P[P_RANKS])
    start = EF[EF_READY, e]
    if P[P_SHARE] > 0.0:
        nev0 = nev
        nev = share_work(e, RI, KI, KF, EF, P, EVR, EVK, EVT, nev, SCR)
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
        split_chunks(e, RI, KI, KF, P)
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
    add_step(BINS, start, P[P_BIN_S], mean, longest)
    return nev


@jit
def end_step(e, RI, RF, KI, EF, EI, P, ACC, EVR, EVK, EVT, nev):
    """End engine ``e``'s step: apply its chunks, finish the requests whose last token was
    computed (``EV_FINISH``) and report progress past the quantum (``EV_PROGRESS``). Returns the
    new event count."""
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
                q = local_work(P, RI[RI_REM, i], RI[RI_PREFIX, i])
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
def prefill_admit(i, f, t, prefix, RI, RF, KI, EF, EI, P):
    """Append request ``i`` to the FIFO queue of flat rank ``f`` at time ``t`` (it waits).

    With ``prefix >= 0`` the request hits ``prefix`` cached tokens there (a per-rank cache) and
    prefills the rest of its prompt, with the quota of that rest; ``prefix < 0`` keeps the
    trace's ``cached_tokens``.
    """
    if prefix >= 0:
        rem = RI[RI_REM, i] + RI[RI_PREFIX, i] - prefix  # the prompt less the hit
        RI[RI_PREFIX, i] = prefix
        RI[RI_REM, i] = rem
        RI[RI_UNCACHED, i] = rem
        q = local_work(P, rem, prefix)
        RF[RF_QREPORT, i] = q
        RF[RF_Q0, i] = q
    RI[RI_RANK, i] = f
    append(RI, KI, f, i)
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
                nev = end_step(e, RI, RF, KI, EF, EI, P, ACC, EVR, EVK, EVT, nev)
            elif EI[EI_NREQ, e] > 0 and EF[EF_READY, e] < t_until:
                if P[P_SHARE] > 0.0 and nev + EI[EI_NREQ, e] > cap:
                    return nev, 0
                nev = start_step(e, RI, KI, KF, EF, EI, P, ACC, BINS, KS, EVR, EVK, EVT, nev,
                                 SCR)  # fmt: skip
            else:
                break
    ACC[ACC_EVENTS_TOTAL] += nev
    return nev, 1
