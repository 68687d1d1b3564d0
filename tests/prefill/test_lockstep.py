"""The lockstep rank choice against a plain-Python oracle, and its cache-aware use in the
balancer."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.core.cost import QuadraticCost
from lbkit.prefill import Buckets, PrefillBalancer
from lbkit.prefill.lockstep import N_COEF, lockstep_rank, lockstep_scored

COST = PRESETS["h800_dsv3"].prefill


def oracle(work, request, busy, budget, growth, idle_growth, left=None):
    """The module docstring's rule, written out rank by rank."""
    engines, ranks = work.shape
    scores = []
    for e in range(engines):
        top = max(work[e])
        wait = 0.0 if left is None else left[e]
        for r in range(ranks):
            x = work[e, r] + request[e, r]
            if busy[e]:
                finish = min(max(x, top), math.ceil(x / budget) * budget)
            else:
                finish = x
            weight = growth if busy[e] else idle_growth
            scores.append(wait + finish + weight * max(0.0, x - top))
    best = min(scores)
    return scores.index(best), scores


loads = st.floats(0.0, 20.0, allow_nan=False).map(lambda v: round(v, 3))


@st.composite
def pools(draw):
    engines = draw(st.integers(1, 4))
    ranks = draw(st.integers(1, 4))
    work = np.array(draw(st.lists(loads, min_size=engines * ranks, max_size=engines * ranks)))
    work = work.reshape(engines, ranks)
    request = np.array(draw(st.lists(loads, min_size=engines * ranks, max_size=engines * ranks)))
    request = request.reshape(engines, ranks)
    budget = draw(st.sampled_from([0.25, 1.0, 2.0]))
    growth = draw(st.sampled_from([0.0, 0.6, 2.0]))
    idle_growth = draw(st.sampled_from([0.0, 0.1, 2.0]))
    left = draw(st.none() | st.lists(st.sampled_from([0.0, 0.2, 0.5, 1.0]), min_size=engines,
                                     max_size=engines).map(np.array))  # fmt: skip
    return work, request, budget, (growth, idle_growth), left


@given(pools())
def test_lockstep_rank_equals_the_oracle(case):
    work, request, budget, growth, left = case
    busy = work.max(axis=1) > 0.0
    got = lockstep_rank(
        work, request, step_budget_s=budget, growth_weight=growth[0], idle_growth_weight=growth[1],
        step_left_s=left,
    )  # fmt: skip
    want, scores = oracle(work, request, busy, budget, *growth, left)
    # equal objective; the oracle's first minimum is the lowest flat index
    assert scores[got] == pytest.approx(scores[want], abs=1e-9)
    assert got == want or scores[got] == scores[want]


@given(pools(), st.integers(1, 60_000), st.data())
def test_balancer_kernel_equals_the_pure_rule(case, total, data):
    """``lockstep_scored`` (per-slot cached tokens, cost coefficients) scores like
    ``lockstep_rank`` given the request's work per rank."""
    work, _, budget, growth, left = case
    engines, ranks = work.shape
    n = engines * ranks
    hit = np.array(data.draw(st.lists(st.integers(0, total - 1), min_size=n, max_size=n)))
    count = (work.ravel() > 0).astype(np.int64)
    coef = np.zeros(N_COEF)
    coef[:] = (COST.b, COST.k, COST.q, COST.gamma, COST.moe_s_per_token, budget, *growth)
    rem = total - hit
    request = (COST.quota(rem, hit) + COST.moe_s_per_token * rem).reshape(engines, ranks)
    # step ends per engine at time 5 (empty: no step reports)
    ends = np.zeros(0) if left is None else 5.0 + left
    k, score, cached = lockstep_scored(work.ravel(), count, 0, n, ranks, total, hit, 0, coef,
                                       ends, 5.0)  # fmt: skip
    busy = count.reshape(engines, ranks).any(axis=1)
    want, scores = oracle(work, request, busy, budget, *growth, left)
    assert score == pytest.approx(scores[want], rel=1e-12, abs=1e-12)
    assert cached == hit[k]


@given(
    st.lists(loads, min_size=2, max_size=6),
    st.integers(2, 40),
    st.integers(1, 60),
    st.sampled_from([0.0, 0.6]),
)
def test_a_rank_holding_the_prefix_wins_when_its_extra_load_is_below_the_saving(
    work, prompt_blocks, hit_blocks, growth
):
    # One rank per engine: no lockstep effect, the choice is load against recomputation.
    hit_blocks = min(hit_blocks, prompt_blocks - 1)
    total = prompt_blocks * 512
    cached = hit_blocks * 512
    work = np.array(work).reshape(-1, 1)
    own = COST.quota(total - cached, cached) + COST.moe_s_per_token * (total - cached)
    full = COST.quota(total, 0) + COST.moe_s_per_token * total
    request = np.full(work.shape, full)
    request[0, 0] = own
    saving = full - own
    extra = work[0, 0] - work[1:, 0].min()
    got = lockstep_rank(work, request, growth_weight=growth, idle_growth_weight=growth)
    if extra < saving - 1e-9:
        assert got == 0
    if extra > (1.0 + growth) * saving + 1e-9:
        assert got != 0


