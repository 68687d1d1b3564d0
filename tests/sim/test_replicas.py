"""Router replicas in the simulator (``lbkit.sim.replicas``): parity with one router, the views."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.sim.engine import scale_to_utilization, simulate_decode, simulate_prefill
from lbkit.sim.policies import LbkitPrefill
from lbkit.sim.policies_decode import LbkitDecode
from lbkit.sim.protocol import EV_FINISH, EV_PROGRESS, PrefillView
from lbkit.sim.replicas import (
    MAX_REPLICAS,
    SYNC_MODES,
    DecodeReplicas,
    PrefillReplicas,
    ReplicaSync,
    decode_replicas,
    prefill_replicas,
)
from lbkit.sim.traces import Trace
from lbkit.sim.workload import synthetic_trace

H800 = PRESETS["h800_dsv3"]
E, R = 2, 3

syncs = st.builds(
    ReplicaSync,
    k=st.integers(1, 6),
    mode=st.sampled_from(SYNC_MODES),
    delay_s=st.sampled_from([0.0, 0.0005, 0.05, 2.0]),
    period_s=st.sampled_from([0.01, 0.3, 1.0]),
)


def _trace(seed: int, n: int, util: float) -> Trace:
    """A prefill trace at utilisation ``util`` of the ``E x R`` pool."""
    t = synthetic_trace(n, rate_per_s=1.0, max_tokens=60_000, max_output_tokens=300, rng=seed)
    return scale_to_utilization(t, util, num_ranks=E * R, cost=H800.prefill)[0]


def _decode_trace(seed: int, n: int) -> Trace:
    """A decode-only trace that keeps four ranks busy (arrivals 200 per second)."""
    return synthetic_trace(n, rate_per_s=200.0, max_tokens=20_000, max_output_tokens=200,
                           rng=seed)  # fmt: skip


# ------------------------------------------------------------------ options
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"k": 0}, ValueError, "k: must be >= 1"),
        ({"k": MAX_REPLICAS + 1}, ValueError, "k: must be <="),
        ({"k": 2.0}, TypeError, "k: must be an integer"),
        ({"mode": "gossip"}, ValueError, "mode: must be one of"),
        ({"delay_s": -1e-3}, ValueError, "delay_s: must be >= 0"),
        ({"delay_s": math.inf}, ValueError, "delay_s: must be finite"),
        ({"period_s": 0.0}, ValueError, "period_s: must be > 0"),
        ({"period_s": math.nan}, ValueError, "period_s: must not be NaN"),
    ],
)
def test_replica_sync_validates_every_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        ReplicaSync(**kwargs)


def test_policies_want_a_replica_sync():
    with pytest.raises(TypeError, match="sync: must be a ReplicaSync"):
        DecodeReplicas(1, 2, sync=4)
    with pytest.raises(TypeError, match="sync: must be a ReplicaSync"):
        prefill_replicas("shared")
    assert ReplicaSync(k=1, mode="none").exact and ReplicaSync(k=3, delay_s=0.0).exact
    assert not ReplicaSync(k=3).exact and not ReplicaSync(k=2, mode="reports").exact


# ------------------------------------------------------------------ one replica = one router
@settings(max_examples=15)
@given(sync=syncs.filter(lambda s: s.k == 1), seed=st.integers(0, 2**16), util=st.floats(0.3, 1.2))
def test_one_replica_routes_prefill_as_the_single_router(sync, seed, util):
    t = _trace(seed, 120, util)
    kw = {"num_engines": E, "ranks_per_engine": R, "cost": H800.prefill, "rng": seed}
    ref = simulate_prefill(t, "lbkit", **kw)
    run = simulate_prefill(t, prefill_replicas(sync), **kw)
    np.testing.assert_array_equal(run.rank, ref.rank)
    np.testing.assert_array_equal(run.ttft_s, ref.ttft_s)


@settings(max_examples=15)
@given(
    sync=syncs.filter(lambda s: s.k == 1),
    seed=st.integers(0, 2**16),
    every=st.sampled_from([None, 0.0, 0.05]),
    caps=st.booleans(),
)
def test_one_replica_routes_decode_as_the_single_router(sync, seed, every, caps):
    t = _decode_trace(seed, 150)
    pool = {"ranks_per_engine": 4, "cost": H800.decode, "rng": seed}
    if caps:
        pool.update(max_batch=6, max_kv_tokens=80_000)
    ref = simulate_decode(t, LbkitDecode(1, 4, rng=seed, migrate_every_s=every), **pool)
    run = simulate_decode(t, decode_replicas(sync, migrate_every_s=every), **pool)
    np.testing.assert_array_equal(run.rank, ref.rank)
    np.testing.assert_array_equal(run.finish_s, ref.finish_s)
    assert run.migrations == ref.migrations


# ------------------------------------------------------------------ one exact shared view
@settings(max_examples=15)
@given(k=st.integers(2, 8), seed=st.integers(0, 2**16), caps=st.booleans())
def test_an_exact_shared_view_admits_decode_as_one_router(k, seed, caps):
    # Without migration a decode replica's choice depends only on the per-rank totals (own
    # ledger plus foreign load, exact integers), which an exact shared view makes one router's.
    t = _decode_trace(seed, 150)
    pool = {"ranks_per_engine": 4, "cost": H800.decode, "rng": seed}
    if caps:
        pool.update(max_batch=6, max_kv_tokens=80_000)
    sync = ReplicaSync(k=k, mode="shared", delay_s=0.0)
    ref = simulate_decode(t, LbkitDecode(1, 4, rng=seed, migrate_every_s=None), **pool)
    pol = DecodeReplicas(1, 4, sync=sync, rng=seed, migrate_every_s=None)
    run = simulate_decode(t, pol, **pool)
    np.testing.assert_array_equal(run.rank, ref.rank)
    np.testing.assert_array_equal(run.finish_s, ref.finish_s)
    assert pol.engine_refusals == 0


def _own(pol, j):
    if isinstance(pol, PrefillReplicas):
        o = pol.replicas[j].balancer.own_load()
        return np.stack([o.quota_s, o.work_s, o.num_requests.astype(float)])
    bal = pol.replicas[j].balancer
    return np.stack([bal.num_requests(), bal.kv_tokens()])


def _seen(pol, j):
    if isinstance(pol, PrefillReplicas):
        f = pol.replicas[j].balancer.foreign_load()
        return np.stack([f.quota_s, f.work_s, f.num_requests.astype(float)])
    f = pol.replicas[j].balancer.foreign_load()
    return np.stack([f.num_requests, f.kv_tokens])


class _Model:
    """The sync modes in a few lines: every replica's own load after each event, by time."""

    def __init__(self, sync):
        self.sync, self.log = sync, []

    def record(self, t, pol):
        self.log.append((t, [_own(pol, i) for i in range(self.sync.k)]))

    def foreign(self, j, t):
        s = self.sync
        if s.mode == "none":
            return None
        if s.mode == "polled":  # replica j polls at (n + j / K) period: the states before
            n = math.floor((t - s.period_s * j / s.k) / s.period_s)  # its last poll
            past = [own for (te, own) in self.log if te == -math.inf
                    or math.floor((te - s.period_s * j / s.k) / s.period_s) < n]  # fmt: skip
            own = past[-1]
            return sum((own[i] for i in range(s.k) if i != j), np.zeros_like(own[j]))
        if s.mode == "reports":
            # Report n is due at n * period_s: an event belongs to the state of the last report
            # due by t when it fell in an earlier period. Periods are compared by index
            # (floor(t / period_s)), as the simulator does: n * period_s rounds, e.g.
            # 70 * 0.01 = 0.7000000000000001 > 0.7 although floor(0.7 / 0.01) = 70.
            due = math.floor(t / s.period_s)
            past = [own for (te, own) in self.log
                    if te == -math.inf or math.floor(te / s.period_s) < due]  # fmt: skip
        else:
            # the state after the last event at or before `at`
            at = t - s.delay_s
            past = [own for (te, own) in self.log if te <= at]
        own = past[-1]  # the log starts with the empty ledgers at -inf
        return sum((own[i] for i in range(s.k) if i != j), np.zeros_like(own[j]))


