"""The count-change and swap searches of the excess descent (``_replan_descent``)
against brute force: every slot of every GPU given to every other expert, the reduction of the
total excess recomputed from scratch, the rule of the docstring (a free step beats every paid
one; then the largest reduction, per move when paid; the first in (GPU, slot, expert) order).
The loads are small integers (replica sizes exact), so the reductions are exact and ties are
real; JIT parity."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lbkit.eplb import _replan_descent as D
from lbkit.eplb import _replan_swaps as W
from lbkit.eplb._primitives import (
    REL_TOL,
    apply_replace,
    apply_swap,
    count_moves,
    gpu_loads,
    holders,
)

#: Loads are multiples of this (the least common multiple of 1..4), so that every replica
#: size ``w / cnt`` with ``cnt <= 4`` is an integer.
UNIT = 12.0


@st.composite
def descent_states(draw):
    g = draw(st.integers(2, 5))
    s = draw(st.integers(2, 4))
    e = draw(st.integers(max(2, g * s // 3), g * s - 1))  # some expert has two replicas
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def placement():
        slots = np.concatenate([np.arange(e), rng.integers(0, e, g * s - e)])
        exp = rng.permutation(slots).reshape(g, s).astype(np.int64)
        return exp if np.bincount(exp.ravel(), minlength=e).max() <= 4 else None

    new, old = placement(), placement()
    if new is None or old is None:
        new = np.arange(g * s).reshape(g, s) % e
        old = new[::-1].copy()
    if draw(st.booleans()):  # the old plan near the new one: few moves, mostly paid steps
        old = new.copy()
        for _ in range(draw(st.integers(0, 3))):
            old[rng.integers(g), rng.integers(s)] = rng.integers(e)
    w = rng.integers(1, 9, e) * UNIT
    cur = np.zeros((g, e), dtype=np.int64)
    hold = np.zeros((g, e), dtype=np.int64)
    np.add.at(cur, (np.repeat(np.arange(g), s), new.ravel()), 1)
    np.add.at(hold, (np.repeat(np.arange(g), s), old.ravel()), 1)
    cnt = cur.sum(axis=0)
    size = w / cnt
    load = size[new].sum(axis=1)
    target = float(np.floor(load.mean() + draw(st.floats(0.0, 1.0)) * (load.max() - load.mean())))
    budget = draw(st.integers(0, g * s))
    return w, size, cnt, hold, cur, new, load, target, budget


def excess_total(load, target):
    return float(np.maximum(load - target, 0.0).sum())


def brute_best_change(w, cnt, hold, cur, gpu_exp, load, target, budget, moves):
    """``(found, free, score, h, i, b)`` by enumeration."""
    g_count, slots = gpu_exp.shape
    tol = REL_TOL * target
    heavy = load > target + tol
    hot = np.zeros(len(w), dtype=bool)
    for g in np.flatnonzero(heavy):
        hot[gpu_exp[g]] = True
    best = None  # (free, score, h, i, b)
    before = excess_total(load, target)
    for h in range(g_count):
        for i in range(slots):
            a = gpu_exp[h, i]
            if cnt[a] < 2:
                continue
            for b in range(len(w)):
                if b == a or cur[h, b] > 0 or not (heavy[h] or hot[b]):
                    continue
                cost = (-1 if cur[h, a] > hold[h, a] else 0) + (1 if cur[h, b] >= hold[h, b] else 0)
                if moves + cost > budget:
                    continue
                exp = gpu_exp.copy()
                exp[h, i] = b
                c2 = np.bincount(exp.ravel(), minlength=len(w))
                red = before - excess_total((w / c2)[exp].sum(axis=1), target)
                if red <= tol:
                    continue
                key = (cost <= 0, red if cost <= 0 else red / cost)
                if best is None or key > best[:2]:  # strictly better; ties keep the first
                    best = (*key, h, i, b)
    if best is None:
        return False, None, None, -1, -1, -1
    return True, *best


def kernel_best_change(fn, w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves):
    g, s = gpu_exp.shape
    e = len(w)
    start = np.zeros(e + 1, dtype=np.int64)
    gpus = np.empty(g * s, dtype=np.int64)
    holders(gpu_exp, e, start, gpus)
    hot = np.zeros(e, dtype=np.bool_)
    D._mark_hot(load, target, start, gpus, hot)
    old_of = np.full((g, s), -1, dtype=np.int64)
    for k in range(g):
        held = np.flatnonzero(hold[k] > 0)
        old_of[k, : len(held)] = held
    scratch = D.count_change_scratch(g, e)
    return fn(
        w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves, start, gpus, hot,
        old_of, scratch, False, 0.0,
    )  # fmt: skip


@given(descent_states())
def test_count_change_search_is_the_best_by_brute_force(state):
    w, size, cnt, hold, cur, gpu_exp, load, target, budget = state
    moves = count_moves(hold, gpu_exp, np.zeros(len(w), dtype=np.int64))
    got = kernel_best_change(D._best_count_change, w, size, cnt, hold, cur, gpu_exp, load,
                             target, budget, moves)  # fmt: skip
    want = brute_best_change(w, cnt, hold, cur, gpu_exp, load, target, budget, moves)
    assert bool(got[0]) == want[0]
    if want[0]:
        assert (bool(got[1]), float(got[2])) == (want[1], want[2])
        assert tuple(int(x) for x in got[3:]) == want[3:]


@given(descent_states())
def test_count_change_search_jit_parity(state):
    w, size, cnt, hold, cur, gpu_exp, load, target, budget = state
    moves = count_moves(hold, gpu_exp, np.zeros(len(w), dtype=np.int64))
    args = (w, size, cnt, hold, cur, gpu_exp, load, target, budget, moves)
    fast = kernel_best_change(D._best_count_change, *args)
    slow = kernel_best_change(D._best_count_change.py_func, *args)
    assert tuple(fast) == tuple(slow)


def brute_best_swap(size, cur, hold, gpu_exp, load, target, budget, moves, best):
    """``(found, free, score, h, i, k, j)`` of the best swap beating ``best = (free, score)``
    by enumeration in (h, i, k, j) order: replica ``a`` of a GPU above the target for a smaller
    ``b`` of a GPU at or below it that holds no ``a`` (``h`` no ``b``)."""
    g_count, slots = gpu_exp.shape
    tol = REL_TOL * target
    before = excess_total(load, target)
    found = None
    key_best = best
    for h in range(g_count):
        if load[h] <= target + tol:
            continue
        for i in range(slots):
            a = gpu_exp[h, i]
            for k in range(g_count):
                if k == h or load[k] > target or cur[k, a] > 0:
                    continue
                for j in range(slots):
                    b = gpu_exp[k, j]
                    if size[a] - size[b] <= tol or cur[h, b] > 0:
                        continue
                    exp = gpu_exp.copy()
                    exp[h, i], exp[k, j] = b, a
                    red = before - excess_total(size[exp].sum(axis=1), target)
                    if red <= tol:
                        continue
                    cost = (
                        (-1 if cur[h, a] > hold[h, a] else 0)
                        + (1 if cur[h, b] >= hold[h, b] else 0)
                        + (-1 if cur[k, b] > hold[k, b] else 0)
                        + (1 if cur[k, a] >= hold[k, a] else 0)
                    )
                    if moves + cost > budget:
                        continue
                    key = (cost <= 0, red if cost <= 0 else red / cost)
                    if key > key_best:  # strictly better; ties keep the first
                        key_best = key
                        found = (h, i, k, j)
    if found is None:
        return False, None, None, -1, -1, -1, -1
    return True, *key_best, *found


@given(descent_states(), st.sampled_from([(False, 0.0), (True, 0.0), (False, 6.0), (True, 6.0)]))
def test_swap_search_is_the_best_by_brute_force(state, best):
    """The swap search (GPUs visited by decreasing room, ties by (h, i, k, j)) against
    enumeration, from no best step and from a free or paid best of another kind (which wins
    ties)."""
    w, size, _cnt, hold, cur, gpu_exp, load, target, budget = state
    moves = count_moves(hold, gpu_exp, np.zeros(len(w), dtype=np.int64))
    args = (size, hold, cur, gpu_exp, load, target, budget, moves, *best)
    got = W.best_swap(*args)
    assert tuple(got) == tuple(W.best_swap.py_func(*args))
    want = brute_best_swap(size, cur, hold, gpu_exp, load, target, budget, moves, best)
    assert bool(got[0]) == want[0]
    if want[0]:
        assert (bool(got[1]), float(got[2])) == (want[1], want[2])
        assert tuple(int(x) for x in got[3:]) == want[3:]


@given(descent_states(), st.data())
def test_cached_swap_search_equals_the_full_search(state, data):
    """The swap search kept per GPU across the steps of a descent (a GPU searched again in
    full only when it, its best swap's partner or the budget calls for it, otherwise against
    the light GPUs that changed) gives the full search's swap after every change: swaps (the
    best one or any), count changes (two experts' replicas change size), moves near the
    budget, and first loads a bit off their sums. Integer loads: ties are exact, so the tie
    rule is checked too."""
    w, size, cnt, hold, cur, gpu_exp, load, target, budget = state
    size, cnt, cur, gpu_exp, load = size.copy(), cnt.copy(), cur.copy(), gpu_exp.copy(), load.copy()
    num_gpus, slots = gpu_exp.shape
    moves = count_moves(hold, gpu_exp, np.zeros(len(w), dtype=np.int64))
    budget = data.draw(st.one_of(st.just(budget), st.integers(max(0, moves - 1), moves + 3)))
    # loads summed in another order: a descent may start from loads a bit off its own sums
    off = np.array(data.draw(st.lists(st.booleans(), min_size=num_gpus, max_size=num_gpus)))
    load = np.where(off, np.nextafter(load, np.inf), load)
    cache = W.swap_cache(num_gpus)
    for _ in range(data.draw(st.integers(4, 12), label="steps")):
        moves = count_moves(hold, gpu_exp, np.zeros(len(w), dtype=np.int64))
        want = W.best_swap(size, hold, cur, gpu_exp, load, target, budget, moves, False, 0.0)
        got = W.cached_best_swap(size, hold, cur, gpu_exp, load, target, budget, moves, cache)
        assert tuple(got) == tuple(want)
        before_exp, before_load = gpu_exp.copy(), load.copy()
        a = b = -1
        kind = data.draw(st.sampled_from(["best swap", "any swap", "count change"]))
        if kind == "best swap" and want[0]:
            apply_swap(gpu_exp, cur, *want[3:])
        elif kind == "count change" and cnt.max() >= 2:
            donors = [
                (g, i) for g in range(num_gpus) for i in range(slots) if cnt[gpu_exp[g, i]] >= 2
            ]
            h, i = data.draw(st.sampled_from(donors))
            a = int(gpu_exp[h, i])
            b = data.draw(st.sampled_from([e for e in range(len(w)) if e != a]))
            apply_replace(gpu_exp, cur, cnt, h, i, b)
            size[a], size[b] = w[a] / cnt[a], w[b] / cnt[b]
        else:
            h, k = data.draw(st.permutations(range(num_gpus)))[:2]
            i, j = data.draw(st.integers(0, slots - 1)), data.draw(st.integers(0, slots - 1))
            apply_swap(gpu_exp, cur, h, i, k, j)
        gpu_loads(size, gpu_exp, load)
        W.mark_changed(gpu_exp, before_exp, load, before_load, cur, a, b, cache[5])
