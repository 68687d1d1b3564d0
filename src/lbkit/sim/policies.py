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
``lbkit``          its own ledger: :class:`lbkit.prefill.PrefillBalancer` with its defaults
                   (the lockstep rule of :mod:`lbkit.prefill.lockstep` over the whole pool:
                   the rank where the request finishes first, engines stepping together, plus
                   a charge for lengthening its engine's work), fed the request's lengths and
                   ``view.hit_tokens`` (its cached tokens on every rank) at routing, each
                   engine's step starts and planned ends (``view.step_start_s`` /
                   ``step_end_s``, :meth:`~lbkit.prefill.PrefillBalancer.step_started`), and
                   the progress, completion and move events (``reassign``)
``lbkit_buckets``  ablation: the same with DeepSeek's length buckets, :data:`LBKIT_BUCKET_OPTIONS`
``lbkit_least_load`` ablation: engine-aware choice off (the least quota load, lowest index)
``lbkit_nocache``  ablation: cache-awareness off (the least of the per-rank hits everywhere)
``lbkit_nosteps``  ablation: no step reports (every engine counts as between steps)
============== ======================================================================

Under ``simulate_prefill(work_sharing="split")`` (context-parallel engines) ``lbkit bench``
runs ``lbkit`` and ``lbkit_buckets`` with :data:`LBKIT_CP_OPTIONS`
(:func:`context_parallel_policy`): a request goes to the engine with the least mean quota load,
since an engine's idle ranks share a long prompt's chunks.

Baselines treat the pool as one flat list of ranks; they know nothing of engines or lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.validation import as_rng
from lbkit.prefill.balancer import PrefillBalancer
from lbkit.prefill.buckets import DEFAULT_EDGES
from lbkit.prefill.options import Buckets, RankChoice
from lbkit.sim.peers import PEER_POLICIES
from lbkit.sim.protocol import EV_FINISH, EV_MOVE, EV_PROGRESS

__all__ = [
    "DEFAULT_PREFILL_POLICY",
    "EV_FINISH",
    "EV_MOVE",
    "EV_PROGRESS",
    "LBKIT_BUCKET_OPTIONS",
    "LBKIT_CP_OPTIONS",
    "PREFILL_POLICIES",
    "LbkitPrefill",
    "LeastRequests",
    "LeastTokens",
    "PowerOfTwo",
    "RandomRank",
    "RoundRobin",
    "context_parallel_policy",
]


#: Options of the ``lbkit_buckets`` ablation, as :class:`~lbkit.prefill.PrefillBalancer`
#: keyword arguments: DeepSeek's length buckets (``DEFAULT_EDGES``) with spill-over to a
#: neighbouring bucket whose best rank scores three times lower; the rounds are the defaults
#: (engines apportioned per bucket every 30 s round after a 5 s cold start, no engine moved
#: while its busiest rank holds more than 30 s of work). The ``lbkit`` policy itself runs
#: :class:`~lbkit.prefill.PrefillBalancer`'s defaults.
LBKIT_BUCKET_OPTIONS: Mapping[str, Any] = MappingProxyType(
    {"buckets": Buckets(edges=DEFAULT_EDGES), "choice": RankChoice(spill_ratio=3.0)}
)

