"""Local search and give-back of a re-plan (steps 4 and 6 of
:func:`lbkit.eplb._replan_layer.replan_subproblem`).

The **local search** lowers the most loaded GPU while it is above the target, one step at a
time; :func:`reclaim` then gives back moves that are not needed. Clean arrays only (see
``_primitives.py`` for the vocabulary); every kernel also runs with ``NUMBA_DISABLE_JIT=1``.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._primitives import (
    REL_TOL,
    apply_replace,
    apply_swap,
    argmax,
    count_moves,
    gpu_loads,
    holders,
    holds_move,
    insert_sorted,
    replace_cost,
    swap_cost,
)

__all__ = ["FILL_CANDIDATES"]

#: Experts (smallest replica after gaining one first) offered a slot of the most loaded GPU by
#: a count change of the local search.
FILL_CANDIDATES = 4


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
def local_search(
    w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves, max_steps, best, cur_tmp
):
    """Local search on the most loaded GPU ``gm`` while it is above ``target`` (at most
    ``max_steps`` steps; see :func:`lbkit.eplb._replan_layer.replan_subproblem`, step 4).

    Steps: swap a replica of ``gm`` with a smaller one on another GPU (no GPU may get two
    replicas of one expert), or give a slot of ``gm`` held by an expert with two or more
    replicas to one of the :data:`FILL_CANDIDATES` experts with the smallest replica after
    gaining one (a count change; the GPUs holding either expert change load). Only steps that
    lower ``gm`` below its load without raising another GPU to it count. A step's cost is its
    change in moves (``-2 .. 2``). Among free swaps the largest gain wins, else the largest gain
    per move (the gain capped at ``gm``'s excess over ``target``); a count change found after
    them (free: a larger gain than every free swap; paid: when no swap is free, a larger gain
    per move) is made instead. Steps beyond ``budget`` are skipped (lowest GPU, then slot,
    among equals).

    ``best = (best_exp, best_val, best_moves)`` is the best state so far (lowest maximum, then
    fewest moves); ``best_exp`` is updated in place. Returns ``(moves, best_val, best_moves)``.
    """
    best_exp, best_val, best_moves = best
    num_gpus, slots = gpu_exp.shape
    num_log = w.shape[0]
    tol = REL_TOL * target
    fill = np.empty(FILL_CANDIDATES, dtype=np.int64)
    fkey = np.empty(FILL_CANDIDATES)
    for _step in range(max_steps):
        if best_val <= target + tol or moves > budget:
            break
        gm = argmax(load)
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
                    delta = swap_cost(cur, hold, gm, a, h, b)
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
        # Count change: slot i of gm goes from a (>= 2 replicas) to a fill candidate (not on
        # gm); one move, no second GPU.
        ri = rb = -1
        nf = 0
        for e in range(num_log):
            if cur[gm, e] == 0:
                nf = insert_sorted(fill, nf, FILL_CANDIDATES, e, w[e] / (cnt[e] + 1), fkey)
        for i in range(slots):
            a = gpu_exp[gm, i]
            if cnt[a] < 2:
                continue
            for k in range(nf):
                b = fill[k]
                delta = replace_cost(cur, hold, gm, a, b)
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
                    ri = i
                    rb = b
        if ri >= 0:  # the count change found last beats every swap before it
            a = gpu_exp[gm, ri]
            apply_replace(gpu_exp, cur, cnt, gm, ri, rb)
            size[a] = w[a] / cnt[a]
            size[rb] = w[rb] / cnt[rb]
            gpu_loads(size, gpu_exp, load)
        else:
            if fi >= 0:
                i, h, j = fi, fh, fj
            elif pi >= 0:
                i, h, j = pi, ph, pj
            else:
                break
            d = size[gpu_exp[gm, i]] - size[gpu_exp[h, j]]
            apply_swap(gpu_exp, cur, gm, i, h, j)
            load[gm] -= d
            load[h] += d
        moves = count_moves(hold, gpu_exp, cur_tmp)
        val = load[argmax(load)]
        if val < best_val * (1.0 - REL_TOL) or (
            val <= best_val * (1.0 + REL_TOL) and moves < best_moves
        ):
            best_val = val
            best_moves = moves
            best_exp[:, :] = gpu_exp
    return moves, best_val, best_moves


@jit
def reclaim(w, hold, gpu_exp, cap, max_steps):
    """Undo moves that are not needed: while some change saves a move and keeps every GPU at or
    below ``cap``, make the one saving most (then the lowest largest load among the changed
    GPUs; lowest GPU, slot, expert among equals). Changes: a swap of two replicas between GPUs,
    or a count change (a slot of an expert with two or more replicas given to another expert)."""
    num_gpus, slots = gpu_exp.shape
    num_log = w.shape[0]
    cnt = np.zeros(num_log, dtype=np.int64)
    cur = np.zeros((num_gpus, num_log), dtype=np.int64)
    for g in range(num_gpus):
        for i in range(slots):
            cnt[gpu_exp[g, i]] += 1
            cur[g, gpu_exp[g, i]] += 1
    size = np.empty(num_log)
    load = np.empty(num_gpus)
    start = np.zeros(num_log + 1, dtype=np.int64)
    gpus = np.empty(num_gpus * slots, dtype=np.int64)
    k_moved = np.empty(num_gpus, dtype=np.bool_)  # GPU k holds a replica that is a move
    lim = cap * (1.0 + REL_TOL)
    for _step in range(max_steps):
        for e in range(num_log):
            size[e] = w[e] / cnt[e]
        gpu_loads(size, gpu_exp, load)
        holds_move(gpu_exp, cur, hold, k_moved)
        best_save = 0
        best_top = 0.0
        kind = -1
        bh = bi = bk = bj = bb = -1
        for h in range(num_gpus):
            for i in range(slots):
                a = gpu_exp[h, i]
                if cur[h, a] <= hold[h, a]:
                    continue  # only a replica that was a move can be given back
                for k in range(num_gpus):
                    if k == h or cur[k, a] > 0:
                        continue
                    if hold[k, a] == 0 and not k_moved[k]:
                        continue  # a is a move on k and k gives back no move: nothing saved
                    for j in range(slots):
                        b = gpu_exp[k, j]
                        if cur[h, b] > 0:
                            continue
                        save = -swap_cost(cur, hold, h, a, k, b)
                        if save <= 0 or save < best_save:
                            continue
                        lh = load[h] - size[a] + size[b]
                        lk = load[k] - size[b] + size[a]
                        if lh > lim or lk > lim:
                            continue
                        top = max(lh, lk)
                        if save > best_save or top < best_top:
                            best_save = save
                            best_top = top
                            kind = 1
                            bh = h
                            bi = i
                            bk = k
                            bj = j
        holders(gpu_exp, num_log, start, gpus)
        for h in range(num_gpus):
            for i in range(slots):
                a = gpu_exp[h, i]
                if cnt[a] < 2 or cur[h, a] <= hold[h, a]:
                    continue
                grow = w[a] / (cnt[a] - 1) - size[a]
                for b in range(num_log):
                    if b == a or cur[h, b] > 0 or replace_cost(cur, hold, h, a, b) >= 0:
                        continue  # saves a move only if b returns to a GPU that held it
                    nb = w[b] / (cnt[b] + 1)  # b's other replicas shrink: never above cap
                    top = load[h] - size[a] + nb
                    for q in range(start[a], start[a + 1]):
                        g = gpus[q]
                        if g != h:
                            top = max(top, load[g] + grow)
                    if top > lim:
                        continue
                    if 1 > best_save or top < best_top:
                        best_save = 1
                        best_top = top
                        kind = 0
                        bh = h
                        bi = i
                        bb = b
        if kind < 0:
            break
        if kind == 0:
            apply_replace(gpu_exp, cur, cnt, bh, bi, bb)
        else:
            apply_swap(gpu_exp, cur, bh, bi, bk, bj)
