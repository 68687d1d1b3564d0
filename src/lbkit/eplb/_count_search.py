"""Joint search of replica counts and packing for one sub-problem (default method, steps 1-5
of :mod:`lbkit.eplb.balanced`): apportionment, packing, single-replica count moves, a second
start for a dominant expert, the exact search on small sub-problems and duplicate repair.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._bound_kernels import PLAN_BOUND_TOL, subproblem_bound
from lbkit.eplb._exact import EXACT_BUDGET, EXACT_MAX_REPLICAS, exact_search
from lbkit.eplb._packing import pack, try_move
from lbkit.eplb._primitives import (
    REL_TOL,
    adopt,
    apportion_minmax,
    argmax,
    count_duplicates,
    insert_sorted,
    plan_loads,
    repair_duplicates,
)

__all__ = ["SECOND_RECEIVERS", "SECOND_STARTS", "solve_subproblem"]


@jit
def _count_search(w, num_gpus, slots, max_evals, good_enough, extra_recv, frozen, cnt, gpu_exp):
    """Steps 2-4 of :func:`solve_subproblem` from the counts in ``cnt`` (updated in place,
    with the packing in ``gpu_exp``); returns the largest GPU load.

    ``extra_recv`` heaviest experts (stable order) join the receivers; no move gives a replica
    to or takes one from expert ``frozen`` (``-1``: none).
    """
    num_log = w.shape[0]
    num_phy = num_gpus * slots
    total = 0.0
    for e in range(num_log):
        total += w[e]
    size = np.empty(num_log)
    load = np.empty(num_gpus)
    gpu_n = np.empty(num_gpus, dtype=np.int64)
    last = np.empty(num_gpus, dtype=np.int64)
    max_iter = 4 * num_phy
    best = pack(w, cnt, num_gpus, slots, size, gpu_exp, load, gpu_n, last, max_iter, good_enough)
    best_load = load.copy()
    trial_cnt = cnt.copy()
    trial_exp = gpu_exp.copy()
    rcap = slots + 4 + extra_recv
    heavy = np.argsort(-w, kind="mergesort")
    recv = np.empty(rcap, dtype=np.int64)
    rkey = np.empty(rcap)
    fill = np.empty(3, dtype=np.int64)
    fkey = np.empty(3)
    dcap = slots + 5
    donors = np.empty(dcap, dtype=np.int64)
    dkey = np.empty(dcap)
    evals = 0
    while total > 0.0 and num_phy > num_log and evals < max_evals:
        if best <= good_enough:
            break
        gm = argmax(best_load)
        for e in range(num_log):
            size[e] = w[e] / cnt[e]
        # Receivers: experts on the most loaded GPU (largest replica first), the expert with
        # the largest replica, then the three with the smallest replicas (fillers).
        nr = 0
        for i in range(slots):
            e = gpu_exp[gm, i]
            nr = insert_sorted(recv, nr, slots, e, -size[e], rkey)
        top = 0
        for e in range(1, num_log):
            if size[e] > size[top]:
                top = e
        nr = insert_sorted(recv, nr, rcap, top, np.inf, rkey)
        nf = 0
        for e in range(num_log):
            nf = insert_sorted(fill, nf, 3, e, size[e], fkey)
        for k in range(nf):
            nr = insert_sorted(recv, nr, rcap, fill[k], np.inf, rkey)
        for k in range(min(extra_recv, num_log)):
            seen = False
            for a in range(nr):
                if recv[a] == heavy[k]:
                    seen = True
            if not seen:
                nr = insert_sorted(recv, nr, rcap, heavy[k], np.inf, rkey)
        # Donors: the four that lose least by giving up a replica, then the experts with two or
        # more replicas on the most loaded GPU (largest replica first), then the largest one.
        nd = 0
        for e in range(num_log):
            if cnt[e] >= 2:
                nd = insert_sorted(donors, nd, 4, e, w[e] / (cnt[e] - 1), dkey)
        for i in range(slots):
            e = gpu_exp[gm, i]
            if cnt[e] >= 2:
                nd = insert_sorted(donors, nd, dcap, e, np.inf, dkey)
        if cnt[top] >= 2:
            nd = insert_sorted(donors, nd, dcap, top, np.inf, dkey)
        improved = False
        for a in range(nr):
            for b in range(nd):
                if recv[a] == donors[b] or evals >= max_evals:
                    continue
                if recv[a] == frozen or donors[b] == frozen:
                    continue
                evals += 1
                if slots <= 2:
                    for e in range(num_log):
                        trial_cnt[e] = cnt[e]
                    trial_cnt[recv[a]] += 1
                    trial_cnt[donors[b]] -= 1
                    v = pack(
                        w,
                        trial_cnt,
                        num_gpus,
                        slots,
                        size,
                        trial_exp,
                        load,
                        gpu_n,
                        last,
                        max_iter,
                        good_enough,
                    )
                else:
                    v = try_move(
                        w,
                        cnt,
                        gpu_exp,
                        recv[a],
                        donors[b],
                        trial_cnt,
                        trial_exp,
                        size,
                        load,
                        max_iter,
                        good_enough,
                    )
                if v < best * (1.0 - REL_TOL):
                    best = v
                    adopt(trial_cnt, trial_exp, cnt, gpu_exp)
                    best_load[:] = load
                    improved = True
                    break
            if improved:
                break
        if not improved:
            break
    if evals > 0:
        v = pack(w, cnt, num_gpus, slots, size, trial_exp, load, gpu_n, last, max_iter, good_enough)
        if v < best * (1.0 - REL_TOL):
            best = v
            gpu_exp[:, :] = trial_exp
    return plan_loads(w, cnt, gpu_exp, size, load)


#: Second starts of the count search on large sub-problems (more than 32 replicas, 3 or more
#: slots per GPU): the largest expert keeps 1, 2, ... fewer replicas than in the current plan.
#: A second one (2 fewer) found nothing more on Zipf 1.0 loads and doubled the plan time.
SECOND_STARTS = 1


#: Heaviest experts added to the receivers of the count search in a second start.
SECOND_RECEIVERS = 8


@jit
def _second_starts(
    w, num_gpus, slots, max_evals, good_enough, best, cnt, gpu_exp, trial_cnt, trial_exp
):
    """Rerun :func:`_count_search` from counts where the largest expert (lowest index among
    equals) has ``k`` fewer replicas than in ``cnt`` (``k = 1 .. SECOND_STARTS``, at least one
    replica) and the others share the remaining slots by the min-max apportionment; that
    expert's count stays frozen (otherwise the first improving move gives the replica back),
    the ``SECOND_RECEIVERS`` heaviest experts join the receivers, and the search has
    ``max_evals // 4`` trial plans. Keeps the strictly best plan in ``cnt`` / ``gpu_exp`` and
    returns its largest GPU load.

    The apportionment spreads a dominant expert over nearly every GPU, which leaves too few
    slots for the others to fill the GPUs evenly; plans that keep it on fewer GPUs and give the
    spare slots to the experts packed beside it are often far better and out of reach of
    single replica moves.
    """
    num_log = w.shape[0]
    num_phy = num_gpus * slots
    top = 0
    for e in range(1, num_log):
        if w[e] > w[top]:
            top = e
    base = cnt[top]
    rest = np.empty(num_log - 1)
    rest_cnt = np.empty(num_log - 1, dtype=np.int64)
    k = 0
    for e in range(num_log):
        if e != top:
            rest[k] = w[e]
            k += 1
    for drop in range(1, SECOND_STARTS + 1):
        c_top = base - drop
        if c_top < 1 or best <= good_enough:
            break
        apportion_minmax(rest, num_phy - c_top, rest_cnt)
        k = 0
        for e in range(num_log):
            if e == top:
                trial_cnt[e] = c_top
            else:
                trial_cnt[e] = rest_cnt[k]
                k += 1
        v = _count_search(
            w,
            num_gpus,
            slots,
            max_evals // 4,
            good_enough,
            SECOND_RECEIVERS,
            top,
            trial_cnt,
            trial_exp,
        )
        if v < best * (1.0 - REL_TOL):
            best = v
            adopt(trial_cnt, trial_exp, cnt, gpu_exp)
    return best


@jit
def solve_subproblem(w, num_gpus, slots, max_evals, stop_gap, target, cnt, gpu_exp):
    """Choose replica counts and their packing for one sub-problem; returns the largest GPU load.

    1. Counts: the min-max apportionment (:func:`apportion_minmax`).
    2. Packing: :func:`_lpt` then :func:`_improve_swaps`.
    3. Count search (first improvement, at most ``max_evals`` trial plans): move one replica
       from a donor to a receiver and repack from the current plan (:func:`try_move`); keep the
       move when the largest GPU load drops. Receivers: the experts on the most loaded GPU
       (largest replica first), the expert with the largest replica, and the three experts
       with the smallest replicas (small replicas fill the GPUs of large ones). Donors: the
       four experts that lose least by giving up a replica (smallest ``w / (c - 1)``), the
       experts with two or more replicas on the most loaded GPU, and the largest one. With two
       slots per GPU a trial is a fresh LPT packing (optimal for two slots: the largest replica
       pairs with the smallest), otherwise it starts from the current plan.
    4. A fresh LPT packing of the final counts replaces the plan if it is better.
    5. Second start (more than ``EXACT_MAX_REPLICAS`` replicas, 3 or more slots per GPU):
       :func:`_second_starts`, steps 2-4 again from counts that keep the largest expert on one
       GPU fewer, with that expert's count frozen, more receivers and a quarter of the trials.
    6. Exact search (at most ``EXACT_MAX_REPLICAS`` replicas): :func:`exact_search` for a
       strictly better plan while its node budget lasts.
    7. Duplicates: swaps that separate two replicas of one expert without raising the maximum;
       with at most ``EXACT_MAX_REPLICAS`` replicas, the exact search then looks for a
       duplicate-free plan no worse than this one.

    Every search stops as soon as the largest load is within a relative ``stop_gap`` of the
    sub-problem's lower bound (:func:`subproblem_bound`), since no plan can be better than the
    bound, or at most ``target``: a node whose largest GPU load is at most the largest load
    already reached on another node of the layer cannot change the layer's balance.

    Runtime complexity: O(M × (R log G + I × G × S²)) for ``M`` trial packings (at most
    ``max_evals``, and ``max_evals / 4`` more in the second start) of ``I`` local-search steps
    each (at most ``4 R``; a stuck search adds pair exchanges of O(G × S⁴)); the exact search
    visits at most ``EXACT_BUDGET`` search nodes, twice.
    """
    num_log = w.shape[0]
    num_phy = num_gpus * slots
    total = 0.0
    for e in range(num_log):
        total += w[e]
    size = np.empty(num_log)
    load = np.empty(num_gpus)
    trial_cnt = np.empty(num_log, dtype=np.int64)
    trial_exp = np.empty_like(gpu_exp)
    bound = subproblem_bound(w, num_gpus, slots, PLAN_BOUND_TOL)
    good_enough = max(bound * (1.0 + stop_gap), target)
    apportion_minmax(w, num_phy, cnt)
    best = _count_search(w, num_gpus, slots, max_evals, good_enough, 0, -1, cnt, gpu_exp)
    if slots > 2 and num_phy > EXACT_MAX_REPLICAS and best > good_enough and total > 0.0:
        best = _second_starts(
            w, num_gpus, slots, max_evals, good_enough, best, cnt, gpu_exp, trial_cnt, trial_exp
        )
    best = plan_loads(w, cnt, gpu_exp, size, load)
    if num_phy <= EXACT_MAX_REPLICAS and total > 0.0:
        # Small sub-problem: exact search for a strictly better plan, while one exists and the
        # node budget lasts (each success lowers the cap).
        if best > good_enough:
            found = exact_search(
                w,
                num_gpus,
                slots,
                best * (1.0 - 1e-9),
                False,
                True,
                EXACT_BUDGET,
                trial_cnt,
                trial_exp,
            )
            if found > 0:
                adopt(trial_cnt, trial_exp, cnt, gpu_exp)
                best = plan_loads(w, cnt, gpu_exp, size, load)
    if count_duplicates(gpu_exp) > 0:
        repair_duplicates(size, gpu_exp, load, best)
    if num_phy <= EXACT_MAX_REPLICAS and count_duplicates(gpu_exp) > 0:
        # A duplicate-free plan no worse than this one, if the exact search finds one.
        found = exact_search(
            w, num_gpus, slots, best, True, False, EXACT_BUDGET, trial_cnt, trial_exp
        )
        if found > 0:
            adopt(trial_cnt, trial_exp, cnt, gpu_exp)
            plan_loads(w, cnt, gpu_exp, size, load)
    return load[argmax(load)]
