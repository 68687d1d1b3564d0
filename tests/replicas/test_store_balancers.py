"""Balancers on a real store: parity with the in-process balancer, K concurrent replicas,
idempotent retries, a server outage mid-run, and the fallback estimate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.core.replica import ReplicaLink, StoreError
from lbkit.decode import POLICIES, DecodeBalancer
from lbkit.prefill import Buckets, PrefillBalancer, RankChoice
from lbkit.replicas import RedisStore

from .worker import DECODE_RANKS, ENGINES, RANKS

N = 4
KV = st.sampled_from([0, 1, 7, 100, 512, 2048, 8192])
COST = PRESETS["h800_dsv3"].prefill
_examples = iter(range(10**9))


def _store(server, ns=None, budget_s=2.0, mirror=False):
    return RedisStore(server.url, namespace=ns or f"h{next(_examples)}", budget_s=budget_s,
                      mirror=mirror)  # fmt: skip


DECODE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), KV),
        st.tuples(st.just("finish"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(0, 3)),
        st.tuples(st.just("rebalance"), st.integers(0, 2)),
        st.tuples(st.just("report"), st.integers(0, N - 1), st.integers(0, 5), KV),
    ),
    max_size=30,
)


def _decode_run(bal, ops):
    out = []
    seq = 0
    for i, op in enumerate(ops):
        if op[0] == "admit":
            out.append(bal.admit(i, op[1]))
        elif op[0] == "finish" and op[1] in bal:
            out.append(bal.finish(op[1]))
        elif op[0] == "step":
            bal.step(op[1])
        elif op[0] == "rebalance":
            out.append(bal.rebalance(op[1]))
        elif op[0] == "report":
            seq += 1
            out.append(bal.report(op[1], seq, op[2], op[3]))
    bal._check()
    return out


@settings(max_examples=30)
@given(policy=st.sampled_from(sorted(POLICIES)), lookahead=st.sampled_from([0, 2]),
       ops=DECODE_OPS, mirror=st.booleans())  # fmt: skip
def test_one_replica_decides_as_the_in_process_decode_balancer(redis_server, policy, lookahead,
                                                               ops, mirror):  # fmt: skip
    kw = dict(policy=policy, lookahead_steps=lookahead, max_kv_tokens=20000, rng=1)
    with _store(redis_server, mirror=mirror) as store:
        alone = DecodeBalancer(N, **kw)
        shared = DecodeBalancer(N, **kw, store=store, replica_id="a")
        assert _decode_run(alone, ops) == _decode_run(shared, ops)
        s = shared.statistics()
        assert s.store_fallbacks == 0 and s.store_errors == 0
        store.flush()
        assert store.totals("decode", 2 * N).tolist() == [*s.num_requests, *s.kv_tokens]
        store.clear()


PREFILL_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("route"), st.sampled_from([1, 100, 5000, 30000]), st.integers(0, 1)),
        st.tuples(st.sampled_from(["finish", "chunk"]), st.integers(0, 20), st.integers(0, 4000)),
        st.tuples(st.just("round"), st.just(0), st.just(0)),
    ),
    max_size=25,
)


def _prefill_run(bal, ops):
    out = []
    t = 0.0
    for i, (kind, a, b) in enumerate(ops):
        t += 0.25
        if kind == "route":
            out.append(bal.route(i, a, b * a // 2, now_s=t))
        elif kind == "finish" and a in bal._ledger.requests:
            out.append(bal.finish(a, now_s=t))
        elif kind == "chunk" and a in bal._ledger.requests:
            out.append(bal.chunk_done(a, min(b, bal._ledger.get(a).left), now_s=t))
        elif kind == "round":
            out.append(bal.end_round(t))
    bal._check()
    return out


@settings(max_examples=30)
@given(choice=st.sampled_from([RankChoice(), RankChoice(rule="least_load")]), ops=PREFILL_OPS,
       mirror=st.booleans())  # fmt: skip
def test_one_replica_decides_as_the_in_process_prefill_balancer(redis_server, choice, ops,
                                                                mirror):  # fmt: skip
    kw = dict(cost=COST, choice=choice, buckets=Buckets(edges=(16384, 65536)))
    with _store(redis_server, mirror=mirror) as store:
        alone = PrefillBalancer(3, 2, **kw)
        shared = PrefillBalancer(3, 2, **kw, store=store, replica_id="a")
        assert _prefill_run(alone, ops) == _prefill_run(shared, ops)
        assert alone.state_dict()["state"] == shared.state_dict()["state"]
        assert shared.statistics().store_fallbacks == 0
        store.clear()


def test_two_replicas_see_each_other(redis_server, closing):
    store_a, store_b = closing(_store(redis_server, "two")), closing(_store(redis_server, "two"))
    a = DecodeBalancer(2, store=store_a, replica_id="a")
    b = DecodeBalancer(2, store=store_b, replica_id="b")
    assert a.admit("x", 5000).rank == 0
    assert b.admit("y", 5000).rank == 1  # b counts a's request on rank 0
    assert b.statistics().foreign_kv_tokens == (5000, 0)
    a.finish("x")
    store_a.flush()  # the finish's publish is pipelined: applied once its reply is read
    b.admit("z", 10)
    assert b.statistics().foreign_requests == (0, 0)
    with pytest.raises(KeyError):
        a.finish("x")  # a double finish is refused by the ledger: nothing is published
    store_b.flush()
    assert store_a.totals("decode", 4).tolist() == [1, 1, 10, 5000]
    store_a.clear()


REPLICA_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), KV),
        st.tuples(st.just("finish"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(0, 3)),
    ),
    max_size=30,
)


@settings(max_examples=20)
@given(policy=st.sampled_from(["cost", "least_kv", "least_requests", "min_max", "sum_of_squares"]),
       max_kv=st.sampled_from([None, 12000]), k=st.integers(2, 3), ops=REPLICA_OPS)  # fmt: skip
def test_replicas_driven_one_call_at_a_time_admit_as_one_balancer(redis_server, policy, max_kv,
                                                                  k, ops):  # fmt: skip
    """K replicas, each on its own connection, called one after the other with each call's
    publish applied before the next call (``flush``): every view is the exact totals, so
    without migration they admit as one in-process balancer on the same requests. Without the
    ``flush`` a publish is pipelined, and another replica's view sent later on its own
    connection may reach the server first (the server serves connections in the order its
    event loop reads them): that is the one interleaving a run's decisions depend on."""
    kw = dict(policy=policy, max_kv_tokens=max_kv, max_migrations=0, make_room=False)
    ns = f"h{next(_examples)}"
    stores = [_store(redis_server, ns) for _ in range(k)]
    try:
        one = DecodeBalancer(N, **kw)
        reps = [DecodeBalancer(N, **kw, store=s, replica_id=f"r{j}") for j, s in enumerate(stores)]
        for i, op in enumerate(ops):
            if op[0] == "admit":
                j = i % k
                assert reps[j].admit(i, op[1]) == one.admit(i, op[1])
                stores[j].flush()
            elif op[0] == "finish" and op[1] in one:
                j = op[1] % k
                assert reps[j].finish(op[1]) == one.finish(op[1])
                stores[j].flush()
            elif op[0] == "step":
                one.step(op[1])
                for j, rep in enumerate(reps):
                    rep.step(op[1])
                    stores[j].flush()
        total = sum(np.concatenate([r.num_requests(), r.kv_tokens()]) for r in reps)
        assert total.tolist() == [*one.num_requests(), *one.kv_tokens()]
        assert stores[0].totals("decode", 2 * N).tolist() == total.tolist()
        stores[0].clear()
    finally:
        for s in stores:
            s.close()


