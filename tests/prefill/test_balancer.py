"""PrefillBalancer: routing rule, progress accounting, rounds, engines, reports, persistence."""

from __future__ import annotations

import json
import math
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.core import PRESETS, QuadraticCost
from lbkit.prefill import DEFAULT_EDGES, Buckets, PrefillBalancer, RankChoice, Rounds, bucket_of

UNIT = PRESETS["unit"].prefill
EDGES = (100, 400)


def make(**kw):
    """A balancer on ``UNIT`` from flat option fields grouped into the option objects (rounds:
    ordinary, no cold start or drain limit unless given; the rank rule only if ``rule=``)."""
    args = {"cost": UNIT, "edges": EDGES, "initial_engines": [2, 1, 1], "min_dwell_s": 0.0} | kw
    return balancer(args.pop("num_engines", 4), args.pop("ranks", 2), **args)


def balancer(num_engines, ranks, *, cost, rng=None, **flat):
    groups = {}
    for cls in (RankChoice, Buckets, Rounds):
        names = {f.name for f in fields(cls)}
        groups[cls] = {k: flat.pop(k) for k in list(flat) if k in names}
    assert not flat, f"unknown option fields {sorted(flat)}"
    rounds = {"cold_start_s": None, "max_drain_s": None} | groups[Rounds]
    return PrefillBalancer(
        num_engines, ranks, cost=cost, rng=rng, choice=RankChoice(**groups[RankChoice]),
        buckets=Buckets(**groups[Buckets]), rounds=Rounds(**rounds),
    )  # fmt: skip


def candidates(bal, bucket):
    """Flat ranks of the active engines serving ``bucket``, from the statistics alone."""
    st_ = bal.statistics()
    h = st_.bucket_server[bucket]
    r = bal.num_ranks // len(st_.engine_state)
    return [
        e * r + k
        for e, (home, state) in enumerate(zip(st_.engine_bucket, st_.engine_state, strict=True))
        if home == h and state == "active"
        for k in range(r)
    ]


def test_route_takes_the_least_loaded_rank_of_the_bucket_lowest_index_on_ties():
    bal = make(rule="least_load")
    rng = np.random.default_rng(1)
    for i in range(60):
        total = int(rng.integers(1, 800))
        bucket = bucket_of(total, edges=EDGES)
        cand = candidates(bal, bucket)
        load = bal.rank_loads()
        want = min(cand, key=lambda f: (load[f], f))
        d = bal.route(i, total, int(rng.integers(0, total + 1)), now_s=float(i))
        assert d.engine * 2 + d.rank == want and d.bucket == bucket
        assert d.reason == "own_bucket"
        bal._check()


def test_quota_load_is_the_remaining_quota_and_chunking_is_free_when_tied():
    bal = make()
    bal.route("x", 300, 50, now_s=0.0)
    d = bal.route("y", 300, 0, now_s=0.0)
    assert d.bucket == 1
    f = d.engine * 2 + d.rank
    assert bal.rank_loads()[f] == pytest.approx(UNIT.quota(300, 0))
    bal.chunk_done("y", 120, now_s=1.0)
    assert bal.rank_loads()[f] == pytest.approx(UNIT.quota(180, 120))
    assert bal.rank_loads()[f] == pytest.approx(UNIT.quota(300, 0) - UNIT.work(120, 0))
    assert bal.chunk_done("y", 180, now_s=2.0) == 0
    assert bal.rank_loads()[f] == pytest.approx(0.0, abs=1e-9)
    assert bal.finish("y", now_s=2.0) == 0
    assert bal.rank_loads()[f] == 0.0
    bal._check()


def test_untied_cost_load_is_the_one_chunk_quota_of_what_is_left():
    cost = QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.002)  # q > k/2
    bal = make(cost=cost)
    d = bal.route("y", 300, 0, now_s=0.0)
    f = d.engine * 2 + d.rank
    bal.chunk_done("y", 100, now_s=1.0)
    assert bal.rank_loads()[f] == pytest.approx(cost.quota(200, 100))
    # The decrease is not the chunk's work (chunking saves q - k/2 per pair) ...
    assert cost.quota(300, 0) - cost.quota(200, 100) != pytest.approx(cost.work(100, 0))
    bal.chunk_done("y", 200, now_s=2.0)
    assert bal.rank_loads()[f] == 0.0  # ... but it telescopes to zero.
    bal._check()


