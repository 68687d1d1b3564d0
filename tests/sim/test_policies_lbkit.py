"""The ``lbkit`` prefill policies' options: a short-prompt workload keeps every engine busy."""

from __future__ import annotations

import dataclasses

import numpy as np

from lbkit.core import PRESETS
from lbkit.prefill import PrefillBalancer
from lbkit.sim.engine import scale_to_utilization, simulate_prefill
from lbkit.sim.metrics import prefill_metrics
from lbkit.sim.policies import LBKIT_BUCKET_OPTIONS, PREFILL_POLICIES
from lbkit.sim.workload import synthetic_trace

H800 = PRESETS["h800_dsv3"].prefill


def test_lbkit_buckets_allocates_from_demand_and_matches_least_tokens_on_short_prompts():
    # Only prompts under 16K tokens: after the cold start every engine serves bucket 0, so no
    # engine idles in an empty bucket (the pool does not wait for 30 s rounds to find out).
    t = synthetic_trace(3000, rate_per_s=20.0, rng=4)
    t = dataclasses.replace(
        t, total_tokens=np.minimum(t.total_tokens, 16000),
        cached_tokens=np.minimum(t.cached_tokens, 8000),
    )  # fmt: skip
    t = scale_to_utilization(t, 0.7, num_ranks=16, cost=H800)[0]
    pol = PREFILL_POLICIES["lbkit_buckets"](4, 4, cost=H800, rng=0)
    run = simulate_prefill(t, pol, num_engines=4, ranks_per_engine=4, cost=H800)
    stats = pol.balancer.statistics()
    assert stats.bucket_engines == (4, 0, 0, 0) and stats.queued == 0
    pol.balancer._check()
    ref = simulate_prefill(t, "least_tokens", num_engines=4, ranks_per_engine=4, cost=H800)
    a, b = prefill_metrics(run), prefill_metrics(ref)
    assert a["finished"] == b["finished"] == len(t)
    assert a["ttft_p99_s"] <= 1.5 * b["ttft_p99_s"]


def test_lbkit_options_are_the_documented_ones():
    pol = PREFILL_POLICIES["lbkit"](2, 2, cost=H800)
    cfg = pol.balancer.state_dict()["config"]
    # the measured configuration is the default one
    assert cfg == PrefillBalancer(2, 2, cost=H800).state_dict()["config"]
    assert cfg["choice"]["rule"] == "lockstep" and cfg["buckets"]["edges"] == []
    buckets = PREFILL_POLICIES["lbkit_buckets"](2, 2, cost=H800).balancer
    assert buckets.buckets == LBKIT_BUCKET_OPTIONS["buckets"]
    assert buckets.choice == LBKIT_BUCKET_OPTIONS["choice"] and buckets.rounds.cold_start_s == 5.0
    least = PREFILL_POLICIES["lbkit_least_load"](2, 2, cost=H800).balancer
    assert least.choice.rule == "least_load"
