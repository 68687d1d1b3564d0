"""Engine apportionment: Adams against brute force, the defining property of each method."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from lbkit.prefill import DEFAULT_METHOD, METHODS, allocate_engines, bottleneck, serving_buckets

OFFSET = {"adams": 0.0, "webster": 0.5, "dhondt": 1.0}

demand_st = st.lists(st.one_of(st.just(0.0), st.floats(0.01, 100.0)), min_size=1, max_size=4).map(
    np.array
)


def compositions(total: int, parts: int):
    """All vectors of ``parts`` non-negative integers summing to ``total``."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        prev, out = -1, []
        for c in (*cuts, total + parts - 1):
            out.append(c - prev - 1)
            prev = c
        yield np.array(out)


def separated_bottleneck(d, s) -> float:
    """max_j D_j / s_j, infinite for a non-empty bucket without an engine."""
    return max(
        (math.inf if sj == 0 else dj / sj) if dj > 0 else 0.0 for dj, sj in zip(d, s, strict=True)
    )


@st.composite
def bounded_problem(draw):
    d = draw(demand_st)
    n = d.shape[0]
    lo = np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    hi = lo + np.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)))
    need = np.maximum(lo, ((d > 0) & (hi > 0)).astype(int))
    e = draw(st.integers(max(1, int(need.sum())), max(1, int(need.sum()), int(hi.sum()))))
    assume(hi.sum() >= e)
    return d, e, lo, hi


@given(problem=bounded_problem())
def test_adams_minimises_the_busiest_engine_over_all_compositions(problem):
    d, e, lo, hi = problem
    assume(d.sum() > 0)
    got = allocate_engines(d, e, min_engines=lo, max_engines=hi)
    assert got.engines.sum() == e
    assert (got.engines >= lo).all() and (got.engines <= hi).all()
    best = min(
        separated_bottleneck(d, s)
        for s in compositions(e, d.shape[0])
        if (s >= lo).all() and (s <= hi).all()
    )
    assert separated_bottleneck(d, got.engines) == best
    # Every non-empty bucket that may have an engine has its own.
    assert ((got.engines > 0) | (d == 0) | (hi == 0)).all()


@given(d=demand_st, data=st.data())
def test_adams_shares_contiguous_groups_when_engines_are_few(d, data):
    nonempty = d[d > 0]
    assume(nonempty.size >= 2)
    e = data.draw(st.integers(1, nonempty.size - 1))
    got = allocate_engines(d, e)
    assert got.engines.sum() == e and (got.engines <= 1).all()
    # Brute force over every split of the non-empty buckets into e contiguous groups.
    best = math.inf
    for cuts in itertools.combinations(range(1, nonempty.size), e - 1):
        bounds = (0, *cuts, nonempty.size)
        best = min(best, max(sum(nonempty[a:b]) for a, b in itertools.pairwise(bounds)))
    assert math.isclose(got.bottleneck, best, rel_tol=1e-12)
    # The serving map groups contiguous buckets, and every bucket is served.
    assert (got.server >= 0).all() and (np.diff(got.server) >= 0).all()
    assert (got.engines[got.server] >= 1).all()


@pytest.mark.parametrize("method", sorted(METHODS))
@given(problem=bounded_problem())
def test_every_method_respects_bounds_and_places_every_engine(method, problem):
    d, e, lo, hi = problem
    try:
        got = allocate_engines(d, e, method=method, min_engines=lo, max_engines=hi)
    except ValueError as exc:  # only Adams with minimums may refuse to share buckets
        assert method == "adams" and "shared" in str(exc)
        return
    assert got.engines.sum() == e
    assert (got.engines >= lo).all() and (got.engines <= hi).all()
    assert (got.server == serving_buckets(got.engines)).all()
    assert got.bottleneck == bottleneck(d if d.sum() > 0 else np.ones_like(d), got.engines)


