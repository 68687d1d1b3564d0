"""The decode kernels against brute-force oracles written from their docstrings.

``test_kernels.py`` checks JIT parity (compiled == Python); these check what the kernels
compute: ``choose`` against exact (``Fraction``) scores of every feasible rank, ``migrate``
against the change of ``sum_r (B_r/bhat)^2 + (S_r/shat)^2`` of every single move, the refusal
codes, ``place``'s bookkeeping and ``make_room``'s choices on cases worked out by hand.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from lbkit.decode import _kernels as K
from lbkit.decode.policies import POLICIES, POLICY_CODES, pick_rank
from lbkit.decode.reasons import REASONS

INF = np.inf


def _state(b, s, cap_b=None, cap_s=None, ok=None, pb=None, ps=None, key=None):
    n = len(b)
    X = np.zeros((K.NUM_ROWS, n))
    X[K.ROW_B], X[K.ROW_S] = b, s
    X[K.ROW_CAP_B] = INF if cap_b is None else cap_b
    X[K.ROW_CAP_S] = INF if cap_s is None else cap_s
    X[K.ROW_OK] = 1.0 if ok is None else ok
    X[K.ROW_PB] = b if pb is None else pb
    X[K.ROW_PS] = s if ps is None else ps
    X[K.ROW_KEY] = 0.0 if key is None else key
    return X


def _oracle_scores(X, s, s_score, code, capscale, bhat, shat, ca, cb, ck, cmax, cursor, proj):
    """{rank: (primary, secondary)} of the feasible ranks, exactly, from choose's docstring."""
    n = X.shape[1]
    F = Fraction
    out = {}
    for r in range(n):
        if not (X[K.ROW_OK, r] > 0 and X[K.ROW_B, r] + 1 <= X[K.ROW_CAP_B, r]
                and X[K.ROW_S, r] + s <= X[K.ROW_CAP_S, r]):  # fmt: skip
            continue
        b = F(X[K.ROW_PB if proj else K.ROW_B, r])
        kv = F(X[K.ROW_PS if proj else K.ROW_S, r])
        sp = F(s_score)
        bh, sh = F(bhat), F(shat)
        if capscale:
            if 0 < X[K.ROW_CAP_B, r] < INF:
                bh = F(X[K.ROW_CAP_B, r])
            if 0 < X[K.ROW_CAP_S, r] < INF:
                sh = F(X[K.ROW_CAP_S, r])
        if code == K.SUM_OF_SQUARES:
            # the exact increase of (b/Bh)^2 + (kv/Sh)^2
            inc = ((b + 1) ** 2 - b**2) / bh**2
            if sh > 0:
                inc += ((kv + sp) ** 2 - kv**2) / sh**2
            out[r] = (inc, F(0))
        elif code == K.MIN_MAX:
            x1 = (b + 1) / bh
            x2 = (kv + sp) / sh if sh > 0 else F(0)
            out[r] = (max(x1, x2), x1 + x2)
        elif code == K.COST:
            t1, t2 = F(cb) * (b + 1), F(ck) * (kv + sp)
            out[r] = (F(ca) + (max(t1, t2) if cmax else t1 + t2), t1 + t2)
        elif code == K.ROUND_ROBIN:
            out[r] = (F((r - cursor) % n), F(0))
        elif code == K.LEAST_REQUESTS:
            out[r] = (b, F(0))
        elif code == K.LEAST_KV:
            out[r] = (kv, F(0))
        else:
            out[r] = (F(X[K.ROW_KEY, r]), F(0))
    return out


def _close(x, y):
    return abs(x - y) <= Fraction(1, 10**9) * max(abs(x), abs(y), Fraction(1))


def _check_choice(got, scores):
    assert got >= 0, "a feasible rank exists"
    assert got in scores
    best = min(scores, key=lambda r: (scores[r], r))
    # the kernel's choice is lexicographically minimal up to rounding; exact when unique
    p1, p2 = scores[best]
    q1, q2 = scores[got]
    assert _close(q1, p1)
    if not any(r != best and _close(scores[r][0], p1) for r in scores):
        assert got == best
    elif _close(q1, p1) and not _close(q2, p2):
        raise AssertionError(f"secondary score of rank {got} is not the smallest")