def test_finish_early_returns_what_was_left():
    bal = make()
    bal.route(1, 50, 10, now_s=0.0)
    bal.chunk_done(1, 15, now_s=0.5)
    assert bal.finish(1, now_s=1.0) == 25
    assert bal.statistics().finished == 1 and bal.statistics().queued == 0


def test_moving_engine_drains_then_joins_its_new_bucket():
    bal = make(max_moves=1, deadband=0.0)
    bal.route("long", 500, 0, now_s=0.0)  # bucket 2, engine 3
    for i in range(20):
        bal.route(i, 50, 0, now_s=0.1)  # bucket 0 only
    for i in range(20):
        bal.finish(i, now_s=0.2)
    for i in range(40):
        bal.route(f"m{i}", 200, 0, now_s=1.0)  # bucket 1 gets most demand
    res = bal.end_round(30.0)
    assert len(res.moves) == 1
    mv = res.moves[0]
    st_ = bal.statistics()
    if mv.engine == 3:  # the busy engine drains
        assert st_.engine_state[3] == "draining"
    assert st_.engine_bucket[mv.engine] == mv.to_bucket
    bal._check()
    # A draining engine takes no new work.
    for i in range(10):
        d = bal.route(f"n{i}", 200, 0, now_s=31.0)
        assert bal.statistics().engine_state[d.engine] == "active"
    bal._check()


def test_draining_engine_joins_after_its_last_request():
    bal = make(num_engines=3, ranks=1, initial_engines=[2, 0, 1], max_moves=1, deadband=0.0)
    for i in range(3):
        bal.route(f"b{i}", 500, 0, now_s=0.0)  # engine 2, bucket 2
    for i in range(4):
        bal.route(i, 200, 0, now_s=1.0)  # bucket 1, served by engines 0 and 1 (bucket 0)
    assert bal.statistics().bucket_server == (0, 0, 2)
    res = bal.end_round(30.0)
    # Bucket 0 had no demand: an engine of it moves to bucket 1 (ideal [0, 1, 2]); engines 0
    # and 1 are equally loaded, so the lower index moves, after draining its 2 requests.
    assert [tuple(m) for m in res.moves] == [(0, 0, 1)]
    st_ = bal.statistics()
    assert st_.engine_state == ("draining", "active", "active")
    assert st_.bucket_server == (0, 0, 2)  # meanwhile engine 1 still serves buckets 0 and 1
    d = bal.route("c", 50, 0, now_s=31.0)
    assert (d.engine, d.reason) == (1, "own_bucket")
    bal._check()
    for rid in bal.requests_on(0, 0):
        bal.finish(rid, now_s=32.0)
        bal._check()
    st_ = bal.statistics()
    assert st_.engine_state == ("active", "active", "active")
    assert st_.bucket_server == (0, 1, 2)
    assert bal.route("d", 200, 0, now_s=33.0).engine == 0


def test_idle_moving_engine_joins_at_once():
    bal = make(num_engines=2, ranks=1, initial_engines=[1, 0, 1], max_moves=1, deadband=0.0)
    for i in range(5):
        bal.route(i, 200, 0, now_s=1.0)
    bal.route("a", 50, 0, now_s=1.0)
    res = bal.end_round(30.0)
    assert [tuple(m) for m in res.moves] == [(1, 2, 1)]
    assert bal.statistics().engine_state == ("active", "active")
    assert bal.statistics().bucket_server == (0, 1, 1)
    bal._check()


def test_remove_engine_reroutes_every_request_and_restore():
    bal = make()
    for i in range(30):
        bal.route(i, [50, 200, 500][i % 3], 0, now_s=0.0)
    on = {rid for k in range(2) for rid in bal.requests_on(3, k)}
    bal.chunk_done(next(iter(on)), 1, now_s=0.5)
    moved = bal.remove_engine(3, now_s=1.0)
    assert {rid for rid, _ in moved} == on
    for _, d in moved:
        assert d.engine not in (3, -1) and d.reason == "shared_bucket"  # bucket 2 shares
    st_ = bal.statistics()
    assert st_.engine_state[3] == "out" and st_.queued == 30 and st_.rerouted == len(on)
    assert st_.bucket_server == (0, 1, 1)
    bal._check()
    with pytest.raises(ValueError, match="engine: 3 is already out of service"):
        bal.remove_engine(3, now_s=1.0)
    bal.restore_engine(3, now_s=2.0)
    assert bal.statistics().bucket_server == (0, 1, 2)
    with pytest.raises(ValueError, match="engine: 3 is in service"):
        bal.restore_engine(3, now_s=2.0)
    bal._check()


