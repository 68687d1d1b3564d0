"""Decode KV capacity (back-pressure, preemption) and the shared MoE term of decode steps."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.core import PRESETS, DecodeCost
from lbkit.sim.engine import REFUSALS, simulate_decode
from lbkit.sim.metrics import decode_metrics
from lbkit.sim.policies_decode import DECODE_POLICIES, LbkitDecode
from lbkit.sim.traces import Trace
from lbkit.sim.workload import synthetic_trace

from .decode_reference import reference_decode

H800 = PRESETS["h800_dsv3"]
UNIT = PRESETS["unit"].decode


@dataclasses.dataclass(frozen=True)
class MoeCost(DecodeCost):
    """A decode cost with the shared-MoE fields (whether or not DecodeCost has them yet)."""

    b_moe: float = 0.0
    moe_lb: float = 1.0


def _trace(arrival, prompt, output):
    return Trace(arrival_s=arrival, total_tokens=prompt, output_tokens=output)


# ------------------------------------------------------------------ hand-computed timelines
def test_a_request_waits_for_capacity_then_runs():
    """One rank of 15 KV tokens, unit cost (1 + B + 0.001 S per step). A (10 tokens, 2 steps)
    runs 0 -> 2.01 -> 4.021; B (10 tokens) does not fit beside it, waits, and is admitted when
    A finishes: 4.021 -> 6.031 -> 8.042."""
    t = _trace([0.0, 0.0], [10, 10], [3, 3])
    run = simulate_decode(t, "least_requests", num_engines=1, ranks_per_engine=1, cost=UNIT,
                          max_kv_tokens=15)  # fmt: skip
    assert run.finish_s.tolist() == pytest.approx([4.021, 8.042], abs=1e-12)
    assert run.wait_s.tolist() == pytest.approx([0.0, 4.021], abs=1e-12)
    assert run.tpot_s[1] == pytest.approx(8.042 / 2)  # waiting counts in TPOT
    assert run.preemptions == 0 and not run.refused.any()
    m = decode_metrics(run)
    assert (m["finished"], m["refused"], m["waited"]) == (2, 0, 1)


def test_growth_preempts_the_newest_request_which_resumes_with_its_tokens():
    """Capacity 23. A (10 tokens, 3 steps) starts at 0; B (10 tokens, 2 steps) arrives at 1 and
    fits (20 <= 23). Step 2 (2.01 -> 5.031) holds 21 + 2 growth = 23. Step 3 would need
    23 + 2 > 23: B, the newest, is preempted at 5.031 (keeping its one generated token); A
    finishes at 7.043 and B, readmitted with 11 tokens, runs its last step to 9.054."""
    t = _trace([0.0, 1.0], [10, 10], [4, 3])
    run = simulate_decode(t, "least_requests", num_engines=1, ranks_per_engine=1, cost=UNIT,
                          max_kv_tokens=23)  # fmt: skip
    assert run.finish_s.tolist() == pytest.approx([7.043, 9.054], abs=1e-12)
    assert run.wait_s.tolist() == pytest.approx([0.0, 7.043 - 5.031], abs=1e-12)
    assert run.preemptions == 1
    assert run.tokens_generated == 3 + 2


def test_the_wait_queue_is_fifo_later_requests_do_not_overtake():
    """B (20 tokens) waits for A; C (5 tokens) would fit beside A but must wait behind B."""
    t = _trace([0.0, 0.1, 0.2], [20, 20, 5], [10, 2, 2])
    run = simulate_decode(t, "least_requests", num_engines=1, ranks_per_engine=1, cost=UNIT,
                          max_kv_tokens=30)  # fmt: skip
    admitted = run.handover_s + run.wait_s
    assert run.wait_s[1] > 0 and run.wait_s[2] > 0
    assert admitted[1] == admitted[2] == run.finish_s[0]  # both join when A leaves, B first
    assert run.finish_s[1] == run.finish_s[2]


def test_only_requests_that_never_fit_an_empty_rank_are_refused():
    t = _trace([0.0, 0.0, 0.0, 0.0], [95, 101, 60, 95], [10, 2, 50, 1])
    run = simulate_decode(t, "lbkit", num_engines=1, ranks_per_engine=2, cost=UNIT,
                          max_kv_tokens=105, kv_watermark_tokens=5)  # fmt: skip
    # 95 fits the admission limit 100 and grows to 104; 101 is above it; 60 + 49 > 105;
    # a single-token request finishes at handover whatever its length.
    assert run.refusal.tolist() == [0, 1, 2, 0]
    assert run.refused_by_reason == {"too_long": 1, "outgrows": 1}
    assert decode_metrics(run)["refused_by_reason"] == {"too_long": 1, "outgrows": 1}
    assert REFUSALS[0] == "too_long"
    with pytest.raises(ValueError, match="kv_watermark_tokens"):
        simulate_decode(t, "lbkit", cost=UNIT, max_kv_tokens=10, kv_watermark_tokens=10)


# ------------------------------------------------------------------ against the plain model
@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 18))
    arrival = sorted(draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)))
    prompt = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    cap = draw(st.none() | st.integers(12, 120))
    wm = 0 if cap is None else draw(st.integers(0, min(8, cap - 1)))
    return {
        "arrival": [x / 4.0 for x in arrival],  # ties in arrival time are common
        "prompt": prompt,
        "output": output,
        "ranks": draw(st.integers(1, 3)),
        "cap": cap,
        "wm": wm,
        "max_batch": draw(st.none() | st.integers(1, 3)),
        "moe": draw(st.sampled_from([0.0, 0.5, 3.0])),
        "combine": draw(st.sampled_from(["sum", "max"])),
    }


def _engine_and_reference(sc, window=None):
    cost = MoeCost(a=1.0, b=1.0, k=0.01, combine=sc["combine"], b_moe=sc["moe"] / 1.05,
                   moe_lb=1.05)  # fmt: skip
    t = _trace(sc["arrival"], sc["prompt"], sc["output"])
    run = simulate_decode(t, "least_requests", num_engines=1, ranks_per_engine=sc["ranks"],
                          cost=cost, max_kv_tokens=sc["cap"], kv_watermark_tokens=sc["wm"],
                          max_batch=sc["max_batch"], window_s=window)  # fmt: skip
    ref = reference_decode(sc["arrival"], sc["prompt"], sc["output"], ranks=sc["ranks"], a=1.0,
                           b=1.0, k=0.01, combine=sc["combine"], moe=cost.b_moe * cost.moe_lb,
                           max_kv_tokens=sc["cap"], watermark=sc["wm"],
                           max_batch=sc["max_batch"])  # fmt: skip
    return t, run, ref


@settings(max_examples=150, deadline=None)
@given(sc=scenarios())
def test_engine_matches_the_plain_model(sc):
    """Finish and wait times, refusals, preemptions and every step (with the shared MoE term)
    agree with the plain-Python engine."""
    _, run, ref = _engine_and_reference(sc)
    np.testing.assert_allclose(run.finish_s, ref.finish_s, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(run.wait_s, ref.wait_s, rtol=1e-12, atol=1e-9)
    assert run.refusal.tolist() == ref.refusal
    assert run.preemptions == ref.preemptions
    assert run.num_steps == len(ref.steps)
    assert run.step_time_s == pytest.approx(sum(d for _, d, _ in ref.steps), rel=1e-12)
    assert run.tokens_generated == sum(sum(c) for _, _, c in ref.steps)
    # conservation: every request finished or was refused with a reason, tokens conserved
    fin = run.finished
    assert (fin | run.refused).all() and not (fin & run.refused).any()
    out = np.asarray(sc["output"])
    assert run.tokens_generated == int((out[fin] - 1).sum())


@settings(max_examples=60, deadline=None)
@given(sc=scenarios(), w0=st.integers(0, 20), span=st.integers(1, 40))
def test_mean_running_per_rank_is_the_recounted_mean(sc, w0, span):
    """``mean_running_per_rank`` over a window = the mean over the steps that start in it of
    the ranks' running requests, recounted on the plain model's steps."""
    window = (w0 / 2.0, (w0 + span) / 2.0)
    _, run, ref = _engine_and_reference(sc, window)
    counts = [c for s, _, c in ref.steps if window[0] <= s < window[1]]
    expect = sum(sum(c) for c in counts) / max(len(counts), 1) / sc["ranks"]
    assert decode_metrics(run)["mean_running_per_rank"] == pytest.approx(expect, rel=1e-12)


def test_the_shared_term_raises_every_rank_by_the_engine_mean():
    """Two ranks with 3 and 1 requests: the step is the busier rank's local time plus
    b_moe * moe_lb * 4 / 2 (the routed experts run on all four requests' tokens)."""
    t = _trace([0.0] * 4, [10, 10, 10, 10], [2, 2, 2, 2])

    def step(cost):
        pol = _Fixed([0, 0, 1, 0])
        run = simulate_decode(t, pol, num_engines=1, ranks_per_engine=2, cost=cost)
        return run.step_time_s, run.step_mean_s

    base = MoeCost(a=1.0, b=1.0, k=0.01)
    moe = MoeCost(a=1.0, b=1.0, k=0.01, b_moe=2.0, moe_lb=1.25)
    assert step(base) == pytest.approx((1 + 3 + 0.3, (4.3 + 2.1) / 2))
    shared = 2.0 * 1.25 * 4 / 2
    assert step(moe) == pytest.approx((4.3 + shared, (4.3 + 2.1) / 2 + shared))


class _Fixed:
    """Routes request i to ``ranks[i]``."""

    def __init__(self, ranks):
        self.ranks = ranks

    def route(self, request, kv_tokens, /, *, now_s, view):
        return self.ranks[request]

    def observe(self, finished, /, *, now_s, view):
        pass


@pytest.mark.parametrize("name", list(DECODE_POLICIES))
def test_b_moe_zero_is_the_old_model(name):
    t = synthetic_trace(300, rate_per_s=80.0, rng=7)
    kw = {"num_engines": 2, "ranks_per_engine": 3, "rng": 3, "window_s": (0.5, 3.0)}
    old = simulate_decode(t, name, cost=H800.decode, **kw)
    new = simulate_decode(t, name, cost=MoeCost(**dataclasses.asdict(H800.decode)), **kw)
    for f in ("finish_s", "rank", "bin_mean_s", "bin_max_s", "window_sums"):
        assert np.array_equal(getattr(old, f), getattr(new, f), equal_nan=True), f
    for f in ("step_mean_s", "step_max_s", "step_time_s", "kv_imbalance_s", "num_steps"):
        assert getattr(old, f) == getattr(new, f), f
    assert old.preemptions == 0 and not old.wait_s.any()


# ------------------------------------------------------------------ policies and migration
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    cap=st.integers(6_000, 40_000),
    name=st.sampled_from([*DECODE_POLICIES, "migrate"]),
    engines=st.sampled_from([1, 2]),
)
def test_back_pressure_conserves_requests_and_tokens(seed, cap, name, engines):
    """Tight capacities, every policy (and lbkit migrating with transfer times): every request
    finishes or is refused with a reason, every token is generated once, the pool and the
    lbkit ledger end empty."""
    t = synthetic_trace(120, rate_per_s=300.0, rng=seed)
    pol = name
    extra = {}
    if name == "migrate":
        pol = LbkitDecode(engines, 2, rng=seed, migrate_every_s=0.02, max_migrations=2)
        extra = {"migration_latency_s": 0.002, "migration_s_per_kv_token": 1e-7}
    run = simulate_decode(t, pol, num_engines=engines, ranks_per_engine=2, cost=H800.decode,
                          max_kv_tokens=cap, rng=seed, **extra)  # fmt: skip
    fin = run.finished
    assert (fin | run.refused).all()
    assert sum(run.refused_by_reason.values()) == int(run.refused.sum())
    assert run.tokens_generated == int((t.output_tokens[fin] - 1).sum())
    never = (t.total_tokens + t.output_tokens - 1 > cap) & (t.output_tokens > 1)
    assert np.array_equal(run.refused, never)
    m = decode_metrics(run)
    assert m["finished"] + m["refused"] == m["arrived"] and m["in_flight"] == 0
    if isinstance(pol, LbkitDecode):
        assert np.asarray(pol.balancer.num_requests()).sum() == 0
        pol.balancer._check()


