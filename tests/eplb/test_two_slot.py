"""Two slots per GPU: the sorted-pairing kernels, the exact MILP oracle against exhaustive
enumeration and CP-SAT, and the default and the lower bound against that oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.eplb import _primitives, _two_slot, lower_bound, moe_lb, rebalance_experts
from lbkit.eplb._reference import (
    optimal_two_slot,
    pairing_max_load,
    two_slot_feasible,
    two_slot_optimum,
)

from .strategies import loads


@st.composite
def two_slot_cases(draw, max_experts: int = 9, max_gpus: int = 7):
    """``(w, num_gpus)`` with ``experts <= 2 * num_gpus``."""
    experts = draw(st.integers(2, max_experts))
    gpus = draw(st.integers(max(1, -(-experts // 2)), max(max_gpus, -(-experts // 2))))
    w = draw(loads(1, experts))[0]
    return w, gpus


@st.composite
def counts_cases(draw):
    """Loads and replica counts (each >= 1) summing to an even number."""
    w, gpus = draw(two_slot_cases(max_experts=12, max_gpus=10))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cnt = np.ones(len(w), dtype=np.int64)
    for e in rng.integers(0, len(w), 2 * gpus - len(w)):
        cnt[e] += 1
    return w, gpus, cnt


@given(case=counts_cases())
def test_pair_walk_and_pair_out_are_the_sorted_pairing(case):
    w, gpus, cnt = case
    size = w / cnt
    order = np.argsort(-size, kind="mergesort")
    top, ntop, _ = _two_slot._pair_walk(size, cnt, order, gpus, np.inf, np.zeros(0, dtype=bool))
    items = np.sort(np.repeat(size, cnt))
    sums = items[:gpus] + items[::-1][:gpus]
    assert top == pytest.approx(sums.max(), rel=1e-12, abs=0)
    assert ntop == (sums >= top * (1 - 1e-12)).sum()
    exp = np.empty((gpus, 2), dtype=np.int64)
    _two_slot._pair_out(cnt, order, gpus, exp)
    assert (np.bincount(exp.ravel(), minlength=len(w)) == cnt).all()
    assert size[exp].sum(axis=1).max() == pytest.approx(top, rel=1e-12, abs=0)


@given(case=two_slot_cases())
@settings(deadline=None)
def test_optimal_two_slot_matches_enumeration(case):
    """The MILP bisection finds the optimum of exhaustive enumeration over count vectors."""
    w, gpus = case
    best, low, counts, proven = optimal_two_slot(w, num_gpus=gpus)
    assert proven
    assert counts.sum() == 2 * gpus and (counts >= 1).all()
    assert pairing_max_load(w, counts) == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert low <= best
    exact = two_slot_optimum(w, gpus, None)
    assert best == pytest.approx(exact, rel=1e-8, abs=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_two_slot_feasible_agrees_with_cp_sat(seed):
    """At the optimum CP-SAT finds a plan and the MILP test passes; just below, both refuse."""
    pytest.importorskip("ortools")
    from lbkit.eplb._reference import optimal_max_load

    rng = np.random.default_rng(seed)
    experts, gpus = int(rng.integers(4, 8)), int(rng.integers(4, 6))
    w = rng.lognormal(0, 1.2, experts) * 100
    best, _, _, proven = optimal_two_slot(w, num_gpus=gpus)
    assert proven
    for t, ok in ((best * (1 + 1e-7), True), (best * (1 - 1e-6), False)):
        value, cp_proven = optimal_max_load(w, num_gpus=gpus, slots=2, max_load=t, time_limit_s=120)
        assert cp_proven and (value < float("inf")) == ok
        found, milp_proven = two_slot_feasible(w, num_gpus=gpus, max_load=t)
        assert milp_proven and (found is not None) == ok
        if ok:
            assert pairing_max_load(w, found) <= t


def test_two_slot_feasible_rejects_bad_max_load():
    with pytest.raises(ValueError, match="max_load: must be finite"):
        two_slot_feasible([1.0, 2.0], num_gpus=1, max_load=float("nan"))


@pytest.mark.jit_parity(kernels=(_two_slot.solve_two_slot,))
@given(case=two_slot_cases(max_experts=40, max_gpus=24))
@settings(max_examples=20, deadline=None)
def test_solve_two_slot_jit_parity_and_validity(case):
    w, gpus = case
    outs = []
    for fn in (_two_slot.solve_two_slot, _two_slot.solve_two_slot.py_func):
        cnt = np.empty(len(w), dtype=np.int64)
        exp = np.empty((gpus, 2), dtype=np.int64)
        v = fn(w, gpus, 1e-3, 0.0, cnt, exp)
        outs.append((v, cnt, exp))
    (v, cnt, exp), (v2, cnt2, exp2) = outs
    assert v == v2 and np.array_equal(cnt, cnt2) and np.array_equal(exp, exp2)
    assert cnt.sum() == 2 * gpus and (cnt >= 1).all()
    assert (np.bincount(exp.ravel(), minlength=len(w)) == cnt).all()
    # Never worse than the sorted pairing of the apportionment it starts from.
    start = np.empty(len(w), dtype=np.int64)
    _primitives.apportion_minmax(w, 2 * gpus, start)
    assert v <= pairing_max_load(w, start) * (1 + 1e-12) + 1e-12


@pytest.mark.parametrize("seed", range(2))
def test_default_and_bound_against_the_exact_optimum_beyond_the_exact_search(seed):
    """48 to 64 replicas (past the exact search's 32): the bound never exceeds the MILP
    optimum, the default never beats it and is within 1% of it on average."""
    rng = np.random.default_rng(seed)
    gaps = []
    for experts, gpus in [(40, 24), (48, 28), (56, 32)]:
        for sigma in (0.5, 1.0, 1.5):
            w = rng.lognormal(0, sigma, (1, experts)) * 100
            plan = rebalance_experts(w, 2 * gpus, 1, 1, gpus, policy="global")
            mean = w.sum() / gpus
            ours = moe_lb(w, plan.phy2log, num_gpus=gpus)[0]
            lb = lower_bound(w, 2 * gpus, 1, 1, gpus, policy="global")[0]
            best, low, _, proven = optimal_two_slot(
                w[0], num_gpus=gpus, upper_counts=plan.logcnt[0], lower_bound=lb * mean
            )
            assert proven
            assert lb <= low / mean * (1 + 1e-9)
            assert ours >= best / mean * (1 - 1e-9)
            gaps.append(ours * mean / best - 1)
    assert np.mean(gaps) <= 0.01


@given(case=counts_cases())
def test_ballot_violation_is_halls_condition_for_the_sorted_pairing(case):
    """No violation at the pairing's largest load; one just below it."""
    w, _, cnt = case
    top = pairing_max_load(w, cnt)
    size = w / cnt
    order = np.argsort(-size, kind="mergesort")
    assert _two_slot._ballot_violation(size, cnt, order, top * (1 + 1e-12)) == -1
    if top > 0:
        assert _two_slot._ballot_violation(size, cnt, order, top * (1 - 1e-6)) >= 0


@given(case=two_slot_cases(max_experts=30, max_gpus=20), frac=st.floats(0.9, 1.2))
@settings(deadline=None)
def test_ballot_counts_meet_their_cap_when_they_claim_to(case, frac):
    w, gpus = case
    start = np.empty(len(w), dtype=np.int64)
    _primitives.apportion_minmax(w, 2 * gpus, start)
    cap = pairing_max_load(w, start) * frac
    cnt = np.empty(len(w), dtype=np.int64)
    for fn in (_two_slot._ballot_counts, _two_slot._ballot_counts.py_func):
        ok = fn(w, gpus, cap, cnt)
        if ok:
            assert cnt.sum() == 2 * gpus and (cnt >= 1).all()
            assert pairing_max_load(w, cnt) <= cap * (1 + 1e-9) + 1e-12
    if frac >= 1:  # the apportionment itself passes, but the heuristic need not find it
        assert _two_slot._ballot_counts(w, gpus, cap * 1e3, cnt)
