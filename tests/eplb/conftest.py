"""Compile the EPLB kernels once per test session."""

import pytest

from lbkit.eplb import _kernels


@pytest.fixture(scope="session", autouse=True)
def _warm_eplb_kernels():
    _kernels.warmup()