def test_waiting_requests_at_the_horizon_are_in_flight():
    t = _trace([0.0, 0.0], [10, 10], [30, 30])
    run = simulate_decode(t, "least_requests", num_engines=1, ranks_per_engine=1, cost=UNIT,
                          max_kv_tokens=50, horizon_s=5.0)  # fmt: skip
    m = decode_metrics(run)
    assert (m["finished"], m["refused"], m["in_flight"]) == (0, 0, 2)


@pytest.mark.jit_parity
def test_kernels_without_jit_give_the_same_run():
    """The decode kernels with back-pressure, preemption and the shared term as plain Python
    (NUMBA_DISABLE_JIT=1 in a subprocess) give the compiled run's results."""
    code = """
import json, dataclasses
from lbkit.core import PRESETS, DecodeCost
from lbkit.sim.engine import simulate_decode
from lbkit.sim.workload import synthetic_trace
@dataclasses.dataclass(frozen=True)
class C(DecodeCost):
    b_moe: float = 0.0
    moe_lb: float = 1.0
d = PRESETS["h800_dsv3"].decode
cost = C(d.a, d.b, d.k, b_moe=4 * d.b, moe_lb=1.05)
t = synthetic_trace(150, rate_per_s=300.0, rng=11)
r = simulate_decode(t, "least_kv", num_engines=2, ranks_per_engine=2, cost=cost,
                    max_kv_tokens=12000, kv_watermark_tokens=100)
print(json.dumps([r.finish_s.tolist(), r.wait_s.tolist(), r.preemptions, r.step_time_s]))
"""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    plain = json.loads(out)
    exec_globals: dict = {}
    exec(code.replace("print(", "result = ("), exec_globals)  # the compiled kernels
    compiled = json.loads(exec_globals["result"])
    assert plain[2] == compiled[2] and plain[2] > 0
    assert plain[3] == compiled[3]
    assert np.array_equal(np.array(plain[0], float), np.array(compiled[0], float), equal_nan=True)
    assert plain[1] == compiled[1] and max(plain[1]) > 0
    assert math.isfinite(plain[3])


