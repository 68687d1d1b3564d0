"""``PrefillBalancer``: the stateful prefill router that a serving front end embeds.

It keeps the ledger a router must remember and calls the pure functions of this package:

- **route** a request to its length bucket (:func:`bucket_of`), then to the least-loaded rank of
  the engines serving that bucket (:func:`pick_rank`'s rule), charging the rank the request's
  quota (:meth:`QuadraticCost.quota` of its uncached tokens);
- **chunk_done / finish** record progress: the rank's quota load falls by the quota of the work
  done (**record** takes a batch of both at once);
- **end_round** re-plans the engines of each bucket from the round's demand, EMA-smoothed
  (:func:`rebalance`: Adams' apportionment under hysteresis);
- **remove_engine / restore_engine** take an engine out of service (its requests are re-routed
  and returned, none lost) and back;
- **report** ingests engine-reported progress by sequence number (stale reports are ignored) and
  measures how far the ledger had drifted;
- **plan_engine** runs :func:`plan_chunks` on each rank's FIFO queue;
- **statistics / _check / state_dict / from_state_dict**.

Quota accounting
----------------
A request's *remaining quota* is ``cost.quota(remaining_tokens, cached_tokens + done_tokens)``:
the work of its remaining tokens as if run in one chunk. A rank's quota load is the sum of the
remaining quotas of its requests. After ``chunk_done`` the remaining quota is recomputed, so the
load falls by ``quota(before) - quota(after)``. With the physical tie ``q = k/2`` (and
``gamma = 0``) this is exactly the work of the chunk, whatever the chunking. Otherwise it is not
the chunk's work (``q > k/2`` charges chunking less than the one-chunk estimate, ``q < k/2``
more), but the decrements still telescope: the load is always the remaining quota of what is left
and returns to zero when the request finishes.

Engine reports
--------------
An engine reports, with an increasing sequence number, the cumulative prefilled tokens of the
requests it holds (not bare per-rank loads: a load alone cannot say which request progressed,
so it could not be reconciled into a per-request ledger). Progress is monotone, so a report only
ever moves a request forward; a report whose sequence number is not newer than the last accepted
one is stale and ignored. ``drift_s`` is how far the ledger's remaining quota was from the
report's before reconciliation, summed over the reported requests.

Moving engines
--------------
A moving engine stops taking new work at once and joins its new bucket when its queue is empty
(it drains; it does not hand its queue back: the prefill already done on it, and the KV it holds,
would be lost). An engine taken out of service, in contrast, hands its requests back: they are
re-routed from the start of their uncached tokens (``done`` resets to 0).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.validation import (
    as_int_array,
    as_rng,
    check_choice,
    check_int,
    check_real,
)
from lbkit.prefill._kernels import least_engine, least_scored, roomy_slot
from lbkit.prefill.apportion import (
    DEFAULT_METHOD,
    METHODS,
    _allocate_iv,
    _serving,
    allocate_engines,
)
from lbkit.prefill.buckets import check_edges
from lbkit.prefill.chunking import ChunkPlan, plan_chunks
from lbkit.prefill.hysteresis import Move, rebalance
from lbkit.prefill.lockstep import (
    C_B,
    C_BUDGET,
    C_GAMMA,
    C_GROWTH,
    C_IDLE_GROWTH,
    C_K,
    C_MOE,
    C_Q,
    N_COEF,
    lockstep_scored,
)

__all__ = [
    "REASONS",
    "EnginePlan",
    "PrefillBalancer",
    "PrefillStatistics",
    "ReportResult",
    "RoundResult",
    "RouteDecision",
]

#: Reason codes of a :class:`RouteDecision`: routed to the bucket's own engines, to the engines
#: of the neighbouring bucket that serves it (it has none of its own), spilled over to a
#: neighbouring bucket's engines, filling a hole of another engine (``fill_holes``), or refused
#: because no engine is in service.
REASONS = ("own_bucket", "shared_bucket", "spill", "fill", "no_engine")

_ACTIVE, _DRAINING, _OUT = 0, 1, 2
_STATE_NAMES = ("active", "draining", "out")
_STATE_VERSION = 1
_NO_HITS = np.zeros(0, dtype=np.int64)


class RouteDecision(NamedTuple):
    """Where a request went: ``engine``, ``rank`` (-1 when refused), ``bucket`` and ``reason``."""

    engine: int
    rank: int
    bucket: int
    reason: str


class RoundResult(NamedTuple):
    """Result of :meth:`PrefillBalancer.end_round`.

    Attributes
    ----------
    moves : tuple of Move
        Engines that change bucket (each drains, then joins its new bucket).
    demand : tuple of float
        EMA-smoothed demand per bucket, quota seconds per second.
    engines : tuple of int
        Engines per bucket after the moves (draining engines counted at their new bucket).
    bottleneck_before, bottleneck_after : float
        Demand per engine of the busiest group before and after the moves.
    """

    moves: tuple[Move, ...]
    demand: tuple[float, ...]
    engines: tuple[int, ...]
    bottleneck_before: float
    bottleneck_after: float


class ReportResult(NamedTuple):
    """Result of :meth:`PrefillBalancer.report`.

    Attributes
    ----------
    accepted : bool
        False when the report's sequence number is not newer than the last accepted one.
    drift_s : float
        Sum over reported requests of ``|ledger remaining quota - reported remaining quota|``
        before reconciliation, seconds.
    unknown : tuple
        Reported request ids that the ledger does not hold on this engine (ignored).
    missing : tuple
        Requests the ledger holds on this engine that the report does not mention (kept).
    """

    accepted: bool
    drift_s: float
    unknown: tuple[Hashable, ...]
    missing: tuple[Hashable, ...]


class EnginePlan(NamedTuple):
    """One step of an engine: per rank, the scheduled request ids and their :class:`ChunkPlan`.

    ``step_time_s`` is the slowest rank's predicted time (the ranks step synchronously).
    """

    request_ids: tuple[tuple[Hashable, ...], ...]
    plans: tuple[ChunkPlan, ...]
    step_time_s: float


@dataclass(frozen=True, slots=True)
class PrefillStatistics:
    """Snapshot of a :class:`PrefillBalancer` (plain tuples; safe to keep).

    Per bucket: ``bucket_demand`` (EMA of quota s/s), ``bucket_round_quota`` (quota arrived this
    round, s), ``bucket_engines`` (active engines), ``bucket_draining`` (engines draining towards
    it), ``bucket_server`` (bucket whose engines serve it, -1 if none), ``bucket_queued`` and
    ``bucket_queued_quota`` (requests of the bucket in the ledger and their remaining quota, s).
    Per rank (flat ``engine * ranks_per_engine + rank``): ``rank_load`` (quota load, s).
    Per engine: ``engine_bucket`` (home bucket) and ``engine_state``
    (``"active"``, ``"draining"``, ``"out"``). Counters: requests ``queued`` (in the ledger,
    queued or running), ``routed`` (admitted), ``finished``, ``refused``, ``handed_back``,
    ``rerouted``; ``moves`` and ``rounds`` so far; reports ``reports_accepted`` and
    ``reports_stale``; ledger drift ``drift_last_s`` and ``drift_max_s``; ``reassigned``
    (requests moved between ranks of their engine, :meth:`PrefillBalancer.reassign`).
    """

    bucket_demand: tuple[float, ...]
    bucket_round_quota: tuple[float, ...]
    bucket_engines: tuple[int, ...]
    bucket_draining: tuple[int, ...]
    bucket_server: tuple[int, ...]
    bucket_queued: tuple[int, ...]
    bucket_queued_quota: tuple[float, ...]
    rank_load: tuple[float, ...]
    engine_bucket: tuple[int, ...]
    engine_state: tuple[str, ...]
    queued: int
    routed: int
    finished: int
    refused: int
    handed_back: int
    rerouted: int
    moves: int
    rounds: int
    reports_accepted: int
    reports_stale: int
    drift_last_s: float
    drift_max_s: float
    reassigned: int = 0


class _Request:
    __slots__ = ("bucket", "cached", "done", "quota", "rank", "rid", "total")

    def __init__(self, rid, rank, bucket, total, cached, done, quota):
        self.rid = rid
        self.rank = rank
        self.bucket = bucket
        self.total = total
        self.cached = cached
        self.done = done
        self.quota = quota


def _tokens(value: Any, name: str) -> int:
    if type(value) is int and value >= 0:
        return value
    return check_int(value, name, min_value=0)


def _request_id(value: Any) -> int | str:
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, str):
        return str(value)
    raise TypeError(f"request_id: must be an int or a str, got {type(value).__name__}")


def _time(value: Any) -> float:
    if type(value) is float and value - value == 0.0:  # finite float: the common case
        return value
    return check_real(value, "now_s")


class PrefillBalancer:
    """Route prefill requests to engines and ranks of a pool, re-planning engines per bucket.

    Parameters
    ----------
    num_engines : int
        Engines in the pool (>= 1).
    ranks_per_engine : int
        DP ranks of each engine (>= 1); rank ``r`` of engine ``e`` has flat index
        ``e * ranks_per_engine + r``.
    cost : QuadraticCost
        Prefill step-cost model of one rank (see :data:`lbkit.core.PRESETS`).
    edges : sequence of int, default ``()``
        Bucket edges in tokens (lower edge inclusive). Default: one bucket, the whole pool
        (DeepSeek's length buckets, ``DEFAULT_EDGES``, cost goodput with the lockstep rule on
        every scenario of ``benchmarks/goodput_world.py``; see docs/simulator.md).
    round_s : float, default 30
        Nominal round length; :meth:`round_due` tells the caller when to call :meth:`end_round`.
    ema_alpha : float in (0, 1], default 0.5
        Weight of the latest round in the demand EMA (1: no smoothing).
    deadband, max_moves, min_dwell_s
        Hysteresis of :func:`rebalance`: relative improvement needed (0.1), moves per round
        at most (2), seconds before an engine may move again (60).
    method : str, default "adams"
        Apportionment method (``METHODS``).
    min_engines, max_engines : sequence of int, optional
        Per-bucket bounds; dropped for a round in which the in-service engines cannot meet them.
    initial_engines : sequence of int, optional
        Engines per bucket at start; default: the pool spread evenly (lowest buckets first).
        Engines are given to buckets in index order (engine 0 to the lowest bucket).
    spill_ratio : float, optional
        Spill-over: send a request to a neighbouring bucket's engines when the least quota load
        among its own is above ``spill_ratio`` times the neighbour's. Off by default.
    sample : int, optional
        Power-of-d choices among the bucket's ranks (with ``rng``) instead of the full argmin.
    cold_start_s : float, optional
        Cold start: the pool starts as one group (every engine in the lowest bucket, within
        ``max_engines``, unless ``initial_engines`` is given), the first round lasts
        ``cold_start_s`` seconds, and its re-plan moves engines to the ideal allocation of the
        demand seen so far, free of hysteresis (no deadband, any number of moves): buckets
        that saw no request get no engine. Off by
        default (the first round is an ordinary one).
    max_drain_s : float, optional
        An engine whose most loaded rank holds more than ``max_drain_s`` seconds of quota is
        not moved to another bucket (its drain would keep it from both buckets for that long).
        Default: any active engine may move.
    wake_penalty_s : float, optional
        Engine-aware rank choice: a rank of an *idle* engine (all its ranks at zero quota load)
        counts ``wake_penalty_s`` seconds more than its load, so a request fills the free ranks
        of engines that are already stepping before it wakes an idle engine. Default: off (the
        plain least quota load).
    fill_holes : bool, default False
        Hole filling: a request may go to a rank of any active engine, of any bucket, whose
        load plus the request's quota stays within that engine's most loaded rank (the work
        runs in steps the engine takes anyway), when the bucket's own choice would lengthen
        its engine's steps and that rank's load is at most the own choice's score; among such
        ranks the least loaded wins (ties: buckets in order, then the lowest engine and rank).
        Reason ``"fill"``.
    context_parallel : bool, default False
        For engines that run context parallelism (an engine's idle ranks help with a prompt
        chunk of a busy rank, so an engine finishes its queued work in about its *mean* rank
        load): the rank choice scores engines, not ranks. A request goes to the engine of its
        bucket with the least mean quota load (ties: the lowest), to that engine's least loaded
        rank (its queue owner); ``wake_penalty_s`` is added to the score of an idle engine and
        ``spill_ratio`` compares the same engine scores. Not combined with ``fill_holes`` or
        ``sample`` (rank-level rules).
    rank_rule : {"lockstep", "least_load"}, default "lockstep"
        Rank choice inside the bucket's engines: the earliest estimated finish with engines
        stepping together (:mod:`lbkit.prefill.lockstep`, cache-aware with per-rank
        ``cached_tokens``), or the least quota load. ``sample``, ``wake_penalty_s``,
        ``fill_holes`` and ``context_parallel`` refine the least-load rule and select it.
    step_budget_s : float, default 1.0
        The engines' step time budget, seconds (lockstep rule).
    growth_weight, idle_growth_weight : float, default 0.6, 0.1
        Lockstep rule: seconds of score per second a request adds to the busiest rank of a busy,
        or an idle, engine.
    rng : numpy Generator, int seed or None
        Randomness for ``sample``.
    now_s : float, default 0
        Start of the first round, seconds.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> bal = PrefillBalancer(4, 2, cost=PRESETS["h800_dsv3"].prefill)
    >>> bal.route("a", 20000, 4096, now_s=0.0)
    RouteDecision(engine=0, rank=0, bucket=0, reason='own_bucket')

    A second long prompt finishes as early next to it (its steps are paced by the first one's
    anyway) and keeps the idle engines for short prompts:

    >>> bal.route("b", 20000, 0, now_s=0.1)
    RouteDecision(engine=0, rank=1, bucket=0, reason='own_bucket')
    >>> bal.chunk_done("a", 15904, now_s=1.0)
    0
    >>> bal.finish("a", now_s=1.0)
    0

    With per-rank prefix caches, the cached tokens of the request on every flat rank: the rank
    holding most of the prompt wins.

    >>> hits = np.zeros(8, dtype=np.int64)
    >>> hits[6] = 28672
    >>> bal.route("c", 30000, hits, now_s=1.0)
    RouteDecision(engine=3, rank=0, bucket=0, reason='own_bucket')
    >>> bal.statistics().queued
    2
    >>> bal._check()
    """

    def __init__(
        self,
        num_engines: int,
        ranks_per_engine: int,
        *,
        cost: QuadraticCost,
        edges: Any = (),
        round_s: float = 30.0,
        ema_alpha: float = 0.5,
        deadband: float = 0.1,
        max_moves: int = 2,
        min_dwell_s: float = 60.0,
        method: str = DEFAULT_METHOD,
        min_engines: Any = None,
        max_engines: Any = None,
        initial_engines: Any = None,
        spill_ratio: float | None = None,
        sample: int | None = None,
        cold_start_s: float | None = None,
        max_drain_s: float | None = None,
        wake_penalty_s: float | None = None,
        fill_holes: bool = False,
        context_parallel: bool = False,
        rank_rule: str = "lockstep",
        step_budget_s: float = 1.0,
        growth_weight: float = 0.6,
        idle_growth_weight: float = 0.1,
        rng: np.random.Generator | int | None = None,
        now_s: float = 0.0,
    ) -> None:
        self._num_engines = check_int(num_engines, "num_engines", min_value=1)
        self._ranks = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
        if not isinstance(cost, QuadraticCost):
            raise TypeError(f"cost: must be a QuadraticCost, got {type(cost).__name__}")
        self._cost = cost
        self._edges = check_edges(edges, allow_empty=True)
        nb = len(self._edges) + 1
        self._round_s = check_real(round_s, "round_s", min_value=0.0, strict_min=True)
        self._alpha = check_real(
            ema_alpha, "ema_alpha", min_value=0.0, max_value=1.0, strict_min=True
        )
        self._deadband = check_real(deadband, "deadband", min_value=0.0, max_value=1.0)
        self._max_moves = check_int(max_moves, "max_moves", min_value=0)
        self._min_dwell_s = check_real(min_dwell_s, "min_dwell_s", min_value=0.0)
        self._method = check_choice(method, "method", tuple(METHODS))
        e = self._num_engines
        self._min_engines = (
            None
            if min_engines is None
            else as_int_array(min_engines, "min_engines", shape=(nb,), min_value=0)
        )
        self._max_engines = (
            None
            if max_engines is None
            else as_int_array(max_engines, "max_engines", shape=(nb,), min_value=0)
        )
        _allocate_iv(np.zeros(nb), e, self._min_engines, self._max_engines)  # feasibility
        self._spill = (
            None if spill_ratio is None else check_real(spill_ratio, "spill_ratio", min_value=1.0)
        )
        self._sample = None if sample is None else check_int(sample, "sample", min_value=1)
        self._cold = (
            None
            if cold_start_s is None
            else check_real(cold_start_s, "cold_start_s", min_value=0.0, strict_min=True)
        )
        self._max_drain = (
            None if max_drain_s is None else check_real(max_drain_s, "max_drain_s", min_value=0.0)
        )
        self._wake = (
            None
            if wake_penalty_s is None
            else check_real(wake_penalty_s, "wake_penalty_s", min_value=0.0)
        )
        if not isinstance(fill_holes, (bool, np.bool_)):
            raise TypeError(f"fill_holes: must be a bool, got {type(fill_holes).__name__}")
        self._fill = bool(fill_holes)
        if not isinstance(context_parallel, (bool, np.bool_)):
            raise TypeError(
                f"context_parallel: must be a bool, got {type(context_parallel).__name__}"
            )
        self._cp = bool(context_parallel)
        if self._cp:
            for opt, value in (("fill_holes", self._fill or None), ("sample", self._sample)):
                if value is not None:
                    raise ValueError(
                        f"context_parallel: cannot be combined with {opt} (a rank-level rule)"
                    )
        self._rule = check_choice(rank_rule, "rank_rule", ("lockstep", "least_load"))
        if self._cp or self._fill or self._sample is not None or self._wake is not None:
            self._rule = "least_load"
        self._moe = float(cost.moe_s_per_token)
        self._coef = np.zeros(N_COEF)
        self._coef[C_B], self._coef[C_K] = cost.b, cost.k
        self._coef[C_Q], self._coef[C_GAMMA] = cost.q, cost.gamma
        self._coef[C_MOE] = self._moe
        self._coef[C_BUDGET] = check_real(
            step_budget_s, "step_budget_s", min_value=0.0, strict_min=True
        )
        self._coef[C_GROWTH] = check_real(growth_weight, "growth_weight", min_value=0.0)
        self._coef[C_IDLE_GROWTH] = check_real(
            idle_growth_weight, "idle_growth_weight", min_value=0.0
        )
        self._rng = as_rng(rng)
        now = _time(now_s)
        if initial_engines is None:
            seed = np.zeros(nb)
            if self._cold is not None:
                seed[0] = 1.0  # one group: demand only in the lowest bucket
            counts = allocate_engines(
                seed, e, min_engines=self._min_engines, max_engines=self._max_engines
            ).engines
        else:
            counts = as_int_array(initial_engines, "initial_engines", shape=(nb,), min_value=0)
            if counts.sum() != e:
                raise ValueError(
                    f"initial_engines: must sum to num_engines ({e}), got {int(counts.sum())}"
                )
        n = e * self._ranks
        self._home = np.repeat(np.arange(nb, dtype=np.int64), counts)
        self._state = np.zeros(e, dtype=np.int8)
        self._last_move = np.full(e, -np.inf)
        self._seq = np.full(e, -1, dtype=np.int64)
        self._load = np.zeros(n)  # in slot order (see _rebuild)
        self._work = np.zeros(n)  # step-time work per slot (lockstep rule)
        self._count = np.zeros(n, dtype=np.int64)  # requests per slot
        self._slot: list[int] = list(range(n))  # flat rank -> slot
        self._rank_at: list[int] = list(range(n))  # slot -> flat rank
        self._lo: list[int] = [0] * nb
        self._hi: list[int] = [0] * nb
        self._server: list[int] = [-1] * nb
        self._queues: list[dict[Hashable, _Request]] = [{} for _ in range(n)]
        self._requests: dict[Hashable, _Request] = {}
        self._round_quota = [0.0] * nb
        self._round_start = now
        self._demand = np.zeros(nb)
        self._counts = {
            "routed": 0, "finished": 0, "refused": 0, "handed_back": 0, "rerouted": 0,
            "moves": 0, "rounds": 0, "reports_accepted": 0, "reports_stale": 0, "reassigned": 0,
        }  # fmt: skip
        self._drift_last = 0.0
        self._drift_max = 0.0
        self._rebuild()

    # ------------------------------------------------------------------ properties
    @property
    def num_buckets(self) -> int:
        """Number of length buckets."""
        return len(self._edges) + 1

    @property
    def num_ranks(self) -> int:
        """Ranks in the pool (``num_engines * ranks_per_engine``)."""
        return self._num_engines * self._ranks

    @property
    def edges(self) -> tuple[int, ...]:
        """Bucket edges in tokens."""
        return self._edges

    @property
    def cost(self) -> QuadraticCost:
        """The step-cost model."""
        return self._cost

    def rank_loads(self) -> np.ndarray:
        """Quota load per rank in flat order, shape (num_ranks,), seconds (a copy)."""
        return self._load[np.asarray(self._slot, dtype=np.int64)]

    def requests_on(self, engine: int, rank: int) -> tuple[Hashable, ...]:
        """Request ids queued or running on a rank, in FIFO order."""
        engine = self._engine_iv(engine)
        rank = check_int(rank, "rank", min_value=0, max_value=self._ranks - 1)
        return tuple(self._queues[engine * self._ranks + rank])

    def round_due(self, now_s: float) -> bool:
        """Whether the current round is over: ``round_s`` seconds (``cold_start_s`` for the
        first round under a cold start) have passed since it started."""
        length = self._round_s
        if self._cold is not None and self._counts["rounds"] == 0:
            length = self._cold
        return _time(now_s) - self._round_start >= length

    # ------------------------------------------------------------------ routing
    def _rebuild(self) -> None:
        """Recompute the routing slices after engines changed state or bucket."""
        nb = self.num_buckets
        r = self._ranks
        to_flat = np.asarray(self._slot, dtype=np.int64)
        flat_load = self._load[to_flat]
        flat_work = self._work[to_flat]
        flat_count = self._count[to_flat]
        active = self._state == _ACTIVE
        counts = np.bincount(self._home[active], minlength=nb)
        server = _serving(counts)
        order: list[int] = []
        start = [0] * nb
        stop = [0] * nb
        for j in range(nb):
            start[j] = len(order)
            for e in np.flatnonzero(active & (self._home == j)).tolist():
                order.extend(range(e * r, e * r + r))
            stop[j] = len(order)
        self._active_end = len(order)
        rest = np.flatnonzero(~active).tolist()
        for e in rest:
            order.extend(range(e * r, e * r + r))
        self._rank_at = order
        slot = [0] * len(order)
        for s, f in enumerate(order):
            slot[f] = s
        self._slot = slot
        self._order = np.asarray(order, dtype=np.int64)
        self._load = flat_load[self._order]
        self._work = flat_work[self._order]
        self._count = flat_count[self._order]
        self._server = server.tolist()
        self._lo = [start[h] if h >= 0 else 0 for h in self._server]
        self._hi = [stop[h] if h >= 0 else 0 for h in self._server]

    def _quota(self, remaining: int, prefix: int) -> float:
        c = self._cost
        return (
            remaining * (c.b + c.k * prefix + c.q * remaining) + c.gamma * prefix
            if remaining
            else 0.0
        )

    def _choose(
        self, bucket: int, total: int, cached: int, hits: np.ndarray | None
    ) -> tuple[int, str, int]:
        """Slot for a new request of ``bucket`` (-1 if no engine), the reason and the request's
        cached tokens there (``hits``: per flat rank, or ``None`` for ``cached`` everywhere)."""
        lo = self._lo[bucket]
        hi = self._hi[bucket]
        if lo == hi:
            return -1, "no_engine", cached
        if self._rule == "lockstep":
            return self._choose_lockstep(bucket, lo, hi, total, cached, hits)
        if self._cp:
            slot, reason = self._choose_engine(bucket, lo, hi)
        else:
            slot, reason = self._choose_least(bucket, lo, hi, self._quota(total - cached, cached))
        return slot, reason, cached if hits is None else int(hits[self._rank_at[slot]])

    def _choose_lockstep(
        self, bucket: int, lo: int, hi: int, total: int, cached: int, hits: np.ndarray | None
    ) -> tuple[int, str, int]:
        """``_choose`` under the lockstep rule (kernel ``lockstep_scored``, one pass per range)."""
        work, count, r, coef = self._work, self._count, self._ranks, self._coef
        h = _NO_HITS if hits is None else hits[self._order]
        k, score, hit = lockstep_scored(work, count, lo, hi, r, total, h, cached, coef)
        slot = lo + k
        reason = "own_bucket" if self._server[bucket] == bucket else "shared_bucket"
        if self._spill is not None:
            best = score
            for nlo, nhi in self._neighbours(bucket):
                nk, nscore, nhit = lockstep_scored(work, count, nlo, nhi, r, total, h, cached, coef)
                if score > self._spill * nscore and nscore < best:
                    slot, best, hit, reason = nlo + nk, nscore, nhit, "spill"
        return slot, reason, int(hit)

    def _choose_least(self, bucket: int, lo: int, hi: int, quota: float) -> tuple[int, str]:
        """``_choose`` under the least-load rule.

        Scores and holes come from the kernels ``least_scored`` and ``roomy_slot`` (one pass
        over the slots each); ``sample`` draws its candidates in numpy.
        """
        load = self._load
        r = self._ranks
        wake = 0.0 if self._wake is None else self._wake
        if self._sample is None or self._sample >= hi - lo:
            k, score, top = least_scored(load, lo, hi, r, wake)
        else:
            vals = self._scores(lo, hi)
            pick = np.sort(self._rng.choice(hi - lo, size=self._sample, replace=False))
            k = int(pick[np.argmin(vals[pick])])
            score = vals[k]
            top = load[lo + k - k % r : lo + k - k % r + r].max()
        slot = lo + k
        reason = "own_bucket" if self._server[bucket] == bucket else "shared_bucket"
        best = score
        if self._spill is not None and score > 0.0:  # a zero own score never spills
            for nlo, nhi in self._neighbours(bucket):
                # the neighbour's idle engines pay the wake penalty too
                nk, nscore, ntop = least_scored(load, nlo, nhi, r, wake)
                if score > self._spill * nscore and nscore < best:
                    slot, best, top, reason = nlo + nk, nscore, ntop, "spill"
        # An own choice that runs within its engine's steps is a hole already; otherwise ties go
        # to the hole (the own choice would lengthen its engine's steps).
        if self._fill and load[slot] + quota > top and self._active_end:
            hole = roomy_slot(load, self._active_end, r, quota)
            if hole >= 0 and load[hole] <= best:
                slot, reason = hole, "fill"
        return slot, reason

    def _neighbours(self, bucket: int) -> list[tuple[int, int]]:
        """Slot ranges of the neighbouring buckets a request of ``bucket`` may spill to: served
        by other engines than its own, and holding at least one engine."""
        out = []
        for nbr in (bucket - 1, bucket + 1):
            if 0 <= nbr < len(self._lo) and self._server[nbr] != self._server[bucket]:
                if self._lo[nbr] != self._hi[nbr]:
                    out.append((self._lo[nbr], self._hi[nbr]))
        return out

    def _choose_engine(self, bucket: int, lo: int, hi: int) -> tuple[int, str]:
        """``_choose`` with ``context_parallel``: engines scored by their mean quota load."""
        load = self._load
        r = self._ranks
        wake = 0.0 if self._wake is None else self._wake
        k, score = least_engine(load, lo, hi, r, wake)
        slot = lo + k
        reason = "own_bucket" if self._server[bucket] == bucket else "shared_bucket"
        if self._spill is not None and score > 0.0:
            best = score
            for nlo, nhi in self._neighbours(bucket):
                nk, nscore = least_engine(load, nlo, nhi, r, wake)
                if score > self._spill * nscore and nscore < best:
                    slot, best, reason = nlo + nk, nscore, "spill"
        return slot, reason

    def _scores(self, lo: int, hi: int) -> np.ndarray:
        """Routing scores of the slots ``lo:hi`` in numpy (the ``sample`` path; ``least_scored``
        is the same rule in one pass): the quota loads, plus the wake penalty on the ranks of
        idle engines (all ranks at zero load) when ``wake_penalty_s`` is set.

        Slots of one engine are contiguous (``_rebuild`` lays engines out rank by rank), so the
        slice reshapes to (engines, ranks).
        """
        vals = self._load[lo:hi]
        if self._wake is None or self._wake == 0.0:
            return vals
        block = vals.reshape(-1, self._ranks)
        top = block.max(axis=1)
        return (block + np.where(top > 0.0, 0.0, self._wake)[:, None]).ravel()

    def route(
        self, request_id: Hashable, total_tokens: int, cached_tokens: int = 0, *, now_s: float
    ) -> RouteDecision:
        """Route a new request; charge its quota to the chosen rank.

        Parameters
        ----------
        request_id : int or str
            Unique among the requests in the ledger (may be reused after ``finish``). numpy
            integers are stored as ``int``.
        total_tokens : int
            Prompt length including the cached prefix (>= 1).
        cached_tokens : int or array_like of int, shape (num_ranks,), default 0
            Prefix already in KV cache (``0 <= cached_tokens <= total_tokens``): one figure
            (a cache shared by the pool) or one per flat rank (each rank its own cache, e.g.
            from a prefix index fed by KV events); the request is charged the work of what
            it computes on the rank it gets.
        now_s : float
            Current time, seconds.

        Returns
        -------
        RouteDecision
            ``engine``, ``rank``, ``bucket``, ``reason`` (see ``REASONS``); ``engine = rank = -1``
            with reason ``"no_engine"`` when no engine is in service (the request is refused and
            not kept).

        Raises
        ------
        ValueError
            Negative or non-integer tokens, ``cached_tokens > total_tokens``, zero tokens, or a
            duplicate id. Nothing changes when a call raises.
        TypeError
            An id that is neither int nor str.

        Runtime complexity: O(ranks of the bucket's engines) (one kernel pass; with
        ``fill_holes`` or ``spill_ratio`` at most three more over the active ranks).
        """
        hits = None
        if type(cached_tokens) is not int and isinstance(cached_tokens, (np.ndarray, list, tuple)):
            hits = self._hits_iv(cached_tokens, total_tokens)
            cached_tokens = int(hits.min())
        if not (
            type(total_tokens) is int
            and type(cached_tokens) is int
            and 0 <= cached_tokens <= total_tokens
            and total_tokens > 0
            and type(now_s) is float
            and now_s - now_s == 0.0  # excludes NaN and infinities
        ):
            total_tokens, cached_tokens, now_s = self._route_iv(total_tokens, cached_tokens, now_s)
        if type(request_id) is not int and type(request_id) is not str:
            request_id = _request_id(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in the ledger")
        bucket = bisect.bisect_right(self._edges, total_tokens)
        slot, reason, cached = self._choose(bucket, total_tokens, cached_tokens, hits)
        quota = self._quota(total_tokens - cached, cached)
        self._round_quota[bucket] += quota
        if slot < 0:
            self._counts["refused"] += 1
            return RouteDecision(-1, -1, bucket, reason)
        flat = self._rank_at[slot]
        req = _Request(request_id, flat, bucket, total_tokens, cached, 0, quota)
        self._requests[request_id] = req
        self._queues[flat][request_id] = req
        self._resum(flat)
        self._counts["routed"] += 1
        return RouteDecision(flat // self._ranks, flat % self._ranks, bucket, reason)

    def _hits_iv(self, cached_tokens: Any, total_tokens: Any) -> np.ndarray:
        total = _tokens(total_tokens, "total_tokens")
        hits = as_int_array(
            cached_tokens, "cached_tokens", shape=(self.num_ranks,), min_value=0
        )
        if hits.shape[0] and int(hits.max()) > total:
            raise ValueError(
                f"cached_tokens: must be <= total_tokens ({total}) on every rank, "
                f"got {int(hits.max())}"
            )
        return hits

    @staticmethod
    def _route_iv(total_tokens: Any, cached_tokens: Any, now_s: Any) -> tuple[int, int, float]:
        total = _tokens(total_tokens, "total_tokens")
        cached = _tokens(cached_tokens, "cached_tokens")
        if total == 0:
            raise ValueError("total_tokens: must be >= 1, got 0")
        if cached > total:
            raise ValueError(f"cached_tokens: must be <= total_tokens ({total}), got {cached}")
        return total, cached, _time(now_s)

    def _get(self, request_id: Hashable) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KeyError(f"request_id: unknown request {request_id!r}") from None

    # ------------------------------------------------------------------ progress
    def _advance(self, req: _Request, done: int) -> float:
        """Set ``req.done``; update quota and load; return |quota change|."""
        new = self._quota(req.total - req.cached - done, req.cached + done)
        delta = req.quota - new
        req.done = done
        req.quota = new
        # Re-sum the rank's queue (short) rather than subtract: no cancellation error builds up.
        self._resum(req.rank)
        return abs(delta)

    def chunk_done(self, request_id: Hashable, tokens: int, *, now_s: float) -> int:
        """Record that ``tokens`` more tokens of a request were prefilled.

        Returns
        -------
        int
            Tokens of the request still to prefill.

        Raises
        ------
        KeyError
            Unknown request id.
        ValueError
            Negative or non-integer ``tokens``, or more than the request has left.

        Runtime complexity: O(requests on the rank) (the rank's load is re-summed exactly).
        """
        req = self._get(request_id)
        tokens = _tokens(tokens, "tokens")
        _time(now_s)
        left = req.total - req.cached - req.done
        if tokens > left:
            raise ValueError(
                f"tokens: request {request_id!r} has {left} tokens left to prefill, got {tokens}"
            )
        self._advance(req, req.done + tokens)
        return left - tokens

    def reassign(self, request_id: Hashable, rank: int, *, now_s: float) -> None:
        """Record that an engine moved a request that has not started to another of its ranks.

        Engines that share work among their ranks (an idle rank takes a sibling's queued
        request at a step's start) report each move here, so that the ledger stays exact: the
        request's remaining quota moves from its old rank's load to ``rank``'s, and it joins
        the end of that rank's queue in the ledger. Moving a request to its own rank does
        nothing.

        Parameters
        ----------
        request_id : int or str
        rank : int
            The new rank, in ``[0, ranks_per_engine)``, of the same engine.
        now_s : float

        Raises
        ------
        KeyError
            Unknown request id.
        ValueError
            A rank out of range, or a request with reported progress (a started request holds
            its KV cache on its rank and cannot move). Nothing changes then.

        Runtime complexity: O(requests on the two ranks) (their loads are re-summed exactly).
        """
        req = self._get(request_id)
        if not (type(rank) is int and 0 <= rank < self._ranks):
            rank = check_int(rank, "rank", min_value=0, max_value=self._ranks - 1)
        _time(now_s)
        if req.done:
            raise ValueError(
                f"request_id: request {request_id!r} has started ({req.done} tokens prefilled) "
                "and cannot move to another rank"
            )
        old = req.rank
        new = (old // self._ranks) * self._ranks + rank
        if new == old:
            return
        del self._queues[old][req.rid]
        self._queues[new][req.rid] = req
        req.rank = new
        for f in (old, new):
            self._resum(f)
        self._counts["reassigned"] += 1

    def finish(self, request_id: Hashable, *, now_s: float) -> int:
        """Remove a request from the ledger (finished, or aborted by the caller).

        Returns
        -------
        int
            Tokens that were never reported done (0 for a request that completed normally).
        """
        req = self._get(request_id)
        _time(now_s)
        left = req.total - req.cached - req.done
        self._drop(req)
        self._counts["finished"] += 1
        self._maybe_join(req.rank // self._ranks)
        return left

    def record(self, request_ids: Any, tokens: Any, finished: Any, /, *, now_s: float) -> int:
        """Record a batch of progress and completions, as ``chunk_done`` then ``finish`` would.

        Entry ``i`` says that ``tokens[i]`` more tokens of ``request_ids[i]`` were prefilled,
        and, if ``finished[i]``, that the request then left (finished or aborted). An id may
        appear several times (later entries continue from earlier ones) but not after its
        finishing entry. The batch is validated as a whole first: if any entry is bad, nothing
        is applied. The final state equals that of the equivalent sequence of ``chunk_done``
        and ``finish`` calls; each touched rank's load is re-summed once, which makes a batch
        much cheaper than the calls one by one.

        Parameters
        ----------
        request_ids : sequence of int or str, length n
        tokens : sequence of int, length n
            Tokens prefilled since the request's previous record (>= 0).
        finished : sequence of bool, length n
        now_s : float

        Returns
        -------
        int
            Requests that left the ledger.

        Raises
        ------
        KeyError
            Unknown request id (or an id recorded after its finishing entry).
        ValueError, TypeError
            Sequences of different lengths, bad token counts, or more tokens than a request has
            left.

        Runtime complexity: O(n + requests on the touched ranks).
        """
        _time(now_s)
        ids = list(request_ids.tolist() if isinstance(request_ids, np.ndarray) else request_ids)
        toks = list(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
        fins = list(finished.tolist() if isinstance(finished, np.ndarray) else finished)
        if not len(ids) == len(toks) == len(fins):
            raise ValueError(
                "request_ids, tokens, finished: must have the same length, got "
                f"{len(ids)}, {len(toks)} and {len(fins)}"
            )
        requests = self._requests
        done: dict[int, int] = {}
        gone: set[int] = set()
        entries: list[tuple[_Request, int, bool]] = []
        for rid, tok, fin in zip(ids, toks, fins, strict=True):
            req = requests.get(rid) if isinstance(rid, (int, str)) else None
            if req is None or id(req) in gone:
                raise KeyError(f"request_id: unknown request {rid!r}")
            if not (type(tok) is int and tok >= 0):
                tok = _tokens(tok, "tokens")
            key = id(req)
            d = done.get(key, req.done) + tok
            if d > req.total - req.cached:
                raise ValueError(
                    f"tokens: request {rid!r} has {req.total - req.cached - d + tok} tokens left "
                    f"to prefill, got {tok}"
                )
            done[key] = d
            fin = bool(fin)
            if fin:
                gone.add(key)
            entries.append((req, tok, fin))
        touched: set[int] = set()
        quota = self._quota
        n_fin = 0
        for req, tok, fin in entries:
            if tok:
                req.done += tok
                req.quota = quota(req.total - req.cached - req.done, req.cached + req.done)
            touched.add(req.rank)
            if fin:
                del requests[req.rid]
                del self._queues[req.rank][req.rid]
                n_fin += 1
        for f in touched:
            self._resum(f)
        self._counts["finished"] += n_fin
        if n_fin:
            for e in sorted({f // self._ranks for f in touched}):
                self._maybe_join(e)
        return n_fin

    def _drop(self, req: _Request) -> None:
        del self._requests[req.rid]
        del self._queues[req.rank][req.rid]
        self._resum(req.rank)

    def _resum(self, flat: int) -> None:
        """Re-sum a rank's quota load, step-time work and request count from its queue (exact
        sums: no cancellation error builds up)."""
        queue = self._queues[flat]
        slot = self._slot[flat]
        if queue:
            self._load[slot] = math.fsum(r.quota for r in queue.values())
            moe = self._moe
            self._work[slot] = math.fsum(
                r.quota + moe * (r.total - r.cached - r.done) for r in queue.values()
            )
        else:
            self._load[slot] = 0.0
            self._work[slot] = 0.0
        self._count[slot] = len(queue)

    def _engine_requests(self, engine: int) -> int:
        r = self._ranks
        return sum(len(self._queues[f]) for f in range(engine * r, engine * r + r))

    def _maybe_join(self, engine: int) -> None:
        if self._state[engine] == _DRAINING and self._engine_requests(engine) == 0:
            self._state[engine] = _ACTIVE
            self._rebuild()

    # ------------------------------------------------------------------ rounds
    def end_round(self, now_s: float) -> RoundResult:
        """Close the round: update the demand EMA and move engines between buckets.

        The round's demand per bucket is the quota routed to it divided by the round's length.
        Engines are re-planned by :func:`rebalance` over the engines in service; engines that
        move stop taking work and join their new bucket once drained (at once if idle). Under
        ``max_drain_s``, engines holding more work than that stay. Under ``cold_start_s``, the
        first round's re-plan ignores the deadband and ``max_moves``.

        Raises
        ------
        ValueError
            ``now_s`` not after the start of the round.
        """
        now = _time(now_s)
        elapsed = now - self._round_start
        if not elapsed > 0:
            raise ValueError(
                f"now_s: must be after the start of the round ({self._round_start}), got {now}"
            )
        rate = np.asarray(self._round_quota) / elapsed
        if self._counts["rounds"] == 0:
            self._demand = rate
        else:
            self._demand = self._alpha * rate + (1.0 - self._alpha) * self._demand
        bucket = np.where(self._state == _OUT, -1, self._home)
        in_service = int((bucket >= 0).sum())
        r = self._ranks
        flat = self.rank_loads().reshape(self._num_engines, r)
        engine_load = flat.sum(axis=1)
        movable = self._state == _ACTIVE
        if self._max_drain is not None:
            movable &= flat.max(axis=1) <= self._max_drain
        cold = self._cold is not None and self._counts["rounds"] == 0
        result = None
        if in_service:
            kwargs = dict(
                now_s=now,
                last_move_s=self._last_move,
                movable=movable,
                engine_load=np.maximum(engine_load, 0.0),
                deadband=self._deadband,
                max_moves=self._num_engines if cold else self._max_moves,
                min_dwell_s=self._min_dwell_s,
                method=self._method,
                force=cold,
            )
            try:
                result = rebalance(
                    bucket, self._demand, min_engines=self._min_engines,
                    max_engines=self._max_engines, **kwargs,
                )  # fmt: skip
            except ValueError:  # bounds infeasible with the engines now in service
                result = rebalance(bucket, self._demand, **kwargs)
            for mv in result.moves:
                self._home[mv.engine] = mv.to_bucket
                self._last_move[mv.engine] = now
                busy = self._engine_requests(mv.engine) > 0
                self._state[mv.engine] = _DRAINING if busy else _ACTIVE
            self._counts["moves"] += len(result.moves)
            self._rebuild()
        self._counts["rounds"] += 1
        self._round_quota = [0.0] * self.num_buckets
        self._round_start = now
        counts = np.bincount(self._home[self._state != _OUT], minlength=self.num_buckets)
        if result is None:
            return RoundResult((), tuple(self._demand.tolist()), tuple(counts.tolist()),
                               float("inf"), float("inf"))  # fmt: skip
        return RoundResult(
            result.moves,
            tuple(self._demand.tolist()),
            tuple(counts.tolist()),
            result.bottleneck_before,
            result.bottleneck_after,
        )

    # ------------------------------------------------------------------ engines
    def _engine_iv(self, engine: Any) -> int:
        return check_int(engine, "engine", min_value=0, max_value=self._num_engines - 1)

    def remove_engine(
        self, engine: int, *, now_s: float
    ) -> tuple[tuple[Hashable, RouteDecision], ...]:
        """Take an engine out of service; re-route its requests and return where they went.

        The requests restart their uncached tokens elsewhere (prefill progress on the removed
        engine is lost). If no engine is left in service they are handed back: removed from the
        ledger and returned with reason ``"no_engine"``.

        Raises
        ------
        ValueError
            Unknown engine or an engine already out of service.
        """
        engine = self._engine_iv(engine)
        _time(now_s)
        if self._state[engine] == _OUT:
            raise ValueError(f"engine: {engine} is already out of service")
        self._state[engine] = _OUT
        self._rebuild()
        r = self._ranks
        moved: list[tuple[Hashable, RouteDecision]] = []
        for f in range(engine * r, engine * r + r):
            for req in list(self._queues[f].values()):
                self._drop(req)
                slot, reason, _ = self._choose(req.bucket, req.total, req.cached, None)
                if slot < 0:
                    self._counts["handed_back"] += 1
                    moved.append((req.rid, RouteDecision(-1, -1, req.bucket, reason)))
                    continue
                req.done = 0
                req.quota = self._quota(req.total - req.cached, req.cached)
                req.rank = self._rank_at[slot]
                self._requests[req.rid] = req
                self._queues[req.rank][req.rid] = req
                self._resum(req.rank)
                self._counts["rerouted"] += 1
                moved.append(
                    (req.rid, RouteDecision(req.rank // r, req.rank % r, req.bucket, reason))
                )
        return tuple(moved)

    def restore_engine(self, engine: int, *, now_s: float, bucket: int | None = None) -> None:
        """Put an engine back into service, in its previous bucket or in ``bucket``.

        Raises
        ------
        ValueError
            Unknown engine or bucket, or an engine that is in service.
        """
        engine = self._engine_iv(engine)
        now = _time(now_s)
        if self._state[engine] != _OUT:
            raise ValueError(f"engine: {engine} is in service")
        if bucket is not None:
            bucket = check_int(bucket, "bucket", min_value=0, max_value=self.num_buckets - 1)
            if bucket != self._home[engine]:
                self._home[engine] = bucket
                self._last_move[engine] = now
        self._state[engine] = _ACTIVE
        self._rebuild()

    # ------------------------------------------------------------------ reports
    def report(
        self, engine: int, seq: int, progress: Mapping[Hashable, int], *, now_s: float
    ) -> ReportResult:
        """Reconcile the ledger with an engine's report of its requests' progress.

        Parameters
        ----------
        engine : int
        seq : int
            Sequence number of the report (>= 0); a report not newer than the last accepted
            one from this engine is stale and ignored.
        progress : mapping of request id to int
            Cumulative prefilled tokens of each request the engine holds.
        now_s : float

        Returns
        -------
        ReportResult
            Reported progress beyond the ledger's is applied (progress never goes back: a
            report older than a ``chunk_done`` call does not undo it). ``drift_s`` measures the
            disagreement before reconciliation.

        Raises
        ------
        ValueError
            Bad engine or sequence number, or reported tokens outside ``[0, uncached tokens]``
            (nothing is applied then).
        """
        engine = self._engine_iv(engine)
        seq = check_int(seq, "seq", min_value=0)
        _time(now_s)
        if not isinstance(progress, Mapping):
            raise TypeError(
                "progress: must be a mapping of request id to tokens, got "
                f"{type(progress).__name__}"
            )
        if seq <= self._seq[engine]:
            self._counts["reports_stale"] += 1
            return ReportResult(False, 0.0, (), ())
        r = self._ranks
        ranks = range(engine * r, engine * r + r)
        known: list[tuple[_Request, int]] = []
        unknown: list[Hashable] = []
        for rid, tokens in progress.items():
            req = self._requests.get(rid) if isinstance(rid, (int, str)) else None
            if req is None or req.rank not in ranks:
                unknown.append(rid)
                continue
            tokens = _tokens(tokens, f"progress[{rid!r}]")
            if tokens > req.total - req.cached:
                raise ValueError(
                    f"progress[{rid!r}]: must be <= the request's uncached tokens "
                    f"({req.total - req.cached}), got {tokens}"
                )
            known.append((req, tokens))
        self._seq[engine] = seq
        drift = 0.0
        for req, tokens in known:
            reported = self._quota(req.total - req.cached - tokens, req.cached + tokens)
            drift += abs(req.quota - reported)
            if tokens > req.done:
                self._advance(req, tokens)
        seen = {id(req) for req, _ in known}
        missing = tuple(
            rid for f in ranks for rid, req in self._queues[f].items() if id(req) not in seen
        )
        self._counts["reports_accepted"] += 1
        self._drift_last = drift
        self._drift_max = max(self._drift_max, drift)
        return ReportResult(True, drift, tuple(unknown), missing)

    # ------------------------------------------------------------------ planning
    def plan_engine(
        self, engine: int, *, budget_s: float, min_chunk: int = 1, align: int = 1
    ) -> EnginePlan:
        """Plan one synchronous step of an engine: :func:`plan_chunks` on each rank's queue.

        Requests with nothing left to prefill are skipped. Does not change the ledger; report
        the work with :meth:`chunk_done` once the step ran.
        """
        engine = self._engine_iv(engine)
        r = self._ranks
        ids: list[tuple[Hashable, ...]] = []
        plans: list[ChunkPlan] = []
        for f in range(engine * r, engine * r + r):
            todo = [q for q in self._queues[f].values() if q.total - q.cached - q.done > 0]
            plan = plan_chunks(
                [q.total - q.cached - q.done for q in todo],
                [q.cached + q.done for q in todo],
                cost=self._cost,
                budget_s=budget_s,
                min_chunk=min_chunk,
                align=align,
            )
            ids.append(tuple(q.rid for q in todo[: len(plan.chunk_tokens)]))
            plans.append(plan)
        step = max(p.step_time_s for p in plans)
        return EnginePlan(tuple(ids), tuple(plans), step)

    # ------------------------------------------------------------------ introspection
    def statistics(self) -> PrefillStatistics:
        """A snapshot of demand, engines, loads and counters (see :class:`PrefillStatistics`)."""
        nb = self.num_buckets
        active = self._state == _ACTIVE
        queued = [0] * nb
        parts: list[list[float]] = [[] for _ in range(nb)]
        for req in self._requests.values():
            queued[req.bucket] += 1
            parts[req.bucket].append(req.quota)
        qquota = [math.fsum(p) for p in parts]  # exact: independent of the ledger's order
        c = self._counts
        return PrefillStatistics(
            bucket_demand=tuple(self._demand.tolist()),
            bucket_round_quota=tuple(self._round_quota),
            bucket_engines=tuple(np.bincount(self._home[active], minlength=nb).tolist()),
            bucket_draining=tuple(
                np.bincount(self._home[self._state == _DRAINING], minlength=nb).tolist()
            ),
            bucket_server=tuple(self._server),
            bucket_queued=tuple(queued),
            bucket_queued_quota=tuple(qquota),
            rank_load=tuple(self.rank_loads().tolist()),
            engine_bucket=tuple(self._home.tolist()),
            engine_state=tuple(_STATE_NAMES[s] for s in self._state.tolist()),
            queued=len(self._requests),
            routed=c["routed"],
            finished=c["finished"],
            refused=c["refused"],
            handed_back=c["handed_back"],
            rerouted=c["rerouted"],
            moves=c["moves"],
            rounds=c["rounds"],
            reports_accepted=c["reports_accepted"],
            reports_stale=c["reports_stale"],
            drift_last_s=self._drift_last,
            drift_max_s=self._drift_max,
            reassigned=c["reassigned"],
        )

    def _check(self) -> None:
        """Assert every internal invariant (for tests; O(requests + ranks))."""
        n = self.num_ranks
        nb = self.num_buckets
        r = self._ranks
        assert sorted(self._rank_at) == list(range(n)), "slots are not a permutation"
        assert all(self._rank_at[self._slot[f]] == f for f in range(n)), "slot maps disagree"
        flat = self.rank_loads()
        seen = 0
        for f, queue in enumerate(self._queues):
            total = 0.0
            scale = 0.0
            for rid, req in queue.items():
                assert self._requests.get(rid) is req, f"request {rid!r} on rank {f} not in ledger"
                assert req.rank == f, f"request {rid!r} records rank {req.rank}, queued on {f}"
                assert 0 <= req.done <= req.total - req.cached, f"request {rid!r} progress"
                assert 0 <= req.cached <= req.total and req.total >= 1
                assert req.bucket == bisect.bisect_right(self._edges, req.total)
                want = self._quota(req.total - req.cached - req.done, req.cached + req.done)
                assert math.isclose(req.quota, want, rel_tol=1e-12, abs_tol=0.0)
                total += req.quota
                scale = max(scale, req.quota)
                seen += 1
            tol = 1e-9 * max(scale, 1e-300) * (len(queue) + 1)
            assert abs(flat[f] - total) <= tol, f"rank {f}: load {flat[f]} != quota sum {total}"
            if not queue:
                assert flat[f] == 0.0, f"rank {f}: empty queue with load {flat[f]}"
            engine = f // r
            assert not (queue and self._state[engine] == _OUT), f"engine {engine} is out, busy"
        assert seen == len(self._requests), "a request is in the ledger but in no queue"
        for e in range(self._num_engines):
            if self._state[e] == _DRAINING:
                assert self._engine_requests(e) > 0, f"engine {e} drains an empty queue"
        assert ((self._home >= 0) & (self._home < nb)).all()
        active = self._state == _ACTIVE
        counts = np.bincount(self._home[active], minlength=nb)
        assert self._server == _serving(counts).tolist(), "serving map is stale"
        for j in range(nb):
            h = self._server[j]
            members = sorted(self._rank_at[self._lo[j] : self._hi[j]])
            want = [f for e in np.flatnonzero(active & (self._home == h)).tolist()
                    for f in range(e * r, e * r + r)] if h >= 0 else []  # fmt: skip
            assert members == want, f"bucket {j}: routing slice is stale"
            if active.any():
                assert self._hi[j] > self._lo[j], f"bucket {j} has no engine to serve it"
        c = self._counts
        assert c["routed"] == len(self._requests) + c["finished"] + c["handed_back"], (
            "routed requests are not all queued, finished or handed back"
        )

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The configuration and state as JSON-serialisable plain types.

        Request ids must be ints or strs (``route`` enforces it). ``from_state_dict`` of the
        result continues exactly where this balancer stands, including the sampling rng.
        """
        c = self._cost
        return {
            "version": _STATE_VERSION,
            "config": {
                "num_engines": self._num_engines,
                "ranks_per_engine": self._ranks,
                "cost": {
                    "a": c.a,
                    "b": c.b,
                    "k": c.k,
                    "q": c.q,
                    "gamma": c.gamma,
                    "b_moe": c.b_moe,
                    "moe_lb": c.moe_lb,
                },
                "edges": list(self._edges),
                "round_s": self._round_s,
                "ema_alpha": self._alpha,
                "deadband": self._deadband,
                "max_moves": self._max_moves,
                "min_dwell_s": self._min_dwell_s,
                "method": self._method,
                "min_engines": None if self._min_engines is None else self._min_engines.tolist(),
                "max_engines": None if self._max_engines is None else self._max_engines.tolist(),
                "spill_ratio": self._spill,
                "sample": self._sample,
                "cold_start_s": self._cold,
                "max_drain_s": self._max_drain,
                "wake_penalty_s": self._wake,
                "fill_holes": self._fill,
                "context_parallel": self._cp,
                "rank_rule": self._rule,
                "step_budget_s": float(self._coef[C_BUDGET]),
                "growth_weight": float(self._coef[C_GROWTH]),
                "idle_growth_weight": float(self._coef[C_IDLE_GROWTH]),
            },
            "state": {
                "engine_bucket": self._home.tolist(),
                "engine_state": self._state.tolist(),
                "last_move_s": [None if t == -np.inf else t for t in self._last_move.tolist()],
                "seq": self._seq.tolist(),
                "rank_load": self.rank_loads().tolist(),
                "requests": [
                    [q.rid, q.rank, q.total, q.cached, q.done, q.quota]
                    for queue in self._queues
                    for q in queue.values()
                ],
                "round_quota": list(self._round_quota),
                "round_start_s": self._round_start,
                "demand": self._demand.tolist(),
                "counts": dict(self._counts),
                "drift_last_s": self._drift_last,
                "drift_max_s": self._drift_max,
                "rng": self._rng.bit_generator.state,
            },
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrefillBalancer:
        """Rebuild a balancer from :meth:`state_dict` output (e.g. after ``json.loads``).

        Raises
        ------
        ValueError
            Unknown version or an inconsistent state (checked with :meth:`_check`).
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"state: expected a state_dict of version {_STATE_VERSION}")
        cfg = dict(state["config"])
        cfg["cost"] = QuadraticCost(**cfg["cost"])
        s = state["state"]
        nb = len(cfg["edges"]) + 1
        home = np.asarray(s["engine_bucket"], dtype=np.int64)
        initial = np.bincount(home, minlength=nb)
        bal = cls(
            cfg.pop("num_engines"), cfg.pop("ranks_per_engine"), initial_engines=initial,
            now_s=s["round_start_s"], **cfg,
        )  # fmt: skip
        bal._home = home
        bal._state = np.asarray(s["engine_state"], dtype=np.int8)
        bal._last_move = np.asarray(
            [-np.inf if t is None else t for t in s["last_move_s"]], dtype=np.float64
        )
        bal._seq = np.asarray(s["seq"], dtype=np.int64)
        bal._rebuild()
        load = np.asarray(s["rank_load"], dtype=np.float64)
        bal._load = load[np.asarray(bal._rank_at, dtype=np.int64)]
        edges = bal._edges
        for rid, rank, total, cached, done, quota in s["requests"]:
            bucket = bisect.bisect_right(edges, total)
            req = _Request(rid, rank, bucket, total, cached, done, quota)
            if rid in bal._requests:
                raise ValueError(f"state: request {rid!r} appears twice")
            bal._requests[rid] = req
            bal._queues[rank][rid] = req
        for f in range(bal.num_ranks):
            bal._resum(f)
        bal._load = load[np.asarray(bal._rank_at, dtype=np.int64)]  # as saved (checked below)
        bal._round_quota = [float(x) for x in s["round_quota"]]
        bal._demand = np.asarray(s["demand"], dtype=np.float64)
        bal._counts = {**bal._counts, **s["counts"]}
        bal._drift_last = float(s["drift_last_s"])
        bal._drift_max = float(s["drift_max_s"])
        bal._rng.bit_generator.state = s["rng"]
        try:
            bal._check()
        except AssertionError as exc:
            raise ValueError(f"state: inconsistent state ({exc})") from None
        return bal
