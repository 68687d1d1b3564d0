"""PrefillBalancer's option objects, the old keyword options mapped onto them, saved states."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.prefill import DEFAULT_EDGES, Buckets, PrefillBalancer, RankChoice, Rounds

H800 = PRESETS["h800_dsv3"].prefill
UNIT = PRESETS["unit"].prefill


# --------------------------------------------------------------------------- option objects
@pytest.mark.parametrize(
    ("rule", "field", "value"),
    [
        ("lockstep", "sample", 4),
        ("lockstep", "wake_penalty_s", 0.5),
        ("lockstep", "fill_holes", True),
        ("engine_mean", "sample", 2),
        ("engine_mean", "fill_holes", True),
        ("least_load", "step_budget_s", 0.5),
        ("engine_mean", "growth_weight", 0.0),
    ],
)
def test_a_field_of_another_rule_is_refused_naming_both(rule, field, value):
    with pytest.raises(ValueError, match=f"{field}: applies to .* only, not to rule='{rule}'"):
        RankChoice(rule=rule, **{field: value})


@pytest.mark.parametrize(
    ("cls", "kwargs", "exc", "match"),
    [
        (RankChoice, {"rule": "fastest"}, ValueError, "rule: must be one of"),
        (RankChoice, {"step_budget_s": 0.0}, ValueError, "step_budget_s: must be > 0.0"),
        (RankChoice, {"growth_weight": -1.0}, ValueError, "growth_weight: must be >= 0.0"),
        (RankChoice, {"spill_ratio": 0.5}, ValueError, "spill_ratio: must be >= 1.0"),
        (RankChoice, {"rule": "least_load", "sample": 0}, ValueError, "sample: must be >= 1"),
        (RankChoice, {"rule": "least_load", "fill_holes": 1}, TypeError, "fill_holes: must be"),
        (RankChoice, {"rule": "least_load", "wake_penalty_s": "1"}, TypeError, "wake_penalty_s"),
        (Buckets, {"edges": (5, 5)}, ValueError, "edges: must be strictly increasing"),
        (Buckets, {"edges": (100,), "min_engines": (1,)}, ValueError, "min_engines: must have"),
        (Buckets, {"initial_engines": (1, 2)}, ValueError, "initial_engines: must have shape"),
        (Buckets, {"edges": (100,), "min_engines": (2, 0), "max_engines": (1, 3)}, ValueError,
         "min_engines, max_engines: bucket 0 has minimum 2 above its cap 1"),
        (Rounds, {"round_s": 0.0}, ValueError, "round_s: must be > 0.0"),
        (Rounds, {"ema_alpha": 1.5}, ValueError, "ema_alpha: must be <= 1.0"),
        (Rounds, {"deadband": -0.1}, ValueError, "deadband: must be >= 0.0"),
        (Rounds, {"max_moves": 1.5}, TypeError, "max_moves: must be an integer"),
        (Rounds, {"method": "x"}, ValueError, "method: must be one of"),
        (Rounds, {"cold_start_s": 0.0}, ValueError, "cold_start_s: must be > 0.0"),
        (Rounds, {"max_drain_s": float("nan")}, ValueError, "max_drain_s: must not be NaN"),
    ],
)  # fmt: skip
def test_option_objects_reject_bad_values_naming_the_field(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(**kwargs)


def test_option_objects_are_frozen_and_normalised():
    choice = RankChoice(rule="least_load", wake_penalty_s=np.float64(1), sample=np.int64(3))
    assert type(choice.wake_penalty_s) is float and type(choice.sample) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.rule = "lockstep"  # type: ignore[misc]
    buckets = Buckets(edges=[100, 400], min_engines=np.array([0, 1, 0]))
    assert buckets.edges == (100, 400) and buckets.min_engines == (0, 1, 0)
    assert buckets.num_buckets == 3
    assert hash(buckets) == hash(Buckets(edges=(100, 400), min_engines=(0, 1, 0)))


def test_the_balancer_checks_bounds_against_its_pool():
    with pytest.raises(ValueError, match="min_engines: the minimums need 6 engines, only 4"):
        PrefillBalancer(4, 2, cost=UNIT, buckets=Buckets(edges=(100,), min_engines=(3, 3)))
    with pytest.raises(ValueError, match="initial_engines: must sum to num_engines"):
        PrefillBalancer(4, 2, cost=UNIT, buckets=Buckets(edges=(100,), initial_engines=(1, 1)))
    with pytest.raises(TypeError, match="choice: must be a RankChoice, got Rounds"):
        PrefillBalancer(4, 2, cost=UNIT, choice=Rounds())


def test_defaults_are_the_measured_configuration():
    bal = PrefillBalancer(4, 2, cost=H800)
    assert (bal.choice, bal.buckets, bal.rounds) == (RankChoice(), Buckets(), Rounds())
    assert bal.choice.rule == "lockstep" and bal.edges == ()
    assert (bal.rounds.cold_start_s, bal.rounds.max_drain_s) == (5.0, 30.0)


# --------------------------------------------------------------------------- old keywords
def _legacy(**kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bal = PrefillBalancer(4, 2, cost=UNIT, **kw)
    (warning,) = caught
    assert warning.category is DeprecationWarning
    return bal, str(warning.message)


def test_old_keywords_map_onto_the_objects_and_name_the_replacement():
    bal, msg = _legacy(wake_penalty_s=0.5, edges=(100,), round_s=4.0)
    assert bal.choice == RankChoice(rule="least_load", wake_penalty_s=0.5)
    assert bal.buckets == Buckets(edges=(100,)) and bal.rounds == Rounds(round_s=4.0)
    assert "wake_penalty_s: pass choice=RankChoice(rule='least_load', wake_penalty_s=...)" in msg
    assert "wake_penalty_s selects rule='least_load', as before" in msg
    assert "edges: pass buckets=Buckets(edges=...)" in msg
    assert "round_s: pass rounds=Rounds(round_s=...)" in msg
    bal, msg = _legacy(context_parallel=True, spill_ratio=2.0)
    assert bal.choice == RankChoice(rule="engine_mean", spill_ratio=2.0)
    assert "context_parallel=True is rule='engine_mean'" in msg
    bal, msg = _legacy(rank_rule="least_load")
    assert bal.choice == RankChoice(rule="least_load") and "selects" not in msg


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"edge": (100,)}, TypeError, "unexpected keyword argument 'edge'"),
        ({"choice": RankChoice(), "sample": 2}, TypeError,
         "sample: pass it inside choice=RankChoice"),
        ({"buckets": Buckets(), "edges": (100,)}, TypeError,
         "edges: pass it inside buckets=Buckets"),
        ({"rounds": Rounds(), "round_s": 3.0}, TypeError, "round_s: pass it inside rounds="),
        ({"rank_rule": "lockstep", "sample": 2}, ValueError,
         "sample: applies to rule='least_load' only, not to rule='lockstep'"),
        ({"context_parallel": True, "rank_rule": "lockstep"}, ValueError,
         "context_parallel: selects rule='engine_mean', contradicting rank_rule='lockstep'"),
        ({"context_parallel": True, "fill_holes": True}, ValueError,
         "fill_holes: applies to rule='least_load' only, not to rule='engine_mean'"),
        ({"context_parallel": "yes"}, TypeError, "context_parallel: must be a bool"),
    ],
)  # fmt: skip
def test_old_keywords_that_cannot_work_fail_naming_the_replacement(kwargs, exc, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(exc, match=match):
            PrefillBalancer(4, 2, cost=UNIT, **kwargs)


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["route", "route_hits", "chunk", "finish", "round"]),
        st.integers(1, 60_000),
        st.integers(0, 100),
        st.floats(0.0, 3.0),
    ),
    min_size=1,
    max_size=60,
)


def _replay(bal, ops, seed=0):
    rng = np.random.default_rng(seed)
    out, live, now = [], [], 0.0
    for i, (op, total, pct, dt) in enumerate(ops):
        now += dt
        if op.startswith("route") or not live:
            cached = total * pct // 100
            if op == "route_hits":
                cached = rng.integers(0, cached + 1, size=bal.num_ranks)
            d = bal.route(i, total, cached, now_s=now)
            out.append(d)
            live.append(i)
        elif op == "chunk":
            rid = live[total % len(live)]
            left = bal.chunk_done(rid, 0, now_s=now)
            out.append(bal.chunk_done(rid, left * pct // 100, now_s=now))
        elif op == "finish":
            out.append(bal.finish(live.pop(total % len(live)), now_s=now))
        elif now > 0.0:
            out.append(bal.end_round(now + 1.0))
            now += 1.0
    bal._check()
    return out


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_new_defaults_decide_as_the_old_explicit_keywords_on_one_bucket(ops):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = PrefillBalancer(
            4, 2, cost=H800, edges=(), round_s=30.0, ema_alpha=0.5, deadband=0.1, max_moves=2,
            min_dwell_s=60.0, method="adams", cold_start_s=None, max_drain_s=None,
            rank_rule="lockstep", step_budget_s=1.0, growth_weight=0.6, idle_growth_weight=0.1,
        )  # fmt: skip
    new = PrefillBalancer(4, 2, cost=H800)
    assert _replay(old, ops) == _replay(new, ops)


# --------------------------------------------------------------------------- saved states
def _busy(**kw):
    # the least-load rule leaves engine 3 empty (the bad states below rely on it)
    bal = PrefillBalancer(4, 2, cost=UNIT, **({"choice": RankChoice(rule="least_load")} | kw))
    for i in range(6):
        bal.route(i, 50 + 90 * i, i, now_s=0.1 * i)
    bal.chunk_done(0, 10, now_s=1.0)
    return bal


def test_state_dict_saves_the_options_as_plain_dicts():
    choice = RankChoice(rule="least_load", wake_penalty_s=2.0, spill_ratio=2.0)
    buckets = Buckets(edges=(100, 400), max_engines=(4, 3, 3))
    bal = _busy(choice=choice, buckets=buckets, rounds=Rounds(round_s=7.0))
    state = json.loads(json.dumps(bal.state_dict()))
    assert state["version"] == 2
    assert state["config"]["choice"] == dataclasses.asdict(choice)
    assert state["config"]["buckets"]["max_engines"] == [4, 3, 3]
    again = PrefillBalancer.from_state_dict(state)
    assert (again.choice, again.buckets, again.rounds) == (bal.choice, bal.buckets, bal.rounds)
    assert again.statistics() == bal.statistics()
    assert again.route("x", 300, 0, now_s=2.0) == bal.route("x", 300, 0, now_s=2.0)


def _as_version_1(state):
    """The same state in the layout of version 1 (flat keyword options)."""
    cfg = state["config"]
    choice = dict(cfg.pop("choice"))
    rule = choice.pop("rule")
    flat = {**choice, **cfg.pop("buckets"), **cfg.pop("rounds")}
    flat.pop("initial_engines")
    flat["rank_rule"] = "least_load" if rule == "engine_mean" else rule
    flat["context_parallel"] = rule == "engine_mean"
    return {**state, "version": 1, "config": {**cfg, **flat}}


@pytest.mark.parametrize(
    "choice",
    [RankChoice(), RankChoice(rule="least_load", sample=2, fill_holes=True),
     RankChoice(rule="engine_mean", wake_penalty_s=1.0)],
)  # fmt: skip
def test_version_1_states_are_still_read(choice):
    bal = _busy(
        choice=choice, buckets=Buckets(edges=DEFAULT_EDGES), rounds=Rounds(max_drain_s=None)
    )
    v1 = _as_version_1(json.loads(json.dumps(bal.state_dict())))
    again = PrefillBalancer.from_state_dict(v1)
    assert again.choice == choice and again.rounds == bal.rounds
    assert again.statistics() == bal.statistics()


def _field(state, path, value):
    node = state
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return state


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("config", "choice", "rule"), "x", "rule: must be one of"),
        (("config", "choice", "samples"), 2, r"state.config.choice: .*samples"),
        (("config", "rounds"), [], "state.config.rounds: must be a mapping"),
        (("config", "num_engines"), 0, "state.config.num_engines: must be >= 1"),
        (
            ("state", "engine_bucket"),
            [0, 0, 0],
            "state.engine_bucket: must be a list of 4 integers",
        ),
        (("state", "engine_state"), [0, 0, 0, 3], r"state.engine_state\[3\]: must be <= 2"),
        (("state", "engine_state"), [2, 0, 0, 0], "state.requests.*out of service"),
        (("state", "engine_state"), [0, 0, 0, 1], "state.engine_state: engine 3 drains"),
        (("state", "seq"), [0, 0, -2, 0], r"state.seq\[2\]: must be >= -1"),
        (("state", "last_move_s"), [None], "state.last_move_s: must be a list of 4"),
        (("state", "rank_load"), [0.0] * 8, "state.rank_load: rank 0 has load 0.0"),
        (("state", "requests", 0, 4), 10**6, r"state.requests\[0\].done: must be <="),
        (("state", "requests", 1, 5), 1.0, r"state.requests\[1\].quota: 1.0 is not"),
        (("state", "requests", 2, 1), 99, r"state.requests\[2\].rank: must be <= 7"),
        (("state", "requests", 2, 0), 0, "state: request 0 appears twice"),
        (("state", "requests", 2), [1, 2], r"state.requests\[2\]: must be \[id, rank"),
        (("state", "demand"), [float("nan")], "state.demand"),
        (("state", "counts", "routed"), 99, "state.counts: routed must equal"),
        (("state", "counts", "finished"), -1, "state.counts.finished: must be >= 0"),
        (("state", "drift_max_s"), "x", "state.drift_max_s: must be a real number"),
        (("state", "rng"), None, "state.rng: must be a mapping"),
        (("state", "rng"), {"state": 1}, "state.rng: not a numpy bit generator state"),
    ],
)
def test_bad_states_are_refused_naming_the_field(path, value, match):
    state = json.loads(json.dumps(_busy().state_dict()))
    with pytest.raises(ValueError, match=match):
        PrefillBalancer.from_state_dict(_field(state, path, value))
