"""Prefill routing policies of the simulator: the baselines and lbkit's balancer.

A policy plugs into :func:`lbkit.sim.engine.simulate_prefill` through one small protocol, an
object with two methods:

``route(request, total_tokens, cached_tokens, /, *, now_s, view) -> int``
    The flat rank (``engine * ranks_per_engine + rank``) of a new request, or ``-1`` to refuse
    it. ``request`` is the request's position in the trace (unique).
``observe(requests, kinds, tokens, /, *, now_s) -> None``
    Events since the last call, as three equal-length int64 arrays: ``kinds`` is
    ``EV_FINISH`` (prefill done; the request leaves the pool), ``EV_PROGRESS`` (``tokens``
    more tokens prefilled since the request's previous event) or, when the engines share work
    (``simulate_prefill(work_sharing=...)``), ``EV_MOVE`` (the engine moved the request, which
    had not started, to flat rank ``tokens`` of the same engine). The arrays are reused by the
    simulator: copy what you keep.

``view`` is a :class:`~lbkit.sim.protocol.PrefillView`: the pool's shape and, per rank, the number
of requests queued or running and the uncached tokens they still have to prefill, both exact at
``now_s``. The simulator never reads a policy's state, and a policy never writes the view.

What each policy uses:

============== ======================================================================
``round_robin``    nothing: ranks in flat order (engine 0 ranks 0..R-1, then engine 1...)
``random``         nothing: a uniform rank drawn from ``rng``
``least_requests`` ``view.num_requests``; ties: lowest flat index
``least_tokens``   ``view.tokens``; ties: lowest flat index
``power_of_two``   ``view.tokens`` of two distinct uniform ranks; the fewer wins (ties: lower index)
``lbkit``          its own ledger: :class:`lbkit.prefill.PrefillBalancer` (length buckets, engines
                   apportioned per bucket every 30 s round, least quota load inside the bucket),
                   fed the request's lengths at routing and the progress, completion and move
                   events (``reassign``), with the options :data:`LBKIT_OPTIONS`
``lbkit_nobuckets`` the same balancer with a single bucket: least quota load over the whole pool
============== ======================================================================

:data:`LBKIT_OPTIONS` are the balancer options of both lbkit policies: a cold start (the pool
is one group until a first re-plan after 5 s allocates engines from the demand seen), no engine
moves while its busiest rank holds more than 30 s of work, engine-aware rank choice (a rank of an
idle engine counts one second, one default step budget, more than its load, so requests fill the
free ranks of engines already stepping first), spill-over to a neighbouring bucket whose best
rank is three times less loaded, and hole filling (a request may take a rank of another bucket's
engine where it runs within the steps that engine takes anyway).

Under ``simulate_prefill(work_sharing="split")`` (context-parallel engines) ``lbkit bench``
runs both lbkit policies with :data:`LBKIT_CP_OPTIONS` (:func:`context_parallel_policy`): a
request goes to the engine of its bucket with the least mean quota load, since an engine's idle
ranks share a long prompt's chunks.

Baselines treat the pool as one flat list of ranks; they know nothing of engines or lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.validation import as_rng
from lbkit.prefill.balancer import PrefillBalancer
from lbkit.prefill.buckets import DEFAULT_EDGES
from lbkit.sim.peers import PEER_POLICIES
from lbkit.sim.protocol import EV_FINISH, EV_MOVE, EV_PROGRESS

__all__ = [
    "DEFAULT_PREFILL_POLICY",
    "EV_FINISH",
    "EV_MOVE",
    "EV_PROGRESS",
    "LBKIT_CP_OPTIONS",
    "LBKIT_OPTIONS",
    "PREFILL_POLICIES",
    "LbkitPrefill",
    "LeastRequests",
    "LeastTokens",
    "PowerOfTwo",
    "RandomRank",
    "RoundRobin",
    "context_parallel_policy",
]


#: Options of :class:`~lbkit.prefill.PrefillBalancer` used by the ``lbkit`` policies.
LBKIT_OPTIONS: Mapping[str, Any] = MappingProxyType(
    {
        "cold_start_s": 5.0,
        "max_drain_s": 30.0,
        "wake_penalty_s": 1.0,
        "spill_ratio": 3.0,
        "fill_holes": True,
    }
)

#: Options of both ``lbkit`` policies for engines with context parallelism
#: (``simulate_prefill(work_sharing="split")``): engines scored by their mean quota load
#: (``context_parallel``), with the cold start, drain limit and spill-over of
#: :data:`LBKIT_OPTIONS` (``lbkit_nobuckets``: ``context_parallel`` alone).
LBKIT_CP_OPTIONS: Mapping[str, Any] = MappingProxyType(
    {
        "cold_start_s": 5.0,
        "max_drain_s": 30.0,
        "spill_ratio": 3.0,
        "context_parallel": True,
    }
)


class _Baseline:
    name = ""

    def __init__(
        self, num_engines: int, ranks_per_engine: int, *, cost: Any = None, rng: Any = None
    ):
        self._n = num_engines * ranks_per_engine
        self._rng = as_rng(rng)

    def observe(self, requests: np.ndarray, kinds: np.ndarray, tokens: np.ndarray, /, *,
                now_s: float) -> None:  # fmt: skip
        """Baselines read the view only; events are ignored."""


class RoundRobin(_Baseline):
    """Ranks in flat order, cyclically (sees nothing of the pool's state).

    Examples
    --------
    >>> p = RoundRobin(2, 2)
    >>> [p.route(i, 10, 0, now_s=0.0, view=None) for i in range(5)]
    [0, 1, 2, 3, 0]
    """

    name = "round_robin"

    def __init__(
        self, num_engines: int, ranks_per_engine: int, *, cost: Any = None, rng: Any = None
    ):
        super().__init__(num_engines, ranks_per_engine, cost=cost, rng=rng)
        self._next = 0

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        f = self._next
        self._next = (f + 1) % self._n
        return f


class RandomRank(_Baseline):
    """A uniform rank drawn from ``rng`` (sees nothing of the pool's state)."""

    name = "random"

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        return int(self._rng.integers(self._n))


class LeastRequests(_Baseline):
    """The rank with the fewest queued or running requests (ties: lowest flat index).

    Examples
    --------
    >>> from lbkit.sim.engine import PrefillView
    >>> v = PrefillView(1, 3, np.array([2, 1, 1]), np.array([10, 900, 5]))
    >>> LeastRequests(1, 3).route(0, 10, 0, now_s=0.0, view=v)
    1
    """

    name = "least_requests"

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        return int(view.num_requests.argmin())


class LeastTokens(_Baseline):
    """The rank with the fewest uncached tokens left to prefill (ties: lowest flat index).

    Examples
    --------
    >>> from lbkit.sim.engine import PrefillView
    >>> v = PrefillView(1, 3, np.array([2, 1, 1]), np.array([10, 900, 5]))
    >>> LeastTokens(1, 3).route(0, 10, 0, now_s=0.0, view=v)
    2
    """

    name = "least_tokens"

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        return int(view.tokens.argmin())


class PowerOfTwo(_Baseline):
    """Two distinct uniform ranks; the one with fewer tokens left wins (ties: lower index)."""

    name = "power_of_two"

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        n = self._n
        if n == 1:
            return 0
        i = int(self._rng.integers(n))
        j = int(self._rng.integers(n - 1))
        j += j >= i
        if i > j:
            i, j = j, i
        tokens = view.tokens
        return j if tokens[j] < tokens[i] else i


class LbkitPrefill:
    """lbkit's :class:`~lbkit.prefill.PrefillBalancer` behind the simulator's policy protocol.

    The balancer routes each request (``route``), learns its progress and completion from the
    events (``chunk_done``, ``finish``) and re-plans engines per bucket whenever a round is due
    (``end_round``, checked at each arrival). Of the view it reads only ``hit_tokens``: with
    per-rank prefix caches it passes the least of a request's per-rank hits as its cached
    tokens (the balancer is not cache-aware; with a global cache every rank's hit is the same).

    Parameters
    ----------
    num_engines, ranks_per_engine : int
    cost : QuadraticCost
    rng : numpy Generator, int seed or None
    edges : sequence of int, optional
        Bucket edges; default :data:`lbkit.prefill.DEFAULT_EDGES`. ``None`` means a single
        bucket (no buckets): the least quota load over the whole pool.
    **options
        Passed to :class:`~lbkit.prefill.PrefillBalancer` (``round_s``, ``deadband``, ...).
    """

    def __init__(
        self,
        num_engines: int,
        ranks_per_engine: int,
        *,
        cost: QuadraticCost,
        rng: Any = None,
        edges: Any = DEFAULT_EDGES,
        **options: Any,
    ) -> None:
        self._r = ranks_per_engine
        if edges is None:
            # One bucket that holds every request (all lengths are >= 1); the empty bucket 0
            # gets no engine.
            options = {"initial_engines": (0, num_engines), "max_engines": (0, num_engines),
                       **options}  # fmt: skip
            edges = (1,)
            self.name = "lbkit_nobuckets"
        else:
            self.name = "lbkit"
        self.balancer = PrefillBalancer(
            num_engines, ranks_per_engine, cost=cost, edges=edges, rng=rng, **options
        )

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        bal = self.balancer
        if bal.round_due(now_s):
            bal.end_round(now_s)
        hit = getattr(view, "hit_tokens", None)
        if hit is not None and hit.shape[0]:
            # Per-rank caches: the balancer takes one cached figure per request, and the one it
            # can count on wherever it routes is the least (its ledger never holds less work
            # than the engine does; a request that hits more finishes early).
            cached_tokens = int(hit.min())
        d = bal.route(request, total_tokens, cached_tokens, now_s=now_s)
        return -1 if d.rank < 0 else d.engine * self._r + d.rank

    def observe(self, requests: np.ndarray, kinds: np.ndarray, tokens: np.ndarray, /, *,
                now_s: float) -> None:  # fmt: skip
        bal = self.balancer
        move = kinds == EV_MOVE
        if move.any():
            # Work sharing moves only requests that have not started, so no event of the batch
            # precedes a move of the same request: the moves can be applied first.
            r = self._r
            for i, f in zip(requests[move].tolist(), tokens[move].tolist(), strict=True):
                bal.reassign(i, f % r, now_s=now_s)
            keep = ~move
            requests, tokens, kinds = requests[keep], tokens[keep], kinds[keep]
        bal.record(requests, tokens, kinds == EV_FINISH, now_s=now_s)


def _lbkit(num_engines: int, ranks_per_engine: int, *, cost: QuadraticCost, rng: Any = None):
    return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, **LBKIT_OPTIONS)


def _lbkit_nobuckets(
    num_engines: int, ranks_per_engine: int, *, cost: QuadraticCost, rng: Any = None
):
    opts = {k: v for k, v in LBKIT_OPTIONS.items() if k in ("wake_penalty_s", "fill_holes")}
    return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, edges=None, **opts)


