"""The leader's duties on a real server: the automatic reaper (a SIGKILLed replica reaped by
the holder of the reaper's lease), the prefill round (demand summed in the store, the
leader's plan followed, a replaced leader's late write refused by the fencing epoch) and the
EPLB scheduler's state saved under the same fencing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lbkit.core import PRESETS
from lbkit.decode import DecodeBalancer
from lbkit.eplb import EplbScheduler, synthetic_expert_load
from lbkit.prefill import Buckets, PrefillBalancer, Rounds
from lbkit.replicas import RedisStore

from .worker import DECODE_RANKS

COST = PRESETS["h800_dsv3"].prefill


def _worker(server, ns, rid, *flags):
    here = Path(__file__).resolve().parent
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1] / "src"), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, str(here / "worker.py"), server.url, ns, rid, "3", "40", *flags],
        stdout=subprocess.PIPE,
        env=env,
    )


def test_a_killed_replica_is_reaped_by_the_holder_of_the_reapers_lease(redis_server, closing):
    """The killed replica held the reaper's lease itself: once the lease and its silence run
    out, the replica alive takes the lease and reaps it, without anyone calling reap()."""
    with _worker(redis_server, "autoreap", "dead", "hold", "reap=0.4") as proc:
        try:
            dead = json.loads(proc.stdout.readline())
        finally:
            proc.kill()  # SIGKILL: no goodbye
    store = closing(RedisStore(redis_server.url, namespace="autoreap", budget_s=2.0,
                               reap_after_s=0.4))  # fmt: skip
    alive = DecodeBalancer(DECODE_RANKS, store=store, replica_id="alive")
    alive.admit("a0", 300)
    store.flush()
    n = 2 * DECODE_RANKS
    mine = np.concatenate([alive.num_requests(), alive.kv_tokens()])
    if alive.statistics().store_reaped == 0:  # the dead replica's lease had not run out yet
        assert store.totals("decode", n).tolist() == (mine + np.ravel(dead["decode"])).tolist()
        time.sleep(0.6)  # past the lease and the silence
        alive.admit("a1", 300)  # a call: the duty is due
        store.flush()
        mine = np.concatenate([alive.num_requests(), alive.kv_tokens()])
    assert alive.statistics().store_reaped == 1
    assert store.totals("decode", n).tolist() == mine.tolist()
    assert sorted(store.contributions("decode", n)) == ["alive"]
    store.clear()


def _pair(server, closing, ns, lease_s):
    kw = dict(
        cost=COST, buckets=Buckets(edges=(16384,)), rounds=Rounds(min_dwell_s=0.0, max_drain_s=None)
    )
    stores = [closing(RedisStore(server.url, namespace=ns, budget_s=2.0, lease_s=lease_s,
                                 reap_after_s=None)) for _ in range(2)]  # fmt: skip
    return [PrefillBalancer(4, 1, **kw, store=s, replica_id=r)
            for s, r in zip(stores, "ab", strict=True)]  # fmt: skip


def test_the_round_leader_plans_on_the_fleets_demand_and_followers_apply_its_plan(
    redis_server, closing
):
    a, b = _pair(redis_server, closing, "round", lease_s=5.0)
    for i in range(6):  # b routes long prompts only, a short ones only
        b.route(f"b{i}", 60000, now_s=0.1)
        a.route(f"a{i}", 2000, now_s=0.1)
    rb = b.end_round(1.0)  # b takes the lease: it leads, and its cold start moves engines
    ra = a.end_round(1.0)  # a follows b's plan
    sa, sb = a.statistics(), b.statistics()
    assert sb.store_rounds_led == 1 and sa.store_plans_followed == 1
    assert sa.store_rounds_led == 0 and sb.store_plans_followed == 0
    assert rb.moves and all(mv.to_bucket == 1 for mv in rb.moves)
    assert sorted(ra.moves) == sorted(rb.moves) and ra.engines == rb.engines
    assert a.statistics().engine_bucket == b.statistics().engine_bucket
    # Round 2: b's demand holds a's short prompts (published at a's round end).
    rb2 = b.end_round(2.0)
    assert rb.demand[0] == 0.0 and rb2.demand[0] > 0.0
    a.end_round(2.0)
    assert a.statistics().engine_bucket == b.statistics().engine_bucket
    assert a.statistics().store_rounds_led == 0 and b.statistics().store_rounds_led == 2
    for bal in (a, b):
        bal._check()
    b._link.store.clear()


def test_a_paused_round_leader_is_replaced_and_its_late_plan_refused(redis_server, closing):
    a, b = _pair(redis_server, closing, "fence", lease_s=0.3)
    for i in range(4):
        a.route(f"a{i}", 60000, now_s=0.1)
    a.end_round(1.0)  # a leads under epoch 1
    epoch_a = a._link.round_epoch
    time.sleep(0.5)  # a pauses past its lease
    b.end_round(1.5)  # b takes the lease (epoch 2) and writes its plan
    assert b.statistics().store_rounds_led == 1 and b._link.round_epoch == epoch_a + 1
    store = b._link.store
    before = store.read_fenced("round-prefill")
    assert not a._link.write_plan({"home": [0, 0, 0, 0]})  # a wakes up, writes late: refused
    assert a.statistics().store_plans_fenced == 1
    assert store.read_fenced("round-prefill") == before
    assert before[0] == epoch_a + 1
    a.end_round(2.0)  # a finds b's lease: it follows from now on
    sa = a.statistics()
    assert sa.store_rounds_led == 1 and sa.store_plans_followed == 1 and sa.store_plans_fenced == 1
    store.clear()


def test_a_round_without_the_store_is_planned_alone_and_counted(own_server, closing):
    a = _pair(own_server, closing, "roundfail", lease_s=5.0)[0]
    a._link.clock = lambda: 0.0  # no retry while the server is down
    for i in range(4):
        a.route(f"a{i}", 60000, now_s=0.1)
    a.end_round(1.0)
    assert a.statistics().store_rounds_led == 1
    own_server.stop()
    a.route("x", 60000, now_s=1.1)  # a fallback: the store does not answer
    result = a.end_round(2.0)  # planned on a's own demand
    s = a.statistics()
    assert result.demand[1] > 0.0
    assert s.store_round_fallbacks == 1 and s.store_rounds_led == 1
    assert s.store_fallbacks >= 1 and s.store_errors == 2  # the load table's and the demand's
    a._check()


def test_a_decode_balancer_shows_the_duties_counters(redis_server, closing):
    store = closing(RedisStore(redis_server.url, namespace="decstats", budget_s=2.0,
                               reap_after_s=5.0))  # fmt: skip
    bal = DecodeBalancer(DECODE_RANKS, store=store, replica_id="d")
    bal.admit("x", 300)
    s = bal.statistics()
    assert s.store_views == 1 and s.store_reaped == 0  # the reaper's lease taken, none silent
    assert s.store_rounds_led == s.store_plans_followed == s.store_round_fallbacks == 0
    store.clear()


def test_eplb_scheduler_state_is_saved_under_the_leaders_fencing_epoch(any_server, closing):
    """The leader saves its scheduler, a new leader resumes from it and saves its own; the
    old leader's late save is refused and changes nothing."""
    store_a, store_b = (closing(RedisStore(any_server.url, namespace="eplb", budget_s=2.0))
                        for _ in range(2))  # fmt: skip
    w = synthetic_expert_load(2, 16, rng=0)
    sched = EplbScheduler(2, 16, 20, 4, 1, 4, window=2, min_interval_s=60.0)
    sched.record(w)
    assert sched.maybe_rebalance(now_s=0.0).replanned
    assert store_b.load_eplb("eplb") is None
    epoch_a = store_a.acquire_lease("eplb", "a", ttl_s=600.0)
    assert store_a.save_eplb("eplb", epoch_a, sched) == 1
    epoch, version, resumed = store_b.load_eplb("eplb")
    assert (epoch, version) == (epoch_a, 1)
    assert resumed.state_dict() == sched.state_dict()
    resumed.record(w * np.linspace(0.5, 2.0, 16))
    resumed.maybe_rebalance(now_s=120.0)
    # The lease changes hands (a released it here; a paused leader's lease runs out alike).
    assert store_a.release_lease("eplb", "a", epoch_a)
    epoch_b = store_b.acquire_lease("eplb", "b", ttl_s=600.0)
    assert epoch_b == epoch_a + 1
    assert store_b.save_eplb("eplb", epoch_b, resumed) == 2
    sched.record(w * 3)  # a wakes up and saves late: refused
    assert store_a.save_eplb("eplb", epoch_a, sched) == -1
    epoch, version, got = store_a.load_eplb("eplb")
    assert (epoch, version) == (epoch_b, 2)
    assert got.state_dict() == resumed.state_dict() != sched.state_dict()
    assert got.statistics().num_recordings == 2
    got._check()
    with pytest.raises(TypeError, match="scheduler"):
        store_b.save_eplb("eplb", epoch_b, sched.state_dict())
    store_a.clear()
