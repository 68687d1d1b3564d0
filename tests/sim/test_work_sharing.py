"""Engine-side work sharing (``simulate_prefill(work_sharing=...)``): a hand-computed step, the
step kernel against a plain-Python model, conservation, JIT parity and lbkit's exact ledger."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.prefill import plan_chunks
from lbkit.sim import _plan_kernels, _prefill_kernels, _sharing_kernels
from lbkit.sim import _prefill_layout as K
from lbkit.sim._bins import N_BIN
from lbkit.sim.engine import SHARING, scale_to_utilization, simulate_prefill
from lbkit.sim.metrics import prefill_metrics
from lbkit.sim.policies import EV_MOVE, LBKIT_BUCKET_OPTIONS, LbkitPrefill
from lbkit.sim.traces import Trace
from lbkit.sim.workload import synthetic_trace

UNIT = PRESETS["unit"].prefill
H800 = PRESETS["h800_dsv3"].prefill


class RankZero:
    """Sends every request to flat rank 0 and records the events it sees."""

    name = "rank_zero"

    def __init__(self):
        self.moves = []

    def route(self, request, total_tokens, cached_tokens, /, *, now_s, view):
        return 0

    def observe(self, requests, kinds, tokens, /, *, now_s):
        moved = zip(requests.tolist(), kinds.tolist(), tokens.tolist(), strict=True)
        self.moves += [(i, f) for i, k, f in moved if k == EV_MOVE]


def test_hand_computed_one_engine_four_requests_on_one_rank():
    # unit cost: step = 1 + sum(c + 0.001 c p + 0.0005 c^2); four 100-token prompts (105 s each).
    t = Trace(arrival_s=[0.0] * 4, total_tokens=[100] * 4, output_tokens=[1] * 4)
    kw = {"num_engines": 1, "ranks_per_engine": 4, "cost": UNIT, "budget_s": 1000.0}
    off = simulate_prefill(t, RankZero(), **kw)
    np.testing.assert_allclose(off.finish_s, [421.0] * 4)  # one rank: 1 + 4 * 105
    assert off.moves == 0 and off.busy_steps.tolist() == [0, 1, 0, 0, 0]
    for mode in ("budget", "level"):
        pol = RankZero()
        run = simulate_prefill(t, pol, work_sharing=mode, **kw)
        np.testing.assert_allclose(run.finish_s, [106.0] * 4)  # one per rank
        assert run.rank.tolist() == [0, 1, 2, 3] and run.work_sharing == mode
        assert pol.moves == [(1, 1), (2, 2), (3, 3)] and run.moves == 3
        assert run.busy_steps.tolist() == [0, 0, 0, 0, 1]
        assert prefill_metrics(run)["balance_efficiency"] == pytest.approx(1.0)


def test_level_shortens_the_step_to_the_level_that_fills_every_rank():
    # Four 100-token prompts and a 300-token one (105 s and 345 s of work) arrive on rank 0;
    # budget 1000. "budget": one prompt per rank, the long one whole after a short one, one
    # step of 1 + 105 + 345 s. "level": the step is the largest T that the requests fill on
    # every rank, T = (4 * 106 + min(345, T)) / 4, i.e. T = 424 / 3; the long prompt fills
    # rank 0 up to T and finishes alone in the next step.
    t = Trace(arrival_s=[0.0] * 5, total_tokens=[100] * 4 + [300], output_tokens=[1] * 5)
    kw = {"num_engines": 1, "ranks_per_engine": 4, "cost": UNIT, "budget_s": 1000.0}
    b = simulate_prefill(t, RankZero(), work_sharing="budget", **kw)
    np.testing.assert_allclose(b.finish_s, [451.0] * 5)
    assert b.num_steps == 1
    lv = simulate_prefill(t, RankZero(), work_sharing="level", **kw)
    assert lv.busy_steps.tolist() == [0, 1, 0, 0, 1]
    first = lv.busy_max_s[4]
    assert 424.0 / 3 - 1.2 < first <= 424.0 / 3 + 1e-9
    np.testing.assert_array_equal(lv.finish_s[:4], [first] * 4)
    assert lv.finish_s[4] > first and lv.tokens_computed == 700
    # Fewer requests than ranks: the step is the even share, (106 + 346) / 4 = 113 s; the
    # short prompt finishes in it, the long one fills its rank and goes on alone.
    two = Trace(arrival_s=[0.0, 0.0], total_tokens=[100, 300], output_tokens=[1, 1])
    lv2 = simulate_prefill(two, RankZero(), work_sharing="level", **kw)
    step = lv2.busy_max_s[2]
    assert lv2.busy_steps.tolist() == [0, 1, 1, 0, 0] and 112.0 < step <= 113.0
    assert lv2.finish_s[0] == step < lv2.finish_s[1]


def _model_step(queues, started, cost, tau, level):
    """Plain-Python model of one shared step: per rank the scheduled (request, chunk) pairs and
    the planned time. ``queues[r]`` lists (request, tokens left, prefix) in queue order."""
    from lbkit.prefill import plan_chunks

    a, b, k, q, g = cost.a, cost.b, cost.k, cost.q, cost.gamma

    def work(c, p):
        return c * (b + k * p + q * c) + g * p if c > 0 else 0.0

    def fit(room, rem, p):  # the largest chunk within room (min_chunk = align = 1)
        return max((c for c in range(rem + 1) if work(c, p) <= room), default=0)

    ranks = len(queues)
    heads = {r: qu[0] for r, qu in enumerate(queues) if qu and qu[0][0] in started}
    pool = sorted(x for r, qu in enumerate(queues) for x in qu if heads.get(r) != x)
    budget = tau
    if level and pool:
        t_level = tau * ranks
        # T = sum min(w, T) / ranks, from T = total / ranks (only that with fewer requests)
        for _ in range(6 if len(heads) + len(pool) >= ranks else 1):
            total = 0.0
            for r in sorted(heads):
                total += min(a + work(heads[r][1], heads[r][2]), tau, t_level)
            for j, (_, rem, p) in enumerate(pool):
                if total > tau * ranks:
                    break
                w = work(rem, p) + (a if j < ranks - len(heads) else 0.0)
                total += min(w, t_level)
            t_level = total / ranks
        budget = min(tau, t_level)
    plan = [[] for _ in range(ranks)]
    time = [0.0] * ranks
    full = [False] * ranks
    for r in sorted(heads):
        i, rem, p = heads[r]
        one = plan_chunks([rem], [p], cost=cost, budget_s=budget)
        plan[r].append((i, one.chunk_tokens[0]))
        time[r] = one.step_time_s
        full[r] = one.chunk_tokens[0] < rem
        budget = max(budget, time[r])
    for i, rem, p in pool:
        while True:
            free = [r for r in range(ranks) if not full[r]]
            if not free:
                return plan, time
            r = min(free, key=lambda r: (time[r], r))
            fixed = 0.0 if plan[r] else a
            c = fit(budget - time[r] - fixed, rem, p)
            if c == 0:
                if plan[r]:
                    full[r] = True
                    continue
                c = min(1, rem)
            time[r] = time[r] + fixed + work(c, p)
            plan[r].append((i, c))
            full[r] = c < rem
            break
    return plan, time


@given(
    data=st.data(),
    ranks=st.integers(1, 4),
    n=st.integers(0, 9),
    tau=st.floats(20.0, 3000.0),
    level=st.booleans(),
    moe=st.sampled_from([0.0, 0.5, 3.0]),
)
def test_share_kernel_matches_the_model(data, ranks, n, tau, level, moe):
    # With shared expert work (moe s per token) the ranks plan for a balanced engine: the
    # model plans with the linear cost b + moe.
    rem = data.draw(st.lists(st.integers(1, 2500), min_size=n, max_size=n))
    pre = data.draw(st.lists(st.integers(0, 4000), min_size=n, max_size=n))
    where = data.draw(st.lists(st.integers(0, ranks - 1), min_size=n, max_size=n))
    first = {}
    for i, f in enumerate(where):
        first.setdefault(f, i)
    started = {i for i in first.values() if data.draw(st.booleans())}
    RI = np.zeros((K.N_RI, max(n, 1)), dtype=np.int64)
    KI = np.zeros((K.N_KI, ranks), dtype=np.int64)
    KI[K.KI_HEAD] = KI[K.KI_TAIL] = -1
    RI[K.RI_NEXT] = -1
    queues = [[] for _ in range(ranks)]
    for i in range(n):
        f = where[i]
        RI[K.RI_REM, i] = rem[i]
        RI[K.RI_PREFIX, i] = pre[i]
        RI[K.RI_UNCACHED, i] = rem[i] + (7 if i in started else 0)
        RI[K.RI_RANK, i] = f
        _plan_kernels.append(RI, KI, f, i)
        KI[K.KI_NREQ, f] += 1
        KI[K.KI_TOKENS, f] += rem[i]
        queues[f].append((i, rem[i], pre[i]))
    KF = np.zeros((K.N_KF, ranks))
    EF = np.zeros((K.N_EF, 1))
    P = np.array([UNIT.a, UNIT.b, UNIT.k, UNIT.q, UNIT.gamma, tau, 1, 1, ranks, 0.0, 1.0,
                  2.0 if level else 1.0, 1.0, moe])  # fmt: skip
    ev = np.zeros(n + 1, dtype=np.int64)
    evk, evt = ev.copy(), ev.copy()
    SCR = np.zeros((3, max(n, ranks)), dtype=np.int64)
    nev = _sharing_kernels.share_work(0, RI, KI, KF, EF, P, ev, evk, evt, 0, SCR)
    plan, time = _model_step(queues, started, dataclasses.replace(UNIT, b=UNIT.b + moe), tau, level)
    moved = {}
    for f in range(ranks):
        got, i = [], KI[K.KI_HEAD, f]
        for s in range(KI[K.KI_SCHED, f]):
            last = s == KI[K.KI_SCHED, f] - 1
            got.append((int(i), int(KI[K.KI_LAST, f] if last else RI[K.RI_REM, i])))
            if where[i] != f:
                moved[int(i)] = f
            i = RI[K.RI_NEXT, i]
        assert got == plan[f], f"rank {f}"
        assert KF[K.KF_TIME, f] == pytest.approx(time[f], rel=1e-12, abs=1e-12)
        # every request is still queued exactly once, on the rank it records
        members, i = [], KI[K.KI_HEAD, f]
        while i >= 0:
            assert RI[K.RI_RANK, i] == f
            members.append(int(i))
            i = RI[K.RI_NEXT, i]
        assert len(members) == KI[K.KI_NREQ, f]
        assert KI[K.KI_TOKENS, f] == sum(rem[j] for j in members)
        assert KI[K.KI_TAIL, f] == (members[-1] if members else -1)
    assert sum(KI[K.KI_NREQ]) == n
    assert {int(ev[j]): int(evt[j]) for j in range(nev)} == moved
    assert all(evk[:nev] == EV_MOVE)


@pytest.mark.parametrize("mode", SHARING)
@pytest.mark.parametrize("policy", ["round_robin", "least_tokens", "lbkit"])
def test_conservation_determinism_and_loss_sums(mode, policy):
    t = synthetic_trace(300, rate_per_s=40.0, long_share={"64K-256K": 0.05}, rng=2)
    kw = {"num_engines": 3, "ranks_per_engine": 3, "cost": H800, "work_sharing": mode}
    run = simulate_prefill(t, policy, **kw)
    m = prefill_metrics(run)
    assert m["finished"] == len(t) and m["in_flight"] == 0
    assert run.tokens_computed == int((t.total_tokens - t.cached_tokens).sum())
    assert run.busy_steps.sum() == run.num_steps and run.busy_steps[0] == 0
    assert run.busy_mean_s.sum() == pytest.approx(run.step_mean_s)
    assert run.busy_max_s.sum() == pytest.approx(run.step_max_s)
    assert 0.0 <= run.few_mean_s <= run.few_max_s <= run.step_max_s
    assert (run.moves > 0) == (mode != "off") or policy == "least_tokens"
    again = simulate_prefill(t, policy, **kw)
    np.testing.assert_array_equal(run.finish_s, again.finish_s)
    np.testing.assert_array_equal(run.rank, again.rank)


@pytest.mark.parametrize("horizon", [None, 30.0])
def test_lbkit_ledger_follows_the_moves(horizon):
    t = synthetic_trace(400, rate_per_s=60.0, rng=5)
    t = scale_to_utilization(t, 0.9, num_ranks=8, cost=H800)[0]
    pol = LbkitPrefill(2, 4, cost=H800, rng=0, **LBKIT_BUCKET_OPTIONS)
    run = simulate_prefill(t, pol, num_engines=2, ranks_per_engine=4, cost=H800,
                           work_sharing="level", horizon_s=horizon)  # fmt: skip
    bal = pol.balancer
    bal._check()
    stats = bal.statistics()
    assert run.moves > 0 and stats.reassigned == run.moves
    live = np.flatnonzero((run.rank >= 0) & ~run.finished)
    assert stats.queued == live.size
    for i in live.tolist():  # the ledger holds each request in flight on its current rank
        f = int(run.rank[i])
        assert i in bal.requests_on(f // 4, f % 4)


@pytest.mark.jit_parity(
    kernels=(
        _prefill_kernels.prefill_advance,
        _prefill_kernels.prefill_admit,
        _plan_kernels.prefill_alone,
    )
)
@pytest.mark.parametrize("mode", ["level", "split"])
def test_jit_parity_with_sharing(monkeypatch, mode):
    t = synthetic_trace(80, rate_per_s=40.0, rng=3)
    kw = {"num_engines": 2, "ranks_per_engine": 3, "cost": H800, "work_sharing": mode}
    jit = simulate_prefill(t, "least_requests", **kw)
    for module, name in ((_prefill_kernels, "prefill_advance"), (_prefill_kernels, "prefill_admit"),
                         (_plan_kernels, "prefill_alone")):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name).py_func)
    py = simulate_prefill(t, "least_requests", **kw)
    np.testing.assert_array_equal(jit.finish_s, py.finish_s)
    np.testing.assert_array_equal(jit.rank, py.rank)
    assert jit.step_max_s == py.step_max_s and jit.moves == py.moves


def test_bad_work_sharing():
    t = Trace(arrival_s=[0.0], total_tokens=[10], output_tokens=[1])
    with pytest.raises(ValueError, match="work_sharing: must be one of"):
        simulate_prefill(t, "round_robin", num_engines=1, ranks_per_engine=1, cost=UNIT,
                         work_sharing="steal")  # fmt: skip


def test_split_runs_a_lone_prompt_on_every_rank():
    # One 300-token prompt (345 s of work, unit cost), budget 100 s: alone it needs four steps
    # of chunks; split over the 4 ranks of its engine the whole prompt fits one step, 1 + 345/4.
    t = Trace(arrival_s=[0.0], total_tokens=[300], output_tokens=[1])
    kw = {"num_engines": 1, "ranks_per_engine": 4, "cost": UNIT, "budget_s": 100.0}
    lv = simulate_prefill(t, RankZero(), work_sharing="level", **kw)
    sp = simulate_prefill(t, RankZero(), work_sharing="split", **kw)
    assert lv.busy_steps[1] == lv.num_steps >= 4
    assert sp.busy_steps.tolist() == [0, 0, 0, 0, 1]
    assert sp.finish_s[0] == pytest.approx(1.0 + 345.0 / 4)
    assert sp.tokens_computed == 300 and sp.moves == 0
    assert prefill_metrics(sp)["balance_efficiency"] == pytest.approx(1.0)
    # at a parallel efficiency of 0.8 the group is 3.2 times as fast as one rank (one step
    # within a 200 s budget)
    kw["budget_s"] = 200.0
    sp8 = simulate_prefill(t, RankZero(), work_sharing="split", cp_efficiency=0.8, **kw)
    assert sp8.finish_s[0] == pytest.approx(1.0 + 345.0 / 3.2) and sp8.num_steps == 1
    # at 1 / 4 the group would be no faster than the prompt's own rank: it does not form
    lv = simulate_prefill(t, RankZero(), work_sharing="level", **kw)
    slow = simulate_prefill(t, RankZero(), work_sharing="split", cp_efficiency=0.25, **kw)
    assert slow.finish_s[0] == lv.finish_s[0] and slow.busy_steps[1] == slow.num_steps


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan")])
def test_cp_efficiency_is_checked(bad):
    t = Trace(arrival_s=[0.0], total_tokens=[300], output_tokens=[1])
    with pytest.raises(ValueError, match="cp_efficiency"):
        simulate_prefill(t, "round_robin", cost=UNIT, work_sharing="split", cp_efficiency=bad)


def _model_split(sched, last, time, rem, prefix, cost, budget, eff=1.0):
    """Plain-Python model of ``_split``: (new last chunk, new time) per rank."""
    a, b, k, q, g = cost.a, cost.b, cost.k, cost.q, cost.gamma
    ranks = len(sched)
    idle = [r for r in range(ranks) if sched[r] == 0]
    cand = sorted((r for r in range(ranks) if sched[r] == 1 and last[r] < rem[r]),
                  key=lambda r: (-time[r], r))  # fmt: skip
    last, time = list(last), list(time)
    if not idle or not cand:
        return last, time
    groups = {r: [r] for r in cand}
    for j, h in enumerate(idle):
        groups[cand[j % len(cand)]].append(h)
    for r, members in groups.items():
        n = len(members)
        if n == 1 or n * eff <= 1.0:
            continue
        p = prefix[r]
        fits = [c for c in range(last[r], rem[r] + 1)
                if a + (c * (b + k * p + q * c) + g * p) / (n * eff) <= budget]  # fmt: skip
        c = max(fits, default=last[r])
        t = a + (c * (b + k * p + q * c) + g * p if c else 0.0) / (n * eff)
        last[r] = c
        for m in members:
            time[m] = t
    return last, time


@given(data=st.data(), ranks=st.integers(1, 4), budget=st.floats(20.0, 800.0),
       eff=st.sampled_from([1.0, 0.8, 0.5, 0.3]))  # fmt: skip
def test_split_kernel_matches_the_model(data, ranks, budget, eff):
    # Each rank after the dealing: idle, one chunk of its started prompt, or several requests.
    sched = data.draw(st.lists(st.integers(0, 2), min_size=ranks, max_size=ranks))
    rem = data.draw(st.lists(st.integers(1, 900), min_size=ranks, max_size=ranks))
    prefix = data.draw(st.lists(st.integers(0, 3000), min_size=ranks, max_size=ranks))
    last = [data.draw(st.integers(1, r)) if s else 0 for s, r in zip(sched, rem, strict=True)]
    time = [data.draw(st.floats(1.0, budget)) if s else 0.0 for s in sched]
    RI = np.zeros((K.N_RI, ranks), dtype=np.int64)
    KI = np.zeros((K.N_KI, ranks), dtype=np.int64)
    KF = np.zeros((K.N_KF, ranks))
    for f in range(ranks):
        RI[K.RI_REM, f], RI[K.RI_PREFIX, f] = rem[f], prefix[f]
        KI[K.KI_HEAD, f] = f
        KI[K.KI_SCHED, f], KI[K.KI_LAST, f] = sched[f], last[f]
        KF[K.KF_TIME, f] = time[f]
    P = np.array([UNIT.a, UNIT.b, UNIT.k, UNIT.q, UNIT.gamma, budget, 1, 1, ranks, 0.0, 1.0, 3.0,
                  eff, 0.0])  # fmt: skip
    _sharing_kernels.split_chunks(0, RI, KI, KF, P)
    want_last, want_time = _model_split(sched, last, time, rem, prefix, UNIT, budget, eff)
    assert KI[K.KI_LAST].tolist() == want_last
    np.testing.assert_allclose(KF[K.KF_TIME], want_time, rtol=1e-12)


def _local(cost, c, p):
    return c * (cost.b + cost.k * p + cost.q * c) + cost.gamma * p if c > 0 else 0.0


@given(
    data=st.data(),
    ranks=st.integers(1, 4),
    n=st.integers(1, 9),
    tau=st.floats(20.0, 3000.0),
    mode=st.sampled_from([0, 1, 2]),
    moe=st.sampled_from([0.0, 0.5, 3.0]),
)
def test_start_step_with_shared_work_matches_the_model(data, ranks, n, tau, mode, moe):
    # One engine step (no sharing, "budget", "level") with shared expert work: the ranks plan
    # with b + moe; rank time = a + own local work (a only if it computes) + moe * C / ranks,
    # C the engine's tokens this step (idle ranks pay the shared part too); step = max.
    rem = data.draw(st.lists(st.integers(1, 2500), min_size=n, max_size=n))
    pre = data.draw(st.lists(st.integers(0, 4000), min_size=n, max_size=n))
    where = data.draw(st.lists(st.integers(0, ranks - 1), min_size=n, max_size=n))
    first = {}
    for i, f in enumerate(where):
        first.setdefault(f, i)
    started = {i for i in first.values() if data.draw(st.booleans())}
    RI = np.zeros((K.N_RI, n), dtype=np.int64)
    KI = np.zeros((K.N_KI, ranks), dtype=np.int64)
    KI[K.KI_HEAD] = KI[K.KI_TAIL] = -1
    RI[K.RI_NEXT] = -1
    queues = [[] for _ in range(ranks)]
    for i in range(n):
        f = where[i]
        RI[K.RI_REM, i], RI[K.RI_PREFIX, i] = rem[i], pre[i]
        RI[K.RI_UNCACHED, i] = rem[i] + (7 if i in started else 0)
        RI[K.RI_RANK, i] = f
        _prefill_kernels.prefill_admit(i, f, 0.0, -1, RI, np.zeros((K.N_RF, n)), KI,
                                       np.zeros((K.N_EF, 1)), np.zeros((K.N_EI, 1), np.int64),
                                       np.full(K.N_P, float(ranks)))  # fmt: skip
        if i in started:  # started in an earlier step: running, its prefix in KV
            RI[K.RI_RUN, i] = 1
            KI[K.KI_WAIT, f] -= 1
            KI[K.KI_KV, f] += pre[i]
        queues[f].append((i, rem[i], pre[i]))
    KF = np.zeros((K.N_KF, ranks))
    EF = np.zeros((K.N_EF, 1))
    EF[K.EF_READY, 0] = 5.0
    EI = np.zeros((K.N_EI, 1), dtype=np.int64)
    EI[K.EI_NREQ, 0] = n
    P = np.array([UNIT.a, UNIT.b, UNIT.k, UNIT.q, UNIT.gamma, tau, 1, 1, ranks, 0.0, 1e9,
                  float(mode), 1.0, moe])  # fmt: skip
    ACC, BINS, KS = np.zeros(K.N_ACC), np.zeros((N_BIN, 4)), np.zeros((K.N_KS, ranks + 1))
    ev = np.zeros(n + 1, dtype=np.int64)
    SCR = np.zeros((3, max(n, ranks)), dtype=np.int64)
    _prefill_kernels.start_step(0, RI, KI, KF, EF, EI, P, ACC, BINS, KS, ev, ev.copy(), ev.copy(),
                                0, SCR)  # fmt: skip
    plan_cost = dataclasses.replace(UNIT, b=UNIT.b + moe)
    if mode == 0:
        plan = []
        for qu in queues:
            chunks = []
            if qu:
                got = plan_chunks([x[1] for x in qu], [x[2] for x in qu], cost=plan_cost,
                                  budget_s=tau).chunk_tokens  # fmt: skip
                chunks = [(qu[j][0], int(c)) for j, c in enumerate(got) if c > 0]
            plan.append(chunks)
    else:
        plan, _ = _model_step(queues, started, plan_cost, tau, mode == 2)
    tokens = sum(c for chunks in plan for _, c in chunks)
    shared = moe * tokens / ranks
    want = [(UNIT.a + sum(_local(UNIT, c, pre[i]) for i, c in chunks) if chunks else 0.0) + shared
            for chunks in plan]  # fmt: skip
    np.testing.assert_allclose(KF[K.KF_BUSY], want, rtol=1e-9, atol=1e-9)
    assert EF[K.EF_END, 0] == pytest.approx(5.0 + max(want), rel=1e-9)
    assert ACC[K.ACC_MAX] == pytest.approx(max(want), rel=1e-9)
    assert ACC[K.ACC_MEAN] == pytest.approx(sum(want) / ranks, rel=1e-9)
    assert KS[K.KS_STEPS, sum(1 for chunks in plan if chunks)] == 1.0
    # queue counters: a request is running once scheduled (or started before), KV = prefixes
    sched = {i for chunks in plan for i, _ in chunks}
    for f in range(ranks):
        mine = [i for i in range(n) if RI[K.RI_RANK, i] == f]
        running = [i for i in mine if i in started or i in sched]
        assert KI[K.KI_NREQ, f] == len(mine)
        assert KI[K.KI_WAIT, f] == len(mine) - len(running)
        assert KI[K.KI_KV, f] == sum(pre[i] for i in running)