def test_last_engine_out_hands_requests_back_and_refuses_new_ones():
    bal = make(num_engines=1, ranks=2, initial_engines=[1, 0, 0])
    bal.route("a", 50, 0, now_s=0.0)
    bal.route("b", 500, 0, now_s=0.0)
    moved = dict(bal.remove_engine(0, now_s=1.0))
    assert moved["a"].reason == moved["b"].reason == "no_engine"
    assert moved["a"].engine == -1
    d = bal.route("c", 50, 0, now_s=2.0)
    assert d == (-1, -1, 0, "no_engine")
    st_ = bal.statistics()
    assert (st_.queued, st_.handed_back, st_.refused, st_.routed) == (0, 2, 1, 2)
    bal._check()
    assert bal.end_round(30.0).moves == ()
    bal.restore_engine(0, now_s=31.0, bucket=2)
    assert bal.route("c", 50, 0, now_s=31.0).reason == "shared_bucket"
    bal._check()


def test_reports_reconcile_the_ledger_and_ignore_stale_ones():
    bal = make()
    d = bal.route("a", 300, 100, now_s=0.0)
    bal.route("b", 300, 0, now_s=0.0)
    e = d.engine
    before = bal.rank_loads().copy()
    res = bal.report(e, 5, {"a": 150, "zzz": 3}, now_s=1.0)
    assert res.accepted and res.unknown == ("zzz",)
    assert res.drift_s == pytest.approx(UNIT.quota(200, 100) - UNIT.quota(50, 250))
    f = e * 2 + d.rank
    assert bal.rank_loads()[f] == pytest.approx(UNIT.quota(50, 250))
    assert bal.rank_loads()[f] < before[f]
    assert bal.report(e, 5, {"a": 200}, now_s=1.5) == (False, 0.0, (), ())
    assert bal.report(e, 4, {"a": 200}, now_s=1.5).accepted is False
    # An older snapshot never undoes progress.
    assert bal.report(e, 6, {"a": 20}, now_s=2.0).accepted
    assert bal.rank_loads()[f] == pytest.approx(UNIT.quota(50, 250))
    st_ = bal.statistics()
    assert (st_.reports_accepted, st_.reports_stale) == (2, 2)
    assert st_.drift_max_s == pytest.approx(res.drift_s)
    bal._check()


def test_report_lists_missing_requests():
    bal = make(num_engines=1, ranks=1, initial_engines=[1, 0, 0])
    bal.route("a", 50, 0, now_s=0.0)
    bal.route("b", 50, 0, now_s=0.0)
    assert bal.report(0, 0, {"a": 10}, now_s=1.0).missing == ("b",)


def test_plan_engine_drives_the_queue_to_completion():
    bal = make(num_engines=1, ranks=2, initial_engines=[1, 0, 0])
    for i in range(6):
        bal.route(i, 90, 10, now_s=0.0)
    steps = 0
    while bal.statistics().queued:
        plan = bal.plan_engine(0, budget_s=120.0, min_chunk=8)
        assert plan.step_time_s == max(p.step_time_s for p in plan.plans)
        for ids, p in zip(plan.request_ids, plan.plans, strict=True):
            for rid, c in zip(ids, p.chunk_tokens.tolist(), strict=True):
                if bal.chunk_done(rid, c, now_s=float(steps)) == 0:
                    bal.finish(rid, now_s=float(steps))
        bal._check()
        steps += 1
    assert steps > 1 and bal.statistics().finished == 6


def test_spill_over_to_a_much_less_loaded_neighbour():
    bal = make(
        num_engines=2, ranks=1, initial_engines=[1, 1, 0], spill_ratio=2.0, rule="least_load"
    )
    bal.route("a", 90, 0, now_s=0.0)
    d = bal.route("b", 90, 0, now_s=0.0)
    assert d.reason == "spill" and d.bucket == 0 and d.engine == 1
    plain = make(num_engines=2, ranks=1, initial_engines=[1, 1, 0])
    plain.route("a", 90, 0, now_s=0.0)
    assert plain.route("b", 90, 0, now_s=0.0).engine == 0  # off by default
    bal._check()


