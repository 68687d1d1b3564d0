"""Test-session set-up shared by tests, doctests and benchmarks.

Hypothesis profiles: ``dev`` (default, quick), ``ci`` (chosen automatically when ``CI=true``;
derandomized so a CI run is reproducible), ``ci-reseeded`` (CI's second pass over the property
tests with ``--hypothesis-seed``) and ``thorough`` (for a long local run). Choose one with
``HYPOTHESIS_PROFILE=<name>``.
"""

import os
import sys

import numpy as np
from hypothesis import HealthCheck, settings

# Kernels compile in the test process on first use (lbkit.core._jit): no background compilers
# competing with the test run for the CPU.
os.environ.setdefault("LBKIT_JIT", "inline")

settings.register_profile("dev", max_examples=40, deadline=None)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# The "ci" profile's examples are fixed (derandomized); CI runs the property tests a second time
# under this profile and another fixed seed (.ci/run), so that a flaky property shows up there.
settings.register_profile(
    "ci-reseeded",
    max_examples=60,
    deadline=None,
    derandomize=False,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
_default = "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))

# Doctests print arrays; keep their format stable across numpy versions.
np.set_printoptions(legacy=False)

collect_ignore = ["src/lbkit/__main__.py"]

# The benchmark scripts import their shared helpers (benchmarks/run_record.py) as a top-level
# module, as they do when run as ``python benchmarks/NAME.py``; their doctests import them too.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))


def _jit_off() -> bool:
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a core dependency
        return True
    return bool(numba.config.DISABLE_JIT)


def _compiled_signatures(kernel) -> list:
    # An entry kernel (lbkit.core._jit.Entry) keeps its numba dispatcher in ``.dispatcher``.
    dispatcher = getattr(kernel, "dispatcher", kernel)
    return list(getattr(dispatcher, "signatures", ()))


def pytest_runtest_setup(item):
    """A JIT-parity test (``@pytest.mark.jit_parity``) compares compiled kernels with their
    Python source; with the JIT off it would compare a function with itself, so it errors."""
    if item.get_closest_marker("jit_parity") is not None and _jit_off():
        import pytest

        pytest.fail(
            "JIT-parity test run without numba's JIT (NUMBA_DISABLE_JIT=1 or no numba): it "
            "would compare the Python source with itself; deselect with -m 'not jit_parity'",
            pytrace=False,
        )


def pytest_runtest_teardown(item):
    """After a JIT-parity test: each kernel it names was really compiled (not run as Python)."""
    marker = item.get_closest_marker("jit_parity")
    if marker is None or _jit_off():
        return
    plain = [
        getattr(k, "__qualname__", repr(k))
        for k in marker.kwargs.get("kernels", ())
        if not _compiled_signatures(k)
    ]
    if plain:
        import pytest

        pytest.fail(
            f"JIT-parity test: {', '.join(plain)} never ran compiled, so the test compared "
            "Python with Python",
            pytrace=False,
        )
