"""The excess descent of a re-plan (step 3 of :func:`lbkit.eplb._replan_layer.replan_subproblem`).

From a packing with GPUs above ``target``, lower the total excess ``sum_g max(0, load[g] -
target)`` one step at a time: the step of largest reduction per move (a step that costs no move
beats every paid one, free steps by reduction). Three kinds of step:

- a **count change** (:data:`STEP_COUNT_CHANGE`, one move): a slot of an expert with two or more
  replicas given to another expert, on a GPU above ``target`` or to an expert held by one;
- a **swap** (:data:`STEP_SWAP`, two moves): a replica of a GPU above ``target`` exchanged with a
  smaller one elsewhere;
- a **chain** (:data:`STEP_CHAIN`, ``m + 1`` moves): GPUs above ``target`` ``h_1 .. h_m``
  (``m >= 2``) each pass a replica to the previous one, ``h_1``'s going to a light GPU that
  passes one to ``h_m``.

A step's cost is its change in moves; steps beyond ``budget`` are skipped; ties: lowest GPU,
slot, expert, and the kinds in that order. The best swap is searched first
(``_replan_swaps.py``: kept per GPU across the steps, searched again only where a GPU
changed), so that the count-change and chain searches need only reach it. Chains are searched
only when the best count change or swap costs moves: they are the costliest search, and a free
chain with a larger reduction than the best free step is rare (none in 254 free steps of 31
sampled 320/64 sub-problems); skipping them there gives the same moves within 0.4% on the
twelve synthetic drift cases of ``benchmarks/eplb_move_ratio.py`` and takes 12% off the 320/64
kernels. Clean arrays only
(see ``_primitives.py`` for the vocabulary); every kernel also runs with
``NUMBA_DISABLE_JIT=1``.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._primitives import (
    REL_TOL,
    apply_replace,
    apply_swap,
    count_moves,
    equals_best,
    excess,
    gpu_loads,
    holders,
    replace_cost,
    step_score,
)
from lbkit.eplb._replan_swaps import cached_best_swap, mark_changed, swap_cache

__all__ = [
    "MAX_CHAIN",
    "STEP_CHAIN",
    "STEP_COUNT_CHANGE",
    "STEP_NONE",
    "STEP_SWAP",
    "count_change_scratch",
    "descend",
]

#: Kinds of descent step (:func:`descend`); ``STEP_NONE``: no step lowers the excess.
STEP_NONE = -1
STEP_COUNT_CHANGE = 0
STEP_SWAP = 1
STEP_CHAIN = 2

#: Most GPUs above the target in one chain.
MAX_CHAIN = 8


@jit
def count_change_scratch(num_gpus, num_log):
    """The work arrays of :func:`_best_count_change`: ``(dl, mark, touched, hot_list, reach)``."""
    return (
        np.zeros(num_gpus),
        np.zeros(num_gpus, dtype=np.int64),
        np.empty(num_gpus, dtype=np.int64),
        np.empty(num_log, dtype=np.int64),
        np.empty(num_log),
    )


@jit
def _best_count_change(
    w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves, start, gpus, hot, old_of,
    scratch, best_free, best_score,
):  # fmt: skip
    """The best count change that beats ``(best_free, best_score)``: slot ``i`` of GPU ``h``
    (expert ``a``, two or more replicas) given to expert ``b``; ``a``'s other replicas grow,
    ``b``'s shrink. Returns ``(found, best_free, best_score, h, i, b)``.

    ``start``, ``gpus``: the holders of every expert (:func:`holders`); ``hot[e]``: some GPU
    above ``target`` holds ``e``; ``old_of[g]``: the experts GPU ``g`` held in the old plan
    (``-1`` pads); ``scratch``: ``(dl, mark, touched, hot_list, reach)`` work arrays. The step
    is the first of the best in the order of ``(h, i, b)``, whatever order the candidates are
    evaluated in. GPUs above the target are searched first, so that a good step is known
    early; the experts ``b`` of a slot by decreasing ``reach[b]`` (below), until
    ``reach[b]`` plus the parts of ``h`` and of ``a``'s growth cannot beat the best step; the
    ``b`` that bound does not cover are searched after: those sharing a GPU with ``a``, and,
    when the replica given up is not a move, those ``h`` held in the old plan (the only ``b``
    that make the step free, which a paid best step does not bound). A candidate is evaluated
    only if an upper bound on its reduction can beat the best step so far: ``b``'s replicas
    shrink by ``size[b] - w[b] / (cnt[b] + 1)``, lowering each holder's excess by at most that,
    ``h``'s excess falls by at most ``size[a] - w[b] / (cnt[b] + 1)``, and ``a``'s other
    replicas only grow. A second, tighter bound counts the growth of ``a``'s replicas exactly
    (per ``(h, i)``, once for every ``b``), ``h``'s change exactly, and for each holder of ``b``
    at most ``min(shrink, its excess after a's growth)``; both bounds carry a slack above any
    rounding, so they only skip steps that cannot be taken. When no GPU holds both ``a`` and
    ``b``, the holders of ``b`` keep their loads until ``b`` shrinks, so the second bound is
    ``reach[b]`` plus the parts of ``h`` and of ``a``'s growth, and the first is not needed.
    """
    dl, mark, touched, hot_list, reach = scratch
    num_gpus, slots = gpu_exp.shape
    num_log = w.shape[0]
    tol = REL_TOL * target
    slack = 1e-9 * target  # above any rounding of a reduction
    found = False
    bh = bi = bb = -1
    stamp = 0
    for g in range(num_gpus):
        mark[g] = 0
    n_hot = 0
    nb_of = np.empty(num_log)  # size of b's replicas after the step
    for b in range(num_log):
        r = 0.0
        nb_of[b] = w[b] / (cnt[b] + 1)
        shrink = size[b] - nb_of[b]
        for k in range(start[b], start[b + 1]):
            r += min(excess(load[gpus[k]], target), shrink)
        reach[b] = r
    by_reach = np.argsort(-reach)  # any order of equals: the result does not depend on it
    for q in range(num_log):
        if hot[by_reach[q]]:
            hot_list[n_hot] = by_reach[q]
            n_hot += 1
    amark = np.zeros(num_gpus, dtype=np.int64)  # GPUs holding a (stamp), their growth
    bmark = np.zeros(num_log, dtype=np.int64)  # experts on a GPU holding a (stamp)
    seen = np.zeros(num_log, dtype=np.int64)  # b searched for this slot (stamp)
    tail = np.empty(num_gpus * slots + old_of.shape[1], dtype=np.int64)  # searched after
    adl = np.zeros(num_gpus)
    astamp = 0
    for pos in range(2 * num_gpus):  # GPUs above the target first: a high score early
        h = pos % num_gpus
        h_heavy = load[h] > target + tol
        if h_heavy != (pos < num_gpus):
            continue
        h_exc = excess(load[h], target)
        n_b = num_log if h_heavy else n_hot
        for i in range(slots):
            a = gpu_exp[h, i]
            if cnt[a] < 2:
                continue
            grow = w[a] / (cnt[a] - 1) - size[a]
            # a's replicas grow: that part of the change, shared by every b
            astamp += 1
            for k in range(start[a], start[a + 1]):
                g = gpus[k]
                if amark[g] != astamp:
                    amark[g] = astamp
                    adl[g] = 0.0
                adl[g] += grow
            base = 0.0
            for k in range(start[a], start[a + 1]):
                g = gpus[k]
                if g != h and amark[g] == astamp:
                    amark[g] = -astamp  # counted once
                    base += excess(load[g], target) - excess(load[g] + adl[g], target)
            n_tail = 0
            for k in range(start[a], start[a + 1]):
                g = gpus[k]
                amark[g] = astamp
                for j in range(slots):
                    e = gpu_exp[g, j]
                    if bmark[e] != astamp:
                        bmark[e] = astamp  # shares a GPU with a: bounded without base
                        tail[n_tail] = e
                        n_tail += 1
            a_moved = cur[h, a] > hold[h, a]  # then every b is free
            if not a_moved:  # the b that make the step free
                for t in range(old_of.shape[1]):
                    if old_of[h, t] < 0:
                        break
                    tail[n_tail] = old_of[h, t]
                    n_tail += 1
            h_after = load[h] + adl[h] - grow - size[a]
            top_ab = base + h_exc + slack  # reach[b] + this bounds the rest of the b
            q = 0
            while True:
                if q < n_b:
                    b = by_reach[q] if h_heavy else hot_list[q]
                    q += 1
                    if best_free or (found and not a_moved):
                        limit = best_score  # a paid b cannot beat a paid best either
                    else:
                        limit = tol
                    if reach[b] + top_ab <= limit:
                        q = n_b  # nor can any b after it: on to the tail
                        continue
                    seen[b] = astamp
                elif n_tail > 0:
                    n_tail -= 1
                    b = tail[n_tail]
                    if seen[b] == astamp or (not h_heavy and not hot[b]):
                        continue
                    seen[b] = astamp
                else:
                    break
                if b == a or cur[h, b] > 0:
                    continue
                cost = replace_cost(cur, hold, h, a, b)
                if moves + cost > budget:
                    continue
                if cost > 0 and best_free:
                    continue
                nb = nb_of[b]
                shrink = size[b] - nb
                if bmark[b] != astamp:  # no GPU holds both: the second bound, from reach[b]
                    bound = base + h_exc - excess(h_after + nb, target) + reach[b] + slack
                else:
                    bound = reach[b] + min(h_exc, max(size[a] - nb, 0.0)) + slack
                    if bound <= tol or step_score(bound, cost, best_free, best_score) < 0.0:
                        continue  # even the bound cannot beat the best step
                    bound = base + h_exc - excess(h_after + nb, target) + slack
                    for k in range(start[b], start[b + 1]):
                        g = gpus[k]
                        x = load[g] + adl[g] if amark[g] == astamp else load[g]
                        bound += min(excess(x, target), shrink)
                if bound <= tol or step_score(bound, cost, best_free, best_score) < 0.0:
                    continue  # even the bound cannot beat the best step
                stamp += 1
                nt = 0
                for k in range(start[a], start[a + 1]):
                    g = gpus[k]
                    if mark[g] != stamp:
                        mark[g] = stamp
                        dl[g] = 0.0
                        touched[nt] = g
                        nt += 1
                    dl[g] += grow
                for k in range(start[b], start[b + 1]):
                    g = gpus[k]
                    if mark[g] != stamp:
                        mark[g] = stamp
                        dl[g] = 0.0
                        touched[nt] = g
                        nt += 1
                    dl[g] -= shrink
                dl[h] += nb - size[a] - grow
                red = 0.0
                for k in range(nt):
                    g = touched[k]
                    red += excess(load[g], target) - excess(load[g] + dl[g], target)
                if red <= tol:
                    continue
                score = step_score(red, cost, best_free, best_score)
                if score < 0.0:
                    # not better; equal to the best count change found and earlier in the
                    # order of (h, i, b) (that order's first one is the step taken)
                    if not equals_best(found, red, cost, best_free, best_score):
                        continue
                    if h > bh or (h == bh and (i > bi or (i == bi and b > bb))):
                        continue
                    score = best_score
                best_free = cost <= 0
                best_score = score
                found = True
                bh = h
                bi = i
                bb = b
    return found, best_free, best_score, bh, bi, bb


@jit
def _slots_by_size(size, gpu_exp, g, out):
    """The slots of GPU ``g`` by decreasing replica size, lowest slot among equals (insertion
    sort: ``S`` is small)."""
    slots = gpu_exp.shape[1]
    for j in range(slots):
        x = size[gpu_exp[g, j]]
        pos = j
        while pos > 0 and size[gpu_exp[g, out[pos - 1]]] < x:
            out[pos] = out[pos - 1]
            pos -= 1
        out[pos] = j


@jit
def _close_chain(size, cur, gpu_exp, load, target, cg, ci, m, mark, stamp, limit, by_room):
    """The light GPU ``k`` (slot ``j``) that closes the chain ``cg[:m], ci[:m]``: it takes the
    first GPU's replica and gives one of size at most ``limit`` to the last; among those, the
    lowest load after the exchange (lowest GPU, slot among equals). Returns ``(k, j, load of k
    after)``, ``k = -1`` if none.

    ``by_room = (order, key, by_size)``: the GPUs by increasing load, ``key[k] = load[k] -
    (largest replica of k)`` and ``by_size[k]``, the slots of ``k`` by decreasing size (lowest
    slot among equals). The load of ``k`` after the exchange less ``size[a1]`` is at least
    ``key[k]`` and at least ``load[k] - limit``: a GPU whose bound is above the best so far, or
    above ``target`` (which the load after the exchange may not exceed), by a slack above
    rounding, is skipped, and the search stops at the first GPU whose second bound is (the
    loads increase). On each GPU only the largest replica that fits is tried (and those after
    it that leave the same load after rounding).
    """
    order, key, by_size = by_room
    num_gpus, slots = gpu_exp.shape
    tol = REL_TOL * target
    slack = 1e-9 * target
    a1 = gpu_exp[cg[0], ci[0]]
    last = cg[m - 1]
    ck = cj = -1
    ck_load = 0.0
    for r in range(num_gpus):
        k = order[r]
        best = (ck_load if ck >= 0 else target + tol) + slack
        if load[k] - (limit + tol) + size[a1] > best:
            break  # no slot of this GPU or the next ones fits, or beats the best
        if key[k] + size[a1] > best or mark[k] == stamp or cur[k, a1] > 0:
            continue
        room = target - load[k] - size[a1]
        first = np.inf  # load after the exchange with the largest replica that fits
        for t in range(slots):
            j = by_size[k, t]
            c = gpu_exp[k, j]
            sc = size[c]
            if sc > limit + tol or cur[last, c] > 0:
                continue
            if -sc > room + tol:
                break  # the smaller replicas after it do not fit either
            nl = load[k] + size[a1] - sc
            if nl > first:
                break  # smaller replicas only leave k more loaded
            first = nl
            if ck < 0 or nl < ck_load or (nl == ck_load and (k < ck or (k == ck and j < cj))):
                ck = k
                cj = j
                ck_load = nl
    return ck, cj, ck_load


@jit
def _chain_value(size, hold, cur, gpu_exp, load, target, cg, ci, m, ck, cj, ck_load):
    """``(cost, reduction of the excess)`` of the chain ``cg[:m], ci[:m]`` closed by slot ``cj``
    of GPU ``ck``."""
    cost = 0
    red = 0.0
    prev_e = gpu_exp[ck, cj]
    for q in range(m - 1, -1, -1):
        g = cg[q]
        e_out = gpu_exp[g, ci[q]]
        cost += replace_cost(cur, hold, g, e_out, prev_e)
        red += excess(load[g], target) - excess(load[g] - size[e_out] + size[prev_e], target)
        prev_e = e_out
    cost += replace_cost(cur, hold, ck, gpu_exp[ck, cj], gpu_exp[cg[0], ci[0]])
    red += excess(load[ck], target) - excess(ck_load, target)
    return cost, red


@jit
def _best_chain(
    size, hold, cur, gpu_exp, load, target, budget, moves, scratch, best, best_free, best_score
):
    """The best chain that beats ``(best_free, best_score)``, grown greedily from every slot of
    every GPU above ``target``: each step adds the largest replica (of size at most the limit
    the chain leaves) of another GPU above ``target`` that the last GPU does not hold.

    ``scratch``: ``(mark, cg, ci, hs_g, hs_j, hs_key)`` work arrays (``hs_*`` of ``G S``
    entries); the chain found goes to ``best = (bcg, bci)``.
    Returns ``(found, best_free, best_score, m, k, j)``: ``m`` GPUs above ``target`` and the
    closing slot ``j`` of GPU ``k``.

    When the best step so far is free, only a free chain can beat it, and a chain is not closed
    when its cost cannot drop to zero whatever closes it: the exchanges between its GPUs are
    known, the last GPU's costs at least minus one if the replica it passes on is a move, and
    the closing GPU's at least minus one.
    """
    mark, cg, ci, hs_g, hs_j, hs_key = scratch
    bcg, bci = best
    num_gpus, slots = gpu_exp.shape
    tol = REL_TOL * target
    max_chain = min(num_gpus - 1, MAX_CHAIN)
    found = False
    bm = 0
    bk = bj = -1
    stamp = 0
    key = np.empty(num_gpus)  # GPUs by their load less their largest replica (_close_chain)
    by_size = np.empty((num_gpus, slots), dtype=np.int64)
    for g in range(num_gpus):
        mark[g] = 0
        _slots_by_size(size, gpu_exp, g, by_size[g])
        key[g] = load[g] - size[gpu_exp[g, by_size[g, 0]]]
    by_room = (np.argsort(load, kind="mergesort"), key, by_size)
    # slots of the GPUs above the target by decreasing size (lowest GPU, slot among equals)
    n_hs = 0
    for g in range(num_gpus):
        if load[g] > target + tol:
            for j in range(slots):
                hs_g[n_hs] = g
                hs_j[n_hs] = j
                hs_key[n_hs] = -size[gpu_exp[g, j]]
                n_hs += 1
    hs_order = np.argsort(hs_key[:n_hs], kind="mergesort")
    hs_neg = np.empty(n_hs)
    for q in range(n_hs):
        hs_neg[q] = hs_key[hs_order[q]]
    for h1 in range(num_gpus):
        if load[h1] <= target + tol:
            continue
        for i1 in range(slots):
            a1 = gpu_exp[h1, i1]
            stamp += 1
            mark[h1] = stamp
            m = 1
            cg[0] = h1
            ci[0] = i1
            limit = size[a1] - (load[h1] - target)
            inner = 0  # cost of the exchanges between the chain's GPUs
            while True:
                last = cg[m - 1]
                ck = cj = -1
                ck_load = 0.0
                least = inner - 1  # the least cost of the chain closed here
                out = gpu_exp[last, ci[m - 1]]
                if cur[last, out] > hold[last, out]:
                    least -= 1
                if m >= 2 and not (best_free and least > 0):  # one heavy GPU: a swap
                    ck, cj, ck_load = _close_chain(
                        size, cur, gpu_exp, load, target, cg, ci, m, mark, stamp, limit, by_room
                    )
                if ck >= 0:
                    cost, red = _chain_value(
                        size, hold, cur, gpu_exp, load, target, cg, ci, m, ck, cj, ck_load
                    )
                    if red > tol and moves + cost <= budget:
                        score = step_score(red, cost, best_free, best_score)
                        if score >= 0.0:
                            best_free = cost <= 0
                            best_score = score
                            found = True
                            bm = m
                            for q in range(m):
                                bcg[q] = cg[q]
                                bci[q] = ci[q]
                            bk = ck
                            bj = cj
                if m >= max_chain:
                    break
                # the largest replica of size at most the limit (first in the sorted list)
                nh = ni = -1
                for q in range(np.searchsorted(hs_neg, -(limit + tol)), n_hs):
                    g = hs_g[hs_order[q]]
                    j = hs_j[hs_order[q]]
                    x = gpu_exp[g, j]
                    if mark[g] == stamp or cur[last, x] > 0:
                        continue
                    if size[x] - (load[g] - target) <= tol:
                        continue
                    nh = g
                    ni = j
                    break
                if nh < 0:
                    break
                inner += replace_cost(cur, hold, last, gpu_exp[last, ci[m - 1]], gpu_exp[nh, ni])
                mark[nh] = stamp
                cg[m] = nh
                ci[m] = ni
                m += 1
                limit = size[gpu_exp[nh, ni]] - (load[nh] - target)
    return found, best_free, best_score, bm, bk, bj


@jit
def _apply_chain(gpu_exp, cur, bcg, bci, bm, bk, bj):
    """Make the chain ``bcg[:bm], bci[:bm]`` closed by slot ``bj`` of GPU ``bk``."""
    a1 = gpu_exp[bcg[0], bci[0]]
    for q in range(bm):
        g = bcg[q]
        e_out = gpu_exp[g, bci[q]]
        e_in = gpu_exp[bcg[q + 1], bci[q + 1]] if q + 1 < bm else gpu_exp[bk, bj]
        cur[g, e_out] -= 1
        cur[g, e_in] += 1
        gpu_exp[g, bci[q]] = e_in
    c = gpu_exp[bk, bj]
    cur[bk, c] -= 1
    cur[bk, a1] += 1
    gpu_exp[bk, bj] = a1


@jit
def _mark_hot(load, target, start, gpus, hot):
    """``hot[e]``: some GPU above ``target`` holds expert ``e``."""
    tol = REL_TOL * target
    for e in range(hot.shape[0]):
        hot[e] = False
        for k in range(start[e], start[e + 1]):
            if load[gpus[k]] > target + tol:
                hot[e] = True
                break


@jit
def descend(w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves, max_steps, cur_tmp):
    """Lower the total excess step by step (module docstring), at most ``max_steps`` steps.

    Updates ``cnt``, ``size``, ``cur``, ``gpu_exp`` and ``load`` in place and returns the moves
    of the final state.

    Runtime complexity: O(max_steps × (G S E + H S G S + H S × MAX_CHAIN × G S)) for ``H`` GPUs
    above ``target``; the swap search is O(H S G S) on the first step and, on the others,
    O(S G S) per GPU above ``target`` that changed or whose best swap's partner did, plus
    O(S C S) per other one for the ``C`` GPUs that changed.
    """
    num_gpus, slots = gpu_exp.shape
    num_log = w.shape[0]
    start = np.zeros(num_log + 1, dtype=np.int64)
    gpus = np.empty(num_gpus * slots, dtype=np.int64)
    hot = np.zeros(num_log, dtype=np.bool_)
    change_scratch = count_change_scratch(num_gpus, num_log)
    chain_scratch = (
        np.zeros(num_gpus, dtype=np.int64),
        np.empty(num_gpus, dtype=np.int64),
        np.empty(num_gpus, dtype=np.int64),
        np.empty(num_gpus * slots, dtype=np.int64),
        np.empty(num_gpus * slots, dtype=np.int64),
        np.empty(num_gpus * slots),
    )
    bcg = np.empty(num_gpus, dtype=np.int64)
    bci = np.empty(num_gpus, dtype=np.int64)
    old_of = np.full((num_gpus, slots), -1, dtype=np.int64)  # experts of the old plan per GPU
    for g in range(num_gpus):
        t = 0
        for e in range(num_log):
            if hold[g, e] > 0:
                old_of[g, t] = e
                t += 1
    cache = swap_cache(num_gpus)
    before_exp = np.empty_like(gpu_exp)
    before_load = np.empty(num_gpus)
    tol = REL_TOL * target
    for _step in range(max_steps):
        heavy = 0
        for g in range(num_gpus):
            if load[g] > target + tol:
                heavy += 1
        if heavy == 0:
            break
        holders(gpu_exp, num_log, start, gpus)
        _mark_hot(load, target, start, gpus, hot)
        kind = STEP_NONE
        # The best swap first (kept across steps); the count-change search then needs only to
        # reach it, since a count change wins a tie with a swap: its threshold is the next
        # float below the swap's score.
        s_found, s_free, s_score, sh, si, sk, sj = cached_best_swap(
            size, hold, cur, gpu_exp, load, target, budget, moves, cache
        )
        best_free = False
        best_score = 0.0
        if s_found:
            best_free = s_free
            best_score = np.nextafter(s_score, -np.inf)
        found, c_free, c_score, ch, ci, cb = _best_count_change(
            w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves, start, gpus, hot,
            old_of, change_scratch, best_free, best_score,
        )  # fmt: skip
        if found:
            kind = STEP_COUNT_CHANGE
            best_free = c_free
            best_score = c_score
        elif s_found:
            kind = STEP_SWAP
            best_free = s_free
            best_score = s_score
        if not best_free:  # chains only against a paid step (module docstring)
            found, best_free, best_score, bm, bk, bj = _best_chain(
                size, hold, cur, gpu_exp, load, target, budget, moves, chain_scratch,
                (bcg, bci), best_free, best_score,
            )  # fmt: skip
            if found:
                kind = STEP_CHAIN
        if kind == STEP_NONE:
            break
        before_exp[:] = gpu_exp
        before_load[:] = load
        a = b = -1
        if kind == STEP_CHAIN:
            _apply_chain(gpu_exp, cur, bcg, bci, bm, bk, bj)
        elif kind == STEP_COUNT_CHANGE:
            a = gpu_exp[ch, ci]
            b = cb
            apply_replace(gpu_exp, cur, cnt, ch, ci, cb)
            size[a] = w[a] / cnt[a]
            size[cb] = w[cb] / cnt[cb]
        else:
            apply_swap(gpu_exp, cur, sh, si, sk, sj)
        gpu_loads(size, gpu_exp, load)
        mark_changed(gpu_exp, before_exp, load, before_load, cur, a, b, cache[5])
        moves = count_moves(hold, gpu_exp, cur_tmp)
    return moves
