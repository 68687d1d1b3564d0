"""Plan time of re-planning at DeepSeek-V3 sizes (58 x 256), side by side with a fresh plan.

Loads: the DeepSeek-V3 expert-load trace ``prefill_in1024`` (SGLang ``logical_count``, layers
3-60) planned fresh by lbkit, then re-planned for the same loads drifted by lognormal sigma 0.1;
without the trace directory, lognormal loads (sigma 1). Each group times, on the same input:

- ``lbkit replan``: :func:`lbkit.eplb.replan.replan_experts` (default: mean scope, 1%);
- ``lbkit scheduler``: ``EplbScheduler.maybe_rebalance`` after one recording of the new loads;
- ``lbkit fresh``: :func:`lbkit.eplb.rebalance_experts` of the new loads;
- ``deepseek fresh``: DeepSeek's reference ``rebalance_experts`` of the new loads, when
  ``LBKIT_DEEPSEEK_EPLB`` names a copy of its ``eplb.py`` and torch is importable.

The target of re-planning is at most a quarter of ``deepseek fresh``'s time; the ratio is taken
from one run (``pytest benchmarks/bench_eplb_replan.py --benchmark-enable``). JIT warmed up first;
``extra_info`` records moves and moe_lb.
"""

from __future__ import annotations

import numpy as np
import pytest
from benchmarks.run_record import REPLAN_SHAPES, deepseek_eplb, replan_loads

import lbkit
from lbkit.eplb import moe_lb, rebalance_experts
from lbkit.eplb.replan import replan_experts
from lbkit.eplb.scheduler import EplbScheduler

SHAPES = REPLAN_SHAPES


def _loads() -> tuple[np.ndarray, np.ndarray]:
    w0, w1, _ = replan_loads()
    return w0, w1


def _id(shape) -> str:
    slots, gpus, _, policy = shape
    return f"58x256-{gpus}gpu-{slots}slots-{policy}"


@pytest.fixture(scope="module", autouse=True)
def _warm():
    lbkit.warmup(packages=("eplb",))


def _case(shape):
    slots, gpus, nodes, policy = shape
    w0, w1 = _loads()
    old = rebalance_experts(w0, slots, 8, nodes, gpus, policy=policy).phy2log
    return w1, old, slots, nodes, gpus, policy


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def bench_lbkit_replan(benchmark, shape):
    w1, old, slots, nodes, gpus, policy = _case(shape)
    benchmark.group = f"replan|{_id(shape)}"
    res = benchmark(replan_experts, w1, old, slots, 8, nodes, gpus, policy=policy)
    fresh = moe_lb(w1, rebalance_experts(w1, slots, 8, nodes, gpus, policy=policy).phy2log,
                   num_gpus=gpus)  # fmt: skip
    assert res.moe_lb.mean() <= fresh.mean() * 1.01 * (1 + 1e-9)
    benchmark.extra_info.update(
        method="lbkit replan",
        moves_share=float(res.num_moves.sum() / old.size),
        moe_lb_mean=float(res.moe_lb.mean()),
        fresh_moe_lb_mean=float(fresh.mean()),
    )


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def bench_lbkit_scheduler(benchmark, shape):
    w1, old, slots, nodes, gpus, policy = _case(shape)
    benchmark.group = f"replan|{_id(shape)}"

    def run():
        s = EplbScheduler(w1.shape[0], w1.shape[1], slots, 8, nodes, gpus, policy=policy,
                          window=1, min_interval_s=0.0, initial_phy2log=old)  # fmt: skip
        s.record(w1)
        return s.maybe_rebalance(now_s=0.0)

    d = benchmark(run)
    benchmark.extra_info.update(method="lbkit scheduler", moves=int(d.num_moves))


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def bench_lbkit_fresh(benchmark, shape):
    w1, _, slots, nodes, gpus, policy = _case(shape)
    benchmark.group = f"replan|{_id(shape)}"
    benchmark(rebalance_experts, w1, slots, 8, nodes, gpus, policy=policy)
    benchmark.extra_info.update(method="lbkit fresh")


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def bench_deepseek_fresh(benchmark, shape):
    ds, torch = deepseek_eplb()
    if ds is None:
        pytest.skip("LBKIT_DEEPSEEK_EPLB is not set, or torch is missing")
    w1, _, slots, nodes, gpus, policy = _case(shape)
    groups, n = (8, nodes) if policy == "hierarchical" else (1, 1)
    benchmark.group = f"replan|{_id(shape)}"
    out = benchmark(ds.rebalance_experts, torch.tensor(w1).float(), slots, groups, n, gpus)
    benchmark.extra_info.update(
        method="deepseek fresh",
        moe_lb_mean=float(moe_lb(w1, out[0].numpy(), num_gpus=gpus).mean()),
    )
