"""Re-plans stay bit-identical on the golden cases (``golden_replan.py`` says how they were
recorded)."""

from __future__ import annotations

import numpy as np
import pytest

from . import golden_replan as golden


@pytest.fixture(scope="module")
def recorded():
    with np.load(golden.FIXTURE) as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def computed():
    return golden.compute()


def test_golden_replan_cases_are_all_recorded(recorded, computed):
    assert sorted(recorded) == sorted(computed)


@pytest.mark.parametrize("case", [c[0] for c in golden.CASES])
def test_replans_are_bit_identical(case, recorded, computed):
    for field in golden.FIELDS:
        key = f"{case}/{field}"
        want, got = recorded[key], computed[key]
        if want.dtype.kind == "i":
            np.testing.assert_array_equal(got, want.astype(np.int64), err_msg=key)
        else:
            assert got.dtype == want.dtype and np.array_equal(got, want), key
