"""Exact checks that pin details of the pure prefill functions the broad properties let through.

Each test below was written against a mutant of ``tools/mutate.py`` that survived the rest of the
suite: a budget just below a chunk boundary that the closed-form chunk solver overshoots, the
serving map and bottleneck of an allocation with no engine, the validation bounds of the
apportionment, and the sampling of ``pick_rank``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.prefill import METHODS, bottleneck, pick_rank, plan_chunks, serving_buckets

adams, webster = METHODS["adams"], METHODS["webster"]

H800 = PRESETS["h800_dsv3"].prefill


def _work(cost, c: int, p: int) -> float:
    # A chunk's work, in the evaluation order the plan documents (QuadraticCost.work).
    return c * (cost.linear_s_per_token + cost.k * p + cost.q * c) + cost.gamma * p


def fifo_oracle(rem, pre, cost, budget):
    """The plan by brute force: each head request takes the largest chunk that still fits the
    running sum (binary search over a work that is monotone in the chunk), whole requests first."""
    total = cost.a
    chunks = []
    for r, p in zip(rem, pre, strict=True):
        lo, hi = 0, r  # largest c in [0, r] with total + work(c) <= budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if total + _work(cost, mid, p) <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo < r:
            if lo >= 1:
                chunks.append(lo)
                total += _work(cost, lo, p)
            break
        chunks.append(r)
        total += _work(cost, r, p)
    if not chunks:
        chunks = [1]
        total = cost.a + _work(cost, 1, pre[0])
    return chunks, total


def _boundary(rem, pre, cut, c, cost=H800):
    """Step time of the whole requests before ``cut`` and ``c`` tokens of request ``cut``."""
    total = cost.a
    for i in range(cut):
        total += _work(cost, rem[i], pre[i])
    return total, total + _work(cost, c, pre[cut])


# Budgets one ulp below a chunk boundary after whole requests: ``budget - total`` rounds up,
# so the closed-form solver proposes the chunk that no longer fits, and the plan must step down.
OVERSHOOT = [
    ([1148, 2400, 1634], [11618, 44634, 40094], 1, 2216),
    ([1234, 4319, 687], [35078, 45592, 14696], 1, 3315),
    ([161, 614, 1422], [32095, 46049, 8637], 1, 505),
]


@pytest.mark.parametrize(("rem", "pre", "cut", "c"), OVERSHOOT)
def test_a_budget_one_ulp_below_a_boundary_steps_the_solved_chunk_down(rem, pre, cut, c):
    total, edge = _boundary(rem, pre, cut, c)
    budget = float(np.nextafter(edge, -np.inf))
    # The precondition that makes this case worth pinning: the solver alone overshoots.
    solved = int(replace(H800, a=0.0).solve_chunk(budget - total, pre[cut]))
    assert total + _work(H800, solved, pre[cut]) > budget
    plan = plan_chunks(rem, pre, cost=H800, budget_s=budget)
    chunks, step = fifo_oracle(rem, pre, H800, budget)
    assert plan.chunk_tokens.tolist() == chunks
    assert plan.chunk_tokens[-1] == c - 1
    assert plan.step_time_s == step <= budget
    assert not plan.overrun


@given(
    queue=st.lists(st.tuples(st.integers(1, 6000), st.integers(0, 60000)), min_size=2, max_size=4),
    data=st.data(),
)
@example(queue=[(1148, 11618), (2400, 44634), (1634, 40094)], data=None)
def test_plans_at_and_around_every_boundary_match_the_brute_force(queue, data):
    rem = [r for r, _ in queue]
    pre = [p for _, p in queue]
    if data is None:
        cut, c, side = 1, 2216, -1
    else:
        cut = data.draw(st.integers(0, len(rem) - 1), label="cut")
        c = data.draw(st.integers(1, rem[cut]), label="c")
        side = data.draw(st.sampled_from([-1, 0, 1]), label="side")
    _, edge = _boundary(rem, pre, cut, c)
    budget = float(edge if side == 0 else np.nextafter(edge, side * np.inf))
    plan = plan_chunks(rem, pre, cost=H800, budget_s=budget)
    chunks, step = fifo_oracle(rem, pre, H800, budget)
    assert plan.chunk_tokens.tolist() == chunks
    assert plan.step_time_s == step
    assert plan.overrun == (step > budget)


def test_serving_map_without_engines_is_all_minus_one():
    assert serving_buckets([0, 0, 0]).tolist() == [-1, -1, -1]
    assert serving_buckets([0, 3]).tolist() == [1, 1]


@pytest.mark.parametrize(
    ("demand", "expected"),
    [([1.0, 0.0], np.inf), ([0.5], np.inf), ([0.25, 0.25], np.inf), ([0.0, 0.0], 0.0)],
)
def test_bottleneck_without_engines(demand, expected):
    assert bottleneck(demand, [0] * len(demand)) == expected


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: serving_buckets([-1, 1]), "engines"),
        (lambda: bottleneck([1.0, 1.0], [-1, 2]), "engines"),
        (lambda: adams([1.0, 1.0], 2, max_engines=[-1, 3]), r"^max_engines: entries must be >= 0"),
        (
            lambda: webster([1.0, 1.0], 2, min_engines=[-1, 0]),
            r"^min_engines: entries must be >= 0",
        ),
    ],
)
def test_negative_engine_counts_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_first_infeasible_bucket_is_named():
    with pytest.raises(ValueError, match="bucket 0 has minimum 2 above its cap 1"):
        adams([1.0, 1.0, 1.0], 4, min_engines=[2, 3, 0], max_engines=[1, 1, 4])
    # A bucket whose minimum equals its cap comes first; the one above its cap is named.
    with pytest.raises(ValueError, match="bucket 1 has minimum 3 above its cap 1"):
        adams([1.0, 1.0, 1.0], 4, min_engines=[1, 3, 0], max_engines=[1, 1, 4])
    # A minimum equal to its cap is feasible.
    assert adams([1.0, 1.0], 2, min_engines=[1, 1], max_engines=[1, 1]).engines.tolist() == [1, 1]


def test_shared_buckets_refuse_a_zero_cap():
    # Three non-empty buckets, two engines: buckets would share, which cannot honour a zero cap.
    with pytest.raises(ValueError, match="zero caps"):
        adams([1.0, 1.0, 1.0, 1.0], 2, max_engines=[0, 2, 2, 2])


def test_shared_engines_go_only_to_buckets_with_demand():
    a = adams([0.0, 5.0, 1.0, 1.0], 2)
    assert a.engines.tolist() == [0, 1, 1, 0]
    assert a.server.tolist() == [1, 1, 2, 2]
    assert a.bottleneck == 5.0


def test_a_sample_covering_every_eligible_rank_draws_nothing():
    gen = np.random.default_rng(7)
    assert pick_rank([3.0, 1.0, 2.0], sample=3, rng=gen) == 1
    assert gen.random() == np.random.default_rng(7).random()


def test_sampled_ranks_are_distinct():
    # Two distinct ranks of three never leave only the most loaded one; with replacement, a
    # sample of the same rank twice would, for some of these seeds.
    load = [1.0, 2.0, 3.0]
    picks = {pick_rank(load, sample=2, rng=seed) for seed in range(200)}
    assert picks == {0, 1}
