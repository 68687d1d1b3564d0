"""assign_batch: brute-force oracle on tiny batches, the proven bound, order, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.decode import POLICIES, assign_batch, batch_bound, pick_rank
from lbkit.decode._reference import assign_exact, batch_objective

from .strategies import UNIT_MAX, feasible, rank_states

#: Largest ratio of the greedy's max-of-both-dimensions objective to the optimum found by a
#: targeted Hypothesis search (``hypothesis.target``, 20,000 examples, up to 4 ranks and 6
#: requests): 1.5, e.g. b0 = [0, 1], s0 = [118, 1], s = [416, 417, 950].
MEASURED_GAP = 1.5


@st.composite
def tiny(draw):
    n = draw(st.integers(2, 4))
    m = draw(st.integers(1, 6 if n <= 3 else 5))
    b0 = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    s0 = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    kv = draw(st.lists(st.integers(0, 5000), min_size=m, max_size=m))
    return np.array(b0), np.array(s0), np.array(kv)


@given(case=tiny())
def test_greedy_is_within_the_proven_and_the_measured_bound_of_the_optimum(case):
    b0, s0, kv = case
    out = assign_batch(b0, s0, kv)
    value = batch_objective(out.num_requests, out.kv_tokens)
    exact = assign_exact(b0, s0, kv)
    assert exact.value <= value + 1e-12  # the oracle is optimal
    assert value <= batch_bound(b0, s0, kv) + 1e-9  # proven (docs/decode.md)
    assert value <= MEASURED_GAP * exact.value + 1e-9  # measured
    # The oracle's own assignment reproduces its value.
    b = b0 + np.bincount(exact.ranks, minlength=b0.size)
    s = s0 + np.bincount(exact.ranks, weights=kv, minlength=b0.size).astype(int)
    assert batch_objective(b, s) == pytest.approx(exact.value)


@given(case=tiny())
def test_sum_of_squares_objective_is_near_its_optimum(case):
    b0, s0, kv = case
    out = assign_batch(b0, s0, kv, policy="sum_of_squares")
    value = batch_objective(out.num_requests, out.kv_tokens, objective="sum_of_squares")
    best = assign_exact(b0, s0, kv, objective="sum_of_squares").value
    assert best <= value + 1e-9
    assert value <= 1.25 * best + 1e-9  # measured worst 1.16 on 1,500 random tiny batches


def test_longest_first_beats_the_given_order_on_average():
    rng = np.random.default_rng(5)
    given_, longest = [], []
    for _ in range(200):
        n = 3
        kv = rng.lognormal(7, 1.2, 6).astype(int)
        b0, s0 = rng.integers(0, 3, n), rng.integers(0, 4000, n)
        opt = assign_exact(b0, s0, kv).value
        for order, acc in (("given", given_), ("longest_first", longest)):
            out = assign_batch(b0, s0, kv, order=order)
            acc.append(batch_objective(out.num_requests, out.kv_tokens) / opt)
    assert np.mean(longest) < np.mean(given_)
    assert np.mean(longest) < 1.08  # 1.06 with this seed


@pytest.mark.parametrize("policy", ["least_requests", "least_kv", "round_robin"])
@given(state=rank_states(), kv=st.lists(st.integers(0, 30000), max_size=10))
def test_normaliser_free_policies_equal_one_pick_rank_after_another(policy, state, kv):
    b, s, _, kw = state
    out = assign_batch(b, s, kv, policy=policy, order="given", **kw)
    b, s, cursor = b.copy(), s.copy(), 0
    for i, x in enumerate(kv):
        d = pick_rank(b, s, x, policy=policy, cursor=cursor, **kw)
        assert (out.ranks[i], out.reasons[i]) == d
        if d.rank >= 0:
            b[d.rank] += 1
            s[d.rank] += x
            cursor = (d.rank + 1) % len(b)
    assert out.num_requests.tolist() == b.tolist() and out.kv_tokens.tolist() == s.tolist()
    assert out.cursor == cursor


@pytest.mark.parametrize("policy", list(POLICIES))
@given(state=rank_states(), kv=st.lists(st.integers(0, 30000), max_size=10))
def test_every_request_is_placed_feasibly_or_refused_and_the_state_adds_up(policy, state, kv):
    b, s, _, kw = state
    out = assign_batch(b, s, kv, policy=policy, cost=UNIT_MAX, rng=3, **kw)
    assert len(out.ranks) == len(out.reasons) == len(kv)
    placed = out.ranks >= 0
    assert all((r == "placed") == p for r, p in zip(out.reasons, placed, strict=True))
    assert out.num_requests.sum() == b.sum() + placed.sum()
    assert out.kv_tokens.sum() == s.sum() + np.asarray(kv, dtype=int)[placed].sum()
    # Replaying the placements in the longest-first order, each was feasible then and each
    # refusal had its reason.
    cur_b, cur_s = b.copy(), s.copy()
    for i in np.argsort(-np.asarray(kv, dtype=int), kind="stable"):
        good, reason = feasible(cur_b, cur_s, kv[i], kw)
        assert out.reasons[i] == reason
        if out.ranks[i] >= 0:
            assert out.ranks[i] in good
            cur_b[out.ranks[i]] += 1
            cur_s[out.ranks[i]] += kv[i]


def test_worked_example():
    out = assign_batch([0, 0], [0, 0], [100, 9000, 200, 8000, 300])
    assert out.ranks.tolist() == [1, 0, 0, 1, 1]
    assert out.reasons == ("placed",) * 5


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"new": [5, -1]}, ValueError, "new_kv_tokens: entries must be >= 0"),
        ({"new": [[5]]}, ValueError, "new_kv_tokens: must be 1-dimensional"),
        ({"order": "shortest_first"}, ValueError, "order: must be one of"),
        ({"policy": "nope"}, ValueError, "policy: must be one of"),
        ({"b": []}, ValueError, "num_requests: must not be empty"),
        ({"max_batch": -2}, ValueError, "max_batch: must be >= 0"),
    ],
)
def test_bad_input_names_the_argument(kw, exc, match):
    b, s, new = kw.pop("b", [0, 0]), [0, 0], kw.pop("new", [5])
    if not b:
        s = []
    with pytest.raises(exc, match=match):
        assign_batch(b, s, new, **kw)
