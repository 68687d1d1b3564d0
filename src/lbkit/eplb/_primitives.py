"""Primitives shared by the EPLB kernels: tolerances, argmax, slot look-ups, GPU loads,
duplicate repair, the min-max apportionment of replicas, and the move accounting of re-plans.

Every kernel is a plain loop over numpy arrays that also runs with ``NUMBA_DISABLE_JIT=1``.
Arrays are ``float64`` loads and ``int64`` indices. Tie-breaks are explicit: the lowest index
wins (lowest expert, lowest GPU), and sorts are stable.

Vocabulary: a *sub-problem* is one layer of one node: ``E`` experts with loads ``w``, ``G`` GPUs
of ``S`` slots each (``R = G*S`` replicas). Under the global policy a layer is one sub-problem;
under the hierarchical policy each node of a layer is one. A packing is ``gpu_exp [G, S]``, the
expert of each slot of each GPU; ``size[e] = w[e] / cnt[e]`` is the size of a replica of ``e``.

Re-planning: ``hold[g, e]`` counts the replicas of ``e`` that GPU ``g`` held in the old plan,
``cur[g, e]`` those it holds now; a *move* is a replica beyond ``hold`` (``-1`` entries of a
packing are slots whose expert belongs to another sub-problem and are skipped).
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit

__all__ = ["apportion_minmax"]


# Relative tolerance under which two loads count as equal (keeps local searches finite).
REL_TOL = 1e-12


@jit
def argmax(load):
    best = 0
    for g in range(1, load.shape[0]):
        if load[g] > load[best]:
            best = g
    return best


@jit
def holds(gpu_exp, g, e, skip):
    for i in range(gpu_exp.shape[1]):
        if i != skip and gpu_exp[g, i] == e:
            return True
    return False


@jit
def insert_sorted(lst, n, cap, e, key, keys):
    """Insert ``e`` with ``key`` into the first ``n`` entries of ``lst`` kept in increasing key
    order (stable), truncated to ``cap`` entries; skips ``e`` if present. Returns the new n."""
    for k in range(n):
        if lst[k] == e:
            return n
    pos = n
    while pos > 0 and keys[pos - 1] > key:
        pos -= 1
    if pos >= cap:
        return n
    last = n if n < cap else cap - 1
    for k in range(last, pos, -1):
        lst[k] = lst[k - 1]
        keys[k] = keys[k - 1]
    lst[pos] = e
    keys[pos] = key
    return n + 1 if n < cap else n


@jit
def recompute_loads(size, gpu_exp, load):
    num_gpus, slots = gpu_exp.shape
    for g in range(num_gpus):
        s = 0.0
        for i in range(slots):
            s += size[gpu_exp[g, i]]
        load[g] = s


@jit
def plan_loads(w, cnt, gpu_exp, size, load):
    """Replica sizes from the counts, the GPU loads of the packing; returns the largest load."""
    for e in range(w.shape[0]):
        size[e] = w[e] / cnt[e]
    recompute_loads(size, gpu_exp, load)
    return load[argmax(load)]


@jit
def count_duplicates(gpu_exp):
    num_gpus, slots = gpu_exp.shape
    n = 0
    for g in range(num_gpus):
        for i in range(slots):
            for k in range(i):
                if gpu_exp[g, k] == gpu_exp[g, i]:
                    n += 1
                    break
    return n


@jit
def repair_duplicates(size, gpu_exp, load, cap):
    """Remove two-replicas-of-one-expert-on-one-GPU where a swap does so without any GPU load
    exceeding ``cap`` (the plan's maximum): swap the duplicate with the replica elsewhere whose
    size is closest to it (lowest GPU, then slot, among equals)."""
    num_gpus, slots = gpu_exp.shape
    tol = REL_TOL * cap
    for g in range(num_gpus):
        for i in range(slots):
            e = gpu_exp[g, i]
            if not holds(gpu_exp, g, e, i):
                continue
            best_h = -1
            best_j = -1
            best_d = np.inf
            for h in range(num_gpus):
                if h == g or holds(gpu_exp, h, e, -1):
                    continue
                for j in range(slots):
                    f = gpu_exp[h, j]
                    if holds(gpu_exp, g, f, -1):
                        continue
                    d = size[e] - size[f]
                    if load[g] - d > cap + tol or load[h] + d > cap + tol:
                        continue
                    if abs(d) < best_d:
                        best_d = abs(d)
                        best_h = h
                        best_j = j
            if best_h >= 0:
                f = gpu_exp[best_h, best_j]
                d = size[e] - size[f]
                gpu_exp[g, i] = f
                gpu_exp[best_h, best_j] = e
                load[g] -= d
                load[best_h] += d


@jit
def adopt(trial_cnt, trial_exp, cnt, gpu_exp):
    """Copy a better trial plan (counts and per-GPU experts) over the current one."""
    for e in range(cnt.shape[0]):
        cnt[e] = trial_cnt[e]
    gpu_exp[:, :] = trial_exp


@jit
def _heap_before(key, cnt, a, b):
    """Heap order of experts: larger load per replica first, then fewer replicas, then lower
    index."""
    if key[a] != key[b]:
        return key[a] > key[b]
    if cnt[a] != cnt[b]:
        return cnt[a] < cnt[b]
    return a < b


@jit
def _sift_down(heap, n, pos, key, cnt):
    while True:
        child = 2 * pos + 1
        if child >= n:
            return
        if child + 1 < n and _heap_before(key, cnt, heap[child + 1], heap[child]):
            child += 1
        if _heap_before(key, cnt, heap[child], heap[pos]):
            heap[pos], heap[child] = heap[child], heap[pos]
            pos = child
        else:
            return


@jit
def apportion_minmax(w, num_phy, cnt):
    """Min-max apportionment: one replica each, then every further replica to the expert with the
    largest load per replica (ties: fewest replicas, then lowest index). Minimises the largest
    replica ``max_e w_e / cnt_e`` (each step removes the current maximum). A binary heap makes
    it O(E + (R - E) log E)."""
    num_log = w.shape[0]
    key = np.empty(num_log)
    heap = np.empty(num_log, dtype=np.int64)
    for e in range(num_log):
        cnt[e] = 1
        key[e] = w[e]
        heap[e] = e
    for pos in range(num_log // 2 - 1, -1, -1):
        _sift_down(heap, num_log, pos, key, cnt)
    for _ in range(num_phy - num_log):
        e = heap[0]
        cnt[e] += 1
        key[e] = w[e] / cnt[e]
        _sift_down(heap, num_log, 0, key, cnt)


# ---- re-planning: loads with empty slots, holders, moves and their changes ----


@jit
def step_score(red, cost, best_free, best_score):
    """Score of a descent step lowering the excess by ``red`` for ``cost`` moves: ``red`` when
    free (``cost <= 0``), else ``red / cost``; ``-1`` unless it beats the best step so far
    (``best_free``, ``best_score``; a free step beats every paid one)."""
    if cost <= 0:
        if best_free and red <= best_score:
            return -1.0
        return red
    if best_free or red / cost <= best_score:
        return -1.0
    return red / cost


@jit
def equals_best(found, red, cost, best_free, best_score):
    """Whether a step lowering the excess by ``red`` for ``cost`` moves, which does not beat the
    best step so far, equals it: the best is the same search's own (``found``), both are free or
    both paid, and the scores (:func:`step_score`) are the same. Ties then go to the first in
    the search's order."""
    return found and (cost <= 0) == best_free and (red if cost <= 0 else red / cost) == best_score


@jit
def gpu_loads(size, gpu_exp, load):
    """GPU loads of a packing whose ``-1`` slots are empty (or another sub-problem's)."""
    num_gpus, slots = gpu_exp.shape
    for g in range(num_gpus):
        s = 0.0
        for i in range(slots):
            e = gpu_exp[g, i]
            if e >= 0:
                s += size[e]
        load[g] = s


@jit
def holds_move(gpu_exp, cur, hold, out):
    """``out[g]``: GPU ``g`` holds a replica that is a move (more of its expert than the old
    plan put there)."""
    num_gpus, slots = gpu_exp.shape
    for g in range(num_gpus):
        out[g] = False
        for i in range(slots):
            e = gpu_exp[g, i]
            if cur[g, e] > hold[g, e]:
                out[g] = True


@jit
def count_moves(hold, gpu_exp, cur):
    """Moves of ``gpu_exp`` against the old per-GPU holdings ``hold[g, e]`` (``cur``: a zeroed
    scratch array of ``E`` counts, zeroed again on return)."""
    num_gpus, slots = gpu_exp.shape
    total = 0
    for g in range(num_gpus):
        for i in range(slots):
            e = gpu_exp[g, i]
            if e >= 0:
                cur[e] += 1
        for i in range(slots):
            e = gpu_exp[g, i]
            if e >= 0 and cur[e] > 0:
                if cur[e] > hold[g, e]:
                    total += cur[e] - hold[g, e]
                cur[e] = 0
    return total


@jit
def holders(gpu_exp, num_log, start, gpus):
    """CSR lists of the GPUs holding each expert (with multiplicity, increasing GPU)."""
    num_gpus, slots = gpu_exp.shape
    start[:] = 0
    for g in range(num_gpus):
        for i in range(slots):
            start[gpu_exp[g, i] + 1] += 1
    for e in range(num_log):
        start[e + 1] += start[e]
    fill = start[:num_log].copy()
    for g in range(num_gpus):
        for i in range(slots):
            e = gpu_exp[g, i]
            gpus[fill[e]] = g
            fill[e] += 1


@jit
def excess(x, target):
    return x - target if x > target else 0.0


@jit
def replace_cost(cur, hold, g, out_e, in_e):
    """Change in moves when GPU ``g`` gives up a replica of ``out_e`` for one of ``in_e``
    (``cur`` the current per-GPU counts, ``hold`` the old ones): ``-1`` if the replica given up
    was a move (``cur > hold``), ``+1`` if the one received is one (``cur >= hold``)."""
    cost = 0
    if cur[g, out_e] > hold[g, out_e]:
        cost -= 1
    if cur[g, in_e] >= hold[g, in_e]:
        cost += 1
    return cost


@jit
def swap_cost(cur, hold, h, a, k, b):
    """Change in moves when GPU ``h`` gives a replica of ``a`` to GPU ``k`` for one of ``b``."""
    return replace_cost(cur, hold, h, a, b) + replace_cost(cur, hold, k, b, a)


@jit
def apply_swap(gpu_exp, cur, h, i, k, j):
    """Exchange slot ``i`` of GPU ``h`` with slot ``j`` of GPU ``k`` (``cur`` kept in step)."""
    a = gpu_exp[h, i]
    b = gpu_exp[k, j]
    gpu_exp[h, i] = b
    gpu_exp[k, j] = a
    cur[h, a] -= 1
    cur[k, a] += 1
    cur[k, b] -= 1
    cur[h, b] += 1


@jit
def apply_replace(gpu_exp, cur, cnt, h, i, b):
    """Give slot ``i`` of GPU ``h`` to expert ``b`` (a count change; ``cur``, ``cnt`` kept)."""
    a = gpu_exp[h, i]
    gpu_exp[h, i] = b
    cur[h, a] -= 1
    cur[h, b] += 1
    cnt[a] -= 1
    cnt[b] += 1
