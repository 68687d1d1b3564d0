"""Plan time of re-planning (``replan_experts``) at DeepSeek-V3 sizes; JIT warmed up first.

Both tolerance scopes: ``"mean"`` (default: candidates at several per-layer tolerances, then the
fewest moves with the mean ``moe_lb`` within the tolerance) and ``"layer"`` (one re-plan per
layer at the tolerance).
"""

from __future__ import annotations

import numpy as np
import pytest

import lbkit
from lbkit.eplb import (
    _replan_kernels,
    drift,
    moe_lb,
    rebalance_experts,
    synthetic_expert_load,
)
from lbkit.eplb.replan import replan_experts


@pytest.mark.parametrize("scope", ["mean", "layer"])
@pytest.mark.parametrize(("r", "g", "n"), [(288, 32, 4), (320, 64, 8)])
@pytest.mark.parametrize("policy", ["global", "hierarchical"])
def bench_replan_experts(benchmark, r, g, n, policy, scope):
    lbkit.warmup(packages=("eplb",))
    _replan_kernels.warmup()
    w = synthetic_expert_load(58, 256, sigma=1.0, rng=0)
    old = rebalance_experts(w, r, 8, n, g, policy=policy).phy2log
    w2 = drift(w, sigma=0.1, rng=1)
    benchmark.group = f"replan_experts|58x256/{r}/{g}/{policy}/{scope}"
    res = benchmark(replan_experts, w2, old, r, 8, n, g, policy=policy, tolerance_scope=scope)
    assert (res.moe_lb <= res.previous_moe_lb + 1e-12).all()
    assert np.isfinite(res.moe_lb).all()
    if scope == "mean":
        fresh = rebalance_experts(w2, r, 8, n, g, policy=policy).phy2log
        assert res.moe_lb.mean() <= moe_lb(w2, fresh, num_gpus=g).mean() * 1.01 * (1 + 1e-9)
