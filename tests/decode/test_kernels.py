"""JIT parity: every decode kernel gives the same result compiled and as plain Python."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.decode import POLICIES, _kernels
from lbkit.decode._state import params, state_iv
from lbkit.decode.policies import POLICY_CODES

from .strategies import UNIT_MAX, rank_states


def _matrix(state, rng_seed=0):
    b, s, new, kw = state
    X = state_iv(b, s, kw.get("max_batch"), kw.get("max_kv_tokens"), kw.get("eligible"))
    X[_kernels.ROW_KEY] = np.random.default_rng(rng_seed).random(X.shape[1])
    X[_kernels.ROW_PB] = X[_kernels.ROW_B] * 2
    X[_kernels.ROW_PS] = X[_kernels.ROW_S] + 3
    return X, new


@pytest.mark.jit_parity(kernels=(_kernels.score_means, _kernels.choose))
@pytest.mark.parametrize("policy", list(POLICIES))
@given(state=rank_states(), proj=st.booleans(), capscale=st.booleans(), cursor=st.integers(0, 7))
def test_choose_parity(policy, state, proj, capscale, cursor):
    X, new = _matrix(state)
    cursor %= X.shape[1]
    P = params(POLICY_CODES[policy], "capacity" if capscale else "mean", UNIT_MAX)
    bhat, shat = _kernels.score_means(X, 1.0, float(new), proj)
    assert (bhat, shat) == _kernels.score_means.py_func(X, 1.0, float(new), proj)
    args = (
        X, float(new), float(new + 2), POLICY_CODES[policy], capscale, bhat, shat,
        P[2], P[3], P[4], True, cursor, proj,
    )  # fmt: skip
    assert _kernels.choose(*args) == _kernels.choose.py_func(*args)


@pytest.mark.jit_parity(kernels=(_kernels.place,))
@pytest.mark.parametrize("policy", list(POLICIES))
@given(state=rank_states(), proj=st.booleans())
def test_place_parity(policy, state, proj):
    X, new = _matrix(state)
    P = params(POLICY_CODES[policy], "mean", UNIT_MAX, proj=proj)
    Xa, Xb = X.copy(), X.copy()
    sa, sb = np.zeros((5, 3), dtype=np.int64), np.zeros((5, 3), dtype=np.int64)
    ra = _kernels.place(Xa, sa, P, 1, new, new + 4, 1.0, float(new + 4), 9, 7, 0)
    rb = _kernels.place.py_func(Xb, sb, P, 1, new, new + 4, 1.0, float(new + 4), 9, 7, 0)
    assert ra == rb
    assert (Xa == Xb).all() and (sa == sb).all()


@pytest.mark.jit_parity(kernels=(_kernels.assign_sequence,))
@pytest.mark.parametrize("policy", list(POLICIES))
@given(state=rank_states(), kv=st.lists(st.integers(0, 30000), max_size=8))
def test_assign_sequence_parity(policy, state, kv):
    X, _ = _matrix(state)
    n = X.shape[1]
    kv = np.array(kv, dtype=np.float64)
    order = np.argsort(-kv, kind="stable")
    keys = np.random.default_rng(1).random((kv.size, n))
    P = params(POLICY_CODES[policy], "mean", UNIT_MAX)
    Xa, Xb = X.copy(), X.copy()
    oa, ob = np.zeros(kv.size, dtype=np.int64), np.zeros(kv.size, dtype=np.int64)
    ca = _kernels.assign_sequence(Xa, kv, order, P, 2.0, 5000.0, 0, keys, oa)
    cb = _kernels.assign_sequence.py_func(Xb, kv, order, P, 2.0, 5000.0, 0, keys, ob)
    assert ca == cb and (oa == ob).all() and (Xa == Xb).all()


def test_warmup_runs():
    _kernels.warmup()