@settings(max_examples=25)
@given(sync=syncs, seed=st.integers(0, 2**16), n=st.integers(5, 40))
@example(sync=ReplicaSync(k=2, mode="reports", delay_s=0.0, period_s=0.01), seed=13, n=5)
def test_prefill_replicas_see_the_others_load_of_their_sync_mode(sync, seed, n):
    # The pinned example: two arrivals at 0.7 s with reports every 0.01 s, where the report
    # time 70 * 0.01 rounds above 0.7 (the model once compared times, not periods).
    # Drive the policy by hand (no engine): arrivals at increasing times, some progress and
    # finishes; before each decision the deciding replica's foreign load is the model's.
    rng = np.random.default_rng(seed)
    pol = PrefillReplicas(E, R, sync=sync, cost=H800.prefill, rng=seed)
    model = _Model(sync)
    view = PrefillView(E, R, np.zeros(E * R, np.int64), np.zeros(E * R, np.int64))
    live: dict[int, int] = {}
    t = 0.0
    model.log.append((-math.inf, [_own(pol, i) for i in range(sync.k)]))
    for i in range(n):
        t += float(rng.choice([0.0, 0.001, 0.1, 0.7]))
        j = i % sync.k
        want = model.foreign(j, t)
        before = _seen(pol, j)
        f = pol.route(i, int(rng.integers(100, 20_000)), 0, now_s=t, view=view)
        if f >= 0:
            live[i] = 1
        # the foreign load in force during the decision (unchanged by the replica's own route)
        got = _seen(pol, j)
        if want is None:
            assert not got.any() and np.array_equal(got, before)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
        model.record(t, pol)
        if live and rng.random() < 0.5:
            done = sorted(live)[: int(rng.integers(1, len(live) + 1))]
            t += float(rng.choice([0.0, 0.05]))
            kinds = np.array([EV_FINISH if rng.random() < 0.5 else EV_PROGRESS for _ in done])
            toks = np.where(kinds == EV_FINISH, 0, 1).astype(np.int64)
            ids = np.array(done, dtype=np.int64)
            pol.observe(ids, kinds.astype(np.int64), toks, now_s=t)
            for d, kind in zip(done, kinds.tolist(), strict=True):
                if kind == EV_FINISH:
                    del live[d]
            model.record(t, pol)
    for j, p in enumerate(pol.replicas):
        held = [rid for e in range(E) for r in range(R) for rid in p.balancer.requests_on(e, r)]
        assert sorted(held) == sorted(i for i in live if i % sync.k == j)
        p.balancer._check()


