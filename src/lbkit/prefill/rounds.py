"""Rounds of the prefill balancer: the demand EMA and the re-plan of engines between buckets.

At the end of a round (:meth:`PrefillBalancer.end_round`) each bucket's demand is the quota
routed to it divided by the round's length, smoothed by an EMA (:func:`smoothed_demand`), and
the engines in service are re-planned by :func:`~lbkit.prefill.rebalance` (:func:`replan`):
Adams' apportionment under hysteresis. Engines that move stop taking work and join their new
bucket once drained. Under :attr:`Rounds.max_drain_s` an engine whose busiest rank holds more
than that stays; under :attr:`Rounds.cold_start_s` the first round's re-plan ignores the
deadband and the move limit (``force``). With one bucket nothing ever moves.
"""

from __future__ import annotations

import numpy as np

from lbkit.core.engines import ACTIVE, OUT
from lbkit.prefill.hysteresis import Rebalance, rebalance
from lbkit.prefill.options import Rounds

__all__ = ["replan", "smoothed_demand"]


def smoothed_demand(
    rounds: Rounds, demand: np.ndarray, round_quota: list[float], elapsed_s: float, first: bool
) -> np.ndarray:
    """The demand EMA after a round of ``elapsed_s`` seconds, quota s/s per bucket (the first
    round's rate as is).

    Examples
    --------
    >>> smoothed_demand(Rounds(ema_alpha=0.5), np.array([2.0]), [30.0], 10.0, False)
    array([2.5])
    """
    rate = np.asarray(round_quota) / elapsed_s
    if first:
        return rate
    alpha = rounds.ema_alpha
    return alpha * rate + (1.0 - alpha) * demand


def replan(
    rounds: Rounds,
    home: np.ndarray,
    state: np.ndarray,
    last_move_s: np.ndarray,
    rank_loads: np.ndarray,
    demand: np.ndarray,
    *,
    now_s: float,
    first: bool,
    min_engines: np.ndarray | None,
    max_engines: np.ndarray | None,
) -> Rebalance | None:
    """The engine moves of a round's end, or None when no engine is in service.

    Parameters
    ----------
    home, state, last_move_s : ndarray, shape (num_engines,)
        Per engine: its bucket, service state (:mod:`lbkit.core.engines`) and last move, s.
    rank_loads : ndarray of float, shape (num_engines, ranks_per_engine)
        Quota load per rank, seconds.
    demand : ndarray of float, shape (num_buckets,)
        Smoothed demand per bucket, quota s/s.
    first : bool
        Whether this is the first round (a cold start's re-plan is forced).
    min_engines, max_engines : ndarray or None
        Per-bucket bounds; dropped when the engines in service cannot meet them.
    """
    bucket = np.where(state == OUT, -1, home)
    if not int((bucket >= 0).sum()):
        return None
    movable = state == ACTIVE
    if rounds.max_drain_s is not None:
        movable &= rank_loads.max(axis=1) <= rounds.max_drain_s
    cold = rounds.cold_start_s is not None and first
    kwargs = dict(
        now_s=now_s,
        last_move_s=last_move_s,
        movable=movable,
        engine_load=np.maximum(rank_loads.sum(axis=1), 0.0),
        deadband=rounds.deadband,
        max_moves=home.shape[0] if cold else rounds.max_moves,
        min_dwell_s=rounds.min_dwell_s,
        method=rounds.method,
        force=cold,
    )
    try:
        return rebalance(bucket, demand, min_engines=min_engines, max_engines=max_engines,
                         **kwargs)  # fmt: skip
    except ValueError:  # bounds infeasible with the engines now in service
        return rebalance(bucket, demand, **kwargs)
