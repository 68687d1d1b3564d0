"""numba kernels of the decode pool: admission, steps, migration, advance, and its array layout.

:class:`lbkit.sim.decode_pool.DecodePool` allocates the arrays and is the only caller; nothing
here validates. The pool's state lives in a few 2-D arrays whose rows are named by the
constants below (so a kernel call passes few arguments: numba's dispatch cost grows with their
number).

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

Arrays: ``DI`` (int64) and ``DF`` (float64) per request; ``DK`` (int64) per flat rank; ``DE``
(float64) per engine; ``ACT`` (int64, engines x requests); ``D`` (float64) cost and options;
``ACC`` (float64, ``2 * N_DACC``: the run's totals, then the window's); ``BINS`` (float64, the time
bins of :mod:`lbkit.sim._bins`); ``EVR`` (int64) the event buffer.
"""

from __future__ import annotations

import math

import numpy as np

from lbkit.core._jit import jit
from lbkit.sim._bins import add_step

__all__ = ["decode_admit", "decode_advance", "decode_migrate"]

#: Requests: flat rank (-1: none, -2: finished at handover), decode steps left, KV tokens, next
#: in the engine's pending or transit list, position in the engine's active set (-1: not active).
DI_RANK, DI_LEFT, DI_KV, DI_NEXT, DI_POS = 0, 1, 2, 3, 4
#: ``DI_SEQ``: admission order (the newest request of a rank is preempted first).
DI_SEQ = 5
N_DI = 6
#: Requests: admission (or preemption) time, decode end, arrival of a migrated request's KV
#: (``nan``: not in transit).
DF_JOIN, DF_FINISH, DF_READY = 0, 1, 2
N_DF = 3
#: Ranks: requests and KV tokens admitted (``B_r``, ``S_r``), those pending for the next step,
#: those in transit to the rank.
DK_B, DK_S, DK_PB, DK_PS, DK_TB, DK_TS = 0, 1, 2, 3, 4, 5
N_DK = 6
#: Engines: end of the running step (``inf``: idle), time from which the next may start, active
#: requests, head and tail of the pending list, steps run, head of the transit list.
DE_END, DE_READY, DE_NACT, DE_PHEAD, DE_PTAIL, DE_STEPS, DE_THEAD = 0, 1, 2, 3, 4, 5, 6
N_DE = 7
#: Cost coefficients (``DecodeCost``; ``D_MAX`` 1 for ``combine="max"``), ranks per engine,
#: time-bin width, measurement window, migration latency and seconds per KV token.
D_A, D_B, D_K, D_MAX, D_RANKS, D_BIN_S, D_W0, D_W1 = 0, 1, 2, 3, 4, 5, 6, 7
D_MIG_LAT, D_MIG_TOKEN = 8, 9
#: ``D_CAP``: per-rank KV capacity (``inf``: none); ``D_STOP`` > 0: return after a step end
#: where requests finished (the wait queue is offered then); ``D_MOE``: shared MoE seconds per
#: token of the engine, ``b_moe * moe_lb``.
D_CAP, D_STOP, D_MOE = 10, 11, 12
N_D = 13
#: ``DI_POS`` of a request in transit (migrated, not decoding until ``DF_READY``).
POS_TRANSIT = -2
#: Totals ``ACC[DACC_*]``: sums of the mean and max rank time, of step durations, of the
#: duration-weighted count and KV imbalance, steps, tokens generated, count floor.
DACC_MEAN, DACC_MAX, DACC_TIME, DACC_BIMB, DACC_SIMB, DACC_STEPS, DACC_TOKENS = range(7)
DACC_BFLOOR = 7
N_DACC = 8
#: ``ACC[DACC_W + DACC_*]``: the same sums over the steps that start in ``[D_W0, D_W1)``.
DACC_W = N_DACC


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
    add_step(BINS, start, D[D_BIN_S], mean, longest)
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
