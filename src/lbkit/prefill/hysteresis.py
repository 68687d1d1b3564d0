"""Hysteresis of engine re-allocation: which engines to move this round, if any.

Re-planning from scratch every round would move engines back and forth on noise; each move costs
a drain. :func:`rebalance` takes the current homes of the engines and the new demand and moves
engines towards the ideal allocation only when that pays:

1. **Deadband**: act only if the ideal allocation's bottleneck is below the current one by more
   than the relative ``deadband`` (``ideal < current * (1 - deadband)``).
2. **At most** ``max_moves`` engines per round, one at a time: the receiver is the bucket below
   its ideal count with the largest ``D_j / s_j`` (infinite for a non-empty bucket without an
   engine), the donor the bucket above its ideal count that suffers least (smallest
   ``D_j / (s_j - 1)``), lowest index on ties. Each move goes from a surplus to a deficit bucket,
   so the allocation converges to the ideal over rounds and, under Adams' method, no move raises
   the bottleneck.
3. **Dwell**: an engine that moved less than ``min_dwell_s`` ago does not move again.
4. **Never the last engine** of a non-empty bucket (demand > 0). Adams' ideal gives every
   non-empty bucket an engine, so this only binds when there are fewer engines than non-empty
   buckets (or under another method): then the pool may stay short of the ideal grouping.

``force=True`` skips the deadband test (1), e.g. for the first re-plan after a cold start.

Among the donor's movable engines the one with the least ``engine_load`` moves (it drains
fastest), lowest engine index on ties.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, as_int_array, check_int, check_real, to_numpy
from lbkit.prefill.apportion import DEFAULT_METHOD, METHODS, Allocation, bottleneck_unchecked

__all__ = ["Move", "Rebalance", "rebalance"]


class Move(NamedTuple):
    """One engine changing bucket."""

    engine: int
    from_bucket: int
    to_bucket: int


class Rebalance(NamedTuple):
    """Result of :func:`rebalance`.

    Attributes
    ----------
    engines : ndarray of int64, shape (num_buckets,)
        Engines per bucket after this round's moves (the target of this round).
    moves : tuple of Move
        The moves, in order.
    ideal : Allocation
        The unconstrained allocation of the in-service engines.
    bottleneck_before, bottleneck_after : float
        Bottleneck (demand per engine of the busiest group) before and after the moves.
    """

    engines: np.ndarray
    moves: tuple[Move, ...]
    ideal: Allocation
    bottleneck_before: float
    bottleneck_after: float


def _times_iv(value: Any, name: str, n: int) -> np.ndarray:
    if value is None:
        return np.full(n, -np.inf)
    arr = to_numpy(value, name)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name}: must hold real numbers, got dtype {arr.dtype}")
    arr = np.asarray(arr, dtype=np.float64)
    if arr.shape != (n,):
        raise ValueError(f"{name}: must have shape ({n},), got {arr.shape}")
    if np.isnan(arr).any() or (arr == np.inf).any():
        raise ValueError(f"{name}: must be finite or -inf (never moved)")
    return arr


def _rebalance_iv(
    engine_bucket, demand, now_s, last_move_s, movable, engine_load, deadband, max_moves,
    min_dwell_s,
):  # fmt: skip
    d = as_float_array(demand, "demand", ndim=1, nonnegative=True, allow_empty=False)
    home = as_int_array(engine_bucket, "engine_bucket", ndim=1, min_value=-1)
    if home.size and home.max() >= d.shape[0]:
        raise ValueError(
            f"engine_bucket: entries must be < num_buckets ({d.shape[0]}), got {int(home.max())}"
        )
    n = home.shape[0]
    now = check_real(now_s, "now_s")
    last = _times_iv(last_move_s, "last_move_s", n)
    if movable is None:
        mov = np.ones(n, dtype=bool)
    else:
        mov = np.asarray(to_numpy(movable, "movable"), dtype=bool)
        if mov.shape != (n,):
            raise ValueError(f"movable: must have shape ({n},), got {mov.shape}")
    load = (
        np.zeros(n)
        if engine_load is None
        else as_float_array(engine_load, "engine_load", shape=(n,), nonnegative=True)
    )
    band = check_real(deadband, "deadband", min_value=0.0, max_value=1.0)
    moves = check_int(max_moves, "max_moves", min_value=0)
    dwell = check_real(min_dwell_s, "min_dwell_s", min_value=0.0)
    return d, home, now, last, mov, load, band, moves, dwell


def rebalance(
    engine_bucket: Any,
    demand: Any,
    /,
    *,
    now_s: float,
    last_move_s: Any = None,
    movable: Any = None,
    engine_load: Any = None,
    deadband: float = 0.1,
    max_moves: int = 2,
    min_dwell_s: float = 60.0,
    method: str = DEFAULT_METHOD,
    min_engines: Any = None,
    max_engines: Any = None,
    force: bool = False,
) -> Rebalance:
    """One hysteresis step: the engine moves that bring the pool towards the ideal allocation.

    Parameters
    ----------
    engine_bucket : array_like of int, shape (num_engines,)
        Home bucket of each engine, ``-1`` for an engine out of service (neither counted nor
        moved).
    demand : array_like of float, shape (num_buckets,)
        Demand per bucket (quota seconds per second).
    now_s : float
        Current time, seconds.
    last_move_s : array_like of float, shape (num_engines,), optional
        When each engine last moved (``-inf``: never). Default: never.
    movable : array_like of bool, shape (num_engines,), optional
        Engines allowed to move at all (e.g. not draining). Default: all.
    engine_load : array_like of float, shape (num_engines,), optional
        Queued quota per engine; the least loaded eligible engine of a donor bucket moves.
    deadband : float, default 0.1
        Act only if the ideal bottleneck is below the current one by more than this fraction.
    max_moves : int, default 2
        Moves per round at most.
    min_dwell_s : float, default 60
        An engine moves again only ``min_dwell_s`` seconds after its last move.
    method, min_engines, max_engines
        Passed to the apportionment method (see :func:`allocate_engines`).
    force : bool, default False
        Move towards the ideal allocation even when its bottleneck is not below the current one
        by the deadband. The current bottleneck can be the lower one when buckets share engines
        (a shared group pools its demand), e.g. when a pool that started as one group is first
        split by length.

    Returns
    -------
    Rebalance

    Runtime complexity: O(apportionment + max_moves × (num_buckets + num_engines)).

    Examples
    --------
    >>> r = rebalance([0, 0, 0, 1], [1.0, 3.0], now_s=100.0)
    >>> r.moves, r.engines.tolist(), r.bottleneck_before, r.bottleneck_after
    ((Move(engine=0, from_bucket=0, to_bucket=1), Move(engine=1, from_bucket=0, to_bucket=1)),
     [1, 3], 3.0, 1.0)
    >>> rebalance([0, 0, 0, 1], [1.0, 3.0], now_s=100.0, max_moves=1).engines.tolist()
    [2, 2]
    >>> rebalance([0, 0, 0, 1], [1.0, 3.0], now_s=100.0, last_move_s=[90.0] * 4).moves
    ()
    """
    d, home, now, last, mov, load, band, max_moves, dwell = _rebalance_iv(
        engine_bucket, demand, now_s, last_move_s, movable, engine_load, deadband, max_moves,
        min_dwell_s,
    )  # fmt: skip
    nb = d.shape[0]
    alive = home >= 0
    s = np.bincount(home[alive], minlength=nb).astype(np.int64)
    e_alive = int(s.sum())
    if e_alive == 0:
        raise ValueError("engine_bucket: no engine is in service")
    check = METHODS.get(method)
    if check is None:
        raise ValueError(f"method: must be one of {', '.join(map(repr, METHODS))}; got {method!r}")
    ideal = check(d, e_alive, min_engines=min_engines, max_engines=max_engines)
    d_eff = d if d.sum() > 0 else np.ones(nb)
    before = bottleneck_unchecked(d_eff, s)
    moves: list[Move] = []
    if not isinstance(force, (bool, np.bool_)):
        raise TypeError(f"force: must be a bool, got {type(force).__name__}")
    if not force and not ideal.bottleneck < before * (1.0 - band):
        return Rebalance(s, (), ideal, before, before)
    if d.sum() <= 0:
        # No demand yet: nothing to plan from, and giving a bucket's last engine away would
        # divide by zero below; engines stay where they are.
        return Rebalance(s, (), ideal, before, before)
    can = alive & mov & (now - last >= dwell)
    home = home.copy()
    target = ideal.engines
    for _ in range(max_moves):
        receiver, donor = -1, -1
        best_need, best_hurt = -1.0, np.inf
        for j in range(nb):
            if s[j] < target[j]:
                need = (np.inf if s[j] == 0 else d_eff[j] / s[j]) if d_eff[j] > 0 else 0.0
                if need > best_need:
                    receiver, best_need = j, need
            elif s[j] > target[j] and (s[j] >= 2 or d[j] == 0):
                if not (can & (home == j)).any():
                    continue
                hurt = d_eff[j] / (s[j] - 1) if d_eff[j] > 0 else 0.0
                if hurt < best_hurt:
                    donor, best_hurt = j, hurt
        if receiver < 0 or donor < 0:
            break
        cand = np.flatnonzero(can & (home == donor))
        engine = int(cand[np.argmin(load[cand])])  # argmin: lowest engine index on ties
        home[engine] = receiver
        can[engine] = False
        s[donor] -= 1
        s[receiver] += 1
        moves.append(Move(engine, donor, receiver))
    return Rebalance(s, tuple(moves), ideal, before, bottleneck_unchecked(d_eff, s))
