"""Every routing policy end to end on small runs, and lbkit against round robin on a skewed load."""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.core import PRESETS
from lbkit.sim.engine import scale_to_utilization, simulate_decode, simulate_prefill
from lbkit.sim.metrics import decode_metrics, prefill_metrics
from lbkit.sim.policies import PREFILL_POLICIES, LbkitPrefill
from lbkit.sim.policies_decode import DECODE_POLICIES, LbkitDecode
from lbkit.sim.workload import synthetic_trace

H800 = PRESETS["h800_dsv3"]


def _skewed(n=2000, seed=0):
    # Mooncake-like short prompts plus 2% long ones (64K-256K), at offered utilisation 0.8 of
    # 8 engines x 2 ranks.
    t = synthetic_trace(n, rate_per_s=10.0, long_share={"64K-256K": 0.02}, rng=seed)
    return scale_to_utilization(t, 0.8, num_ranks=16, cost=H800.prefill)[0]


@pytest.fixture(scope="module")
def skewed():
    return _skewed()


@pytest.fixture(scope="module")
def prefill_runs(skewed):
    return {
        name: simulate_prefill(
            skewed, name, num_engines=8, ranks_per_engine=2, cost=H800.prefill, rng=1
        )
        for name in PREFILL_POLICIES
    }


@pytest.mark.parametrize("name", list(PREFILL_POLICIES))
def test_prefill_policy_end_to_end(name, skewed, prefill_runs):
    run = prefill_runs[name]
    m = prefill_metrics(run)
    assert m["finished"] == len(skewed) and m["refused"] == 0 and m["in_flight"] == 0
    assert 0.0 < m["balance_efficiency"] <= 1.0
    assert m["ttft_p50_s"] <= m["ttft_p99_s"]
    # every TTFT is at least the request's prefill time alone (no policy beats an idle rank)
    assert (run.ttft_s >= run.alone_s - 1e-9).all()
    assert run.rank.min() >= 0 and run.rank.max() < 16


def test_lbkit_ledger_is_empty_and_consistent_after_a_run(skewed):
    pol = LbkitPrefill(8, 2, cost=H800.prefill)
    simulate_prefill(skewed, pol, num_engines=8, ranks_per_engine=2, cost=H800.prefill)
    pol.balancer._check()
    stats = pol.balancer.statistics()
    assert stats.queued == 0 and stats.finished == len(skewed)
    assert stats.rounds > 0


def test_lbkit_beats_round_robin_on_a_skewed_workload(prefill_runs):
    # Round robin puts long prompts (minutes of work) in front of short ones on every rank it
    # cycles through, so the short requests behind them wait; lbkit gives long prompts their own
    # engines and fills the least-loaded rank. We require lbkit's p99 TTFT to be at most half
    # of round robin's (the published target; measured 103 s against 450 s) and its p50 to be
    # lower too (10 s against 18 s).
    lb = prefill_metrics(prefill_runs["lbkit"])
    rr = prefill_metrics(prefill_runs["round_robin"])
    assert lb["ttft_p99_s"] <= 0.5 * rr["ttft_p99_s"]
    assert lb["ttft_p50_s"] < rr["ttft_p50_s"]


@pytest.mark.parametrize("name", list(DECODE_POLICIES))
def test_decode_policy_end_to_end(name, skewed, prefill_runs):
    pre = prefill_runs["least_tokens"]
    dec = simulate_decode(pre, name, num_engines=2, ranks_per_engine=4, cost=H800.decode, rng=2)
    m = decode_metrics(dec)
    assert m["finished"] == len(skewed) and m["refused"] == 0
    assert m["count_imbalance"] >= m["reference"]["count_imbalance"] - 1e-12
    assert m["kv_imbalance"] >= 1.0 and 0.0 < m["balance_efficiency"] <= 1.0
    again = decode_metrics(
        simulate_decode(pre, name, num_engines=2, ranks_per_engine=4, cost=H800.decode, rng=2)
    )
    assert m == again


@pytest.mark.parametrize("name", list(DECODE_POLICIES))
def test_decode_policies_respect_capacity(name, prefill_runs):
    dec = simulate_decode(prefill_runs["least_tokens"], name, num_engines=1, ranks_per_engine=2,
                          cost=H800.decode, max_batch=2, rng=0)  # fmt: skip
    m = decode_metrics(dec)
    assert m["refused"] == 0 and m["finished"] == m["arrived"]
    assert dec.wait_s.max() > 0  # back-pressure: requests waited for a batch slot


def test_lbkit_decode_ledger_matches_the_pool():
    t = synthetic_trace(300, rate_per_s=50.0, rng=4)
    pre = simulate_prefill(t, "least_tokens", num_engines=2, ranks_per_engine=2,
                           cost=H800.prefill)  # fmt: skip
    pol = LbkitDecode(1, 8)
    dec = simulate_decode(pre, pol, num_engines=1, ranks_per_engine=8, cost=H800.decode)
    assert decode_metrics(dec)["finished"] == 300
    assert np.asarray(pol.balancer.num_requests()).sum() == 0
    assert np.asarray(pol.balancer.kv_tokens()).sum() == 0
    pol.balancer._check()
