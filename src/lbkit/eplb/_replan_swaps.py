"""The swap search of the excess descent (:func:`lbkit.eplb._replan_descent.descend`): a
replica of a GPU above the target exchanged with a smaller one of a GPU at or below it, the
step of largest reduction per move, and that search kept per GPU across the steps of a descent.

Vocabulary as in ``_primitives.py``; every kernel also runs with ``NUMBA_DISABLE_JIT=1``.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit
from lbkit.eplb._primitives import (
    REL_TOL,
    equals_best,
    excess,
    holds_move,
    step_score,
    swap_cost,
)

__all__ = ["best_swap", "cached_best_swap", "mark_changed", "swap_cache"]


@jit
def _earlier(h, i, k, j, bh, bi, bk, bj):
    """Whether swap ``(h, i, k, j)`` comes before ``(bh, bi, bk, bj)`` in index order."""
    if h != bh:
        return h < bh
    if i != bi:
        return i < bi
    if k != bk:
        return k < bk
    return j < bj


@jit
def _swaps_of(
    size, hold, cur, gpu_exp, load, target, budget, moves, h, k_ok, k_moved, by_room, n_light,
    found, best_free, best_score, bh, bi, bk, bj,
):  # fmt: skip
    """The swaps of GPU ``h`` (above ``target``) with the light GPUs ``k`` where ``k_ok[k]``,
    against the best step so far: ``found`` (a swap, ``(bh, bi, bk, bj)``, which loses ties to
    an earlier swap in ``(h, i, k, j)`` order) or not (``(best_free, best_score)`` is an
    earlier kind's step, or nothing, and wins ties). Returns the updated ``(found, best_free,
    best_score, bh, bi, bk, bj)``.

    ``k_moved[k]``: ``k`` holds a replica that is a move; ``by_room[:n_light]``: the GPUs at or
    below ``target`` by decreasing room. The reduction of a swap is at most ``min(excess of h,
    target - load[k])``; a GPU ``k`` whose bound (plus a slack above rounding) cannot beat the
    best step at the fewest moves a swap of ``a`` with ``k`` can cost (``[k never held a] - [a
    is a move on h]``, less one if ``k`` holds a move: only such a ``b`` can lower the cost by
    leaving ``k``) is skipped, and when the best step is free the first ``k`` whose bound
    cannot beat it ends the search for that slot (less room after it).
    """
    slots = gpu_exp.shape[1]
    tol = REL_TOL * target
    slack = 1e-9 * target
    h_exc = excess(load[h], target)
    for i in range(slots):
        a = gpu_exp[h, i]
        a_moved = 1 if cur[h, a] > hold[h, a] else 0
        for r in range(n_light):
            k = by_room[r]
            if k == h or not k_ok[k] or cur[k, a] > 0:
                continue
            bound = min(h_exc, target - load[k]) + slack
            if best_free and bound <= best_score:
                break  # nor can any GPU after it (less room)
            cmin = (1 if hold[k, a] == 0 else 0) - a_moved - (1 if k_moved[k] else 0)
            if cmin > 0 and (best_free or bound <= best_score * cmin):
                continue  # every swap here costs moves and cannot beat the best step
            for j in range(slots):
                b = gpu_exp[k, j]
                d = size[a] - size[b]
                if d <= tol or cur[h, b] > 0:
                    continue
                red = (
                    excess(load[h], target)
                    - excess(load[h] - d, target)
                    + excess(load[k], target)
                    - excess(load[k] + d, target)
                )
                if red <= tol:
                    continue
                cost = swap_cost(cur, hold, h, a, k, b)
                if moves + cost > budget:
                    continue
                score = step_score(red, cost, best_free, best_score)
                if score < 0.0:
                    # equal to the best swap and earlier in (h, i, k, j) order
                    if not equals_best(found, red, cost, best_free, best_score):
                        continue
                    if not _earlier(h, i, k, j, bh, bi, bk, bj):
                        continue
                    score = best_score
                best_free = cost <= 0
                best_score = score
                found = True
                bh = h
                bi = i
                bk = k
                bj = j
    return found, best_free, best_score, bh, bi, bk, bj


@jit
def _light_by_room(load, target, by_room):
    """``by_room``: the GPUs by increasing load (stable); returns how many are at or below
    ``target``."""
    by_room[:] = np.argsort(load, kind="mergesort")
    n_light = 0
    while n_light < load.shape[0] and load[by_room[n_light]] <= target:
        n_light += 1
    return n_light


@jit
def best_swap(size, hold, cur, gpu_exp, load, target, budget, moves, best_free, best_score):
    """The best swap that beats ``(best_free, best_score)``: replica ``a`` (slot ``i``) of a GPU
    ``h`` above ``target`` with a smaller replica ``b`` (slot ``j``) of GPU ``k``, the first
    of the best in ``(h, i, k, j)`` order (:func:`_swaps_of` on every GPU above ``target``).
    Returns ``(found, best_free, best_score, h, i, k, j)``.
    """
    num_gpus = gpu_exp.shape[0]
    tol = REL_TOL * target
    k_moved = np.empty(num_gpus, dtype=np.bool_)
    holds_move(gpu_exp, cur, hold, k_moved)
    by_room = np.empty(num_gpus, dtype=np.int64)
    n_light = _light_by_room(load, target, by_room)
    k_ok = np.ones(num_gpus, dtype=np.bool_)
    found = False
    bh = bi = bk = bj = -1
    for h in range(num_gpus):
        if load[h] <= target + tol:
            continue
        found, best_free, best_score, bh, bi, bk, bj = _swaps_of(
            size, hold, cur, gpu_exp, load, target, budget, moves, h, k_ok, k_moved, by_room,
            n_light, found, best_free, best_score, bh, bi, bk, bj,
        )  # fmt: skip
    return found, best_free, best_score, bh, bi, bk, bj


@jit
def swap_cache(num_gpus):
    """The state of :func:`cached_best_swap`, nothing cached yet: ``(found, free, score, at,
    ok, changed, k_moved, by_room, every)``; GPU ``h``'s best swap is ``found[h]``,
    ``free[h]``, ``score[h]`` and ``at[h] = (i, k, j)``, valid while ``ok[h]``; ``changed[g]``:
    GPU ``g`` changed since the last search."""
    return (
        np.zeros(num_gpus, dtype=np.bool_),
        np.zeros(num_gpus, dtype=np.bool_),
        np.zeros(num_gpus),
        np.full((num_gpus, 3), -1, dtype=np.int64),
        np.zeros(num_gpus, dtype=np.bool_),
        np.ones(num_gpus, dtype=np.bool_),
        np.empty(num_gpus, dtype=np.bool_),
        np.empty(num_gpus, dtype=np.int64),
        np.ones(num_gpus, dtype=np.bool_),
    )


@jit
def cached_best_swap(size, hold, cur, gpu_exp, load, target, budget, moves, cache):
    """:func:`best_swap` from nothing (``(False, 0.0)``), kept per GPU above ``target`` across
    the steps of a descent: the swaps of GPU ``h`` depend only on ``h``, the light GPUs ``k``
    and, near the budget, on ``moves``. So ``h``'s best is searched again in full only when
    ``h`` changed, its best's ``k`` changed, or a swap may reach the budget (``moves + 2 >
    budget``); otherwise only the swaps with the light GPUs that changed are searched, against
    the best kept (ties: the first in ``(i, k, j)`` order, as in the full search). Clears the
    changed marks. Returns ``(found, best_free, best_score, h, i, k, j)``, the same as
    :func:`best_swap` with no best step given.
    """
    c_found, c_free, c_score, at, ok, changed, k_moved, by_room, every = cache
    num_gpus = gpu_exp.shape[0]
    tol = REL_TOL * target
    holds_move(gpu_exp, cur, hold, k_moved)
    n_light = _light_by_room(load, target, by_room)
    near_budget = moves + 2 > budget
    some_changed = False
    for g in range(num_gpus):
        some_changed = some_changed or changed[g]
    found = False
    best_free = False
    best_score = 0.0
    bh = bi = bk = bj = -1
    for h in range(num_gpus):
        if load[h] <= target + tol:
            ok[h] = False
            continue
        full = near_budget or not ok[h] or changed[h] or (c_found[h] and changed[at[h, 1]])
        if full or some_changed:
            if full:
                f, fr, sc, i, k, j = False, False, 0.0, -1, -1, -1
                k_ok = every
            else:
                f, fr, sc, i, k, j = c_found[h], c_free[h], c_score[h], at[h, 0], at[h, 1], at[h, 2]
                k_ok = changed
            f, fr, sc, _, i, k, j = _swaps_of(
                size, hold, cur, gpu_exp, load, target, budget, moves, h, k_ok, k_moved,
                by_room, n_light, f, fr, sc, h, i, k, j,
            )  # fmt: skip
            c_found[h] = f
            c_free[h] = fr
            c_score[h] = sc
            at[h, 0] = i
            at[h, 1] = k
            at[h, 2] = j
            ok[h] = not near_budget
        if c_found[h] and (
            not found
            or (c_free[h] and not best_free)
            or (c_free[h] == best_free and c_score[h] > best_score)
        ):
            found = True
            best_free = c_free[h]
            best_score = c_score[h]
            bh = h
            bi = at[h, 0]
            bk = at[h, 1]
            bj = at[h, 2]
    for g in range(num_gpus):
        changed[g] = False
    return found, best_free, best_score, bh, bi, bk, bj


@jit
def mark_changed(gpu_exp, before_exp, load, before_load, cur, a, b, changed):
    """``changed[g]``: GPU ``g``'s replicas changed, its load is not bit for bit the same (a
    descent may start from loads summed in another order), or it holds expert ``a`` or ``b``
    (whose replica sizes a count change alters; ``-1``: none). A GPU's swaps depend only on
    its replicas, their sizes and its load."""
    num_gpus, slots = gpu_exp.shape
    for g in range(num_gpus):
        c = changed[g] or load[g] != before_load[g]
        if a >= 0 and (cur[g, a] > 0 or cur[g, b] > 0):
            c = True
        for i in range(slots):
            if gpu_exp[g, i] != before_exp[g, i]:
                c = True
        changed[g] = c
