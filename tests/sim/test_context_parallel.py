"""lbkit on context-parallel prefill engines (``work_sharing="split"``): engines, not ranks."""

from __future__ import annotations

import pytest

from lbkit.core import PRESETS
from lbkit.sim.bench import run_bench
from lbkit.sim.engine import scale_to_utilization, simulate_prefill
from lbkit.sim.metrics import prefill_metrics
from lbkit.sim.policies import LBKIT_BUCKET_OPTIONS, LBKIT_CP_OPTIONS, context_parallel_policy
from lbkit.sim.workload import synthetic_trace

BASELINES = ("round_robin", "random", "least_requests", "least_tokens", "power_of_two")


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_scores_beat_every_baseline_on_long_prompts(seed):
    """3% of prompts in 64K-256K, 4 engines x 4 ranks at utilisation 0.7, idle ranks sharing
    a long prompt's chunks. A long prompt sent to the engine with the least mean quota load
    gets that engine's idle ranks; rank-level rules stack long prompts on one engine's ranks.
    lbkit's p99 TTFT is at most 0.8 x the best baseline's (measured 0.52 and 0.71 x, 78.7 s vs
    power of two's 111.5 s on seed 0) and below lbkit's own rank-level choice."""
    trace = synthetic_trace(3000, rate_per_s=1.0, long_share={"64K-256K": 0.03}, rng=seed)
    rep = run_bench(trace, utilization=0.7, prefill_engines=4, ranks_per_engine=4,
                    decode_policies=[], work_sharing="split", seed=seed).report  # fmt: skip
    pre = rep["prefill"]
    best = min(pre[b]["ttft_p99_s"] for b in BASELINES)
    assert pre["lbkit"]["ttft_p99_s"] <= 0.8 * best
    # A diagnostic: 0.941 on seed 1 since the engines pay the shared expert work of SPEC section
    # 8 (utilisation then counts it, so the same U offers less local work); 0.95 before.
    assert pre["lbkit"]["balance_efficiency"] >= 0.93
    assert pre["lbkit"]["finished"] == pre["power_of_two"]["finished"] == 3000
    # the rank-level lbkit (the default options) under the same engines
    cost = PRESETS["h800_dsv3"].prefill
    scaled, _ = scale_to_utilization(trace, 0.7, num_ranks=16, cost=cost)
    ranks = simulate_prefill(scaled, "lbkit", num_engines=4, ranks_per_engine=4, cost=cost,
                             work_sharing="split", rng=seed)  # fmt: skip
    assert pre["lbkit"]["ttft_p99_s"] < prefill_metrics(ranks)["ttft_p99_s"]


def test_context_parallel_policy_options():
    cost = PRESETS["unit"].prefill
    pol = context_parallel_policy("lbkit", 4, 2, cost=cost)
    assert pol.balancer.choice == LBKIT_CP_OPTIONS["choice"]
    bucketed = context_parallel_policy("lbkit_buckets", 4, 2, cost=cost)
    assert bucketed.name == "lbkit_buckets" and len(bucketed.balancer.edges) == 3
    assert bucketed.balancer.choice.rule == "engine_mean"
    assert bucketed.balancer.choice.spill_ratio == LBKIT_BUCKET_OPTIONS["choice"].spill_ratio
    with pytest.raises(ValueError, match="name: must be 'lbkit' or 'lbkit_buckets'"):
        context_parallel_policy("round_robin", 4, 2, cost=cost)
