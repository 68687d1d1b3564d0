"""The replay driver shared by the prefill and decode pools.

A replay takes the requests in time order. For each arrival at ``t``: the pool *screens* it
(a request that needs no routing, or can never be served, is settled there), *steps* its engines
up to ``t`` (each kernel call's events go to the policy's ``observe``), then *offers* the request
to the policy (``route``) and admits it, refuses it, or (decode) queues it. After the last
arrival, or at the horizon, the pool steps to the horizon and, while it has requests that only a
new offer can start, offers them again. Time never reads a clock; the same trace, policy and
seed give the same replay.

The pool-specific parts are the methods of the pool objects
(:class:`lbkit.sim.prefill_pool.PrefillPool`, :class:`lbkit.sim.decode_pool.DecodePool`), the
:class:`ReplayPool` protocol below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

__all__ = ["PROGRESS_EVERY", "ReplayPool", "advance", "readonly", "replay"]

#: Arrivals between two calls of a replay's ``on_progress`` callback.
PROGRESS_EVERY = 1000


class ReplayPool(Protocol):
    """What :func:`replay` needs of a pool (see the module docstring)."""

    def screen(self, request: int, t: float, /) -> bool:
        """Settle a request that needs no routing at its arrival ``t``; ``True``: route it."""
        ...

    def step(self, t_until: float, /) -> bool:
        """Run the engines towards ``t_until`` (one kernel call) and hand its events to the
        policy; ``True`` once the pool has reached ``t_until``."""
        ...

    def offer(self, request: int, t: float, /) -> bool:
        """Offer the request to the policy at ``t``; ``False``: refused."""
        ...

    def retry(self, horizon_s: float, /) -> bool:
        """After the pool reached the horizon: offer what waits again; ``False``: nothing to."""
        ...


def advance(pool: ReplayPool, t_until: float, /) -> None:
    """Step ``pool`` until it has reached ``t_until`` (events delivered on the way)."""
    while not pool.step(t_until):
        pass


def replay(
    pool: ReplayPool,
    order: np.ndarray,
    arrival_s: np.ndarray,
    /,
    *,
    horizon_s: float,
    on_progress: Callable[[int, int], None] | None = None,
) -> int:
    """Replay the arrivals ``order`` (request indices, in time order) at ``arrival_s[i]``.

    Parameters
    ----------
    pool : ReplayPool
    order : ndarray of int64, shape (m,)
        Requests in the order they arrive (ties in the order given).
    arrival_s : ndarray of float64
        Arrival time of each request (indexed by request).
    horizon_s : float
        Arrivals after it are not replayed and the pool stops there (``inf``: run to the end).
    on_progress : callable(done, total), optional
        Called after every :data:`PROGRESS_EVERY`-th arrival that was not refused or settled at
        screening (``done`` its position in ``order``, ``total = m``).

    Returns
    -------
    int
        Arrivals replayed (those at or before the horizon).

    Runtime complexity: O(m) calls of the pool's methods.
    """
    total = len(order)
    arrived = 0
    screen, step, offer = pool.screen, pool.step, pool.offer  # bound once: called per arrival
    for j, i in enumerate(order.tolist()):
        t = float(arrival_s[i])
        if t > horizon_s:
            break
        arrived += 1
        if not screen(i, t):
            continue
        while not step(t):  # advance(pool, t)
            pass
        if not offer(i, t):
            continue
        if on_progress is not None and (j + 1) % PROGRESS_EVERY == 0:
            on_progress(j + 1, total)
    advance(pool, horizon_s)
    while pool.retry(horizon_s):
        advance(pool, horizon_s)
    return arrived


def readonly(a: np.ndarray, /) -> np.ndarray:
    """A read-only view of ``a`` (what a policy's view holds: live, not writable)."""
    v = a.view()
    v.setflags(write=False)
    return v
