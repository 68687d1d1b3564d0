"""Cost-model tests written for mutants of the cost modules that no other test killed.

The cost presets are pinned to their documented coefficients: the ``unit`` preset is the worked
example of the docs and doctests (``a = 1 s``, ``b = 1 s`` per token, ``k = 0.001``,
``q = 0.0005``); ``h800_dsv3`` is the fit stated in ``docs/cost-model.md``. A change to either is a
change to every documented figure, so it must be deliberate.

The chunk solver is checked at the limits of its exact correction (no slack, one ulp short of one
token, a closed form three tokens short, a chunk beyond int64), and every entry point of the
prefill and decode models rejects bad arguments with a message that names them.
"""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.core import PRESETS, DecodeCost, QuadraticCost


@pytest.mark.parametrize(
    ("name", "prefill", "decode"),
    [
        (
            "unit",
            QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005),
            DecodeCost(a=1.0, b=1.0, k=0.001),
        ),
        (
            "h800_dsv3",
            QuadraticCost(a=10e-3, b=62.4e-6, k=11.1e-9, q=5.55e-9, b_moe=81.1e-6, moe_lb=1.03),
            DecodeCost(a=5e-3, b=0.123e-3, k=23.4e-9, b_moe=0.124e-3, moe_lb=1.03),
        ),
    ],
)
def test_presets_hold_their_documented_coefficients(name, prefill, decode):
    assert PRESETS[name].prefill == prefill
    assert PRESETS[name].decode == decode


def test_unit_preset_worked_example():
    # One token on an empty KV: a + b + k*0 + q*1 = 2.0005 s.
    assert PRESETS["unit"].prefill.predict(1, 0) == pytest.approx(2.0005, rel=0, abs=1e-12)
    step = float(PRESETS["unit"].decode.step_time([1], [0])[0])
    assert step == pytest.approx(2.0, rel=0, abs=1e-12)


UNIT = PRESETS["unit"].prefill

# --- QuadraticCost.solve_chunk at the limits of its exact correction ---------------------------

#: One token costs 2**-55 s, an eighth of the spacing 2**-52 of the floats in [1, 2): added to a
#: cost of 1 s it is rounded away, so these budgets sit where rounding and the closed form differ.
TINY = QuadraticCost(a=1.0, b=2.0**-55, k=0.0, q=0.0)


@pytest.mark.parametrize(
    ("cost", "budget", "prefix"),
    [
        (TINY, 1.0, 0),  # the budget is the fixed cost a
        (QuadraticCost(a=0.0, b=2.0**-55, k=0.0, q=0.0, gamma=2.0**-10), 1.0, 1024),  # gamma*p
    ],
)
def test_no_slack_gives_no_chunk_even_where_a_token_rounds_to_nothing(cost, budget, prefix):
    # B = budget - a - gamma*p = 0 exactly: "B <= 0 gives 0" (the solver's docstring), as in
    # exact arithmetic, where one token costs more than nothing. The rounded cost of a token
    # equals the budget here, so only the slack test keeps the chunk at 0.
    assert float(cost.predict(1, prefix)) == budget
    assert cost.solve_chunk(budget, prefix) == 0


@pytest.mark.parametrize("m", [1, 3, 5])
def test_exact_correction_restores_a_closed_form_three_tokens_short(m):
    # Budget 1 + m*2**-52: the closed form (exact here) gives c* = 8m. The rounded cost
    # 1 + c*2**-55 stays 1 + m*2**-52 up to c = 8m + 3 (within half a spacing); at c = 8m + 4 it
    # is a tie, which rounds to the even neighbour, 1 + (m+1)*2**-52 for odd m: the largest
    # chunk that fits is 8m + 3, three upward steps from the closed form.
    budget = 1.0 + m * 2.0**-52
    fits = [c for c in range(16 * m + 16) if TINY.predict(c, 0) <= budget]
    assert fits == list(range(8 * m + 4))  # the hand count above, by brute force
    assert TINY.solve_chunk(budget, 0) == 8 * m + 3


