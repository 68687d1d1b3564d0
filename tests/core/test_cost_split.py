"""Local/shared split of the step cost: the old model as a special case, quota, engine steps
against a brute-force oracle, fitting the split, and validation."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.core import PRESETS, DecodeCost, QuadraticCost

H800 = PRESETS["h800_dsv3"]

old_costs = st.builds(
    QuadraticCost,
    a=st.floats(0, 10),
    b=st.floats(1e-3, 5),
    k=st.floats(0, 1e-2),
    q=st.floats(0, 1e-2),
    gamma=st.floats(0, 1e-2),
)
split_costs = st.builds(
    QuadraticCost,
    a=st.floats(0, 10),
    b=st.floats(0, 5),
    k=st.floats(0, 1e-2),
    q=st.floats(1e-4, 1e-2),
    gamma=st.floats(0, 1e-2),
    b_moe=st.floats(0, 5),
    moe_lb=st.floats(1, 2),
)
decode_costs = st.builds(
    DecodeCost,
    a=st.floats(0, 10),
    b=st.floats(0, 5),
    k=st.floats(0, 1e-2),
    combine=st.sampled_from(["sum", "max"]),
    b_moe=st.floats(0, 5),
    moe_lb=st.floats(1, 2),
)
chunks = st.lists(st.integers(0, 3000), min_size=1, max_size=6)


def rank_time_oracle(cost: QuadraticCost, chunk: list[list[int]], prefix: list[list[int]]):
    """Plain-Python ``T_r = a + sum_i local(c, p) + b_moe * moe_lb * sum(all c) / R``."""
    total = sum(sum(row) for row in chunk)
    shared = cost.b_moe * cost.moe_lb * total / len(chunk)
    out = []
    for cs, ps in zip(chunk, prefix, strict=True):
        local = 0.0
        for c, p in zip(cs, ps, strict=True):
            if c > 0:
                local += b_local(cost, c, p)
        out.append(cost.a + local + shared)
    return out


def b_local(cost: QuadraticCost, c: int, p: int) -> float:
    return cost.b * c + cost.k * c * p + cost.q * c * c + cost.gamma * p


@given(old=old_costs, c=chunks, p=st.integers(0, 10**5), budget=st.floats(0, 1e4))
def test_zero_b_moe_is_the_old_model(old, c, p, budget):
    """``b_moe = 0`` (any ``moe_lb``) reproduces every number of the old model exactly."""
    for lb in (1.0, 1.7):
        new = replace(old, b_moe=0.0, moe_lb=lb)
        assert new.moe_s_per_token == 0.0 and new.linear_s_per_token == old.b
        assert new.tied == old.tied
        np.testing.assert_array_equal(new.work(c, p), old.work(c, p))
        np.testing.assert_array_equal(new.quota(c, p), old.quota(c, p))
        np.testing.assert_array_equal(new.predict(c, p), old.a + np.asarray(old.work(c, p)))
        assert new.step_time(c, p) == old.step_time(c, p)
        assert new.solve_chunk(budget, p) == old.solve_chunk(budget, p)
        # An engine step with no shared cost is the slowest rank's own step.
        assert new.engine_step_s(c, p) == max(old.predict(ci, p) for ci in c)


@given(old=old_costs, c=chunks, p=st.integers(0, 10**5))
def test_positional_old_calls_keep_their_meaning(old, c, p):
    four = QuadraticCost(old.a, old.b, old.k, old.q)
    five = QuadraticCost(old.a, old.b, old.k, old.q, old.gamma)
    assert (four.gamma, four.b_moe, four.moe_lb) == (0.0, 0.0, 1.0)
    assert five == replace(old, b_moe=0.0, moe_lb=1.0) == old
    np.testing.assert_array_equal(five.predict(c, p), old.predict(c, p))


@given(
    old=st.builds(DecodeCost, a=st.floats(0, 10), b=st.floats(0, 5), k=st.floats(0, 1e-2)),
    combine=st.sampled_from(["sum", "max"]),
    n=st.lists(st.integers(0, 200), min_size=1, max_size=8),
    s=st.integers(0, 10**6),
)
def test_zero_b_moe_is_the_old_decode_model(old, combine, n, s):
    old = old.with_combine(combine)
    new = DecodeCost(old.a, old.b, old.k, combine, 0.0, 1.3)
    np.testing.assert_array_equal(new.step_time(n, s), old.step_time(n, s))
    local = (
        old.b * np.array(n) + old.k * s
        if combine == "sum"
        else np.maximum(old.b * np.array(n), old.k * s)
    )
    np.testing.assert_array_equal(new.rank_step_s(n, s), old.a + local)
    assert new.engine_step_s(n, s) == float(np.max(old.step_time(n, s)))


@given(cost=split_costs, c=chunks, p=st.integers(0, 10**5))
def test_quota_excludes_shared_work(cost, c, p):
    local = [b_local(cost, ci, p) if ci > 0 else 0.0 for ci in c]
    np.testing.assert_allclose(cost.quota(c, p), local, rtol=1e-12, atol=0)
    np.testing.assert_allclose(
        cost.predict(c, p),
        cost.a + np.array(local) + cost.b_moe * cost.moe_lb * np.array(c),
        rtol=1e-12,
    )
    # Raising the routed-expert cost moves no quota.
    more = replace(cost, b_moe=cost.b_moe + 1.0)
    np.testing.assert_array_equal(more.quota(c, p), cost.quota(c, p))


@given(
    cost=split_costs,
    pieces=st.lists(st.integers(1, 2000), min_size=1, max_size=5),
    prefix=st.integers(0, 50_000),
)
def test_tied_quota_is_chunking_independent_with_shared_cost(cost, pieces, prefix):
    cost = replace(cost, q=cost.k / 2.0 + 1e-4, k=2 * (cost.k / 2.0 + 1e-4), gamma=0.0)
    assert cost.tied
    done, work = 0, 0.0
    for c in pieces:
        work += cost.work(c, prefix + done)
        done += c
    assert math.isclose(work, cost.quota(done, prefix), rel_tol=1e-9)


@given(
    cost=split_costs,
    data=st.data(),
    ranks=st.integers(1, 6),
    slots=st.integers(1, 3),
)
def test_engine_step_matches_brute_force_over_ranks(cost, data, ranks, slots):
    cells = st.lists(st.integers(0, 4000), min_size=slots, max_size=slots)
    c = data.draw(st.lists(cells, min_size=ranks, max_size=ranks))
    p = data.draw(
        st.lists(
            st.lists(st.integers(0, 10**5), min_size=slots, max_size=slots),
            min_size=ranks,
            max_size=ranks,
        )
    )
    oracle = rank_time_oracle(cost, c, p)
    np.testing.assert_allclose(cost.rank_step_s(c, p), oracle, rtol=1e-12)
    assert math.isclose(cost.engine_step_s(c, p), max(oracle), rel_tol=1e-12)
    if slots == 1:  # one chunk per rank: the 1-D form gives the same step
        flat_c, flat_p = [row[0] for row in c], [row[0] for row in p]
        assert cost.engine_step_s(flat_c, flat_p) == cost.engine_step_s(c, p)
    total = sum(map(sum, c))
    assert math.isclose(
        cost.shared_s(total, ranks), cost.b_moe * cost.moe_lb * total / ranks, rel_tol=1e-12
    )


@given(cost=split_costs, c=st.integers(0, 4000), p=st.integers(0, 10**5), ranks=st.integers(1, 8))
def test_balanced_engine_step_is_the_planned_step(cost, c, p, ranks):
    """A balanced engine steps exactly as predict / solve_chunk plan it."""
    assert math.isclose(cost.engine_step_s([c] * ranks, p), cost.predict(c, p), rel_tol=1e-12)
    budget = float(cost.predict(c, p))
    chunk = cost.solve_chunk(budget, p)
    assert chunk >= c
    assert cost.predict(chunk, p) <= budget < cost.predict(chunk + 1, p)


@given(cost=decode_costs, data=st.data(), ranks=st.integers(1, 8))
def test_decode_engine_step_matches_brute_force(cost, data, ranks):
    n = data.draw(st.lists(st.integers(0, 200), min_size=ranks, max_size=ranks))
    s = data.draw(st.lists(st.integers(0, 10**6), min_size=ranks, max_size=ranks))
    shared = cost.b_moe * cost.moe_lb * sum(n) / ranks
    oracle = []
    for b, kv in zip(n, s, strict=True):
        if cost.combine == "sum":
            local = cost.b * b + cost.k * kv
        else:
            local = max(cost.b * b, cost.k * kv)
        oracle.append(cost.a + local + shared)
    np.testing.assert_allclose(cost.rank_step_s(n, s), oracle, rtol=1e-12)
    assert math.isclose(cost.engine_step_s(n, s), max(oracle), rel_tol=1e-12)
    # step_time is the balanced engine's rank: every rank as loaded as this one.
    for b, kv in zip(n, s, strict=True):
        assert math.isclose(
            cost.step_time(b, kv), cost.engine_step_s([b] * ranks, [kv] * ranks), rel_tol=1e-12
        )
    assert cost.with_combine("max").b_moe == cost.b_moe
    assert cost.with_combine("sum").moe_lb == cost.moe_lb


def engine_samples(truth: QuadraticCost, seed: int, n: int = 120, ranks: int = 8):
    """Steps of one rank of an imbalanced engine: its chunk, prefix, the engine's tokens, time."""
    rng = np.random.default_rng(seed)
    c = np.round(np.exp(rng.uniform(np.log(16), np.log(8192), n)))
    p = np.round(np.exp(rng.uniform(0, np.log(65536), n))) * (rng.random(n) < 0.7)
    others = rng.integers(0, 8192, (n, ranks - 1)).sum(axis=1)
    engine = c + others
    t = truth.a + np.asarray(truth.work(c, p)) + truth.shared_s(engine, ranks)
    return c, p, engine, t


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("moe_lb", [1.0, 1.03, 1.4])
def test_fit_recovers_the_split_exactly_from_noiseless_samples(seed, moe_lb):
    truth = QuadraticCost(a=0.01, b=62.4e-6, k=11.1e-9, q=5.55e-9, b_moe=81.1e-6, moe_lb=moe_lb)
    c, p, engine, t = engine_samples(truth, seed)
    fit = QuadraticCost.fit(c, p, t, engine_tokens=engine, num_ranks=8, moe_lb=moe_lb)
    for name in ("a", "b", "k", "q", "b_moe", "moe_lb"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert fit.rel_rmse < 1e-9 and fit.num_samples == c.shape[0]
    # Per-sample rank counts give the same fit.
    per_sample = QuadraticCost.fit(
        c, p, t, engine_tokens=engine, num_ranks=np.full(c.shape, 8), moe_lb=moe_lb
    )
    assert per_sample.cost.b_moe == pytest.approx(truth.b_moe, rel=1e-6)


def test_fit_split_with_gamma_and_untied():
    truth = QuadraticCost(a=0.5, b=1.0, k=0.002, q=0.0003, gamma=0.0004, b_moe=2.0, moe_lb=1.1)
    c, p, engine, t = engine_samples(truth, seed=3, n=200, ranks=4)
    fit = QuadraticCost.fit(
        c, p, t, tied=False, fit_gamma=True, engine_tokens=engine, num_ranks=4, moe_lb=1.1
    )
    for name in ("a", "b", "k", "q", "gamma", "b_moe"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_fit_rejects_a_degenerate_engine_column():
    truth = H800.prefill
    c, p, _, _ = engine_samples(truth, seed=0)
    balanced = 8 * c  # every rank ran as many tokens as this one: engine/R == chunk
    t = np.asarray(truth.predict(c, p))
    with pytest.raises(ValueError, match="engine_tokens: .* cannot be told apart; add steps"):
        QuadraticCost.fit(c, p, t, engine_tokens=balanced, num_ranks=8)
    # A constant engine load is collinear with the fixed cost.
    const = np.full(c.shape, 70_000.0)
    with pytest.raises(ValueError, match="linear combination of the other columns"):
        QuadraticCost.fit(c, p, t, engine_tokens=const, num_ranks=8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"engine_tokens": [8, 16, 24, 32]}, "num_ranks: required with engine_tokens"),
        ({"num_ranks": 8}, "num_ranks: only meaningful together with engine_tokens"),
        ({"engine_tokens": [8, 16, 24], "num_ranks": 8}, "engine_tokens: must have one value"),
        ({"engine_tokens": [8, 16, 24, 1], "num_ranks": 8}, "engine_tokens >= chunk_tokens"),
        ({"engine_tokens": [8, 16, 24, 32], "num_ranks": 0}, "num_ranks: must be whole"),
        ({"engine_tokens": [8, 16, 24, 32], "num_ranks": [8, 8]}, "num_ranks: must be an int"),
        ({"engine_tokens": [8, 16, 24, 32], "num_ranks": 8, "moe_lb": 0.9}, "moe_lb: must be >="),
    ],
)
def test_fit_split_validates_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuadraticCost.fit([1, 2, 3, 4], [0, 5, 0, 9], [1.0, 2.0, 3.0, 4.5], **kwargs)


