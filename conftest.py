"""Test-session set-up shared by tests, doctests and benchmarks.

Hypothesis profiles: ``dev`` (default, quick), ``ci`` (chosen automatically when ``CI=true``;
derandomized so a CI run is reproducible) and ``thorough`` (for a long local run). Choose one with
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
settings.register_profile("thorough", max_examples=1000, deadline=None)
_default = "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))

# Doctests print arrays; keep their format stable across numpy versions.
np.set_printoptions(legacy=False)

collect_ignore = ["src/lbkit/__main__.py"]

# The benchmark scripts import their shared helpers (benchmarks/run_record.py) as a top-level
# module, as they do when run as ``python benchmarks/NAME.py``; their doctests import them too.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))