def test_a_batch_beyond_the_capacity_calibrates_to_the_capacity_bound():
    """Requests of ~17k tokens on ranks of 40k: at most a few run per rank whatever the arrival
    rate; the calibration terminates below the target and the bench says so."""
    from lbkit.sim.bench import OCCUPANCY_RANGE, run_decode_bench, scale_to_decode_batch
    from lbkit.sim.workload import default_workload

    t = default_workload(num_requests=120, rng=2)
    _, _, batch = scale_to_decode_batch(t, 20.0, ranks_per_engine=4, cost=H800.decode,
                                        max_kv_tokens=40_000, iterations=2)  # fmt: skip
    assert 0.0 < batch < 20.0 * 0.5
    rep = run_decode_bench(t, batch_per_rank=20.0, decode_ranks=4, decode_policies=["least_kv"],
                           max_kv_tokens=40_000)  # fmt: skip
    m = rep["decode"]["least_kv"]
    assert rep["workload"]["capacity_bound"] and rep["options"]["kv_capacity_tokens"] == 40_000
    assert m["mean_running_per_rank"] == m["window"]["batch_per_rank_mean"]
    lo, hi = OCCUPANCY_RANGE
    assert m["meaningful"] == (lo <= m["mean_running_per_rank"] <= hi) and not rep["meaningful"]
    assert m["waited"] > 0 and m["finished"] + m["refused"] == m["arrived"]