def test_two_mirroring_replicas_see_each_other(redis_server, closing):
    stores = [closing(_store(redis_server, "two-m", mirror=True)) for _ in range(2)]
    a = DecodeBalancer(2, store=stores[0], replica_id="a")
    b = DecodeBalancer(2, store=stores[1], replica_id="b")
    assert b.admit("w", 1).rank == 0  # b subscribes and snapshots
    stores[1].flush()
    assert a.admit("x", 5000).rank == 1  # a's snapshot holds w
    stores[0].flush()  # applied and announced: b reads it at its next decision
    assert b.admit("y", 5000).rank == 0
    assert b.statistics().foreign_kv_tokens == (0, 5000)
    a.finish("x")
    stores[0].flush()
    b.rebalance()
    assert b.statistics().foreign_requests == (0, 0)
    assert b._link.store._mirror.counts["snapshots"] == 1
    stores[0].clear()  # announced: b's mirror takes a new snapshot
    b.admit("z", 7)  # its partial publish is refused (the store lost b's contribution),
    stores[1].flush()
    b.admit("q", 3)  # which this call finds: b publishes whole
    stores[1].flush()
    want = np.concatenate([b.num_requests(), b.kv_tokens()])
    assert stores[0].totals("decode", 4).tolist() == want.tolist()
    assert b._link.store._mirror.counts["snapshots"] == 2
    assert b.statistics().store_reconnects == 1
    stores[0].clear()