@settings(max_examples=10)
@given(sync=syncs.filter(lambda s: s.k > 1), seed=st.integers(0, 2**16))
def test_decode_replicas_finish_every_request_and_keep_only_their_own(sync, seed):
    t = _decode_trace(seed, 150)
    pool = {"ranks_per_engine": 4, "cost": H800.decode, "rng": seed,
            "max_batch": 6, "max_kv_tokens": 80_000}  # fmt: skip
    pol = DecodeReplicas(1, 4, sync=sync, rng=seed, migrate_every_s=None)
    run = simulate_decode(t, pol, **pool)
    assert run.finished.sum() + (run.refusal > 0).sum() == len(t)
    for p in pol.replicas:
        assert len(p.balancer) == 0
        p.balancer._check()
    if not sync.exact:
        with pytest.raises(ValueError, match="migration under capacities"):
            simulate_decode(t, DecodeReplicas(1, 4, sync=sync, rng=seed), **pool)


def test_decode_replicas_admit_only_their_own_requests():
    t = _decode_trace(3, 60)
    sync = ReplicaSync(k=3, mode="reports", period_s=0.05)
    pol = DecodeReplicas(1, 4, sync=sync, rng=0, migrate_every_s=0.0)
    simulate_decode(t, pol, ranks_per_engine=4, cost=H800.decode, horizon_s=float(t.arrival_s[40]))
    held = [[rid for r in range(4) for rid in p.balancer.requests_on(r)] for p in pol.replicas]
    assert all(held)  # every replica still holds requests at the horizon, its own only
    for j, ids in enumerate(held):
        assert all(rid % 3 == j for rid in ids)


def test_replicas_are_deterministic():
    t = _trace(5, 200, 0.9)
    kw = {"num_engines": E, "ranks_per_engine": R, "cost": H800.prefill, "rng": 7}
    make = prefill_replicas(ReplicaSync(k=4, mode="reports", period_s=0.3))
    a, b = simulate_prefill(t, make, **kw), simulate_prefill(t, make, **kw)
    np.testing.assert_array_equal(a.rank, b.rank)
    np.testing.assert_array_equal(a.ttft_s, b.ttft_s)
    pol = PrefillReplicas(E, R, sync=ReplicaSync(k=3), cost=H800.prefill, rng=7)
    assert all(isinstance(p, LbkitPrefill) for p in pol.replicas) and pol.name == "lbkit"
