"""Saving and restoring a DecodeBalancer: JSON, pickle, ``python -O`` and tampered states.

A restored state either is refused with a ``ValueError`` naming the field, or the balancer it
gives holds exactly that state (``state_dict()`` returns it, every invariant holds) and keeps
working. Nothing of the check relies on ``assert``.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tests import tamper

from lbkit.core import DecodeCost
from lbkit.decode import DecodeBalancer


def _busy() -> DecodeBalancer:
    """A balancer with every part of the state in use: look-ahead, capacities, a draining rank,
    reports, a foreign load, a refused request waiting for room and the random policy's rng."""
    bal = DecodeBalancer(
        3, policy="random", max_batch=[4, 4, 3], max_kv_tokens=[20000, 9000, 9000],
        lookahead_steps=2, rng=7,
        cost=DecodeCost(a=0.01, b=1e-4, k=1e-8, combine="max", b_moe=1e-5, moe_lb=1.1),
    )  # fmt: skip
    for i, kv in enumerate([100, 2000, 50, 7000, 300]):
        bal.admit(i, kv, expected_output_tokens=None if i % 2 else 5)
    bal.step()
    bal.set_foreign_load(num_requests=[1, 0, 2], kv_tokens=[500, 0, 800])
    bal.report(1, 3, int(bal.statistics().num_requests[1]) + 0, 2500)
    bal.finish(2)
    bal.admit("long", 19900)  # refused for lack of room: waits in the state
    bal.drain_rank(2)
    bal._check()
    return bal


STATE = tamper.json_copy(_busy().state_dict())
LEAVES = [p for p in tamper.leaves(STATE) if p != ("version",)]

values = tamper.values(2**52, 2**53, 2**53 + 1, 2**63 - 1, 2**63, -(2**63))


def _exercise(bal: DecodeBalancer) -> None:
    """Use a restored balancer: every call either works or refuses with a named error."""
    bal.admit("new", 10)
    bal.step()
    bal.rebalance()
    bal.statistics()
    for rank in range(bal.num_ranks):
        bal.report(rank, 2**40, 0, 0)
    bal._check()


@given(path=st.sampled_from(LEAVES), value=values)
@example(path=("state", "requests", 0, 2), value=-1)  # negative KV
@example(path=("state", "order"), value=3)  # a request from the future
@example(path=("state", "counts", "finished"), value=0)  # a request lost
@example(path=("state", "rank_state", 0), value=2)  # a rank out of service holding requests
@example(path=("state", "seq", 0), value=2**70)
@example(path=("state", "cursor"), value=3)
@example(path=("state", "counts", "migrated_for_room"), value=5)
@example(path=("config", "max_batch", 1), value=-4)
@example(path=("state", "requests", 0, 0), value=[1])  # an unhashable id
@example(path=("state", "rng", "state", "state"), value="x")
@example(path=("state", "room", 1), value=2**60)
@example(path=("state", "rng", "state", "state"), value=-1)  # numpy: OverflowError
@example(path=("state", "rng", "state", "state"), value=1.5)  # numpy truncates
@example(path=("state", "foreign", 0, 0), value=2**53)  # inexact request sums
@example(path=("config", "cost", "a"), value=2**53 + 1)
@example(path=("config", "lookahead_steps"), value=2**63 - 1)
def test_a_tampered_state_is_refused_by_name_or_restored_exactly(path, value):
    bad = tamper.tampered(STATE, path, value)
    try:
        bal = DecodeBalancer.from_state_dict(bad)
    except ValueError as exc:
        assert str(exc).startswith(("state", "state.")), str(exc)
        return
    bal._check()
    want = tamper.json_copy(bad)
    cost = want["config"]["cost"]  # the cost model keeps floats: an int is taken as float(int)
    for key, v in cost.items():
        if isinstance(v, int) and not isinstance(v, bool):
            cost[key] = float(v)
    assert tamper.json_copy(bal.state_dict()) == want
    try:
        _exercise(bal)
    except ValueError as exc:  # e.g. the tampered capacities leave no room: a named refusal
        assert str(exc).split(":")[0] in {"rank", "tokens", "kv_tokens"}, str(exc)


