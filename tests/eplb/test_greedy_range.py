"""DeepSeek's greedy method computes in float32: loads beyond float32's range are scaled by a
power of two first, which changes no rounding, so the plan is that of the same loads in a
smaller unit (and no overflow warning is raised)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lbkit.eplb import moe_lb, rebalance_experts

from .strategies import instances


@given(inst=instances(max_layers=2, policy="any"), k=st.integers(0, 990))
def test_greedy_plans_do_not_depend_on_a_power_of_two_unit(inst, k):
    weight, r, groups, nodes, gpus, policy = inst
    w = weight / max(float(weight.max()), 1.0) * 2.0**20  # largest load at most 2**20
    small = rebalance_experts(w, r, groups, nodes, gpus, policy=policy, method="greedy")
    big = rebalance_experts(np.ldexp(w, k), r, groups, nodes, gpus, policy=policy, method="greedy")
    np.testing.assert_array_equal(big.phy2log, small.phy2log)
    np.testing.assert_array_equal(big.logcnt, small.logcnt)


def test_loads_near_the_float64_limit():
    unit = np.array([[10.0, 5, 1, 3, 2, 1, 4, 1]])
    w = np.vstack([unit * 1e38, unit * 1e307])  # 1e38 * 10 is beyond float32's largest finite
    plan = rebalance_experts(w, 12, 1, 1, 4, method="greedy")
    ref = rebalance_experts(np.vstack([unit, unit]), 12, 1, 1, 4, method="greedy")
    np.testing.assert_array_equal(plan.phy2log, ref.phy2log)
    lb = moe_lb(w, plan.phy2log, num_gpus=4)
    assert np.isfinite(lb).all() and np.allclose(lb, moe_lb(unit, ref.phy2log[:1], num_gpus=4))
