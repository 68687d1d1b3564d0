"""Optional-JIT shim: one place that decides how lbkit's kernels are compiled.

Kernels are plain loops over numpy arrays. They are compiled with ``numba.njit(nogil=True)``,
never with ``fastmath`` or ``parallel`` (router paths must be deterministic and must not start
thread pools). Compiled code is cached on disk only on request: set ``LBKIT_JIT_CACHE=1`` before
lbkit's subpackages are imported (the ``lbkit`` command-line tool does, since it runs as one
process; a library stays off by default because numba's on-disk cache and multiprocessing do not
always mix, numba issue 4807).

With ``NUMBA_DISABLE_JIT=1`` numba returns the Python function itself, which is how the test
suite checks JIT parity and measures coverage. If numba cannot be imported at all, the
decorator degrades to the identity so that the pure-Python kernels still run (slowly).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

try:  # numba is a core dependency; the fallback keeps lbkit importable on exotic platforms.
    import numba as _numba
except ImportError:  # pragma: no cover - exercised only where numba is absent
    _numba = None

__all__ = ["HAVE_NUMBA", "jit"]

HAVE_NUMBA = _numba is not None


def jit(func: F) -> F:
    """Compile ``func`` with numba in lbkit's standard mode (``nogil``, no fastmath).

    The compiled function keeps the original in ``.py_func`` (numba's convention; the fallback
    sets it too), so tests can compare the jitted kernel with the plain Python one.

    Examples
    --------
    >>> import numpy as np
    >>> @jit
    ... def total(x):
    ...     s = 0.0
    ...     for v in x:
    ...         s += v
    ...     return s
    >>> float(total(np.arange(4.0)))
    6.0
    >>> float(total.py_func(np.arange(4.0)))
    6.0
    """
    if _numba is None:  # pragma: no cover
        func.py_func = func  # type: ignore[attr-defined]
        return func
    compiled = None
    if os.environ.get("LBKIT_JIT_CACHE", "") == "1":
        try:
            compiled = _numba.njit(nogil=True, cache=True, fastmath=False)(func)
        except RuntimeError:  # no file to cache against (e.g. a function defined in a doctest)
            compiled = None
    if compiled is None:
        compiled = _numba.njit(nogil=True, cache=False, fastmath=False)(func)
    if not hasattr(compiled, "py_func"):  # NUMBA_DISABLE_JIT=1 returns the function itself
        compiled.py_func = func
    return compiled
