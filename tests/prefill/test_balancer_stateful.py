"""PrefillBalancer against a plain-Python model under any interleaving of its calls."""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lbkit.core import PRESETS
from lbkit.prefill import Buckets, PrefillBalancer, RankChoice, Rounds

COST = PRESETS["unit"].prefill
EDGES = (100, 400)
ENGINES, RANKS = 4, 2


class Model:
    """Where every request is, and what it has left: the balancer's ledger, in plain Python."""

    def __init__(self):
        self.live = {}  # id -> [total, cached, done, flat rank]
        self.status = {}  # id -> "live" | "finished" | "handed_back" | "refused"
        self.state = ["active"] * ENGINES  # "active"/"draining" as one: "in"; or "out"
        self.step = [(-math.inf, -math.inf)] * ENGINES  # each engine's last reported step

    def quota(self, rid):
        total, cached, done, _ = self.live[rid]
        return float(COST.quota(total - cached - done, cached + done))

    def rank_loads(self):
        loads = [[] for _ in range(ENGINES * RANKS)]
        for rid, (_, _, _, f) in self.live.items():
            loads[f].append(self.quota(rid))
        return [math.fsum(x) for x in loads]

    def rank_work(self):
        """Step-time work per rank (quota plus routed-expert time) and requests per rank."""
        work = [[] for _ in range(ENGINES * RANKS)]
        count = [0] * (ENGINES * RANKS)
        for rid, (total, cached, done, f) in self.live.items():
            work[f].append(self.quota(rid) + COST.moe_s_per_token * (total - cached - done))
            count[f] += 1
        return [math.fsum(x) for x in work], count

    def on_engine(self, e):
        return {rid for rid, v in self.live.items() if v[3] // RANKS == e}


class BalancerMachine(RuleBasedStateMachine):
    #: Balancer options (subclasses exercise others); rounds keep the defaults (a 5 s cold
    #: start, a 30 s drain limit) beyond the common hysteresis.
    CHOICE: ClassVar[RankChoice] = RankChoice()
    INITIAL: ClassVar[tuple[int, ...] | None] = (2, 1, 1)
    ROUNDS: ClassVar[dict[str, Any]] = {}

    def __init__(self):
        super().__init__()
        self.bal = PrefillBalancer(
            ENGINES, RANKS, cost=COST, choice=self.CHOICE,
            buckets=Buckets(edges=EDGES, initial_engines=self.INITIAL),
            rounds=Rounds(min_dwell_s=0.0, deadband=0.0, max_moves=2, **self.ROUNDS),
        )  # fmt: skip
        self.model = Model()
        self.now = 0.0
        self.next_id = 0
        self.seq = [-1] * ENGINES  # last accepted report per engine

    def tick(self, dt):
        self.now += dt
        return self.now

    @rule(total=st.integers(1, 900), frac=st.floats(0, 1), dt=st.floats(0, 2))
    def route(self, total, frac, dt):
        cached = int(total * frac)
        rid = self.next_id
        self.next_id += 1
        stats = self.bal.statistics()
        before = self.bal.rank_loads()
        work, count = self.model.rank_work()
        d = self.bal.route(rid, total, cached, now_s=self.tick(dt))
        cached = min(cached, total - 1)  # a whole prompt in cache still computes its last token
        assert d.bucket == sum(total >= e for e in EDGES)
        if d.engine < 0:
            assert "active" not in stats.engine_state and d.reason == "no_engine"
            self.model.status[rid] = "refused"
            return
        # The rank is the least loaded of the active engines serving the bucket (lowest index);
        # with a wake penalty, ranks of idle engines (no load on any rank) count it on top.
        server = stats.bucket_server[d.bucket]
        cand = [
            e * RANKS + r for e in range(ENGINES) for r in range(RANKS)
            if stats.engine_bucket[e] == server and stats.engine_state[e] == "active"
        ]  # fmt: skip
        wake = self.CHOICE.wake_penalty_s or 0.0

        def score(x):
            e = x // RANKS
            idle = all(before[g] == 0.0 for g in range(e * RANKS, e * RANKS + RANKS))
            return (before[x] + (wake if idle else 0.0), x)

        f = d.engine * RANKS + d.rank
        want = min(cand, key=score)
        reason = "own_bucket" if server == d.bucket else "shared_bucket"
        if self.CHOICE.rule == "lockstep":
            # Earliest finish in lockstep steps (budget 1 s), plus the growth of the engine's work
            # weighted by the choice's weights (busy and idle engines).
            rem = total - cached
            own = float(COST.quota(rem, cached)) + COST.moe_s_per_token * rem

            def lockstep_score(x):
                e = x // RANKS
                top = max(work[e * RANKS : (e + 1) * RANKS])
                busy = sum(count[e * RANKS : (e + 1) * RANKS]) > 0
                y = work[x] + own
                fin = min(max(y, top), math.ceil(y / 1.0)) if busy else y
                weight = self.CHOICE.growth_weight if busy else self.CHOICE.idle_growth_weight
                wait = max(0.0, self.model.step[e][1] - self.now)  # the rest of its step
                return wait + fin + weight * max(0.0, y - top)

            best = min(lockstep_score(x) for x in cand)
            assert lockstep_score(f) <= best + 1e-9 * max(1.0, best)
            want = f
        if self.CHOICE.rule == "engine_mean":
            # The engine with the least mean load (plus the wake penalty when idle; lowest
            # engine on ties), then its least loaded rank (lowest on ties).
            def engine_score(e):
                loads = before[e * RANKS : (e + 1) * RANKS]
                return (sum(loads) / RANKS + (0.0 if max(loads) > 0.0 else wake), e)

            e = min({x // RANKS for x in cand}, key=engine_score)
            want = min(range(e * RANKS, (e + 1) * RANKS), key=lambda x: (before[x], x))
        if self.CHOICE.fill_holes:
            # Hole filling: when the own choice would lengthen its engine's steps, the least
            # loaded rank of any active engine that takes the quota within its most loaded
            # rank, if no more loaded than the own choice's score.
            quota = float(COST.quota(total - cached, cached))
            holes = [
                e * RANKS + r for e in range(ENGINES) for r in range(RANKS)
                if stats.engine_state[e] == "active" and before[e * RANKS + r] + quota
                <= max(before[e * RANKS : (e + 1) * RANKS])
            ]  # fmt: skip
            e = want // RANKS
            if holes and before[want] + quota > max(before[e * RANKS : (e + 1) * RANKS]):
                order = {e: (stats.engine_bucket[e], e) for e in range(ENGINES)}
                h = min(holes, key=lambda x: (before[x], order[x // RANKS], x % RANKS))
                if before[h] <= score(want)[0]:
                    want, reason = h, "fill"
        assert f == want
        assert d.reason == reason
        self.model.live[rid] = [total, cached, 0, f]
        self.model.status[rid] = "live"

    @rule(total=st.sampled_from([50, 250, 800]), n=st.integers(2, 10))
    def route_burst(self, total, n):
        # Many requests of one bucket at once: engines stay busy, so moving ones must drain.
        for _ in range(n):
            self.route(total=total, frac=0.0, dt=0.0)

    def live_ids(self):
        return sorted(self.model.live)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), dt=st.floats(0, 2))
    def chunk_done(self, data, dt):
        rid = data.draw(st.sampled_from(self.live_ids()))
        total, cached, done, _ = self.model.live[rid]
        tokens = data.draw(st.integers(0, total - cached - done))
        left = self.bal.chunk_done(rid, tokens, now_s=self.tick(dt))
        self.model.live[rid][2] += tokens
        assert left == total - cached - done - tokens

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), dt=st.floats(0, 2))
    def finish(self, data, dt):
        rid = data.draw(st.sampled_from(self.live_ids()))
        total, cached, done, _ = self.model.live.pop(rid)
        assert self.bal.finish(rid, now_s=self.tick(dt)) == total - cached - done
        self.model.status[rid] = "finished"

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), dt=st.floats(0, 2))
    def record(self, data, dt):
        # A batch of progress and completions; an id may repeat until its finishing entry.
        entries, left, gone = [], {}, set()
        for _ in range(data.draw(st.integers(1, 6))):
            rid = data.draw(st.sampled_from(self.live_ids()))
            if rid in gone:
                continue
            total, cached, done, _ = self.model.live[rid]
            room = left.get(rid, total - cached - done)
            tokens = data.draw(st.integers(0, room))
            fin = data.draw(st.booleans())
            left[rid] = room - tokens
            if fin:
                gone.add(rid)
            entries.append((rid, tokens, fin))
        ids, toks, fins = zip(*entries, strict=True) if entries else ((), (), ())
        assert self.bal.record(ids, toks, fins, now_s=self.tick(dt)) == len(gone)
        for rid, tokens, fin in entries:
            self.model.live[rid][2] += tokens
            if fin:
                del self.model.live[rid]
                self.model.status[rid] = "finished"

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), dt=st.floats(0, 2))
    def reassign(self, data, dt):
        # The engine moved a request to another of its ranks (work sharing): only a request
        # without reported progress may move; a started one is refused and nothing changes.
        rid = data.draw(st.sampled_from(self.live_ids()))
        _, _, done, f = self.model.live[rid]
        rank = data.draw(st.integers(0, RANKS - 1))
        before = self.bal.statistics()
        if done:
            try:
                self.bal.reassign(rid, rank, now_s=self.tick(dt))
            except ValueError:
                assert self.bal.statistics() == before
                return
            raise AssertionError("a started request was moved")
        self.bal.reassign(rid, rank, now_s=self.tick(dt))
        new = (f // RANKS) * RANKS + rank
        self.model.live[rid][3] = new
        if new != f:  # a moved request joins the end of its new rank's queue
            assert self.bal.requests_on(new // RANKS, rank)[-1] == rid
        assert self.bal.statistics().reassigned == before.reassigned + (new != f)

    @rule(dt=st.floats(0.5, 60))
    def end_round(self, dt):
        before = self.bal.statistics()
        res = self.bal.end_round(self.tick(dt))
        cold = self.bal.rounds.cold_start_s is not None and before.rounds == 0
        assert len(res.moves) <= (ENGINES if cold else 2)
        stats = self.bal.statistics()
        limit = self.bal.rounds.max_drain_s
        for m in res.moves:
            assert stats.engine_bucket[m.engine] == m.to_bucket
            if limit is not None:  # engines holding more than max_drain_s stay
                assert max(before.rank_load[m.engine * RANKS : (m.engine + 1) * RANKS]) <= limit

    @rule(engine=st.integers(0, ENGINES - 1), dt=st.floats(0, 2))
    def remove_engine(self, engine, dt):
        if self.bal.statistics().engine_state[engine] == "out":
            return
        expected = self.model.on_engine(engine)
        moved = self.bal.remove_engine(engine, now_s=self.tick(dt))
        assert {rid for rid, _ in moved} == expected and len(moved) == len(expected)
        for rid, d in moved:
            if d.engine < 0:
                del self.model.live[rid]
                self.model.status[rid] = "handed_back"
            else:
                assert d.engine != engine
                self.model.live[rid][2] = 0  # restarts elsewhere
                self.model.live[rid][3] = d.engine * RANKS + d.rank

    @rule(engine=st.integers(0, ENGINES - 1), bucket=st.none() | st.integers(0, 2))
    def restore_engine(self, engine, bucket):
        if self.bal.statistics().engine_state[engine] != "out":
            return
        self.bal.restore_engine(engine, now_s=self.tick(0.1), bucket=bucket)

    @rule(engine=st.integers(0, ENGINES - 1), stale=st.booleans(), data=st.data())
    def report(self, engine, stale, data):
        ids = sorted(self.model.on_engine(engine))
        chosen = data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
        progress = {}
        for rid in chosen:
            total, cached, _, _ = self.model.live[rid]
            progress[rid] = data.draw(st.integers(0, total - cached))
        gap = data.draw(st.integers(1, 3))
        seq = max(self.seq[engine] - gap + 1, 0) if stale else self.seq[engine] + gap
        res = self.bal.report(engine, seq, progress, now_s=self.tick(0.1))
        assert res.accepted == (seq > self.seq[engine])
        if res.accepted:
            self.seq[engine] = seq
            for rid, tokens in progress.items():
                v = self.model.live[rid]
                v[2] = max(v[2], tokens)
            assert set(res.missing) == set(ids) - set(chosen)

    @rule(
        engine=st.integers(0, ENGINES - 1),
        duration=st.floats(0, 600),
        late=st.floats(0, 2),
        dt=st.floats(0, 1),
    )
    def step_started(self, engine, duration, late, dt):
        # The report of a step that started ``late`` seconds ago (reports may cross: one older
        # than the engine's last is ignored).
        start = self.tick(dt) - late
        before = self.bal.statistics()
        took = self.bal.step_started(engine, duration, now_s=start)
        assert took == (start >= self.model.step[engine][0])
        after = self.bal.statistics()
        assert after.steps_reported == before.steps_reported + took
        assert after.steps_stale == before.steps_stale + (not took)
        if took:
            self.model.step[engine] = (start, start + duration)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), dt=st.floats(0, 1))
    def step_started_from_own_plan(self, data, dt):
        # Without a duration the step is the balancer's plan of the engine's queues.
        rid = data.draw(st.sampled_from(self.live_ids()))
        engine = self.model.live[rid][3] // RANKS
        now = self.tick(dt)
        if now < self.model.step[engine][0]:
            return
        plan = self.bal.plan_engine(engine, budget_s=self.CHOICE.step_budget_s)
        assert self.bal.step_started(engine, now_s=now)
        self.model.step[engine] = (now, now + plan.step_time_s)

    @rule()
    def save_and_restore(self):
        state = json.loads(json.dumps(self.bal.state_dict()))
        before = self.bal.statistics()
        self.bal = PrefillBalancer.from_state_dict(state)
        assert self.bal.statistics() == before

    @rule(dt=st.floats(0, 1))
    def bad_calls_change_nothing(self, dt):
        before = self.bal.statistics()
        for call in (
            lambda: self.bal.route("x", 10, 11, now_s=self.now),
            lambda: self.bal.route("x", -1, 0, now_s=self.now),
            lambda: self.bal.finish("never-routed", now_s=self.now),
            lambda: self.bal.chunk_done("never-routed", 1, now_s=self.now),
            lambda: self.bal.record(["never-routed"], [1], [False], now_s=self.now),
            lambda: self.bal.record([], [], [True], now_s=self.now),
            lambda: self.bal.reassign("never-routed", 0, now_s=self.now),
            lambda: self.bal.step_started(ENGINES, 1.0, now_s=self.now),
            lambda: self.bal.step_started(0, -1.0, now_s=self.now),
            lambda: self.bal.step_started(0, math.inf, now_s=self.now),
            lambda: self.bal.step_started(0, 1.0, now_s=math.nan),
            lambda: self.bal.step_started(0, 1e308, now_s=1e308),
            lambda: self.bal.reassign(
                self.live_ids()[0] if self.model.live else "x", RANKS, now_s=self.now
            ),
        ):
            try:
                call()
            except (ValueError, KeyError, TypeError):
                pass
            else:
                raise AssertionError("bad call accepted")
        if self.model.live:
            rid = self.live_ids()[0]
            try:
                self.bal.route(rid, 10, 0, now_s=self.now)
            except ValueError:
                pass
            else:
                raise AssertionError("duplicate id accepted")
            total, cached, done, _ = self.model.live[rid]
            try:  # the batch's second entry overdraws what the first left: nothing applies
                self.bal.record([rid, rid], [total - cached - done, 1], [False, True],
                                now_s=self.now)  # fmt: skip
            except ValueError:
                pass
            else:
                raise AssertionError("overdrawn batch accepted")
        assert self.bal.statistics() == before

    @invariant()
    def ledger_matches_model(self):
        self.bal._check()
        stats = self.bal.statistics()
        m = self.model
        counts = {s: sum(1 for v in m.status.values() if v == s) for s in
                  ("live", "finished", "handed_back", "refused")}  # fmt: skip
        assert stats.queued == counts["live"] == len(m.live)
        assert stats.finished == counts["finished"]
        assert stats.handed_back == counts["handed_back"]
        assert stats.refused == counts["refused"]
        assert sum(counts.values()) == self.next_id  # every request accounted for exactly once
        for rid, (_, _, _, f) in m.live.items():
            assert rid in self.bal.requests_on(f // RANKS, f % RANKS)
        for got, want in zip(stats.rank_load, m.rank_loads(), strict=True):
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        if "active" in stats.engine_state:  # no bucket is left without an engine
            assert all(h >= 0 for h in stats.bucket_server)


class LeastLoadMachine(BalancerMachine):
    """The same rules with the plain least-load rank choice."""

    CHOICE: ClassVar[RankChoice] = RankChoice(rule="least_load")


class OptionsMachine(BalancerMachine):
    """The same rules with a cold start, engine-aware rank choice and a drain limit."""

    CHOICE: ClassVar[RankChoice] = RankChoice(rule="least_load", wake_penalty_s=50.0)
    INITIAL = None
    ROUNDS: ClassVar[dict[str, Any]] = {"cold_start_s": 1.0, "max_drain_s": 300.0}


class FillMachine(BalancerMachine):
    """The same rules with engine-aware rank choice and hole filling across buckets."""

    CHOICE: ClassVar[RankChoice] = RankChoice(
        rule="least_load", wake_penalty_s=5.0, fill_holes=True
    )


class ContextParallelMachine(BalancerMachine):
    """The same rules with engines scored by their mean load (context-parallel engines)."""

    CHOICE: ClassVar[RankChoice] = RankChoice(rule="engine_mean", wake_penalty_s=20.0)


BalancerMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
ContextParallelMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestContextParallelMachine = ContextParallelMachine.TestCase
TestBalancerMachine = BalancerMachine.TestCase
LeastLoadMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestLeastLoadMachine = LeastLoadMachine.TestCase
OptionsMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestOptionsMachine = OptionsMachine.TestCase
FillMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestFillMachine = FillMachine.TestCase


def test_fill_machine_counterexample_a_hole_exactly_at_its_engine_step():
    """Pinned: the hole rule compared ``load <= top - quota``, which rounds differently from
    ``load + quota <= top`` when a rank of two requests can take a third of the same quota."""
    m = FillMachine()
    for n in (7, 10):
        m.route_burst(n=n, total=50)
    m.route(total=1, frac=0.0, dt=0.0)
    m.route(total=144, frac=0.0, dt=0.0)
    m.remove_engine(engine=0, dt=0.0)
    assert m.bal.record([18], [0], [True], now_s=m.tick(0.0)) == 1
    del m.model.live[18]
    m.model.status[18] = "finished"
    m.route_burst(n=3, total=50)  # the third is the hole at the boundary
    m.ledger_matches_model()
    m.bal._check()
