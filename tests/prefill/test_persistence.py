"""Saving and restoring a PrefillBalancer: JSON, pickle, ``python -O`` and tampered states.

A restored state either is refused with a ``ValueError`` naming the field, or the balancer it
gives holds exactly that state (``state_dict()`` returns it, every invariant holds) and keeps
working. Nothing of the check relies on ``assert``.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tests import tamper

from lbkit.core import PRESETS
from lbkit.prefill import Buckets, PrefillBalancer, RankChoice, Rounds

COST = PRESETS["h800_dsv3"].prefill


def _busy() -> PrefillBalancer:
    """Every part of the state in use: buckets with a round behind them, progress, a report,
    step reports (one with the balancer's own plan), a draining engine, a foreign load and the
    sampling rng."""
    bal = PrefillBalancer(
        4, 2, cost=COST, choice=RankChoice(), buckets=Buckets(edges=(16384,)),
        rounds=Rounds(round_s=1.0), rng=3,
    )  # fmt: skip
    for i, (total, cached) in enumerate([(900, 0), (20000, 4096), (3000, 100), (40000, 0)]):
        bal.route(i, total, cached, now_s=0.1 * i)
    bal.chunk_done(0, 300, now_s=0.5)
    bal.report(0, 4, {0: 400}, now_s=0.6)
    bal.step_started(1, 0.8, now_s=0.4)
    bal.step_started(0, now_s=0.7)
    bal.set_foreign_load(quota_s=[0.1] * 8, work_s=[0.2] * 8, num_requests=[1] * 8)
    bal.end_round(1.2)
    bal.route("late", 5000, 0, now_s=1.3)
    bal._check()
    return bal


STATE = tamper.json_copy(_busy().state_dict())
LEAVES = [p for p in tamper.leaves(STATE) if p != ("version",)]

values = tamper.values(2**53, 2**63 - 1, 2**63, -(2**63))


def _same(a, b) -> bool:
    """Equal states, numbers compared as numbers (an int restored as the float it means)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    num = (int, float)  # bool included: where the state takes False for 0 it behaves as 0
    if isinstance(a, num) and isinstance(b, num):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b and type(a) is type(b)


def _exercise(bal: PrefillBalancer) -> None:
    # At times after the state's own clock (a restored round may start late, e.g. at 2**53 s).
    t = max(5.0, float(bal.state_dict()["state"]["round_start_s"]))
    bal.route("new", 1000, 0, now_s=t)
    bal.plan_engine(0, budget_s=0.05)
    bal.statistics()
    bal.end_round(t * (1.0 + 2.0**-20) + 1.0)
    bal._check()


@given(path=st.sampled_from(LEAVES), value=values)
@example(path=("state", "requests", 0, 4), value=-1)  # negative progress
@example(path=("state", "counts", "routed"), value=1)  # requests lost
@example(path=("state", "engine_state", 0), value=2)  # an engine out of service, busy
@example(path=("state", "rank_load", 0), value=1e308)
@example(path=("state", "requests", 0, 0), value=[1])  # an unhashable id
@example(path=("state", "rng", "state", "state"), value=1.5)  # numpy would truncate it
@example(path=("state", "rng", "state", "state"), value=-1)  # numpy: OverflowError
@example(path=("state", "seq", 0), value=2**70)
@example(path=("state", "foreign", "work_s", 1), value=2**63 - 1)  # no exact float
@example(path=("config", "choice", "spill_ratio"), value=2**63 - 1)
@example(path=("config", "ranks_per_engine"), value=10**9)  # refused before any allocation
@example(path=("state", "foreign", "num_requests", 7), value=2**63 - 1)  # sums would overflow
@example(path=("state", "round_start_s"), value=2**53)  # a late clock: used after it
def test_a_tampered_state_is_refused_by_name_or_restored_exactly(path, value):
    bad = tamper.tampered(STATE, path, value)
    try:
        bal = PrefillBalancer.from_state_dict(bad)
    except ValueError as exc:
        assert str(exc).startswith("state"), str(exc)
        return
    bal._check()
    assert _same(tamper.json_copy(bal.state_dict()), tamper.json_copy(bad))
    _exercise(bal)


def test_json_and_pickle_round_trips_continue_exactly():
    bal = _busy()
    twins = [
        PrefillBalancer.from_state_dict(tamper.json_copy(bal.state_dict())),
        pickle.loads(pickle.dumps(bal)),
        copy.deepcopy(bal),
    ]
    rng = np.random.default_rng(5)
    for i in range(40):
        total = int(rng.integers(100, 60000))
        now = 1.5 + 0.05 * i
        d = bal.route(f"r{i}", total, 0, now_s=now)
        assert all(t.route(f"r{i}", total, 0, now_s=now) == d for t in twins)
        if i % 7 == 6:
            r = bal.end_round(now)
            assert all(t.end_round(now) == r for t in twins)
    for twin in twins:
        twin._check()
        assert twin.state_dict() == bal.state_dict()
        assert twin.statistics() == bal.statistics()


def test_a_balancer_with_a_store_is_not_pickled_silently():
    bal = _busy()
    bal._link = object()  # stands for an attached store: the refusal comes before any use
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(bal)


_OPTIMISED = """
import json, sys
from lbkit.prefill import PrefillBalancer
state = json.loads(sys.stdin.read())
try:
    PrefillBalancer.from_state_dict(state)
except ValueError as exc:
    print("refused:", exc)
else:
    print("restored")
"""


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("state", "counts", "routed"), 1, "state.counts"),  # requests lost
        (("state", "requests", 0, 4), -5, "state.requests[0].done"),
        (("state", "engine_state", 0), 2, "state.requests[0]"),
    ],
)
def test_python_dash_o_refuses_the_same_states(path, value, field):
    bad = json.dumps(tamper.tampered(STATE, path, value))
    out = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMISED], input=bad, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert out.stdout.startswith(f"refused: {field}"), out.stdout + out.stderr


@pytest.mark.parametrize("flag", ["no", "", float("nan"), 0.0, None, 2, -1, [True]])
def test_record_takes_only_bools_as_finished_flags(flag):
    bal = _busy()
    before = bal.state_dict()
    with pytest.raises(TypeError, match=r"^finished\[1\]: must be a bool"):
        bal.record([0, 1], [0, 0], [False, flag], now_s=2.0)
    assert bal.state_dict() == before
    assert bal.record(np.array([0, 1]), np.array([0, 0]), np.array([False, True]), now_s=2.0) == 1
    assert bal.record([0], [0], [1], now_s=2.0) == 1
