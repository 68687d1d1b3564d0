"""Exact search for small sub-problems (at most ``EXACT_MAX_REPLICAS`` replicas): every count
vector, every packing, within a node budget (default method, steps 4-5).
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._primitives import REL_TOL

__all__ = ["EXACT_BUDGET", "EXACT_MAX_REPLICAS", "exact_search"]


#: Sub-problems with at most this many replicas also get the exact search (:func:`exact_search`).
EXACT_MAX_REPLICAS = 32


#: Search nodes the exact search of one sub-problem may visit.
EXACT_BUDGET = 400_000


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
    tol = REL_TOL * cap
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
        if trial[e] > hi[e] or extra > left or w[e] / trial[e] > cap * (1.0 + REL_TOL):
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