def test_sampling_is_seeded():
    a = make(num_engines=4, ranks=8, initial_engines=[4, 0, 0], sample=2, rng=7, rule="least_load")
    b = make(num_engines=4, ranks=8, initial_engines=[4, 0, 0], sample=2, rng=7, rule="least_load")
    da = [a.route(i, 50, 0, now_s=0.0) for i in range(50)]
    db = [b.route(i, 50, 0, now_s=0.0) for i in range(50)]
    assert da == db
    assert len({(d.engine, d.rank) for d in da}) > 8


def _ops(seed):
    """A fixed random script of balancer calls."""
    rng = np.random.default_rng(seed)
    ops, live, t = [], [], 0.0
    for i in range(120):
        t += float(rng.exponential(1.0))
        u = rng.random()
        if u < 0.55 or not live:
            total = int(rng.integers(1, 900))
            ops.append(("route", i, total, int(rng.integers(0, total + 1)), t))
            live.append((i, total))
        elif u < 0.75:
            rid, _ = live[int(rng.integers(len(live)))]
            ops.append(("chunk", rid, 1, t))
        elif u < 0.9:
            rid, _ = live.pop(int(rng.integers(len(live))))
            ops.append(("finish", rid, t))
        else:
            ops.append(("round", t + 30.0))
            t += 30.0
    return ops


def _replay(bal, ops):
    out = []
    for op in ops:
        if op[0] == "route":
            out.append(bal.route(op[1], op[2], op[3], now_s=op[4]))
        elif op[0] == "chunk":
            try:
                out.append(bal.chunk_done(op[1], op[2], now_s=op[3]))
            except (KeyError, ValueError) as exc:
                out.append(type(exc).__name__)
        elif op[0] == "finish":
            try:
                out.append(bal.finish(op[1], now_s=op[2]))
            except KeyError:
                out.append("KeyError")
        else:
            out.append(bal.end_round(op[1]).moves)
    return out


@given(seed=st.integers(0, 10**6), k=st.integers(-12, 12).filter(lambda x: x != 0))
def test_scaling_the_cost_model_changes_no_decision(seed, k):
    c = 2.0**k  # exact scaling: loads, demands and bottlenecks scale without rounding
    scaled = QuadraticCost(a=UNIT.a * c, b=UNIT.b * c, k=UNIT.k * c, q=UNIT.q * c)
    ops = _ops(seed)
    a = make(deadband=0.05, max_moves=2)
    b = make(deadband=0.05, max_moves=2, cost=scaled, step_budget_s=c)
    assert _replay(a, ops) == _replay(b, ops)
    assert np.allclose(a.rank_loads() * c, b.rank_loads(), rtol=1e-12)
    a._check()
    b._check()


@given(seed=st.integers(0, 10**6), total=st.integers(1, 900), extra=st.integers(1, 900))
def test_more_load_on_a_rank_never_attracts_the_next_request(seed, total, extra):
    base = make()
    _replay(base, [op for op in _ops(seed) if op[0] != "round"])
    more = PrefillBalancer.from_state_dict(base.state_dict())
    d_extra = more.route("extra", extra, 0, now_s=1e6)  # lands on one rank of `more` only
    loaded = d_extra.engine * 2 + d_extra.rank
    a = base.route("next", total, 0, now_s=1e6)
    b = more.route("next", total, 0, now_s=1e6)
    fa, fb = a.engine * 2 + a.rank, b.engine * 2 + b.rank
    if fb == loaded:
        assert fa == loaded
    if fa != loaded:
        assert fb == fa


@given(seed=st.integers(0, 10**6), cut=st.integers(0, 120))
def test_state_dict_round_trip_continues_identically(seed, cut):
    ops = _ops(seed)
    a = make(sample=2, rng=3, rule="least_load")
    _replay(a, ops[:cut])
    b = PrefillBalancer.from_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.statistics() == a.statistics()
    b._check()
    assert _replay(a, ops[cut:]) == _replay(b, ops[cut:])
    assert a.statistics() == b.statistics()


def test_from_state_dict_rejects_bad_states():
    with pytest.raises(ValueError, match="state: expected a state_dict of version"):
        PrefillBalancer.from_state_dict({"version": 99})
    bal = make()
    bal.route(1, 50, 0, now_s=0.0)
    sd = bal.state_dict()
    sd["state"]["rank_load"][0] += 5.0
    with pytest.raises(ValueError, match="state.rank_load: rank 0 has load"):
        PrefillBalancer.from_state_dict(sd)