def _random_state(rng, n):
    b = rng.integers(0, 6, n).astype(float)
    s = rng.integers(0, 40, n).astype(float) * 8
    cap_b = np.where(rng.random(n) < 0.3, rng.integers(1, 8, n), INF)
    cap_s = np.where(rng.random(n) < 0.3, rng.integers(0, 60, n) * 8, INF)
    ok = (rng.random(n) < 0.85).astype(float)
    pb = b + rng.integers(0, 3, n)
    ps = s + rng.integers(0, 50, n)
    key = rng.random(n)
    return _state(b, s, cap_b, cap_s, ok, pb, ps, key)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_choose_matches_exact_scores(policy):
    code = POLICY_CODES[policy]
    rng = np.random.default_rng(1000 + code)
    for _ in range(150):
        n = int(rng.integers(1, 7))
        X = _random_state(rng, n)
        s = float(rng.integers(0, 30) * 8)
        proj = bool(rng.random() < 0.5)
        capscale = bool(rng.random() < 0.5)
        cmax = bool(rng.random() < 0.5)
        cursor = int(rng.integers(0, n))
        ca, cb, ck = 0.5, float(rng.integers(1, 4)), float(rng.integers(1, 4)) / 64
        s_score = s + float(rng.integers(0, 3))
        bhat, shat = K.score_means(X, 1.0, s_score, proj)
        args = (X, s, s_score, code, capscale, bhat, shat, ca, cb, ck, cmax, cursor, proj)
        got = K.choose(*args)
        scores = _oracle_scores(*args)
        if scores:
            _check_choice(got, scores)
        else:
            assert got < 0


def test_score_means_over_eligible_ranks():
    X = _state([1, 3, 8], [10, 30, 80], ok=[1, 1, 0], pb=[2, 4, 9], ps=[20, 40, 90])
    assert K.score_means(X, 1.0, 6.0, False) == (2.5, 23.0)  # (1+3+1)/2, (10+30+6)/2
    assert K.score_means(X, 0.0, 0.0, True) == (3.0, 30.0)
    assert K.score_means(_state([1], [1], ok=[0]), 1.0, 1.0, False) == (0.0, 0.0)


def test_capacity_scale_uses_a_batch_capacity_of_one():
    # rank 0: cap_B 1 (normaliser 1: score 1); rank 1: cap_B inf, normaliser bhat = 4: 1/4
    X = _state([0, 0], [0, 0], cap_b=[1, INF])
    assert K.choose(X, 0.0, 0.0, K.MIN_MAX, True, 4.0, 0.0, 0, 0, 0, False, 0, False) == 1
    # both finite: the emptier relative to its capacity wins
    X = _state([1, 4], [0, 0], cap_b=[2, 10])
    assert K.choose(X, 0.0, 0.0, K.SUM_OF_SQUARES, True, 1.0, 0.0, 0, 0, 0, False, 0, False) == 1
    # an infinite capacity keeps the mean normaliser (inf would score every rank 0)
    X = _state([1, 0], [0, 0], cap_b=[INF, INF])
    assert K.choose(X, 0.0, 0.0, K.SUM_OF_SQUARES, True, 2.0, 0.0, 0, 0, 0, False, 0, False) == 1


@pytest.mark.parametrize(
    ("X", "s", "code"),
    [
        (_state([0, 0], [0, 0], ok=[0, 0]), 1.0, 1),  # no eligible rank
        (_state([0, 0], [0, 0], cap_s=[5, 9], ok=[1, 1]), 10.0, 2),  # too long for every rank
        (_state([2, 3], [0, 0], cap_b=[2, 3]), 1.0, 3),  # every batch full
        (_state([2, 0], [0, 8], cap_b=[2, 9], cap_s=[99, 10]), 4.0, 5),  # full, mixed reasons
        (_state([0, 0], [0, 0], cap_s=[5, 20], ok=[1, 0]), 10.0, 2),  # ineligible rank ignored
    ],
)
def test_refusal_reasons(X, s, code):
    for policy in (K.SUM_OF_SQUARES, K.MIN_MAX, K.LEAST_KV):
        bhat, shat = K.score_means(X, 1.0, s, False)
        got = K.choose(X, s, s, policy, False, bhat, shat, 0, 1, 1, False, 0, False)
        assert got == -code, REASONS[code]


