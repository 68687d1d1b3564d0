"""The cost presets pinned to their documented coefficients.

The ``unit`` preset is the worked example of the docs and doctests (``a = 1 s``, ``b = 1 s`` per
token, ``k = 0.001``, ``q = 0.0005``); ``h800_dsv3`` is the fit stated in ``docs/cost-model.md``.
A change to either is a change to every documented figure, so it must be deliberate.
"""

from __future__ import annotations

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
