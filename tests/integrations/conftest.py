"""Fixtures of the adapter tests: the engine stand-ins, torch, warm EPLB kernels."""

from __future__ import annotations

import os

import pytest

import lbkit

from .engines import install_sglang, install_vllm


@pytest.fixture(scope="session", autouse=True)
def _warm_eplb_kernels():
    lbkit.warmup(packages=("eplb",))


@pytest.fixture
def torch():
    """The real torch (CPU build, in the ``dev`` extra); CI fails rather than skip without it."""
    try:
        import torch
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("torch is in the dev extra: `pip install -e '.[dev]'` must install it")
        pytest.skip("torch is not installed (pip install torch==2.13.0, the dev extra's pin)")
    return torch


@pytest.fixture
def vllm(monkeypatch):
    """vLLM 0.33.0's EPLB policy interface (``engines.install_vllm``), removed after the test."""
    monkeypatch.delenv("LBKIT_EPLB", raising=False)
    return install_vllm(monkeypatch)


@pytest.fixture
def sglang(monkeypatch):
    """SGLang 0.5.23's EPLB algorithm interface (``engines.install_sglang``)."""
    monkeypatch.delenv("LBKIT_EPLB", raising=False)
    return install_sglang(monkeypatch)
