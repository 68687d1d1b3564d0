"""Migrations of running decode requests between ranks (``plan_migrations``).

Admission-time placement cannot undo what departures create: when long requests leave one rank
and short ones another, the ranks drift apart until new arrivals even them out, and with
heavy-tailed prompts they rarely do. Moving a few running requests (their KV cache) from one rank
to another restores the balance. :func:`plan_migrations` picks the moves greedily on the default
rule's objective

    F = sum_r (B_r / Bhat)^2 + (S_r / Shat)^2

(``B_r`` requests and ``S_r`` KV tokens of rank ``r``; ``Bhat``, ``Shat`` their means over all
ranks, which moves do not change). Moving a request of ``s`` KV tokens from rank ``a`` to rank
``b`` changes ``F`` by ``2(B_b - B_a + 1)/Bhat^2 + 2s(S_b - S_a + s)/Shat^2``; each step makes the
move with the most negative change, so a request with a large KV leaves a rank heavy in KV and a
short one a rank with many requests, as the admission rule would have placed them.

Balance is not the only reason to move: a request that fits no rank waits (a FIFO queue waits
behind it), although the ranks together often have room for it many times over. A long prompt
needs one rank with that much free KV, and a balanced pool has none: every rank is a little
full. :func:`plan_room` frees one rank for such a request with the fewest moves, each to the
rank the admission rule picks among the others.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_int_array, check_choice, check_int
from lbkit.decode import _kernels as K
from lbkit.decode._state import limits_iv, params
from lbkit.decode.policies import DEFAULT_POLICY, POLICY_CODES

__all__ = [
    "MIGRATION_SOURCES",
    "Migrations",
    "Room",
    "migration_objective",
    "plan_migrations",
    "plan_room",
]

#: Candidate requests of a balance move: every request, or those of the heaviest rank.
MIGRATION_SOURCES = ("all", "heaviest")


class Migrations(NamedTuple):
    """Moves chosen by :func:`plan_migrations`, in the order they were chosen.

    Attributes
    ----------
    request : ndarray of int64, shape (moves,)
        Index of each moved request in the input arrays (each at most once).
    source, target : ndarray of int64, shape (moves,)
        Rank the request leaves and the rank it goes to.
    objective_before, objective_after : float
        ``F`` of the module docstring before and after the moves.
    """

    request: np.ndarray
    source: np.ndarray
    target: np.ndarray
    objective_before: float
    objective_after: float


def migration_objective(num_requests: Any, kv_tokens: Any, /) -> float:
    """``F = sum_r (B_r/Bhat)^2 + (S_r/Shat)^2`` with ``Bhat``, ``Shat`` the means over ranks.

    A term whose mean is zero counts 0 (nothing to balance). ``num_ranks`` times 2 is the
    minimum, reached by equal ranks.

    Examples
    --------
    >>> migration_objective([2, 2], [100, 100]), migration_objective([3, 1], [100, 100])
    (4.0, 4.5)
    """
    b = np.asarray(num_requests, dtype=np.float64)
    s = np.asarray(kv_tokens, dtype=np.float64)
    out = 0.0
    for x in (b, s):
        mean = x.mean() if x.size else 0.0
        if mean > 0.0:
            out += float(((x / mean) ** 2).sum())
    return out


def _plan_migrations_iv(
    request_rank: Any,
    request_kv_tokens: Any,
    num_ranks: Any,
    max_moves: Any,
    eligible: Any,
    max_batch: Any,
    max_kv_tokens: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    n = check_int(num_ranks, "num_ranks", min_value=1)
    moves = check_int(max_moves, "max_moves", min_value=0)
    rank = as_int_array(request_rank, "request_rank", ndim=1, min_value=0, max_value=n - 1)
    kv = as_int_array(request_kv_tokens, "request_kv_tokens", shape=rank.shape, min_value=0)
    X = np.zeros((K.NUM_ROWS, n))
    X[K.ROW_B] = np.bincount(rank, minlength=n)
    X[K.ROW_S] = np.bincount(rank, weights=kv.astype(np.float64), minlength=n)
    limits_iv(X, max_batch, max_kv_tokens, eligible, "(num_ranks)")
    return rank.copy(), kv.astype(np.float64), X, moves


def plan_migrations(
    request_rank: Any,
    request_kv_tokens: Any,
    /,
    *,
    num_ranks: int,
    max_moves: int,
    eligible: Any = None,
    max_batch: Any = None,
    max_kv_tokens: Any = None,
    sources: str = "all",
) -> Migrations:
    """Moves of running decode requests that lower ``F`` (module docstring) most, greedily.

    Each step makes the single move with the most negative change of ``F`` (lowest request
    index, then lowest rank, among equals) among the candidates: every request with
    ``sources="all"``, the requests of the heaviest rank (largest ``(B_r/Bhat)^2 +
    (S_r/Shat)^2`` among ranks holding a request that may move, lowest index among equals)
    with ``sources="heaviest"``; a moved request stays put for the rest of the plan;
    steps stop after ``max_moves`` or when no move lowers ``F``. Moves only go to eligible ranks
    with room (``max_batch``, ``max_kv_tokens``); requests on ineligible ranks may leave them
    (a draining rank empties when that lowers ``F``).

    Parameters
    ----------
    request_rank : array_like of int, shape (requests,)
        Rank of each running request, in ``[0, num_ranks)``.
    request_kv_tokens : array_like of int, shape (requests,)
        KV tokens each request holds (>= 0): what a move transfers.
    num_ranks : int
        Decode ranks (>= 1).
    max_moves : int
        Most moves to make (>= 0).
    eligible : array_like of bool, shape (num_ranks,), optional
        False for ranks that may not receive requests.
    max_batch, max_kv_tokens : int or array_like of int, shape (num_ranks,), optional
        Capacities a receiving rank must stay within; ``None`` means no limit.
    sources : {"all", "heaviest"}, default "all"
        Candidate requests of each move (see above): ``"heaviest"`` costs ``O(requests +
        B_a * ranks)`` per move instead of ``O(requests * ranks)``.

    Returns
    -------
    Migrations

    Raises
    ------
    ValueError, TypeError
        A rank out of range, negative tokens, mismatched shapes, ``max_moves < 0``.

    Notes
    -----
    Runtime complexity: ``O(moves * requests * ranks)``, one numba call (64 ranks, 4,096
    requests, 4 moves: 1.9 ms in ``benchmarks/bench_decode.py``). Greedy, not optimal over
    several moves; the first move is the best single move (tested against brute force).

    Examples
    --------
    Rank 0 holds four short requests, rank 1 one long request: one short request moves to rank
    1 (few requests, though much KV); a second would only shift the imbalance:

    >>> m = plan_migrations([0, 0, 0, 0, 1], [100, 100, 100, 100, 5000], num_ranks=2,
    ...                     max_moves=4)
    >>> m.request.tolist(), m.source.tolist(), m.target.tolist()
    ([0], [0], [1])
    >>> round(m.objective_before, 3), round(m.objective_after, 3)
    (6.171, 5.66)
    """
    rank, kv, X, moves = _plan_migrations_iv(
        request_rank, request_kv_tokens, num_ranks, max_moves, eligible, max_batch, max_kv_tokens
    )
    check_choice(sources, "sources", MIGRATION_SOURCES)
    return plan_on(rank, kv, X, moves, sources == "heaviest")


def plan_on(
    rank: np.ndarray,
    kv: np.ndarray,
    X: np.ndarray,
    moves: int,
    heaviest: bool = False,
    objectives: bool = True,
) -> Migrations:
    """:func:`plan_migrations` on clean arrays: ``rank`` (int64) and ``kv`` (float64) per request
    (``rank`` becomes the ranks after the moves), ``X`` a state matrix of the kernels whose
    ledger rows agree with them (``ROW_B``/``ROW_S`` are updated; capacities and eligibility
    read). Without ``objectives`` the objectives are ``nan`` (the router path skips them)."""
    before = migration_objective(X[K.ROW_B], X[K.ROW_S]) if objectives else math.nan
    n_req = rank.shape[0]
    bhat = X[K.ROW_B].mean()
    shat = X[K.ROW_S].mean()
    out_req = np.empty(min(moves, n_req), dtype=np.int64)
    out_dst = np.empty_like(out_req)
    src = rank.copy()
    done = 0
    if n_req and moves:
        # A zero mean contributes nothing to F: any positive scale leaves its term at 0 change.
        done = K.migrate(
            X, rank, kv, np.zeros(n_req, dtype=np.bool_), bhat, shat if shat > 0 else 1.0,
            len(out_req), out_req, out_dst, heaviest,
        )  # fmt: skip
    req = out_req[:done]
    after = migration_objective(X[K.ROW_B], X[K.ROW_S]) if objectives else math.nan
    return Migrations(req, src[req], out_dst[:done].copy(), before, after)


class Room(NamedTuple):
    """Moves chosen by :func:`plan_room`, in order.

    Attributes
    ----------
    rank : int
        The rank freed for the request (when not ``complete``: the last rank tried; -1 when no
        eligible rank could ever hold it).
    request : ndarray of int64, shape (moves,)
        Index of each moved request in the input arrays.
    target : ndarray of int64, shape (moves,)
        Where each goes (its source is ``rank``).
    complete : bool
        Whether ``rank`` has room for the request after the moves (always when no move was
        needed). When False there are no moves.
    """

    rank: int
    request: np.ndarray
    target: np.ndarray
    complete: bool


#: Most moves :func:`plan_room` makes for one request by default.
ROOM_MAX_MOVES = 64
#: Ranks :func:`plan_room` tries to free, in increasing order of deficit, before giving up.
ROOM_SOURCES = 4


def plan_room(
    request_rank: Any,
    request_kv_tokens: Any,
    new_kv_tokens: int,
    /,
    *,
    num_ranks: int,
    policy: str = DEFAULT_POLICY,
    max_moves: int = ROOM_MAX_MOVES,
    grow_tokens: int = 0,
    eligible: Any = None,
    max_batch: Any = None,
    max_kv_tokens: Any = None,
) -> Room:
    """Moves of running requests that free one rank for a request of ``new_kv_tokens`` KV tokens.

    The ranks that could hold the request (eligible, capacity at least ``new_kv_tokens``, at
    least one batch slot) are tried in increasing order of KV deficit ``S + s + grow_tokens *
    (B + 1) - max_kv_tokens`` (then batch deficit, then index), at most ``ROOM_SOURCES`` of them;
    ``grow_tokens`` keeps room for that many steps of growth of the rank's requests. While a
    deficit remains, one of the rank's requests leaves: the smallest whose KV covers the
    deficit, else the largest (the fewest moves that cover it: no smaller set of its requests
    frees as much); each goes where ``policy`` places it among the other ranks (as
    :func:`~lbkit.decode.pick_rank` with ``cursor=0``), and one that fits nowhere is passed over.
    A rank that cannot be freed within ``max_moves`` keeps its requests and the next is tried.

    Parameters
    ----------
    request_rank : array_like of int, shape (requests,)
        Rank of each running request, in ``[0, num_ranks)``.
    request_kv_tokens : array_like of int, shape (requests,)
        KV tokens each request holds (>= 0).
    new_kv_tokens : int
        KV tokens of the request to make room for (>= 0).
    num_ranks : int
        Decode ranks (>= 1).
    policy : str, default ``DEFAULT_POLICY``
        Rule that picks each moved request's new rank (a key of :data:`~lbkit.decode.POLICIES`;
        ``"random"`` uses its keys of zero).
    max_moves : int, default ``ROOM_MAX_MOVES``
        Most moves (>= 0); a deficit not covered within them leaves ``complete`` False.
    grow_tokens : int, default 0
        Steps of growth kept free on the freed rank (>= 0).
    eligible : array_like of bool, shape (num_ranks,), optional
        False for ranks that may neither be freed nor receive requests.
    max_batch, max_kv_tokens : int or array_like of int, shape (num_ranks,), optional
        Capacities; ``None`` means no limit (then every rank has room and no move is needed).

    Returns
    -------
    Room

    Raises
    ------
    ValueError, TypeError
        A rank out of range, negative tokens, mismatched shapes, an unknown policy.

    Notes
    -----
    Runtime complexity: ``O(ROOM_SOURCES * (ranks + moves * (requests + ranks)))``, one numba
    call.

    Examples
    --------
    Two ranks of capacity 1,000, each 700 full: a request of 500 fits neither, though together
    they have 600 free. Rank 0 (the lower index of two equal deficits) sends away its smallest
    request that covers the deficit of 200:

    >>> r = plan_room([0, 0, 0, 1], [100, 250, 350, 700], 500, num_ranks=2, max_kv_tokens=1000)
    >>> r.rank, r.request.tolist(), r.target.tolist(), r.complete
    (0, [1], [1], True)
    """
    n = check_int(num_ranks, "num_ranks", min_value=1)
    rank = as_int_array(request_rank, "request_rank", ndim=1, min_value=0, max_value=n - 1)
    kv = as_int_array(request_kv_tokens, "request_kv_tokens", shape=rank.shape, min_value=0)
    s = check_int(new_kv_tokens, "new_kv_tokens", min_value=0)
    moves = check_int(max_moves, "max_moves", min_value=0)
    grow = check_int(grow_tokens, "grow_tokens", min_value=0)
    if policy not in POLICY_CODES:
        raise ValueError(f"policy: must be one of {', '.join(POLICY_CODES)}, got {policy!r}")
    X = np.zeros((K.NUM_ROWS, n))
    X[K.ROW_B] = np.bincount(rank, minlength=n)
    X[K.ROW_S] = np.bincount(rank, weights=kv.astype(np.float64), minlength=n)
    limits_iv(X, max_batch, max_kv_tokens, eligible, "(num_ranks)")
    return room_on(rank.copy(), kv.astype(np.float64), X, s, params(POLICY_CODES[policy],
                    "mean", None), grow, moves)  # fmt: skip


def room_on(
    rank: np.ndarray, kv: np.ndarray, X: np.ndarray, s: int, P: np.ndarray, grow: int, moves: int
) -> Room:
    """:func:`plan_room` on clean arrays (``rank`` and the ledger rows of ``X`` are updated with
    the moves when they free the rank)."""
    out_req = np.empty(moves, dtype=np.int64)
    out_dst = np.empty_like(out_req)
    X[K.ROW_KEY] = 0.0
    done, src, ok = K.make_room(X, rank, kv, float(s), P, float(grow), moves, ROOM_SOURCES,
                                out_req, out_dst)  # fmt: skip
    return Room(int(src), out_req[:done].copy(), out_dst[:done].copy(), bool(ok and src >= 0))