#: Options of both ``lbkit`` policies for engines with context parallelism
#: (``simulate_prefill(work_sharing="split")``): engines scored by their mean quota load
#: (``RankChoice(rule="engine_mean")``); ``lbkit_buckets`` adds the buckets and spill-over of
#: :data:`LBKIT_BUCKET_OPTIONS`.
LBKIT_CP_OPTIONS: Mapping[str, Any] = MappingProxyType({"choice": RankChoice(rule="engine_mean")})


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

    The balancer routes each request (``route``) with the per-rank cached tokens of the view
    (``hit_tokens``, exact as from KV events; ``cache_aware=False`` passes their least instead),
    learns each engine's steps as the engine reports them at their start (``step_started`` with
    the view's ``step_start_s`` and planned ``step_end_s``; ``step_reports=False`` ignores
    them), learns its progress and completion from the events (``chunk_done``, ``finish``, and
    ``reassign`` for moves) and re-plans engines per bucket whenever a round is due
    (``end_round``, checked at each arrival).

    Parameters
    ----------
    num_engines, ranks_per_engine : int
    cost : QuadraticCost
    rng : numpy Generator, int seed or None
    name : str, default "lbkit"
    cache_aware : bool, default True
    step_reports : bool, default True
    **options
        Passed to :class:`~lbkit.prefill.PrefillBalancer` (none: its defaults).
    """

    def __init__(
        self,
        num_engines: int,
        ranks_per_engine: int,
        *,
        cost: QuadraticCost,
        rng: Any = None,
        name: str = "lbkit",
        cache_aware: bool = True,
        step_reports: bool = True,
        **options: Any,
    ) -> None:
        self._r = ranks_per_engine
        self.name = name
        self._cache_aware = bool(cache_aware)
        self._steps = bool(step_reports)
        self._seen = np.full(num_engines, -np.inf)  # the start of each engine's last step seen
        self.balancer = PrefillBalancer(
            num_engines, ranks_per_engine, cost=cost, rng=rng, **options
        )

    def _step_reports(self, view: Any) -> None:
        """Report the steps that started since the last routing (an engine reports each step
        at its start; the simulator's view holds the running one)."""
        start, end = view.step_start_s, view.step_end_s
        new = np.flatnonzero((start != self._seen) & (end < np.inf))
        for e in new.tolist():
            t = float(start[e])
            self.balancer.step_started(e, float(end[e]) - t, now_s=t)
            self._seen[e] = t

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        bal = self.balancer
        if bal.round_due(now_s):
            bal.end_round(now_s)
        if self._steps and getattr(view, "step_start_s", None) is not None:
            self._step_reports(view)
        hit = getattr(view, "hit_tokens", None)
        if hit is not None and hit.shape[0]:
            # per-rank cached tokens (exact, as from KV events), or the least of them
            cached_tokens = hit if self._cache_aware else int(hit.min())
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
    return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng)


def _lbkit_buckets(
    num_engines: int, ranks_per_engine: int, *, cost: QuadraticCost, rng: Any = None
):
    return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, name="lbkit_buckets",
                        **LBKIT_BUCKET_OPTIONS)  # fmt: skip


def _lbkit_least_load(
    num_engines: int, ranks_per_engine: int, *, cost: QuadraticCost, rng: Any = None
):
    return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng,
                        name="lbkit_least_load",
                        choice=RankChoice(rule="least_load"))  # fmt: skip


def _lbkit_nocache(
    num_engines: int, ranks_per_engine: int, *, cost: QuadraticCost, rng: Any = None
):
    return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, name="lbkit_nocache",
                        cache_aware=False)  # fmt: skip


def _lbkit_nosteps(
    num_engines: int, ranks_per_engine: int, *, cost: QuadraticCost, rng: Any = None
):
    return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, name="lbkit_nosteps",
                        step_reports=False)  # fmt: skip


def context_parallel_policy(
    name: str, num_engines: int, ranks_per_engine: int, *, cost: QuadraticCost, rng: Any = None
) -> LbkitPrefill:
    """The ``lbkit`` or ``lbkit_buckets`` policy configured for context-parallel engines
    (:data:`LBKIT_CP_OPTIONS`), as ``lbkit bench --work-sharing split`` runs them.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> context_parallel_policy("lbkit", 4, 2, cost=PRESETS["unit"].prefill).name
    'lbkit'
    """
    if name == "lbkit":
        return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, **LBKIT_CP_OPTIONS)
    if name == "lbkit_buckets":
        choice = replace(LBKIT_BUCKET_OPTIONS["choice"], rule=LBKIT_CP_OPTIONS["choice"].rule)
        options = {**LBKIT_BUCKET_OPTIONS, "choice": choice}
        return LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=rng, name=name,
                            **options)  # fmt: skip
    raise ValueError(f"name: must be 'lbkit' or 'lbkit_buckets', got {name!r}")


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
        "lbkit_buckets": _lbkit_buckets,
        "lbkit_least_load": _lbkit_least_load,
        "lbkit_nocache": _lbkit_nocache,
        "lbkit_nosteps": _lbkit_nosteps,
        "lbkit": _lbkit,
    }
)

#: The policy the simulator compares the others with.
DEFAULT_PREFILL_POLICY = "lbkit"
