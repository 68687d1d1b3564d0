"""The packing kernels of the default EPLB method against plain models of their documented rules.

:func:`lbkit.eplb._packing._lpt` is checked against a direct reading of its docstring (heaviest
replica first, to the lightest GPU with room that does not hold the expert, lowest index among
equal loads, else the lightest GPU with room), including experts with more replicas than GPUs,
where a GPU must take a second replica. :func:`lbkit.eplb._packing._local_search` is checked
against the same search driven one exchange at a time, so that its step count is the number of
exchanges it made.
"""

from __future__ import annotations

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from lbkit.eplb import _packing as K


@st.composite
def lpt_cases(draw, max_gpus=5, max_slots=4, max_experts=6):
    """``(size, cnt, num_gpus, slots)`` with ``sum(cnt) == num_gpus * slots``; sizes from a small
    set so that equal loads (the tie rule) are common."""
    g = draw(st.integers(1, max_gpus))
    s = draw(st.integers(1, max_slots))
    e = draw(st.integers(1, min(max_experts, g * s)))
    cnt = np.ones(e, dtype=np.int64)
    for _ in range(g * s - e):
        cnt[draw(st.integers(0, e - 1))] += 1
    size = np.array(draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=e, max_size=e)))
    return size, cnt, g, s


def _lpt_model(size, cnt, num_gpus, slots, order):
    gpu = [[] for _ in range(num_gpus)]
    load = [0.0] * num_gpus
    for e in order:
        for _ in range(cnt[e]):
            room = [g for g in range(num_gpus) if len(gpu[g]) < slots]
            free = [g for g in room if e not in gpu[g]] or room
            g = min(free, key=lambda h: (load[h], h))
            gpu[g].append(e)
            load[g] += size[e]
    return np.array(gpu, dtype=np.int64), np.array(load)


def _run_lpt(size, cnt, num_gpus, slots):
    order = np.argsort(-size, kind="mergesort")
    gpu_exp = np.full((num_gpus, slots), -1, dtype=np.int64)
    gpu_n = np.zeros(num_gpus, dtype=np.int64)
    load = np.zeros(num_gpus)
    last = np.zeros(num_gpus, dtype=np.int64)
    K._lpt(size, cnt, num_gpus, slots, order, gpu_exp, gpu_n, load, last)
    return order, gpu_exp, load


# Two GPUs with room, both holding the expert: the lighter one (GPU 0) takes the third replica.
@example((np.array([2.0, 1.0]), np.array([3, 1]), 2, 2))
# Three GPUs with room, all holding it: the lightest of them, not the last one popped.
@example((np.array([1.0, 3.0]), np.array([4, 2]), 3, 2))
@given(lpt_cases())
def test_lpt_follows_its_documented_rule(case):
    size, cnt, num_gpus, slots = case
    order, gpu_exp, load = _run_lpt(size, cnt, num_gpus, slots)
    want_exp, want_load = _lpt_model(size, cnt, num_gpus, slots, order)
    np.testing.assert_array_equal(gpu_exp, want_exp)
    np.testing.assert_array_equal(load, want_load)


def test_lpt_gives_a_second_replica_to_the_lightest_holder():
    # Expert 0 has three replicas on two GPUs; expert 1 (lighter) one. The third replica of 0 goes
    # to GPU 0: both GPUs hold it and have room, equal loads, lowest index.
    _, gpu_exp, load = _run_lpt(np.array([2.0, 1.0]), np.array([3, 1]), 2, 2)
    np.testing.assert_array_equal(gpu_exp, [[0, 0], [0, 1]])
    np.testing.assert_array_equal(load, [4.0, 3.0])


def _exchange_count_model(size, gpu_exp, load, good_enough):
    """The local search made one exchange at a time: single swaps while one helps, then one pair
    exchange, until neither helps or the largest load is at most ``good_enough``."""
    exchanges = 0
    while True:
        while K._improve_swaps(size, gpu_exp, load, 1):
            exchanges += 1
        if load.max() <= good_enough or not K._improve_pair_swap(size, gpu_exp, load):
            return exchanges
        exchanges += 1


@st.composite
def packed_states(draw, max_gpus=4, max_slots=4, max_experts=8):
    """A valid packing (no expert twice on a GPU) with its per-replica sizes and loads."""
    g = draw(st.integers(2, max_gpus))
    s = draw(st.integers(2, max_slots))
    e = draw(st.integers(s, max_experts))
    rows = [draw(st.permutations(range(e)))[:s] for _ in range(g)]
    gpu_exp = np.array(rows, dtype=np.int64)
    size = np.array(draw(st.lists(st.integers(1, 40), min_size=e, max_size=e)), dtype=np.float64)
    load = size[gpu_exp].sum(axis=1)
    return size, gpu_exp, load


_STUCK_SIZE = np.array([70.0, 24.0, 5.0, 32.0, 79.0, 59.0, 45.0, 90.0, 22.0])
_STUCK_EXP = np.array([[3, 4, 5, 2], [6, 1, 8, 7]])


def _search_both(size, gpu_exp, load, good_enough):
    exp_a, load_a = gpu_exp.copy(), load.copy()
    steps = K._local_search(size, exp_a, load_a, 10**6, good_enough)
    exp_b, load_b = gpu_exp.copy(), load.copy()
    exchanges = _exchange_count_model(size, exp_b, load_b, good_enough)
    return steps, exp_a, load_a, exchanges, exp_b, load_b


# No single swap lowers the maximum (181); exchanging experts 5 and 2 of GPU 0 for 6 and 8 of
# GPU 1 lowers it to 178.
@example((_STUCK_SIZE, _STUCK_EXP, _STUCK_SIZE[_STUCK_EXP].sum(axis=1)))
@given(packed_states())
def test_local_search_counts_each_exchange_once(state):
    size, gpu_exp, load = state
    steps, exp_a, load_a, exchanges, exp_b, load_b = _search_both(size, gpu_exp, load, 0.0)
    assert steps == exchanges
    np.testing.assert_array_equal(exp_a, exp_b)
    np.testing.assert_array_equal(load_a, load_b)


def test_a_pair_exchange_is_one_step():
    load = _STUCK_SIZE[_STUCK_EXP].sum(axis=1)
    np.testing.assert_array_equal(load, [175.0, 181.0])
    assert K._improve_swaps(_STUCK_SIZE, _STUCK_EXP.copy(), load.copy(), 10) == 0
    steps, exp_a, load_a, *_ = _search_both(_STUCK_SIZE, _STUCK_EXP, load, 0.0)
    np.testing.assert_array_equal(load_a, [178.0, 178.0])
    assert steps == 1
    np.testing.assert_array_equal(np.sort(exp_a, axis=1), [[3, 4, 6, 8], [1, 2, 5, 7]])


def test_local_search_stops_at_good_enough():
    load = _STUCK_SIZE[_STUCK_EXP].sum(axis=1)
    steps, exp_a, _, *_ = _search_both(_STUCK_SIZE, _STUCK_EXP, load, 181.0)
    assert steps == 0
    np.testing.assert_array_equal(exp_a, _STUCK_EXP)
