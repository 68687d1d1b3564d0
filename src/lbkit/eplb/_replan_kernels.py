"""numba kernels of EPLB re-planning with few expert moves (clean arrays only; see ``replan.py``).

Every kernel is a plain loop over numpy arrays that also runs with ``NUMBA_DISABLE_JIT=1``.
Arrays are ``float64`` loads and ``int64`` indices. Tie-breaks: the lowest index wins (lowest
expert, GPU, slot), sorts are stable.

Vocabulary: a *sub-problem* is one layer (global policy) or one node of a layer (hierarchical
policy): ``E`` local experts with loads ``w``, ``G`` GPUs of ``S`` slots. ``old_exp[g, i]`` is the
local expert the previous plan put in slot ``i`` of GPU ``g``, or ``-1`` when that expert now
belongs to another sub-problem. A *move* is a replica that a GPU holds in the new plan and did not
hold in the old one (counted with multiplicity): ``sum_{g, e} max(0, new[g, e] - old[g, e])``.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit

__all__ = ["count_moves", "replan_subproblem", "warmup"]

_REL_TOL = 1e-12


@jit
def count_moves(old_exp, new_exp, num_experts):
    """Moves from ``old_exp`` to ``new_exp`` (both ``(G, S)``; ``-1`` entries are ignored)."""
    num_gpus, slots = new_exp.shape
    diff = np.zeros(num_experts, dtype=np.int64)
    total = 0
    for g in range(num_gpus):
        for i in range(slots):
            if new_exp[g, i] >= 0:
                diff[new_exp[g, i]] += 1
            if old_exp[g, i] >= 0:
                diff[old_exp[g, i]] -= 1
        for i in range(slots):
            e = new_exp[g, i]
            if e >= 0 and diff[e] > 0:
                total += diff[e]
                diff[e] = 0
        for i in range(slots):
            if new_exp[g, i] >= 0:
                diff[new_exp[g, i]] = 0
            if old_exp[g, i] >= 0:
                diff[old_exp[g, i]] = 0
    return total


@jit
def _argmax(x):
    best = 0
    for k in range(1, x.shape[0]):
        if x[k] > x[best]:
            best = k
    return best


@jit
def _holds(gpu_exp, g, e):
    for i in range(gpu_exp.shape[1]):
        if gpu_exp[g, i] == e:
            return True
    return False


@jit
def _loads(size, gpu_exp, load):
    num_gpus, slots = gpu_exp.shape
    for g in range(num_gpus):
        s = 0.0
        for i in range(slots):
            e = gpu_exp[g, i]
            if e >= 0:
                s += size[e]
        load[g] = s


@jit
def _moves(hold, gpu_exp, cur):
    """Moves of ``gpu_exp`` against the old per-GPU holdings ``hold[g, e]``."""
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
def _repack(size, pinned, gpu_exp, pool_e, pool_home, n_pool, cap, load, order):
    """Put the ``n_pool`` replicas of the pool into the free (unpinned) slots.

    Largest replica first (stable: lowest pool position among equal sizes). A replica goes back
    to its home GPU (the GPU it was unpinned from) when that GPU has a free slot and stays at or
    below ``cap``; otherwise to the lightest GPU with a free slot that does not hold its expert
    (lowest GPU among equal loads), or, when every GPU with a free slot holds it, the lightest
    GPU with a free slot.
    """
    num_gpus, slots = gpu_exp.shape
    for g in range(num_gpus):
        for i in range(slots):
            if not pinned[g, i]:
                gpu_exp[g, i] = -1
    _loads(size, gpu_exp, load)
    key = np.empty(n_pool)
    for k in range(n_pool):
        key[k] = -size[pool_e[k]]
    order[:n_pool] = np.argsort(key, kind="mergesort")
    for k in range(n_pool):
        p = order[k]
        e = pool_e[p]
        x = size[e]
        best = -1
        h = pool_home[p]
        if h >= 0 and load[h] + x <= cap and not _holds(gpu_exp, h, e):
            for i in range(slots):
                if gpu_exp[h, i] < 0:
                    best = h
                    break
        if best < 0:
            best_dup = True
            for g in range(num_gpus):
                free = False
                for i in range(slots):
                    if gpu_exp[g, i] < 0:
                        free = True
                        break
                if not free:
                    continue
                dup = _holds(gpu_exp, g, e)
                if best < 0 or (best_dup and not dup) or (dup == best_dup and load[g] < load[best]):
                    best = g
                    best_dup = dup
        for i in range(slots):
            if gpu_exp[best, i] < 0:
                gpu_exp[best, i] = e
                break
        load[best] += x


@jit
def _insert_small(lst, n, e, key, keys):
    """Keep in ``lst[:n]`` the ``len(lst)`` experts of smallest key, in increasing key order
    (stable: the earlier expert first among equal keys). Returns the new ``n``."""
    cap = lst.shape[0]
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
def _replace_value(size, w, cnt, gpu_exp, load, gm, i, b):
    """Largest load over the GPUs that change if slot ``i`` of ``gm`` (expert ``a``, at least
    two replicas) is given to expert ``b``: ``a``'s other replicas grow, ``b``'s shrink."""
    num_gpus, slots = gpu_exp.shape
    a = gpu_exp[gm, i]
    grow = w[a] / (cnt[a] - 1) - size[a]
    nb = w[b] / (cnt[b] + 1)
    shrink = size[b] - nb
    worst = 0.0
    for g in range(num_gpus):
        v = load[g]
        for k in range(slots):
            e = gpu_exp[g, k]
            if g == gm and k == i:
                v += nb - size[a]
            elif e == a:
                v += grow
            elif e == b:
                v -= shrink
        if v > worst:
            worst = v
    return worst


@jit
def replan_subproblem(w, old_exp, target, budget, max_steps, gpu_exp):
    """Re-plan one sub-problem from ``old_exp`` with at most ``budget`` moves.

    1. **Counts**: old counts; experts without a replica get one and slots freed by experts
       that left go, one at a time, to the expert with the largest load per replica. Then, while
       a replica is larger than ``target - Q`` (``Q`` = the ``S - 1`` smallest replicas, so no
       GPU holding it could stay at or below ``target``), the largest replica's expert gains a
       replica from the expert that loses least (smallest ``w / (c - 1)``, which must stay at or
       below the same limit); the donor gives up its replica on its most loaded GPU.
    2. **Keep, then fill**: every other old replica stays pinned in its slot; the new replicas
       fill the freed slots (:func:`_repack`).
    3. **Local search** while the most loaded GPU ``gm`` is above ``target``: swap a replica of
       ``gm`` with a smaller one on another GPU (no GPU may get two replicas of one expert), or
       give a slot of ``gm`` held by an expert with two or more replicas to one of the four
       experts with the smallest replica after gaining one (a count change; the GPUs holding
       either expert change load). Only steps that lower ``gm`` below its load without raising
       another GPU to it count. A step's cost is its change in moves (``-2 .. 2``: a replica
       returning to a GPU that held it is free). Among free steps the largest gain wins; else
       the largest gain per move, the gain capped at ``gm``'s excess over ``target``; steps that
       would exceed ``budget`` are skipped (lowest GPU, then slot, among equals).
    4. Stop when the maximum is at most ``target``, no step is left or ``max_steps`` were made;
       the result is the best state seen (lowest maximum, then fewest moves).

    Returns the moves of the result; ``budget + 1`` (and ``old_exp`` copied) when even the
    replicas that the sub-problem must receive exceed the budget.
    """
    num_gpus, slots = old_exp.shape
    num_log = w.shape[0]
    num_phy = num_gpus * slots
    hold = np.zeros((num_gpus, num_log), dtype=np.int64)
    cnt = np.zeros(num_log, dtype=np.int64)
    pinned = np.zeros((num_gpus, slots), dtype=np.bool_)
    for g in range(num_gpus):
        for i in range(slots):
            e = old_exp[g, i]
            gpu_exp[g, i] = e
            if e >= 0:
                hold[g, e] += 1
                cnt[e] += 1
                pinned[g, i] = True
    size = np.empty(num_log)
    load = np.empty(num_gpus)
    cur_tmp = np.zeros(num_log, dtype=np.int64)
    pool_e = np.empty(num_phy, dtype=np.int64)
    pool_home = np.empty(num_phy, dtype=np.int64)
    order = np.empty(num_phy, dtype=np.int64)
    n_pool = 0
    n_free = 0
    for g in range(num_gpus):
        for i in range(slots):
            if gpu_exp[g, i] < 0:
                n_free += 1
    # 1a. Experts without a replica take free slots first (donors if there are too few).
    for e in range(num_log):
        if cnt[e] > 0:
            continue
        if n_free == 0:
            donor = -1
            for d in range(num_log):
                if cnt[d] >= 2 and (donor < 0 or w[d] / (cnt[d] - 1) < w[donor] / (cnt[donor] - 1)):
                    donor = d
            for d in range(num_log):
                size[d] = w[d] / max(cnt[d], 1)
            _loads(size, gpu_exp, load)
            bg = -1
            bi = -1
            for g in range(num_gpus):
                for i in range(slots):
                    if gpu_exp[g, i] == donor and pinned[g, i] and (bg < 0 or load[g] > load[bg]):
                        bg = g
                        bi = i
            gpu_exp[bg, bi] = -1
            pinned[bg, bi] = False
            cnt[donor] -= 1
            n_free += 1
        cnt[e] = 1
        pool_e[n_pool] = e
        pool_home[n_pool] = -1
        n_pool += 1
        n_free -= 1
    # 1b. Remaining free slots: largest load per replica first (lowest expert among equals).
    while n_free > 0:
        best = 0
        for e in range(1, num_log):
            if w[e] * cnt[best] > w[best] * cnt[e]:
                best = e
        cnt[best] += 1
        pool_e[n_pool] = best
        pool_home[n_pool] = -1
        n_pool += 1
        n_free -= 1
    # 1c. Count repair: no replica may exceed target - Q (each change adds one new replica).
    while n_pool < budget and num_phy > num_log:
        for e in range(num_log):
            size[e] = w[e] / cnt[e]
        by_size = np.argsort(size, kind="mergesort")
        q = 0.0
        left = slots - 1
        for k in range(num_log):
            if left == 0:
                break
            take = min(cnt[by_size[k]], left)
            q += take * size[by_size[k]]
            left -= take
        limit = target - q
        recv = _argmax(size)
        if size[recv] <= limit * (1.0 + _REL_TOL):
            break
        donor = -1
        for d in range(num_log):
            if d != recv and cnt[d] >= 2 and w[d] / (cnt[d] - 1) <= limit:
                if donor < 0 or w[d] * (cnt[donor] - 1) < w[donor] * (cnt[d] - 1):
                    donor = d
        if donor < 0:
            break
        in_pool = -1
        for p in range(n_pool):
            if pool_e[p] == donor:
                in_pool = p
                break
        if in_pool >= 0:  # a new replica of the donor not placed yet: give it to the receiver
            pool_e[in_pool] = recv
        else:  # free the donor's replica on its most loaded GPU (lowest GPU among equals)
            _loads(size, gpu_exp, load)
            bg = -1
            bi = -1
            for g in range(num_gpus):
                for i in range(slots):
                    if gpu_exp[g, i] == donor and (bg < 0 or load[g] > load[bg]):
                        bg = g
                        bi = i
            gpu_exp[bg, bi] = -1
            pinned[bg, bi] = False
            pool_e[n_pool] = recv
            pool_home[n_pool] = -1
            n_pool += 1
        cnt[donor] -= 1
        cnt[recv] += 1
    for e in range(num_log):
        size[e] = w[e] / cnt[e]
    # 2. Fill the freed slots.
    _repack(size, pinned, gpu_exp, pool_e, pool_home, n_pool, target, load, order)
    moves = _moves(hold, gpu_exp, cur_tmp)
    best_exp = gpu_exp.copy()
    best_val = load[_argmax(load)]
    best_moves = moves
    if moves > budget:  # the count repair alone exceeds the budget (only when budget < changes)
        best_val = np.inf
    tol = _REL_TOL * target
    fill = np.empty(4, dtype=np.int64)
    fkey = np.empty(4)
    cur = np.zeros((num_gpus, num_log), dtype=np.int64)
    for g in range(num_gpus):
        for i in range(slots):
            cur[g, gpu_exp[g, i]] += 1
    for _step in range(max_steps):
        if best_val <= target + tol or moves > budget:
            break
        gm = _argmax(load)
        top = load[gm]
        # Best swap of a replica of gm with a smaller one elsewhere: among those that cost no
        # move the largest gain, else the largest gain per move (lowest GPU, slots among equals).
        need = top - target  # gain beyond this does not help gm reach the target
        free_gain = 0.0
        paid_score = 0.0
        fi = fh = fj = -1
        pi = ph = pj = -1
        for h in range(num_gpus):
            gap = top - load[h]
            if h == gm or gap <= tol:
                continue
            for i in range(slots):
                a = gpu_exp[gm, i]
                for j in range(slots):
                    b = gpu_exp[h, j]
                    d = size[a] - size[b]
                    if d <= tol or d >= gap - tol:
                        continue
                    gain = top - max(top - d, load[h] + d)
                    if gain <= free_gain and min(gain, need) <= paid_score * 2.0:
                        continue
                    if cur[h, a] > 0 or cur[gm, b] > 0:
                        continue  # would put two replicas of one expert on a GPU
                    delta = 0
                    if cur[gm, a] <= hold[gm, a]:
                        delta += 0
                    else:
                        delta -= 1
                    if cur[h, a] >= hold[h, a]:
                        delta += 1
                    if cur[h, b] > hold[h, b]:
                        delta -= 1
                    if cur[gm, b] >= hold[gm, b]:
                        delta += 1
                    if moves + delta > budget:
                        continue
                    if delta <= 0:
                        if gain > free_gain:
                            free_gain = gain
                            fi = i
                            fh = h
                            fj = j
                    elif min(gain, need) / delta > paid_score:
                        paid_score = min(gain, need) / delta
                        pi = i
                        ph = h
                        pj = j
        # Count change: slot i of gm goes from a (>= 2 replicas) to one of the 4 experts with
        # the smallest replica after gaining one (not on gm); one move, no second GPU.
        ri = rb = -1
        nf = 0
        for e in range(num_log):
            if cur[gm, e] == 0:
                nf = _insert_small(fill, nf, e, w[e] / (cnt[e] + 1), fkey)
        for i in range(slots):
            a = gpu_exp[gm, i]
            if cnt[a] < 2:
                continue
            for k in range(nf):
                b = fill[k]
                delta = 1 if cur[gm, b] >= hold[gm, b] else 0
                if cur[gm, a] > hold[gm, a]:
                    delta -= 1
                if moves + delta > budget:
                    continue
                v = _replace_value(size, w, cnt, gpu_exp, load, gm, i, b)
                gain = top - v
                if gain <= tol:
                    continue
                if delta <= 0:
                    if gain > free_gain:
                        free_gain = gain
                        fi = -1
                        ri = i
                        rb = b
                elif fi < 0 and min(gain, need) / delta > paid_score:
                    paid_score = min(gain, need) / delta
                    pi = -1
                    ri = i
                    rb = b
        if ri >= 0 and fi < 0 and (pi < 0 or free_gain > 0.0):
            a = gpu_exp[gm, ri]
            gpu_exp[gm, ri] = rb
            cur[gm, a] -= 1
            cur[gm, rb] += 1
            cnt[a] -= 1
            cnt[rb] += 1
            size[a] = w[a] / cnt[a]
            size[rb] = w[rb] / cnt[rb]
            _loads(size, gpu_exp, load)
            fi = -2
        if fi == -2:  # the count change was made
            pass
        elif fi >= 0:
            i, h, j = fi, fh, fj
        elif pi >= 0:
            i, h, j = pi, ph, pj
        else:
            break
        if fi != -2:
            a = gpu_exp[gm, i]
            b = gpu_exp[h, j]
            d = size[a] - size[b]
            gpu_exp[gm, i] = b
            gpu_exp[h, j] = a
            cur[gm, a] -= 1
            cur[h, a] += 1
            cur[h, b] -= 1
            cur[gm, b] += 1
            load[gm] -= d
            load[h] += d
        moves = _moves(hold, gpu_exp, cur_tmp)
        val = load[_argmax(load)]
        if val < best_val * (1.0 - _REL_TOL) or (
            val <= best_val * (1.0 + _REL_TOL) and moves < best_moves
        ):
            best_val = val
            best_moves = moves
            best_exp[:, :] = gpu_exp
    if best_val == np.inf:  # nothing within the budget: the caller keeps the old plan
        best_exp[:, :] = old_exp
        best_moves = budget + 1
    gpu_exp[:, :] = best_exp
    return best_moves


def warmup() -> None:
    """Compile every re-planning kernel on a tiny input."""
    w = np.array([4.0, 3.0, 2.0, 1.0])
    old = np.array([[0, 1], [2, 3], [0, 1]], dtype=np.int64)
    out = np.empty_like(old)
    replan_subproblem(w, old, 4.0, 10, 16, out)
    count_moves(old, out, 4)
