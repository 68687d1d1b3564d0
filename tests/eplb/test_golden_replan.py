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


#: Cases also re-planned by the entry kernels as plain Python (kept quick).
PYTHON_CASES = (
    "v2lite_96_16_hier",
    "sparse_80_16_global",
    "small_24_8_global",
    "small_32_8_hier",
    "single_12_2_hier",
)


def test_entry_kernels_as_python_give_the_recorded_replans(recorded, monkeypatch):
    """Until they are compiled, the re-planning entry kernels run as Python (lbkit.core._jit)."""
    from lbkit.core import _jit

    if _jit.jit_disabled():
        pytest.skip("NUMBA_DISABLE_JIT=1: everything runs as Python already")
    from lbkit.eplb import replan

    from .test_golden import eplb_entries

    monkeypatch.setenv("LBKIT_JIT", "python")
    monkeypatch.setattr(_jit.Entry, "is_compiled", lambda self, *args: False)
    monkeypatch.setattr(replan, "replan_kernels_ready", lambda: True)  # the full search
    calls = []
    for kernel in eplb_entries():
        monkeypatch.setattr(kernel, "_ready", set())  # forget the compiled calls made before
        monkeypatch.setattr(kernel, "dispatcher", lambda *args: calls.append(args))
    cases = [c for c in golden.CASES if c[0] in PYTHON_CASES]
    got = golden.compute(cases)
    assert not calls  # every call ran as Python
    assert sorted({k.split("/")[0] for k in got}) == sorted(PYTHON_CASES)
    for key, value in got.items():
        np.testing.assert_array_equal(value, recorded[key].astype(value.dtype), err_msg=key)
