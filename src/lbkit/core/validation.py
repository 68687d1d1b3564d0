"""Input validation shared by lbkit's public boundaries.

Every public function validates its inputs once, through a ``_<name>_iv`` helper built from the
checks below, and then runs its kernel on clean arrays. Each check raises ``TypeError`` (wrong
kind of value) or ``ValueError`` (right kind, wrong value) with a message that names the argument
and the rule it broke, e.g. ``"weight: must be finite (found NaN)"``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "as_float_array",
    "as_int_array",
    "as_rng",
    "check_choice",
    "check_int",
    "check_int_list",
    "check_real",
    "set_rng_state",
    "to_numpy",
]


def to_numpy(value: Any, name: str) -> np.ndarray:
    """Convert array-likes (lists, numpy arrays, CPU or GPU torch tensors) to a numpy array.

    Examples
    --------
    >>> to_numpy([[1, 2], [3, 4]], "weight").shape
    (2, 2)
    """
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor without importing torch
        return value.detach().cpu().numpy()
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name}: expected an array of numbers, got {type(value).__name__}")
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise TypeError(f"{name}: expected an array of numbers ({exc})") from None


def _check_shape(arr: np.ndarray, name: str, ndim: int | None, shape: Sequence[int | None] | None):
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: must be {ndim}-dimensional, got shape {arr.shape}")
    if shape is not None:
        if arr.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(arr.shape, shape, strict=True)
        ):
            want_s = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: must have shape {want_s}, got {arr.shape}")


def _kernel_ready(arr: np.ndarray) -> np.ndarray:
    """``arr``, or a copy of it if it is read-only or unaligned: compiled kernels are
    specialised on writeable, aligned arrays, and another kind would run as Python until a
    copy for it is compiled (a re-plan of 58 x 256 from a read-only weight took 8 s instead of
    0.1 s).

    >>> x = np.arange(3.0)
    >>> x.flags.writeable = False
    >>> _kernel_ready(x).flags.writeable, _kernel_ready(np.arange(3.0)).flags.writeable
    (True, True)
    """
    if arr.flags.writeable and arr.flags.aligned:
        return arr
    return arr.copy()


def as_float_array(
    value: Any,
    name: str,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    nonnegative: bool = False,
    allow_empty: bool = True,
) -> np.ndarray:
    """Validate a real-valued array and return it as a contiguous, writeable ``float64`` array
    (the input itself when it is one).

    Parameters
    ----------
    value : array_like
        Numbers (bool, integer or floating dtype; torch tensors accepted).
    name : str
        Argument name used in error messages.
    ndim, shape : optional
        Required number of dimensions / shape (``None`` entries in ``shape`` match anything).
    nonnegative : bool
        Reject negative entries.
    allow_empty : bool
        Accept arrays with zero elements.

    Raises
    ------
    TypeError
        Non-numeric or complex dtype.
    ValueError
        Wrong shape, NaN or infinite entries, negative entries when ``nonnegative``.

    Examples
    --------
    >>> as_float_array([1, 2.5], "load", nonnegative=True)
    array([1. , 2.5])
    >>> as_float_array([1, -1], "load", nonnegative=True)
    Traceback (most recent call last):
    ...
    ValueError: load: must be non-negative (found -1.0 at index (1,))
    """
    arr = to_numpy(value, name)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name}: must hold real numbers, got dtype {arr.dtype}")
    _check_shape(arr, name, ndim, shape)
    if not allow_empty and arr.size == 0:
        raise ValueError(f"{name}: must not be empty, got shape {arr.shape}")
    out = _kernel_ready(np.asarray(arr, dtype=np.float64, order="C"))
    if out.size and not np.isfinite(out).all():
        bad = np.argwhere(~np.isfinite(out))[0]
        kind = "NaN" if np.isnan(out[tuple(bad)]) else "infinity"
        raise ValueError(
            f"{name}: must be finite (found {kind} at index {tuple(int(i) for i in bad)})"
        )
    if nonnegative and out.size and (out < 0).any():
        bad = np.argwhere(out < 0)[0]
        raise ValueError(
            f"{name}: must be non-negative (found {out[tuple(bad)]} at index "
            f"{tuple(int(i) for i in bad)})"
        )
    return out


_INT64_LIMIT = 2.0**63


def as_int_array(
    value: Any,
    name: str,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    min_value: int | None = None,
    max_value: int | None = None,
    allow_empty: bool = True,
) -> np.ndarray:
    """Validate an integer array and return it as a contiguous, writeable ``int64`` array (the
    input itself when it is one).

    Floating arrays are accepted only when every entry is integral (``3.0`` but not ``3.5``).

    Examples
    --------
    >>> as_int_array([0, 3.0], "slots", min_value=0)
    array([0, 3])
    >>> as_int_array([0.5], "slots")
    Traceback (most recent call last):
    ...
    ValueError: slots: must hold integers (found 0.5 at index (0,))
    """
    arr = to_numpy(value, name)
    kind = arr.dtype.kind
    if kind == "f":
        if arr.size and not np.isfinite(arr).all():
            raise ValueError(f"{name}: must hold integers (found a non-finite value)")
        frac = arr != np.round(arr)
        if arr.size and frac.any():
            bad = np.argwhere(frac)[0]
            raise ValueError(
                f"{name}: must hold integers (found {arr[tuple(bad)]} at index "
                f"{tuple(int(i) for i in bad)})"
            )
        if arr.size and np.abs(arr).max() >= _INT64_LIMIT:
            raise ValueError(f"{name}: entries must lie within int64 (|x| < 2**63)")
    elif kind == "u":
        if arr.size and arr.max() >= _INT64_LIMIT:
            raise ValueError(f"{name}: entries must lie within int64 (|x| < 2**63)")
    elif (
        kind == "O"
        and arr.size
        and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in arr.flat)
    ):
        raise ValueError(f"{name}: entries must lie within int64 (|x| < 2**63)")
    elif kind != "i":
        raise TypeError(f"{name}: must hold integers, got dtype {arr.dtype}")
    _check_shape(arr, name, ndim, shape)
    if not allow_empty and arr.size == 0:
        raise ValueError(f"{name}: must not be empty, got shape {arr.shape}")
    out = _kernel_ready(np.asarray(arr, dtype=np.int64, order="C"))
    if min_value is not None and out.size and (out < min_value).any():
        bad = np.argwhere(out < min_value)[0]
        raise ValueError(
            f"{name}: entries must be >= {min_value} (found {out[tuple(bad)]} at index "
            f"{tuple(int(i) for i in bad)})"
        )
    if max_value is not None and out.size and (out > max_value).any():
        bad = np.argwhere(out > max_value)[0]
        raise ValueError(
            f"{name}: entries must be <= {max_value} (found {out[tuple(bad)]} at index "
            f"{tuple(int(i) for i in bad)})"
        )
    return out


def check_int(
    value: Any, name: str, *, min_value: int | None = None, max_value: int | None = None
) -> int:
    """Validate an integer scalar (``bool`` is rejected) and return it as ``int``.

    Examples
    --------
    >>> check_int(4, "num_gpus", min_value=1)
    4
    >>> check_int(0, "num_gpus", min_value=1)
    Traceback (most recent call last):
    ...
    ValueError: num_gpus: must be >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalars
            item = value.item()
            if isinstance(item, int) and not isinstance(item, bool):
                return check_int(item, name, min_value=min_value, max_value=max_value)
        raise TypeError(f"{name}: must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if min_value is not None and value < min_value:
        raise ValueError(f"{name}: must be >= {min_value}, got {value}")
    if max_value is not None and value > max_value:
        raise ValueError(f"{name}: must be <= {max_value}, got {value}")
    return value


def check_int_list(
    value: Any,
    name: str,
    length: int,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
) -> np.ndarray:
    """Validate a list of ``length`` integers, as read from a saved state, into ``int64``.

    Stricter than :func:`as_int_array`: every entry must itself be an integer (``bool``,
    integral floats and strings are refused), and any failure is a ``ValueError`` naming the
    entry, as a corrupted file deserves.

    Examples
    --------
    >>> check_int_list([0, -1, 4], "state.seq", 3, min_value=-1)
    array([ 0, -1,  4])
    >>> check_int_list([0, False], "state.seq", 2)
    Traceback (most recent call last):
    ...
    ValueError: state.seq[1]: must be an integer, got bool False
    """
    if not isinstance(value, (list, tuple)) or len(value) != length:
        raise ValueError(f"{name}: must be a list of {length} integers, got {value!r:.60}")
    out = np.empty(length, dtype=np.int64)
    lo = -(2**63) if min_value is None else min_value
    hi = 2**63 - 1 if max_value is None else max_value
    for i, v in enumerate(value):
        try:
            out[i] = check_int(v, f"{name}[{i}]", min_value=lo, max_value=hi)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    return out


def check_real(
    value: Any,
    name: str,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    strict_min: bool = False,
    allow_inf: bool = False,
) -> float:
    """Validate a real scalar and return it as ``float``.

    Examples
    --------
    >>> check_real(0.5, "budget_s", min_value=0.0)
    0.5
    >>> check_real(0.0, "utilization", min_value=0.0, strict_min=True)
    Traceback (most recent call last):
    ...
    ValueError: utilization: must be > 0.0, got 0.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            return check_real(
                value.item(),
                name,
                min_value=min_value,
                max_value=max_value,
                strict_min=strict_min,
                allow_inf=allow_inf,
            )
        raise TypeError(f"{name}: must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if value != value:
        raise ValueError(f"{name}: must not be NaN")
    if not allow_inf and value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: must be finite, got {value}")
    if min_value is not None:
        if strict_min and not value > min_value:
            raise ValueError(f"{name}: must be > {min_value}, got {value}")
        if not strict_min and value < min_value:
            raise ValueError(f"{name}: must be >= {min_value}, got {value}")
    if max_value is not None and value > max_value:
        raise ValueError(f"{name}: must be <= {max_value}, got {value}")
    return value


def check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    """Validate that ``value`` is one of ``choices``.

    Examples
    --------
    >>> check_choice("max", "combine", ("sum", "max"))
    'max'
    >>> check_choice("mean", "combine", ("sum", "max"))
    Traceback (most recent call last):
    ...
    ValueError: combine: must be one of 'sum', 'max'; got 'mean'
    """
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}: must be one of {options}; got {value!r}")
    return value


def as_rng(rng: Any, name: str = "rng") -> np.random.Generator:
    """Return a ``numpy.random.Generator`` from a Generator, an integer seed or ``None``.

    ``None`` means seed 0: lbkit never draws from an unseeded source, so the same inputs always
    give the same decisions.

    Examples
    --------
    >>> float(as_rng(3).random()) == float(as_rng(3).random())
    True
    """
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None:
        return np.random.default_rng(0)
    if isinstance(rng, bool) or not isinstance(rng, numbers.Integral) or rng < 0:
        raise TypeError(f"{name}: must be a numpy Generator, a non-negative int seed or None")
    return np.random.default_rng(int(rng))


def set_rng_state(rng: np.random.Generator, saved: Any, name: str = "state.rng") -> None:
    """Set ``rng`` to a saved ``bit_generator.state`` (a balancer's ``from_state_dict``).

    Raises ``ValueError`` naming ``name`` when the saved state is not one of this bit generator
    or numpy does not keep it as given.

    Examples
    --------
    >>> a, b = as_rng(1), as_rng(2)
    >>> set_rng_state(b, a.bit_generator.state)
    >>> float(a.random()) == float(b.random())
    True
    """
    try:
        rng.bit_generator.state = saved
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise ValueError(f"{name}: not a numpy bit generator state ({exc})") from None
    if rng.bit_generator.state != saved:
        raise ValueError(f"{name}: numpy does not keep this bit generator state as given")