def test_round_due_and_demand_ema():
    bal = make(ema_alpha=0.5, round_s=30.0, max_moves=0)
    assert not bal.round_due(29.0) and bal.round_due(30.0)
    bal.route(1, 50, 0, now_s=1.0)
    r1 = bal.end_round(30.0)
    assert r1.demand[0] == pytest.approx(UNIT.quota(50, 0) / 30.0)
    r2 = bal.end_round(60.0)
    assert r2.demand[0] == pytest.approx(UNIT.quota(50, 0) / 60.0)
    assert bal.statistics().rounds == 2


# --------------------------------------------------------------------------- bad input
BAD_CALLS = [
    ("route", (1, -5, 0), {}, ValueError, "total_tokens: must be >= 0"),
    ("route", (1, 10.5, 0), {}, TypeError, "total_tokens: must be an integer"),
    ("route", (1, 10, 1.5), {}, TypeError, "cached_tokens: must be an integer"),
    ("route", (1, 10, -1), {}, ValueError, "cached_tokens: must be >= 0"),
    ("route", (1, 10, 11), {}, ValueError, r"cached_tokens: must be <= total_tokens \(10\)"),
    ("route", (1, 0, 0), {}, ValueError, "total_tokens: must be >= 1"),
    # per-rank cached tokens (8 ranks): the int64 fast path and the full validation
    (
        "route",
        (1, 10, np.array([0, 0, 0, -1, 0, 0, 0, 0])),
        {},
        ValueError,
        r"cached_tokens: entries must be >= 0 \(found -1 at index \(3,\)\)",
    ),
    (
        "route",
        (1, 10, np.array([0, 0, 0, 11, 0, 0, 0, 0])),
        {},
        ValueError,
        r"cached_tokens: must be <= total_tokens \(10\) on every rank, got 11",
    ),
    (
        "route",
        (1, 10, [0, 0, 0, 11, 0, 0, 0, 0]),
        {},
        ValueError,
        r"cached_tokens: must be <= total_tokens \(10\) on every rank",
    ),
    (
        "route",
        (1, 10, np.zeros(7, dtype=np.int64)),
        {},
        ValueError,
        "cached_tokens: must have shape",
    ),
    ("route", (1, 10, np.full(8, 0.5)), {}, ValueError, "cached_tokens: must hold integers"),
    (
        "route",
        (1, 10.5, np.zeros(8, dtype=np.int64)),
        {},
        TypeError,
        "total_tokens: must be an integer",
    ),
    ("route", ("dup", 10, 0), {}, ValueError, "request_id: 'dup' is already in the ledger"),
    ("route", ((1, 2), 10, 0), {}, TypeError, "request_id: must be an int or a str"),
    ("route", (1, 10, 0), {"now_s": float("nan")}, ValueError, "now_s: must not be NaN"),
    ("chunk_done", ("nope", 5), {}, KeyError, "request_id: unknown request 'nope'"),
    ("chunk_done", ("dup", -1), {}, ValueError, "tokens: must be >= 0"),
    ("chunk_done", ("dup", 2.5), {}, TypeError, "tokens: must be an integer"),
    ("chunk_done", ("dup", 500), {}, ValueError, "tokens: request 'dup' has 40 tokens left"),
    ("finish", ("nope",), {}, KeyError, "request_id: unknown request 'nope'"),
    ("finish", ([1],), {}, KeyError, "request_id: unknown request"),
    ("remove_engine", (9,), {}, ValueError, "engine: must be <= 3"),
    ("remove_engine", (-1,), {}, ValueError, "engine: must be >= 0"),
    ("restore_engine", (0,), {}, ValueError, "engine: 0 is in service"),
    ("report", (0, -1, {}), {}, ValueError, "seq: must be >= 0"),
    ("report", (0, 1, [1]), {}, TypeError, "progress: must be a mapping"),
    ("report", (0, 1, {"dup": 41}), {}, ValueError, r"progress\['dup'\]: must be <= .* \(40\)"),
    ("report", (0, 1, {"dup": -1}), {}, ValueError, r"progress\['dup'\]: must be >= 0"),
    ("plan_engine", (0,), {"budget_s": -1.0}, ValueError, "budget_s: must be >= 0.0"),
    ("end_round", (), {"now_s": -1.0}, ValueError, "now_s: must be after the start"),
    ("requests_on", (0, 5), {}, ValueError, "rank: must be <= 1"),
]


