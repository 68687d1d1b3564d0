"""EplbScheduler: decisions and reasons, robust option, persistence, bad input leaves state
intact, and a stateful test against a plain model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lbkit.eplb import drift, synthetic_expert_load
from lbkit.eplb.scheduler import EplbScheduler

SIZES = (3, 16, 20, 4, 2, 4)  # layers, experts, replicas, groups, nodes, GPUs


def make(**kw):
    return EplbScheduler(*SIZES, **kw)


def test_reasons_in_order():
    s = make(min_interval_s=100.0, min_gain=0.01)
    assert s.maybe_rebalance(now_s=0.0).reason == "no load recorded"
    w = synthetic_expert_load(3, 16, sigma=1.5, rng=0)
    assert s.record(w) and not s.record(np.zeros((3, 16)))
    d = s.maybe_rebalance(now_s=1.0)
    assert d.replanned and d.moe_lb_after < d.moe_lb_before and d.num_moves == len(d.moves.slot)
    assert np.array_equal(d.plan.phy2log, s.phy2log)
    assert s.maybe_rebalance(now_s=50.0).reason == "min interval not passed"
    d2 = s.maybe_rebalance(now_s=200.0)  # same loads: nothing left to gain
    assert not d2.replanned and d2.reason in ("already balanced", "gain below min_gain")
    st_ = s.statistics()
    assert (st_.num_replans, st_.num_skipped, st_.num_ignored) == (1, 3, 1)
    s._check()


def test_gain_threshold_skips_small_gains():
    s = make(min_interval_s=0.0, min_gain=10.0)
    s.record(synthetic_expert_load(3, 16, sigma=1.5, rng=0))
    assert s.maybe_rebalance(now_s=0.0).reason in ("gain below min_gain", "already balanced")
    assert s.statistics().num_replans == 0


def test_robust_option_never_worse_in_the_worst_window():
    w = synthetic_expert_load(3, 16, sigma=1.0, rng=1)
    a, b = drift(w, sigma=0.8, rng=2), drift(w, sigma=0.8, rng=3)
    plain = make(window=2, min_interval_s=0.0, min_gain=0.0)
    robust = make(window=2, robust_windows=2, min_interval_s=0.0, min_gain=0.0)
    for s in (plain, robust):
        s.record(a)
        s.record(b)
        s.maybe_rebalance(now_s=0.0)
        s._check()
    worst = [max(float(np.mean(_lb(x, s.phy2log))) for x in (a, b)) for s in (plain, robust)]
    per_layer = [np.max([_lb(x, s.phy2log) for x in (a, b)], axis=0) for s in (plain, robust)]
    assert (per_layer[1] <= per_layer[0] + 1e-9).all() or worst[1] <= worst[0] + 1e-9


def _lb(w, phy2log):
    from lbkit.eplb import moe_lb

    return moe_lb(w, phy2log, num_gpus=4)


def test_state_round_trip_through_json():
    s = make(window=3, min_interval_s=0.0)
    for k in range(4):
        s.record(synthetic_expert_load(3, 16, rng=k))
    s.maybe_rebalance(now_s=5.0)
    t = EplbScheduler.from_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.state_dict() == s.state_dict()
    assert t.statistics() == s.statistics()
    layer = make(tolerance_scope="layer")
    assert EplbScheduler.from_state_dict(layer.state_dict()).state_dict() == layer.state_dict()
    e = make(ema_alpha=0.5)
    e.record(np.ones((3, 16)))
    assert EplbScheduler.from_state_dict(e.state_dict()).statistics() == e.statistics()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.record(np.ones((2, 16))), "load: must have shape"),
        (lambda s: s.record(-np.ones((3, 16))), "load: must be non-negative"),
        (lambda s: s.record(np.full((3, 16), np.nan)), "load: must be finite"),
        (lambda s: s.maybe_rebalance(now_s=-1.0), "now_s: must not decrease"),
        (lambda s: s.maybe_rebalance(now_s=float("nan")), "now_s: must not be NaN"),
    ],
)
def test_bad_input_leaves_state_intact(call, match):
    s = make()
    s.record(np.ones((3, 16)))
    s.maybe_rebalance(now_s=0.0)
    before = s.state_dict()
    with pytest.raises(ValueError, match=match):
        call(s)
    assert s.state_dict() == before
    s._check()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"window": 0}, "window: must be >= 1"),
        ({"ema_alpha": 1.5}, "ema_alpha: must be <= 1"),
        ({"ema_alpha": 0.5, "robust_windows": 2}, "robust_windows: needs window mode"),
        ({"window": 2, "robust_windows": 3}, "robust_windows: must be <= window"),
        ({"min_interval_s": -1.0}, "min_interval_s: must be >= 0"),
        ({"max_moves": -1}, "max_moves: must be >= 0"),
        ({"tolerance_scope": "worst"}, "tolerance_scope: must be one of 'mean', 'layer'"),
        ({"initial_phy2log": np.zeros((3, 20), dtype=int)}, "initial_phy2log: every expert"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_bad_state():
    with pytest.raises(ValueError, match="state: must be a dict"):
        EplbScheduler.from_state_dict({"format": "other"})


class SchedulerMachine(RuleBasedStateMachine):
    """Recordings, decisions and restores against a plain model of the window and counters."""

    @initialize(window=st.integers(1, 4), ema=st.booleans(), gain=st.sampled_from([0.0, 0.05]))
    def start(self, window, ema, gain):
        self.s = make(window=window, ema_alpha=0.5 if ema else None, min_interval_s=10.0,
                      min_gain=gain, max_moves=6)  # fmt: skip
        self.window, self.ema = window, ema
        self.recs: list[np.ndarray] = []
        self.ema_value = None
        self.now = 0.0
        self.last_replan = None
        self.replans = self.skips = 0

    @rule(seed=st.integers(0, 1000), zero=st.booleans(), sigma=st.sampled_from([0.3, 1.5]))
    def record(self, seed, zero, sigma):
        w = 0 * np.ones((3, 16)) if zero else synthetic_expert_load(3, 16, sigma=sigma, rng=seed)
        assert self.s.record(w) == (not zero)
        if zero:
            return
        if self.ema:
            self.ema_value = w if self.ema_value is None else 0.5 * w + 0.5 * self.ema_value
        else:
            self.recs = ([*self.recs, w])[-self.window :]

    @rule(dt=st.sampled_from([0.0, 5.0, 20.0]))
    def decide(self, dt):
        self.now += dt
        d = self.s.maybe_rebalance(now_s=self.now)
        has_load = self.ema_value is not None or bool(self.recs)
        if not has_load:
            assert d.reason == "no load recorded"
        elif self.last_replan is not None and self.now - self.last_replan < 10.0:
            assert d.reason == "min interval not passed"
        if d.replanned:
            self.replans += 1
            self.last_replan = self.now
            assert d.num_moves <= 6 * 3
        else:
            self.skips += 1

    @rule()
    def restore(self):
        self.s = EplbScheduler.from_state_dict(json.loads(json.dumps(self.s.state_dict())))

    @invariant()
    def consistent(self):
        self.s._check()
        load = self.s.window_load()
        expect = self.ema_value if self.ema else (np.sum(self.recs, axis=0) if self.recs else None)
        assert (load is None) == (expect is None)
        if load is not None:
            assert np.allclose(load, expect)
        st_ = self.s.statistics()
        assert (st_.num_replans, st_.num_skipped) == (self.replans, self.skips)
        assert st_.last_replan_s == self.last_replan


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = __import__("hypothesis").settings(
    max_examples=25, stateful_step_count=12, deadline=None
)
