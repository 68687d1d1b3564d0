"""Two slots per GPU: for fixed counts the sorted pairing (``k``-th largest replica with the
``k``-th smallest) is optimal and scored in ``O(E)``, so only the counts are searched
(:func:`solve_two_slot`, used by :func:`lbkit.eplb.balanced.two_slot_plan` for sub-problems of
more than ``EXACT_MAX_REPLICAS`` replicas).
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._bound_kernels import PLAN_BOUND_TOL, subproblem_bound
from lbkit.eplb._primitives import (
    REL_TOL,
    apportion_minmax,
    argmax,
    count_duplicates,
    recompute_loads,
    repair_duplicates,
)

__all__ = ["TWO_SLOT_RECEIVERS", "solve_two_slot", "two_slot_counts"]


#: Receivers below the critical partner tried per step of :func:`two_slot_counts`.
TWO_SLOT_RECEIVERS = 8
#: Steps of :func:`two_slot_counts` per GPU of the sub-problem.
TWO_SLOT_STEPS_PER_GPU = 8
#: Bisection steps on the cap in :func:`_two_slot_second_start`.
CAP_BISECTIONS = 12


@jit
def _pair_walk(size, cnt, order, num_gpus, limit, crit):
    """Sorted pairing of the replicas: the k-th largest with the k-th smallest.

    Expert ``e`` has ``cnt[e]`` replicas of ``size[e]``; ``order`` lists the experts by
    decreasing size. For fixed counts this pairing minimises the largest pair (exchange
    argument). Returns ``(top, ntop, partner)``: the largest pair sum, the number of pairs within
    a relative ``REL_TOL`` of it and the largest small-side replica among those pairs; or
    ``(inf, 0, 0.0)`` as soon as a pair exceeds ``limit``. When ``crit`` is not empty, the experts
    of every pair within ``REL_TOL`` of ``limit`` are marked in it. O(E).
    """
    num_log = order.shape[0]
    i = 0
    j = num_log - 1
    ri = cnt[order[i]]
    rj = cnt[order[j]]
    pairs = 0
    top = -1.0
    ntop = 0
    partner = 0.0
    while pairs < num_gpus:
        a = order[i]
        b = order[j]
        take = ri // 2 if i == j else min(ri, rj)
        take = min(take, num_gpus - pairs)
        v = size[a] + size[b]
        if v > limit:
            return np.inf, 0, 0.0
        if v > top * (1.0 + REL_TOL):
            top = v
            ntop = take
            partner = size[b]
        elif v >= top * (1.0 - REL_TOL):
            ntop += take
            partner = max(partner, size[b])
        if crit.shape[0] > 0 and v >= limit * (1.0 - REL_TOL):
            crit[a] = True
            crit[b] = True
        pairs += take
        if pairs >= num_gpus:
            break
        if i == j:
            ri -= 2 * take
            rj = ri
        else:
            ri -= take
            rj -= take
        if ri == 0:
            i += 1
            ri = cnt[order[i]] if i != j else rj
        if rj == 0:
            j -= 1
            rj = cnt[order[j]] if j != i else ri
    return top, ntop, partner


@jit
def _before(size, a, b):
    """Order of :func:`_pair_walk`: larger size first, then lower index."""
    return size[a] > size[b] or (size[a] == size[b] and a < b)


@jit
def _moved_order(order, size, d, r, out):
    """``order`` with experts ``d`` and ``r`` re-inserted at their places for the current sizes
    (the others keep their relative order). O(E)."""
    first, second = (r, d) if _before(size, r, d) else (d, r)
    k = 0
    placed = 0
    for t in range(order.shape[0]):
        x = order[t]
        if x == d or x == r:
            continue
        if placed == 0 and _before(size, first, x):
            out[k] = first
            k += 1
            placed = 1
        if placed == 1 and _before(size, second, x):
            out[k] = second
            k += 1
            placed = 2
        out[k] = x
        k += 1
    if placed == 0:
        out[k] = first
        k += 1
    if placed <= 1:
        out[k] = second


@jit
def two_slot_counts(w, num_gpus, good_enough, max_steps, fresh, cnt):
    """Replica counts for two slots per GPU by local search on the sorted pairing.

    Starts from the min-max apportionment (:func:`apportion_minmax`) if ``fresh``, otherwise
    from the counts in ``cnt``. Each step tries moving one
    replica from a donor (any expert with two or more) to a receiver: the experts of the pairs
    at the maximum, and the ``TWO_SLOT_RECEIVERS`` experts whose new replica would be the
    largest one still below the largest partner at the maximum (a smaller partner is what a
    large replica lacks). Each trial is scored exactly by :func:`_pair_walk` in O(E); the step
    takes the best trial by (largest pair, number of pairs at it), lexicographically, if it is
    strictly better (ties: lowest donor, then receiver). Stops when no trial is better, after
    ``max_steps`` steps, or once the largest pair is at most ``good_enough``. Returns the largest
    pair sum of the final counts (in ``cnt``).
    """
    num_log = w.shape[0]
    if fresh:
        apportion_minmax(w, 2 * num_gpus, cnt)
    size = np.empty(num_log)
    for e in range(num_log):
        size[e] = w[e] / cnt[e]
    order = np.argsort(-size, kind="mergesort")
    trial = np.empty_like(order)
    best_order = np.empty_like(order)
    crit = np.zeros(num_log, dtype=np.bool_)
    recv = np.zeros(num_log, dtype=np.bool_)
    key = np.empty(num_log)
    no_mark = np.zeros(0, dtype=np.bool_)
    top, ntop, partner = _pair_walk(size, cnt, order, num_gpus, np.inf, no_mark)
    if num_log == 2 * num_gpus:
        return top
    for _ in range(max_steps):
        if top <= good_enough:
            break
        crit[:] = False
        _pair_walk(size, cnt, order, num_gpus, top, crit)
        smallest = np.inf
        for e in range(num_log):
            smallest = min(smallest, size[e])
            key[e] = w[e] / (cnt[e] + 1)
            recv[e] = crit[e]
        by_key = np.argsort(-key, kind="mergesort")
        k = 0
        for t in range(num_log):
            e = by_key[t]
            if k < TWO_SLOT_RECEIVERS and key[e] < partner:
                recv[e] = True
                k += 1
        # and the expert of the largest replica and the three of the smallest
        recv[order[0]] = True
        for t in range(max(0, num_log - 3), num_log):
            recv[order[t]] = True
        bv = top
        bn = ntop
        bd = -1
        br = -1
        for d in range(num_log):
            if cnt[d] < 2:
                continue
            grown = w[d] / (cnt[d] - 1)
            for r in range(num_log):
                # The donor's larger replica pairs with a replica no smaller than the smallest.
                if r == d or not recv[r] or grown + min(smallest, key[r]) > bv * (1.0 + REL_TOL):
                    continue
                sd = size[d]
                sr = size[r]
                cnt[d] -= 1
                cnt[r] += 1
                size[d] = grown
                size[r] = key[r]
                _moved_order(order, size, d, r, trial)
                v, nv, _ = _pair_walk(size, cnt, trial, num_gpus, bv * (1.0 + REL_TOL), no_mark)
                if v < bv * (1.0 - REL_TOL) or (v <= bv * (1.0 + REL_TOL) and nv < bn):
                    bv = v
                    bn = nv
                    bd = d
                    br = r
                    best_order[:] = trial
                cnt[d] += 1
                cnt[r] -= 1
                size[d] = sd
                size[r] = sr
        if bd < 0:
            break
        cnt[bd] -= 1
        cnt[br] += 1
        size[bd] = w[bd] / cnt[bd]
        size[br] = w[br] / cnt[br]
        order[:] = best_order
        top, ntop, partner = _pair_walk(size, cnt, order, num_gpus, np.inf, no_mark)
    return top


@jit
def _ballot_violation(size, cnt, order, cap):
    """First replica size ``x > cap / 2`` (largest first) with more replicas ``>= x`` than
    replicas ``<= cap - x``, as the expert holding it; ``-1`` if there is none. With exactly
    ``2 G`` replicas, none means the sorted pairing keeps every GPU within ``cap`` (Hall's
    condition: replicas above ``cap / 2`` need distinct partners of at most ``cap - x``)."""
    num_log = order.shape[0]
    tol = REL_TOL * cap
    demand = 0
    supply = 0
    p = num_log - 1
    for t in range(num_log):
        e = order[t]
        x = size[e]
        if x <= 0.5 * cap + tol:
            break
        demand += cnt[e]
        while p >= 0 and size[order[p]] <= cap - x + tol:
            supply += cnt[order[p]]
            p -= 1
        if demand > supply:
            return e
    return -1


@jit
def _ballot_counts(w, num_gpus, cap, cnt):
    """Counts meant to pass :func:`_ballot_violation` at ``cap`` (a heuristic; ``False`` when it
    runs out of slots).

    From the fewest replicas that keep every replica within ``cap``, repeatedly fix the first
    violation (a replica ``x`` short of partners of at most ``u = cap - x``) with the change that
    gains most per added replica: one more replica for the expert of ``x`` (its replicas drop
    below ``x``), or enough replicas for another expert to bring its replicas to at most ``u``
    (ties: the largest resulting replica, which leaves smaller experts for tighter partners;
    then the lowest index). Slots left over go, one at a time, to the expert with the smallest
    replica, which only adds partners.
    """
    num_log = w.shape[0]
    num_phy = 2 * num_gpus
    size = np.empty(num_log)
    left = num_phy
    for e in range(num_log):
        c = 1
        if w[e] > cap:
            c = int(np.ceil(w[e] / cap))
        cnt[e] = c
        left -= c
    if left < 0:
        return False
    while True:
        for e in range(num_log):
            size[e] = w[e] / cnt[e]
        order = np.argsort(-size, kind="mergesort")
        b = _ballot_violation(size, cnt, order, cap)
        if b < 0:
            for _ in range(left):
                s = 0
                for e in range(1, num_log):
                    if size[e] < size[s]:
                        s = e
                cnt[s] += 1
                size[s] = w[s] / cnt[s]
            return True
        if left == 0:
            return False
        u = cap - size[b]
        best_e = b
        best_k = 1
        best_gain = float(cnt[b])
        best_size = w[b] / (cnt[b] + 1)
        if u > 0.0:
            for e in range(num_log):
                if e == b:
                    continue
                if size[e] <= u + REL_TOL * cap:
                    k = 1
                    gain = 1.0
                else:
                    c = int(np.ceil(w[e] / u))
                    if w[e] / c > u + REL_TOL * cap:
                        c += 1
                    k = c - cnt[e]
                    gain = float(c)
                if k > left:
                    continue
                new_size = w[e] / (cnt[e] + k)
                if gain * best_k > best_gain * k or (
                    gain * best_k == best_gain * k and new_size > best_size
                ):
                    best_e = e
                    best_k = k
                    best_gain = gain
                    best_size = new_size
        cnt[best_e] += best_k
        left -= best_k


@jit
def _two_slot_second_start(w, num_gpus, good_enough, top, cnt):
    """Second start for :func:`two_slot_counts`: bisection on the cap between the lower bound
    (``good_enough``) and the local optimum ``top`` with :func:`_ballot_counts`
    (``CAP_BISECTIONS`` steps), then the local search from the best counts it built. Keeps
    ``cnt`` unless this is strictly better; returns the largest pair sum."""
    num_log = w.shape[0]
    trial = np.empty(num_log, dtype=np.int64)
    best = np.empty(num_log, dtype=np.int64)
    size = np.empty(num_log)
    no_mark = np.zeros(0, dtype=np.bool_)
    lo = good_enough
    hi = top
    best_v = top
    found = False
    for _ in range(CAP_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if not _ballot_counts(w, num_gpus, mid, trial):
            lo = mid
            continue
        for e in range(num_log):
            size[e] = w[e] / trial[e]
        order = np.argsort(-size, kind="mergesort")
        v, _, _ = _pair_walk(size, trial, order, num_gpus, np.inf, no_mark)
        if v < best_v * (1.0 - REL_TOL):
            best_v = v
            best[:] = trial
            found = True
        hi = min(mid, v)
    if not found:
        return top
    v = two_slot_counts(w, num_gpus, good_enough, TWO_SLOT_STEPS_PER_GPU * num_gpus, False, best)
    if v < top * (1.0 - REL_TOL):
        cnt[:] = best
        return v
    return top


@jit
def _pair_out(cnt, order, num_gpus, gpu_exp):
    """Write the sorted pairing: GPU ``g`` gets the ``g``-th largest and ``g``-th smallest
    replica."""
    num_log = order.shape[0]
    i = 0
    j = num_log - 1
    ri = cnt[order[i]]
    rj = cnt[order[j]]
    for g in range(num_gpus):
        gpu_exp[g, 0] = order[i]
        ri -= 1
        if i == j:
            rj = ri
        if ri == 0:
            i += 1
            ri = cnt[order[i]] if i != j else rj
        gpu_exp[g, 1] = order[j]
        rj -= 1
        if i == j:
            ri = rj
        if rj == 0 and g < num_gpus - 1:
            j -= 1
            rj = cnt[order[j]] if j != i else ri


@jit
def solve_two_slot(w, num_gpus, stop_gap, target, cnt, gpu_exp):
    """Counts and packing for a sub-problem with two slots per GPU; returns the largest GPU load.

    Counts by :func:`two_slot_counts` (stopping once within ``stop_gap`` of
    :func:`subproblem_bound`, or at ``target``), the sorted pairing, then
    :func:`repair_duplicates` separates two replicas of one expert on a GPU where a swap keeps
    the maximum.

    Runtime complexity: O(T × E × K × E) for ``T <= TWO_SLOT_STEPS_PER_GPU × G`` count-search
    steps with ``K`` receivers each (``TWO_SLOT_RECEIVERS + 4`` plus the experts of the pairs at
    the maximum) and an O(E) pairing per trial, twice with the second start, plus
    ``CAP_BISECTIONS`` ballot constructions of O(G × E log E).
    """
    num_log = w.shape[0]
    total = 0.0
    for e in range(num_log):
        total += w[e]
    good_enough = max(subproblem_bound(w, num_gpus, 2, PLAN_BOUND_TOL) * (1.0 + stop_gap), target)
    if total <= 0.0:
        good_enough = np.inf
    top = two_slot_counts(w, num_gpus, good_enough, TWO_SLOT_STEPS_PER_GPU * num_gpus, True, cnt)
    if top > good_enough:
        top = _two_slot_second_start(w, num_gpus, good_enough, top, cnt)
    size = np.empty(num_log)
    for e in range(num_log):
        size[e] = w[e] / cnt[e]
    order = np.argsort(-size, kind="mergesort")
    _pair_out(cnt, order, num_gpus, gpu_exp)
    load = np.empty(num_gpus)
    recompute_loads(size, gpu_exp, load)
    best = load[argmax(load)]
    if count_duplicates(gpu_exp) > 0:
        repair_duplicates(size, gpu_exp, load, best)
    return load[argmax(load)]
