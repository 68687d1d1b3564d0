"""Plans stay bit-identical on the golden cases (``golden.py`` says how they were recorded)."""

from __future__ import annotations

import numpy as np
import pytest

from . import golden


@pytest.fixture(scope="module")
def recorded():
    with np.load(golden.FIXTURE) as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def computed():
    return golden.compute()


def test_golden_cases_are_all_recorded(recorded, computed):
    assert sorted(recorded) == sorted(computed)


@pytest.mark.parametrize("case", [c[0] for c in golden.CASES])
def test_plans_and_bounds_are_bit_identical(case, recorded, computed):
    for key in sorted(k for k in computed if k.startswith(case + "/")):
        want = recorded[key]
        got = computed[key]
        if want.dtype.kind == "i":
            np.testing.assert_array_equal(got, want.astype(np.int64), err_msg=key)
        else:
            assert got.dtype == want.dtype and np.array_equal(got, want), key