@pytest.mark.parametrize("cost", [UNIT, PRESETS["h800_dsv3"].prefill], ids=["unit", "h800"])
def test_one_ulp_short_of_one_token_gives_no_chunk(cost):
    # For the unit preset at prefixes from 1000 on, the closed form rounds up to 1 at a budget
    # one ulp below predict(1, p), and the downward step must take it back to 0.
    prefix = np.arange(5000)
    one = np.asarray(cost.predict(1, prefix))
    assert (cost.solve_chunk(one, prefix) == 1).all()
    assert (cost.solve_chunk(np.nextafter(one, -np.inf), prefix) == 0).all()


def test_a_chunk_beyond_int64_is_capped_without_overflow():
    # 10**21 tokens fit in 1e9 s at 1e-12 s per token: more than an int64 holds. The solver caps
    # the closed form below 2**63 (no overflowing cast, which warns), and max_chunk then applies.
    cost = QuadraticCost(a=0.0, b=1e-12, k=0.0, q=0.0)
    assert cost.solve_chunk(1e9, 0, max_chunk=8192) == 8192
    c = cost.solve_chunk(1e9, 0)
    assert isinstance(c, int) and 2**62 <= c < 2**63
    assert cost.predict(c, 0) <= 1e9


def test_min_chunk_keeps_a_chunk_of_exactly_min_chunk():
    assert UNIT.solve_chunk(1501.0, 0) == 1000
    assert UNIT.solve_chunk(1501.0, 0, min_chunk=1000) == 1000  # not smaller than min_chunk
    assert UNIT.solve_chunk(1501.0, 0, min_chunk=1001) == 0


# --- argument validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [lambda: UNIT.work(-1, 0), lambda: UNIT.quota([5, -1], 0), lambda: UNIT.step_time([-1], 0)],
    ids=["work", "quota", "step_time"],
)
def test_negative_chunk_tokens_are_rejected(call):
    with pytest.raises(ValueError, match="chunk_tokens: must be non-negative"):
        call()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"a": -1.0, "b": 1.0, "k": 0.0}, ValueError, "a: must be >= 0.0"),
        ({"a": 0.0, "b": -1e-3, "k": 0.0}, ValueError, "b: must be >= 0.0"),
        ({"a": 0.0, "b": float("nan"), "k": 0.0}, ValueError, "b: must not be NaN"),
        ({"a": 0.0, "b": 1.0, "k": float("inf")}, ValueError, "k: must be finite"),
        ({"a": "1", "b": 1.0, "k": 0.0}, TypeError, "a: must be a real number"),
    ],
)
def test_decode_cost_validates_coefficients(kwargs, error, match):
    with pytest.raises(error, match=match):
        DecodeCost(**kwargs)


def test_decode_cost_coefficients_are_floats():
    cost = DecodeCost(a=1, b=2, k=np.float32(0.5))
    assert [type(x) for x in (cost.a, cost.b, cost.k)] == [float, float, float]


def test_decode_rank_step_rejects_negative_requests():
    cost = PRESETS["h800_dsv3"].decode
    with pytest.raises(ValueError, match="num_requests: must be non-negative"):
        cost.rank_step_s([4, -1], 0)


def test_decode_rank_step_broadcasts_one_kv_entry():
    cost = DecodeCost(a=1.0, b=1.0, k=0.001, b_moe=0.5, moe_lb=1.2)
    # shared = 0.6 * 15 / 3 = 3; local = B + 0.001 * 2000 = B + 2
    expected = [1.0 + 10 + 2 + 3, 1.0 + 2 + 2 + 3, 1.0 + 3 + 2 + 3]
    np.testing.assert_allclose(cost.rank_step_s([10, 2, 3], [2000]), expected)
    np.testing.assert_allclose(cost.rank_step_s([10, 2, 3], 2000), expected)
    with pytest.raises(ValueError, match="kv_tokens: must broadcast"):
        cost.rank_step_s([10, 2, 3], [2000, 1000])


def test_engine_step_wants_at_least_one_rank_not_one_chunk():
    # shape (ranks, chunks): no rank is an error, no chunk slot is an idle step of every rank.
    with pytest.raises(ValueError, match="chunk_tokens: must have shape"):
        UNIT.rank_step_s(np.zeros((0, 3)), 0)
    np.testing.assert_array_equal(UNIT.rank_step_s(np.zeros((2, 0)), 0), [UNIT.a, UNIT.a])
