"""Cost models: prediction, quota, the chunk solver against brute force, and fitting."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from lbkit.core import PRESETS, DecodeCost, QuadraticCost, preset

UNIT = PRESETS["unit"].prefill
H800 = PRESETS["h800_dsv3"].prefill

costs = st.builds(
    QuadraticCost,
    a=st.floats(0, 10),
    b=st.floats(1e-3, 5),
    k=st.floats(0, 1e-2),
    q=st.floats(0, 1e-2),
    gamma=st.floats(0, 1e-2),
)


def brute_force_chunk(cost: QuadraticCost, budget: float, prefix: int, limit: int) -> int:
    """Largest c in [0, limit] with predict(c, prefix) <= budget, by scanning every c."""
    best = 0
    for c in range(1, limit + 1):
        if cost.predict(c, prefix) <= budget:
            best = c
    return best


@given(cost=costs, budget=st.floats(0, 3000), prefix=st.integers(0, 5000))
def test_solve_chunk_is_the_largest_chunk_that_fits(cost, budget, prefix):
    c = cost.solve_chunk(budget, prefix)
    assert isinstance(c, int)
    # The cost is at least b*c per chunk, so no chunk above budget/b can fit.
    limit = int(budget / cost.b) + 2 if cost.b > 0 else 4000
    assume(limit <= 4000)
    assert c == brute_force_chunk(cost, budget, prefix, limit)


@given(
    cost=costs,
    budget=st.floats(0, 1e6),
    prefix=st.integers(0, 10**6),
)
def test_solve_chunk_fits_and_next_does_not(cost, budget, prefix):
    c = cost.solve_chunk(budget, prefix)
    if c > 0:
        assert cost.predict(c, prefix) <= budget
    assert cost.predict(c + 1, prefix) > budget


@given(
    budget=st.floats(0, 1e4),
    prefix=st.integers(0, 10**5),
    align=st.integers(1, 128),
    min_chunk=st.integers(0, 300),
    max_chunk=st.none() | st.integers(0, 5000),
)
def test_solve_chunk_options(budget, prefix, align, min_chunk, max_chunk):
    plain = UNIT.solve_chunk(budget, prefix)
    c = UNIT.solve_chunk(budget, prefix, align=align, min_chunk=min_chunk, max_chunk=max_chunk)
    cap = plain if max_chunk is None else min(plain, max_chunk)
    expected = cap // align * align
    assert c == (0 if expected < min_chunk else expected)


def test_solve_chunk_vectorised_matches_scalar():
    budgets = np.array([0.0, 1.0, 2.0, 100.0, 5000.0])
    prefixes = np.array([0, 10, 1000, 50_000, 3])
    vec = H800.solve_chunk(budgets, prefixes)
    assert vec.dtype == np.int64
    assert vec.tolist() == [H800.solve_chunk(b, p) for b, p in zip(budgets, prefixes, strict=True)]


def test_solve_chunk_handles_no_budget_and_no_quadratic_term():
    linear = QuadraticCost(a=1.0, b=2.0, k=0.0, q=0.0)
    assert linear.solve_chunk(1.0, 0) == 0
    assert linear.solve_chunk(11.0, 0) == 5
    assert linear.solve_chunk(-5.0, 0) == 0


def test_solve_chunk_stable_form_on_tiny_quadratic_term():
    # The textbook root (-beta + sqrt(beta^2 + 4qB)) / 2q cancels catastrophically here.
    cost = QuadraticCost(a=0.0, b=1.0, k=0.0, q=1e-18)
    assert cost.solve_chunk(1e6, 0) == 999_999 or cost.solve_chunk(1e6, 0) == 1_000_000
    assert cost.predict(cost.solve_chunk(1e6, 0), 0) <= 1e6


@given(
    chunks=st.lists(st.integers(1, 4000), min_size=1, max_size=6),
    prefix=st.integers(0, 10_000),
)
def test_quota_is_independent_of_chunking_under_the_causal_tie(chunks, prefix):
    total = sum(chunks)
    done = 0
    work = 0.0
    for c in chunks:
        work += H800.work(c, prefix + done)
        done += c
    assert math.isclose(work, H800.quota(total, prefix), rel_tol=1e-9)


def test_predict_work_step_time_relations():
    assert UNIT.predict(0, 100) == UNIT.a
    assert UNIT.work(0, 100) == 0.0
    assert UNIT.step_time([10, 20], [0, 5]) == pytest.approx(
        UNIT.a + UNIT.work(10, 0) + UNIT.work(20, 5)
    )
    assert UNIT.tied and H800.tied
    assert not QuadraticCost(a=0, b=1, k=1e-3, q=0).tied


@pytest.mark.parametrize("seed", range(10))
def test_fit_recovers_coefficients_within_two_percent(seed):
    """200 samples, 3% multiplicative noise, log-uniform chunk and prefix lengths."""
    rng = np.random.default_rng(seed)
    n = 200
    c = np.round(np.exp(rng.uniform(np.log(16), np.log(16384), n)))
    p = np.round(np.exp(rng.uniform(0, np.log(131072), n))) * (rng.random(n) < 0.8)
    t = H800.predict(c, p) * np.exp(rng.normal(0.0, 0.03, n))
    fit = QuadraticCost.fit(c, p, t)
    # Balanced steps only (predict): b takes all of the linear cost, b + b_moe * moe_lb.
    expected = {"a": H800.a, "b": H800.linear_s_per_token, "k": H800.k, "q": H800.q}
    for name, value in expected.items():
        assert getattr(fit.cost, name) == pytest.approx(value, rel=0.02), name
    assert fit.cost.b_moe == 0.0
    assert fit.num_samples == n
    assert 0.02 < fit.rel_rmse < 0.04
    assert fit.r_squared_log > 0.99


def test_weighted_fit_keeps_the_intercept_an_unweighted_fit_loses():
    """Over 20 noisy data sets the weighted fit always recovers ``a`` within 2%; an unweighted
    least-squares fit (dominated by the longest steps) misses it by more than 2% in most."""
    from scipy.optimize import nnls

    weighted_err, unweighted_err = [], []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        n = 200
        c = np.round(np.exp(rng.uniform(np.log(16), np.log(16384), n)))
        p = np.round(np.exp(rng.uniform(0, np.log(131072), n))) * (rng.random(n) < 0.8)
        t = H800.predict(c, p) * np.exp(rng.normal(0.0, 0.03, n))
        design = np.stack([np.ones(n), c, c * p + c * c / 2], axis=1)
        scale = np.linalg.norm(design, axis=0)
        unweighted, _ = nnls(design / scale, t)
        unweighted_err.append(abs(unweighted[0] / scale[0] / H800.a - 1))
        weighted_err.append(abs(QuadraticCost.fit(c, p, t).cost.a / H800.a - 1))
    assert max(weighted_err) < 0.02
    assert np.median(unweighted_err) > 0.05
    assert np.mean(np.array(unweighted_err) > 0.02) > 0.8


def test_fit_untied_and_gamma():
    truth = QuadraticCost(a=0.5, b=1.0, k=0.002, q=0.0003, gamma=0.0004)
    rng = np.random.default_rng(1)
    c = rng.integers(1, 5000, 300)
    p = rng.integers(0, 20000, 300)
    fit = QuadraticCost.fit(c, p, truth.predict(c, p), tied=False, fit_gamma=True)
    for name in ("a", "b", "k", "q", "gamma"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([1, 2], [0, 0], [1.0, 2.0]), {}, "need at least 3 samples"),
        (([1, 2, 3], [0, 0], [1.0, 2.0, 3.0]), {}, "equal lengths"),
        (([1, 2, np.nan], [0, 0, 0], [1.0, 2.0, 3.0]), {}, "chunk_tokens: must be finite"),
        (([0, 2, 3], [0, 0, 0], [1.0, 2.0, 3.0]), {}, "chunk_tokens: every measured step"),
        (([1, 2, 3], [0, -1, 0], [1.0, 2.0, 3.0]), {}, "prefix_tokens: must be non-negative"),
        (([1, 2, 3], [0, 0, 0], [1.0, 0.0, 3.0]), {}, "seconds: every duration must be > 0"),
        (
            ([1, 2, 3, 4], [0, 0, 0, 0], [1.0, 2.0, 3.0, 4.0]),
            {"tied": False, "fit_gamma": True},
            "need at least 5 samples",
        ),
    ],
)
def test_fit_rejects_bad_data(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuadraticCost.fit(*args, **kwargs)


def test_fit_rejects_data_without_per_token_cost():
    with pytest.raises(ValueError, match="no per-token cost"):
        QuadraticCost.fit([1, 2, 3], [0, 0, 0], [1.0, 1.0, 1.0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"a": -1.0, "b": 1.0, "k": 0.0, "q": 0.0}, ValueError, "a: must be >= 0.0"),
        ({"a": 0.0, "b": float("nan"), "k": 0.0, "q": 0.0}, ValueError, "b: must not be NaN"),
        ({"a": 0.0, "b": 0.0, "k": 1.0, "q": 0.0}, ValueError, "at least one must be > 0"),
        ({"a": "1", "b": 1.0, "k": 0.0, "q": 0.0}, TypeError, "a: must be a real number"),
        ({"a": 0.0, "b": 1.0, "k": float("inf"), "q": 0.0}, ValueError, "k: must be finite"),
    ],
)
def test_quadratic_cost_validates_coefficients(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuadraticCost(**kwargs)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: UNIT.solve_chunk(10.0, -1), "prefix_tokens: must be non-negative"),
        (lambda: UNIT.solve_chunk(float("nan"), 0), "budget_s: must be finite"),
        (lambda: UNIT.solve_chunk(10.0, 0, align=0), "align: must be >= 1"),
        (lambda: UNIT.solve_chunk(10.0, 0, min_chunk=-1), "min_chunk: must be >= 0"),
        (lambda: UNIT.solve_chunk(10.0, 0, max_chunk=-1), "max_chunk: must be >= 0"),
        (lambda: UNIT.predict(-1, 0), "chunk_tokens: must be non-negative"),
        (lambda: UNIT.quota(10, "x"), "prefix_tokens: expected an array of numbers"),
    ],
)
def test_quadratic_cost_methods_validate_arguments(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_decode_cost_combiners():
    cost = PRESETS["unit"].decode
    assert cost.step_time(4, 3000) == pytest.approx(1 + 4 + 3)
    assert cost.with_combine("max").step_time(4, 3000) == pytest.approx(1 + 4)
    np.testing.assert_allclose(cost.step_time([0, 1], [0, 1000]), [1.0, 3.0])
    with pytest.raises(ValueError, match="combine: must be one of"):
        DecodeCost(a=0, b=1, k=1, combine="mean")
    with pytest.raises(ValueError, match="num_requests: must be non-negative"):
        cost.step_time(-1, 0)


def test_presets():
    h = preset("h800_dsv3")
    assert h.prefill.a == pytest.approx(0.010)
    # b is the local share; the balanced total b + b_moe * moe_lb keeps the derived 146 us/token.
    assert h.prefill.b == pytest.approx(62.4e-6) and h.prefill.b_moe == pytest.approx(81.1e-6)
    assert h.prefill.linear_s_per_token == pytest.approx(146e-6, rel=1e-3)
    assert h.prefill.k == pytest.approx(11.1e-9) and h.prefill.tied
    assert h.decode.a == pytest.approx(5e-3)
    assert h.decode.b == pytest.approx(0.123e-3) and h.decode.b_moe == pytest.approx(0.124e-3)
    assert h.decode.b + h.decode.moe_s_per_token == pytest.approx(0.25e-3, rel=3e-3)
    assert h.prefill.moe_lb == h.decode.moe_lb == pytest.approx(1.03)
    assert h.decode.k == pytest.approx(23.4e-9)
    u = preset("unit").prefill
    # In the unit preset attention work (k*c*p) overtakes linear work (b*c) at p = 1000 cached
    # tokens per new token, i.e. q*c^2 == b*c at c = 2000 for a fresh prompt.
    assert u.q * 2000**2 == pytest.approx(u.b * 2000)
    with pytest.raises(ValueError, match="name: must be one of"):
        preset("nope")


@given(
    cost=st.sampled_from([H800, UNIT]) | costs,
    c=st.integers(1, 50_000),
    prefix=st.integers(0, 200_000),
)
@example(cost=H800, c=108, prefix=12428)  # the closed form's floor is 107 here
def test_solve_chunk_on_a_chunk_boundary(cost, c, prefix):
    # A budget of exactly predict(c, p) fits c and one ulp less does not: the closed form's floor
    # lands a token short in about one case in seven, and the exact correction must restore it.
    budget = float(cost.predict(c, prefix))
    if cost.predict(c + 1, prefix) == budget:  # a flat step of the rounded cost: c is no maximum
        return
    assert cost.solve_chunk(budget, prefix) == c
    assert cost.solve_chunk(float(np.nextafter(budget, -np.inf)), prefix) == c - 1


def test_fit_of_a_purely_linear_model():
    # k = q = 0 in truth: the fit finds them zero (no refusal) and reproduces the data.
    c = np.array([100, 200, 400, 800, 1600, 300])
    p = np.array([0, 100, 0, 500, 0, 1000])
    t = 0.5 + 0.001 * c
    for tied in (True, False):
        fit = QuadraticCost.fit(c, p, t, tied=tied)
        assert fit.cost.a == pytest.approx(0.5) and fit.cost.b == pytest.approx(0.001)
        assert fit.cost.k == pytest.approx(0.0, abs=1e-15) and fit.cost.q == pytest.approx(
            0.0, abs=1e-15
        )
        assert fit.max_rel_error < 1e-12 and fit.r_squared_log == pytest.approx(1.0)


@given(seed=st.integers(0, 2**16), noise=st.floats(0.02, 0.3))
def test_fit_quality_figures_follow_their_definitions(seed, noise):
    # Both ways: exact data give max_rel_error ~ 0 and r_squared_log ~ 1; noisy data give the
    # figures their definitions compute from the fitted prediction (and a worse one).
    rng = np.random.default_rng(seed)
    c = rng.integers(64, 8192, size=40)
    p = rng.integers(0, 32768, size=40)
    exact = H800.predict(c, p)
    clean = QuadraticCost.fit(c, p, exact)
    assert clean.max_rel_error < 1e-6 and clean.r_squared_log > 1 - 1e-9
    t = exact * np.exp(rng.normal(0.0, noise, size=40))
    fit = QuadraticCost.fit(c, p, t)
    pred = fit.cost.predict(c, p)
    rel = pred / t - 1.0
    assert fit.max_rel_error == pytest.approx(np.abs(rel).max(), rel=1e-9)
    assert fit.rel_rmse == pytest.approx(np.sqrt((rel**2).mean()), rel=1e-9)
    log_t = np.log(t)
    want = 1 - ((np.log(pred) - log_t) ** 2).sum() / ((log_t - log_t.mean()) ** 2).sum()
    assert fit.r_squared_log == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert fit.max_rel_error > clean.max_rel_error and fit.r_squared_log < clean.r_squared_log


# A per-token cost tiny next to the budget (about 1e-15 of it or less): the closed form's root
# is then far from the integer answer, beyond the solver's few correction steps.
tiny_costs = st.builds(
    QuadraticCost,
    a=st.floats(0.0, 1e3),
    b=st.sampled_from([2.0**-60, 2.0**-55, 1e-17]),
    k=st.sampled_from([0.0, 1e-25, 8.538610812692633e-23]),
    q=st.sampled_from([0.0, 2.0**-70]),
    gamma=st.floats(0.0, 1e-3),
    b_moe=st.sampled_from([0.0, 2.0**-58, 2.113547219364867e-15]),
)


@given(cost=tiny_costs, budget=st.floats(0.0, 2e3), prefix=st.integers(0, 10**7))
@example(
    cost=QuadraticCost(a=190.65084876147196, b=0.0, k=8.538610812692633e-23, q=0.0,
                       gamma=1.3403602111174357e-4, b_moe=2.113547219364867e-15),
    budget=1154.8211398379922, prefix=7193367,
)  # fmt: skip
def test_solve_chunk_fits_and_next_does_not_at_tiny_per_token_costs(cost, budget, prefix):
    """Pinned: the example returned 288 tokens, which overran the budget (277 fit)."""
    assume(budget - cost.a - cost.gamma * prefix > 0)  # no slack: 0 by definition
    c = cost.solve_chunk(budget, prefix)
    assume(c < 2**62)  # the solver's cap
    if c > 0:
        assert cost.predict(c, prefix) <= budget
    assert cost.predict(c + 1, prefix) > budget


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6])
def test_solve_chunk_one_ulp_steps_of_a_tiny_per_token_cost(m):
    """One token costs 2**-55 s next to a 1 s fixed cost: a budget of ``1 + m * 2**-52`` fits
    ``8m`` tokens exactly, plus the tokens whose cost rounds away (the largest chunk is found by
    exact evaluation; the closed form alone was one token short for even ``m``)."""
    cost = QuadraticCost(a=1.0, b=2.0**-55, k=0.0, q=0.0)
    budget = 1.0 + m * 2.0**-52
    c = cost.solve_chunk(budget, 0)
    assert cost.predict(c, 0) <= budget < cost.predict(c + 1, 0)
    assert c == max(x for x in range(8 * m + 8) if cost.predict(x, 0) <= budget)


@given(
    cost=costs,
    prefix=st.integers(0, 10**6),
    chunk=st.integers(1, 200_000),
    nudge=st.sampled_from([-1, 0, 1]),
)
def test_solve_chunk_needs_no_bisection_for_realistic_costs(cost, prefix, chunk, nudge):
    """The closed form and its few corrections are the solver for any realistic cost: the
    bisection is only the safety net of tiny per-token costs. Budgets at a chunk's exact cost and
    one ulp either side, where rounding decides."""

    def no_bisection(*args, **kwargs):
        raise AssertionError("solve_chunk fell back to the bisection")

    exact = cost.predict(chunk, prefix)
    budget = float(np.nextafter(exact, np.inf * nudge)) if nudge else exact
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(QuadraticCost, "_bisect_chunk", no_bisection)
        c = cost.solve_chunk(budget, prefix)
    assert cost.predict(c + 1, prefix) > budget
    if c > 0:
        assert cost.predict(c, prefix) <= budget
    assert c == chunk or nudge or cost.predict(c, prefix) == budget
