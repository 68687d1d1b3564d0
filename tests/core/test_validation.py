"""Validation helpers: clean conversions and messages that name the argument and the rule."""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.core.validation import (
    as_float_array,
    as_int_array,
    as_rng,
    check_choice,
    check_int,
    check_real,
)


def test_as_float_array_accepts_lists_ints_and_bools():
    assert as_float_array([True, 2], "x").tolist() == [1.0, 2.0]
    assert as_float_array(3, "x").shape == ()


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "match"),
    [
        (["a"], {}, TypeError, "x: must hold real numbers"),
        ([1j], {}, TypeError, "x: must hold real numbers"),
        (None, {}, TypeError, "x: expected an array of numbers"),
        ([[1.0], [2.0, 3.0]], {}, TypeError, "x: expected an array of numbers"),
        ([1.0, np.inf], {}, ValueError, r"x: must be finite \(found infinity at index \(1,\)\)"),
        ([[1.0, 2.0]], {"ndim": 1}, ValueError, "x: must be 1-dimensional"),
        ([1.0, 2.0], {"shape": (3,)}, ValueError, r"x: must have shape \(3\)"),
        ([], {"allow_empty": False}, ValueError, "x: must not be empty"),
    ],
)
def test_as_float_array_errors(value, kwargs, error, match):
    with pytest.raises(error, match=match):
        as_float_array(value, "x", **kwargs)


def test_as_int_array_bounds_and_types():
    assert as_int_array(np.array([1, 2], dtype=np.uint8), "x").dtype == np.int64
    with pytest.raises(ValueError, match=r"x: entries must be >= 0 \(found -1 at index \(0,\)\)"):
        as_int_array([-1], "x", min_value=0)
    with pytest.raises(ValueError, match=r"x: entries must be <= 3"):
        as_int_array([4], "x", max_value=3)
    with pytest.raises(TypeError, match="x: must hold integers"):
        as_int_array(["1"], "x")
    with pytest.raises(ValueError, match="x: must hold integers"):
        as_int_array([np.nan], "x")


def test_check_int_and_real():
    assert check_int(np.int32(5), "n") == 5
    assert check_int(np.array(5), "n") == 5
    with pytest.raises(TypeError, match="n: must be an integer"):
        check_int(True, "n")
    with pytest.raises(TypeError, match="n: must be an integer"):
        check_int(2.0, "n")
    with pytest.raises(ValueError, match="n: must be <= 3, got 4"):
        check_int(4, "n", max_value=3)
    assert check_real(np.float32(0.5), "r") == 0.5
    assert check_real(float("inf"), "r", allow_inf=True) == float("inf")
    with pytest.raises(ValueError, match=r"r: must be <= 1\.0"):
        check_real(2, "r", max_value=1.0)
    with pytest.raises(TypeError, match="r: must be a real number"):
        check_real(None, "r")


def test_check_choice_and_rng():
    assert check_choice("a", "c", ("a", "b")) == "a"
    with pytest.raises(ValueError, match="c: must be one of 'a', 'b'; got 3"):
        check_choice(3, "c", ("a", "b"))
    g = np.random.default_rng(1)
    assert as_rng(g) is g
    assert as_rng(None).random() == as_rng(None).random()
    with pytest.raises(TypeError, match="rng: must be a numpy Generator"):
        as_rng(-1)
    with pytest.raises(TypeError, match="rng: must be a numpy Generator"):
        as_rng(1.5)


def test_torch_tensors_are_converted_when_torch_is_installed():
    torch = pytest.importorskip("torch")
    out = as_float_array(torch.tensor([[1, 2]]), "x", ndim=2)
    assert isinstance(out, np.ndarray) and out.tolist() == [[1.0, 2.0]]


def test_read_only_and_unaligned_arrays_come_back_writeable_and_aligned():
    """Compiled kernels are specialised on writeable, aligned arrays: validation copies the
    other kinds (and returns a writeable input itself)."""
    ro = np.arange(6.0)
    ro.flags.writeable = False
    got = as_float_array(ro, "w")
    assert got.flags.writeable and np.array_equal(got, ro)
    ints = np.arange(6)
    ints.flags.writeable = False
    assert as_int_array(ints, "x").flags.writeable
    raw = np.zeros(8 * 6 + 1, dtype=np.uint8)
    unaligned = np.frombuffer(raw.data, dtype=np.float64, count=6, offset=1)
    assert not unaligned.flags.aligned
    fixed = as_float_array(unaligned, "w")
    assert fixed.flags.aligned and fixed.flags.writeable
    mine = np.arange(6.0)
    assert as_float_array(mine, "w") is mine
