"""Exchange cycles of a re-plan (step 3 of :func:`lbkit.eplb._replan_layer.replan_subproblem`).

Replica counts stay fixed: ``m`` GPUs above ``target`` each pass a replica to the next, larger
than the one they receive by at least their excess, and a light GPU closes the cycle (``m + 1``
moves for ``m`` GPUs). Clean arrays only (see ``_primitives.py`` for the vocabulary); every
kernel also runs with ``NUMBA_DISABLE_JIT=1``.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._primitives import REL_TOL, count_moves, insert_sorted

__all__ = ["CYCLE_CLOSERS"]


#: Light GPUs (largest room first) tried as the closing GPU of an exchange cycle.
CYCLE_CLOSERS = 6


@jit
def _chain_from(size, gpu_exp, cur, load, target, tol, k, j, by_rise, mark, stamp, chain, hs):
    """Longest exchange cycle closed by slot ``j`` of the light GPU ``k`` (counts fixed).

    ``k`` gives its replica ``c`` (slot ``j``) to a GPU above ``target``; each GPU of the chain
    gives a replica larger than the one it receives by at least its excess to the next, and the
    last one's goes to ``k``, which must stay at or below ``target``: the sizes grow along the
    chain and their total rise is at most ``k``'s room. Greedy: the next GPU is the one whose
    step leaves the least slack over its excess (lowest GPU, slot among equals). Returns
    ``(m, span)``: the longest prefix that ``k`` can close (it must not hold the last replica's
    expert) and its total rise; the chain is in ``ch_g[:m], ch_i[:m]`` (``chain = (ch_g,
    ch_i)``). ``hs = (hs_g, hs_i, hs_size, hs_exc, hs_q, min_exc)``: the slots of the GPUs above
    ``target`` by increasing replica size (``hs_q``: the rank of the slot by GPU, then slot,
    which breaks ties), their GPU's excess, and the smallest excess. Each step scans only the
    slots whose size lies in the window its two conditions allow (by bisection, widened by
    ``1e-9`` relative for rounding).
    """
    ch_g, ch_i = chain
    hs_g, hs_i, hs_size, hs_exc, hs_q, min_exc = hs
    room = target - load[k]
    c = gpu_exp[k, j]
    s_in = size[c]
    e_in = c
    rise = 0.0
    m = 0
    best_m = 0
    best_rise = 0.0
    n = hs_g.shape[0]
    while True:
        margin = 1e-9 * (abs(target) + abs(s_in) + abs(room) + abs(rise))
        first = np.searchsorted(hs_size, s_in + min_exc - tol - margin, side="left")
        last = np.searchsorted(hs_size, s_in + (room + tol - rise) + margin, side="right")
        bh = -1
        bi = -1
        bq = n
        bslack = np.inf
        for t in range(first, last):
            h = hs_g[t]
            if mark[h] == stamp or cur[h, e_in] > 0:
                continue
            exc = hs_exc[t]
            d = hs_size[t] - s_in
            if d < exc - tol or rise + d > room + tol:
                continue
            key = d if by_rise else d - exc
            if key < bslack or (key == bslack and hs_q[t] < bq):
                bslack = key
                bh = h
                bi = hs_i[t]
                bq = hs_q[t]
        if bh < 0:
            break
        mark[bh] = stamp
        ch_g[m] = bh
        ch_i[m] = bi
        m += 1
        x = gpu_exp[bh, bi]
        rise += size[x] - s_in
        s_in = size[x]
        e_in = x
        if x != c and cur[k, x] == 0:
            best_m = m
            best_rise = rise
    return best_m, best_rise


@jit
def cycles(size, gpu_exp, cur, load, target, budget, hold, moves, cur_tmp):
    """Exchange cycles (counts fixed) until no GPU is above ``target``.

    Each cycle is the best of the chains (:func:`_chain_from`, both greedy rules) closed by the
    :data:`CYCLE_CLOSERS` GPUs with the most room and each of their slots: the largest total
    excess fixed (so that the GPUs hardest to fix go first), then the most GPUs fixed, then the
    least rise (first found among equals); ``m + 1`` moves for ``m`` GPUs. Stops when no chain
    fixes a GPU or the next cycle would exceed ``budget``. Updates the state in place; returns
    the moves. Only GPUs above ``target`` and one light GPU per cycle change, each by one
    replica in and one out, so the replica counts stay as they are."""
    num_gpus, slots = gpu_exp.shape
    tol = REL_TOL * target
    mark = np.zeros(num_gpus, dtype=np.int64)
    ch_g = np.empty(num_gpus, dtype=np.int64)
    ch_i = np.empty(num_gpus, dtype=np.int64)
    bc_g = np.empty(num_gpus, dtype=np.int64)
    bc_i = np.empty(num_gpus, dtype=np.int64)
    closers = np.empty(CYCLE_CLOSERS, dtype=np.int64)
    ckey = np.empty(CYCLE_CLOSERS)
    stamp = 0
    hs_g = np.empty(num_gpus * slots, dtype=np.int64)
    hs_i = np.empty(num_gpus * slots, dtype=np.int64)
    hs_size = np.empty(num_gpus * slots)
    hs_exc = np.empty(num_gpus * slots)
    for _cycle in range(num_gpus):
        n_hs = 0
        for g in range(num_gpus):
            if load[g] > target + tol:
                for i in range(slots):
                    hs_g[n_hs] = g
                    hs_i[n_hs] = i
                    hs_size[n_hs] = size[gpu_exp[g, i]]
                    hs_exc[n_hs] = load[g] - target
                    n_hs += 1
        if n_hs == 0:
            break
        by_size = np.argsort(hs_size[:n_hs], kind="mergesort")
        hs = (
            hs_g[by_size],
            hs_i[by_size],
            hs_size[by_size],
            hs_exc[by_size],
            by_size,
            hs_exc[:n_hs].min(),
        )
        nc = 0
        for g in range(num_gpus):
            if load[g] < target - tol:
                nc = insert_sorted(closers, nc, CYCLE_CLOSERS, g, load[g] - target, ckey)
        best_m = 0
        best_rise = 0.0
        best_fixed = 0.0
        bk = bj = -1
        for q in range(nc * slots * 2):
            k = closers[q // (2 * slots)]
            j = (q // 2) % slots
            # A chain closed by k fixes at most its rise plus tol per GPU, its rise at most k's
            # room plus tol: once that cannot reach the best, neither can the closers after k
            # (by decreasing room).
            reach = (target - load[k]) + (n_hs + 1) * tol
            if reach + 1e-9 * (abs(target) + abs(reach)) < best_fixed * (1.0 - REL_TOL):
                break
            stamp += 1
            m, rise = _chain_from(
                size, gpu_exp, cur, load, target, tol, k, j, q % 2 == 1, mark, stamp,
                (ch_g, ch_i), hs,
            )  # fmt: skip
            if m == 0:
                continue
            fixed = 0.0
            for t in range(m):
                fixed += load[ch_g[t]] - target
            if fixed > best_fixed * (1.0 + REL_TOL) or (
                fixed >= best_fixed * (1.0 - REL_TOL)
                and (m > best_m or (m == best_m and rise < best_rise))
            ):
                best_m = m
                best_rise = rise
                best_fixed = fixed
                bk = k
                bj = j
                bc_g[:m] = ch_g[:m]
                bc_i[:m] = ch_i[:m]
        if best_m == 0:
            break
        # apply: k's replica goes to the first GPU, each GPU's to the next, the last's to k
        prev_e = gpu_exp[bk, bj]
        for q in range(best_m):
            g = bc_g[q]
            out = gpu_exp[g, bc_i[q]]
            gpu_exp[g, bc_i[q]] = prev_e
            cur[g, out] -= 1
            cur[g, prev_e] += 1
            load[g] += size[prev_e] - size[out]
            prev_e = out
        c = gpu_exp[bk, bj]
        gpu_exp[bk, bj] = prev_e
        cur[bk, c] -= 1
        cur[bk, prev_e] += 1
        load[bk] += size[prev_e] - size[c]
        new_moves = count_moves(hold, gpu_exp, cur_tmp)
        if new_moves > budget:  # undo the cycle and stop
            gpu_exp[bk, bj] = c
            cur[bk, prev_e] -= 1
            cur[bk, c] += 1
            load[bk] -= size[prev_e] - size[c]
            for q in range(best_m - 1, -1, -1):
                g = bc_g[q]
                back = gpu_exp[g, bc_i[q]]  # what it received
                gpu_exp[g, bc_i[q]] = prev_e
                cur[g, back] -= 1
                cur[g, prev_e] += 1
                load[g] += size[prev_e] - size[back]
                prev_e = back
            break
        moves = new_moves
    return moves
