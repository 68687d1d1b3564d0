"""Plan time of re-planning (``replan_experts``) at DeepSeek-V3 sizes; JIT warmed up first."""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.eplb import _kernels, _replan_kernels, drift, rebalance_experts, synthetic_expert_load
from lbkit.eplb.replan import replan_experts


@pytest.mark.parametrize(("r", "g", "n"), [(288, 32, 4), (320, 64, 8)])
@pytest.mark.parametrize("policy", ["global", "hierarchical"])
def bench_replan_experts(benchmark, r, g, n, policy):
    _kernels.warmup()
    _replan_kernels.warmup()
    w = synthetic_expert_load(58, 256, sigma=1.0, rng=0)
    old = rebalance_experts(w, r, 8, n, g, policy=policy).phy2log
    w2 = drift(w, sigma=0.1, rng=1)
    benchmark.group = f"replan_experts|58x256/{r}/{g}/{policy}"
    res = benchmark(replan_experts, w2, old, r, 8, n, g, policy=policy)
    assert (res.moe_lb <= res.previous_moe_lb + 1e-12).all()
    assert np.isfinite(res.moe_lb).all()