@pytest.mark.parametrize("method", ["adams", "webster", "dhondt"])
@given(
    d=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=5).map(np.array),
    extra=st.integers(0, 9),
)
def test_divisor_methods_admit_a_common_divisor(method, d, extra):
    """For some divisor x: D_j / d(s_j) <= x <= D_j / d(s_j - 1) for every bucket."""
    off = OFFSET[method]
    e = d.shape[0] + extra
    s = allocate_engines(d, e, method=method).engines
    floor = 1 if method == "adams" else 0

    def prio(j, k):
        return math.inf if k + off == 0 else d[j] / (k + off)

    highest_unfilled = max(prio(j, s[j]) for j in range(d.shape[0]))
    lowest_filled = min(
        (prio(j, s[j] - 1) for j in range(d.shape[0]) if s[j] > floor), default=math.inf
    )
    assert highest_unfilled <= lowest_filled * (1 + 1e-12)


@given(
    d=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=6).map(np.array), e=st.integers(1, 30)
)
def test_hamilton_meets_the_quota_rule(d, e):
    quota = e * d / d.sum()
    s = allocate_engines(d, e, method="hamilton").engines
    assert (s >= np.floor(quota)).all() and (s <= np.ceil(quota)).all()


@given(
    d=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=6).map(np.array), e=st.integers(1, 30)
)
def test_quota_properties_of_adams_and_dhondt(d, e):
    quota = e * d / d.sum()
    if e >= d.shape[0]:  # Adams never exceeds the upper quota (beyond its one-per-bucket floor)
        s = allocate_engines(d, e, method="adams").engines
        assert (s <= np.maximum(np.ceil(quota - 1e-9), 1)).all()
    s = allocate_engines(d, e, method="dhondt").engines  # D'Hondt never falls below lower quota
    assert (s >= np.floor(quota + 1e-9)).all()


@pytest.mark.parametrize("method", sorted(METHODS))
@given(d=demand_st, e=st.integers(1, 12), k=st.integers(-20, 20))
def test_scaling_demand_changes_nothing(method, d, e, k):
    a = allocate_engines(d, e, method=method)
    b = allocate_engines(d * 2.0**k, e, method=method)
    assert a.engines.tolist() == b.engines.tolist()
    assert a.server.tolist() == b.server.tolist()


def test_zero_demand_spreads_engines_evenly_lowest_buckets_first():
    for method in METHODS:
        assert allocate_engines([0.0] * 4, 6, method=method).engines.tolist() == [2, 2, 1, 1]
        assert allocate_engines([0.0] * 4, 3, method=method).engines.tolist() == [1, 1, 1, 0]


def test_empty_buckets_are_served_by_the_nearest_bucket_below_else_above():
    got = allocate_engines([0.0, 5.0, 0.0, 0.0, 2.0, 0.0], 4)
    assert got.engines.tolist() == [0, 3, 0, 0, 1, 0]
    assert got.server.tolist() == [1, 1, 1, 1, 4, 4]
    assert serving_buckets([0, 0, 0]).tolist() == [-1, -1, -1]


def test_default_method_is_adams():
    assert DEFAULT_METHOD == "adams" and set(METHODS) == {"adams", "webster", "dhondt", "hamilton"}


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (([1.0, -1.0], 2), {}, ValueError, "demand: must be non-negative"),
        (([1.0, float("nan")], 2), {}, ValueError, "demand: must be finite"),
        (([], 2), {}, ValueError, "demand: must not be empty"),
        (([1.0], 0), {}, ValueError, "num_engines: must be >= 1"),
        (([1.0], 2.5), {}, TypeError, "num_engines: must be an integer"),
        (([1.0, 1.0], 2), {"method": "borda"}, ValueError, "method: must be one of"),
        (([1.0, 1.0], 3), {"min_engines": [2, 2]}, ValueError, "min_engines: the minimums"),
        (([1.0, 1.0], 3), {"max_engines": [1, 1]}, ValueError, "max_engines: the caps"),
        (
            ([1.0, 1.0], 3),
            {"min_engines": [2, 0], "max_engines": [1, 3]},
            ValueError,
            "above its cap",
        ),
        (([1.0, 1.0], 3), {"min_engines": [1]}, ValueError, "min_engines: must have shape"),
        (([1.0, 1.0, 1.0], 2), {"min_engines": [1, 0, 0]}, ValueError, "cannot give each"),
    ],
)
def test_bad_input(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        allocate_engines(*args, **kwargs)