def test_json_and_pickle_round_trips_continue_exactly():
    bal = _busy()
    twins = [
        DecodeBalancer.from_state_dict(tamper.json_copy(bal.state_dict())),
        pickle.loads(pickle.dumps(bal)),
        copy.deepcopy(bal),
    ]
    for twin in twins:
        assert twin.state_dict() == bal.state_dict()
    for i in range(40):
        d = bal.admit(f"r{i}", 37 * i % 900, expected_output_tokens=i % 4)
        assert all(t.admit(f"r{i}", 37 * i % 900, expected_output_tokens=i % 4) == d
                   for t in twins)  # fmt: skip
        if i % 5 == 0:
            bal.step()
            for t in twins:
                t.step()
            moves = bal.rebalance()
            assert all(t.rebalance() == moves for t in twins)
    for twin in twins:
        twin._check()
        assert twin.state_dict() == bal.state_dict()
        assert twin.statistics() == bal.statistics()


def test_a_balancer_with_a_store_is_not_pickled_silently():
    bal = _busy()
    bal._link = object()  # stands for an attached store: the refusal happens before any use
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(bal)


_OPTIMISED = """
import json, sys
from lbkit.decode import DecodeBalancer
state = json.loads(sys.stdin.read())
try:
    DecodeBalancer.from_state_dict(state)
except ValueError as exc:
    print("refused:", exc)
else:
    print("restored")
"""


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("state", "counts", "finished"), 0, "state.order"),  # a request lost
        (("state", "requests", 0, 2), -5, r"state.requests[0].kv"),  # negative KV
        (("state", "rank_state", 0), 2, r"state.requests[0].rank"),
    ],
)
def test_python_dash_o_refuses_the_same_states(path, value, field):
    assert __debug__, "the suite itself runs without -O"
    bad = json.dumps(tamper.tampered(STATE, path, value))
    out = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMISED], input=bad, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert out.stdout.startswith(f"refused: {field}"), out.stdout + out.stderr


def test_limits_refuse_overflowing_growth_and_reports_by_name():
    bal = DecodeBalancer(2)
    bal.admit("a", 2**52 - 1)
    before = bal.state_dict()
    with pytest.raises(ValueError, match=r"^tokens: a request would hold"):
        bal.step(2)
    with pytest.raises(ValueError, match=r"^tokens: must be <="):
        bal.step(2**60)
    with pytest.raises(ValueError, match=r"^tokens: a request would hold"):
        bal.step(request_tokens={"a": 5})
    with pytest.raises(ValueError, match=r"^seq: "):
        bal.report(0, 2**70, 1, 10)
    with pytest.raises(ValueError, match=r"^expected_output_tokens: "):
        bal.admit("b", 1, expected_output_tokens=2**70)
    assert bal.state_dict() == before
    bal.step(1)  # exactly at the limit
    assert bal.kv_tokens().tolist() == [2**52, 0]
    many = DecodeBalancer(1)
    for i in range(2):
        many.admit(i, 2**51 + 2**50)
    with pytest.raises(ValueError, match=r"^kv_tokens: .* past 9007199254740992"):
        many.admit("more", 2**51 + 2**50)
    many._check()
    busy = DecodeBalancer(1)
    for i in range(3):
        busy.admit(i, 2**51)
    with pytest.raises(ValueError, match=r"^kv_tokens: rank 0 would hold more than"):
        busy.set_foreign_load(num_requests=[1], kv_tokens=[2**51 + 1])
    busy.set_foreign_load(num_requests=[1], kv_tokens=[2**51 - 3 * 2**20])
    with pytest.raises(ValueError, match=r"^tokens: rank 0 would hold more than"):
        busy.step(2**20 + 1)
    busy.step(2**20)  # exactly 2**53 on the rank
    assert busy.statistics().kv_tokens == (3 * (2**51 + 2**20),)
    busy._check()
