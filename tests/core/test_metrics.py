"""Balance metrics against their definitions."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lbkit.core import balance_efficiency, gpu_loads, imbalance, max_over_mean, moe_lb

loads = arrays(
    np.float64,
    st.tuples(st.integers(1, 6), st.integers(1, 6)),
    elements=st.floats(0, 1e6, allow_subnormal=False),
)


@given(loads)
def test_balance_efficiency_definition(load):
    eta = balance_efficiency(load)
    peak = load.max(axis=0).sum()
    expected = 1.0 if peak == 0 else load.mean(axis=0).sum() / peak
    assert eta == pytest.approx(expected)
    assert 0 < eta <= 1 + 1e-12
    assert imbalance(load) == pytest.approx(1 / eta)


@given(loads, st.floats(1e-3, 1e3))
def test_balance_efficiency_is_scale_and_permutation_invariant(load, scale):
    eta = balance_efficiency(load)
    assert balance_efficiency(load * scale) == pytest.approx(eta)
    assert balance_efficiency(load[::-1]) == pytest.approx(eta)


def test_balance_efficiency_is_a_ratio_of_sums_not_a_mean_of_ratios():
    # Step 1 is tiny and badly balanced, step 2 large and balanced.
    load = np.array([[1.0, 100.0], [0.0, 100.0]])
    assert balance_efficiency(load) == pytest.approx((0.5 + 100.0) / (1.0 + 100.0))


def test_max_over_mean():
    assert max_over_mean([2.0, 2.0]) == 1.0
    np.testing.assert_allclose(max_over_mean([[1.0, 3.0], [0.0, 0.0]], axis=1), [1.5, 1.0])


@given(loads, st.integers(-60, 60))
def test_metrics_near_the_float_limit_are_the_scaled_figures(load, shift):
    # Finite loads whose sums overflow float64 (max_over_mean([1e308, 1e308]) was 0.0): scaled
    # by a power of two inside, the figures are exactly those of the same loads at a small scale.
    with np.errstate(over="ignore"):
        big = np.ldexp(load, 1000 + shift)
    if not np.isfinite(big).all():
        return
    small = np.ldexp(load, -100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert max_over_mean(big) == pytest.approx(max_over_mean(small), rel=1e-12)
        np.testing.assert_allclose(max_over_mean(big, axis=0), max_over_mean(small, axis=0))
        assert balance_efficiency(big) == pytest.approx(balance_efficiency(small), rel=1e-12)
        p2l = np.tile(np.arange(load.shape[1]), (load.shape[0], 2))
        np.testing.assert_allclose(moe_lb(big, p2l, num_gpus=2), moe_lb(small, p2l, num_gpus=2))


def test_metrics_of_the_largest_finite_loads():
    assert max_over_mean([1e308, 1e308]) == 1.0
    assert max_over_mean([1.7e308, 0.0]) == 2.0
    assert balance_efficiency([[1.7e308, 1.7e308], [1.7e308, 0.0]]) == pytest.approx(0.75)
    np.testing.assert_allclose(moe_lb([[1.7e308, 1.7e308]], [[0, 1, 0, 1]], num_gpus=2), [1.0])


def test_gpu_loads_and_moe_lb_split_experts_over_replicas():
    weight = np.array([[6.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    phy2log = np.array([[0, 1, 0, 2], [0, 1, 2, 0]])
    loads = gpu_loads(weight, phy2log, num_gpus=2)
    np.testing.assert_allclose(loads, [[3 + 2, 3 + 2], [0.5 + 1, 1 + 0.5]])
    np.testing.assert_allclose(moe_lb(weight, phy2log, num_gpus=2), [1.0, 1.0])
    np.testing.assert_allclose(moe_lb(weight, [[0, 0, 1, 2], [0, 1, 2, 0]], num_gpus=2), [1.2, 1])


def test_moe_lb_of_an_idle_layer_is_one():
    np.testing.assert_allclose(moe_lb(np.zeros((1, 2)), [[0, 1]], num_gpus=2), [1.0])


@pytest.mark.parametrize(
    ("weight", "phy2log", "num_gpus", "match"),
    [
        ([[1.0, 2.0]], [[0, 2]], 1, "phy2log: entries must be <= 1"),
        ([[1.0, 2.0]], [[0, 1, 1]], 2, "num_gpus: must divide the number of slots"),
        ([[1.0, -2.0]], [[0, 1]], 1, "weight: must be non-negative"),
        ([1.0, 2.0], [[0, 1]], 1, "weight: must be 2-dimensional"),
        ([[1.0, 2.0]], [[0, 1], [1, 0]], 1, r"phy2log: must have shape \(1, \*\)"),
        ([[1.0, 2.0]], [[0, 1]], 0, "num_gpus: must be >= 1"),
    ],
)
def test_moe_lb_rejects_bad_input(weight, phy2log, num_gpus, match):
    with pytest.raises(ValueError, match=match):
        moe_lb(weight, phy2log, num_gpus=num_gpus)


def test_balance_efficiency_rejects_bad_input():
    with pytest.raises(ValueError, match="load: must not be empty"):
        balance_efficiency([])
    with pytest.raises(ValueError, match="load: must be 1- or 2-dimensional"):
        balance_efficiency(np.ones((2, 2, 2)))
    with pytest.raises(ValueError, match="load: must be finite"):
        balance_efficiency([1.0, float("nan")])
