"""The chunk plan against brute force over every FIFO schedule of tiny queues."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lbkit.core import PRESETS, QuadraticCost
from lbkit.prefill import plan_chunks

# Dyadic coefficients: every step time below is computed exactly in binary floating point, so
# the oracle and the plan agree on which schedules fit, to the last bit.
costs = st.builds(
    QuadraticCost,
    a=st.sampled_from([0.0, 1.0, 4.0]),
    b=st.sampled_from([0.5, 1.0, 2.0]),
    k=st.sampled_from([0.0, 1 / 64, 1 / 8]),
    q=st.sampled_from([0.0, 1 / 128, 1 / 16, 1 / 4]),
    gamma=st.sampled_from([0.0, 1 / 32]),
)


def step_time(cost, chunks, prefixes):
    total = cost.a
    for c, p in zip(chunks, prefixes, strict=True):
        total += c * (cost.b + cost.k * p + cost.q * c) + cost.gamma * p
    return total


def oracle(rem, pre, cost, budget, min_chunk, align):
    """Most tokens among FIFO schedules (all whole but the last) that fit the budget."""
    best = 0
    for k in range(1, len(rem) + 1):
        for c in range(1, rem[k - 1] + 1):
            if c < rem[k - 1] and (c < min_chunk or c % align):
                continue
            chunks = [*rem[: k - 1], c]
            if step_time(cost, chunks, pre[:k]) <= budget:
                best = max(best, sum(chunks))
    return best


queues = st.lists(st.tuples(st.integers(1, 12), st.integers(0, 40)), min_size=1, max_size=4)


@given(
    queue=queues,
    cost=costs,
    budget=st.integers(0, 160).map(lambda x: x / 4),
    min_chunk=st.integers(1, 4),
    align=st.sampled_from([1, 2, 4]),
)
def test_plan_schedules_the_most_tokens_within_budget(queue, cost, budget, min_chunk, align):
    rem = [r for r, _ in queue]
    pre = [p for _, p in queue]
    plan = plan_chunks(rem, pre, cost=cost, budget_s=budget, min_chunk=min_chunk, align=align)
    chunks = plan.chunk_tokens.tolist()
    k = len(chunks)
    assert 1 <= k <= len(rem)
    assert chunks[:-1] == rem[: k - 1]  # only the last may be partial
    assert 1 <= chunks[-1] <= rem[k - 1]
    assert plan.step_time_s == step_time(cost, chunks, pre[:k])
    best = oracle(rem, pre, cost, budget, min_chunk, align)
    if best > 0:
        assert not plan.overrun and plan.step_time_s <= budget
        assert sum(chunks) == best
        if chunks[-1] < rem[k - 1]:
            assert chunks[-1] >= min_chunk and chunks[-1] % align == 0
    else:  # progress guarantee: flagged whenever it exceeds the budget
        assert chunks == [min(min_chunk, rem[0])]
        assert plan.overrun == (plan.step_time_s > budget)
        if align == 1:  # then nothing fitting was left out, so the progress chunk overruns
            assert plan.overrun


@given(
    rem=st.lists(st.integers(1, 200_000), min_size=1, max_size=12),
    data=st.data(),
    budget=st.floats(0.0, 5.0),
)
def test_realistic_plans_never_exceed_the_budget_unless_flagged(rem, data, budget):
    cost = PRESETS["h800_dsv3"].prefill
    pre = data.draw(st.lists(st.integers(0, 300_000), min_size=len(rem), max_size=len(rem)))
    plan = plan_chunks(rem, pre, cost=cost, budget_s=budget, min_chunk=64)
    k = plan.chunk_tokens.size
    assert np.isclose(plan.step_time_s, cost.step_time(plan.chunk_tokens, pre[:k]), rtol=1e-12)
    assert plan.overrun == (plan.step_time_s > budget)
    if plan.overrun:
        assert plan.chunk_tokens.tolist() == [min(64, rem[0])]


def test_tied_cost_chunking_is_free_so_a_split_request_finishes_in_equal_work():
    cost = PRESETS["unit"].prefill
    done, prefix, work = 0, 1000, 0.0
    while done < 5000:
        plan = plan_chunks([5000 - done], [prefix + done], cost=cost, budget_s=1500.0)
        c = int(plan.chunk_tokens[0])
        work += plan.step_time_s - cost.a
        done += c
    assert np.isclose(work, cost.quota(5000, 1000), rtol=1e-12)


def test_empty_queue():
    plan = plan_chunks([], [], cost=PRESETS["unit"].prefill, budget_s=10.0)
    assert plan.chunk_tokens.size == 0 and plan.step_time_s == 0.0 and not plan.overrun


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (([0], [0]), {}, ValueError, "remaining_tokens: entries must be >= 1"),
        (([5], [-1]), {}, ValueError, "prefix_tokens: entries must be >= 0"),
        (([5, 6], [0]), {}, ValueError, "prefix_tokens: must have the length"),
        (([5.5], [0]), {}, ValueError, "remaining_tokens: must hold integers"),
        (([5], [0]), {"budget_s": -1.0}, ValueError, "budget_s: must be >= 0.0"),
        (([5], [0]), {"min_chunk": 0}, ValueError, "min_chunk: must be >= 1"),
        (([5], [0]), {"align": 0}, ValueError, "align: must be >= 1"),
        (([5], [0]), {"cost": "unit"}, TypeError, "cost: must be a QuadraticCost"),
    ],
)
def test_bad_input(args, kwargs, exc, match):
    kw = {"cost": PRESETS["unit"].prefill, "budget_s": 10.0} | kwargs
    with pytest.raises(exc, match=match):
        plan_chunks(*args, **kw)


def _exact_budget(cost, rem, pre, k, c):
    """The step time of the schedule ``rem[:k] + [c]`` summed as the plan sums it."""
    total = cost.a
    for r, p in zip([*rem[:k], c], pre[: k + 1], strict=True):
        total += r * (cost.linear_s_per_token + cost.k * p + cost.q * r) + cost.gamma * p
    return total


@given(
    queue=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 50_000)), min_size=1, max_size=3),
    data=st.data(),
    preset=st.sampled_from(["h800_dsv3", "unit"]),
)
@example(queue=[(1246, 21166), (1559, 13658), (4345, 41385)], data=None, preset="h800_dsv3")
def test_a_budget_on_a_chunk_boundary_schedules_that_chunk(queue, data, preset):
    # Budgets that sit exactly on a schedule's step time (the plan's own sum): the solver fits
    # ``budget - total``, which rounds, so the plan corrects against its running sum both ways.
    # Pinned: a budget of exactly one 510-token chunk once planned 509 tokens.
    cost = PRESETS[preset].prefill
    rem = [r for r, _ in queue]
    pre = [p for _, p in queue]
    if data is None:
        k, c = 0, 510
    else:
        k = data.draw(st.integers(0, len(rem) - 1))
        c = data.draw(st.integers(1, rem[k]))
    budget = _exact_budget(cost, rem, pre, k, c)
    plan = plan_chunks(rem, pre, cost=cost, budget_s=budget)
    assert not plan.overrun and plan.step_time_s <= budget
    assert plan.chunk_tokens.sum() >= sum(rem[:k]) + c
    below = plan_chunks(rem, pre, cost=cost, budget_s=float(np.nextafter(budget, -np.inf)))
    assert below.chunk_tokens.sum() <= plan.chunk_tokens.sum()
    assert below.overrun or below.step_time_s < budget
    if plan.chunk_tokens.sum() == sum(rem[:k]) + c and not below.overrun:
        assert below.chunk_tokens.sum() < sum(rem[:k]) + c  # that schedule no longer fits