@pytest.mark.parametrize(("method", "args", "kwargs", "exc", "match"), BAD_CALLS)
def test_bad_input_raises_and_changes_nothing(method, args, kwargs, exc, match):
    bal = make()
    bal.route("dup", 50, 10, now_s=0.0)
    bal.route("other", 300, 0, now_s=0.0)
    before = bal.statistics()
    sd = json.dumps(bal.state_dict())
    kw = ({} if method in ("end_round", "requests_on", "plan_engine") else {"now_s": 1.0}) | kwargs
    with pytest.raises(exc, match=match):
        getattr(bal, method)(*args, **kw)
    bal._check()
    assert bal.statistics() == before
    assert json.dumps(bal.state_dict()) == sd


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((0, 4), {}, ValueError, "num_engines: must be >= 1"),
        ((4, 0), {}, ValueError, "ranks_per_engine: must be >= 1"),
        ((4, 2), {"cost": "unit"}, TypeError, "cost: must be a QuadraticCost"),
        ((4, 2), {"edges": [5, 5]}, ValueError, "edges: must be strictly increasing"),
        ((4, 2), {"round_s": 0.0}, ValueError, "round_s: must be > 0.0"),
        ((4, 2), {"ema_alpha": 0.0}, ValueError, "ema_alpha: must be > 0.0"),
        ((4, 2), {"method": "x"}, ValueError, "method: must be one of"),
        ((4, 2), {"initial_engines": [1, 1, 1]}, ValueError, "initial_engines: must sum to"),
        ((4, 2), {"min_engines": [3, 3, 0]}, ValueError, "min_engines: the minimums need 6"),
        ((4, 2), {"spill_ratio": 0.5}, ValueError, "spill_ratio: must be >= 1.0"),
        ((4, 2), {"sample": 0, "rule": "least_load"}, ValueError, "sample: must be >= 1"),
    ],
)
def test_bad_construction(args, kwargs, exc, match):
    kw = {"cost": UNIT, "edges": EDGES} | kwargs
    with pytest.raises(exc, match=match):
        balancer(*args, **kw)


def test_default_pool_spreads_engines_and_serves_every_bucket():
    bal = balancer(16, 4, cost=PRESETS["h800_dsv3"].prefill, edges=DEFAULT_EDGES)
    st_ = bal.statistics()
    assert st_.bucket_engines == (4, 4, 4, 4) and st_.bucket_server == (0, 1, 2, 3)
    assert len(st_.rank_load) == 64 and math.fsum(st_.rank_load) == 0.0


def test_numpy_integer_ids_are_stored_as_int():
    bal = make()
    bal.route(np.int64(7), 50, 0, now_s=0.0)
    assert bal.statistics().queued == 1
    with pytest.raises(ValueError, match="request_id: 7 is already in the ledger"):
        bal.route(7, 50, 0, now_s=0.0)
    assert bal.finish(np.int32(7), now_s=1.0) == 50
    with pytest.raises(TypeError, match="request_id: must be an int or a str, got bool"):
        bal.route(True, 50, 0, now_s=0.0)
    bal._check()


def test_a_whole_prompt_in_cache_still_computes_its_last_token():
    # cached_tokens == total_tokens (one figure, or on one rank) used to be routed and then
    # skipped by plan_engine for ever; the engine computes the last prompt token for its logits.
    bal = PrefillBalancer(1, 2, cost=PRESETS["h800_dsv3"].prefill)
    hits = np.array([1024, 0])
    assert bal.route("a", 1024, 1024, now_s=0.0).rank == 0
    assert bal.route("b", 1024, hits, now_s=0.0).rank == 0
    assert hits.tolist() == [1024, 0]  # the caller's array is not changed
    plan = bal.plan_engine(0, budget_s=1.0)
    assert plan.request_ids[0] == ("a", "b") and plan.plans[0].chunk_tokens.tolist() == [1, 1]
    for rid in ("a", "b"):
        assert bal.chunk_done(rid, 1, now_s=0.1) == 0
        bal.finish(rid, now_s=0.1)
    bal._check()
    st_ = bal.statistics()
    assert (st_.queued, st_.routed, st_.finished) == (0, 2, 2)