def test_concurrent_replicas_add_up(redis_server, closing):
    """K processes admit, finish (twice) and step at once, half of them viewing the store and
    half mirroring it: the totals are the sum of the contributions and of the replicas' own
    ledgers."""
    k, ops = 4, 150
    here = Path(__file__).resolve().parent
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")  # no compile per process: plain Python
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1] / "src"), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(here / "worker.py"),
                redis_server.url,
                "conc",
                f"r{i}",
                str(i),
                str(ops),
                *(["mirror"] if i % 2 else []),
            ],
            stdout=subprocess.PIPE,
            env=env,
        )
        for i in range(k)
    ]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0
            results.append(json.loads(out))
    finally:
        for p in procs:  # those left when one failed or timed out
            if p.poll() is None:
                p.kill()
            p.communicate()
    store = closing(_store(redis_server, "conc"))
    n_dec = 2 * DECODE_RANKS
    tot = store.totals("decode", n_dec)
    contrib = store.contributions("decode", n_dec)
    assert sorted(contrib) == [f"r{i}" for i in range(k)]
    assert (sum(contrib.values()) == tot).all()
    ledgers = sum(np.array(r["decode"]).ravel() for r in results)
    assert tot.tolist() == ledgers.tolist()
    n_pre = 3 * ENGINES * RANKS
    ptot = store.totals("prefill", n_pre).reshape(3, -1)
    assert ptot[0].tolist() == sum(np.array(r["prefill_count"]) for r in results).tolist()
    assert ptot[1].tolist() == sum(np.array(r["prefill_quota_ns"]) for r in results).tolist()
    assert all(r["fallbacks"] == 0 for r in results)
    store.clear()


def test_outage_keeps_routing_and_recovers_without_loss(own_server, closing):
    """Stop the server mid-run, keep admitting and finishing, restart it (empty: no
    persistence): the replicas publish again and the totals are their ledgers."""
    clock = [0.0]
    stores = [closing(_store(own_server, "out", budget_s=0.5)) for _ in range(2)]
    bals = [DecodeBalancer(4, store=s, replica_id=f"r{i}") for i, s in enumerate(stores)]
    for bal in bals:
        bal._link.clock = lambda: clock[0]
    for i in range(8):
        bals[i % 2].admit(i, 100 * (i + 1))
    own_server.stop()
    for i in range(8, 16):
        d = bals[i % 2].admit(i, 100 * (i + 1))
        assert d.rank >= 0  # routing goes on
        if i % 3 == 0:
            bals[i % 2].finish(i - 8)
        bals[i % 2].step()
    for bal in bals:
        s = bal.statistics()
        assert s.store_errors >= 1 and s.store_fallbacks >= 4
    own_server.start()
    clock[0] += 10.0  # past the retry delay
    for i, bal in enumerate(bals):
        bal.admit(f"after{i}", 50)
    tot = stores[0].totals("decode", 8)
    want = sum(np.concatenate([b.num_requests(), b.kv_tokens()]) for b in bals)
    assert tot.tolist() == want.tolist()
    assert all(b.statistics().store_reconnects >= 1 for b in bals)
    for bal in bals:
        bal._check()


def test_a_replica_that_saw_no_failure_rebuilds_a_lost_store(own_server, closing):
    store = closing(_store(own_server, "lost"))
    bal = PrefillBalancer(2, 2, cost=COST, store=store, replica_id="a")
    bal.route("x", 20000, now_s=0.0)
    own_server.stop()
    own_server.start()  # between two calls: the replica never saw the outage
    bal.route("y", 3000, now_s=0.1)
    tot = store.totals("prefill", 12).reshape(3, -1)
    assert tot[0].sum() == 2
    assert tot[1].tolist() == np.rint(bal.rank_loads() * 1e9).astype(np.int64).tolist()
    assert bal.statistics().store_reconnects == 1


def test_a_paused_server_costs_one_budget_then_falls_back(own_server, closing):
    store = closing(_store(own_server, "pause", budget_s=0.1))
    bal = DecodeBalancer(2, store=store, replica_id="a")
    bal._link.clock = lambda: 0.0  # no retry while paused
    bal.admit("x", 10)
    own_server.pause()
    try:
        for i in range(5):
            bal.admit(i, 10)
    finally:
        own_server.resume()
    s = bal.statistics()
    assert s.store_errors == 1 and s.store_fallbacks == 5


class _Down:
    """A store that answers until told not to."""

    def __init__(self):
        self.up = True

    def sync(self, key, replica_id, version, fields, values, size, whole=False):
        if not self.up:
            raise StoreError("down")
        mine = self.mine if hasattr(self, "mine") else np.zeros(self.foreign.size, dtype=np.int64)
        if version >= 0:
            mine = mine.copy()
            mine[fields] = values
            self.version = version
        self.mine = mine
        return (self.foreign + mine if size else None), getattr(self, "version", -1)


