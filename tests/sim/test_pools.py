"""The pool objects behind simulate_prefill / simulate_decode: admission state against the cost
model, and the kernels' layout constants."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.core import PRESETS
from lbkit.sim import _decode_kernels as DK
from lbkit.sim import _prefill_layout as L
from lbkit.sim.decode_pool import DecodePool
from lbkit.sim.policies import PREFILL_POLICIES
from lbkit.sim.policies_decode import DECODE_POLICIES
from lbkit.sim.prefill_pool import PrefillPool
from lbkit.sim.traces import Trace

H800 = PRESETS["h800_dsv3"]


def _names(module, prefix):
    return {k: v for k, v in vars(module).items() if k.startswith(prefix) and k.isupper()}


def test_layout_rows_are_distinct_and_within_their_arrays():
    for module, groups in ((L, ("RI_", "RF_", "KI_", "KF_", "EF_", "EI_", "P_", "ACC_", "KS_",
                                "SCR_")),
                           (DK, ("DI_", "DF_", "DK_", "DE_", "D_", "DACC_"))):  # fmt: skip
        for prefix in groups:
            rows = {k: v for k, v in _names(module, prefix).items() if k != prefix + "W"}
            size = getattr(module, "N_" + prefix[:-1])
            assert sorted(rows.values()) == list(range(size)), prefix


@settings(max_examples=30, deadline=None)
@given(total=st.integers(2, 20_000), cached=st.integers(0, 19_999), hit=st.integers(0, 19_999))
def test_admission_with_a_hit_sets_the_quota_of_the_rest(total, cached, hit):
    cached, hit = min(cached, total - 1), min(hit, total - 1)
    t = Trace(arrival_s=[0.0], total_tokens=[total], output_tokens=[1], cached_tokens=[cached])
    cost = H800.prefill
    pool = PrefillPool(t, PREFILL_POLICIES["round_robin"](1, 2, cost=cost, rng=0), "rr",
                       num_engines=1, ranks_per_engine=2, cost=cost)  # fmt: skip
    assert pool.RF[L.RF_Q0, 0] == cost.quota(total - cached, cached)
    pool.admit(0, 1, 0.0, prefix_tokens=hit)
    rem = total - hit
    assert pool.RI[L.RI_PREFIX, 0] == hit and pool.RI[L.RI_REM, 0] == rem
    assert pool.RI[L.RI_UNCACHED, 0] == rem and pool.ran_cached[0] == hit
    assert pool.RF[L.RF_Q0, 0] == pool.RF[L.RF_QREPORT, 0] == cost.quota(rem, hit)
    assert pool.view.num_requests.tolist() == [0, 1] and pool.view.tokens.tolist() == [0, rem]


def test_decode_pool_screens_what_needs_no_step_or_never_fits():
    t = Trace(arrival_s=[0.0, 0.0, 0.0, 0.0], total_tokens=[10, 90, 60, 10],
              output_tokens=[1, 2, 50, 3])  # fmt: skip
    cost = H800.decode
    pool = DecodePool(t, t.arrival_s, DECODE_POLICIES["least_kv"](1, 2, cost=cost, rng=0), "kv",
                      num_engines=1, ranks_per_engine=2, cost=cost, bin_s=1.0, max_kv_tokens=100,
                      admission_limit_tokens=80)  # fmt: skip
    assert [pool.screen(i, 0.0) for i in range(4)] == [False, False, False, True]
    assert pool.DI[DK.DI_RANK, 0] == -2 and pool.DF[DK.DF_FINISH, 0] == 0.0
    assert pool.refusal.tolist() == [0, 1, 2, 0]  # too_long, outgrows
    assert pool.offer(3, 0.0) and pool.view.num_requests.sum() == 1
    assert not pool.retry(math.inf)
    np.testing.assert_array_equal(pool.view.kv_tokens, pool.DK[DK.DK_S])


@settings(max_examples=60, deadline=None)
@given(
    b=st.sampled_from([2.0**-55, 1e-17, 1e-4]),
    k=st.sampled_from([0.0, 8.538610812692633e-23]),
    gamma=st.floats(0.0, 1e-3),
    budget=st.floats(1e-9, 2e3),
    prefix=st.integers(0, 10**7),
)
def test_plan_kernel_solve_chunk_is_the_cost_models(b, k, gamma, budget, prefix):
    """The simulator's chunk solver (the variable model, no fixed cost) returns what
    ``QuadraticCost.solve_chunk`` returns for a cost without ``a``, down to per-token costs where
    only its bisection finds the chunk (without shared expert work the two evaluate the work in
    the same order, so they agree bit for bit at any magnitude)."""
    from lbkit.core import QuadraticCost
    from lbkit.sim import _plan_kernels

    cost = QuadraticCost(a=0.0, b=b, k=k, q=0.0, gamma=gamma)
    P = np.zeros(L.N_P)
    P[L.P_B], P[L.P_K], P[L.P_Q], P[L.P_GAMMA] = b, k, 0.0, gamma
    want = cost.solve_chunk(budget, prefix)
    for kernel in (_plan_kernels.solve_chunk, _plan_kernels.solve_chunk.py_func):
        assert kernel(P, budget, prefix) == want
