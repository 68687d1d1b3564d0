"""The routing kernels ``least_scored`` and ``roomy_slot`` against plain numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.prefill import _kernels as K


def _least_scored_reference(load, lo, hi, ranks, wake):
    """Scores as whole-array numpy: load, plus ``wake`` on every rank of an all-zero engine."""
    block = load[lo:hi].reshape(-1, ranks)
    top = block.max(axis=1)
    vals = (block + np.where(top > 0.0, 0.0, wake)[:, None]).ravel()
    k = int(vals.argmin())
    return k, float(vals[k]), float(top[k // ranks])


def _least_engine_reference(load, lo, hi, ranks, wake):
    block = load[lo:hi].reshape(-1, ranks)
    score = block.sum(axis=1) / ranks + np.where(block.max(axis=1) > 0.0, 0.0, wake)
    e = int(score.argmin())
    return e * ranks + int(block[e].argmin()), float(score[e])


def _roomy_slot_reference(load, end, ranks, quota):
    block = load[:end].reshape(-1, ranks)
    vals = np.where(block + quota <= block.max(axis=1, keepdims=True), block, np.inf)
    k = int(vals.argmin())
    return k if vals.flat[k] < np.inf else -1


@st.composite
def _loads(draw):
    ranks = draw(st.integers(1, 5))
    engines = draw(st.integers(1, 6))
    # few distinct values: ties and idle (all-zero) engines are common
    values = st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.25, 7.0])
    load = np.array(draw(st.lists(values, min_size=engines * ranks, max_size=engines * ranks)))
    e0 = draw(st.integers(0, engines - 1))
    e1 = draw(st.integers(e0 + 1, engines))
    return load, ranks, e0 * ranks, e1 * ranks


@settings(max_examples=300, deadline=None)
@given(_loads(), st.sampled_from([0.0, 0.25, 1.0, 10.0]))
def test_least_scored_matches_numpy(case, wake):
    load, ranks, lo, hi = case
    got = K.least_scored(load, lo, hi, ranks, wake)
    want = _least_scored_reference(load, lo, hi, ranks, wake)
    assert (int(got[0]), float(got[1]), float(got[2])) == want


@settings(max_examples=300, deadline=None)
@given(_loads(), st.sampled_from([0.0, 0.25, 1.0, 10.0]))
def test_least_engine_matches_numpy(case, wake):
    load, ranks, lo, hi = case
    k, score = K.least_engine(load, lo, hi, ranks, wake)
    want_k, want_score = _least_engine_reference(load, lo, hi, ranks, wake)
    assert int(k) == want_k and float(score) == pytest.approx(want_score, rel=1e-12, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(_loads(), st.sampled_from([0.0, 0.5, 1.0, 2.5, 100.0]))
def test_roomy_slot_matches_numpy(case, quota):
    load, ranks, _, hi = case
    assert K.roomy_slot(load, hi, ranks, quota) == _roomy_slot_reference(load, hi, ranks, quota)


def test_examples():
    load = np.array([0.0, 0.0, 2.0, 0.5, 1.0, 3.0])  # engines of 2: idle, (2, 0.5), (1, 3)
    assert K.least_scored(load, 0, 6, 2, 0.0) == (0, 0.0, 0.0)
    assert K.least_scored(load, 0, 6, 2, 1.0) == (3, 0.5, 2.0)  # the idle engine pays 1.0
    assert K.roomy_slot(load, 6, 2, 1.5) == 3  # 0.5 + 1.5 <= 2.0; 1.0 + 1.5 <= 3.0 loads more
    assert K.roomy_slot(load, 6, 2, 2.5) == -1


def test_roomy_slot_takes_a_rank_that_exactly_fills_its_engine_step():
    # Found by the balancer's state machine: two and three requests of the same quota. In
    # floats 2q + q == 3q here while 3q - q < 2q, so the rule must be ``v + quota <= top``.
    q = 51.24999999999999  # the unit preset's quota of 50 tokens
    two, three = q + q, q + q + q
    assert two + q <= three and not two <= three - q
    load = np.array([359.7505, 358.75, two, three])
    assert K.roomy_slot(load, 4, 2, q) == 2
    assert K.roomy_slot.py_func(load, 4, 2, q) == 2


@pytest.mark.jit_parity(kernels=(K.least_scored, K.roomy_slot, K.least_engine))
def test_jit_parity():
    rng = np.random.default_rng(5)
    for _ in range(50):
        load = rng.choice([0.0, 1.0, 2.5, 4.0], size=12)
        for wake in (0.0, 3.0):
            assert K.least_scored(load, 4, 12, 4, wake) == K.least_scored.py_func(
                load, 4, 12, 4, wake
            )
        assert K.roomy_slot(load, 12, 4, 1.0) == K.roomy_slot.py_func(load, 12, 4, 1.0)
        assert K.least_engine(load, 4, 12, 4, 2.0) == K.least_engine.py_func(load, 4, 12, 4, 2.0)
