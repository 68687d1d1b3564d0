"""Exchange cycles of the re-planning kernel (``_replan_cycles.cycles``): replica counts kept,
GPUs at or below the target stay there, GPUs above it that change end at or below it, moves as
counted by brute force, never below the fixed-count lower bound on moves (``H + k``: GPUs above
the target plus the fewest light GPUs whose room covers the excess), checked against an
exhaustive search of the fewest moves on tiny instances; JIT parity."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lbkit.eplb import _replan_cycles as K


@st.composite
def states(draw, max_gpus=5, max_slots=3):
    g = draw(st.integers(2, max_gpus))
    s = draw(st.integers(1, max_slots))
    e = draw(st.integers(max(1, (g * s) // 2), g * s))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0, draw(st.floats(0.3, 1.5)), e) * 100
    slots = np.concatenate([np.arange(e), rng.integers(0, e, g * s - e)])
    gpu_exp = rng.permutation(slots).reshape(g, s).astype(np.int64)
    cnt = np.bincount(gpu_exp.ravel(), minlength=e)
    size = w / cnt
    load = size[gpu_exp].sum(axis=1)
    target = load.mean() * (1 + draw(st.floats(0.0, 0.3)))
    return w, size, gpu_exp, target


def _run(fn, size, gpu_exp, target, budget=10**6):
    g, _ = gpu_exp.shape
    e = len(size)
    exp = gpu_exp.copy()
    cur = np.zeros((g, e), dtype=np.int64)
    for k in range(g):
        for x in exp[k]:
            cur[k, x] += 1
    hold = cur.copy()
    load = size[exp].sum(axis=1)
    moves = fn(size, exp, cur, load, target, budget, hold, 0, np.zeros(e, dtype=np.int64))
    return exp, load, moves


def brute_moves(old, new):
    total = 0
    for a, b in zip(old, new, strict=True):
        ca, cb = np.bincount(a, minlength=64), np.bincount(b, minlength=64)
        total += int(np.maximum(cb - ca, 0).sum())
    return total


def fixed_count_bound(load, target):
    """``H + k`` (``inf`` when the light GPUs' room cannot hold the excess)."""
    excess = np.maximum(load - target, 0.0)
    heavy = int((excess > 1e-12 * target).sum())
    if heavy == 0:
        return 0
    room = np.cumsum(np.sort(np.maximum(target - load, 0.0))[::-1])
    k = int(np.searchsorted(room, excess.sum() * (1 - 1e-12))) + 1
    return heavy + k if k <= len(room) else np.inf


def fewest_moves(size, gpu_exp, target):
    """Exhaustive: the fewest moves of any placement of the same replicas (counts fixed) with
    every GPU at or below ``target``; ``inf`` if none."""
    g, s = gpu_exp.shape
    best = np.inf
    for perm in set(itertools.permutations(gpu_exp.ravel().tolist())):
        new = np.array(perm).reshape(g, s)
        if (size[new].sum(axis=1) <= target * (1 + 1e-12)).all():
            best = min(best, brute_moves(gpu_exp, new))
    return best


@given(states())
def test_cycles_keep_counts_and_never_raise_a_gpu_above_the_target(state):
    w, size, gpu_exp, target = state
    exp, load, moves = _run(K.cycles, size, gpu_exp, target)
    tol = 1e-12 * target
    assert np.array_equal(np.sort(exp.ravel()), np.sort(gpu_exp.ravel()))
    before = size[gpu_exp].sum(axis=1)
    assert np.allclose(load, size[exp].sum(axis=1))
    changed = (np.sort(exp, axis=1) != np.sort(gpu_exp, axis=1)).any(axis=1)
    assert (load[changed] <= target + 1e4 * tol).all()
    assert (load[before <= target + tol] <= target + 1e4 * tol).all()
    assert moves == brute_moves(gpu_exp, exp)
    for k in range(exp.shape[0]):  # a cycle never puts two replicas of an expert on a GPU
        fresh = np.bincount(exp[k], minlength=len(w)) - np.bincount(gpu_exp[k], minlength=len(w))
        assert (fresh <= 1).all()
    # the fixed-count bound holds for what the cycles reached
    if (load <= target + 1e4 * tol).all():
        assert moves >= fixed_count_bound(before, target)
    exp2, _, moves2 = _run(K.cycles.py_func, size, gpu_exp, target)
    assert moves2 == moves and np.array_equal(exp2, exp)


@given(states(max_gpus=3, max_slots=2))
def test_fixed_count_bound_against_exhaustive_search(state):
    """The bound the cycles are measured against is a lower bound on the fewest moves; the
    cycles, when they reach the target, use at least that many (and never fewer than the
    exhaustive optimum)."""
    _, size, gpu_exp, target = state
    opt = fewest_moves(size, gpu_exp, target)
    before = size[gpu_exp].sum(axis=1)
    assert fixed_count_bound(before, target) <= opt
    _, load, moves = _run(K.cycles, size, gpu_exp, target)
    if (load <= target * (1 + 1e-9)).all():
        assert moves >= opt