def context_parallel_policy(
    name: str, num_engines: int, ranks_per_engine: int, *, cost: QuadraticCost, rng: Any = None
) -> LbkitPrefill:
    """The ``lbkit`` or ``lbkit_nobuckets`` policy configured for context-parallel engines
    (:data:`LBKIT_CP_OPTIONS`), as ``lbkit bench --work-sharing split`` runs them.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> context_parallel_policy("lbkit", 4, 2, cost=PRESETS["unit"].prefill).name
    'lbkit'
    """
    if name == "lbkit":
        return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, **LBKIT_CP_OPTIONS)
    if name == "lbkit_nobuckets":
        return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, edges=None,
                            context_parallel=True)  # fmt: skip
    raise ValueError(f"name: must be 'lbkit' or 'lbkit_nobuckets', got {name!r}")


#: Prefill policies by name: ``factory(num_engines, ranks_per_engine, *, cost, rng)`` returns a
#: fresh policy object (see the module documentation for the protocol).
PREFILL_POLICIES: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        "round_robin": RoundRobin,
        "random": RandomRank,
        "least_requests": LeastRequests,
        "least_tokens": LeastTokens,
        "power_of_two": PowerOfTwo,
        **PEER_POLICIES,
        "lbkit_nobuckets": _lbkit_nobuckets,
        "lbkit": _lbkit,
    }
)

#: The policy the simulator compares the others with.
DEFAULT_PREFILL_POLICY = "lbkit"
