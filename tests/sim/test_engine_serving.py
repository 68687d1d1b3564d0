"""The serving world of SPEC §8 in the prefill engine: shared expert work in the step time, the
policy view's queue and KV fields, the local prefix-cache hook, and identity with b_moe = 0."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lbkit.core import PRESETS
from lbkit.core.cost import QuadraticCost
from lbkit.sim import _prefill_kernels
from lbkit.sim import _prefill_layout as K
from lbkit.sim.engine import (
    PREFILL_KV_CAPACITY_TOKENS,
    prefill_work_s,
    scale_to_utilization,
    simulate_prefill,
    utilization_factor,
)
from lbkit.sim.metrics import prefill_metrics
from lbkit.sim.protocol import EV_MOVE
from lbkit.sim.traces import Trace
from lbkit.sim.workload import synthetic_trace

_PRESET = PRESETS["h800_dsv3"].prefill
#: The preset's totals in the old form (every linear cost local, no shared expert work).
H800 = QuadraticCost(a=_PRESET.a, b=_PRESET.linear_s_per_token, k=_PRESET.k, q=_PRESET.q)


def moe_cost(base: QuadraticCost, b_moe: float, moe_lb: float = 1.0) -> QuadraticCost:
    """``base`` with shared expert work ``b_moe * moe_lb`` seconds per token."""
    return dataclasses.replace(base, b_moe=b_moe, moe_lb=moe_lb)


class Fixed:
    """Routes request ``i`` to ``ranks[i]``."""

    name = "fixed"

    def __init__(self, ranks):
        self.ranks = list(ranks)

    def route(self, request, total_tokens, cached_tokens, /, *, now_s, view):
        return self.ranks[request]

    def observe(self, requests, kinds, tokens, /, *, now_s):
        pass


def test_hand_computed_two_rank_timeline_with_shared_work():
    # a = 1, b = 1, no attention terms, b_moe * moe_lb = 2: ranks plan 3 s per token, so a
    # 100 s budget fits 33 tokens after the fixed cost. Request 0 (50 tokens) on rank 0,
    # request 1 (10 tokens) on rank 1, both at t = 0.
    # Step 1: chunks 33 and 10, shared 2 * 43 / 2 = 43: T = (1 + 33 + 43, 1 + 10 + 43) = (77, 54).
    # Step 2 at 77: rank 0 the last 17 tokens, rank 1 idle; shared 17: T = (35, 17).
    cost = moe_cost(QuadraticCost(a=1.0, b=1.0, k=0.0, q=0.0), b_moe=2.0, moe_lb=1.0)
    t = Trace(arrival_s=[0.0, 0.0], total_tokens=[50, 10], output_tokens=[1, 1])
    run = simulate_prefill(t, Fixed([0, 1]), num_engines=1, ranks_per_engine=2, cost=cost,
                           budget_s=100.0)  # fmt: skip
    assert run.finish_s.tolist() == [112.0, 77.0]
    assert run.num_steps == 2 and run.tokens_computed == 60
    assert run.rank_busy_s.tolist() == [77.0 + 35.0, 54.0 + 17.0]
    assert run.step_max_s == 77.0 + 35.0
    assert run.step_mean_s == (77.0 + 54.0) / 2 + (35.0 + 17.0) / 2
    assert run.busy_steps.tolist() == [0, 1, 1]
    assert run.busy_max_s.tolist() == [0.0, 35.0, 77.0]
    # Alone in its engine of 2 ranks: 50 tokens = (1 + 33 + 33) + (1 + 17 + 17); 10 = 1 + 10 + 10.
    assert run.alone_s.tolist() == [102.0, 21.0]
    m = prefill_metrics(run)
    assert m["balance_efficiency"] == pytest.approx(run.step_mean_s / run.step_max_s)


def test_utilisation_counts_the_shared_work_and_quota_does_not():
    base = QuadraticCost(a=1.0, b=1.0, k=0.0, q=0.0)
    cost = moe_cost(base, b_moe=2.0)
    t = Trace(arrival_s=[0.0, 10.0], total_tokens=[1000, 600], output_tokens=[1, 1],
              cached_tokens=[0, 100])  # fmt: skip
    np.testing.assert_array_equal(prefill_work_s(t, cost), prefill_work_s(t, base))
    # local 1,500 s plus shared 2 * 1,500 s offered to 3 ranks over 10 s at 50 %
    assert utilization_factor(t, 0.5, num_ranks=3, cost=cost) == pytest.approx(4500 / 15)
    assert utilization_factor(t, 0.5, num_ranks=3, cost=base) == pytest.approx(1500 / 15)


@pytest.mark.parametrize("mode", ["off", "level", "split"])
@pytest.mark.parametrize("policy", ["least_tokens", "lbkit", "random"])
def test_b_moe_zero_is_bit_identical(mode, policy):
    t = synthetic_trace(300, rate_per_s=50.0, long_share={"64K-256K": 0.03}, rng=7)
    t = t.with_cached_tokens(np.minimum(t.total_tokens // 3, t.total_tokens - 1))
    plain = scale_to_utilization(t, 0.8, num_ranks=12, cost=H800)
    zero = moe_cost(H800, b_moe=0.0, moe_lb=1.05)
    same = scale_to_utilization(t, 0.8, num_ranks=12, cost=zero)
    assert plain[1] == same[1]
    kw = {"num_engines": 3, "ranks_per_engine": 4, "work_sharing": mode, "rng": 3}
    a = simulate_prefill(plain[0], policy, cost=H800, **kw)
    b = simulate_prefill(same[0], policy, cost=zero, **kw)
    for field in ("rank", "finish_s", "alone_s", "rank_busy_s", "bin_mean_s", "bin_max_s",
                  "busy_steps", "busy_mean_s", "busy_max_s", "cached_tokens"):  # fmt: skip
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    for field in ("step_mean_s", "step_max_s", "num_steps", "overruns", "tokens_computed",
                  "moves", "few_steps", "few_mean_s", "few_max_s", "end_s"):  # fmt: skip
        assert getattr(a, field) == getattr(b, field), field


@pytest.mark.parametrize("mode", ["off", "level", "split"])
def test_shared_work_lengthens_steps_and_keeps_conservation(mode):
    t = synthetic_trace(300, rate_per_s=50.0, rng=4)
    t = scale_to_utilization(t, 0.7, num_ranks=8, cost=H800)[0]
    kw = {"num_engines": 2, "ranks_per_engine": 4, "work_sharing": mode}
    base = simulate_prefill(t, "least_tokens", cost=H800, **kw)
    moe = simulate_prefill(t, "least_tokens", cost=moe_cost(H800, 100e-6, 1.05), **kw)
    for run in (base, moe):
        m = prefill_metrics(run)  # asserts conservation
        assert m["finished"] == len(t)
        assert run.busy_steps.sum() == run.num_steps
        assert run.busy_max_s.sum() == pytest.approx(run.step_max_s)
    assert moe.alone_s.sum() > base.alone_s.sum()
    assert moe.rank_busy_s.sum() > base.rank_busy_s.sum()


def _recount(state, f):
    """Brute-force (requests, waiting, running, KV tokens) of flat rank ``f`` from the request
    state: a request runs once a chunk of it was applied or it is scheduled in the step of its
    engine in progress; its KV is its prefix (cached plus prefilled tokens)."""
    RI, KI, EF, ranks = state["RI"], state["KI"], state["EF"], state["ranks"]
    live = np.flatnonzero((RI[K.RI_RANK] == f) & (RI[K.RI_REM] > 0))
    scheduled = set()
    if EF[K.EF_END, f // ranks] < np.inf:
        i = KI[K.KI_HEAD, f]
        for _ in range(KI[K.KI_SCHED, f]):
            scheduled.add(int(i))
            i = RI[K.RI_NEXT, i]
    running = [int(i) for i in live if RI[K.RI_REM, i] < RI[K.RI_UNCACHED, i] or i in scheduled]
    kv = int(sum(RI[K.RI_PREFIX, i] for i in running))
    return live.size, live.size - len(running), len(running), kv


class ViewChecker:
    """Routes at random and, at every route call, checks the view against a recount."""

    name = "view_checker"

    def __init__(self, state, trace, seed):
        self.state = state
        self.trace = trace
        self.rng = np.random.default_rng(seed)
        self.checks = 0
        self.seen_waiting = self.seen_running = 0

    def route(self, request, total_tokens, cached_tokens, /, *, now_s, view):
        nr = view.num_engines * view.ranks_per_engine
        assert view.kv_capacity_tokens == 12345 and view.block_tokens == 512
        assert view.hit_tokens.tolist() == [cached_tokens] * nr
        np.testing.assert_array_equal(view.block_hashes, self.trace.hash_ids_of(request))
        if "RI" in self.state:
            for f in range(nr):
                want = _recount(self.state, f)
                got = (view.num_requests[f], view.num_waiting[f], view.num_running[f],
                       view.kv_tokens[f])  # fmt: skip
                assert got == want, (request, f)
                self.seen_waiting += want[1] > 0
                self.seen_running += want[2] > 0
            self.checks += 1
        return int(self.rng.integers(nr))

    def observe(self, requests, kinds, tokens, /, *, now_s):
        pass


def _capture(monkeypatch, state, ranks):
    """Keep references to the engine's arrays (the first admission hands them over)."""
    admit = _prefill_kernels.prefill_admit

    def spy(i, f, t, prefix, RI, RF, KI, EF, EI, P):
        state.update(RI=RI, KI=KI, EF=EF, ranks=ranks)
        return admit(i, f, t, prefix, RI, RF, KI, EF, EI, P)

    monkeypatch.setattr(_prefill_kernels, "prefill_admit", spy)


