"""pick_rank: every policy against a plain-Python oracle, reasons, metamorphic laws, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from lbkit.core import DecodeCost
from lbkit.decode import DEFAULT_POLICY, POLICIES, REASONS, pick_rank

from .strategies import (
    UNIT_MAX,
    feasible,
    linf_after,
    objective_increase,
    rank_states,
    score,
)

REL = 1e-9


def _minimal(values, chosen, good):
    best = min(values[r] for r in good)
    assert values[chosen] <= best + REL * max(1.0, abs(best))
    unique = [r for r in good if values[r] <= best + 1e-6 * max(1.0, abs(best))]
    if len(unique) == 1:
        assert chosen == unique[0]


@pytest.mark.parametrize("policy", list(POLICIES))
@given(state=rank_states())
def test_every_policy_places_feasibly_or_refuses_with_the_right_reason(policy, state):
    b, s, new, kw = state
    good, reason = feasible(b, s, new, kw)
    d = pick_rank(b, s, new, policy=policy, cost=UNIT_MAX, **kw)
    assert d.reason == reason and d.reason in REASONS
    if good:
        assert d.rank in good
    else:
        assert d.rank == -1


@pytest.mark.parametrize("scale", ["mean", "capacity"])
@given(state=rank_states())
def test_sum_of_squares_is_the_greedy_step_of_its_objective(scale, state):
    b, s, new, kw = state
    good, _ = feasible(b, s, new, kw)
    assume(good)
    d = pick_rank(b, s, new, policy="sum_of_squares", scale=scale, **kw)
    inc = {r: objective_increase(b, s, new, kw, r, scale) for r in good}
    _minimal(inc, d.rank, good)


@given(state=rank_states(caps=False))
def test_min_max_minimises_the_largest_normalised_load(state):
    b, s, new, kw = state
    good, _ = feasible(b, s, new, kw)
    assume(good)
    d = pick_rank(b, s, new, policy="min_max", **kw)
    after = {r: linf_after(b, s, new, kw, r) for r in good}
    _minimal(after, d.rank, good)


@pytest.mark.parametrize("combine", ["sum", "max"])
@given(state=rank_states())
def test_cost_policy_minimises_the_modelled_step_time_after_placement(combine, state):
    b, s, new, kw = state
    good, _ = feasible(b, s, new, kw)
    assume(good)
    cost = DecodeCost(a=0.005, b=0.25e-3, k=23.4e-9, combine=combine)
    d = pick_rank(b, s, new, policy="cost", cost=cost, **kw)
    t = {r: cost.step_time(b[r] + 1, s[r] + new) for r in good}
    _minimal(t, d.rank, good)


@given(state=rank_states(), cursor=st.integers(0, 7))
def test_baselines_match_their_definitions_exactly(state, cursor):
    b, s, new, kw = state
    good, _ = feasible(b, s, new, kw)
    assume(good)
    n = len(b)
    cursor %= n
    assert pick_rank(b, s, new, policy="least_requests", **kw).rank == min(
        good, key=lambda r: (b[r], r)
    )
    assert pick_rank(b, s, new, policy="least_kv", **kw).rank == min(good, key=lambda r: (s[r], r))
    assert pick_rank(b, s, new, policy="round_robin", cursor=cursor, **kw).rank == min(
        good, key=lambda r: ((r - cursor) % n, r)
    )


def test_default_rule_is_min_max_and_sum_of_squares_stays_reachable():
    assert DEFAULT_POLICY == "min_max"
    b, s = np.array([8, 2]), np.array([8000, 40000])  # rank 0: many short; rank 1: few long
    for new in (50, 20000):
        assert pick_rank(b, s, new) == pick_rank(b, s, new, policy="min_max")
    # min_max: rank 1's KV after placement (1.67 of the mean) binds above rank 0's count (1.64)
    assert pick_rank(b, s, 50).rank == 0
    # sum_of_squares: a short request goes to few requests, a long one to little KV
    assert pick_rank(b, s, 50, policy="sum_of_squares").rank == 1
    assert pick_rank(b, s, 20000, policy="sum_of_squares").rank == 0


def test_zero_means_are_defined():
    # No KV anywhere and an empty request: the KV term is dropped, counts decide.
    assert pick_rank([3, 1, 2], [0, 0, 0], 0).rank == 1
    # Everything empty: all ranks tie, the lowest index wins, for every policy.
    for name in POLICIES:
        if name != "random":
            assert pick_rank([0, 0, 0], [0, 0, 0], 0, policy=name).rank == 0


def test_random_is_reproducible_and_covers_every_feasible_rank():
    b, s = np.zeros(4, dtype=int), np.zeros(4, dtype=int)
    ok = np.array([True, False, True, True])
    got = [pick_rank(b, s, 1, policy="random", eligible=ok, rng=i).rank for i in range(60)]
    assert set(got) == {0, 2, 3}
    assert got == [pick_rank(b, s, 1, policy="random", eligible=ok, rng=i).rank for i in range(60)]


@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in ("random", "round_robin")])
@given(state=rank_states(), data=st.data())
def test_permuting_ranks_permutes_the_decision(policy, state, data):
    b, s, new, kw = state
    n = len(b)
    perm = np.array(data.draw(st.permutations(range(n))))
    pkw = {}
    for key, val in kw.items():
        pkw[key] = np.asarray(val)[perm] if np.ndim(val) else val
    d = pick_rank(b, s, new, policy=policy, cost=UNIT_MAX, **kw)
    e = pick_rank(b[perm], s[perm], new, policy=policy, cost=UNIT_MAX, **pkw)
    assert d.reason == e.reason
    if d.rank < 0:
        return
    # Ties go to the lowest index, which permuting changes: compare the policy's objective of the
    # two decisions, and the indices where the optimum is unique.
    good, _ = feasible(b, s, new, kw)
    values = {r: score(policy, b, s, new, kw, r) for r in good}
    _minimal(values, int(perm[e.rank]), good)
    _minimal(values, d.rank, good)


@given(state=rank_states(caps=False), k=st.integers(1, 6))
def test_scaling_kv_leaves_least_requests_and_the_default_unchanged(state, k):
    b, s, new, kw = state
    c = 2**k  # powers of two scale floats exactly: tie-breaks cannot move
    assert (
        pick_rank(b, s * c, new * c, policy="least_requests", **kw)
        == pick_rank(b, s, new, policy="least_requests", **kw)
    )  # fmt: skip
    assert pick_rank(b, s * c, new * c, **kw) == pick_rank(b, s, new, **kw)


@given(state=rank_states(min_ranks=2), extra=st.integers(1, 5000), data=st.data())
def test_more_load_never_attracts_work_with_capacity_normalisers(state, extra, data):
    b, s, new, kw = state
    kw = dict(kw, max_batch=16, max_kv_tokens=200000)
    d = pick_rank(b, s, new, scale="capacity", **kw)
    assume(d.rank >= 0)
    other = data.draw(st.sampled_from([r for r in range(len(b)) if r != d.rank]))
    s2 = s.copy()
    s2[other] += extra
    b2 = b.copy()
    b2[other] += data.draw(st.integers(0, 2))
    assert pick_rank(b2, s2, new, scale="capacity", **kw).rank != other


@pytest.mark.parametrize(
    ("args", "kw", "exc", "match"),
    [
        (([], [], 1), {}, ValueError, "num_requests: must not be empty"),
        (([1, -1], [0, 0], 1), {}, ValueError, "num_requests: entries must be >= 0"),
        (([1, 1], [0, -5], 1), {}, ValueError, "kv_tokens: entries must be >= 0"),
        (([1, 1], [0], 1), {}, ValueError, r"kv_tokens: must have shape \(2\)"),
        (([1, 1], [0, 0], -3), {}, ValueError, "new_kv_tokens: must be >= 0"),
        (([1, 1], [0, 0], 1.5), {}, TypeError, "new_kv_tokens: must be an integer"),
        (([1, 1], [0, 0], 1), {"policy": "best"}, ValueError, "policy: must be one of"),
        (([1, 1], [0, 0], 1), {"max_batch": -1}, ValueError, "max_batch: must be >= 0"),
        (([1, 1], [0, 0], 1), {"max_kv_tokens": [5, -1]}, ValueError, "max_kv_tokens: entries"),
        (([1, 1], [0, 0], 1), {"max_batch": [1, 2, 3]}, ValueError, r"max_batch: must have shape"),
        (([1, 1], [0, 0], 1), {"eligible": [1, 0]}, TypeError, "eligible: must be a boolean"),
        (([1, 1], [0, 0], 1), {"eligible": np.ones(3, bool)}, ValueError, "eligible: must have"),
        (([1, 1], [0, 0], 1), {"scale": "max"}, ValueError, "scale: must be one of"),
        (([1, 1], [0, 0], 1), {"cursor": 2}, ValueError, "cursor: must be <= 1"),
        (([1, 1], [0, 0], 1), {"policy": "cost", "cost": 3}, TypeError, "cost: must be"),
        (([[1, 1]], [[0, 0]], 1), {}, ValueError, "num_requests: must be 1-dimensional"),
    ],
)
def test_bad_input_names_the_argument(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        pick_rank(*args, **kw)
