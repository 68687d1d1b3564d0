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


#: Cases also planned by the entry kernels as plain Python (every solver path, kept quick).
PYTHON_CASES = (
    "v3_320_64_hier",
    "v2lite_128_64_global",
    "small_24_8_global",
    "small_32_8_hier",
    "readme_16_8_hier",
)


def eplb_entries() -> list:
    """Every entry kernel of the loaded ``lbkit.eplb`` modules."""
    import sys

    from lbkit.core import _jit

    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("lbkit.eplb.") and module is not None:
            for value in vars(module).values():
                if isinstance(value, _jit.Entry):
                    found[id(value)] = value
    return list(found.values())


def test_entry_kernels_as_python_give_the_recorded_plans(recorded, monkeypatch):
    """The first call of a process runs the entry kernels as Python (lbkit.core._jit)."""
    from lbkit.core import _jit

    if _jit.jit_disabled():
        pytest.skip("NUMBA_DISABLE_JIT=1: everything runs as Python already")
    monkeypatch.setenv("LBKIT_JIT", "python")
    monkeypatch.setattr(_jit.Entry, "is_compiled", lambda self, *args: False)
    calls = []
    for kernel in eplb_entries():
        monkeypatch.setattr(kernel, "_ready", set())  # forget the compiled calls made before
        monkeypatch.setattr(kernel, "dispatcher", lambda *args: calls.append(args))
    cases = [c for c in golden.CASES if c[0] in PYTHON_CASES]
    got = golden.compute(cases)
    assert not calls  # every call ran as Python
    assert got and all(k.split("/")[0] in PYTHON_CASES for k in got)
    for key, value in got.items():
        np.testing.assert_array_equal(value, recorded[key].astype(value.dtype), err_msg=key)


def test_python_twins_reach_no_compiled_kernel():
    """A twin's namespace holds twins, never a numba dispatcher (which would compile)."""
    from lbkit.core import _jit
    from lbkit.eplb import _bound_kernels, _replan_layer, balanced, greedy

    if _jit.jit_disabled():
        pytest.skip("NUMBA_DISABLE_JIT=1")
    seen: set[int] = set()
    todo = [
        k.interpreted
        for k in (
            balanced.default_plan,
            balanced.two_slot_plan,
            greedy.greedy_plan,
            _bound_kernels.lower_bound_layers,
            _replan_layer.replan_subproblem,
            _replan_layer.replan_nodes,
            _replan_layer.replan_nodes_levels,
            _replan_layer.place_slots,
        )
    ]
    while todo:
        func = todo.pop()
        if id(func) in seen:
            continue
        seen.add(id(func))
        for name in func.__code__.co_names:
            value = func.__globals__.get(name)
            assert id(value) not in _jit._KERNELS, f"{func.__qualname__} calls compiled {name}"
            if callable(value) and getattr(value, "__code__", None) is not None:
                if any(value.__code__ is f.__code__ for _, f in _jit._KERNELS.values()):
                    todo.append(value)
    assert len(seen) > 30
