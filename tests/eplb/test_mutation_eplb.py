"""Exact checks of the EPLB bound and planners that the broad properties let through.

Written against mutants of ``tools/mutate.py`` that survived the rest of the suite: the bound
of a layer without load, the bound's invariance to the unit of the loads (small loads, mean
below one), and the re-planning primitives against plain models (moves counted from per-GPU
holdings, the change in moves of a swap or a count change, the sorted candidate lists).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.eplb import _primitives as P
from lbkit.eplb import lower_bound

HOT = [100.0, 1.0, 1.0, 1.0, 1.0]  # one hot expert, 6 slots on 3 GPUs (the docstring example)


def test_a_layer_without_load_has_bound_one_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = lower_bound([[0.0] * 5, HOT], 6, 1, 1, 3)
    assert out[0] == 1.0
    assert out[1] == pytest.approx(1.4711, abs=1e-4)


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 0.5, 1.0, 7.0, 1e6])
def test_the_bound_does_not_depend_on_the_unit_of_the_loads(scale):
    ref = lower_bound([HOT], 6, 1, 1, 3)
    assert lower_bound([np.asarray(HOT) * scale], 6, 1, 1, 3) == pytest.approx(ref, rel=1e-12)


# ---- the re-planning primitives (lbkit.eplb._primitives) against plain models ----------------


@st.composite
def packings(draw, max_gpus=4, max_slots=3, max_experts=5):
    g = draw(st.integers(1, max_gpus))
    s = draw(st.integers(1, max_slots))
    e = draw(st.integers(1, max_experts))
    cells = st.lists(st.integers(0, e - 1), min_size=g * s, max_size=g * s)
    new = np.array(draw(cells), dtype=np.int64).reshape(g, s)
    old = np.array(draw(cells), dtype=np.int64).reshape(g, s)
    return new, old, e


def _hold(gpu_exp, experts):
    out = np.zeros((gpu_exp.shape[0], experts), dtype=np.int64)
    for g, row in enumerate(gpu_exp):
        for e in row:
            out[g, e] += 1
    return out


def _moves(hold, gpu_exp, experts):
    return int(np.maximum(_hold(gpu_exp, experts) - hold, 0).sum())


@given(packings())
def test_count_moves_and_holders_match_plain_counting(case):
    new, old, experts = case
    hold = _hold(old, experts)
    scratch = np.zeros(experts, dtype=np.int64)
    assert P.count_moves(hold, new, scratch) == _moves(hold, new, experts)
    assert not scratch.any()  # zeroed again on return
    start = np.zeros(experts + 1, dtype=np.int64)
    gpus = np.zeros(new.size, dtype=np.int64)
    P.holders(new, experts, start, gpus)
    for e in range(experts):
        want = [g for g in range(new.shape[0]) for x in new[g] if x == e]
        assert gpus[start[e] : start[e + 1]].tolist() == want


@given(packings(), st.data())
def test_swap_and_replace_costs_are_the_change_in_moves(case, data):
    new, old, experts = case
    hold = _hold(old, experts)
    g_count, slots = new.shape
    h, k = data.draw(st.integers(0, g_count - 1)), data.draw(st.integers(0, g_count - 1))
    i, j = data.draw(st.integers(0, slots - 1)), data.draw(st.integers(0, slots - 1))
    cur = _hold(new, experts)
    before = _moves(hold, new, experts)
    a, b = int(new[h, i]), int(new[k, j])
    if h != k:
        cost = P.swap_cost(cur, hold, h, a, k, b)
        swapped = new.copy()
        P.apply_swap(swapped, cur, h, i, k, j)
        assert swapped[h, i] == b and swapped[k, j] == a
        assert np.array_equal(cur, _hold(swapped, experts))
        assert _moves(hold, swapped, experts) - before == (cost if a != b else 0)
    e = data.draw(st.integers(0, experts - 1))
    cur = _hold(new, experts)
    cnt = np.bincount(new.ravel(), minlength=experts).astype(np.int64)
    cost = P.replace_cost(cur, hold, h, a, e)
    replaced = new.copy()
    P.apply_replace(replaced, cur, cnt, h, i, e)
    assert replaced[h, i] == e
    assert np.array_equal(cur, _hold(replaced, experts))
    assert np.array_equal(cnt, np.bincount(replaced.ravel(), minlength=experts))
    assert _moves(hold, replaced, experts) - before == (cost if a != e else 0)


@given(st.lists(st.floats(0, 10), min_size=1, max_size=8))
def test_argmax_takes_the_lowest_index_among_equals(loads):
    x = np.array(loads)
    assert P.argmax(x) == int(np.flatnonzero(x == x.max())[0])
    assert P.excess(5.0, 3.0) == 2.0 and P.excess(3.0, 3.0) == 0.0 and P.excess(1.0, 3.0) == 0.0


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), max_size=10), st.integers(1, 5))
def test_insert_sorted_keeps_the_cap_smallest_keys_stably(items, cap):
    lst = np.zeros(cap, dtype=np.int64)
    keys = np.zeros(cap)
    n = 0
    model: list[tuple[float, int]] = []  # (key, expert) in insertion order, stable by key
    for e, key in items:
        n = P.insert_sorted(lst, n, cap, e, float(key), keys)
        if e not in [x for _, x in model]:
            pos = len([1 for k, _ in model if k <= key])
            if pos < cap:
                model.insert(pos, (float(key), e))
                model = model[:cap]
        assert n == len(model)
        assert lst[:n].tolist() == [x for _, x in model]
        assert keys[:n].tolist() == [k for k, _ in model]


@given(packings())
def test_loads_and_duplicates_of_a_packing(case):
    new, _, experts = case
    size = np.arange(1.0, experts + 1)
    load = np.zeros(new.shape[0])
    P.recompute_loads(size, new, load)
    assert np.array_equal(load, size[new].sum(axis=1))
    holes = new.copy()
    holes[:, 0] = -1
    P.gpu_loads(size, holes, load)
    assert np.allclose(load, np.where(holes >= 0, size[np.maximum(holes, 0)], 0.0).sum(axis=1))
    dup = sum(len(row) - len(set(row.tolist())) for row in new)
    assert P.count_duplicates(new) == dup
    for g in range(new.shape[0]):
        for e in range(experts):
            for skip in range(-1, new.shape[1]):
                want = any(new[g, i] == e for i in range(new.shape[1]) if i != skip)
                assert P.holds(new, g, e, skip) == want


def test_repair_swaps_a_duplicate_with_the_closest_replica_on_gpu_zero():
    gpu_exp = np.array([[1, 2], [0, 0]])  # GPU 1 holds expert 0 twice; GPU 0 is the only partner
    size = np.array([3.0, 2.0, 1.0])
    load = size[gpu_exp].sum(axis=1)
    P.repair_duplicates(size, gpu_exp, load, 6.0)
    assert gpu_exp.tolist() == [[0, 2], [1, 0]]  # expert 1 is closest in size to expert 0
    assert P.count_duplicates(gpu_exp) == 0
    assert np.array_equal(load, size[gpu_exp].sum(axis=1))
