"""Packing of fixed replica counts onto GPUs with ``S`` slots each (default method, step 2).

:func:`_lpt` places replicas heaviest first on the lightest GPU with room; :func:`_local_search`
then swaps single replicas (:func:`_improve_swaps`) and pairs (:func:`_improve_pair_swap`)
between the most loaded GPU and another one while that lowers the larger load. :func:`pack`
packs a count vector from scratch, :func:`try_move` scores moving one replica from a donor to
a receiver starting from the current packing. Kernels of :mod:`lbkit.eplb.balanced`.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._primitives import REL_TOL, argmax, holds, recompute_loads

__all__ = []


@jit
def _gpu_before(load, a, b):
    return load[a] < load[b] or (load[a] == load[b] and a < b)


@jit
def _gpu_push(heap, n, g, load):
    pos = n
    heap[pos] = g
    while pos > 0:
        parent = (pos - 1) // 2
        if _gpu_before(load, heap[pos], heap[parent]):
            heap[pos], heap[parent] = heap[parent], heap[pos]
            pos = parent
        else:
            break
    return n + 1


@jit
def _gpu_pop(heap, n, load):
    top = heap[0]
    n -= 1
    heap[0] = heap[n]
    pos = 0
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        if child + 1 < n and _gpu_before(load, heap[child + 1], heap[child]):
            child += 1
        if _gpu_before(load, heap[child], heap[pos]):
            heap[pos], heap[child] = heap[child], heap[pos]
            pos = child
        else:
            break
    return top, n


@jit
def _lpt(size, cnt, num_gpus, slots, order, gpu_exp, gpu_n, load, last):
    """Longest-processing-time packing with exactly ``slots`` replicas per GPU.

    Replicas are placed heaviest first (experts in stable order of replica size); each goes to the
    lightest GPU with a free slot that does not already hold the expert (lowest GPU index among
    equal loads), or, when every GPU with room holds it, to the lightest GPU with room. A heap of
    the GPUs with room makes it O(R log G) while experts have few replicas, O(sum_e c_e² log G)
    at worst (GPUs holding the expert are popped and pushed back).
    """
    heap = np.empty(num_gpus, dtype=np.int64)
    stash = np.empty(num_gpus, dtype=np.int64)
    n = 0
    for g in range(num_gpus):
        gpu_n[g] = 0
        load[g] = 0.0
        last[g] = -1
        n = _gpu_push(heap, n, g, load)
    for k in range(order.shape[0]):
        e = order[k]
        for _ in range(cnt[e]):
            # Replicas of `e` are placed consecutively, so `last[g] == e` means g holds e.
            ns = 0
            g, n = _gpu_pop(heap, n, load)
            while last[g] == e and n > 0:
                stash[ns] = g
                ns += 1
                g, n = _gpu_pop(heap, n, load)
            if last[g] == e and ns > 0:  # every GPU with room holds e: take the lightest
                stash[ns] = g
                ns += 1
                g = stash[0]
                for t in range(1, ns):
                    stash[t - 1] = stash[t]
                ns -= 1
            gpu_exp[g, gpu_n[g]] = e
            gpu_n[g] += 1
            load[g] += size[e]
            last[g] = e
            if gpu_n[g] < slots:
                n = _gpu_push(heap, n, g, load)
            for t in range(ns):
                n = _gpu_push(heap, n, stash[t], load)


@jit
def _improve_swaps(size, gpu_exp, load, max_iter):
    """Local search: swap one replica of the most loaded GPU with a lighter replica elsewhere.

    Each step takes the most loaded GPU (lowest index among equals) and the swap that minimises
    the larger of the two new loads, provided it is strictly below the current maximum; swaps
    that would put two replicas of one expert on a GPU are never made. A partner GPU ``h`` is
    skipped when ``(max + load[h]) / 2``, the best a swap with it can reach, is no better than
    the best swap found. Stops when the most loaded GPU has no improving swap.
    Returns the number of swaps made.
    """
    num_gpus, slots = gpu_exp.shape
    steps = 0
    for _ in range(max_iter):
        gm = argmax(load)
        top = load[gm]
        tol = REL_TOL * top
        best_v = top - tol
        bi = -1
        bh = -1
        bj = -1
        for h in range(num_gpus):
            if h == gm:
                continue
            gap = top - load[h]
            if gap <= tol or 0.5 * (top + load[h]) >= best_v + tol:
                continue
            for i in range(slots):
                ea = gpu_exp[gm, i]
                a = size[ea]
                for j in range(slots):
                    eb = gpu_exp[h, j]
                    d = a - size[eb]
                    if d <= 0.0 or d >= gap:
                        continue
                    v = max(top - d, load[h] + d)
                    if v < best_v - tol:
                        if holds(gpu_exp, h, ea, j) or holds(gpu_exp, gm, eb, i):
                            continue
                        best_v = v
                        bi = i
                        bh = h
                        bj = j
        if bi < 0:
            break
        ea = gpu_exp[gm, bi]
        eb = gpu_exp[bh, bj]
        d = size[ea] - size[eb]
        gpu_exp[gm, bi] = eb
        gpu_exp[bh, bj] = ea
        load[gm] -= d
        load[bh] += d
        steps += 1
    return steps


@jit
def _pair_makes_duplicate(gpu_exp, g, i1, i2, h, j1, j2):
    """Would exchanging slots ``i1, i2`` of GPU ``g`` with ``j1, j2`` of ``h`` leave two
    replicas of one expert on either GPU?"""
    slots = gpu_exp.shape[1]
    for src, a1, a2, dst, b1, b2 in ((g, i1, i2, h, j1, j2), (h, j1, j2, g, i1, i2)):
        for e in (gpu_exp[src, a1], gpu_exp[src, a2]):
            for t in range(slots):
                if t != b1 and t != b2 and gpu_exp[dst, t] == e:
                    return True
        if gpu_exp[src, a1] == gpu_exp[src, a2]:
            return True
    return False


@jit
def _improve_pair_swap(size, gpu_exp, load):
    """One exchange of two replicas of the most loaded GPU with two replicas of another GPU,
    the one that minimises the larger of the two new loads if that is below the maximum
    (exchanges that leave two replicas of one expert on a GPU are skipped). Returns ``True``
    if it made one."""
    num_gpus, slots = gpu_exp.shape
    gm = argmax(load)
    top = load[gm]
    tol = REL_TOL * top
    best_v = top - tol
    bh = -1
    bi1 = bi2 = bj1 = bj2 = -1
    for h in range(num_gpus):
        if h == gm:
            continue
        gap = top - load[h]
        if gap <= tol or 0.5 * (top + load[h]) >= best_v:
            continue
        for i1 in range(slots):
            for i2 in range(i1 + 1, slots):
                ea1 = gpu_exp[gm, i1]
                ea2 = gpu_exp[gm, i2]
                a = size[ea1] + size[ea2]
                for j1 in range(slots):
                    for j2 in range(j1 + 1, slots):
                        eb1 = gpu_exp[h, j1]
                        eb2 = gpu_exp[h, j2]
                        d = a - size[eb1] - size[eb2]
                        if d <= 0.0 or d >= gap:
                            continue
                        v = max(top - d, load[h] + d)
                        if v < best_v:
                            if _pair_makes_duplicate(gpu_exp, gm, i1, i2, h, j1, j2):
                                continue
                            best_v = v
                            bh = h
                            bi1 = i1
                            bi2 = i2
                            bj1 = j1
                            bj2 = j2
    if bh < 0:
        return False
    for i, j in ((bi1, bj1), (bi2, bj2)):
        ea = gpu_exp[gm, i]
        eb = gpu_exp[bh, j]
        d = size[ea] - size[eb]
        gpu_exp[gm, i] = eb
        gpu_exp[bh, j] = ea
        load[gm] -= d
        load[bh] += d
    return True


@jit
def _local_search(size, gpu_exp, load, max_iter, good_enough):
    """:func:`_improve_swaps`, then :func:`_improve_pair_swap` whenever it gets stuck, until
    neither helps or the largest load is at most ``good_enough``."""
    steps = 0
    while steps < max_iter:
        steps += _improve_swaps(size, gpu_exp, load, max_iter - steps)
        if load[argmax(load)] <= good_enough or not _improve_pair_swap(size, gpu_exp, load):
            break
        steps += 1
    return steps


@jit
def pack(w, cnt, num_gpus, slots, size, gpu_exp, load, gpu_n, last, max_iter, good_enough):
    """Pack one count vector (LPT, then :func:`_local_search`); returns the largest GPU load."""
    num_log = w.shape[0]
    for e in range(num_log):
        size[e] = w[e] / cnt[e]
    order = np.argsort(-size, kind="mergesort")
    _lpt(size, cnt, num_gpus, slots, order, gpu_exp, gpu_n, load, last)
    _local_search(size, gpu_exp, load, max_iter, good_enough)
    recompute_loads(size, gpu_exp, load)
    return load[argmax(load)]


@jit
def try_move(w, cnt, gpu_exp, recv, donor, trial_cnt, trial_exp, size, load, max_iter, good_enough):
    """Largest GPU load after moving one replica from ``donor`` to ``recv`` (warm start).

    The new replica of ``recv`` takes the slot of one replica of ``donor``: the slot whose GPU is
    lightest afterwards, preferring GPUs that do not hold ``recv`` (lowest GPU among equals);
    then :func:`_local_search` runs from that state.
    """
    num_log = w.shape[0]
    num_gpus, slots = gpu_exp.shape
    for e in range(num_log):
        trial_cnt[e] = cnt[e]
    trial_cnt[recv] += 1
    trial_cnt[donor] -= 1
    for e in range(num_log):
        size[e] = w[e] / trial_cnt[e]
    trial_exp[:, :] = gpu_exp
    recompute_loads(size, trial_exp, load)
    best_g = -1
    best_i = -1
    best_dup = True
    best_v = np.inf
    for g in range(num_gpus):
        for i in range(slots):
            if trial_exp[g, i] == donor:
                v = load[g] - size[donor] + size[recv]
                dup = holds(trial_exp, g, recv, -1)
                if (best_dup and not dup) or (dup == best_dup and v < best_v):
                    best_g = g
                    best_i = i
                    best_v = v
                    best_dup = dup
                break
    trial_exp[best_g, best_i] = recv
    load[best_g] = best_v
    _local_search(size, trial_exp, load, max_iter, good_enough)
    recompute_loads(size, trial_exp, load)
    return load[argmax(load)]