def test_the_fallback_extrapolates_own_changes_by_traffic_share():
    store = _Down()
    store.foreign = np.array([30, 30, 3000, 3000])  # 2 ranks: 60 foreign requests
    link = ReplicaLink(store, "a", key="decode", num_ranks=2, columns=2)
    own = np.array([[10, 10], [1000, 1000]])
    link.publish(own)
    assert link.view(own).tolist() == [[30, 30], [3000, 3000]]
    assert link.share == pytest.approx(0.25)
    store.up = False
    own2 = np.array([[12, 10], [1200, 900]])
    est = link.view(own2)  # others are taken to do 3x what we did since the view
    assert est.tolist() == [[36, 30], [3600, 2700]]
    assert link.counts["fallbacks"] == 1 and link.counts["errors"] == 1


def test_store_and_replica_id_go_together():
    with pytest.raises(ValueError, match="replica_id: given without a store"):
        DecodeBalancer(2, replica_id="a")
    with pytest.raises(ValueError, match="replica_id"):
        DecodeBalancer(2, store=_Down(), replica_id="")
    with pytest.raises(TypeError, match="store"):
        PrefillBalancer(1, 1, cost=COST, store=object(), replica_id="a")


def test_a_killed_replica_is_reaped_and_a_paused_one_comes_back_whole(redis_server, closing):
    """SIGKILL a replica process: its contribution stays until reaped; a replica only silent
    (paused) is reaped too, and publishes its whole ledger again when it calls next."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1] / "src"), env.get("PYTHONPATH", "")])
    with subprocess.Popen(
        [sys.executable, str(here / "worker.py"), redis_server.url, "reap", "dead", "7", "60",
         "hold"],
        stdout=subprocess.PIPE,
        env=env,
    ) as proc:  # fmt: skip
        try:
            dead = json.loads(proc.stdout.readline())
        finally:
            proc.kill()  # SIGKILL: no goodbye
    store = closing(_store(redis_server, "reap"))
    alive = DecodeBalancer(DECODE_RANKS, store=store, replica_id="alive")
    paused = DecodeBalancer(DECODE_RANKS, store=closing(_store(redis_server, "reap")),
                            replica_id="paused")  # fmt: skip
    for i in range(6):
        alive.admit(f"a{i}", 300)
        paused.admit(f"p{i}", 70)
    n = 2 * DECODE_RANKS
    ledger = {name: np.concatenate([b.num_requests(), b.kv_tokens()])
              for name, b in (("alive", alive), ("paused", paused))}  # fmt: skip
    ledger["dead"] = np.array(dead["decode"]).ravel()
    assert store.totals("decode", n).tolist() == sum(ledger.values()).tolist()
    time.sleep(1.0)
    alive.admit("a-last", 300)  # a call: alive's heartbeat is fresh
    ledger["alive"] = np.concatenate([alive.num_requests(), alive.kv_tokens()])
    assert store.reap("decode", max_silence_s=0.5) == ("dead", "paused")
    assert store.reap("decode", max_silence_s=0.5) == ()  # idempotent
    assert store.totals("decode", n).tolist() == ledger["alive"].tolist()
    paused.finish("p0")  # its partial publish is refused,
    paused.admit("p6", 70)  # which its next call finds: it publishes whole
    paused._link.store.flush()
    ledger["paused"] = np.concatenate([paused.num_requests(), paused.kv_tokens()])
    assert store.totals("decode", n).tolist() == (ledger["alive"] + ledger["paused"]).tolist()
    assert paused.statistics().store_reconnects == 1
    contrib = store.contributions("decode", n)
    assert sorted(contrib) == ["alive", "paused"]
    store.clear()


def test_a_replica_restarted_from_its_state_publishes_its_ledger(own_server, closing):
    store = closing(_store(own_server, "restart"))
    dec = DecodeBalancer(4, store=store, replica_id="a")
    pre = PrefillBalancer(2, 2, cost=COST, store=store, replica_id="a")
    for i in range(5):
        dec.admit(i, 100 * i)
        pre.route(i, 1000 * (i + 1), now_s=0.0)
    dec_state, pre_state = json.dumps(dec.state_dict()), json.dumps(pre.state_dict())
    own_server.stop()  # the server restarts empty, the replica restarts from its state
    own_server.start()
    dec2 = DecodeBalancer.from_state_dict(json.loads(dec_state), store=store, replica_id="a")
    pre2 = PrefillBalancer.from_state_dict(json.loads(pre_state), store=store, replica_id="a")
    assert store.totals("decode", 8).tolist() == [*dec2.num_requests(), *dec2.kv_tokens()]
    ptot = store.totals("prefill", 12).reshape(3, -1)
    assert ptot[1].tolist() == np.rint(pre2.rank_loads() * 1e9).astype(np.int64).tolist()
    alone = DecodeBalancer.from_state_dict(json.loads(dec_state))
    assert [dec2.admit(j, 10 * j) for j in range(10, 14)] == [
        alone.admit(j, 10 * j) for j in range(10, 14)
    ]
    assert dec2.statistics().store_fallbacks == 0
