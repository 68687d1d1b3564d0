"""The guard of the JIT-parity tests (the root ``conftest.py``): a parity test must compare a
compiled kernel with its Python source, so it errors when the JIT is off and fails when a kernel
it names never ran compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARITY_TESTS = """
import numpy as np
import pytest

from lbkit.prefill import _kernels


@pytest.mark.jit_parity(kernels=(_kernels.divisor_apportion,))
def test_compiled_and_python_agree():
    args = (np.array([3.0, 1.0]), 4, np.zeros(2, np.int64), np.full(2, 4, np.int64), 0.0)
    a = _kernels.divisor_apportion(*args, np.zeros(2, np.int64))
    b = _kernels.divisor_apportion.py_func(*args, np.zeros(2, np.int64))
    assert a.tolist() == b.tolist()


@pytest.mark.jit_parity(kernels=(_kernels.partition_min_max,))
def test_names_a_kernel_it_never_calls():
    pass
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (tmp_path / "test_parity.py").write_text(PARITY_TESTS)
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), full.get("PYTHONPATH", "")])
    full["LBKIT_CACHE_DIR"] = str(tmp_path / "cache")  # the small kernels compile here
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rA",
            "-o",
            "markers=jit_parity",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=full,
        cwd=tmp_path,
        timeout=600,
    )


@pytest.mark.skipif(os.environ.get("NUMBA_DISABLE_JIT") == "1", reason="needs the JIT")
def test_a_parity_test_fails_when_a_named_kernel_never_ran_compiled(tmp_path):
    out = _run(tmp_path, NUMBA_DISABLE_JIT="0")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "PASSED test_parity.py::test_compiled_and_python_agree" in out.stdout
    assert "partition_min_max never ran compiled" in out.stdout
    assert "2 passed, 1 error" in out.stdout  # the call passes, its teardown errors


def test_parity_tests_error_without_the_jit(tmp_path):
    out = _run(tmp_path, NUMBA_DISABLE_JIT="1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.count("JIT-parity test run without numba's JIT") >= 2
    assert "2 errors" in out.stdout
