"""Compile the EPLB kernels once per test session."""

import pytest

import lbkit


@pytest.fixture(scope="session", autouse=True)
def _warm_eplb_kernels():
    lbkit.warmup(packages=("eplb",))
