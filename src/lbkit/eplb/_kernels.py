"""numba kernels of the expert-parallel load balancer (clean arrays only; see ``rebalance.py``).

Every kernel is a plain loop over numpy arrays that also runs with ``NUMBA_DISABLE_JIT=1``.
Arrays are ``float64`` loads and ``int64`` indices. Tie-breaks are explicit and documented: the
lowest index wins (lowest expert, lowest GPU, lowest node), and sorts are stable.

Vocabulary: a *sub-problem* is one layer of one node: ``E`` experts with loads ``w``, ``G`` GPUs of
``S`` slots each (``R = G*S`` replicas). Under the global policy a layer is one sub-problem; under
the hierarchical policy each node of a layer is one.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import entry, jit

__all__ = [
    "apportion_minmax",
    "balanced_packing",
    "default_plan",
    "greedy_plan",
    "lower_bound_layers",
    "partition_groups",
    "solve_subproblem",
    "solve_two_slot",
    "two_slot_counts",
    "warmup",
]

#: Sub-problems with at most this many replicas also get the exact search (:func:`exact_search`).
EXACT_MAX_REPLICAS = 32
#: Search nodes the exact search of one sub-problem may visit.
EXACT_BUDGET = 400_000

# Relative tolerance under which two loads count as equal (keeps local searches finite).
_REL_TOL = 1e-12


# --------------------------------------------------------------------------------------------
# Greedy method: DeepSeek's published algorithm, step by step, in the dtype of `weight`
# (float32 when called by `greedy_rebalance`, as the published code computes).
# --------------------------------------------------------------------------------------------


@jit
def balanced_packing(x, num_packs, pack_index, rank_in_pack):
    """Pack ``n`` items into ``num_packs`` packs of ``n / num_packs`` items each.

    Items are taken heaviest first (stable: lower index first among equal loads); each goes to
    the lightest pack that still has room (lowest pack index among equal loads). With one item
    per pack, item ``i`` goes to pack ``i`` (identity), as in the published algorithm.
    """
    n = x.shape[0]
    per_pack = n // num_packs
    if per_pack == 1:
        for i in range(n):
            pack_index[i] = i
            rank_in_pack[i] = 0
        return
    order = np.argsort(-x, kind="mergesort")
    pack_load = np.zeros(num_packs, dtype=x.dtype)
    pack_n = np.zeros(num_packs, dtype=np.int64)
    for k in range(n):
        item = order[k]
        best = -1
        for p in range(num_packs):
            if pack_n[p] < per_pack and (best < 0 or pack_load[p] < pack_load[best]):
                best = p
        pack_index[item] = best
        rank_in_pack[item] = pack_n[best]
        pack_load[best] += x[item]
        pack_n[best] += 1


@jit
def _greedy_replicate(w, num_phy, phy2log, phyrank, cnt, cnt_f):
    """Replicate: slot ``i < E`` holds expert ``i``; each further slot goes to the expert with the
    largest load per replica (lowest index among equal values). ``cnt_f`` mirrors ``cnt`` in the
    dtype of ``w`` so that the divisions happen in that dtype."""
    num_log = w.shape[0]
    for e in range(num_log):
        phy2log[e] = e
        phyrank[e] = 0
        cnt[e] = 1
        cnt_f[e] = 1
    for i in range(num_log, num_phy):
        best = 0
        best_v = w[0] / cnt_f[0]
        for e in range(1, num_log):
            v = w[e] / cnt_f[e]
            if v > best_v:
                best = e
                best_v = v
        phy2log[i] = best
        phyrank[i] = cnt[best]
        cnt[best] += 1
        cnt_f[best] += 1


@jit
def _greedy_layer(w, num_phy, num_groups, num_nodes, num_gpus, phy2log, phyrank, logcnt):
    num_log = w.shape[0]
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    slots = num_phy // num_gpus
    log_per_node = num_log // num_nodes
    phy_per_node = num_phy // num_nodes
    gpus_per_node = num_gpus // num_nodes

    # Step 1: groups to nodes, a group's position in its node given by its packing rank.
    group_load = np.zeros(num_groups, dtype=w.dtype)
    for g in range(num_groups):
        for j in range(group_size):
            group_load[g] += w[g * group_size + j]
    gpack = np.empty(num_groups, dtype=np.int64)
    grank = np.empty(num_groups, dtype=np.int64)
    balanced_packing(group_load, num_nodes, gpack, grank)
    log2mlog = np.empty(num_log, dtype=np.int64)
    mlog2log = np.empty(num_log, dtype=np.int64)
    for e in range(num_log):
        g = e // group_size
        m = (gpack[g] * groups_per_node + grank[g]) * group_size + e % group_size
        log2mlog[e] = m
        mlog2log[m] = e

    # Steps 2 and 3 per node: replicate within the node, then pack its replicas to its GPUs.
    w_node = np.empty(log_per_node, dtype=w.dtype)
    p2m = np.empty(phy_per_node, dtype=np.int64)
    prank = np.empty(phy_per_node, dtype=np.int64)
    mcnt = np.empty(log_per_node, dtype=np.int64)
    mcnt_f = np.empty(log_per_node, dtype=w.dtype)
    x = np.empty(phy_per_node, dtype=w.dtype)
    pidx = np.empty(phy_per_node, dtype=np.int64)
    ridx = np.empty(phy_per_node, dtype=np.int64)
    for n in range(num_nodes):
        for j in range(log_per_node):
            w_node[j] = w[mlog2log[n * log_per_node + j]]
        _greedy_replicate(w_node, phy_per_node, p2m, prank, mcnt, mcnt_f)
        for i in range(phy_per_node):
            x[i] = w_node[p2m[i]] / mcnt_f[p2m[i]]
        balanced_packing(x, gpus_per_node, pidx, ridx)
        for i in range(phy_per_node):
            slot = n * phy_per_node + pidx[i] * slots + ridx[i]
            phy2log[slot] = mlog2log[n * log_per_node + p2m[i]]
            phyrank[slot] = prank[i]
        for j in range(log_per_node):
            logcnt[mlog2log[n * log_per_node + j]] = mcnt[j]


@entry
def greedy_plan(weight, num_phy, num_groups, num_nodes, num_gpus, phy2log, phyrank, logcnt):
    """DeepSeek's greedy plan for every layer (``num_groups = num_nodes = 1`` for global).

    Loads, divisions and running sums use the dtype of ``weight``."""
    for layer in range(weight.shape[0]):
        _greedy_layer(
            weight[layer],
            num_phy,
            num_groups,
            num_nodes,
            num_gpus,
            phy2log[layer],
            phyrank[layer],
            logcnt[layer],
        )


# --------------------------------------------------------------------------------------------
# Default method: joint choice of replica counts and packing, per sub-problem.
# --------------------------------------------------------------------------------------------


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
    the GPUs with room makes it O(R log G).
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
def _holds(gpu_exp, g, e, skip):
    for i in range(gpu_exp.shape[1]):
        if i != skip and gpu_exp[g, i] == e:
            return True
    return False


@jit
def _argmax(load):
    best = 0
    for g in range(1, load.shape[0]):
        if load[g] > load[best]:
            best = g
    return best


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
        gm = _argmax(load)
        top = load[gm]
        tol = _REL_TOL * top
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
                        if _holds(gpu_exp, h, ea, j) or _holds(gpu_exp, gm, eb, i):
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
    gm = _argmax(load)
    top = load[gm]
    tol = _REL_TOL * top
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
        if load[_argmax(load)] <= good_enough or not _improve_pair_swap(size, gpu_exp, load):
            break
        steps += 1
    return steps


@jit
def _recompute_loads(size, gpu_exp, load):
    num_gpus, slots = gpu_exp.shape
    for g in range(num_gpus):
        s = 0.0
        for i in range(slots):
            s += size[gpu_exp[g, i]]
        load[g] = s


@jit
def _plan_loads(w, cnt, gpu_exp, size, load):
    """Replica sizes from the counts, the GPU loads of the packing; returns the largest load."""
    for e in range(w.shape[0]):
        size[e] = w[e] / cnt[e]
    _recompute_loads(size, gpu_exp, load)
    return load[_argmax(load)]


@jit
def _repair_duplicates(size, gpu_exp, load, cap):
    """Remove two-replicas-of-one-expert-on-one-GPU where a swap does so without any GPU load
    exceeding ``cap`` (the plan's maximum): swap the duplicate with the replica elsewhere whose
    size is closest to it (lowest GPU, then slot, among equals)."""
    num_gpus, slots = gpu_exp.shape
    tol = _REL_TOL * cap
    for g in range(num_gpus):
        for i in range(slots):
            e = gpu_exp[g, i]
            if not _holds(gpu_exp, g, e, i):
                continue
            best_h = -1
            best_j = -1
            best_d = np.inf
            for h in range(num_gpus):
                if h == g or _holds(gpu_exp, h, e, -1):
                    continue
                for j in range(slots):
                    f = gpu_exp[h, j]
                    if _holds(gpu_exp, g, f, -1):
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
def _count_duplicates(gpu_exp):
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
def _pack(w, cnt, num_gpus, slots, size, gpu_exp, load, gpu_n, last, max_iter, good_enough):
    """Pack one count vector (LPT, then :func:`_local_search`); returns the largest GPU load."""
    num_log = w.shape[0]
    for e in range(num_log):
        size[e] = w[e] / cnt[e]
    order = np.argsort(-size, kind="mergesort")
    _lpt(size, cnt, num_gpus, slots, order, gpu_exp, gpu_n, load, last)
    _local_search(size, gpu_exp, load, max_iter, good_enough)
    _recompute_loads(size, gpu_exp, load)
    return load[_argmax(load)]


@jit
def _try_move(
    w, cnt, gpu_exp, recv, donor, trial_cnt, trial_exp, size, load, max_iter, good_enough
):
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
    _recompute_loads(size, trial_exp, load)
    best_g = -1
    best_i = -1
    best_dup = True
    best_v = np.inf
    for g in range(num_gpus):
        for i in range(slots):
            if trial_exp[g, i] == donor:
                v = load[g] - size[donor] + size[recv]
                dup = _holds(trial_exp, g, recv, -1)
                if (best_dup and not dup) or (dup == best_dup and v < best_v):
                    best_g = g
                    best_i = i
                    best_v = v
                    best_dup = dup
                break
    trial_exp[best_g, best_i] = recv
    load[best_g] = best_v
    _local_search(size, trial_exp, load, max_iter, good_enough)
    _recompute_loads(size, trial_exp, load)
    return load[_argmax(load)]


@jit
def _insert_sorted(lst, n, cap, e, key, keys):
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
def _adopt(trial_cnt, trial_exp, cnt, gpu_exp):
    """Copy a better trial plan (counts and per-GPU experts) over the current one."""
    for e in range(cnt.shape[0]):
        cnt[e] = trial_cnt[e]
    gpu_exp[:, :] = trial_exp


@jit
def _count_search(w, num_gpus, slots, max_evals, good_enough, extra_recv, frozen, cnt, gpu_exp):
    """Steps 2-4 of :func:`solve_subproblem_to` from the counts in ``cnt`` (updated in place,
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
    best = _pack(w, cnt, num_gpus, slots, size, gpu_exp, load, gpu_n, last, max_iter, good_enough)
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
        gm = _argmax(best_load)
        for e in range(num_log):
            size[e] = w[e] / cnt[e]
        # Receivers: experts on the most loaded GPU (largest replica first), the expert with
        # the largest replica, then the three with the smallest replicas (fillers).
        nr = 0
        for i in range(slots):
            e = gpu_exp[gm, i]
            nr = _insert_sorted(recv, nr, slots, e, -size[e], rkey)
        top = 0
        for e in range(1, num_log):
            if size[e] > size[top]:
                top = e
        nr = _insert_sorted(recv, nr, rcap, top, np.inf, rkey)
        nf = 0
        for e in range(num_log):
            nf = _insert_sorted(fill, nf, 3, e, size[e], fkey)
        for k in range(nf):
            nr = _insert_sorted(recv, nr, rcap, fill[k], np.inf, rkey)
        for k in range(min(extra_recv, num_log)):
            seen = False
            for a in range(nr):
                if recv[a] == heavy[k]:
                    seen = True
            if not seen:
                nr = _insert_sorted(recv, nr, rcap, heavy[k], np.inf, rkey)
        # Donors: the four that lose least by giving up a replica, then the experts with two or
        # more replicas on the most loaded GPU (largest replica first), then the largest one.
        nd = 0
        for e in range(num_log):
            if cnt[e] >= 2:
                nd = _insert_sorted(donors, nd, 4, e, w[e] / (cnt[e] - 1), dkey)
        for i in range(slots):
            e = gpu_exp[gm, i]
            if cnt[e] >= 2:
                nd = _insert_sorted(donors, nd, dcap, e, np.inf, dkey)
        if cnt[top] >= 2:
            nd = _insert_sorted(donors, nd, dcap, top, np.inf, dkey)
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
                    v = _pack(
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
                    v = _try_move(
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
                if v < best * (1.0 - _REL_TOL):
                    best = v
                    _adopt(trial_cnt, trial_exp, cnt, gpu_exp)
                    best_load[:] = load
                    improved = True
                    break
            if improved:
                break
        if not improved:
            break
    if evals > 0:
        v = _pack(
            w, cnt, num_gpus, slots, size, trial_exp, load, gpu_n, last, max_iter, good_enough
        )
        if v < best * (1.0 - _REL_TOL):
            best = v
            gpu_exp[:, :] = trial_exp
    return _plan_loads(w, cnt, gpu_exp, size, load)


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
        if v < best * (1.0 - _REL_TOL):
            best = v
            _adopt(trial_cnt, trial_exp, cnt, gpu_exp)
    return best


@jit
def solve_subproblem(w, num_gpus, slots, max_evals, stop_gap, cnt, gpu_exp):
    """Choose replica counts and their packing for one sub-problem; returns the largest GPU load.

    :func:`solve_subproblem_to` with no target of its own (``target = 0``).
    """
    return solve_subproblem_to(w, num_gpus, slots, max_evals, stop_gap, 0.0, cnt, gpu_exp)


@jit
def solve_subproblem_to(w, num_gpus, slots, max_evals, stop_gap, target, cnt, gpu_exp):
    """Choose replica counts and their packing for one sub-problem; returns the largest GPU load.

    1. Counts: the min-max apportionment (:func:`apportion_minmax`).
    2. Packing: :func:`_lpt` then :func:`_improve_swaps`.
    3. Count search (first improvement, at most ``max_evals`` trial plans): move one replica
       from a donor to a receiver and repack from the current plan (:func:`_try_move`); keep the
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
    6. Duplicates: swaps that separate two replicas of one expert without raising the maximum.

    Every search stops as soon as the largest load is within a relative ``stop_gap`` of the
    sub-problem's lower bound (:func:`subproblem_bound`), since no plan can be better than the
    bound, or at most ``target``: a node whose largest GPU load is at most the largest load
    already reached on another node of the layer cannot change the layer's balance.
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
    good_enough = max(subproblem_bound(w, num_gpus, slots) * (1.0 + stop_gap), target)
    apportion_minmax(w, num_phy, cnt)
    best = _count_search(w, num_gpus, slots, max_evals, good_enough, 0, -1, cnt, gpu_exp)
    if slots > 2 and num_phy > EXACT_MAX_REPLICAS and best > good_enough and total > 0.0:
        best = _second_starts(
            w, num_gpus, slots, max_evals, good_enough, best, cnt, gpu_exp, trial_cnt, trial_exp
        )
    best = _plan_loads(w, cnt, gpu_exp, size, load)
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
                _adopt(trial_cnt, trial_exp, cnt, gpu_exp)
                best = _plan_loads(w, cnt, gpu_exp, size, load)
    if _count_duplicates(gpu_exp) > 0:
        _repair_duplicates(size, gpu_exp, load, best)
    if num_phy <= EXACT_MAX_REPLICAS and _count_duplicates(gpu_exp) > 0:
        # A duplicate-free plan no worse than this one, if the exact search finds one.
        found = exact_search(
            w, num_gpus, slots, best, True, False, EXACT_BUDGET, trial_cnt, trial_exp
        )
        if found > 0:
            _adopt(trial_cnt, trial_exp, cnt, gpu_exp)
            _plan_loads(w, cnt, gpu_exp, size, load)
    return load[_argmax(load)]


# --------------------------------------------------------------------------------------------
# Exact search for small sub-problems: every count vector, every packing (with budgets).
# --------------------------------------------------------------------------------------------


@jit
def _exact_pack(size, cnt, order, num_gpus, slots, cap, forbid_dup, budget, gpu_exp):
    """Depth-first search for a packing of the replicas of counts ``cnt`` with every GPU load
    at most ``cap`` (and, if ``forbid_dup``, no two replicas of one expert on a GPU).

    Replicas are placed heaviest first (experts in ``order``); a replica goes to a GPU with a
    free slot, lowest GPU first; two replicas of one expert go to non-decreasing GPUs and, of
    several empty GPUs, only the first is tried (both are symmetries). Returns the number of
    search nodes visited (``-1`` once ``budget`` nodes are exceeded), negated minus 2 when a
    packing is found, which is then in ``gpu_exp``.
    """
    num_log = cnt.shape[0]
    num_items = num_gpus * slots
    item_e = np.empty(num_items, dtype=np.int64)
    k = 0
    for t in range(num_log):
        e = order[t]
        for _ in range(cnt[e]):
            item_e[k] = e
            k += 1
    # suffix sums of sizes: the replicas still to place must fit in the room left
    rest = np.zeros(num_items + 1)
    for k in range(num_items - 1, -1, -1):
        rest[k] = rest[k + 1] + size[item_e[k]]
    load = np.zeros(num_gpus)
    nfill = np.zeros(num_gpus, dtype=np.int64)
    pos = np.full(num_items, -1, dtype=np.int64)
    tol = _REL_TOL * cap
    visited = 0
    k = 0
    while k >= 0:
        e = item_e[k]
        x = size[e]
        if pos[k] >= 0:  # undo
            g = pos[k]
            load[g] -= x
            nfill[g] -= 1
        g = pos[k] + 1
        if pos[k] < 0 and k > 0 and item_e[k - 1] == e:
            g = pos[k - 1] + (1 if forbid_dup else 0)
        placed = False
        while g < num_gpus:
            ok = nfill[g] < slots and load[g] + x <= cap + tol
            if ok and nfill[g] == 0:
                for h in range(g):
                    if nfill[h] == 0:
                        ok = False
                        break
            if ok and forbid_dup:
                for i in range(nfill[g]):
                    if gpu_exp[g, i] == e:
                        ok = False
                        break
            if ok:
                placed = True
                break
            g += 1
        visited += 1
        if visited > budget:
            return -1
        if not placed:
            pos[k] = -1
            k -= 1
            continue
        pos[k] = g
        gpu_exp[g, nfill[g]] = e
        load[g] += x
        nfill[g] += 1
        if k == num_items - 1:
            return -visited - 2
        # Prune: the room left on GPUs must hold the replicas left.
        room = 0.0
        for h in range(num_gpus):
            if nfill[h] < slots:
                room += cap + tol - load[h]
        if room < rest[k + 1]:
            continue  # retry this item on the next GPU
        k += 1
    return visited


@jit
def exact_search(w, num_gpus, slots, cap, forbid_dup, minimize, budget, cnt, gpu_exp):
    """Search every count vector and packing for a plan with largest GPU load at most ``cap``
    (relative tolerance 1e-12) and, if ``forbid_dup``, no two replicas of one expert on a GPU;
    with ``minimize``, keep lowering the cap below each plan found (branch and bound).

    Count vectors are enumerated depth first over experts in decreasing load order (stable),
    each count from ``max(1, ceil(w_e / cap))`` upwards (and at most ``num_gpus`` with
    ``forbid_dup``); for each, :func:`_exact_pack`. The best plan found is in ``cnt`` and
    ``gpu_exp``. Returns ``2`` when a plan was found and the search finished (with
    ``minimize``: the plan is optimal to a relative 1e-9), ``1`` when a plan was found but the
    search stopped after ``budget`` search nodes, ``0`` when the search proves there is none,
    ``-1`` when it stopped after ``budget`` nodes without a plan.
    """
    num_log = w.shape[0]
    num_phy = num_gpus * slots
    order = np.argsort(-w, kind="mergesort")
    lo = np.empty(num_log, dtype=np.int64)
    hi = np.empty(num_log, dtype=np.int64)
    need = 0
    for e in range(num_log):
        c = 1
        if cap > 0.0 and w[e] > 0.0:
            c = max(1, int(np.ceil(w[e] / cap * (1.0 - 1e-12))))
        lo[e] = c
        need += c
    if need > num_phy:
        return 0
    for e in range(num_log):
        hi[e] = lo[e] + num_phy - need
        if forbid_dup and hi[e] > num_gpus:
            hi[e] = num_gpus
        if hi[e] < lo[e]:
            return 0
    size = np.empty(num_log)
    trial = np.empty(num_log, dtype=np.int64)
    pack = np.empty_like(gpu_exp)
    found = False
    spent = 0
    # Iterative enumeration: trial[order[t]] for t < depth; left = slots still to hand out.
    t = 0
    left = num_phy - need
    for e in range(num_log):
        trial[e] = lo[e] - 1
    while t >= 0:
        e = order[t]
        if trial[e] >= lo[e]:
            left += trial[e] - lo[e]
        trial[e] += 1
        extra = trial[e] - lo[e]
        if trial[e] > hi[e] or extra > left or w[e] / trial[e] > cap * (1.0 + _REL_TOL):
            if trial[e] <= hi[e] and extra <= left:  # replica too large: more replicas
                left -= extra
                continue
            trial[e] = lo[e] - 1
            t -= 1
            continue
        left -= extra
        if t < num_log - 1:
            t += 1
            continue
        if left != 0:
            continue
        for f in range(num_log):
            size[f] = w[f] / trial[f]
        porder = np.argsort(-size, kind="mergesort")
        while True:
            r = _exact_pack(
                size, trial, porder, num_gpus, slots, cap, forbid_dup, budget - spent, pack
            )
            if r == -1:
                return 1 if found else -1
            if r >= 0:
                spent += r
                break
            spent += -r - 2
            found = True
            top = 0.0
            for g in range(num_gpus):
                s = 0.0
                for i in range(slots):
                    s += size[pack[g, i]]
                    gpu_exp[g, i] = pack[g, i]
                top = max(top, s)
            for f in range(num_log):
                cnt[f] = trial[f]
            if not minimize:
                return 2
            cap = top * (1.0 - 1e-9)
        if spent > budget:
            return 1 if found else -1
    return 2 if found else 0


@jit
def partition_groups(group_load, num_nodes, node_budget, node_of_group):
    """Cardinality-constrained partition of groups to nodes minimising the largest node load.

    Depth-first branch and bound over groups in decreasing load order (stable), starting from
    the LPT partition; a group only opens the first empty node (symmetry). Exact unless the
    search visits more than ``node_budget`` partial assignments, in which case the best
    partition found is returned. Returns ``True`` when the result is proven optimal.
    """
    num_groups = group_load.shape[0]
    per_node = num_groups // num_nodes
    order = np.argsort(-group_load, kind="mergesort")
    # LPT start.
    nload = np.zeros(num_nodes)
    ncount = np.zeros(num_nodes, dtype=np.int64)
    for k in range(num_groups):
        g = order[k]
        best = -1
        for n in range(num_nodes):
            if ncount[n] < per_node and (best < 0 or nload[n] < nload[best]):
                best = n
        node_of_group[g] = best
        nload[best] += group_load[g]
        ncount[best] += 1
    best_val = nload[_argmax(nload)]
    if per_node == 1 or num_nodes == 1:
        return True
    # Iterative DFS: choice[k] = node tried for the k-th group in order.
    choice = np.full(num_groups, -1, dtype=np.int64)
    cur = np.zeros(num_nodes)
    cnt = np.zeros(num_nodes, dtype=np.int64)
    k = 0
    visited = 0
    tol = _REL_TOL * best_val
    while k >= 0:
        g = order[k]
        if choice[k] >= 0:  # undo the previous choice for this depth
            n = choice[k]
            cur[n] -= group_load[g]
            cnt[n] -= 1
        n = choice[k] + 1
        moved = False
        while n < num_nodes:
            # Symmetry: a group may open only the first empty node.
            if cnt[n] < per_node and cur[n] + group_load[g] < best_val - tol:
                if cnt[n] == 0:
                    first_empty = True
                    for m in range(n):
                        if cnt[m] == 0:
                            first_empty = False
                            break
                    if not first_empty:
                        n += 1
                        continue
                moved = True
                break
            n += 1
        visited += 1
        if visited > node_budget:
            return False
        if not moved:
            choice[k] = -1
            k -= 1
            continue
        choice[k] = n
        cur[n] += group_load[g]
        cnt[n] += 1
        if k == num_groups - 1:
            best_val = cur[_argmax(cur)]
            tol = _REL_TOL * best_val
            for kk in range(num_groups):
                node_of_group[order[kk]] = choice[kk]
            # keep searching for strictly better partitions
        else:
            k += 1
    return True


@entry
def default_plan(
    weight, num_phy, num_groups, num_nodes, num_gpus, max_evals, stop_gap, phy2log, logcnt
):
    """Default plan for every layer (``num_groups = num_nodes = 1`` for the global policy).

    Hierarchical: groups to nodes by :func:`partition_groups`, then the nodes are solved in
    decreasing order of their lower bound, each with the largest load reached so far on the
    layer as its target (:func:`solve_subproblem_to`). The layer's largest load is no higher
    than if every node were solved to its own bound: a node that stops at the target stays at
    or below the largest load reached on another node, and the others run unchanged.
    """
    num_layers, num_log = weight.shape
    group_size = num_log // num_groups
    slots = num_phy // num_gpus
    log_per_node = num_log // num_nodes
    phy_per_node = num_phy // num_nodes
    gpus_per_node = num_gpus // num_nodes
    group_load = np.empty(num_groups)
    node_of_group = np.empty(num_groups, dtype=np.int64)
    w_node = np.empty((num_nodes, log_per_node))
    local2log = np.empty((num_nodes, log_per_node), dtype=np.int64)
    node_bound = np.zeros(num_nodes)
    cnt = np.empty(log_per_node, dtype=np.int64)
    gpu_exp = np.empty((gpus_per_node, slots), dtype=np.int64)
    for layer in range(num_layers):
        w = weight[layer]
        for g in range(num_groups):
            s = 0.0
            for j in range(group_size):
                s += w[g * group_size + j]
            group_load[g] = s
        partition_groups(group_load, num_nodes, 2_000_000, node_of_group)
        for n in range(num_nodes):
            k = 0
            for g in range(num_groups):
                if node_of_group[g] == n:
                    for j in range(group_size):
                        local2log[n, k] = g * group_size + j
                        w_node[n, k] = w[g * group_size + j]
                        k += 1
            node_bound[n] = (
                subproblem_bound(w_node[n], gpus_per_node, slots) if num_nodes > 1 else 0.0
            )
        # Nodes in decreasing order of their bound (stable); a node only needs to reach the
        # largest load already reached on the layer (the layer's balance is its largest load).
        reached = 0.0
        for n in np.argsort(-node_bound, kind="mergesort"):
            if slots == 2 and phy_per_node > EXACT_MAX_REPLICAS:
                v = solve_two_slot(w_node[n], gpus_per_node, stop_gap, reached, cnt, gpu_exp)
            else:
                v = solve_subproblem_to(
                    w_node[n], gpus_per_node, slots, max_evals, stop_gap, reached, cnt, gpu_exp
                )
            reached = max(reached, v)
            for j in range(log_per_node):
                logcnt[layer, local2log[n, j]] = cnt[j]
            for gl in range(gpus_per_node):
                for i in range(slots):
                    slot = n * phy_per_node + gl * slots + i
                    phy2log[layer, slot] = local2log[n, gpu_exp[gl, i]]


# --------------------------------------------------------------------------------------------
# Lower bound on the largest GPU load of a sub-problem.
# --------------------------------------------------------------------------------------------


@jit
def _big_replica_feasible(w, r, num_phy, num_gpus, cap):
    """Necessary condition from replicas larger than ``cap / 2``: no GPU holds two of them.

    With least counts ``r``, an expert either keeps replicas above ``cap / 2`` (at least ``r_e``
    of them, all on different GPUs) or needs ``s_e = max(r_e, ceil(2 w_e / cap))`` replicas. So
    ``sum_e s_e - (savings) <= R``, where the savings ``s_e - r_e`` of the experts kept large
    weigh ``r_e`` each against a capacity of ``num_gpus``; the fractional knapsack bounds them.
    """
    num_log = w.shape[0]
    half = 0.5 * cap
    total_small = 0
    ratio = np.zeros(num_log)
    for e in range(num_log):
        small = r[e]
        if w[e] / r[e] > half:
            small = max(r[e], int(np.ceil(w[e] / half)))
            if w[e] / small > half:  # guard against rounding
                small += 1
            ratio[e] = (small - r[e]) / r[e]
        total_small += small
    if total_small <= num_phy:
        return True
    order = np.argsort(-ratio, kind="mergesort")
    room = float(num_gpus)
    saved = 0.0
    for k in range(num_log):
        e = order[k]
        if ratio[e] <= 0.0 or room <= 0.0:
            break
        take = min(float(r[e]), room)
        saved += take * ratio[e]
        room -= take
    return total_small - saved <= num_phy + 1e-9


@jit
def _slot_bound_feasible(w, num_phy, slots, cap):
    """Necessary condition for a plan with largest GPU load ``cap`` (see ``bounds.py``)."""
    num_log = w.shape[0]
    q = 0.0
    r = np.empty(num_log, dtype=np.int64)
    m = np.empty(num_log)
    for _ in range(200):
        room = cap - q
        if room <= 0.0:
            return False
        total = 0
        for e in range(num_log):
            need = int(np.ceil(w[e] / room)) if w[e] > 0.0 else 1
            if need < 1:
                need = 1
            r[e] = need
            total += need
            if total > num_phy:
                return False
        spare = num_phy - total
        if not _big_replica_feasible(w, r, num_phy, num_phy // slots, cap):
            return False
        if slots == 1:
            return True
        # Smallest possible replica of each expert and how many of them there can be.
        for e in range(num_log):
            m[e] = w[e] / (r[e] + spare)
        order = np.argsort(m, kind="mergesort")
        need_items = slots - 1
        q_new = 0.0
        for k in range(num_log):
            e = order[k]
            take = r[e] + spare
            if take > need_items:
                take = need_items
            q_new += take * m[e]
            need_items -= take
            if need_items == 0:
                break
        if q_new <= q * (1.0 + 1e-15):
            return True
        q = q_new
    return True


@jit
def subproblem_bound(w, num_gpus, slots):
    """Lower bound on the largest GPU load of one sub-problem: max of the mean and the slot bound
    (largest replica plus the ``slots - 1`` smallest replicas), found by bisection."""
    num_log = w.shape[0]
    num_phy = num_gpus * slots
    total = 0.0
    wmax = 0.0
    for e in range(num_log):
        total += w[e]
        if w[e] > wmax:
            wmax = w[e]
    if total <= 0.0:
        return 0.0
    mean = total / num_gpus
    lo = mean
    if not _slot_bound_feasible(w, num_phy, slots, lo):
        # Most layers pass at the mean; the others need a bisection.
        hi = total
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if mid <= lo or mid >= hi:
                break
            if _slot_bound_feasible(w, num_phy, slots, mid):
                hi = mid
            else:
                lo = mid
    return lo


@jit
def _enumerate_bound(sub_bound, num_groups, num_nodes, per_node):
    """min over group-to-node partitions of max over nodes of ``sub_bound[mask]`` (bit masks)."""
    best = np.inf
    mask = np.zeros(num_nodes, dtype=np.int64)
    cnt = np.zeros(num_nodes, dtype=np.int64)
    choice = np.full(num_groups, -1, dtype=np.int64)
    k = 0
    while k >= 0:
        if choice[k] >= 0:
            n = choice[k]
            mask[n] ^= 1 << k
            cnt[n] -= 1
        n = choice[k] + 1
        moved = False
        while n < num_nodes:
            if cnt[n] < per_node:
                if cnt[n] == 0:
                    ok = True
                    for mm in range(n):
                        if cnt[mm] == 0:
                            ok = False
                            break
                    if not ok:
                        n += 1
                        continue
                if cnt[n] + 1 == per_node and sub_bound[mask[n] | (1 << k)] >= best:
                    n += 1
                    continue
                moved = True
                break
            n += 1
        if not moved:
            choice[k] = -1
            k -= 1
            continue
        choice[k] = n
        mask[n] |= 1 << k
        cnt[n] += 1
        if k == num_groups - 1:
            v = 0.0
            for nn in range(num_nodes):
                if sub_bound[mask[nn]] > v:
                    v = sub_bound[mask[nn]]
            if v < best:
                best = v
        else:
            k += 1
    return best


@entry
def lower_bound_layers(weight, num_phy, num_groups, num_nodes, num_gpus, out):
    """Per-layer lower bound on the largest GPU load (absolute units, not divided by the mean).

    Global (``num_nodes == 1``): :func:`subproblem_bound`. Hierarchical with at most 12 groups:
    the minimum over group-to-node partitions of the largest within-node bound (enumerated
    exactly over bit masks of groups), and at least the global bound. With more groups: the
    global bound and, when :func:`partition_groups` proves its partition optimal, the smallest
    possible largest node load divided by the GPUs per node.
    """
    num_layers, num_log = weight.shape
    slots = num_phy // num_gpus
    gpus_per_node = num_gpus // num_nodes
    group_size = num_log // num_groups
    per_node = num_groups // num_nodes
    group_load = np.empty(num_groups)
    node_of_group = np.empty(num_groups, dtype=np.int64)
    nload = np.empty(num_nodes)
    for layer in range(num_layers):
        w = weight[layer]
        glob = subproblem_bound(w, num_gpus, slots)
        if num_nodes == 1:
            out[layer] = glob
            continue
        if num_groups > 12:
            for g in range(num_groups):
                s = 0.0
                for j in range(group_size):
                    s += w[g * group_size + j]
                group_load[g] = s
            if partition_groups(group_load, num_nodes, 2_000_000, node_of_group):
                nload[:] = 0.0
                for g in range(num_groups):
                    nload[node_of_group[g]] += group_load[g]
                glob = max(glob, nload[_argmax(nload)] / gpus_per_node)
            out[layer] = glob
            continue
        # Bound of every subset of groups with `per_node` members, indexed by bit mask.
        sub = np.zeros(1 << num_groups)
        wn = np.empty(per_node * group_size)
        for mask_v in range(1 << num_groups):
            bits = 0
            for g in range(num_groups):
                if (mask_v >> g) & 1:
                    bits += 1
            if bits != per_node:
                continue
            k = 0
            for g in range(num_groups):
                if (mask_v >> g) & 1:
                    for j in range(group_size):
                        wn[k] = w[g * group_size + j]
                        k += 1
            sub[mask_v] = subproblem_bound(wn, gpus_per_node, slots)
        out[layer] = max(_enumerate_bound(sub, num_groups, num_nodes, per_node), glob)


# --------------------------------------------------------------------------------------------
# Two slots per GPU: for fixed counts the sorted pairing is optimal, so only counts are searched.
# --------------------------------------------------------------------------------------------

#: Receivers below the critical partner tried per step of :func:`two_slot_counts`.
TWO_SLOT_RECEIVERS = 8


@jit
def _pair_walk(size, cnt, order, num_gpus, limit, crit):
    """Sorted pairing of the replicas: the k-th largest with the k-th smallest.

    Expert ``e`` has ``cnt[e]`` replicas of ``size[e]``; ``order`` lists the experts by
    decreasing size. For fixed counts this pairing minimises the largest pair (exchange
    argument). Returns ``(top, ntop, partner)``: the largest pair sum, the number of pairs within
    a relative ``_REL_TOL`` of it and the largest small-side replica among those pairs; or
    ``(inf, 0, 0.0)`` as soon as a pair exceeds ``limit``. When ``crit`` is not empty, the experts
    of every pair within ``_REL_TOL`` of ``limit`` are marked in it. O(E).
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
        if v > top * (1.0 + _REL_TOL):
            top = v
            ntop = take
            partner = size[b]
        elif v >= top * (1.0 - _REL_TOL):
            ntop += take
            partner = max(partner, size[b])
        if crit.shape[0] > 0 and v >= limit * (1.0 - _REL_TOL):
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
                if r == d or not recv[r] or grown + min(smallest, key[r]) > bv * (1.0 + _REL_TOL):
                    continue
                sd = size[d]
                sr = size[r]
                cnt[d] -= 1
                cnt[r] += 1
                size[d] = grown
                size[r] = key[r]
                _moved_order(order, size, d, r, trial)
                v, nv, _ = _pair_walk(size, cnt, trial, num_gpus, bv * (1.0 + _REL_TOL), no_mark)
                if v < bv * (1.0 - _REL_TOL) or (v <= bv * (1.0 + _REL_TOL) and nv < bn):
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
    tol = _REL_TOL * cap
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
                if size[e] <= u + _REL_TOL * cap:
                    k = 1
                    gain = 1.0
                else:
                    c = int(np.ceil(w[e] / u))
                    if w[e] / c > u + _REL_TOL * cap:
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
    (``good_enough``) and the local optimum ``top`` with :func:`_ballot_counts` (12 steps),
    then the local search from the best counts it built. Keeps ``cnt`` unless this is strictly
    better; returns the largest pair sum."""
    num_log = w.shape[0]
    trial = np.empty(num_log, dtype=np.int64)
    best = np.empty(num_log, dtype=np.int64)
    size = np.empty(num_log)
    no_mark = np.zeros(0, dtype=np.bool_)
    lo = good_enough
    hi = top
    best_v = top
    found = False
    for _ in range(12):
        mid = 0.5 * (lo + hi)
        if not _ballot_counts(w, num_gpus, mid, trial):
            lo = mid
            continue
        for e in range(num_log):
            size[e] = w[e] / trial[e]
        order = np.argsort(-size, kind="mergesort")
        v, _, _ = _pair_walk(size, trial, order, num_gpus, np.inf, no_mark)
        if v < best_v * (1.0 - _REL_TOL):
            best_v = v
            best[:] = trial
            found = True
        hi = min(mid, v)
    if not found:
        return top
    v = two_slot_counts(w, num_gpus, good_enough, 8 * num_gpus, False, best)
    if v < top * (1.0 - _REL_TOL):
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
    :func:`_repair_duplicates` separates two replicas of one expert on a GPU where a swap keeps
    the maximum.
    """
    num_log = w.shape[0]
    total = 0.0
    for e in range(num_log):
        total += w[e]
    good_enough = max(subproblem_bound(w, num_gpus, 2) * (1.0 + stop_gap), target)
    if total <= 0.0:
        good_enough = np.inf
    top = two_slot_counts(w, num_gpus, good_enough, 8 * num_gpus, True, cnt)
    if top > good_enough:
        top = _two_slot_second_start(w, num_gpus, good_enough, top, cnt)
    size = np.empty(num_log)
    for e in range(num_log):
        size[e] = w[e] / cnt[e]
    order = np.argsort(-size, kind="mergesort")
    _pair_out(cnt, order, num_gpus, gpu_exp)
    load = np.empty(num_gpus)
    _recompute_loads(size, gpu_exp, load)
    best = load[_argmax(load)]
    if _count_duplicates(gpu_exp) > 0:
        _repair_duplicates(size, gpu_exp, load, best)
    return load[_argmax(load)]


def warmup() -> None:
    """Compile every kernel of :mod:`lbkit.eplb` on a tiny input."""
    w = np.array([[4.0, 3.0, 2.0, 1.0]])
    phy2log = np.empty((1, 8), dtype=np.int64)
    phyrank = np.empty((1, 8), dtype=np.int64)
    logcnt = np.empty((1, 4), dtype=np.int64)
    greedy_plan(w.astype(np.float32), 8, 2, 2, 4, phy2log, phyrank, logcnt)
    default_plan(w, 8, 2, 2, 4, 8, 1e-4, phy2log, logcnt)
    cnt = np.empty(4, dtype=np.int64)
    gpu_exp = np.empty((3, 2), dtype=np.int64)
    solve_two_slot(w[0], 3, 1e-4, 0.0, cnt, gpu_exp)
    out = np.empty(1)
    lower_bound_layers(w, 8, 2, 2, 4, out)
    lower_bound_layers(w, 8, 1, 1, 4, out)
