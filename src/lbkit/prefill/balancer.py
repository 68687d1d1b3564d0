"""``PrefillBalancer``: the stateful prefill router that a serving front end embeds.

The class is a façade over the modules of this package; a newcomer can read it top to bottom.
This file holds its set-up and the request path; :class:`~lbkit.prefill.control.PoolControl`
(``control.py``), which it inherits, the methods that act on the pool:

- options (:mod:`~lbkit.prefill.options`): :class:`RankChoice`, :class:`Buckets`,
  :class:`Rounds`, frozen and self-validating; the defaults are what ``lbkit bench`` measures.
  The old keyword options still work, with a ``DeprecationWarning``
  (:mod:`~lbkit.prefill.legacy`);
- **route** a request to its length bucket (:func:`bucket_of`), then to a rank of the engines
  serving that bucket by the :class:`RankChoice` rule (:mod:`~lbkit.prefill.choice`), charging
  the rank the request's quota (:meth:`QuadraticCost.quota` of its uncached tokens);
- **chunk_done / finish / record / reassign** record progress in the ledger
  (:mod:`~lbkit.prefill.ledger`: the per-request quotas and the per-rank sums);
- **plan_engine** runs :func:`plan_chunks` on each rank's FIFO queue;
- **statistics / _check / state_dict / from_state_dict** (:mod:`~lbkit.prefill.results`,
  :mod:`~lbkit.prefill.persistence`);
- in ``control.py``: **end_round** re-plans the engines of each bucket from the round's demand,
  EMA-smoothed (:func:`rebalance`: Adams' apportionment under hysteresis); **remove_engine /
  restore_engine** take an engine out of service (its requests are re-routed and returned, none
  lost) and back; **report** ingests engine-reported progress by sequence number (stale reports
  are ignored) and measures how far the ledger had drifted; **set_foreign_load** adds the load
  other routers queued on the ranks (router replicas in front of one pool;
  :mod:`~lbkit.prefill.foreign`): it counts in every decision, in no request.

The engines' buckets, service states (:mod:`lbkit.core.engines`, shared with the decode
balancer) and routing layout are an :class:`~lbkit.prefill.pool.EnginePool` (``pool.py``:
moving engines drain first). With a store shared by router replicas, the ledger's load is
published and the others' viewed through :func:`~lbkit.prefill.foreign.store_columns` and
:func:`~lbkit.prefill.foreign.set_from_store`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable
from typing import Any

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.replica import ReplicaLink, Store, replica_id_iv
from lbkit.core.validation import as_rng, check_int
from lbkit.prefill.apportion import allocate_engines
from lbkit.prefill.choice import RankChooser
from lbkit.prefill.chunking import ChunkPlan, plan_chunks
from lbkit.prefill.control import PoolControl
from lbkit.prefill.foreign import set_from_store, store_columns
from lbkit.prefill.ledger import (
    Ledger,
    Request,
    as_request_id,
    as_time,
    as_tokens,
    hits_iv,
    route_iv,
)
from lbkit.prefill.legacy import from_keywords
from lbkit.prefill.options import Buckets, RankChoice, Rounds
from lbkit.prefill.persistence import COUNTERS, Persistent
from lbkit.prefill.pool import EnginePool
from lbkit.prefill.results import (
    EnginePlan,
    PrefillStatistics,
    RouteDecision,
)

__all__ = ["PrefillBalancer"]


class PrefillBalancer(PoolControl, Persistent):
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
    choice : RankChoice, default ``RankChoice()``
        How a request picks its rank: the lockstep rule by default.
    buckets : Buckets, default ``Buckets()``
        Length buckets and per-bucket engine bounds: one bucket by default. The bounds' sums
        are checked against ``num_engines`` here.
    rounds : Rounds, default ``Rounds()``
        Re-planning of engines between buckets (nothing moves with one bucket).
    rng : numpy Generator, int seed or None
        Randomness for ``RankChoice.sample``.
    now_s : float, default 0
        Start of the first round, seconds.
    store : Store, optional
        A load store shared by the router replicas of this pool (e.g.
        :class:`lbkit.replicas.RedisStore`); ``None`` (default): this balancer is alone. Each
        :meth:`route` and :meth:`end_round` first views it (the foreign load is the store's
        totals minus this replica's contribution, :meth:`set_foreign_load`); each change of the
        ledger publishes the replica's per-rank requests, quota and work (in nanoseconds).
        When the store does not answer within its budget the decision runs on an estimate
        (counted in ``statistics().store_fallbacks``; :mod:`lbkit.core.replica`).
    replica_id : str, optional
        This replica's name in ``store`` (required with it; unique among the replicas).
    **legacy
        The keyword options before the option objects (``edges=``, ``round_s=``,
        ``wake_penalty_s=``, ``context_parallel=``, ``rank_rule=``, ...): mapped onto the
        objects with a ``DeprecationWarning`` naming the replacement (:mod:`lbkit.prefill.legacy`).

    Raises
    ------
    TypeError
        An unknown keyword, a legacy keyword beside the object replacing it, or an option object
        of the wrong class.
    ValueError
        A value out of its rule (naming the field), or engine bounds the pool cannot meet.

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

    The least-load rule with a wake penalty, on DeepSeek's length buckets:

    >>> from lbkit.prefill import DEFAULT_EDGES
    >>> PrefillBalancer(
    ...     4, 2, cost=PRESETS["h800_dsv3"].prefill,
    ...     choice=RankChoice(rule="least_load", wake_penalty_s=0.05),
    ...     buckets=Buckets(edges=DEFAULT_EDGES),
    ... ).statistics().bucket_engines
    (4, 0, 0, 0)
    """

    def __init__(
        self,
        num_engines: int,
        ranks_per_engine: int,
        *,
        cost: QuadraticCost,
        choice: RankChoice | None = None,
        buckets: Buckets | None = None,
        rounds: Rounds | None = None,
        rng: np.random.Generator | int | None = None,
        now_s: float = 0.0,
        store: Store | None = None,
        replica_id: str | None = None,
        **legacy: Any,
    ) -> None:
        e = self._num_engines = check_int(num_engines, "num_engines", min_value=1)
        rid = replica_id_iv(store, replica_id)
        self._ranks = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
        if not isinstance(cost, QuadraticCost):
            raise TypeError(f"cost: must be a QuadraticCost, got {type(cost).__name__}")
        for name, value, cls in (("choice", choice, RankChoice), ("buckets", buckets, Buckets),
                                 ("rounds", rounds, Rounds)):  # fmt: skip
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"{name}: must be a {cls.__name__}, got {type(value).__name__}")
        if legacy:
            choice, buckets, rounds = from_keywords(legacy, choice, buckets, rounds)
        self._choice = RankChoice() if choice is None else choice
        self._buckets = Buckets() if buckets is None else buckets
        self._rounds = Rounds() if rounds is None else rounds
        self._cost = cost
        self._edges = self._buckets.edges
        nb = self._buckets.num_buckets
        bk = self._buckets
        self._min_engines = None if bk.min_engines is None else np.asarray(bk.min_engines)
        self._max_engines = None if bk.max_engines is None else np.asarray(bk.max_engines)
        # feasibility of the bounds with this pool (ValueError naming the bound)
        allocate_engines(np.zeros(nb), e, min_engines=self._min_engines,
                         max_engines=self._max_engines)  # fmt: skip
        self._rng = as_rng(rng)
        self._chooser = RankChooser(self._choice, cost, self._ranks, self._rng)
        now = as_time(now_s)
        if bk.initial_engines is None:
            seed = np.zeros(nb)
            if self._rounds.cold_start_s is not None:
                seed[0] = 1.0  # one group: demand only in the lowest bucket
            counts = allocate_engines(
                seed, e, min_engines=self._min_engines, max_engines=self._max_engines
            ).engines
        else:
            counts = np.asarray(bk.initial_engines, dtype=np.int64)
            if counts.sum() != e:
                raise ValueError(
                    f"initial_engines: must sum to num_engines ({e}), got {int(counts.sum())}"
                )
        self._ledger = Ledger(e, self._ranks, cost)
        self._pool = EnginePool(np.repeat(np.arange(nb, dtype=np.int64), counts), nb, self._ledger)
        self._round_quota = [0.0] * nb
        self._round_start = now
        self._demand = np.zeros(nb)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._drift_last = 0.0
        self._drift_max = 0.0
        self._link: ReplicaLink | None = None
        if rid is not None:
            self._attach(store, rid)

    def _attach(self, store: Any, replica_id: str) -> None:
        """Join ``store`` as ``replica_id``: publish the whole ledger."""
        n = self.num_ranks
        self._link = ReplicaLink(store, replica_id, key="prefill", num_ranks=n, columns=3)
        self._push()

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

    @property
    def choice(self) -> RankChoice:
        """The rank-choice options."""
        return self._choice

    @property
    def buckets(self) -> Buckets:
        """The bucket options."""
        return self._buckets

    @property
    def rounds(self) -> Rounds:
        """The round options."""
        return self._rounds

    def rank_loads(self) -> np.ndarray:
        """Quota load of the ledger per rank in flat order, shape (num_ranks,), seconds (a
        copy; without the foreign load)."""
        return self._ledger.rank_loads()

    # ------------------------------------------------------------------ store
    def _pull(self) -> None:
        """View the store before a decision: its foreign load replaces ours."""
        set_from_store(self._ledger, self._link.view(store_columns(self._ledger)))

    def _push(self) -> None:
        """Publish the ledger's per-rank load after a change."""
        if self._link is not None:
            self._link.publish(store_columns(self._ledger))

    def _store_counts(self) -> dict[str, int]:
        return {} if self._link is None else self._link.statistics()

    def requests_on(self, engine: int, rank: int) -> tuple[Hashable, ...]:
        """Request ids queued or running on a rank, in FIFO order."""
        engine = self._engine_iv(engine)
        rank = check_int(rank, "rank", min_value=0, max_value=self._ranks - 1)
        return tuple(self._ledger.queues[engine * self._ranks + rank])

    # ------------------------------------------------------------------ routing
    def _choose(
        self, bucket: int, total: int, cached: int, hits: Any, now: float
    ) -> tuple[int, str, int]:
        pool = self._pool
        ends = pool.step_ends(now)
        return self._chooser.choose(
            self._ledger, pool.layout, pool.order, bucket, total, cached, hits,
            *(() if ends is None else (ends, now)),
        )  # fmt: skip

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
            it computes on the rank it gets. A whole prompt in cache still computes its last
            token, whose logits give the first output token (as vLLM and SGLang do): the request
            is charged ``total_tokens - 1`` cached tokens there.
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
        full = False  # some rank holds the whole prompt
        if type(cached_tokens) is not int and isinstance(cached_tokens, (np.ndarray, list, tuple)):
            hits, cached_tokens, full = hits_iv(cached_tokens, total_tokens, self.num_ranks)
        if not (
            type(total_tokens) is int
            and type(cached_tokens) is int
            and 0 <= cached_tokens <= total_tokens
            and total_tokens > 0
            and type(now_s) is float
            and now_s - now_s == 0.0  # excludes NaN and infinities
        ):
            total_tokens, cached_tokens, now_s = route_iv(total_tokens, cached_tokens, now_s)
        if type(request_id) is not int and type(request_id) is not str:
            request_id = as_request_id(request_id)
        led = self._ledger
        if request_id in led.requests:
            raise ValueError(f"request_id: {request_id!r} is already in the ledger")
        if full or cached_tokens == total_tokens:
            # A full hit still computes the last prompt token (the docstring).
            cached_tokens = min(cached_tokens, total_tokens - 1)
            if hits is not None:
                hits = np.minimum(hits, total_tokens - 1)
        bucket = bisect.bisect_right(self._edges, total_tokens)
        if self._link is not None:
            self._pull()
        slot, reason, cached = self._choose(bucket, total_tokens, cached_tokens, hits, now_s)
        quota = led.quota(total_tokens - cached, cached)
        self._round_quota[bucket] += quota
        if slot < 0:
            self._counts["refused"] += 1
            return RouteDecision(-1, -1, bucket, reason)
        flat = led.rank_at[slot]
        led.add(Request(request_id, flat, bucket, total_tokens, cached, 0, quota))
        self._counts["routed"] += 1
        self._push()
        return RouteDecision(flat // self._ranks, flat % self._ranks, bucket, reason)

    # ------------------------------------------------------------------ progress
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
        req = self._ledger.get(request_id)
        tokens = as_tokens(tokens, "tokens")
        as_time(now_s)
        left = req.total - req.cached - req.done
        if tokens > left:
            raise ValueError(
                f"tokens: request {request_id!r} has {left} tokens left to prefill, got {tokens}"
            )
        self._ledger.advance(req, req.done + tokens)
        self._push()
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
        req = self._ledger.get(request_id)
        if not (type(rank) is int and 0 <= rank < self._ranks):
            rank = check_int(rank, "rank", min_value=0, max_value=self._ranks - 1)
        as_time(now_s)
        if req.done:
            raise ValueError(
                f"request_id: request {request_id!r} has started ({req.done} tokens prefilled) "
                "and cannot move to another rank"
            )
        old = req.rank
        new = (old // self._ranks) * self._ranks + rank
        if new == old:
            return
        self._ledger.move(req, new)
        self._counts["reassigned"] += 1
        self._push()

    def finish(self, request_id: Hashable, *, now_s: float) -> int:
        """Remove a request from the ledger (finished, or aborted by the caller).

        Returns
        -------
        int
            Tokens that were never reported done (0 for a request that completed normally).
        """
        req = self._ledger.get(request_id)
        as_time(now_s)
        left = req.total - req.cached - req.done
        self._ledger.drop(req)
        self._counts["finished"] += 1
        self._pool.join_if_drained(req.rank // self._ranks)
        self._push()
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
        as_time(now_s)
        n_fin, touched = self._ledger.record(request_ids, tokens, finished)
        self._counts["finished"] += n_fin
        if n_fin:
            for e in sorted({f // self._ranks for f in touched}):
                self._pool.join_if_drained(e)
        self._push()
        return n_fin

    # ------------------------------------------------------------------ engines
    def _engine_iv(self, engine: Any) -> int:
        return check_int(engine, "engine", min_value=0, max_value=self._num_engines - 1)

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
            todo = [q for q in self._ledger.queues[f].values() if q.total - q.cached - q.done > 0]
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
        queued = [0] * nb
        parts: list[list[float]] = [[] for _ in range(nb)]
        for req in self._ledger.requests.values():
            queued[req.bucket] += 1
            parts[req.bucket].append(req.quota)
        qquota = [math.fsum(p) for p in parts]  # exact: independent of the ledger's order
        c = self._counts
        foreign = self._ledger.foreign()
        return PrefillStatistics(
            bucket_demand=tuple(self._demand.tolist()),
            bucket_round_quota=tuple(self._round_quota),
            bucket_queued=tuple(queued),
            bucket_queued_quota=tuple(qquota),
            rank_load=tuple(self.rank_loads().tolist()),
            queued=len(self._ledger.requests),
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
            steps_reported=c["steps_reported"],
            steps_stale=c["steps_stale"],
            rank_foreign_load=tuple(foreign[0].tolist()),
            rank_foreign_requests=tuple(foreign[2].tolist()),
            **self._pool.statistics(),
            **self._store_counts(),
        )

    def _check(self) -> None:
        """Assert every internal invariant (for tests; O(requests + ranks))."""
        self._ledger.check(lambda total: bisect.bisect_right(self._edges, total))
        self._pool.check()
        c = self._counts
        assert c["routed"] == len(self._ledger.requests) + c["finished"] + c["handed_back"], (
            "routed requests are not all queued, finished or handed back"
        )