def _hashed_trace(n, seed):
    t = synthetic_trace(n, rate_per_s=60.0, rng=seed)
    blocks = (t.total_tokens + 511) // 512
    offsets = np.concatenate([[0], np.cumsum(blocks)])
    ids = np.arange(offsets[-1], dtype=np.int64)
    t = dataclasses.replace(t, hash_ids=ids, hash_offsets=offsets)
    return t.with_cached_tokens(np.minimum((t.total_tokens // 4) // 512 * 512, t.total_tokens - 1))


@pytest.mark.parametrize("mode", ["off", "budget", "split"])
def test_view_fields_match_a_recount_at_every_route(monkeypatch, mode):
    t = _hashed_trace(200, seed=8)
    t = scale_to_utilization(t, 0.9, num_ranks=6, cost=H800)[0]
    state = {}
    _capture(monkeypatch, state, 3)
    pol = ViewChecker(state, t, seed=1)
    run = simulate_prefill(t, pol, num_engines=2, ranks_per_engine=3, work_sharing=mode,
                           cost=moe_cost(H800, 50e-6), kv_capacity_tokens=12345)  # fmt: skip
    assert pol.checks == len(t) - 1
    assert pol.seen_waiting > 0 and pol.seen_running > 0
    # after the drain nothing is held
    assert not state["KI"][K.KI_NREQ].any() and not state["KI"][K.KI_KV].any()
    assert not state["KI"][K.KI_WAIT].any() and prefill_metrics(run)["finished"] == len(t)


class FixedHits:
    """A deterministic stand-in for per-rank prefix caches: fixed hits, recorded calls."""

    def __init__(self, trace, num_ranks, seed):
        rng = np.random.default_rng(seed)
        total = trace.total_tokens
        frac = rng.random((len(trace), num_ranks))
        self.hits = np.minimum((frac * total[:, None]).astype(np.int64), total[:, None] - 1)
        self.admitted_calls = []
        self.finished_calls = []
        self.asked = []

    def hit_tokens(self, request):
        self.asked.append(request)
        return self.hits[request]

    def admitted(self, request, rank):
        self.admitted_calls.append((request, rank))

    def finished(self, request, rank):
        self.finished_calls.append((request, rank))


class Recorder:
    """Least remaining tokens; records its choices, the hits it saw and the progress events."""

    name = "recorder"

    def __init__(self, hits):
        self.hits = hits
        self.choice = {}
        self.progress = {}

    def route(self, request, total_tokens, cached_tokens, /, *, now_s, view):
        np.testing.assert_array_equal(view.hit_tokens, self.hits[request])
        f = int(np.argmin(view.tokens + total_tokens - view.hit_tokens))
        self.choice[request] = f
        return f

    def observe(self, requests, kinds, tokens, /, *, now_s):
        for i, k, c in zip(requests.tolist(), kinds.tolist(), tokens.tolist(), strict=True):
            if k != EV_MOVE:
                self.progress[i] = self.progress.get(i, 0) + c


@pytest.mark.parametrize("mode", ["off", "level", "split"])
def test_rank_cache_hook(mode):
    t = synthetic_trace(250, rate_per_s=60.0, rng=9)
    t = scale_to_utilization(t, 0.9, num_ranks=6, cost=H800)[0]
    cache = FixedHits(t, 6, seed=2)
    pol = Recorder(cache.hits)
    run = simulate_prefill(t, pol, num_engines=2, ranks_per_engine=3, cost=moe_cost(H800, 50e-6),
                           work_sharing=mode, report_quantum=0.0, rank_cache=cache)  # fmt: skip
    n = len(t)
    assert cache.asked == list(range(n))
    assert sorted(cache.admitted_calls) == sorted(pol.choice.items())
    assert sorted(cache.finished_calls) == [(i, int(run.rank[i])) for i in range(n)]
    hit = np.array([cache.hits[i, pol.choice[i]] for i in range(n)])
    np.testing.assert_array_equal(run.cached_tokens, hit)
    # each request prefilled exactly what it missed where it was admitted
    assert [pol.progress[i] for i in range(n)] == (t.total_tokens - hit).tolist()
    assert run.tokens_computed == int((t.total_tokens - hit).sum())
    assert prefill_metrics(run)["finished"] == n  # conservation with the hits
    # the slowdown denominator does not depend on where the requests hit
    plain = simulate_prefill(t, "least_tokens", num_engines=2, ranks_per_engine=3,
                             cost=moe_cost(H800, 50e-6), work_sharing=mode)  # fmt: skip
    np.testing.assert_array_equal(run.alone_s, plain.alone_s)
    if mode != "off":
        assert run.moves > 0  # finished() got the rank after the moves


class BadHits:
    def __init__(self, value):
        self.value = value

    def hit_tokens(self, request):
        return self.value

    def admitted(self, request, rank):
        pass

    def finished(self, request, rank):
        pass


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.zeros(3, dtype=np.int64), r"shape \(4,\)"),
        (np.zeros(4), "integer array"),
        (np.array([0, 0, 100, 0]), r"within \[0, total_tokens - 1 = 99\]"),
        (np.array([0, -1, 0, 0]), "within"),
    ],
)
def test_bad_rank_cache(value, match):
    t = Trace(arrival_s=[0.0], total_tokens=[100], output_tokens=[1])
    kw = {"num_engines": 2, "ranks_per_engine": 2, "cost": H800}
    with pytest.raises(ValueError, match=match):
        simulate_prefill(t, "round_robin", rank_cache=BadHits(value), **kw)
    with pytest.raises(TypeError, match=r"rank_cache: must have a callable hit_tokens\(\)"):
        simulate_prefill(t, "round_robin", rank_cache=object(), **kw)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        simulate_prefill(t, "round_robin", kv_capacity_tokens=0, **kw)


def test_default_pool_and_view_without_hashes():
    seen = {}

    class Peek(Fixed):
        def route(self, request, total_tokens, cached_tokens, /, *, now_s, view):
            seen["shape"] = (view.num_engines, view.ranks_per_engine)
            seen["hashes"] = view.block_hashes.copy()
            seen["cap"] = view.kv_capacity_tokens
            return 0

    t = Trace(arrival_s=[0.0], total_tokens=[100], output_tokens=[1])
    run = simulate_prefill(t, Peek([0]), cost=H800)
    assert (run.num_engines, run.ranks_per_engine) == seen["shape"] == (8, 8)
    assert seen["hashes"].dtype == np.int64 and seen["hashes"].size == 0
    assert seen["cap"] == PREFILL_KV_CAPACITY_TOKENS == 35_000_000_000 // (61 * 576 * 2)


@pytest.mark.jit_parity
def test_this_module_without_jit():
    # Every kernel as plain Python (the new counters and the shared term included), and the
    # step kernel against its model.
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")
    step = Path(__file__).with_name("test_work_sharing.py")
    args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
            f"{step}::test_start_step_with_shared_work_matches_the_model",
            "-k", "not without_jit and not bit_identical"]  # fmt: skip
    out = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
