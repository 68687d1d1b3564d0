"""DecodeBalancer's foreign load: counted in every decision, in no request of the ledger."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.decode import POLICIES, DecodeBalancer, pick_rank

N = 4
KV = st.sampled_from([0, 1, 7, 100, 512, 2048, 8192])
COUNTS = st.lists(st.integers(0, 5), min_size=N, max_size=N)
KVS = st.lists(KV, min_size=N, max_size=N)
DETERMINISTIC = sorted(p for p in POLICIES if p != "random")


def _ops(draw_foreign: bool):
    op = [
        st.tuples(st.just("admit"), KV),
        st.tuples(st.just("finish"), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(0, 3)),
        st.tuples(st.just("rebalance"), st.integers(0, 2)),
        st.tuples(st.just("report"), st.integers(0, N - 1), st.integers(0, 6), KV),
    ]
    if draw_foreign:
        op.append(st.tuples(st.just("foreign"), COUNTS, KVS))
    return st.lists(st.one_of(op), max_size=40)


def _run(bal, ops, foreign_zero: bool):
    """Apply ``ops``; with ``foreign_zero`` set a zero foreign load before every op."""
    out = []
    next_id = 0
    seq = 0
    for op in ops:
        if foreign_zero:
            bal.set_foreign_load(num_requests=np.zeros(N, int), kv_tokens=[0] * N)
        if op[0] == "admit":
            out.append(bal.admit(next_id, op[1]))
            next_id += 1
        elif op[0] == "finish":
            out.append(bal.finish(op[1]) if op[1] in bal else None)
        elif op[0] == "step":
            bal.step(op[1])
        elif op[0] == "rebalance":
            out.append(bal.rebalance(op[1]))
        elif op[0] == "report":
            seq += 1
            out.append(bal.report(op[1], seq, op[2], op[3]))
        bal._check()
    return out


@given(
    policy=st.sampled_from(sorted(POLICIES)),
    lookahead=st.sampled_from([0, 3]),
    max_kv=st.sampled_from([None, 9000]),
    ops=_ops(False),
)
def test_zero_foreign_load_changes_nothing(policy, lookahead, max_kv, ops):
    kw = dict(policy=policy, lookahead_steps=lookahead, max_kv_tokens=max_kv, rng=3)
    plain, zero = DecodeBalancer(N, **kw), DecodeBalancer(N, **kw)
    assert _run(plain, ops, False) == _run(zero, ops, True)
    assert plain.statistics() == zero.statistics()
    a, b = plain.state_dict(), zero.state_dict()
    assert a == b


@given(
    policy=st.sampled_from(DETERMINISTIC),
    scale=st.sampled_from(["mean", "capacity"]),
    max_batch=st.sampled_from([None, 6]),
    max_kv=st.sampled_from([None, 12000]),
    ops=_ops(True),
)
def test_decisions_are_pick_rank_over_the_totals(policy, scale, max_batch, max_kv, ops):
    """Every admission is the pure rule over ledger plus foreign load; steps grow the ledger
    only; finishes release only the ledger."""
    kw = dict(policy=policy, scale=scale, max_batch=max_batch, max_kv_tokens=max_kv)
    bal = DecodeBalancer(N, **kw, max_migrations=0, make_room=False)
    own_kv: dict[int, int] = {}
    fb = np.zeros(N, dtype=np.int64)
    fs = np.zeros(N, dtype=np.int64)
    next_id = 0
    for op in ops:
        if op[0] == "foreign":
            fb, fs = np.array(op[1]), np.array(op[2])
            bal.set_foreign_load(num_requests=fb, kv_tokens=fs)
        elif op[0] == "admit":
            tb = bal.num_requests() + fb
            ts = bal.kv_tokens() + fs
            want = pick_rank(tb, ts, op[1], policy=policy, scale=scale, max_batch=max_batch,
                             max_kv_tokens=max_kv, cursor=bal._cursor)  # fmt: skip
            got = bal.admit(next_id, op[1])
            assert got == want
            if got.rank >= 0:
                own_kv[next_id] = op[1]
            next_id += 1
        elif op[0] == "finish" and op[1] in bal:
            bal.finish(op[1])
            del own_kv[op[1]]
        elif op[0] == "step":
            bal.step(op[1])
            own_kv = {rid: kv + op[1] for rid, kv in own_kv.items()}
        bal._check()
        assert int(bal.kv_tokens().sum()) == sum(own_kv.values())
        assert bal.foreign_load().num_requests.tolist() == fb.tolist()
        assert bal.foreign_load().kv_tokens.tolist() == fs.tolist()


@given(
    policy=st.sampled_from(sorted(POLICIES)),
    lookahead=st.sampled_from([0, 2]),
    fb=COUNTS,
    kvs=st.lists(KV, min_size=3 * N, max_size=3 * N),
    arrivals=st.lists(KV, max_size=12),
    finishes=st.lists(st.integers(0, 11), max_size=6),
)
def test_foreign_load_decides_as_requests_in_the_ledger(
    policy, lookahead, fb, kvs, arrivals, finishes
):
    """A foreign load decides as the same load held by requests of the ledger (built from a
    saved state): same admissions, with or without look-ahead (foreign requests are
    projected to stay, as requests of unknown output are)."""
    kw = dict(policy=policy, lookahead_steps=lookahead, max_kv_tokens=20000, rng=5)
    fs = [sum(kvs[r * 3 : r * 3 + min(fb[r], 3)]) for r in range(N)]
    fb = [min(b, 3) for b in fb]
    with_foreign = DecodeBalancer(N, **kw)
    with_foreign.set_foreign_load(num_requests=fb, kv_tokens=fs)
    state = DecodeBalancer(N, **kw).state_dict()
    ghosts = [[f"g{r}.{i}", r, kvs[r * 3 + i], 0, -1, 0] for r in range(N) for i in range(fb[r])]
    for order, g in enumerate(ghosts):
        g[5] = order
    state["state"]["requests"] = ghosts
    state["state"]["order"] = len(ghosts)
    in_ledger = DecodeBalancer.from_state_dict(json.loads(json.dumps(state)))
    for i, kv in enumerate(arrivals):
        assert with_foreign.admit(i, kv) == in_ledger.admit(i, kv)
        for j in finishes:
            if j == i and j in with_foreign:
                assert with_foreign.finish(j) == in_ledger.finish(j)
    with_foreign._check()


def test_state_dict_round_trip_keeps_the_foreign_load():
    bal = DecodeBalancer(3, lookahead_steps=2)
    bal.set_foreign_load(num_requests=[2, 0, 1], kv_tokens=[500, 0, 40])
    for i, kv in enumerate([100, 300, 7, 900]):
        bal.admit(i, kv)
    bal.step()
    copy = DecodeBalancer.from_state_dict(json.loads(json.dumps(bal.state_dict())))
    copy._check()
    assert copy.statistics() == bal.statistics()
    assert [copy.admit("x", 50), copy.admit("y", 5000)] == [bal.admit("x", 50),
                                                             bal.admit("y", 5000)]  # fmt: skip
    assert copy.foreign_load().kv_tokens.tolist() == [500, 0, 40]


def test_statistics_balance_the_totals_and_count_the_ledger():
    bal = DecodeBalancer(2)
    bal.set_foreign_load(num_requests=[3, 0], kv_tokens=[600, 0])
    assert bal.admit("a", 200).rank == 1
    st_ = bal.statistics()
    assert st_.num_requests == (0, 1) and st_.kv_tokens == (0, 200)
    assert st_.foreign_requests == (3, 0) and st_.foreign_kv_tokens == (600, 0)
    assert st_.count_imbalance == pytest.approx(3 / 2)
    bal.step()
    assert bal.kv_tokens().tolist() == [0, 201]  # foreign KV is the transport's to update
    assert bal.foreign_load().kv_tokens.tolist() == [600, 0]


def test_capacities_count_the_foreign_load():
    bal = DecodeBalancer(2, max_batch=2, max_kv_tokens=1000)
    bal.set_foreign_load(num_requests=[2, 1], kv_tokens=[10, 950])
    assert bal.admit("a", 100).reason == "full"
    bal.set_foreign_load(num_requests=[1, 1], kv_tokens=[10, 950])
    assert bal.admit("a", 100).rank == 0
    with pytest.raises(ValueError, match="rank: 1 has no room"):
        bal.migrate("a", 1)


def test_reports_are_of_the_whole_rank():
    bal = DecodeBalancer(1)
    bal.set_foreign_load(num_requests=[2], kv_tokens=[300])
    bal.admit("a", 100)
    bal.admit("b", 100)
    res = bal.report(0, 1, 4, 560)  # counts agree: own KV becomes 560 - 300
    assert res.accepted and res.corrected and res.drift_requests == 0
    assert res.drift_kv_tokens == 60
    assert bal.kv_tokens().tolist() == [260]
    res = bal.report(0, 2, 5, 900)  # a request in flight: no correction
    assert res.drift_requests == 1 and not res.corrected
    res = bal.report(0, 3, 4, 200)  # less than the foreign KV: the ledger cannot take it
    assert not res.corrected
    bal._check()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(num_requests=[1, 2], kv_tokens=[0, 0, 0]), "num_requests: must have shape"),
        (dict(num_requests=[1, 2, 3], kv_tokens=[0, -1, 0]), "kv_tokens: entries must be >= 0"),
        (dict(num_requests=[1.5, 2, 3], kv_tokens=[0, 0, 0]), "num_requests: must hold integers"),
        (dict(num_requests=[0, 0, 0], kv_tokens=[0, 0, 2**60]), "kv_tokens: entries must be <="),
    ],
)
def test_bad_foreign_load_is_refused_and_changes_nothing(kw, match):
    bal = DecodeBalancer(3)
    bal.set_foreign_load(num_requests=[1, 0, 0], kv_tokens=[5, 0, 0])
    with pytest.raises(ValueError, match=match):
        bal.set_foreign_load(**kw)
    assert bal.foreign_load().num_requests.tolist() == [1, 0, 0]
    bal._check()
    with pytest.raises(TypeError):
        bal.set_foreign_load(num_requests=[0, 0, 0])  # both are required
