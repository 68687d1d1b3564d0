"""Plan time of rebalance_experts at DeepSeek-V3 sizes (58 layers x 256 experts), greedy and
default side by side, and DeepSeek's own code in the same run when ``LBKIT_DEEPSEEK_EPLB`` points
at a copy of its ``eplb.py`` and torch is importable. ``extra_info`` records moe_lb mean/worst
and the lower bound for the docs generator."""

from __future__ import annotations

import numpy as np
import pytest
from benchmarks.run_record import deepseek_eplb

import lbkit
from lbkit.eplb import METHODS, lower_bound, moe_lb, rebalance_experts

SHAPES = [  # (slots, gpus, nodes, policy)
    (288, 32, 4, "global"),
    (320, 64, 8, "global"),
    (384, 64, 8, "global"),
    (320, 64, 8, "hierarchical"),
    (288, 144, 1, "global"),
]


def _weight() -> np.ndarray:
    return np.random.default_rng(0).lognormal(0.0, 1.0, (58, 256)) * 1000


def _id(shape) -> str:
    slots, gpus, _, policy = shape
    return f"58x256-{gpus}gpu-{slots}slots-{policy}"


@pytest.fixture(scope="module", autouse=True)
def _warm():
    lbkit.warmup(packages=("eplb",))


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def bench_rebalance_experts(benchmark, method, shape):
    slots, gpus, nodes, policy = shape
    weight = _weight()
    benchmark.group = f"rebalance_experts|{_id(shape)}"
    plan = benchmark(rebalance_experts, weight, slots, 8, nodes, gpus, method=method, policy=policy)
    lb = moe_lb(weight, plan.phy2log, num_gpus=gpus)
    bound = lower_bound(weight, slots, 8, nodes, gpus, policy=policy)
    assert (lb >= bound * (1 - 1e-9)).all()
    benchmark.extra_info.update(
        method=method,
        moe_lb_mean=float(lb.mean()),
        moe_lb_worst=float(lb.max()),
        lower_bound_mean=float(bound.mean()),
    )


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def bench_deepseek_reference(benchmark, shape):
    ds, torch = deepseek_eplb()
    if ds is None:
        pytest.skip("LBKIT_DEEPSEEK_EPLB is not set, or torch is missing")
    slots, gpus, nodes, policy = shape
    weight = _weight()
    groups, n = (8, nodes) if policy == "hierarchical" else (1, 1)
    benchmark.group = f"rebalance_experts|{_id(shape)}"
    out = benchmark(
        ds.rebalance_experts_hierarchical, torch.tensor(weight).float(), slots, groups, n, gpus
    )
    lb = moe_lb(weight, out[0].numpy(), num_gpus=gpus)
    benchmark.extra_info.update(
        method="deepseek", moe_lb_mean=float(lb.mean()), moe_lb_worst=float(lb.max())
    )
