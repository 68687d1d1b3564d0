"""PrefillBalancer's foreign load: counted in every decision, in no request of the ledger."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.core import PRESETS, QuadraticCost
from lbkit.prefill import Buckets, PrefillBalancer, RankChoice, Rounds

ENGINES, RANKS = 3, 2
N = ENGINES * RANKS
# Dyadic coefficients: every quota and sum below is exact in float64, so a load summed in one
# order or another is the same float and ties break alike.
EXACT = QuadraticCost(a=1.0, b=1.0, k=2.0**-10, q=2.0**-11, b_moe=0.25)
RULES = [
    RankChoice(),
    RankChoice(rule="least_load"),
    RankChoice(rule="least_load", wake_penalty_s=64.0),
    RankChoice(rule="engine_mean"),
]
TOKENS = st.sampled_from([1, 16, 100, 300, 1000])


@given(
    choice=st.sampled_from(RULES),
    ghosts=st.lists(st.tuples(st.integers(0, N - 1), TOKENS, st.sampled_from([0, 8])), max_size=8),
    arrivals=st.lists(st.tuples(TOKENS, st.sampled_from([0, 1])), max_size=10),
    progress=st.lists(
        st.tuples(st.integers(0, 9), st.sampled_from([0, 1, 8]), st.booleans()), max_size=8
    ),
)
def test_foreign_load_decides_as_requests_in_the_ledger(choice, ghosts, arrivals, progress):
    """A foreign load routes as the same requests held in the ledger (built from a saved
    state): same decisions through routes, progress and finishes of the own requests."""
    plain = PrefillBalancer(ENGINES, RANKS, cost=EXACT, choice=choice)
    led = plain._ledger
    quota, work, count = np.zeros(N), np.zeros(N), np.zeros(N, dtype=np.int64)
    rows = []
    for i, (f, total, cached) in enumerate(ghosts):
        q = led.quota(total - min(cached, total - 1), min(cached, total - 1))
        rows.append([f"g{i}", f, total, min(cached, total - 1), 0, q])
        quota[f] += q
        work[f] += q + EXACT.moe_s_per_token * (total - min(cached, total - 1))
        count[f] += 1
    state = plain.state_dict()
    state["state"]["requests"] = rows
    state["state"]["rank_load"] = quota.tolist()
    state["state"]["counts"]["routed"] = len(rows)
    in_ledger = PrefillBalancer.from_state_dict(json.loads(json.dumps(state)))
    plain.set_foreign_load(quota_s=quota, work_s=work, num_requests=count)
    t = 0.0
    for i, (total, cached) in enumerate(arrivals):
        t += 0.5
        a = plain.route(i, total, cached * (total // 2), now_s=t)
        b = in_ledger.route(i, total, cached * (total // 2), now_s=t)
        assert a == b
        for rid, tok, fin in progress:
            if rid == i and rid in plain._ledger.requests:
                left = plain._ledger.get(rid).left
                assert plain.chunk_done(rid, min(tok, left), now_s=t) == in_ledger.chunk_done(
                    rid, min(tok, left), now_s=t
                )
                if fin:
                    assert plain.finish(rid, now_s=t) == in_ledger.finish(rid, now_s=t)
        plain._check()
    own = plain.rank_loads()
    assert np.allclose(own + quota, in_ledger.rank_loads(), rtol=1e-12, atol=0.0)


def _script(bal, ops, zero):
    out = []
    t = 0.0
    for kind, a, b in ops:
        t += 0.25
        if zero:
            bal.set_foreign_load(quota_s=[0.0] * N, work_s=np.zeros(N), num_requests=[0] * N)
        if kind == "route":
            out.append(bal.route(len(out), a, b * a // 2, now_s=t))
        elif kind == "finish" and a in bal._ledger.requests:
            out.append(bal.finish(a, now_s=t))
        elif kind == "chunk" and a in bal._ledger.requests:
            out.append(bal.chunk_done(a, min(b, bal._ledger.get(a).left), now_s=t))
        elif kind == "round":
            out.append(bal.end_round(t))
        bal._check()
    return out


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("route"), st.sampled_from([1, 100, 5000, 30000, 90000]), st.integers(0, 1)
        ),
        st.tuples(st.sampled_from(["finish", "chunk"]), st.integers(0, 20), st.integers(0, 4000)),
        st.tuples(st.just("round"), st.just(0), st.just(0)),
    ),
    max_size=30,
)


@given(choice=st.sampled_from(RULES), ops=OPS)
def test_zero_foreign_load_changes_nothing(choice, ops):
    kw = dict(cost=PRESETS["h800_dsv3"].prefill, choice=choice,
              buckets=Buckets(edges=(16384, 65536)), rounds=Rounds(round_s=1.0))  # fmt: skip
    plain, zero = PrefillBalancer(ENGINES, RANKS, **kw), PrefillBalancer(ENGINES, RANKS, **kw)
    assert _script(plain, ops, False) == _script(zero, ops, True)
    assert plain.statistics() == zero.statistics()
    assert plain.state_dict() == zero.state_dict()


def test_state_dict_round_trip_keeps_the_foreign_load():
    bal = PrefillBalancer(ENGINES, RANKS, cost=PRESETS["h800_dsv3"].prefill)
    bal.set_foreign_load(quota_s=[0.5, 0, 0, 0, 0, 0.1], work_s=[0.7, 0, 0, 0, 0, 0.2],
                         num_requests=[1, 0, 0, 0, 0, 2])  # fmt: skip
    for i, total in enumerate([3000, 20000, 100]):
        bal.route(i, total, now_s=0.0)
    copy = PrefillBalancer.from_state_dict(json.loads(json.dumps(bal.state_dict())))
    copy._check()
    assert copy.statistics() == bal.statistics()
    assert copy.route("x", 5000, now_s=1.0) == bal.route("x", 5000, now_s=1.0)
    assert copy.foreign_load().num_requests.tolist() == [1, 0, 0, 0, 0, 2]


def test_statistics_count_the_ledger_and_show_the_foreign_load():
    bal = PrefillBalancer(2, 1, cost=PRESETS["h800_dsv3"].prefill,
                          choice=RankChoice(rule="least_load"))  # fmt: skip
    bal.set_foreign_load(quota_s=[1.0, 0.0], work_s=[1.0, 0.0], num_requests=[1, 0])
    d = bal.route("a", 1000, now_s=0.0)
    assert d.engine == 1
    s = bal.statistics()
    assert s.rank_load[0] == 0.0 and s.rank_load[1] > 0.0
    assert s.rank_foreign_load == (1.0, 0.0) and s.rank_foreign_requests == (1, 0)
    bal.finish("a", now_s=1.0)
    assert bal.rank_loads().tolist() == [0.0, 0.0]  # exactly: the foreign load stays apart
    assert bal._ledger.total_loads().tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(quota_s=[0.0], work_s=[0.0, 0.0], num_requests=[0, 0]), "quota_s: must have shape"),
        (dict(quota_s=[0.0, -1.0], work_s=[0.0, 0.0], num_requests=[0, 0]), "quota_s"),
        (dict(quota_s=[0.0, 0.0], work_s=[0.0, np.inf], num_requests=[0, 0]), "work_s"),
        (dict(quota_s=[0.0, 0.0], work_s=[0.0, 0.0], num_requests=[0, 0.5]), "num_requests"),
        (dict(quota_s=[0.0, 0.0], work_s=[0.0, 0.0], num_requests=[0, -2]), "num_requests"),
    ],
)
def test_bad_foreign_load_is_refused_and_changes_nothing(kw, match):
    bal = PrefillBalancer(2, 1, cost=PRESETS["h800_dsv3"].prefill)
    bal.set_foreign_load(quota_s=[0.5, 0.0], work_s=[0.5, 0.0], num_requests=[1, 0])
    with pytest.raises(ValueError, match=match):
        bal.set_foreign_load(**kw)
    assert bal.foreign_load().quota_s.tolist() == [0.5, 0.0]
    bal._check()


def test_bad_saved_foreign_load_is_named():
    bal = PrefillBalancer(2, 1, cost=PRESETS["h800_dsv3"].prefill)
    state = bal.state_dict()
    state["state"]["foreign"]["work_s"] = [0.0, -1.0]
    with pytest.raises(ValueError, match=r"state\.foreign\.work_s"):
        PrefillBalancer.from_state_dict(state)