def test_fit_split_refuses_fewer_samples_than_parameters():
    with pytest.raises(ValueError, match="need at least 4 samples to fit a, b, k, b_moe, got 3"):
        QuadraticCost.fit(
            [1, 2, 3], [0, 1, 2], [1.0, 2.0, 3.0], engine_tokens=[8, 9, 30], num_ranks=8
        )


@pytest.mark.parametrize("cls", ["prefill", "decode"])
@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("b_moe", -1e-6, ValueError, "b_moe: must be >= 0.0"),
        ("b_moe", float("inf"), ValueError, "b_moe: must be finite"),
        ("b_moe", float("nan"), ValueError, "b_moe: must not be NaN"),
        ("moe_lb", 0.99, ValueError, "moe_lb: must be >= 1.0"),
        ("moe_lb", float("inf"), ValueError, "moe_lb: must be finite"),
        ("moe_lb", "1.05", TypeError, "moe_lb: must be a real number"),
    ],
)
def test_shared_fields_are_validated(cls, field, value, error, match):
    base = H800.prefill if cls == "prefill" else H800.decode
    with pytest.raises(error, match=match):
        replace(base, **{field: value})


def test_only_shared_cost_is_a_valid_prefill_model():
    cost = QuadraticCost(a=0.0, b=0.0, k=0.0, q=0.0, b_moe=1.0)
    assert cost.quota(100, 0) == 0.0 and cost.predict(100, 0) == 100.0
    with pytest.raises(ValueError, match="b, b_moe, q: at least one must be > 0"):
        QuadraticCost(a=0.0, b=0.0, k=1.0, q=0.0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c: c.prefill.engine_step_s([], []), "chunk_tokens: must have shape"),
        (lambda c: c.prefill.engine_step_s([[[1]]], 0), "chunk_tokens: must have shape"),
        (lambda c: c.prefill.engine_step_s([1, -1], 0), "chunk_tokens: must be non-negative"),
        (lambda c: c.prefill.rank_step_s([1, 2], [0, 1, 2]), "prefix_tokens: must broadcast"),
        (lambda c: c.prefill.rank_step_s([1, 2], [[0], [1]]), "prefix_tokens: must broadcast"),
        (lambda c: c.prefill.shared_s(100, 0), "num_ranks: must be whole numbers >= 1"),
        (lambda c: c.prefill.shared_s(100, 2.5), "num_ranks: must be whole numbers >= 1"),
        (lambda c: c.prefill.shared_s(-1, 2), "total_chunk_tokens: must be non-negative"),
        (lambda c: c.decode.shared_s(-1, 2), "total_requests: must be non-negative"),
        (lambda c: c.decode.engine_step_s([[1, 2]], 0), "num_requests: must have shape"),
        (lambda c: c.decode.engine_step_s([1, 2], [[0, 1]]), "kv_tokens: must broadcast"),
        (lambda c: c.decode.engine_step_s([1, 2], [0, 1, 2]), "kv_tokens: must broadcast"),
        (lambda c: c.decode.engine_step_s([], []), "num_requests: must have shape"),
    ],
)
def test_engine_helpers_validate_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(H800)


def test_preset_split_keeps_the_derived_totals():
    """h800_dsv3: local + routed at the preset's moe_lb stay the derived totals (146 us/token
    prefill, 0.25 ms/request decode), and the routed share follows docs/cost-model.md."""
    pre, dec = H800.prefill, H800.decode
    assert pre.linear_s_per_token == pytest.approx(146e-6, rel=1e-3)
    assert dec.b + dec.moe_s_per_token == pytest.approx(0.25e-3, rel=3e-3)
    assert pre.moe_s_per_token / pre.linear_s_per_token == pytest.approx(0.572, abs=1e-3)
    assert dec.moe_s_per_token / (dec.b + dec.moe_s_per_token) == pytest.approx(0.509, abs=2e-3)
    # An engine whose tokens all sit on one of 8 ranks: that rank pays all its local work, but
    # only 1/8 of the routed-expert work; the router cannot balance the shared part.
    one = pre.engine_step_s([8192] + [0] * 7, 0)
    spread = pre.engine_step_s([1024] * 8, 0)
    assert one == pytest.approx(pre.a + pre.work(8192, 0) + pre.shared_s(8192, 8))
    assert spread < one
