"""plan_migrations against brute force, its invariants, errors and JIT parity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.decode import _kernels, migration_objective, plan_migrations
from lbkit.decode._reference import best_single_migration

from .strategies import KV


@st.composite
def fleets(draw, max_ranks=5, max_requests=8):
    """``(request_rank, request_kv, num_ranks, kwargs)`` with optional eligibility and caps."""
    n = draw(st.integers(1, max_ranks))
    m = draw(st.integers(0, max_requests))
    rank = draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m))
    kv = draw(st.lists(KV, min_size=m, max_size=m))
    kw = {}
    if draw(st.booleans()):
        kw["eligible"] = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    if draw(st.booleans()):
        kw["max_batch"] = draw(st.integers(0, 6))
    if draw(st.booleans()):
        kw["max_kv_tokens"] = draw(st.lists(st.integers(0, 60000), min_size=n, max_size=n))
    return np.array(rank, dtype=np.int64), np.array(kv, dtype=np.int64), n, kw


def _loads(rank, kv, n):
    return np.bincount(rank, minlength=n), np.bincount(rank, weights=kv, minlength=n)


@given(fleets())
def test_the_first_move_is_the_best_single_move(fleet):
    rank, kv, n, kw = fleet
    plan = plan_migrations(rank, kv, num_ranks=n, max_moves=1, **kw)
    best, _, _ = best_single_migration(rank, kv, n, **kw)
    if best < plan.objective_before * (1 - 1e-9):
        assert len(plan.request) == 1
        assert plan.objective_after == pytest.approx(best, rel=1e-9)
    else:  # no move lowers the objective (beyond rounding)
        assert plan.objective_after >= best * (1 - 1e-9)


@given(fleets(), st.integers(0, 6))
def test_moves_are_feasible_and_every_one_lowers_the_objective(fleet, max_moves):
    rank, kv, n, kw = fleet
    plan = plan_migrations(rank, kv, num_ranks=n, max_moves=max_moves, **kw)
    assert len(plan.request) <= max_moves
    assert len(set(plan.request.tolist())) == len(plan.request)  # each request at most once
    assert (plan.source == rank[plan.request]).all()
    assert (plan.source != plan.target).all()
    now = rank.copy()
    last = migration_objective(*_loads(now, kv, n))
    assert plan.objective_before == pytest.approx(last)
    for i, dst in zip(plan.request, plan.target, strict=True):
        now[i] = dst
        b, s = _loads(now, kv, n)
        if "eligible" in kw:
            assert kw["eligible"][dst]
        if "max_batch" in kw:
            assert b[dst] <= kw["max_batch"]
        if "max_kv_tokens" in kw:
            assert s[dst] <= kw["max_kv_tokens"][dst]
        value = migration_objective(b, s)
        assert value < last
        last = value
    assert plan.objective_after == pytest.approx(last)
    # A longer budget continues the same plan (greedy, deterministic).
    more = plan_migrations(rank, kv, num_ranks=n, max_moves=max_moves + 1, **kw)
    assert (more.request[: len(plan.request)] == plan.request).all()
    assert (more.target[: len(plan.target)] == plan.target).all()


@given(fleets(), st.integers(1, 6))
def test_conservation_and_determinism(fleet, max_moves):
    rank, kv, n, kw = fleet
    a = plan_migrations(rank, kv, num_ranks=n, max_moves=max_moves, **kw)
    b = plan_migrations(rank.copy(), kv.copy(), num_ranks=n, max_moves=max_moves, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3], strict=True))
    now = rank.copy()
    now[a.request] = a.target
    assert np.bincount(now, minlength=n).sum() == len(rank)  # no request lost


def test_a_short_request_moves_to_the_rank_with_few_requests():
    plan = plan_migrations([0, 0, 0, 0, 1], [100, 100, 100, 100, 5000], num_ranks=2, max_moves=4)
    assert plan.request.tolist() == [0] and plan.target.tolist() == [1]


def test_a_draining_rank_empties_when_that_balances():
    # Rank 2 may not receive; its requests leave for ranks 0 and 1 when that lowers F.
    plan = plan_migrations([2, 2, 2, 2], [100, 100, 100, 100], num_ranks=3, max_moves=10,
                           eligible=[True, True, False])  # fmt: skip
    assert set(plan.target.tolist()) <= {0, 1} and len(plan.request) >= 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"request_rank": [0, 3]}, "request_rank"),
        ({"request_kv_tokens": [1, -1]}, "request_kv_tokens"),
        ({"request_kv_tokens": [1]}, "request_kv_tokens"),
        ({"max_moves": -1}, "max_moves"),
        ({"num_ranks": 0}, "num_ranks"),
        ({"eligible": [1, 0, 1]}, "eligible"),
        ({"eligible": np.array([True, False])}, "eligible"),
        ({"max_batch": -1}, "max_batch"),
        ({"max_kv_tokens": [1, 2]}, "max_kv_tokens"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    args = {"request_rank": [0, 1], "request_kv_tokens": [5, 7], "num_ranks": 3, "max_moves": 2}
    args.update(kwargs)
    rank, kv = args.pop("request_rank"), args.pop("request_kv_tokens")
    with pytest.raises((ValueError, TypeError), match=match):
        plan_migrations(rank, kv, **args)


def test_nothing_to_move():
    empty = plan_migrations([], [], num_ranks=3, max_moves=5)
    assert len(empty.request) == 0 and empty.objective_before == empty.objective_after == 0.0
    assert len(plan_migrations([0, 1], [5, 5], num_ranks=2, max_moves=0).request) == 0


@pytest.mark.jit_parity(kernels=(_kernels.migrate,))
@given(fleets(), st.integers(0, 5))
def test_migrate_kernel_jit_parity(fleet, max_moves):
    rank, kv, n, _ = fleet
    outs = []
    for fn in (_kernels.migrate, _kernels.migrate.py_func):
        X = np.zeros((_kernels.NUM_ROWS, n))
        X[_kernels.ROW_B], X[_kernels.ROW_S] = _loads(rank, kv, n)
        X[_kernels.ROW_CAP_B : _kernels.ROW_CAP_S + 1] = np.inf
        X[_kernels.ROW_OK] = 1.0
        r = rank.copy()
        req = np.zeros(max_moves, dtype=np.int64)
        dst = np.zeros(max_moves, dtype=np.int64)
        bhat = max(X[_kernels.ROW_B].mean(), 1e-9)
        shat = X[_kernels.ROW_S].mean() or 1.0
        k = fn(X, r, kv.astype(float), np.zeros(len(r), dtype=np.bool_), bhat, shat, max_moves,
               req, dst)  # fmt: skip
        outs.append((k, r.tolist(), req[:k].tolist(), dst[:k].tolist(), X.tolist()))
    assert outs[0] == outs[1]


def _heaviest(rank, kv, n):
    b, s = _loads(rank, kv, n)
    bh = b.mean() if len(rank) else 1.0
    sh = s.mean() if s.mean() > 0 else 1.0
    terms = [(b[r] / bh) ** 2 + (s[r] / sh) ** 2 if (rank == r).any() else -1.0 for r in range(n)]
    return int(np.argmax(terms))  # the first of equal maxima


@given(fleets())
def test_heaviest_sources_make_the_best_move_off_the_heaviest_rank(fleet):
    rank, kv, n, kw = fleet
    plan = plan_migrations(rank, kv, num_ranks=n, max_moves=1, sources="heaviest", **kw)
    before = migration_objective(*_loads(rank, kv, n))
    assert plan.objective_before == pytest.approx(before)
    if not len(rank):
        assert len(plan.request) == 0
        return
    src = _heaviest(rank, kv, n)
    b, s = _loads(rank, kv, n)
    ok = np.asarray(kw.get("eligible", np.ones(n, dtype=bool)))
    cap_b = kw.get("max_batch", np.inf)
    cap_s = np.asarray(kw.get("max_kv_tokens", np.full(n, np.inf)))
    best = before
    for i in np.flatnonzero(rank == src):
        for r in range(n):
            if r == src or not ok[r] or b[r] + 1 > cap_b or s[r] + kv[i] > cap_s[r]:
                continue
            moved = rank.copy()
            moved[i] = r
            best = min(best, migration_objective(*_loads(moved, kv, n)))
    if best < before * (1 - 1e-9):
        assert len(plan.request) == 1 and plan.source[0] == src
        assert plan.objective_after == pytest.approx(best, rel=1e-9)
    else:
        assert plan.objective_after >= best * (1 - 1e-9)


@given(fleets(), st.integers(0, 6))
def test_heaviest_sources_moves_are_feasible_and_lower_the_objective(fleet, max_moves):
    rank, kv, n, kw = fleet
    plan = plan_migrations(rank, kv, num_ranks=n, max_moves=max_moves, sources="heaviest", **kw)
    assert len(set(plan.request.tolist())) == len(plan.request) <= max_moves
    now = rank.copy()
    last = plan.objective_before
    for i, dst in zip(plan.request, plan.target, strict=True):
        now[i] = dst
        value = migration_objective(*_loads(now, kv, n))
        assert value < last
        last = value
    assert np.bincount(now, minlength=n).sum() == len(rank)  # no request lost


def test_unknown_sources_are_refused_by_name():
    with pytest.raises(ValueError, match="sources"):
        plan_migrations([0], [1], num_ranks=2, max_moves=1, sources="lightest")
