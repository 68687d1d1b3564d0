"""``PrefillBalancer.reassign`` (an engine moves a request that has not started between ranks)
and ``fill_holes`` (a request takes a free rank of a stepping engine of another bucket)."""

from __future__ import annotations

import pytest

from lbkit.core import PRESETS
from lbkit.prefill import Buckets, PrefillBalancer, RankChoice

COST = PRESETS["h800_dsv3"].prefill


def _balancer():
    bal = PrefillBalancer(2, 4, cost=COST, buckets=Buckets(edges=(16384,), initial_engines=(2, 0)))
    for rid in range(3):  # ranks 0, 1, 2 of engine 0
        bal.route(rid, 4000, 0, now_s=0.0)
    return bal


def test_reassign_moves_the_quota_within_the_engine():
    bal = _balancer()
    before = bal.rank_loads()
    bal.reassign(0, 3, now_s=0.5)
    after = bal.rank_loads()
    assert after[0] == 0.0 and after[3] == pytest.approx(before[0])
    assert after.sum() == pytest.approx(before.sum())
    assert bal.requests_on(0, 3) == (0,) and bal.requests_on(0, 0) == ()
    assert bal.statistics().reassigned == 1
    # The next request sees the moved load: rank 0 is free again.
    assert bal.route(9, 4000, 0, now_s=0.6).rank == 0
    bal.reassign(1, 1, now_s=0.7)  # to its own rank: nothing changes, nothing counted
    assert bal.statistics().reassigned == 1
    bal._check()


def test_reassign_keeps_the_request_on_its_engine_and_survives_a_state_round_trip():
    bal = _balancer()
    bal.reassign(2, 0, now_s=0.1)
    assert bal.requests_on(0, 0) == (0, 2)
    again = PrefillBalancer.from_state_dict(bal.state_dict())
    assert again.statistics() == bal.statistics()
    assert again.finish(2, now_s=1.0) == 4000
    again._check()


def test_reassign_rejects_bad_input_and_changes_nothing():
    bal = _balancer()
    bal.chunk_done(1, 100, now_s=0.2)
    before = bal.statistics()
    with pytest.raises(KeyError, match="request_id: unknown request 'nope'"):
        bal.reassign("nope", 0, now_s=0.3)
    with pytest.raises(ValueError, match="rank: "):
        bal.reassign(0, 4, now_s=0.3)
    with pytest.raises(ValueError, match="rank: "):
        bal.reassign(0, -1, now_s=0.3)
    with pytest.raises(ValueError, match="request_id: request 1 has started"):
        bal.reassign(1, 0, now_s=0.3)
    with pytest.raises(ValueError, match="now_s"):
        bal.reassign(0, 1, now_s=float("nan"))
    assert bal.statistics() == before
    bal._check()


def test_fill_holes_uses_another_buckets_stepping_engine():
    unit = PRESETS["unit"].prefill  # quota(n) = n + 0.0005 n^2 seconds
    buckets = Buckets(edges=(1000,), initial_engines=(1, 1))
    least = RankChoice(rule="least_load", wake_penalty_s=10.0)
    fill = RankChoice(rule="least_load", wake_penalty_s=10.0, fill_holes=True)
    bal = PrefillBalancer(2, 2, cost=unit, choice=fill, buckets=buckets)
    plain = PrefillBalancer(2, 2, cost=unit, choice=least, buckets=buckets)
    for b in (bal, plain):
        assert b.route("long", 2000, 0, now_s=0.0)[:2] == (1, 0)  # 4000 s on engine 1
    # A short prompt fits in engine 1's steps (105 s <= 4000 s) on its free rank, which beats
    # waking the idle engine of its own bucket (score 10).
    assert bal.route("s1", 100, 0, now_s=0.1) == (1, 1, 0, "fill")
    assert plain.route("s1", 100, 0, now_s=0.1) == (0, 0, 0, "own_bucket")
    # The next one: that rank now holds 105 s, more than the own choice's score: own bucket.
    assert bal.route("s2", 100, 0, now_s=0.2) == (0, 0, 0, "own_bucket")
    # Engine 0 steps now: its free rank (score 0) is the own choice, and no hole beats it.
    assert bal.route("s3", 100, 0, now_s=0.3) == (0, 1, 0, "own_bucket")
    assert bal.state_dict()["config"]["choice"]["fill_holes"] is True
    bal._check()


def test_fill_holes_must_be_a_bool():
    with pytest.raises(TypeError, match="fill_holes: must be a bool"):
        RankChoice(rule="least_load", fill_holes=1)


def test_context_parallel_scores_engines():
    unit = PRESETS["unit"].prefill  # quota(n) = n + 0.0005 n^2 seconds
    buckets = Buckets(edges=(1000,), initial_engines=(2, 1))
    cp = PrefillBalancer(3, 2, cost=unit, choice=RankChoice(rule="engine_mean"), buckets=buckets)
    ranks = PrefillBalancer(3, 2, cost=unit, choice=RankChoice(rule="least_load"), buckets=buckets)
    for b in (cp, ranks):
        assert b.route("a", 400, 0, now_s=0.0)[:2] == (0, 0)  # 480 s on engine 0, rank 0
    # Rank by rank, engine 0's free rank is the least loaded; engine by engine, engine 1
    # (mean 0) beats engine 0 (mean 240 s): the long prompt gets an engine to share.
    assert ranks.route("b", 300, 0, now_s=0.1)[:2] == (0, 1)
    assert cp.route("b", 300, 0, now_s=0.1)[:2] == (1, 0)
    # Engine 1's mean (172.5 s) is still below engine 0's (240 s): engine 1's free rank.
    assert cp.route("c", 10, 0, now_s=0.2)[:2] == (1, 1)
    assert cp.state_dict()["config"]["choice"]["rule"] == "engine_mean"
    again = PrefillBalancer.from_state_dict(cp.state_dict())
    assert again.route("d", 10, 0, now_s=0.3) == cp.route("d", 10, 0, now_s=0.3)
    cp._check()


def test_context_parallel_wake_penalty_and_spill():
    unit = PRESETS["unit"].prefill
    buckets = Buckets(edges=(1000,), initial_engines=(2, 1))
    wake = RankChoice(rule="engine_mean", wake_penalty_s=1000.0)
    bal = PrefillBalancer(3, 2, cost=unit, choice=wake, buckets=buckets)
    bal.route("a", 400, 0, now_s=0.0)  # engine 0: mean 240 s; engine 1 idle pays 1,000
    assert bal.route("b", 300, 0, now_s=0.1)[:2] == (0, 1)
    ratio = RankChoice(rule="engine_mean", spill_ratio=2.0)
    spill = PrefillBalancer(3, 2, cost=unit, choice=ratio, buckets=buckets)
    spill.route("a", 900, 0, now_s=0.0)  # 1,305 s: engine 0 mean 652.5
    spill.route("b", 900, 0, now_s=0.0)  # engine 1 of bucket 0, same
    # the next short prompt's engines average 652.5 s, more than twice the long bucket's 0
    assert spill.route("c", 10, 0, now_s=0.1) == (2, 0, 0, "spill")


@pytest.mark.parametrize(
    ("opts", "match"),
    [({"fill_holes": True}, "fill_holes: applies to rule='least_load' only, not to "
      "rule='engine_mean'"),
     ({"sample": 2}, "sample: applies to rule='least_load' only, not to rule='engine_mean'")],
)  # fmt: skip
def test_engine_mean_refuses_rank_level_rules(opts, match):
    with pytest.raises(ValueError, match=match):
        RankChoice(rule="engine_mean", **opts)