def test_place_records_the_request():
    X = _state([3, 1], [30, 10], pb=[5, 1], ps=[50, 10])
    slots = np.full((5, 3), -7, dtype=np.int64)
    P = np.zeros(K.NUM_PARAMS)
    P[K.P_CODE] = K.LEAST_REQUESTS
    P[K.P_PROJ] = 1.0
    r = K.place(X, slots, P, 2, 6, 9, 2.0, 11.0, 40, 17, 0)
    assert r == 1
    assert slots[:, 2].tolist() == [1, 6, 0, 40, 17]
    assert (slots[:, :2] == -7).all()
    assert X[K.ROW_B].tolist() == [3, 2] and X[K.ROW_S].tolist() == [30, 16]
    assert X[K.ROW_PB].tolist() == [5, 3] and X[K.ROW_PS].tolist() == [50, 21]
    P[K.P_PROJ] = 0.0  # without look-ahead the scored rows stay
    K.place(X, slots, P, 0, 1, 1, 2.0, 11.0, 1, 1, 0)
    assert X[K.ROW_PB].tolist() == [5, 3] and X[K.ROW_PS].tolist() == [50, 21]


def test_assign_sequence_round_robin_cursor():
    X = _state([0, 0, 0], [0, 0, 0], cap_b=[9, 0, 9])
    P = np.zeros(K.NUM_PARAMS)
    P[K.P_CODE] = K.ROUND_ROBIN
    out = np.zeros(4, dtype=np.int64)
    cur = K.assign_sequence(X, np.ones(4), np.arange(4), P, 1.0, 1.0, 1, np.zeros((4, 3)), out)
    # from cursor 1: rank 1 is full -> 2, then 0, 2, 0; the cursor follows the last rank
    assert out.tolist() == [2, 0, 2, 0]
    assert cur == 1
    assert X[K.ROW_B].tolist() == [2, 0, 2]


def _objective(B, S, bhat, shat):
    return sum(Fraction(b) ** 2 / Fraction(bhat) ** 2 + Fraction(s) ** 2 / Fraction(shat) ** 2
               for b, s in zip(B, S, strict=True))  # fmt: skip


def _oracle_migrate(X, rank, kv, moved, bhat, shat, max_moves, heaviest):
    B, S = X[K.ROW_B].copy(), X[K.ROW_S].copy()
    rank, moved = rank.copy(), moved.copy()
    n, moves = X.shape[1], []
    while len(moves) < max_moves:
        cands = [i for i in range(len(rank)) if not moved[i]]
        if heaviest and cands:
            holders = sorted({int(rank[i]) for i in cands})
            f = {r: Fraction(B[r]) ** 2 / Fraction(bhat) ** 2
                 + Fraction(S[r]) ** 2 / Fraction(shat) ** 2 for r in holders}  # fmt: skip
            src = min(holders, key=lambda r: (-f[r], r))
            cands = [i for i in cands if rank[i] == src]
        before = _objective(B, S, bhat, shat)
        best = None
        for i in cands:
            a = int(rank[i])
            for b in range(n):
                if b == a or X[K.ROW_OK, b] <= 0:
                    continue
                if B[b] + 1 > X[K.ROW_CAP_B, b] or S[b] + kv[i] > X[K.ROW_CAP_S, b]:
                    continue
                B2, S2 = B.copy(), S.copy()
                B2[a] -= 1
                S2[a] -= kv[i]
                B2[b] += 1
                S2[b] += kv[i]
                d = _objective(B2, S2, bhat, shat) - before
                if best is None or d < best[0]:
                    best = (d, i, b)
        if best is None or best[0] > Fraction(-1, 10**12):
            break
        _, i, b = best
        a = int(rank[i])
        B[a] -= 1
        S[a] -= kv[i]
        B[b] += 1
        S[b] += kv[i]
        rank[i] = b
        moved[i] = True
        moves.append((i, b))
    return moves, rank, B, S