@settings(max_examples=40)
@given(
    st.lists(
        st.tuples(st.integers(1, 300_000), st.integers(0, 100), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([(), (16_384, 65_536)]),
)
def test_equal_caches_everywhere_choose_as_a_scalar_does(requests, edges):
    a = PrefillBalancer(3, 2, cost=COST, buckets=Buckets(edges=edges))
    b = PrefillBalancer(3, 2, cost=COST, buckets=Buckets(edges=edges))
    t = 0.0
    for i, (total, pct, finish_first) in enumerate(requests):
        cached = total * pct // 100
        da = a.route(i, total, cached, now_s=t)
        db = b.route(i, total, np.full(6, cached), now_s=t)
        assert da == db
        if finish_first and i:
            a.finish(i - 1, now_s=t)
            b.finish(i - 1, now_s=t)
        t += 0.1
    np.testing.assert_array_equal(a.rank_loads(), b.rank_loads())
    a._check()
    b._check()


def test_per_rank_cached_tokens_are_validated():
    bal = PrefillBalancer(2, 2, cost=COST)
    with pytest.raises(ValueError, match="cached_tokens"):
        bal.route("a", 100, np.zeros(3, dtype=np.int64), now_s=0.0)
    with pytest.raises(ValueError, match="cached_tokens"):
        bal.route("a", 100, np.array([0, 0, 101, 0]), now_s=0.0)
    with pytest.raises(ValueError, match="cached_tokens"):
        bal.route("a", 100, np.array([0, 0, -1, 0]), now_s=0.0)
    bal._check()
    assert bal.statistics().queued == 0


def test_the_request_takes_the_cached_tokens_of_its_rank():
    bal = PrefillBalancer(2, 2, cost=COST, buckets=Buckets(edges=()))
    d = bal.route("a", 30_000, np.array([0, 0, 0, 28_672]), now_s=0.0)
    assert (d.engine, d.rank) == (1, 1)
    # its quota is that of the 1,328 tokens it computes there
    assert bal.rank_loads()[3] == pytest.approx(COST.quota(30_000 - 28_672, 28_672))


def test_lockstep_rank_rejects_bad_input():
    with pytest.raises(ValueError, match="work_s"):
        lockstep_rank([1.0, 2.0], 0.5)
    with pytest.raises(ValueError, match="request_s"):
        lockstep_rank([[1.0, 2.0]], [0.5])
    with pytest.raises(ValueError, match="step_budget_s"):
        lockstep_rank([[1.0, 2.0]], 0.5, step_budget_s=0.0)
    with pytest.raises(ValueError, match="growth_weight"):
        lockstep_rank([[1.0, 2.0]], 0.5, growth_weight=-1.0)
    with pytest.raises(ValueError, match="idle_growth_weight"):
        lockstep_rank([[1.0, 2.0]], 0.5, idle_growth_weight=-1.0)
    with pytest.raises(TypeError, match="busy"):
        lockstep_rank([[1.0, 2.0]], 0.5, busy=[1])
    with pytest.raises(ValueError, match="step_left_s"):
        lockstep_rank([[1.0, 2.0]], 0.5, step_left_s=[0.1, 0.2])
    with pytest.raises(ValueError, match="step_left_s"):
        lockstep_rank([[1.0, 2.0]], 0.5, step_left_s=[-0.1])
    with pytest.raises(ValueError, match="step_left_s"):
        lockstep_rank([[1.0, 2.0]], 0.5, step_left_s=[np.nan])


@given(pools(), st.floats(0.0, 5.0))
def test_an_equal_wait_everywhere_changes_no_choice(case, wait):
    """Step reports only shift an engine's scores: the same time left everywhere is the rule
    without reports."""
    work, request, budget, growth, _ = case
    kw = dict(step_budget_s=budget, growth_weight=growth[0], idle_growth_weight=growth[1])
    same = np.full(work.shape[0], wait)
    assert lockstep_rank(work, request, step_left_s=same, **kw) == lockstep_rank(
        work, request, **kw
    )


def test_a_short_prompt_goes_to_the_engine_whose_step_ends_first():
    """Two busy engines, each with a long prompt on rank 0: the same score without reports
    (the lowest index wins), the engine whose running step ends first with them."""
    work = [[3.0, 0.0], [3.0, 0.0]]
    assert lockstep_rank(work, 0.1) == 1
    assert lockstep_rank(work, 0.1, step_left_s=[0.9, 0.2]) == 3
    assert lockstep_rank(work, 0.1, step_left_s=[0.2, 0.9]) == 1


def test_an_idle_engine_beats_a_busy_engines_idle_rank_for_a_short_prompt():
    # a 0.3 s prompt: one 1 s step next to a busy sibling, 0.3 s on the idle engine
    assert lockstep_rank([[5.0, 0.0], [0.0, 0.0]], 0.3, idle_growth_weight=0.0) == 2


def test_cost_without_shared_work_is_accepted():
    cost = QuadraticCost(a=0.01, b=1e-4, k=1e-9, q=5e-10)
    bal = PrefillBalancer(2, 2, cost=cost)
    assert bal.route("a", 1000, now_s=0.0).engine == 0
