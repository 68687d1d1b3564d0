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


def test_lbkit_knows_every_running_step_when_it_routes():
    """At every routing the ``lbkit`` policy's balancer knows when each engine's running step
    ends (the engines report each step at its start); the ``lbkit_nosteps`` ablation knows
    none."""
    from lbkit.sim.policies import LbkitPrefill

    class Checked(LbkitPrefill):
        routed = 0

        def route(self, request, total_tokens, cached_tokens, /, *, now_s, view):
            f = super().route(request, total_tokens, cached_tokens, now_s=now_s, view=view)
            known = self.balancer.statistics().engine_step_end_s
            for e, end in enumerate(view.step_end_s.tolist()):
                if end < np.inf:
                    assert known[e] == (end if self._steps else -np.inf)
            self.routed += 1
            return f

    t = synthetic_trace(400, rate_per_s=30.0, rng=5)
    for steps in (True, False):
        pol = Checked(2, 2, cost=H800, rng=0, step_reports=steps)
        simulate_prefill(t, pol, num_engines=2, ranks_per_engine=2, cost=H800)
        stats = pol.balancer.statistics()
        assert pol.routed == len(t) and stats.steps_stale == 0
        assert (stats.steps_reported > 0) == steps
        pol.balancer._check()


def test_a_short_prompt_joins_the_engine_whose_step_ends_first():
    """Two engines of two ranks, each busy with one long prompt on rank 0, their steps out of
    phase: a short prompt goes to the idle rank of the engine whose running step ends first
    with step reports, and finishes sooner than without them (the busy engines then tie and
    the lowest index wins)."""
    from lbkit.sim.traces import Trace

    # engine 0 steps from 0.0 (a 60K prompt), engine 1 from 0.5 (a 200K prompt, which the
    # growth charge keeps off engine 0's idle rank); at 2.6 engine 0's step runs from 2.44 to
    # 3.31, engine 1's from 2.09 to 2.94
    t = Trace(arrival_s=[0.0, 0.5, 2.6], total_tokens=[60_000, 200_000, 800],
              output_tokens=[1, 1, 1])  # fmt: skip
    runs = {}
    for name in ("lbkit", "lbkit_nosteps"):
        runs[name] = simulate_prefill(t, name, num_engines=2, ranks_per_engine=2, cost=H800)
    with_steps, without = runs["lbkit"], runs["lbkit_nosteps"]
    assert with_steps.rank[:2].tolist() == without.rank[:2].tolist() == [0, 2]
    assert without.rank[2] == 1 and with_steps.rank[2] == 3
    assert with_steps.ttft_s[2] < without.ttft_s[2] - 0.3
