"""The control plane of :class:`~lbkit.prefill.PrefillBalancer`: everything beyond one request.

:class:`PoolControl` holds the balancer's methods that act on the pool rather than on a request,
which :class:`~lbkit.prefill.PrefillBalancer` inherits (``balancer.py`` has the request path:
``route``, ``chunk_done``, ``reassign``, ``finish``, ``record``, ``plan_engine``):

- **set_foreign_load / foreign_load**: the load other routers queued on the ranks
  (:mod:`~lbkit.prefill.foreign`);
- **round_due / end_round**: close a round, EMA-smooth its demand and move engines between
  buckets (:mod:`~lbkit.prefill.rounds`; with a store, the round's leader plans for the fleet);
- **remove_engine / restore_engine**: an engine out of service (its requests re-routed and
  returned) and back (:class:`~lbkit.prefill.pool.EnginePool`);
- **report**: reconcile the ledger with an engine's report of its requests' progress;
- **step_started**: an engine's report that it started a step, and how long the step will last
  (the lockstep rule waits out the rest of it).

Engine reports
--------------
An engine reports, with an increasing sequence number, the cumulative prefilled tokens of the
requests it holds (not bare per-rank loads: a load alone cannot say which request progressed,
so it could not be reconciled into a per-request ledger). Progress is monotone, so a report only
ever moves a request forward; a report whose sequence number is not newer than the last accepted
one is stale and ignored. ``drift_s`` is how far the ledger's remaining quota was from the
report's before reconciliation, summed over the reported requests.

Step reports
------------
An engine's ranks step together, and a request that reaches an engine during a step joins the
next one. So where a request finishes first depends on when each engine's running step ends:
engines are out of phase with each other, and on a busy pool a short prompt finishes soonest on
the engine whose step ends next. The router cannot see the phases from its ledger; an engine
tells it at each step's start (``step_started``, with the step's planned duration, which the
engine knows from its plan, e.g. :meth:`PrefillBalancer.plan_engine`'s ``step_time_s``, or
from the cost model). The lockstep rule then scores the engine's ranks with the rest of that
step (:mod:`~lbkit.prefill.lockstep`). Without reports every engine counts as between steps,
the rule as it was. A report older than the engine's last one (by start time) is stale and
ignored (reports may cross on the way).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from lbkit.core.engines import OUT
from lbkit.core.replica import ReplicaLink
from lbkit.core.validation import check_int, check_real
from lbkit.prefill.foreign import ForeignLoad, foreign_iv
from lbkit.prefill.ledger import Ledger, as_time
from lbkit.prefill.options import RankChoice, Rounds
from lbkit.prefill.pool import EnginePool
from lbkit.prefill.results import ReportResult, RoundResult, RouteDecision
from lbkit.prefill.rounds import replan, smoothed_demand

__all__ = ["PoolControl"]


class PoolControl:
    """The pool-level methods of :class:`~lbkit.prefill.PrefillBalancer` (module docstring).

    Not used on its own: it works on the state the balancer's ``__init__`` sets, declared here,
    and calls the balancer's ``_engine_iv``, ``_choose``, ``_pull`` and ``_push``.
    """

    _num_engines: int
    _ranks: int
    _choice: RankChoice
    _rounds: Rounds
    _min_engines: np.ndarray | None
    _max_engines: np.ndarray | None
    _ledger: Ledger
    _pool: EnginePool
    _link: ReplicaLink | None
    _counts: dict[str, int]
    _round_quota: list[float]
    _round_start: float
    _demand: np.ndarray
    _drift_last: float
    _drift_max: float

    # ------------------------------------------------------------------ foreign load
    def foreign_load(self) -> ForeignLoad:
        """The foreign load in force, per flat rank (copies; zeros until
        :meth:`set_foreign_load`)."""
        return ForeignLoad(*self._ledger.foreign())

    def own_load(self) -> ForeignLoad:
        """This ledger's own load per flat rank (copies; without the foreign load), in the
        shape that :meth:`set_foreign_load` takes: what this router contributes to another
        router's foreign load.

        Examples
        --------
        >>> from lbkit.core import PRESETS
        >>> from lbkit.prefill import PrefillBalancer
        >>> bal = PrefillBalancer(1, 2, cost=PRESETS["unit"].prefill)
        >>> _ = bal.route("a", 100, now_s=0.0)
        >>> bal.own_load().num_requests.tolist()
        [1, 0]
        """
        return ForeignLoad(*self._ledger.own_flat())

    def set_foreign_load(self, *, quota_s: Any, work_s: Any, num_requests: Any) -> None:
        """Set the load that other routers queued on the ranks (replacing the previous one).

        It counts in every later routing decision (each rule reads the ledger's sums plus this
        load) and in :meth:`end_round`'s re-plan, but in no request of the ledger
        (:mod:`lbkit.prefill.foreign`).

        Parameters
        ----------
        quota_s : array_like of float, shape (num_ranks,)
            Remaining quota of other routers' requests per flat rank, seconds (>= 0).
        work_s : array_like of float, shape (num_ranks,)
            Their step-time work (quota plus routed-expert seconds of the remaining tokens),
            seconds (>= 0).
        num_requests : array_like of int, shape (num_ranks,)
            Their requests per flat rank (>= 0).

        Raises
        ------
        ValueError, TypeError
            A wrong shape, a negative, non-finite or (for requests) non-integer value; nothing
            changes.

        Runtime complexity: O(requests + ranks) (every rank's sums are re-summed).

        Examples
        --------
        >>> from lbkit.core import PRESETS
        >>> from lbkit.prefill import PrefillBalancer, RankChoice
        >>> bal = PrefillBalancer(2, 1, cost=PRESETS["h800_dsv3"].prefill,
        ...                       choice=RankChoice(rule="least_load"))
        >>> bal.set_foreign_load(quota_s=[2.0, 0.0], work_s=[2.5, 0.0], num_requests=[1, 0])
        >>> bal.route("a", 1000, now_s=0.0).engine
        1
        >>> bal.rank_loads().tolist()[0], bal.statistics().rank_foreign_load
        (0.0, (2.0, 0.0))
        """
        new = foreign_iv(quota_s, work_s, num_requests, self.num_ranks)
        self._ledger.set_foreign(*new)

    # ------------------------------------------------------------------ rounds
    def round_due(self, now_s: float) -> bool:
        """Whether the current round is over: ``round_s`` seconds (``cold_start_s`` for the
        first round under a cold start) have passed since it started."""
        length = self._rounds.round_s
        if self._rounds.cold_start_s is not None and self._counts["rounds"] == 0:
            length = self._rounds.cold_start_s
        return as_time(now_s) - self._round_start >= length

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
        now = as_time(now_s)
        elapsed = now - self._round_start
        if not elapsed > 0:
            raise ValueError(
                f"now_s: must be after the start of the round ({self._round_start}), got {now}"
            )
        first = self._counts["rounds"] == 0
        quota = self._round_quota
        if self._link is not None:  # the fleet's demand, summed in the store
            self._pull()
            quota = self._link.round_demand(quota)
        self._demand = smoothed_demand(self._rounds, self._demand, quota, elapsed, first)
        loads = self._ledger.total_loads().reshape(self._num_engines, self._ranks)
        pool = self._pool
        result = replan(self._rounds, pool.home, pool.state, pool.last_move, loads,
                        self._demand, now_s=now, first=first, min_engines=self._min_engines,
                        max_engines=self._max_engines)  # fmt: skip
        if self._link is not None:  # the leader publishes its plan, a follower applies it
            result = self._link.round_plan(result, pool.home, pool.state != OUT)
        if result is not None:
            pool.move(result.moves, now)
            self._counts["moves"] += len(result.moves)
        self._counts["rounds"] += 1
        self._round_quota = [0.0] * self.num_buckets
        self._round_start = now
        counts = pool.counts()
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
        now = as_time(now_s)
        self._pool.take_out(engine)
        r = self._ranks
        led = self._ledger
        moved: list[tuple[Hashable, RouteDecision]] = []
        for f in range(engine * r, engine * r + r):
            for req in list(led.queues[f].values()):
                led.drop(req)
                slot, reason, _ = self._choose(req.bucket, req.total, req.cached, None, now)
                if slot < 0:
                    self._counts["handed_back"] += 1
                    moved.append((req.rid, RouteDecision(-1, -1, req.bucket, reason)))
                    continue
                req.done = 0
                req.quota = led.quota(req.total - req.cached, req.cached)
                req.rank = led.rank_at[slot]
                led.add(req)
                self._counts["rerouted"] += 1
                moved.append(
                    (req.rid, RouteDecision(req.rank // r, req.rank % r, req.bucket, reason))
                )
        self._push()
        return tuple(moved)

    def restore_engine(self, engine: int, *, now_s: float, bucket: int | None = None) -> None:
        """Put an engine back into service, in its previous bucket or in ``bucket``.

        Raises
        ------
        ValueError
            Unknown engine or bucket, or an engine that is in service.
        """
        engine = self._engine_iv(engine)
        now = as_time(now_s)
        self._pool.put_back(engine, bucket, now)

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
        as_time(now_s)
        if not isinstance(progress, Mapping):
            raise TypeError(
                "progress: must be a mapping of request id to tokens, got "
                f"{type(progress).__name__}"
            )
        if seq <= self._pool.seq[engine]:
            self._counts["reports_stale"] += 1
            return ReportResult(False, 0.0, (), ())
        known, unknown = self._ledger.reported(engine, progress)
        self._pool.seq[engine] = seq
        drift, missing = self._ledger.reconcile(engine, known)
        self._counts["reports_accepted"] += 1
        self._drift_last = drift
        self._drift_max = max(self._drift_max, drift)
        self._push()
        return ReportResult(True, drift, unknown, missing)

    def step_started(self, engine: int, duration_s: float | None = None, *, now_s: float) -> bool:
        """Record that ``engine`` started a step at ``now_s``, planned to last ``duration_s``.

        Until ``now_s + duration_s`` the lockstep rule adds the rest of the step to the score of
        the engine's ranks (a request routed there joins the next step; module docstring).

        Parameters
        ----------
        engine : int
        duration_s : float, optional
            The step's planned duration, seconds (>= 0, finite). Default: the balancer's own
            plan of the engine's queues, :meth:`plan_engine` under
            ``RankChoice.step_budget_s`` (O(requests of the engine)).
        now_s : float
            When the step started.

        Returns
        -------
        bool
            Whether the report was taken; ``False``: an engine's report older than its last one
            (an earlier ``now_s``), ignored and counted in ``statistics().steps_stale``.

        Raises
        ------
        ValueError
            A bad engine index, a negative or non-finite duration or time (nothing changes).

        Runtime complexity: O(1) with ``duration_s``.

        Examples
        --------
        >>> from lbkit.core import PRESETS
        >>> from lbkit.prefill import PrefillBalancer
        >>> bal = PrefillBalancer(2, 1, cost=PRESETS["h800_dsv3"].prefill)
        >>> [bal.route(i, 60000, 0, now_s=0.0).engine for i in "ab"]  # 9 s of work each
        [0, 1]
        >>> bal.step_started(0, 1.0, now_s=0.0), bal.step_started(1, 1.0, now_s=0.5)
        (True, True)

        At 0.6 s engine 0's step ends 0.4 s from now, engine 1's 0.9 s: a short prompt goes to
        engine 0, whose next step starts first.

        >>> bal.route("c", 1000, 0, now_s=0.6).engine
        0
        """
        engine = self._engine_iv(engine)
        now = as_time(now_s)
        if duration_s is not None:
            duration = check_real(duration_s, "duration_s", min_value=0.0)
        else:
            duration = self.plan_engine(engine, budget_s=self._choice.step_budget_s).step_time_s
        if not math.isfinite(now + duration):
            raise ValueError(f"duration_s: the step must end at a finite time, got {duration}")
        pool = self._pool
        if now < pool.step_start[engine]:
            self._counts["steps_stale"] += 1
            return False
        pool.start_step(engine, now, now + duration)
        self._counts["steps_reported"] += 1
        return True