@pytest.mark.parametrize("heaviest", [False, True])
def test_migrate_matches_the_objective_oracle(heaviest):
    rng = np.random.default_rng(7 + heaviest)
    for _ in range(60):
        n = int(rng.integers(2, 5))
        m = int(rng.integers(1, 9))
        rank = rng.integers(0, n, m).astype(np.int64)
        kv = (rng.integers(0, 6, m) * 4).astype(float)
        B = np.bincount(rank, minlength=n).astype(float)
        S = np.bincount(rank, weights=kv, minlength=n)
        cap_b = np.where(rng.random(n) < 0.3, B + rng.integers(0, 2, n), INF)
        X = _state(B, S, cap_b=cap_b, ok=(rng.random(n) < 0.9).astype(float))
        moved = rng.random(m) < 0.2
        bhat = float(2 ** rng.integers(0, 3))  # powers of two: every float step is exact
        shat = float(2 ** rng.integers(1, 5))
        max_moves = int(rng.integers(1, 5))
        want, want_rank, want_b, want_s = _oracle_migrate(
            X, rank, kv, moved, bhat, shat, max_moves, heaviest
        )
        out_req = np.full(m, -1, dtype=np.int64)
        out_dst = np.full(m, -1, dtype=np.int64)
        r2, mv2 = rank.copy(), moved.copy()
        done = K.migrate(X, r2, kv, mv2, bhat, shat, max_moves, out_req, out_dst, heaviest)
        assert list(zip(out_req[:done].tolist(), out_dst[:done].tolist(), strict=True)) == want
        assert r2.tolist() == want_rank.tolist()
        assert X[K.ROW_B].tolist() == want_b.tolist() and X[K.ROW_S].tolist() == want_s.tolist()
        assert mv2.sum() == moved.sum() + done


def test_migrate_ignores_a_negligible_gain():
    # moving the empty request from rank 0 (2 requests) to rank 1 (0) changes the objective by
    # 2 * (0 - 2 + 1) / bhat^2 = -2e-14: below the 1e-12 threshold, no move
    X = _state([2, 0], [0, 0])
    out = np.zeros(2, dtype=np.int64)
    args = (np.zeros(2, dtype=np.int64), np.zeros(2), np.zeros(2, dtype=np.bool_), 1e7, 1.0, 2)
    assert K.migrate(X, *args, out, out.copy(), False) == 0
    X = _state([2, 0], [0, 0])
    assert K.migrate(X, np.zeros(2, dtype=np.int64), np.zeros(2), np.zeros(2, dtype=np.bool_),
                     1.0, 1.0, 2, out, out.copy(), False) == 1  # fmt: skip


def test_migrate_heaviest_with_large_normalisers():
    # every rank's term (B/bhat)^2 + (S/shat)^2 is far below 1: the heaviest rank is still found
    X = _state([3, 0], [30, 0])
    rank = np.zeros(3, dtype=np.int64)
    out = np.zeros(3, dtype=np.int64)
    dst = np.zeros(3, dtype=np.int64)
    done = K.migrate(X, rank, np.full(3, 10.0), np.zeros(3, dtype=np.bool_), 100.0, 1000.0, 1,
                     out, dst, True)  # fmt: skip
    assert done == 1 and dst[0] == 1


def test_room_pick_rules():
    on = np.array([0, 1, 2, 3], dtype=np.int64)
    kv = np.array([5.0, 8.0, 8.0, 3.0])
    skip = np.zeros(4, dtype=np.bool_)
    assert K._room_pick(on, 4, kv, skip, 6.0) == 1  # smallest covering 6; lowest of equals
    assert K._room_pick(on, 4, kv, skip, 9.0) == 1  # none covers: the largest, lowest index
    assert K._room_pick(on, 4, kv, skip, 0.0) == 3  # no KV deficit: the smallest
    assert K._room_pick(on, 4, kv, skip, 4.0) == 0
    skip[1] = True
    assert K._room_pick(on, 4, kv, skip, 6.0) == 2
    assert K._room_pick(on, 0, kv, skip, 6.0) == -1


def test_round_robin_default_cursor_and_bounds():
    assert POLICIES["round_robin"]([0, 0, 0], [0, 0, 0], 1).rank == 0
    assert POLICIES["round_robin"]([0, 0, 0], [0, 0, 0], 1, cursor=2).rank == 2
    with pytest.raises(ValueError, match="cursor"):
        POLICIES["round_robin"]([0, 0, 0], [0, 0, 0], 1, cursor=-1)
    with pytest.raises(ValueError, match="cursor"):
        POLICIES["round_robin"]([0, 0, 0], [0, 0, 0], 1, cursor=3)
    assert pick_rank([0, 0], [0, 0], 1, policy="round_robin", cursor=1).rank == 1
