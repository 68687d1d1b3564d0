"""The re-plans of a layer at every tolerance level in one kernel call (``replan_levels``,
``replan_nodes_levels``) give what one call per level gives, and leave out only levels that a
looser level's result already meets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.eplb import _replan_layer, drift, rebalance_experts
from lbkit.eplb._replan_candidates import _replan_one_uncached, context, replan_levels
from lbkit.eplb._replan_choice import _LEVELS
from lbkit.eplb.replan import replan_iv

from .strategies import instances


@pytest.fixture(scope="module", autouse=True)
def _warm():
    _replan_layer.warmup()


@st.composite
def level_cases(draw):
    weight, r, k, n, g, policy = draw(instances())
    sigma = draw(st.sampled_from([0.05, 0.3, 1.0]))
    old = rebalance_experts(weight, r, k, n, g, policy=policy).phy2log
    new_w = drift(weight, sigma=sigma, rng=draw(st.integers(0, 2**16)))
    budget = draw(st.sampled_from([None, 1, 3]))
    tol = draw(st.sampled_from([0.0, 0.01, 0.05]))
    args = replan_iv(new_w, old, r, k, n, g, policy, budget, None, tol, 0.005)
    return args, tol


def _same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and a[1:] == b[1:]


@given(level_cases())
def test_levels_in_one_call_equal_one_call_per_level(case):
    args, tol = case
    ctx = context(args)
    levels = sorted({tol * f for f in _LEVELS}, reverse=True)
    for layer in range(args.previous.shape[0]):
        budget = int(args.budget[layer])
        replan_levels(args, ctx, layer, levels, budget)
        fresh_lb = ctx.fresh_lb[layer]
        alone = [_replan_one_uncached(args, ctx, layer, t, budget) for t in levels]
        kept = [ctx.old_lb[layer] <= fresh_lb * (1.0 + t) for t in levels]
        if sum(not k for k in kept) < 2:  # one kernel call would save nothing: none made
            assert not any((layer, t, budget) in ctx.memo for t in levels)
            continue
        for j, t in enumerate(levels):
            got = ctx.memo.get((layer, t, budget))
            if got is not None:
                assert not kept[j] and _same(got, alone[j]), (layer, t)
                continue
            # Left out: kept as the old row, or a looser level's result (with moves) meets it.
            if kept[j]:
                assert alone[j][1] == 0 and alone[j][3] is None
                continue
            looser = [ctx.memo.get((layer, s, budget)) for s in levels[:j]]
            assert any(
                x is not None and x[1] > 0 and x[3] <= fresh_lb * (1.0 + t) for x in looser
            ), (layer, t)


@pytest.mark.jit_parity(kernels=(_replan_layer.replan_nodes_levels,))
def test_replan_nodes_levels_jit_parity_and_per_level_equality():
    """Two nodes of 8 experts on 2 GPUs of 5 slots each at three targets: the compiled kernel,
    its Python twin and one :func:`replan_nodes` call per target give the same rows and moves
    (nothing left out when no row is useful)."""
    rng = np.random.default_rng(11)
    for _ in range(4):
        experts = rng.permutation(16).reshape(2, 8)
        rows = [rng.permutation(np.r_[np.arange(8), rng.integers(0, 8, 2)]) for _ in range(2)]
        old = np.stack(rows).reshape(2, 2, 5).astype(np.int64)
        prev = np.concatenate([experts[n][old[n].ravel()] for n in range(2)]).astype(np.int64)
        w = rng.lognormal(0, 1, 16) * 100
        mean = w.sum() / 4
        targets = mean * np.array([1.05, 1.02, 1.001])
        order = np.array([1, 0], dtype=np.int64)
        common = (w[experts], old, experts.astype(np.int64), prev, order, targets, 6, w)
        meets, useful = np.full(3, np.inf), 0.0
        a, b = np.empty((3, 20), dtype=np.int64), np.empty((3, 20), dtype=np.int64)
        ua = _replan_layer.replan_nodes_levels.dispatcher(*common, meets, useful, a)
        ub = _replan_layer.replan_nodes_levels.interpreted(*common, meets, useful, b)
        assert np.array_equal(ua, ub) and np.array_equal(a, b)
        for k, target in enumerate(targets):
            one = np.empty(20, dtype=np.int64)
            used = _replan_layer.replan_nodes(*common[:5], target, 6, one)
            assert used == ua[k] and np.array_equal(one, a[k])


def test_a_useful_row_that_meets_the_tighter_levels_leaves_them_out():
    """With every row useful and meeting every level, only the first level is computed."""
    rng = np.random.default_rng(3)
    experts = np.arange(8)[None, :]
    old = rng.permutation(np.r_[np.arange(8), 0, 1]).reshape(1, 2, 5).astype(np.int64)
    w = rng.lognormal(0, 1, 8) * 100
    prev = old.ravel().copy()
    targets = w.sum() / 2 * np.array([1.5, 1.2, 1.0])
    rows = np.empty((3, 10), dtype=np.int64)
    args = (w[None], old, experts, prev, np.zeros(1, dtype=np.int64), targets, 10, w)
    used = _replan_layer.replan_nodes_levels(*args, np.full(3, np.inf), np.inf, rows)
    if 0 < used[0] <= 10:
        assert (used[1:] == -1).all()
    else:  # nothing moved: no row is useful, every level computed
        assert (used >= 0).all()
