"""Synthetic workloads: determinism, requested shares, calibration, arrival processes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.sim.traces import load_mooncake
from lbkit.sim.workload import (
    DEFAULT_WORKLOAD,
    INPUT_LN_MU,
    INPUT_LN_SIGMA,
    OUTPUT_LN_MU,
    OUTPUT_LN_SIGMA,
    default_workload,
    fit_lognormal,
    synthetic_trace,
)

MOONCAKE_FULL = (
    Path(__file__).resolve().parents[2]
    / ".."
    / "shared"
    / "traces"
    / "mooncake_conversation"
    / "conversation_trace.jsonl"
)


def _within_sigmas(observed: float, p: float, n: int, k: float = 5.0) -> bool:
    return abs(observed - p) <= k * math.sqrt(p * (1 - p) / n) + 1e-12


def test_same_seed_same_trace_different_seed_different_trace():
    kw = dict(rate_per_s=5.0, arrival="gamma", burstiness=2.0, long_share={"64K-256K": 0.1})
    a = synthetic_trace(300, rng=3, **kw)
    assert a == synthetic_trace(300, rng=3, **kw)
    assert a == synthetic_trace(300, rng=np.random.default_rng(3), **kw)
    b = synthetic_trace(300, rng=4, **kw)
    assert not np.array_equal(a.total_tokens, b.total_tokens)
    assert not np.array_equal(a.arrival_s, b.arrival_s)
    assert synthetic_trace(5, rate_per_s=1.0) == synthetic_trace(5, rate_per_s=1.0, rng=0)


@given(
    st.floats(0.0, 0.3),
    st.floats(0.0, 0.3),
    st.integers(0, 2**32 - 1),
)
def test_requested_long_shares_are_met(share_mid, share_top, seed):
    n = 4000
    t = synthetic_trace(
        n, rate_per_s=1.0, long_share={"64K-256K": share_mid, ">=256K": share_top}, rng=seed
    )
    s = t.summary()
    assert s.bucket_labels[2:] == ("64K-256K", ">=256K")
    assert _within_sigmas(s.bucket_request_shares[2], share_mid, n)
    assert _within_sigmas(s.bucket_request_shares[3], share_top, n)
    assert t.total_tokens.max() <= 1_048_576 and t.total_tokens.min() >= 1


def test_short_requests_stay_below_64k_when_shares_are_set():
    t = synthetic_trace(20_000, rate_per_s=1.0, long_share={">=256K": 0.01}, rng=5)
    s = t.summary()
    assert s.bucket_counts[2] == 0  # no 64K-256K share was requested
    assert _within_sigmas(s.bucket_request_shares[3], 0.01, 20_000)
    # The rest follows the lognormal truncated below 64K: its median is the lognormal's.
    rest = t.total_tokens[t.total_tokens < 65536]
    assert np.median(rest) == pytest.approx(math.exp(INPUT_LN_MU), rel=0.05)


def test_long_buckets_respect_max_tokens():
    t = synthetic_trace(2000, rate_per_s=1.0, long_share={">=256K": 0.5}, max_tokens=300_000, rng=1)
    top = t.total_tokens[t.total_tokens >= 262_144]
    assert top.size > 800 and top.max() <= 300_000
    capped = synthetic_trace(2000, rate_per_s=1.0, max_tokens=5000, max_output_tokens=7, rng=1)
    assert capped.total_tokens.max() == 5000 and capped.output_tokens.max() == 7


def test_lognormal_calibration_is_recovered():
    t = synthetic_trace(40_000, rate_per_s=1.0, max_output_tokens=10**9, rng=11)
    mu, sigma = fit_lognormal(t.total_tokens)
    assert mu == pytest.approx(INPUT_LN_MU, abs=0.03) and sigma == pytest.approx(
        INPUT_LN_SIGMA, abs=0.03
    )
    mu, sigma = fit_lognormal(t.output_tokens)
    assert mu == pytest.approx(OUTPUT_LN_MU, abs=0.03) and sigma == pytest.approx(
        OUTPUT_LN_SIGMA, abs=0.03
    )
    other = synthetic_trace(40_000, rate_per_s=1.0, input_mu=6.0, input_sigma=0.5, rng=12)
    assert tuple(fit_lognormal(other.total_tokens)) == pytest.approx((6.0, 0.5), abs=0.02)


@pytest.mark.skipif(not MOONCAKE_FULL.is_file(), reason="shared Mooncake trace not present")
def test_default_parameters_are_the_fit_of_the_mooncake_trace():
    trace = load_mooncake(MOONCAKE_FULL)
    assert tuple(fit_lognormal(trace.total_tokens)) == pytest.approx(
        (INPUT_LN_MU, INPUT_LN_SIGMA), abs=1e-4
    )
    assert tuple(fit_lognormal(trace.output_tokens)) == pytest.approx(
        (OUTPUT_LN_MU, OUTPUT_LN_SIGMA), abs=1e-4
    )


@pytest.mark.parametrize(("arrival", "cv"), [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0)])
def test_arrival_rate_and_burstiness(arrival, cv):
    t = synthetic_trace(30_000, rate_per_s=8.0, arrival=arrival, burstiness=cv, rng=2)
    gaps = np.diff(t.arrival_s)
    assert t.arrival_s[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_default_workload_mix():
    t = default_workload()
    assert t == default_workload(rng=0) and t.source == "default_workload"
    assert len(t) == DEFAULT_WORKLOAD["num_requests"] == 20_000
    s = t.summary()
    assert _within_sigmas(s.bucket_request_shares[2], 0.03, 20_000)
    assert _within_sigmas(s.bucket_request_shares[3], 0.005, 20_000)
    assert s.rate_per_s == pytest.approx(3.4, rel=0.03)
    assert "64K-256K" in str(s) and ">=256K" in str(s)
    assert t.hash_ids is not None and (t.cached_tokens == 0).all()
    short = default_workload(num_requests=100, rng=1)
    assert len(short) == 100 and short != default_workload(num_requests=100, rng=2)


def test_empty_and_single_request_traces():
    assert len(synthetic_trace(0, rate_per_s=1.0)) == 0
    one = synthetic_trace(1, rate_per_s=1.0, long_share={"64K-256K": 1.0})
    assert one.arrival_s.tolist() == [0.0] and 65536 <= one.total_tokens[0] < 262144


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_requests": -1}, ValueError, "num_requests: must be >= 0"),
        ({"rate_per_s": 0.0}, ValueError, "rate_per_s: must be > 0.0"),
        ({"arrival": "weibull"}, ValueError, "arrival: must be one of 'poisson', 'gamma'"),
        ({"burstiness": 2.0}, ValueError, "burstiness: only arrival='gamma' takes"),
        ({"arrival": "gamma", "burstiness": 0.0}, ValueError, "burstiness: must be > 0.0"),
        ({"input_sigma": 0.0}, ValueError, "input_sigma: must be > 0.0"),
        ({"output_mu": math.nan}, ValueError, "output_mu: must not be NaN"),
        ({"long_share": {"32K-64K": 0.1}}, ValueError, "long_share: unknown bucket '32K-64K'"),
        ({"long_share": {">=256K": -0.1}}, ValueError, r"long_share\['>=256K'\]: must be >= 0"),
        (
            {"long_share": {">=256K": 0.6, "64K-256K": 0.6}},
            ValueError,
            "long_share: shares must sum to at most 1",
        ),
        ({"long_share": 0.1}, TypeError, "long_share: must be a mapping"),
        (
            {"long_share": {">=256K": 0.1}, "max_tokens": 200_000},
            ValueError,
            "max_tokens: must be >= 262144 to draw requests in bucket '>=256K'",
        ),
        ({"max_tokens": 0}, ValueError, "max_tokens: must be >= 1"),
        ({"max_output_tokens": 0}, ValueError, "max_output_tokens: must be >= 1"),
        ({"rng": -1}, TypeError, "rng: must be a numpy Generator"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    args = {"num_requests": 10, "rate_per_s": 1.0, **kwargs}
    n = args.pop("num_requests")
    with pytest.raises(error, match=message):
        synthetic_trace(n, **args)


def test_fit_lognormal_checks_its_input():
    with pytest.raises(ValueError, match="values: need at least 2 values"):
        fit_lognormal([5])
    with pytest.raises(ValueError, match=r"values: must be positive \(found 0.0\)"):
        fit_lognormal([5, 0])
    assert fit_lognormal([math.e, math.e**3]) == pytest.approx((2.0, 1.0))
