"""numba kernels of the decode balancer (clean arrays only; see ``policies.py``).

Every kernel works on a *state matrix* ``X`` of shape ``(NUM_ROWS, ranks)``, float64, with rows

- ``ROW_B``: requests per rank, ``ROW_S``: KV tokens per rank (the ledger);
- ``ROW_CAP_B``, ``ROW_CAP_S``: maximum batch and KV tokens per rank (``inf`` = no limit);
- ``ROW_OK``: 1.0 for an eligible rank, 0.0 otherwise;
- ``ROW_PB``, ``ROW_PS``: requests and KV tokens used for *scoring* when look-ahead is on
  (``proj``); the ledger rows are used otherwise;
- ``ROW_KEY``: uniform random keys of the ``random`` policy.

One matrix keeps the call cheap (numba unboxes one array instead of eight). Counts and tokens
are integers held exactly in float64 (below 2**53). Plain loops that also run with
``NUMBA_DISABLE_JIT=1``. Tie-breaks: lexicographic on (primary score, secondary score), then the
lowest rank index wins.

A kernel returns a rank (>= 0) or a negative reason code ``-k`` (``reasons.REASONS[k]``).
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit

__all__ = [
    "COST",
    "LEAST_KV",
    "LEAST_REQUESTS",
    "MIN_MAX",
    "NUM_ROWS",
    "RANDOM",
    "ROUND_ROBIN",
    "ROW_B",
    "ROW_CAP_B",
    "ROW_CAP_S",
    "ROW_KEY",
    "ROW_OK",
    "ROW_PB",
    "ROW_PS",
    "ROW_S",
    "SUM_OF_SQUARES",
    "assign_sequence",
    "choose",
    "make_room",
    "migrate",
    "place",
    "score_means",
    "warmup",
]

ROW_B, ROW_S, ROW_CAP_B, ROW_CAP_S, ROW_OK, ROW_PB, ROW_PS, ROW_KEY = range(8)
NUM_ROWS = 8

SUM_OF_SQUARES, MIN_MAX, COST, ROUND_ROBIN, LEAST_REQUESTS, LEAST_KV, RANDOM = range(7)

# Parameter vector ``P`` of ``place`` and ``assign_sequence``:
# [policy code, capacity scale (0/1), cost a, cost b, cost k, combine max (0/1), look-ahead (0/1)]
P_CODE, P_CAPSCALE, P_A, P_B, P_K, P_CMAX, P_PROJ = range(7)
NUM_PARAMS = 7


@jit
def score_means(X, add_b, add_s, proj):
    """Mean scored requests and KV tokens over eligible ranks, after adding ``add_b, add_s``.

    Returns ``(bhat, shat)``; ``(0.0, 0.0)`` when no rank is eligible.
    """
    n = X.shape[1]
    rb = ROW_PB if proj else ROW_B  # the scored rows; +1 is their KV row
    m = 0
    sb = 0.0
    ss = 0.0
    for r in range(n):
        if X[ROW_OK, r] > 0.0:
            m += 1
            sb += X[rb, r]
            ss += X[rb + 1, r]
    if m == 0:
        return 0.0, 0.0
    return (sb + add_b) / m, (ss + add_s) / m


@jit
def choose(X, s, s_score, code, capscale, bhat, shat, ca, cb, ck, cmax, cursor, proj):
    """Rank for a request of ``s`` KV tokens (scored as ``s_score``), or ``-reason``.

    Feasible ranks: eligible, ``B + 1 <= cap_B`` and ``S + s <= cap_S``. Scores (lower wins;
    ``b, kv`` are the scored rows, ``Bh, Sh`` the normalisers: ``bhat, shat``, or a rank's finite
    positive capacity when ``capscale``):

    - sum of squares: ``(2b + 1)/Bh^2 + s'(2kv + s')/Sh^2``, the exact increase of
      ``(b/Bh)^2 + (kv/Sh)^2`` (the KV term is 0 when ``Sh == 0``);
    - min-max: ``max((b+1)/Bh, (kv+s')/Sh)``, then their sum;
    - cost: ``a + b_c(b+1) (+|max) k_c(kv+s')``, then ``b_c(b+1) + k_c(kv+s')``;
    - round robin: ``(r - cursor) mod n``; least requests: ``b``; least KV: ``kv``;
      random: ``X[ROW_KEY, r]``.
    """
    n = X.shape[1]
    rb = ROW_PB if proj else ROW_B  # the scored rows; +1 is their KV row
    if code == SUM_OF_SQUARES and not capscale:
        best = _choose_sos(X, s, s_score, bhat, shat, rb)
        if best >= 0:
            return best
        return _refusal(X, s)
    best = -1
    p1 = np.inf
    p2 = np.inf
    for r in range(n):
        capb = X[ROW_CAP_B, r]
        caps = X[ROW_CAP_S, r]
        if X[ROW_OK, r] <= 0.0 or X[ROW_B, r] + 1.0 > capb or X[ROW_S, r] + s > caps:
            continue  # out of service, or no room (see _refusal for the reason)
        b = X[rb, r]
        kv = X[rb + 1, r]
        q2 = 0.0
        if code == SUM_OF_SQUARES or code == MIN_MAX:
            bh = bhat
            sh = shat
            if capscale:
                if 0.0 < capb < np.inf:
                    bh = capb
                if 0.0 < caps < np.inf:
                    sh = caps
            if code == SUM_OF_SQUARES:
                q1 = (2.0 * b + 1.0) / (bh * bh)
                if sh > 0.0:
                    q1 += s_score * (2.0 * kv + s_score) / (sh * sh)
            else:
                x1 = (b + 1.0) / bh
                x2 = (kv + s_score) / sh if sh > 0.0 else 0.0
                q1 = x1 if x1 >= x2 else x2
                q2 = x1 + x2
        elif code == COST:
            t1 = cb * (b + 1.0)
            t2 = ck * (kv + s_score)
            if cmax:
                q1 = ca + (t1 if t1 >= t2 else t2)
            else:
                q1 = ca + t1 + t2
            q2 = t1 + t2
        elif code == ROUND_ROBIN:
            q1 = float((r - cursor + n) % n)
        elif code == LEAST_REQUESTS:
            q1 = b
        elif code == LEAST_KV:
            q1 = kv
        else:
            q1 = X[ROW_KEY, r]
        if q1 < p1 or (q1 == p1 and q2 < p2):
            best = r
            p1 = q1
            p2 = q2
    if best >= 0:
        return best
    return _refusal(X, s)


@jit
def _choose_sos(X, s, s_score, bhat, shat, rb):
    """The default policy with common normalisers: ``argmin b wB + s' kv wS``.

    Equal to the argmin of the full increase ``(2b + 1) wB + s'(2kv + s') wS`` (half of it,
    less the terms that do not depend on the rank); ties may differ only by rounding.
    """
    n = X.shape[1]
    if bhat <= 0.0:  # no eligible rank
        return -1
    wb = 1.0 / (bhat * bhat)
    ws = 1.0 / (shat * shat) if shat > 0.0 else 0.0
    ws2 = s_score * ws  # half the increase, without the terms common to every rank
    best = -1
    p1 = np.inf
    for r in range(n):
        if (
            X[ROW_OK, r] > 0.0
            and X[ROW_B, r] + 1.0 <= X[ROW_CAP_B, r]
            and X[ROW_S, r] + s <= X[ROW_CAP_S, r]
        ):
            q1 = X[rb, r] * wb + X[rb + 1, r] * ws2
            if q1 < p1:
                best = r
                p1 = q1
    return best


@jit
def _refusal(X, s):
    """Reason code (negative) of a request that fits no rank; see ``reasons``."""
    n = X.shape[1]
    n_ok = 0
    n_len = 0
    n_broom = 0
    n_kroom = 0
    for r in range(n):
        if X[ROW_OK, r] <= 0.0:
            continue
        n_ok += 1
        if s > X[ROW_CAP_S, r]:
            continue
        n_len += 1
        if X[ROW_B, r] + 1.0 <= X[ROW_CAP_B, r]:
            n_broom += 1
        if X[ROW_S, r] + s <= X[ROW_CAP_S, r]:
            n_kroom += 1
    if n_ok == 0:
        return -1
    if n_len == 0:
        return -2
    if n_broom == 0:
        return -3
    if n_kroom == 0:
        return -4
    return -5


@jit
def place(X, slots, P, slot, s, s_score, add_pb, add_ps, expect, order, cursor):
    """Choose a rank for one request and record it (the balancer's admission hot path).

    Normalisers: means over eligible ranks including the new request (``P[P_CAPSCALE]`` switches
    to finite capacities). On success the ledger rows (and the scored rows by ``add_pb,
    add_ps`` under look-ahead) grow, and column ``slot`` of ``slots`` (int64, rows rank, KV
    tokens, generated tokens, expected output, admission order) is written. Returns the rank or
    ``-reason``.
    """
    proj = P[P_PROJ] > 0.0
    bhat, shat = score_means(X, 1.0, s_score, proj)
    r = choose(
        X, float(s), float(s_score), int(P[P_CODE]), P[P_CAPSCALE] > 0.0, bhat, shat,
        P[P_A], P[P_B], P[P_K], P[P_CMAX] > 0.0, cursor, proj,
    )  # fmt: skip
    if r >= 0:
        X[ROW_B, r] += 1.0
        X[ROW_S, r] += s
        if proj:
            X[ROW_PB, r] += add_pb
            X[ROW_PS, r] += add_ps
        slots[0, slot] = r
        slots[1, slot] = s
        slots[2, slot] = 0
        slots[3, slot] = expect
        slots[4, slot] = order
    return r


@jit
def assign_sequence(X, kv, order, P, bhat, shat, cursor, keys, out):
    """Place requests ``order[0], order[1], ...`` (KV tokens ``kv``) one after another.

    Fixed normalisers ``bhat, shat`` for the whole sequence. Writes each request's rank (or
    ``-reason``) into ``out`` (indexed like ``kv``), updates the ledger rows of ``X`` and returns
    the round-robin cursor after the last placement. ``keys`` (shape ``(len(order), ranks)``)
    are the random policy's keys, one row per placement.
    """
    n = X.shape[1]
    code = int(P[P_CODE])
    for t in range(order.shape[0]):
        i = order[t]
        s = kv[i]
        if code == RANDOM:
            for r in range(n):
                X[ROW_KEY, r] = keys[t, r]
        r = choose(
            X,
            s,
            s,
            code,
            P[P_CAPSCALE] > 0.0,
            bhat,
            shat,
            P[P_A],
            P[P_B],
            P[P_K],
            P[P_CMAX] > 0.0,
            cursor,
            False,
        )
        out[i] = r
        if r >= 0:
            X[ROW_B, r] += 1.0
            X[ROW_S, r] += s
            cursor = (r + 1) % n
    return cursor


@jit
def _shift(X, a, b, s):
    """Move one request of ``s`` KV tokens from rank ``a`` to rank ``b`` in the ledger rows."""
    X[ROW_B, a] -= 1.0
    X[ROW_S, a] -= s
    X[ROW_B, b] += 1.0
    X[ROW_S, b] += s


@jit
def migrate(X, rank, kv, moved, bhat, shat, max_moves, out_req, out_dst, heaviest=False):
    """Greedy migrations (see ``migration.plan_migrations``); returns how many were made.

    ``rank`` (int64) and ``kv`` (float64): rank and KV tokens of each request; ``rank`` and the
    ledger rows ``ROW_B``/``ROW_S`` of ``X`` are updated in place. ``moved`` (bool) marks requests
    that may not move (each moves at most once). Each move is the (request, rank) pair with the
    most negative change ``2(B_b - B_a + 1)/bhat^2 + 2s(S_b - S_a + s)/shat^2`` of
    ``sum_r (B_r/bhat)^2 + (S_r/shat)^2`` among eligible ranks with room (lowest request, then
    rank, among equals); none when no change is negative. With ``heaviest`` only the requests
    of one rank are candidates at each move: the rank with the largest term
    ``(B_r/bhat)^2 + (S_r/shat)^2`` among those holding a movable request (lowest index among
    equals), which makes a move ``O(requests + B_a * ranks)`` instead of ``O(requests * ranks)``.
    """
    n = X.shape[1]
    m = rank.shape[0]
    ib = 1.0 / (bhat * bhat)
    isq = 1.0 / (shat * shat)
    done = 0
    has = np.zeros(n, dtype=np.bool_)
    while done < max_moves:
        best = 0.0
        bi = -1
        bb = -1
        src = -1
        if heaviest:
            for r in range(n):
                has[r] = False
            for i in range(m):
                if not moved[i]:
                    has[rank[i]] = True
            top = -1.0
            for r in range(n):
                if has[r]:
                    f = X[ROW_B, r] * X[ROW_B, r] * ib + X[ROW_S, r] * X[ROW_S, r] * isq
                    if f > top:
                        top = f
                        src = r
        for i in range(m):
            if moved[i] or (heaviest and rank[i] != src):
                continue
            a = rank[i]
            s = kv[i]
            base_b = X[ROW_B, a]
            base_s = X[ROW_S, a]
            for b in range(n):
                if b == a or X[ROW_OK, b] <= 0.0:
                    continue
                if X[ROW_B, b] + 1.0 > X[ROW_CAP_B, b] or X[ROW_S, b] + s > X[ROW_CAP_S, b]:
                    continue
                d = (
                    2.0 * (X[ROW_B, b] - base_b + 1.0) * ib
                    + 2.0 * s * (X[ROW_S, b] - base_s + s) * isq
                )
                if d < best:
                    best = d
                    bi = i
                    bb = b
        if bi < 0 or best > -1e-12:
            break
        a = rank[bi]
        _shift(X, a, bb, kv[bi])
        rank[bi] = bb
        moved[bi] = True
        out_req[done] = bi
        out_dst[done] = bb
        done += 1
    return done


@jit
def _room_source(X, s, grow, tried):
    """The untried eligible rank able to hold ``s`` with the smallest (KV deficit, batch
    deficit, index); returns ``(rank, kv deficit, batch deficit)``, rank -1 when none is left."""
    n = X.shape[1]
    src = -1
    best_d = np.inf
    best_e = np.inf
    for r in range(n):
        if tried[r] or X[ROW_OK, r] <= 0.0 or X[ROW_CAP_S, r] < s or X[ROW_CAP_B, r] < 1.0:
            continue
        d = X[ROW_S, r] + s + grow * (X[ROW_B, r] + 1.0) - X[ROW_CAP_S, r]
        e = X[ROW_B, r] + 1.0 - X[ROW_CAP_B, r]
        if d < best_d or (d == best_d and e < best_e):
            src = r
            best_d = d
            best_e = e
    return src, best_d, best_e


@jit
def _room_pick(on, k, kv, skip, d):
    """The request of ``on[:k]`` (the source's, ascending) that leaves next: the smallest KV
    covering ``d``, else the largest (the smallest when ``d <= 0``); lowest index among equals;
    -1 when none is left."""
    pick = -1
    for j in range(k):
        i = on[j]
        if skip[i]:
            continue
        if pick < 0:
            pick = i
            continue
        a = kv[i]
        b = kv[pick]
        if d > 0.0:
            better = (d <= a < b) if b >= d else a > b
        else:
            better = a < b
        if better:
            pick = i
    return pick


@jit
def make_room(X, rank, kv, s, P, grow, max_moves, tries, out_req, out_dst):
    """Moves that free one rank for a request of ``s`` KV tokens (see ``migration.plan_room``).

    Sources are tried in increasing order of (KV deficit ``S + s + grow*(B + 1) - cap_S``,
    batch deficit ``B + 1 - cap_B``, index) among the eligible ranks able to hold ``s``
    (``cap_S >= s``, ``cap_B >= 1``), at most ``tries`` of them. On a source, while a deficit
    remains, the request picked by ``_room_pick`` leaves; a move takes ``kv + grow`` off the KV
    deficit and one off the batch deficit. Its target is ``choose`` of policy ``P`` (cursor 0,
    the ledger rows) over the other ranks; a request that fits nowhere is passed over. A source
    whose deficit cannot be covered within ``max_moves`` moves is rolled back and the next one
    tried. ``rank`` and the ledger rows of ``X`` are updated in place with the moves of the
    source that succeeded. Returns ``(moves, source, complete)``: ``source`` is the rank freed
    (the last one tried when none could be; -1 when no rank can hold ``s``).
    """
    n = X.shape[1]
    m = rank.shape[0]
    tried = np.zeros(n, dtype=np.bool_)
    skip = np.zeros(m, dtype=np.bool_)
    on = np.empty(m, dtype=np.int64)
    code = int(P[P_CODE])
    last = -1
    for _ in range(tries):
        src, d, e = _room_source(X, s, grow, tried)
        if src < 0:
            break
        last = src
        tried[src] = True
        k_on = 0
        for i in range(m):
            skip[i] = False
            if rank[i] == src:
                on[k_on] = i
                k_on += 1
        X[ROW_OK, src] = 0.0  # no move goes back to the source
        done = 0
        ok = True
        while d > 0.0 or e > 0.0:
            pick = _room_pick(on, k_on, kv, skip, d)
            if done >= max_moves or pick < 0:
                ok = False
                break
            k = kv[pick]
            bhat, shat = score_means(X, 1.0, k, False)
            g = choose(
                X,
                k,
                k,
                code,
                P[P_CAPSCALE] > 0.0,
                bhat,
                shat,
                P[P_A],
                P[P_B],
                P[P_K],
                P[P_CMAX] > 0.0,
                0,
                False,
            )
            skip[pick] = True
            if g < 0:
                continue
            _shift(X, src, g, k)
            rank[pick] = g
            out_req[done] = pick
            out_dst[done] = g
            done += 1
            d -= k + grow
            e -= 1.0
        X[ROW_OK, src] = 1.0
        if ok:
            return done, src, True
        for t in range(done - 1, -1, -1):  # roll back this source's moves
            i = out_req[t]
            g = out_dst[t]
            _shift(X, g, src, kv[i])
            rank[i] = src
    return 0, last, False


def warmup() -> None:
    """Compile every kernel of this module on tiny inputs."""
    X = np.zeros((NUM_ROWS, 3))
    X[ROW_CAP_B : ROW_CAP_S + 1] = np.inf
    X[ROW_OK] = 1.0
    slots = np.zeros((5, 2), dtype=np.int64)
    P = np.zeros(NUM_PARAMS)
    place(X, slots, P, 0, 5, 5, 0.0, 0.0, -1, 0, 0)
    kv = np.array([4.0, 1.0])
    out = np.zeros(2, dtype=np.int64)
    assign_sequence(X, kv, np.array([0, 1]), P, 1.0, 1.0, 0, np.zeros((2, 3)), out)
    X = np.zeros((NUM_ROWS, 2))
    X[ROW_CAP_B : ROW_CAP_S + 1] = np.inf
    X[ROW_OK] = 1.0
    X[ROW_B, 0], X[ROW_S, 0] = 2.0, 5.0
    rank = np.zeros(2, dtype=np.int64)
    migrate(X, rank, kv, np.zeros(2, dtype=np.bool_), 1.0, 2.5, 1, out, out.copy())
    X[ROW_CAP_S] = 6.0
    make_room(X, np.zeros(2, dtype=np.int64), kv, 4.0, P, 0.0, 2, 2, out, out.copy())
