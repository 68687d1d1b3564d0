"""``PrefillBalancer``: the stateful prefill router that a serving front end embeds.

The class is a façade over the modules of this package; a newcomer can read it top to bottom:

- options (:mod:`~lbkit.prefill.options`): :class:`RankChoice`, :class:`Buckets`,
  :class:`Rounds`, frozen and self-validating; the defaults are what ``lbkit bench`` measures.
  The old keyword options still work, with a ``DeprecationWarning``
  (:mod:`~lbkit.prefill.legacy`);
- **route** a request to its length bucket (:func:`bucket_of`), then to a rank of the engines
  serving that bucket by the :class:`RankChoice` rule (:mod:`~lbkit.prefill.choice`), charging
  the rank the request's quota (:meth:`QuadraticCost.quota` of its uncached tokens);
- **chunk_done / finish / record / reassign** record progress in the ledger
  (:mod:`~lbkit.prefill.ledger`: the per-request quotas and the per-rank sums);
- **end_round** re-plans the engines of each bucket from the round's demand, EMA-smoothed
  (:func:`rebalance`: Adams' apportionment under hysteresis);
- **remove_engine / restore_engine** take an engine out of service (its requests are re-routed
  and returned, none lost) and back; engine states are :mod:`lbkit.core.engines`';
- **report** ingests engine-reported progress by sequence number (stale reports are ignored) and
  measures how far the ledger had drifted;
- **set_foreign_load** adds the load other routers queued on the ranks (router replicas in
  front of one pool; :mod:`~lbkit.prefill.foreign`): it counts in every decision, in no request;
- **plan_engine** runs :func:`plan_chunks` on each rank's FIFO queue;
- **statistics / _check / state_dict / from_state_dict** (:mod:`~lbkit.prefill.results`,
  :mod:`~lbkit.prefill.persistence`).

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
from typing import Any

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.engines import ACTIVE, DRAINING, OUT, STATE_NAMES
from lbkit.core.replica import ReplicaLink, Store, replica_id_iv
from lbkit.core.validation import as_int_array, as_rng, check_int
from lbkit.prefill._kernels import int_bounds
from lbkit.prefill.apportion import allocate_engines, serving_buckets
from lbkit.prefill.choice import RankChooser, layout
from lbkit.prefill.chunking import ChunkPlan, plan_chunks
from lbkit.prefill.foreign import ForeignLoad, foreign_iv
from lbkit.prefill.ledger import Ledger, Request, as_request_id, as_time, as_tokens
from lbkit.prefill.legacy import from_keywords
from lbkit.prefill.options import Buckets, RankChoice, Rounds
from lbkit.prefill.persistence import (
    COUNTERS,
    STATE_VERSION,
    config_dict,
    read_config,
    read_state,
)
from lbkit.prefill.results import (
    EnginePlan,
    PrefillStatistics,
    ReportResult,
    RoundResult,
    RouteDecision,
)
from lbkit.prefill.rounds import replan, smoothed_demand

__all__ = ["PrefillBalancer"]

#: Units of the quota and work a store holds (integers): nanoseconds.
STORE_NS = 1e9


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
        self._home = np.repeat(np.arange(nb, dtype=np.int64), counts)
        self._state = np.full(e, ACTIVE, dtype=np.int8)
        self._last_move = np.full(e, -np.inf)
        self._seq = np.full(e, -1, dtype=np.int64)
        self._ledger = Ledger(e, self._ranks, cost)
        self._round_quota = [0.0] * nb
        self._round_start = now
        self._demand = np.zeros(nb)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._drift_last = 0.0
        self._drift_max = 0.0
        self._rebuild()
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

    # ------------------------------------------------------------------ store
    def _own(self) -> np.ndarray:
        quota, work, count = self._ledger.own_flat()
        return np.stack([count, np.rint(quota * STORE_NS).astype(np.int64),
                         np.rint(work * STORE_NS).astype(np.int64)])  # fmt: skip

    def _pull(self) -> None:
        """View the store before a decision: its foreign load replaces ours."""
        f = self._link.view(self._own())
        self._ledger.set_foreign(f[1] / STORE_NS, f[2] / STORE_NS, f[0].copy())

    def _push(self) -> None:
        """Publish the ledger's per-rank load after a change."""
        if self._link is not None:
            self._link.publish(self._own())

    def _store_counts(self) -> dict[str, int]:
        return {} if self._link is None else self._link.statistics()

    def requests_on(self, engine: int, rank: int) -> tuple[Hashable, ...]:
        """Request ids queued or running on a rank, in FIFO order."""
        engine = self._engine_iv(engine)
        rank = check_int(rank, "rank", min_value=0, max_value=self._ranks - 1)
        return tuple(self._ledger.queues[engine * self._ranks + rank])

    def round_due(self, now_s: float) -> bool:
        """Whether the current round is over: ``round_s`` seconds (``cold_start_s`` for the
        first round under a cold start) have passed since it started."""
        length = self._rounds.round_s
        if self._rounds.cold_start_s is not None and self._counts["rounds"] == 0:
            length = self._rounds.cold_start_s
        return as_time(now_s) - self._round_start >= length

    # ------------------------------------------------------------------ routing
    def _rebuild(self) -> None:
        """Recompute the routing slices after engines changed state or bucket."""
        self._layout = layout(self._home, self._state, self.num_buckets, self._ranks)
        self._order = np.asarray(self._layout.order, dtype=np.int64)
        self._ledger.relayout(self._layout.order)

    def _choose(self, bucket: int, total: int, cached: int, hits: Any) -> tuple[int, str, int]:
        return self._chooser.choose(
            self._ledger, self._layout, self._order, bucket, total, cached, hits
        )

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
            hits, cached_tokens, full = self._hits_iv(cached_tokens, total_tokens)
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
        slot, reason, cached = self._choose(bucket, total_tokens, cached_tokens, hits)
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

    def _hits_iv(self, cached_tokens: Any, total_tokens: Any) -> tuple[np.ndarray, int, bool]:
        # Per-rank cached tokens, their least and whether one is the whole prompt. The common
        # case, an int64 array of the right shape and a valid total, costs one kernel pass;
        # anything else is validated in full.
        n = self.num_ranks
        if (
            type(cached_tokens) is np.ndarray
            and cached_tokens.dtype == np.int64
            and cached_tokens.shape == (n,)
            and type(total_tokens) is int
        ):
            lo, hi = int_bounds(cached_tokens)
            if 0 <= lo and hi <= total_tokens:
                return cached_tokens, int(lo), hi == total_tokens
        total = as_tokens(total_tokens, "total_tokens")
        hits = as_int_array(cached_tokens, "cached_tokens", shape=(n,), min_value=0)
        if not hits.shape[0]:
            return hits, 0, False
        hi = int(hits.max())
        if hi > total:
            raise ValueError(
                f"cached_tokens: must be <= total_tokens ({total}) on every rank, got {hi}"
            )
        return hits, int(hits.min()), hi == total

    @staticmethod
    def _route_iv(total_tokens: Any, cached_tokens: Any, now_s: Any) -> tuple[int, int, float]:
        total = as_tokens(total_tokens, "total_tokens")
        cached = as_tokens(cached_tokens, "cached_tokens")
        if total == 0:
            raise ValueError("total_tokens: must be >= 1, got 0")
        if cached > total:
            raise ValueError(f"cached_tokens: must be <= total_tokens ({total}), got {cached}")
        return total, cached, as_time(now_s)

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
        self._maybe_join(req.rank // self._ranks)
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
                self._maybe_join(e)
        self._push()
        return n_fin

    def _maybe_join(self, engine: int) -> None:
        if self._state[engine] == DRAINING and self._ledger.engine_requests(engine) == 0:
            self._state[engine] = ACTIVE
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
        result = replan(self._rounds, self._home, self._state, self._last_move, loads,
                        self._demand, now_s=now, first=first, min_engines=self._min_engines,
                        max_engines=self._max_engines)  # fmt: skip
        if self._link is not None:  # the leader publishes its plan, a follower applies it
            result = self._link.round_plan(result, self._home, self._state != OUT)
        if result is not None:
            for mv in result.moves:
                self._home[mv.engine] = mv.to_bucket
                self._last_move[mv.engine] = now
                busy = self._ledger.engine_requests(mv.engine) > 0
                self._state[mv.engine] = DRAINING if busy else ACTIVE
            self._counts["moves"] += len(result.moves)
            self._rebuild()
        self._counts["rounds"] += 1
        self._round_quota = [0.0] * self.num_buckets
        self._round_start = now
        counts = np.bincount(self._home[self._state != OUT], minlength=self.num_buckets)
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
        as_time(now_s)
        if self._state[engine] == OUT:
            raise ValueError(f"engine: {engine} is already out of service")
        self._state[engine] = OUT
        self._rebuild()
        r = self._ranks
        led = self._ledger
        moved: list[tuple[Hashable, RouteDecision]] = []
        for f in range(engine * r, engine * r + r):
            for req in list(led.queues[f].values()):
                led.drop(req)
                slot, reason, _ = self._choose(req.bucket, req.total, req.cached, None)
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
        if self._state[engine] != OUT:
            raise ValueError(f"engine: {engine} is in service")
        if bucket is not None:
            bucket = check_int(bucket, "bucket", min_value=0, max_value=self.num_buckets - 1)
            if bucket != self._home[engine]:
                self._home[engine] = bucket
                self._last_move[engine] = now
        self._state[engine] = ACTIVE
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
        as_time(now_s)
        if not isinstance(progress, Mapping):
            raise TypeError(
                "progress: must be a mapping of request id to tokens, got "
                f"{type(progress).__name__}"
            )
        if seq <= self._seq[engine]:
            self._counts["reports_stale"] += 1
            return ReportResult(False, 0.0, (), ())
        known, unknown = self._ledger.reported(engine, progress)
        self._seq[engine] = seq
        drift, missing = self._ledger.reconcile(engine, known)
        self._counts["reports_accepted"] += 1
        self._drift_last = drift
        self._drift_max = max(self._drift_max, drift)
        self._push()
        return ReportResult(True, drift, unknown, missing)

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
        active = self._state == ACTIVE
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
            bucket_engines=tuple(np.bincount(self._home[active], minlength=nb).tolist()),
            bucket_draining=tuple(
                np.bincount(self._home[self._state == DRAINING], minlength=nb).tolist()
            ),
            bucket_server=tuple(self._layout.server),
            bucket_queued=tuple(queued),
            bucket_queued_quota=tuple(qquota),
            rank_load=tuple(self.rank_loads().tolist()),
            engine_bucket=tuple(self._home.tolist()),
            engine_state=tuple(STATE_NAMES[s] for s in self._state.tolist()),
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
            rank_foreign_load=tuple(foreign[0].tolist()),
            rank_foreign_requests=tuple(foreign[2].tolist()),
            **self._store_counts(),
        )

    def _check(self) -> None:
        """Assert every internal invariant (for tests; O(requests + ranks))."""
        nb = self.num_buckets
        r = self._ranks
        led = self._ledger
        led.check(lambda total: bisect.bisect_right(self._edges, total))
        for f, queue in enumerate(led.queues):
            engine = f // r
            assert not (queue and self._state[engine] == OUT), f"engine {engine} is out, busy"
        for e in range(self._num_engines):
            if self._state[e] == DRAINING:
                assert led.engine_requests(e) > 0, f"engine {e} drains an empty queue"
        assert ((self._home >= 0) & (self._home < nb)).all()
        active = self._state == ACTIVE
        counts = np.bincount(self._home[active], minlength=nb)
        lay = self._layout
        assert lay.server == serving_buckets(counts).tolist(), "serving map is stale"
        assert lay.order == led.rank_at, "the ledger's slots are not the routing layout's"
        for j in range(nb):
            h = lay.server[j]
            members = sorted(lay.order[lay.lo[j] : lay.hi[j]])
            want = [f for e in np.flatnonzero(active & (self._home == h)).tolist()
                    for f in range(e * r, e * r + r)] if h >= 0 else []  # fmt: skip
            assert members == want, f"bucket {j}: routing slice is stale"
            if active.any():
                assert lay.hi[j] > lay.lo[j], f"bucket {j} has no engine to serve it"
        c = self._counts
        assert c["routed"] == len(led.requests) + c["finished"] + c["handed_back"], (
            "routed requests are not all queued, finished or handed back"
        )

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The configuration and state as JSON-serialisable plain types.

        The options are saved as plain dicts (:meth:`RankChoice.to_dict`, ...). Request ids
        must be ints or strs (``route`` enforces it). ``from_state_dict`` of the result
        continues exactly where this balancer stands, including the sampling rng. ``pickle``
        and ``copy`` go through it too (a balancer with a store is not picklable: save its state
        and pass the store to :meth:`from_state_dict`).
        """
        led = self._ledger
        config = config_dict(self._num_engines, self._ranks, self._cost, self._choice,
                             self._buckets, self._rounds)  # fmt: skip
        return {
            "version": STATE_VERSION,
            "config": config,
            "state": {
                "engine_bucket": self._home.tolist(),
                "engine_state": self._state.tolist(),
                "last_move_s": [None if t == -np.inf else t for t in self._last_move.tolist()],
                "seq": self._seq.tolist(),
                "rank_load": self.rank_loads().tolist(),
                "requests": [
                    [q.rid, q.rank, q.total, q.cached, q.done, q.quota]
                    for queue in led.queues
                    for q in queue.values()
                ],
                "round_quota": list(self._round_quota),
                "round_start_s": self._round_start,
                "demand": self._demand.tolist(),
                "counts": dict(self._counts),
                "drift_last_s": self._drift_last,
                "drift_max_s": self._drift_max,
                "rng": self._rng.bit_generator.state,
                "foreign": dict(
                    zip(
                        ("quota_s", "work_s", "num_requests"),
                        (a.tolist() for a in led.foreign()),
                        strict=True,
                    )
                ),
            },
        }

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        if self._link is not None:
            raise TypeError(
                "PrefillBalancer: a balancer with a store cannot be pickled; pickle its "
                "state_dict() and pass store= and replica_id= to from_state_dict"
            )
        return (type(self).from_state_dict, (self.state_dict(),))

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Any], *, store: Store | None = None, replica_id: str | None = None
    ) -> PrefillBalancer:
        """Rebuild a balancer from :meth:`state_dict` output (e.g. after ``json.loads``).

        With ``store`` and ``replica_id`` (not saved in a state) the rebuilt balancer is that
        replica again: it publishes its whole ledger before it returns.

        Reads states of version 2 and 1 (flat keyword options).

        Raises
        ------
        ValueError
            Unknown version, or a field out of its rules or inconsistent with the others,
            named (:func:`lbkit.prefill.persistence.read_state`).
        """
        me = replica_id_iv(store, replica_id)
        e, r, cost, choice, buckets, rounds = read_config(state)
        nb = buckets.num_buckets
        led = Ledger(e, r, cost)
        s = read_state(state.get("state"), e, r, nb, led.quota)
        initial = np.bincount(s["home"], minlength=nb)
        bal = cls(
            e, r, cost=cost, choice=choice, rounds=rounds, now_s=s["round_start"],
            buckets=Buckets(buckets.edges, buckets.min_engines, buckets.max_engines,
                            tuple(initial.tolist())),
        )  # fmt: skip
        bal._buckets = buckets
        bal._home = s["home"]
        bal._state = s["state"]
        bal._last_move = s["last_move"]
        bal._seq = s["seq"]
        bal._rebuild()
        led = bal._ledger
        edges = bal._edges
        for rid, rank, total, cached, done, quota in s["requests"]:
            bucket = bisect.bisect_right(edges, total)
            req = Request(rid, rank, bucket, total, cached, done, quota)
            led.requests[rid] = req
            led.queues[rank][rid] = req
        for f in range(bal.num_ranks):
            led.resum(f)
        if s["foreign"] is not None:
            led.set_foreign(*s["foreign"])
        led.own = s["load"][np.asarray(led.rank_at, dtype=np.int64)]  # as saved (checked)
        led.load = led.own + led.f_load
        bal._round_quota = s["round_quota"]
        bal._demand = s["demand"]
        bal._counts = s["counts"]
        bal._drift_last = s["drift_last"]
        bal._drift_max = s["drift_max"]
        try:
            bal._rng.bit_generator.state = s["rng"]
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            raise ValueError(f"state.rng: not a numpy bit generator state ({exc})") from None
        if bal._rng.bit_generator.state != s["rng"]:
            raise ValueError("state.rng: numpy does not keep this bit generator state as given")
        if me is not None:
            bal._attach(store, me)
        return bal
