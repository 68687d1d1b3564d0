"""The first re-plans of a process, before the re-planning kernels are compiled
(``lbkit.eplb._replan_first``): the same rules as the full re-plan, over two candidates a layer."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.eplb import check_placement, drift, moe_lb, rebalance_experts, replan
from lbkit.eplb._replan_candidates import matched_fresh
from lbkit.eplb._replan_first import replan_kernels_ready
from lbkit.eplb.replan import apply_moves, replan_experts

from .test_replan import brute_moves, replan_cases


@contextlib.contextmanager
def first_call():
    """Re-plan as a process does before its re-planning kernels are compiled."""
    with mock.patch.object(replan, "replan_kernels_ready", lambda: False):
        yield


def test_the_test_session_runs_the_full_search():
    assert replan_kernels_ready()  # LBKIT_JIT=inline (conftest.py): kernels compile on the call


@pytest.mark.parametrize("one, levels", [(True, False), (False, True), (True, True)])
def test_the_full_search_waits_for_both_search_kernels(one, levels):
    """The compiler writes the one-level and the all-levels kernels one after the other: a
    re-plan between the two must not run the second as Python."""
    from lbkit.eplb import _replan_first, _replan_layer

    with (
        mock.patch.object(_replan_first, "jit_mode", lambda: "background"),
        mock.patch.object(_replan_first, "jit_disabled", lambda: False),
        mock.patch.object(_replan_layer.replan_nodes, "is_compiled", lambda *a: one),
        mock.patch.object(_replan_layer.replan_nodes_levels, "is_compiled", lambda *a: levels),
    ):
        assert replan_kernels_ready() == (one and levels)


@given(replan_cases(), st.sampled_from([None, 0, 1, 3]), st.sampled_from([0.0, 0.01, 0.05]))
def test_first_replans_are_valid_never_worse_and_within_the_tolerance(case, budget, tol):
    w, old, r, k, n, g, policy = case
    with first_call():
        res = replan_experts(w, old, r, k, n, g, policy=policy, max_moves=budget, tolerance=tol)
    check_placement(*res.plan, num_experts=w.shape[1], num_gpus=g, num_groups=k,
                    num_nodes=n, policy=policy)  # fmt: skip
    assert np.array_equal(res.num_moves, brute_moves(old, res.plan.phy2log, g))
    assert np.array_equal(apply_moves(old, res.moves), res.plan.phy2log)
    assert (res.moe_lb <= res.previous_moe_lb + 1e-12).all()
    assert ((res.num_moves == 0) | (res.moe_lb < res.previous_moe_lb)).all()
    if budget is not None:
        assert (res.num_moves <= budget).all()
    else:  # every layer may take its matched fresh row: the mean target is always reachable
        fresh = moe_lb(w, rebalance_experts(w, r, k, n, g, policy=policy).phy2log, num_gpus=g)
        assert res.moe_lb.mean() <= fresh.mean() * (1.0 + tol) * (1.0 + 1e-9)


@given(replan_cases(), st.integers(0, 40))
def test_first_replans_respect_the_total_budget(case, total):
    w, old, r, k, n, g, policy = case
    with first_call():
        res = replan_experts(w, old, r, k, n, g, policy=policy, max_moves_total=total)
    assert res.num_moves.sum() <= total
    assert (res.moe_lb <= res.previous_moe_lb + 1e-12).all()


@given(replan_cases())
def test_the_choice_is_the_fewest_moves_over_old_and_matched_rows(case):
    """Against enumeration of every choice of the old or the matched fresh row per layer."""
    w, old, r, k, n, g, policy = case
    layers = min(len(w), 3)
    w, old = w[:layers], old[:layers]
    with first_call():
        res = replan_experts(w, old, r, k, n, g, policy=policy)
    args = replan.replan_iv(w, old, r, k, n, g, policy, None, None, 0.01, 0.1)
    fresh = rebalance_experts(w, r, k, n, g, policy=policy).phy2log
    fresh_lb = moe_lb(w, fresh, num_gpus=g)
    old_lb = moe_lb(w, old, num_gpus=g)
    options = []
    for layer in range(layers):
        opts = [(0, float(old_lb[layer]))]
        if old_lb[layer] > fresh_lb[layer]:
            row, used = matched_fresh(old[layer], fresh[layer], args)
            v = float(moe_lb(w[layer : layer + 1], row[None, :], num_gpus=g)[0])
            if v < old_lb[layer] * (1.0 - 1e-12):
                opts.append((used, v))
        options.append(opts)
    cap = float(fresh_lb.sum()) * 1.01
    combos = [
        (sum(o[0] for o in pick), sum(o[1] for o in pick)) for pick in itertools.product(*options)
    ]
    fits = [c for c in combos if c[1] <= cap]
    assert fits  # the matched rows reach the fresh plan's balance
    assert int(res.num_moves.sum()) == min(fits)[0]


def test_layer_scope_takes_every_layer_to_the_tolerance():
    w = np.random.default_rng(2).lognormal(0, 1.0, (6, 256)) * 1000
    old = rebalance_experts(w, 288, 8, 4, 32, policy="global").phy2log
    w2 = drift(w, sigma=0.1, rng=5)
    f = moe_lb(w2, rebalance_experts(w2, 288, 8, 4, 32, policy="global").phy2log, num_gpus=32)
    with first_call():
        per = replan_experts(w2, old, 288, 8, 4, 32, policy="global", tolerance_scope="layer")
    assert (per.moe_lb <= f * 1.01 * (1 + 1e-9)).all()


@pytest.mark.skipif(os.environ.get("NUMBA_DISABLE_JIT") == "1", reason="needs the JIT")
def test_a_fresh_process_with_an_empty_cache_replans_without_the_search_kernels(tmp_path):
    """End to end: the first re-plan of a fresh process runs no search (its kernels are not
    compiled) and still returns a valid re-plan within the tolerance."""
    code = """
        import json
        import numpy as np
        import lbkit.eplb as E
        from lbkit.eplb import _replan_candidates as C
        calls = []
        real = C.replan_layer
        C.replan_layer = lambda *a: calls.append(1) or real(*a)  # the search of one layer
        w = E.synthetic_expert_load(4, 64, rng=0)
        old = E.rebalance_experts(w, 80, 8, 2, 16).phy2log
        w1 = E.drift(w, sigma=0.2, rng=1)
        r = E.replan_experts(w1, old, 80, 8, 2, 16)
        fresh = E.moe_lb(w1, E.rebalance_experts(w1, 80, 8, 2, 16).phy2log, num_gpus=16)
        print(json.dumps([len(calls), float(r.moe_lb.mean()), float(fresh.mean()),
                          int(r.num_moves.sum())]))
    """
    env = dict(os.environ, LBKIT_JIT="python", LBKIT_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_DISABLE_JIT", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")]
    )
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    calls, got, fresh, moves = (float(v) for v in out.stdout.strip()[1:-1].split(","))
    assert calls == 0
    assert got <= fresh * 1.01 * (1 + 1e-9)
    assert moves > 0
