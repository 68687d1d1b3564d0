"""Replay speed of the simulator per policy (requests per second = requests / mean time)."""

from __future__ import annotations

import pytest

from lbkit.core import PRESETS
from lbkit.sim.engine import scale_to_utilization, simulate_decode, simulate_prefill, warmup
from lbkit.sim.policies import PREFILL_POLICIES
from lbkit.sim.policies_decode import DECODE_POLICIES
from lbkit.sim.workload import default_workload

COST = PRESETS["h800_dsv3"]
N = 2000


@pytest.fixture(scope="module")
def trace():
    warmup()
    return scale_to_utilization(default_workload(num_requests=N), 0.8, num_ranks=64,
                                cost=COST.prefill)[0]  # fmt: skip


@pytest.mark.parametrize("sharing", ["off", "level"])
@pytest.mark.parametrize("policy", list(PREFILL_POLICIES))
def bench_prefill_replay(benchmark, trace, policy, sharing):
    benchmark.group = f"simulate_prefill|{N}"
    run = benchmark(simulate_prefill, trace, policy, num_engines=16, ranks_per_engine=4,
                    cost=COST.prefill, work_sharing=sharing)  # fmt: skip
    assert run.finished.sum() == N


@pytest.mark.parametrize("policy", list(DECODE_POLICIES))
def bench_decode_replay(benchmark, trace, policy):
    benchmark.group = f"simulate_decode|{N}"
    pre = simulate_prefill(trace, "least_tokens", num_engines=16, ranks_per_engine=4,
                           cost=COST.prefill)  # fmt: skip
    run = benchmark(simulate_decode, pre, policy, cost=COST.decode)
    assert run.finished.sum() == N
