"""PrefillBalancer options: cold start, drain limit, engine-aware rank choice, batched records."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.prefill import Buckets, PrefillBalancer, RankChoice, Rounds, allocate_engines

UNIT = PRESETS["unit"].prefill
EDGES = (100, 400)


def make(*, initial_engines=None, max_engines=None, choice=None, **rounds):
    """Four engines of two ranks on ``UNIT`` and ``EDGES``; ordinary rounds (no cold start or
    drain limit, no dwell time) unless ``rounds`` fields say otherwise."""
    buckets = Buckets(edges=EDGES, initial_engines=initial_engines, max_engines=max_engines)
    rounds = {"min_dwell_s": 0.0, "cold_start_s": None, "max_drain_s": None} | rounds
    return PrefillBalancer(4, 2, cost=UNIT, choice=choice, buckets=buckets, rounds=Rounds(**rounds))


# --------------------------------------------------------------------------- cold start
def test_cold_start_is_one_group_then_allocates_from_the_first_demand():
    bal = make(cold_start_s=2.0, max_moves=1, round_s=30.0)
    st0 = bal.statistics()
    assert st0.bucket_engines == (4, 0, 0) and st0.bucket_server == (0, 0, 0)
    assert not bal.round_due(1.9) and bal.round_due(2.0)
    for i in range(3):
        assert bal.route(i, 200, 0, now_s=0.1).reason == "shared_bucket"
    bal.route(3, 50, 0, now_s=0.2)
    res = bal.end_round(2.0)
    want = allocate_engines(np.asarray(res.demand), 4).engines.tolist()
    # The first re-plan reaches the ideal at once (beyond max_moves=1), although pooling all
    # buckets on one group has the lower bottleneck; the bucket without demand gets no engine.
    assert list(res.engines) == want == [1, 3, 0] and len(res.moves) == 3
    assert bal.statistics().bucket_server == (0, 1, 1)
    bal._check()
    # Later rounds are ordinary: round_s long, at most max_moves.
    assert not bal.round_due(31.0) and bal.round_due(32.0)
    for i in range(10, 16):
        bal.route(i, 800, 0, now_s=3.0)
    assert len(bal.end_round(32.0).moves) <= 1
    bal._check()


def test_cold_start_respects_explicit_initial_engines_and_bounds():
    assert make(cold_start_s=1.0, initial_engines=[2, 1, 1]).statistics().bucket_engines == (
        2, 1, 1,
    )  # fmt: skip
    capped = make(cold_start_s=1.0, max_engines=[1, 4, 4])
    assert capped.statistics().bucket_engines == (1, 3, 0)


def test_cold_start_survives_persistence():
    bal = make(cold_start_s=2.0)
    bal.route(1, 200, 0, now_s=0.5)
    copy = PrefillBalancer.from_state_dict(json.loads(json.dumps(bal.state_dict())))
    assert copy.round_due(2.0) and copy.end_round(2.0) == bal.end_round(2.0)


# --------------------------------------------------------------------------- drain limit
def _drain_pool(max_drain_s):
    bal = make(initial_engines=[2, 1, 1], deadband=0.0, max_moves=2, max_drain_s=max_drain_s)
    for i in range(4):  # every rank of bucket 0's engines holds ~104 s
        bal.route(i, 99, 0, now_s=0.0)
    bal.route(10, 200, 0, now_s=0.0)  # bucket 1 is non-empty: its only engine stays
    for i in range(20, 30):
        bal.route(i, 800, 0, now_s=0.0)  # bucket 2 wants more engines
    return bal


def test_max_drain_keeps_engines_that_hold_long_work():
    free = _drain_pool(None).end_round(30.0)
    assert free.moves and all(m.from_bucket == 0 for m in free.moves)
    held = _drain_pool(100.0)
    assert held.end_round(30.0).moves == ()
    held._check()
    assert _drain_pool(110.0).end_round(30.0).moves == free.moves


# --------------------------------------------------------------------------- engine-aware
def test_wake_penalty_fills_the_idle_ranks_of_a_busy_engine_first():
    bal = make(initial_engines=[4, 0, 0], choice=RankChoice(rule="least_load", wake_penalty_s=60.0))
    at = [bal.route(i, 50, 0, now_s=0.0)[:2] for i in range(5)]
    # quota(50) = 51.25 s: the second request takes engine 0's idle rank; the third and fourth
    # queue behind 51.25 s there, which beats waking engine 1 (0 + 60 s); the fifth would queue
    # behind 102.5 s, so it wakes engine 1.
    assert at == [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0)]
    plain = make(initial_engines=[4, 0, 0])
    assert [plain.route(i, 50, 0, now_s=0.0)[:2] for i in range(2)] == [(0, 0), (0, 1)]
    assert plain.route(2, 50, 0, now_s=0.0)[:2] == (1, 0)


def _oracle(loads, candidates, ranks, wake):
    """Brute force: least load plus the wake penalty on idle engines, lowest index on ties."""

    def key(f):
        e = f // ranks
        idle = all(loads[g] == 0.0 for g in range(e * ranks, e * ranks + ranks))
        return (loads[f] + (wake if idle else 0.0), f)

    return min(candidates, key=key)


@given(
    ops=st.lists(
        st.tuples(st.integers(1, 900), st.booleans(), st.integers(0, 30)), min_size=1,
        max_size=40,
    ),
    wake=st.sampled_from([0.0, 5.0, 60.0, 1e6]),
)  # fmt: skip
def test_engine_aware_choice_matches_the_brute_force_oracle(ops, wake):
    bal = make(initial_engines=[2, 1, 1], choice=RankChoice(rule="least_load", wake_penalty_s=wake))
    plain = make(initial_engines=[2, 1, 1], choice=RankChoice(rule="least_load"))
    live = []
    for i, (total, finish, pick) in enumerate(ops):
        if finish and live:
            rid = live.pop(pick % len(live))
            bal.finish(rid, now_s=1.0)
            plain.finish(rid, now_s=1.0)
            continue
        loads = bal.rank_loads().tolist()
        stats = bal.statistics()
        server = stats.bucket_server[sum(total >= e for e in EDGES)]
        cand = [e * 2 + r for e in range(4) for r in range(2) if stats.engine_bucket[e] == server]
        d = bal.route(i, total, 0, now_s=1.0)
        assert d.engine * 2 + d.rank == _oracle(loads, cand, 2, wake)
        if wake == 0.0:  # no penalty: exactly the plain rule
            assert plain.route(i, total, 0, now_s=1.0) == d
        else:
            plain.route(i, total, 0, now_s=1.0)
        live.append(i)
        bal._check()


# --------------------------------------------------------------------------- batched records
@given(
    sizes=st.lists(st.integers(1, 900), min_size=1, max_size=12),
    batch=st.lists(st.tuples(st.integers(0, 11), st.floats(0, 1), st.booleans()), max_size=20),
)
def test_record_equals_chunk_done_and_finish_one_by_one(sizes, batch):
    bal = make(initial_engines=[2, 1, 1], deadband=0.0)
    for i, total in enumerate(sizes):
        bal.route(i, total, total // 3, now_s=0.0)
    bal.end_round(30.0)  # engines may be draining: finishing their last request joins them
    seq = PrefillBalancer.from_state_dict(bal.state_dict())
    ids, toks, fins, left, gone = [], [], [], {}, set()
    for k, frac, fin in batch:
        rid = k % len(sizes)
        if rid in gone:
            continue
        room = left.get(rid, sizes[rid] - sizes[rid] // 3)
        tok = int(room * frac)
        left[rid] = room - tok
        ids.append(rid), toks.append(tok), fins.append(fin)
        if fin:
            gone.add(rid)
            seq.chunk_done(rid, tok, now_s=31.0)
            seq.finish(rid, now_s=31.0)
        else:
            seq.chunk_done(rid, tok, now_s=31.0)
    assert bal.record(np.array(ids, dtype=np.int64), np.array(toks, dtype=np.int64),
                      np.array(fins, dtype=bool), now_s=31.0) == len(gone)  # fmt: skip
    bal._check()
    assert json.dumps(bal.state_dict()) == json.dumps(seq.state_dict())


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((["nope"], [1], [False]), KeyError, "request_id: unknown request 'nope'"),
        ((["a"], [1, 2], [False]), ValueError, "must have the same length, got 1, 2 and 1"),
        ((["a"], [-1], [False]), ValueError, "tokens: must be >= 0"),
        ((["a"], [1.5], [False]), TypeError, "tokens: must be an integer"),
        ((["a"], [41], [False]), ValueError, "tokens: request 'a' has 40 tokens left"),
        ((["a", "a"], [30, 11], [False, False]), ValueError, "request 'a' has 10 tokens left"),
        ((["a", "a"], [0, 0], [True, False]), KeyError, "unknown request 'a'"),
        ((["b", [1]], [5, 0], [True, False]), KeyError, "unknown request"),
    ],
)  # fmt: skip
def test_record_validates_the_whole_batch_before_applying_any(args, exc, match):
    bal = make(initial_engines=[2, 1, 1])
    bal.route("a", 50, 10, now_s=0.0)
    bal.route("b", 300, 0, now_s=0.0)
    before = json.dumps(bal.state_dict())
    with pytest.raises(exc, match=match):
        bal.record(*args, now_s=1.0)
    bal._check()
    assert json.dumps(bal.state_dict()) == before


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (Rounds, {"cold_start_s": 0.0}, "cold_start_s: must be > 0.0"),
        (Rounds, {"max_drain_s": -1.0}, "max_drain_s: must be >= 0.0"),
        (RankChoice, {"wake_penalty_s": float("nan"), "rule": "least_load"},
         "wake_penalty_s: must not be NaN"),
    ],
)  # fmt: skip
def test_bad_options(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