def test_per_bucket_decode_metrics_are_each_buckets_own_requests():
    # Prompts on both sides of the 16K edge, one request refused (longer than the rank's KV):
    # each bucket counts its arrivals and its TPOT percentiles are those of its own requests.
    prompt = [1000, 20000, 3000, 70000, 500, 17000, 900]
    t = _trace([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], prompt, [4, 3, 5, 2, 6, 3, 1])
    run = simulate_decode(t, "least_requests", num_engines=1, ranks_per_engine=2, cost=UNIT,
                          max_kv_tokens=65000)  # fmt: skip
    m = decode_metrics(run, total_tokens=np.array(prompt), edges=(16384, 65536))
    per = m["per_bucket"]
    tpot = np.where(run.finished, run.tpot_s, np.nan)
    groups = {"<16K": [0, 2, 4, 6], "16K-64K": [1, 5], ">=64K": [3]}
    assert set(per) == set(groups)
    for label, idx in groups.items():
        assert per[label]["requests"] == len(idx)
        v = tpot[idx]
        v = v[np.isfinite(v)]
        if v.size:
            assert per[label]["tpot_p50_s"] == pytest.approx(float(np.percentile(v, 50)))
            assert per[label]["tpot_p99_s"] == pytest.approx(float(np.percentile(v, 99)))
        else:
            assert per[label]["tpot_p50_s"] is None
    assert run.refused[3] and per[">=64K"]["tpot_p50_s"] is None  # 70,000 > the KV capacity
    assert sum(e["requests"] for e in per.values()) == m["arrived"]
