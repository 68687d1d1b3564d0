"""Decode-only replays (a trace straight into the decode pool) and the steady-state window."""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.core import PRESETS
from lbkit.sim import _decode_kernels as K
from lbkit.sim.engine import simulate_decode, simulate_prefill
from lbkit.sim.metrics import decode_metrics
from lbkit.sim.traces import Trace
from lbkit.sim.workload import synthetic_trace

UNIT = PRESETS["unit"]
H800 = PRESETS["h800_dsv3"]


def test_decode_only_equals_a_prefill_run_with_the_same_handovers():
    t = Trace(arrival_s=[0.0, 0.0], total_tokens=[100, 300], output_tokens=[3, 2])
    pre = simulate_prefill(t, "round_robin", num_engines=1, ranks_per_engine=2,
                           cost=UNIT.prefill, budget_s=1000.0)  # fmt: skip
    moved = Trace(arrival_s=pre.finish_s, total_tokens=t.total_tokens, output_tokens=[3, 2])
    a = simulate_decode(pre, "least_kv", num_engines=1, ranks_per_engine=2, cost=UNIT.decode)
    b = simulate_decode(moved, "least_kv", num_engines=1, ranks_per_engine=2, cost=UNIT.decode)
    for field in ("handover_s", "rank", "finish_s"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert (a.step_max_s, a.count_imbalance_s, a.num_steps) == (
        b.step_max_s, b.count_imbalance_s, b.num_steps,
    )  # fmt: skip


@pytest.mark.parametrize("policy", ["round_robin", "lbkit"])
def test_window_over_everything_equals_the_totals_and_inner_windows_are_parts(policy):
    t = synthetic_trace(600, rate_per_s=50.0, rng=2)
    full = simulate_decode(t, policy, num_engines=2, ranks_per_engine=4, cost=H800.decode,
                           window_s=(-1.0, np.inf))  # fmt: skip
    w = full.window_sums
    assert w[K.DACC_MAX] == full.step_max_s and w[K.DACC_MEAN] == full.step_mean_s
    assert w[K.DACC_TIME] == full.step_time_s and w[K.DACC_BIMB] == full.count_imbalance_s
    assert w[K.DACC_STEPS] == full.num_steps and w[K.DACC_TOKENS] == full.tokens_generated
    mid = float(t.arrival_s[-1]) / 2
    a = simulate_decode(t, policy, num_engines=2, ranks_per_engine=4, cost=H800.decode,
                        window_s=(-1.0, mid))  # fmt: skip
    b = simulate_decode(t, policy, num_engines=2, ranks_per_engine=4, cost=H800.decode,
                        window_s=(mid, np.inf))  # fmt: skip
    np.testing.assert_allclose(a.window_sums + b.window_sums, w, rtol=1e-12)
    np.testing.assert_array_equal(a.finish_s, full.finish_s)  # measuring changes nothing
    m = decode_metrics(b)["window"]
    assert m["steps"] == int(b.window_sums[K.DACC_STEPS]) > 0
    assert 0 < m["balance_efficiency"] <= 1 and m["count_imbalance"] >= m["count_imbalance_floor"]
    assert "window" not in decode_metrics(simulate_decode(
        t, policy, num_engines=2, ranks_per_engine=4, cost=H800.decode))  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"window_s": (2.0, 1.0)}, ValueError, "window_s: stop must be after start"),
        ({"window_s": 3.0}, TypeError, "window_s: must be a pair"),
        ({"window_s": (float("nan"), 1.0)}, ValueError, r"window_s\[0\]: must not be NaN"),
    ],
)
def test_bad_window(kwargs, exc, match):
    t = Trace(arrival_s=[0.0, 1.0], total_tokens=[10, 10], output_tokens=[2, 2])
    with pytest.raises(exc, match=match):
        simulate_decode(t, "round_robin", num_engines=1, ranks_per_engine=2,
                        cost=UNIT.decode, **kwargs)  # fmt: skip


def test_decode_refuses_other_inputs():
    with pytest.raises(TypeError, match="prefill: must be a PrefillRun or a Trace"):
        simulate_decode([1.0], "round_robin", cost=UNIT.decode)


def test_batch_per_rank_counts_each_engine_step_once():
    """Two engines of one rank, one request each, running side by side: every engine step runs
    a batch of one on its rank (a mean of 1, whatever the number of engines)."""
    t = Trace(arrival_s=[0.0, 0.0], total_tokens=[100, 100], output_tokens=[6, 6])
    run = simulate_decode(t, "least_requests", num_engines=2, ranks_per_engine=1,
                          cost=PRESETS["unit"].decode, window_s=(0.0, 100.0))  # fmt: skip
    m = decode_metrics(run)
    assert run.num_steps == 10 and run.tokens_generated == 10
    assert m["batch_per_rank_mean"] == 1.0 and m["window"]["batch_per_rank_mean"] == 1.0


@pytest.mark.parametrize(("engines", "ranks"), [(1, 8), (2, 4)])
def test_decode_batch_calibration_with_several_engines(engines, ranks):
    from lbkit.sim.bench import scale_to_decode_batch

    t = synthetic_trace(1500, rate_per_s=20.0, rng=2)
    _, _, got = scale_to_decode_batch(t, 6.0, num_engines=engines, ranks_per_engine=ranks,
                                      cost=PRESETS["h800_dsv3"].decode)  # fmt: skip
    assert 5.0 < got < 7.0
