"""Engine model: a hand-computed scenario, conservation, work conservation, determinism, kernels."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.prefill import plan_chunks
from lbkit.sim import _plan_kernels, _prefill_kernels
from lbkit.sim import _prefill_layout as K
from lbkit.sim.engine import (
    scale_to_utilization,
    simulate_decode,
    simulate_prefill,
    utilization_factor,
)
from lbkit.sim.engine import warmup as engine_warmup
from lbkit.sim.metrics import decode_metrics, prefill_metrics
from lbkit.sim.traces import Trace
from lbkit.sim.workload import synthetic_trace

UNIT = PRESETS["unit"]
H800 = PRESETS["h800_dsv3"]


def test_hand_computed_two_engines_two_ranks():
    # unit cost: step = 1 + sum(c + 0.001 c p + 0.0005 c^2); budget 1000 s (every request whole).
    # round robin over flat ranks: r0 -> (e0, r0), r1 -> (e0, r1), r2 -> (e1, r0).
    t = Trace(arrival_s=[0.0, 0.0, 10.0], total_tokens=[100, 300, 200], output_tokens=[3, 2, 1])
    run = simulate_prefill(t, "round_robin", num_engines=2, ranks_per_engine=2,
                           cost=UNIT.prefill, budget_s=1000.0)  # fmt: skip
    assert run.rank.tolist() == [0, 1, 2]
    # engine 0 steps at 0 with ranks 106 s and 346 s -> all finish at 346.
    # engine 1 steps at 10 with 1 + 200 + 20 = 221 s -> 231.
    np.testing.assert_allclose(run.finish_s, [346.0, 346.0, 231.0], rtol=1e-15)
    np.testing.assert_allclose(run.alone_s, [106.0, 346.0, 221.0], rtol=1e-15)
    # balance: engine 0 mean (106 + 346)/2 = 226, max 346; engine 1 mean 110.5, max 221.
    assert run.step_mean_s == pytest.approx(226.0 + 110.5)
    assert run.step_max_s == pytest.approx(346.0 + 221.0)
    assert run.tokens_computed == 600
    m = prefill_metrics(run)
    assert m["balance_efficiency"] == pytest.approx(336.5 / 567.0)
    assert m["finished"] == 3 and m["refused"] == 0 and m["in_flight"] == 0
    # decode, one engine of two ranks: r2 (o = 1) finishes at handover 231; r0 and r1 arrive at
    # 346 and go to ranks 0 and 1. Step 1: max(1 + 1 + 0.1, 1 + 1 + 0.3) = 2.3; r1 done at
    # 348.3. Step 2: rank 0 has 1 request of 101 KV tokens: 2.101 (idle rank 1 pays 1) -> 350.401.
    dec = simulate_decode(run, "round_robin", num_engines=1, ranks_per_engine=2, cost=UNIT.decode)
    assert dec.rank.tolist() == [0, 1, -2]
    np.testing.assert_allclose(dec.finish_s, [350.401, 348.3, 231.0])
    np.testing.assert_allclose(dec.tpot_s[:2], [4.401 / 2, 2.3])
    dm = decode_metrics(dec)
    assert dm["balance_efficiency"] == pytest.approx(((2.1 + 2.3) / 2 + (2.101 + 1) / 2) / 4.401)
    assert dm["finished"] == 3 and dm["single_token"] == 1


def test_arrival_during_a_step_waits_and_ties_go_to_the_arrival():
    t = Trace(arrival_s=[0.0, 50.0, 106.0], total_tokens=[100, 100, 100], output_tokens=[1, 1, 1])
    run = simulate_prefill(t, "least_requests", num_engines=1, ranks_per_engine=1,
                           cost=UNIT.prefill, budget_s=1000.0)  # fmt: skip
    # r1 arrives mid-step and waits for the step ending at 106; r2 arrives exactly at 106 and
    # joins the same next step (two requests: 1 + 2 * 105 = 211).
    np.testing.assert_allclose(run.finish_s, [106.0, 317.0, 317.0], rtol=1e-15)


def _trace(n=400, seed=1, rate=40.0):
    return synthetic_trace(n, rate_per_s=rate, long_share={"64K-256K": 0.05}, rng=seed)


@pytest.mark.parametrize("horizon", [None, 5.0, 30.0])
def test_conservation_and_work_conservation(horizon):
    t = _trace()
    run = simulate_prefill(t, "least_tokens", num_engines=3, ranks_per_engine=2,
                           cost=H800.prefill, horizon_s=horizon)  # fmt: skip
    m = prefill_metrics(run)  # asserts conservation itself; check the sums explicitly too
    assert m["arrived"] == m["finished"] + m["refused"] + m["in_flight"]
    uncached = t.total_tokens - t.cached_tokens
    fin = run.finished
    if horizon is None:
        assert m["in_flight"] == 0 and m["arrived"] == len(t)
        assert run.tokens_computed == int(uncached.sum())
    else:
        assert m["arrived"] == int((t.arrival_s <= horizon).sum())
        assert int(uncached[fin].sum()) <= run.tokens_computed < int(uncached[run.rank >= 0].sum())
    dec = simulate_decode(run, "least_kv", num_engines=1, ranks_per_engine=8, cost=H800.decode,
                          horizon_s=horizon)  # fmt: skip
    dm = decode_metrics(dec)
    assert dm["arrived"] == dm["finished"] + dm["refused"] + dm["in_flight"]
    if horizon is None:
        assert dm["finished"] == m["finished"]
        assert dec.tokens_generated == int((t.output_tokens[fin] - 1).sum())


def test_decode_capacity_makes_requests_wait():
    t = Trace(arrival_s=[0.0, 0.0, 0.0], total_tokens=[10, 10, 10], output_tokens=[50, 50, 50])
    run = simulate_prefill(t, "round_robin", num_engines=1, ranks_per_engine=3,
                           cost=UNIT.prefill, budget_s=1000.0)  # fmt: skip
    dec = simulate_decode(run, "least_requests", num_engines=1, ranks_per_engine=2,
                          cost=UNIT.decode, max_batch=1)  # fmt: skip
    m = decode_metrics(dec)
    assert (m["finished"], m["refused"]) == (3, 0)
    # the third waits for the first rank to free: it starts when request 0 finishes
    assert dec.wait_s[2] == dec.finish_s[0] - dec.handover_s[2] > 0


def test_determinism_same_inputs_same_results():
    t = _trace(300)
    a = simulate_prefill(t, "power_of_two", num_engines=2, ranks_per_engine=2, cost=H800.prefill,
                         rng=3)  # fmt: skip
    b = simulate_prefill(t, "power_of_two", num_engines=2, ranks_per_engine=2, cost=H800.prefill,
                         rng=3)  # fmt: skip
    assert prefill_metrics(a) == prefill_metrics(b)
    np.testing.assert_array_equal(a.finish_s, b.finish_s)


def test_utilization_scaling_meets_its_definition():
    t = _trace(500)
    f = utilization_factor(t, 0.7, num_ranks=8, cost=H800.prefill)
    scaled, f2 = scale_to_utilization(t, 0.7, num_ranks=8, cost=H800.prefill)
    assert f == f2
    # Offered work in rank-seconds: the local quota plus the shared expert work of every token.
    uncached = t.total_tokens - t.cached_tokens
    work = H800.prefill.quota(uncached, t.cached_tokens).sum()
    work += H800.prefill.moe_s_per_token * uncached.sum()
    assert work / (scaled.arrival_s[-1] * 8) == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_engines": 0}, "num_engines: must be >= 1"),
        ({"ranks_per_engine": 0}, "ranks_per_engine: must be >= 1"),
        ({"budget_s": 0.0}, "budget_s: must be > 0"),
        ({"report_quantum": 2.0}, "report_quantum: must be <= 1"),
    ],
)
def test_bad_input(kwargs, match):
    t = _trace(5)
    opts = {"num_engines": 1, "ranks_per_engine": 1, "cost": UNIT.prefill, **kwargs}
    with pytest.raises(ValueError, match=match):
        simulate_prefill(t, "round_robin", **opts)
    with pytest.raises(ValueError, match="unknown prefill policy"):
        simulate_prefill(t, "fastest", num_engines=1, ranks_per_engine=1, cost=UNIT.prefill)
    with pytest.raises(ValueError, match="utilization: must be > 0"):
        utilization_factor(t, 0.0, num_ranks=1, cost=UNIT.prefill)


@given(
    rem=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    pre=st.lists(st.integers(0, 20000), min_size=6, max_size=6),
    budget=st.floats(0.5, 5000.0),
    min_chunk=st.integers(1, 64),
    align=st.sampled_from([1, 16, 64]),
)
def test_plan_kernel_matches_plan_chunks(rem, pre, budget, min_chunk, align):
    pre = pre[: len(rem)]
    cost = UNIT.prefill
    want = plan_chunks(rem, pre, cost=cost, budget_s=budget, min_chunk=min_chunk, align=align)
    RI = np.zeros((K.N_RI, len(rem)), dtype=np.int64)
    RI[K.RI_REM] = rem
    RI[K.RI_PREFIX] = pre
    RI[K.RI_NEXT] = [*range(1, len(rem)), -1]
    P = np.zeros(K.N_P)
    P[: K.P_BIN_S + 1] = [cost.a, cost.b, cost.k, cost.q, cost.gamma, budget, min_chunk, align, 1,
                          0, 1.0]  # fmt: skip
    for kernel in (_plan_kernels.plan_rank, _plan_kernels.plan_rank.py_func):
        count, last, t = kernel(RI, P, 0)
        assert count == len(want.chunk_tokens)
        assert last == want.chunk_tokens[-1]
        assert t == want.step_time_s


@given(
    queue=st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 50_000)), min_size=1, max_size=3),
    data=st.data(),
)
def test_plan_kernel_matches_plan_chunks_on_chunk_boundaries(queue, data):
    # The budget is exactly the step time of a schedule (summed as the plan sums it), where
    # both planners must correct the solver's chunk against their running sum the same way.
    cost = H800.prefill
    rem = [r for r, _ in queue]
    pre = [p for _, p in queue]
    k = data.draw(st.integers(0, len(rem) - 1))
    c = data.draw(st.integers(1, rem[k]))
    budget = cost.a
    for r, p in zip([*rem[:k], c], pre[: k + 1], strict=True):
        budget += r * (cost.linear_s_per_token + cost.k * p + cost.q * r) + cost.gamma * p
    want = plan_chunks(rem, pre, cost=cost, budget_s=budget)
    assert want.chunk_tokens.sum() >= sum(rem[:k]) + c
    RI = np.zeros((K.N_RI, len(rem)), dtype=np.int64)
    RI[K.RI_REM] = rem
    RI[K.RI_PREFIX] = pre
    RI[K.RI_NEXT] = [*range(1, len(rem)), -1]
    P = np.zeros(K.N_P)
    P[: K.P_BIN_S + 1] = [cost.a, cost.b, cost.k, cost.q, cost.gamma, budget, 1, 1, 1, 0, 1.0]
    P[K.P_MOE] = cost.moe_s_per_token
    for kernel in (_plan_kernels.plan_rank, _plan_kernels.plan_rank.py_func):
        count, last, t = kernel(RI, P, 0)
        assert count == len(want.chunk_tokens)
        assert last == want.chunk_tokens[-1]
        assert t == want.step_time_s


@pytest.mark.jit_parity(
    kernels=(
        _prefill_kernels.prefill_advance,
        _prefill_kernels.prefill_admit,
        _plan_kernels.prefill_alone,
    )
)
def test_jit_parity_of_a_whole_replay(monkeypatch):
    t = _trace(60)
    jit = simulate_prefill(t, "least_tokens", num_engines=2, ranks_per_engine=2,
                           cost=H800.prefill)  # fmt: skip
    for module, name in ((_prefill_kernels, "prefill_advance"), (_prefill_kernels, "prefill_admit"),
                         (_plan_kernels, "prefill_alone")):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name).py_func)
    py = simulate_prefill(t, "least_tokens", num_engines=2, ranks_per_engine=2,
                          cost=H800.prefill)  # fmt: skip
    np.testing.assert_array_equal(jit.finish_s, py.finish_s)
    assert jit.step_max_s == py.step_max_s


def test_warmup_runs():
    engine_warmup()
