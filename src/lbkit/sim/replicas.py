"""Router replicas in the simulator: ``K`` lbkit balancers in front of one pool, and how they sync.

Users outgrow one router process: 4 to 32 replicas behind an L4 balancer serve one fleet (SPEC
section 9). Each replica keeps a ledger of the requests *it* admitted; what it knows of the
others' load is its *foreign load* (``set_foreign_load`` of :class:`lbkit.prefill.PrefillBalancer`
and :class:`lbkit.decode.DecodeBalancer`), and how fresh that is depends on how the replicas
sync. :class:`PrefillReplicas` and :class:`DecodeReplicas` are simulator policies (the protocol
of :mod:`lbkit.sim.protocol`) holding ``K`` copies of the ``lbkit`` policy
(:class:`~lbkit.sim.policies.LbkitPrefill`, :class:`~lbkit.sim.policies_decode.LbkitDecode`)
and the sync model chosen by :class:`ReplicaSync`:

``shared``
    One store of every replica's contribution (e.g. :class:`lbkit.replicas.RedisStore`), read
    with a round-trip delay ``delay_s``: before each decision a replica sees its own ledger
    exactly plus the others' load as it stood ``delay_s`` earlier. ``delay_s = 0`` is one
    exact shared view.
``reports``
    The engines report their totals every ``period_s`` (at ``0, period_s, 2 period_s, ...``,
    to every replica at once: a broadcast); a replica's foreign load is the last reported
    total minus its own contribution at that time, i.e. the others' load as of the last
    report.
``polled``
    Each replica polls the engines' totals every ``period_s`` at a phase of its own: replica
    ``j`` at ``(n + j / K) period_s``, ``n = 0, 1, ...``; its foreign load is the totals of its
    last poll minus its own contribution then. The replicas' views are as old on average as
    under ``reports``, but not all of the same instant.
``none``
    Each replica sees only its own admissions (no foreign load).

**The split of arrivals**: request ``i`` (its position in the trace) goes to replica
``i mod K``: round-robin by request index, deterministic; a request offered again (a decode
request that waited or was preempted) goes to the same replica, which also receives its events
(progress, moves, completion). **Migrations** (decode): the simulator asks for them once per
arrival; the replicas take turns (call ``c`` goes to replica ``c mod K``), each moving only its
own requests, as a replica that calls ``rebalance()`` before each of its own admissions does.

**What is exact.** The load a replica contributes is its balancer's own ledger
(``PrefillBalancer.own_load()``; ``DecodeBalancer.num_requests()`` and ``kv_tokens()``, after
the decode steps the engines ran), updated after every event it handles; the engines' totals
are the sum of these ledgers (the simulator's engines hold exactly the admitted requests). The
view of time ``t`` is the state after the last event at or before ``t``. With ``K = 1`` the
foreign load is always zero and every decision is the single router's. With ``shared`` and
``delay_s = 0`` a decode replica scores ranks by exactly the totals one router would see; with
migration off (``migrate_every_s=None``) its decisions are then one router's.

**Capacities** (decode). A replica checks capacities on its own view. When that view is not
exact and it places a request on a rank the engine has no room on, the engine refuses: the
replica aborts the admission from its ledger and the request waits in the pool's queue
(``engine_refusals`` counts these). Migration under capacities is modelled only with exact
views (``K = 1``, or ``shared`` with ``delay_s = 0``); otherwise the first call raises
``ValueError``.

Examples
--------
>>> from lbkit.core import PRESETS
>>> from lbkit.sim.engine import simulate_decode
>>> from lbkit.sim.traces import Trace
>>> t = Trace(arrival_s=[0.0, 0.0, 0.1, 0.2], total_tokens=[900, 100, 500, 50],
...           output_tokens=[40, 30, 20, 10])
>>> cost = PRESETS["h800_dsv3"].decode

Replica 0 admits requests 0 and 2, replica 1 requests 1 and 3; blind to each other, both put
their first request on rank 0 (request 1 has finished when request 3 arrives):

>>> blind = DecodeReplicas(1, 2, sync=ReplicaSync(k=2, mode="none"))
>>> simulate_decode(t, blind, ranks_per_engine=2, cost=cost).rank.tolist()
[0, 0, 1, 0]
>>> exact = DecodeReplicas(1, 2, sync=ReplicaSync(k=2, mode="shared", delay_s=0.0))
>>> simulate_decode(t, exact, ranks_per_engine=2, cost=cost).rank.tolist()
[0, 1, 1, 1]
>>> simulate_decode(t, "lbkit", ranks_per_engine=2, cost=cost).rank.tolist()  # one router
[0, 1, 1, 1]
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from lbkit.core.validation import as_rng, check_choice, check_int, check_real
from lbkit.sim.policies import LbkitPrefill
from lbkit.sim.policies_decode import LbkitDecode

__all__ = [
    "DEFAULT_DELAY_S",
    "DEFAULT_PERIOD_S",
    "MAX_REPLICAS",
    "REPLICAS_ROW",
    "SYNC_MODES",
    "DecodeReplicas",
    "PrefillReplicas",
    "ReplicaSync",
    "decode_replicas",
    "prefill_replicas",
]

#: Sync modes of :class:`ReplicaSync` (see the module documentation).
SYNC_MODES = ("shared", "reports", "polled", "none")
#: Default round trip to the shared store, seconds (a loopback or same-rack Redis).
DEFAULT_DELAY_S = 0.0005
#: Default interval between engine reports, seconds.
DEFAULT_PERIOD_S = 1.0
#: Most replicas of one pool.
MAX_REPLICAS = 1024
#: Name of the row that ``lbkit bench --replicas K`` adds to the goodput and decode tables.
REPLICAS_ROW = "lbkit_replicas"


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaSync:
    """How many router replicas share a pool and how they see each other's load.

    Parameters
    ----------
    k : int, default 1
        Router replicas (1 to ``MAX_REPLICAS``).
    mode : {"shared", "reports", "polled", "none"}, default "shared"
        Sync mode (module documentation).
    delay_s : float, default ``DEFAULT_DELAY_S`` (0.5 ms)
        ``shared``: age of the others' load a replica sees, seconds (>= 0, finite).
    period_s : float, default ``DEFAULT_PERIOD_S`` (1 s)
        ``reports`` and ``polled``: interval between engine reports (between a replica's
        polls), seconds (> 0, finite).

    Examples
    --------
    >>> ReplicaSync(k=16, mode="reports").period_s
    1.0
    >>> ReplicaSync(k=0)
    Traceback (most recent call last):
    ...
    ValueError: k: must be >= 1, got 0
    >>> ReplicaSync(mode="gossip")
    Traceback (most recent call last):
    ...
    ValueError: mode: must be one of 'shared', 'reports', 'polled', 'none'; got 'gossip'
    """

    k: int = 1
    mode: str = "shared"
    delay_s: float = DEFAULT_DELAY_S
    period_s: float = DEFAULT_PERIOD_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", check_int(self.k, "k", min_value=1, max_value=MAX_REPLICAS))
        object.__setattr__(self, "mode", check_choice(self.mode, "mode", SYNC_MODES))
        object.__setattr__(self, "delay_s", check_real(self.delay_s, "delay_s", min_value=0.0))
        object.__setattr__(
            self, "period_s", check_real(self.period_s, "period_s", min_value=0.0, strict_min=True)
        )

    @property
    def exact(self) -> bool:
        """Whether every replica sees the exact totals (``k == 1``, or ``shared`` without
        delay)."""
        return self.k == 1 or (self.mode == "shared" and self.delay_s == 0.0)


def _sync_iv(sync: Any) -> ReplicaSync:
    if not isinstance(sync, ReplicaSync):
        raise TypeError(f"sync: must be a ReplicaSync, got {type(sync).__name__}")
    return sync


def _rngs(rng: Any, k: int) -> list[np.random.Generator]:
    """Replica 0 draws from ``rng`` itself (so ``k == 1`` is the single router); the others
    from independent children spawned from it (which leaves ``rng``'s own stream as it is)."""
    g = as_rng(rng)
    return [g, *g.spawn(k - 1)] if k > 1 else [g]


class _Views:
    """Every replica's contribution per rank over time, and the view each one has of the others.

    ``cur[i]`` is replica ``i``'s own load now (``columns x ranks``). ``foreign(j, t)`` is the
    others' load replica ``j`` sees at ``t`` under the sync mode; ``advance(t)`` must be called
    before the changes of an event at ``t``, ``commit(t)`` after them.
    """

    def __init__(self, sync: ReplicaSync, columns: int, ranks: int, dtype: Any) -> None:
        self.sync = sync
        k = sync.k
        self.cur = np.zeros((k, columns, ranks), dtype=dtype)
        self._lag = self.cur.copy()
        self._hist: deque[tuple[float, np.ndarray]] = deque()
        self._report = 0  # index of the last engine report taken in (reports at n * period_s)
        self._others = [np.arange(k) != j for j in range(k)]
        self._exact_ints = np.issubdtype(dtype, np.integer)
        # polled: each replica's foreign load at its last poll, and the poll's index
        self._polled = np.zeros((k, columns, ranks), dtype=dtype)
        self._poll = [-1] * k
        self._next_poll = -math.inf  # a little before the earliest poll not yet taken in

    def poll_index(self, j: int, now_s: float) -> int:
        """``polled``: the index ``n`` of replica ``j``'s last poll at or before ``now_s`` (its
        polls at ``(n + j / K) period_s``; -1 before the first)."""
        s = self.sync
        return math.floor((now_s - s.period_s * j / s.k) / s.period_s)

    def advance(self, now_s: float) -> None:
        """Take in the engine reports (the polls) due by ``now_s`` (the state before this
        event's changes is the state of the last report or poll time)."""
        s = self.sync
        if not math.isfinite(now_s):
            return
        if s.mode == "reports":
            idx = math.floor(now_s / s.period_s)
            if idx > self._report:
                self._lag = self.cur.copy()
                self._report = idx
        elif s.mode == "polled" and now_s >= self._next_poll:
            p, k = s.period_s, s.k
            for j in range(k):
                idx = self.poll_index(j, now_s)
                if idx > self._poll[j]:
                    self._poll[j] = idx
                    self._polled[j] = self._others_of(self.cur, j)
            # the next poll's time, early by a margin far above the rounding of poll_index
            self._next_poll = min((self._poll[j] + 1 + j / k) * p for j in range(k)) - 1e-6 * p

    def commit(self, now_s: float) -> None:
        """Record the state after an event at ``now_s`` (``shared`` with a delay)."""
        s = self.sync
        if s.mode == "shared" and s.delay_s > 0.0 and s.k > 1:
            self._hist.append((now_s, self.cur.copy()))

    def foreign(self, j: int, now_s: float) -> np.ndarray | None:
        """The others' load replica ``j`` sees at ``now_s`` (``None`` in mode ``none``)."""
        s = self.sync
        if s.mode == "none":
            return None
        if s.mode == "polled":
            return self._polled[j].copy()
        if s.mode == "shared":
            if s.delay_s == 0.0:
                src = self.cur
            else:
                t = now_s - s.delay_s
                hist = self._hist
                while hist and hist[0][0] <= t:
                    self._lag = hist.popleft()[1]
                src = self._lag
        else:
            src = self._lag
        return self._others_of(src, j)

    def _others_of(self, src: np.ndarray, j: int) -> np.ndarray:
        """The sum over the replicas but ``j`` of ``src`` (per replica)."""
        if self._exact_ints:
            return src.sum(axis=0) - src[j]
        return src[self._others[j]].sum(axis=0)


class PrefillReplicas:
    """``K`` replicas of the ``lbkit`` prefill policy in front of one prefill pool.

    Request ``i`` is routed by replica ``i mod K``, whose balancer first gets the foreign load
    of the sync mode (module documentation); its events go to the same replica.

    Parameters
    ----------
    num_engines, ranks_per_engine : int
        The pool's shape.
    sync : ReplicaSync
        Replicas and sync mode.
    cost : QuadraticCost
        Prefill cost model (as for :class:`~lbkit.sim.policies.LbkitPrefill`).
    rng : numpy Generator, int seed or None
        Replica 0 uses it; the others independent children of it.
    **options
        Passed to every :class:`~lbkit.sim.policies.LbkitPrefill` (``name``, ``cache_aware``
        and :class:`~lbkit.prefill.PrefillBalancer` options; none: the ``lbkit`` policy).

    Attributes
    ----------
    replicas : tuple of LbkitPrefill
        The replicas, replica ``j`` serving the requests ``i`` with ``i mod K == j``.

    Runtime complexity: per event, the replica's own work plus ``O(K * ranks)`` for the view.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> from lbkit.sim.engine import simulate_prefill
    >>> from lbkit.sim.traces import Trace
    >>> t = Trace(arrival_s=[0.0, 0.0, 0.0], total_tokens=[4000, 3000, 100],
    ...           output_tokens=[1, 1, 1])
    >>> cost = PRESETS["h800_dsv3"].prefill
    >>> blind = PrefillReplicas(1, 2, sync=ReplicaSync(k=3, mode="none"), cost=cost)
    >>> simulate_prefill(t, blind, num_engines=1, ranks_per_engine=2, cost=cost).rank.tolist()
    [0, 0, 0]
    >>> shared = PrefillReplicas(1, 2, sync=ReplicaSync(k=3, delay_s=0.0), cost=cost)
    >>> simulate_prefill(t, shared, num_engines=1, ranks_per_engine=2,
    ...                  cost=cost).rank.tolist()
    [0, 1, 1]
    """

    def __init__(
        self,
        num_engines: int,
        ranks_per_engine: int,
        *,
        sync: ReplicaSync,
        cost: Any,
        rng: Any = None,
        **options: Any,
    ) -> None:
        self.sync = _sync_iv(sync)
        k = self.sync.k
        self.replicas = tuple(
            LbkitPrefill(num_engines, ranks_per_engine, cost=cost, rng=g, **options)
            for g in _rngs(rng, k)
        )
        self.name = self.replicas[0].name
        n = num_engines * ranks_per_engine
        self._views = _Views(self.sync, 3, n, np.float64)
        self._last = [np.zeros((3, n)) for _ in range(k)]

    def _refresh(self, j: int) -> None:
        own = self.replicas[j].balancer.own_load()
        self._views.cur[j] = (own.quota_s, own.work_s, own.num_requests)

    def _view(self, j: int, now_s: float) -> None:
        f = self._views.foreign(j, now_s)
        if f is None or np.array_equal(f, self._last[j]):
            return
        self._last[j] = f
        self.replicas[j].balancer.set_foreign_load(
            quota_s=f[0], work_s=f[1], num_requests=f[2].astype(np.int64)
        )

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        """Route ``request`` by its replica (see the class documentation)."""
        j = request % self.sync.k
        views = self._views
        views.advance(now_s)
        self._view(j, now_s)
        f = self.replicas[j].route(request, total_tokens, cached_tokens, now_s=now_s, view=view)
        self._refresh(j)
        views.commit(now_s)
        return f

    def observe(self, requests: np.ndarray, kinds: np.ndarray, tokens: np.ndarray, /, *,
                now_s: float) -> None:  # fmt: skip
        """Hand each request's events to its replica (in order)."""
        k = self.sync.k
        views = self._views
        views.advance(now_s)
        if k == 1:
            self.replicas[0].observe(requests, kinds, tokens, now_s=now_s)
            self._refresh(0)
        else:
            owner = requests % k
            for j in np.unique(owner).tolist():
                m = owner == j
                self.replicas[j].observe(requests[m], kinds[m], tokens[m], now_s=now_s)
                self._refresh(j)
        views.commit(now_s)


class DecodeReplicas:
    """``K`` replicas of the ``lbkit`` decode policy in front of one decode pool.

    Request ``i`` is admitted by replica ``i mod K``, whose balancer first gets the foreign
    load of the sync mode; the replicas take turns at the migrations asked for before each
    arrival; every replica's ledger steps with the engines (module documentation).

    Parameters
    ----------
    num_engines, ranks_per_engine : int
        The pool's shape.
    sync : ReplicaSync
        Replicas and sync mode.
    cost : any, optional
        Unused (the decode protocol's signature).
    rng : numpy Generator, int seed or None
        Replica 0 uses it; the others independent children of it.
    **options
        Passed to every :class:`~lbkit.sim.policies_decode.LbkitDecode` (``migrate_every_s``,
        ``max_migrations`` and :class:`~lbkit.decode.DecodeBalancer` options; none: the
        ``lbkit`` policy).

    Attributes
    ----------
    replicas : tuple of LbkitDecode
        The replicas, replica ``j`` serving the requests ``i`` with ``i mod K == j``.
    engine_refusals : int
        Admissions the engine refused (a replica's view showed room the rank did not have).

    Runtime complexity: per event, the replica's own work plus ``O(K * ranks)`` for the view;
    ``O(K * ranks)`` more at each event after the engines stepped.
    """

    name = "lbkit"

    def __init__(
        self,
        num_engines: int,
        ranks_per_engine: int,
        *,
        sync: ReplicaSync,
        cost: Any = None,
        rng: Any = None,
        **options: Any,
    ) -> None:
        self.sync = _sync_iv(sync)
        k = self.sync.k
        self.replicas = tuple(
            LbkitDecode(num_engines, ranks_per_engine, cost=cost, rng=g, **options)
            for g in _rngs(rng, k)
        )
        self._migrates = options.get("migrate_every_s", 0.0) is not None
        n = num_engines * ranks_per_engine
        self._views = _Views(self.sync, 2, n, np.int64)
        self._last = [np.zeros((2, n), dtype=np.int64) for _ in range(k)]
        self._steps: np.ndarray | None = None
        self._turn = 0
        self.engine_refusals = 0

    @property
    def migrated_kv_tokens(self) -> int:
        """KV tokens moved by all replicas' migrations."""
        return sum(p.migrated_kv_tokens for p in self.replicas)

    def _refresh(self, j: int) -> None:
        bal = self.replicas[j].balancer
        self._views.cur[j] = (bal.num_requests(), bal.kv_tokens())

    def _begin(self, now_s: float, view: Any) -> None:
        """Before an event: take in due reports, then step every ledger with the engines."""
        self._views.advance(now_s)
        if self._steps is None:
            caps = view.max_batch is not None or view.max_kv_tokens is not None
            if caps and self._migrates and not self.sync.exact:
                raise ValueError(
                    "sync: migration under capacities is modelled only with exact views (k=1, "
                    "or mode='shared' with delay_s=0); pass migrate_every_s=None"
                )
        elif np.array_equal(self._steps, view.steps):
            return
        self._steps = view.steps.copy()
        for j, p in enumerate(self.replicas):
            p.sync(view)
            self._refresh(j)

    def _view(self, j: int, now_s: float) -> None:
        f = self._views.foreign(j, now_s)
        if f is None or np.array_equal(f, self._last[j]):
            return
        self._last[j] = f
        self.replicas[j].balancer.set_foreign_load(num_requests=f[0], kv_tokens=f[1])

    def route(self, request: int, kv_tokens: int, /, *, now_s: float, view: Any) -> int:
        """Admit ``request`` by its replica; -1 if it or the engine has no room."""
        j = request % self.sync.k
        self._begin(now_s, view)
        self._view(j, now_s)
        p = self.replicas[j]
        f = p.route(request, kv_tokens, now_s=now_s, view=view)
        if f >= 0 and not self.sync.exact and self._no_room(f, kv_tokens, view):
            p.balancer.abort(request)
            self.engine_refusals += 1
            f = -1
        self._refresh(j)
        self._views.commit(now_s)
        return f

    @staticmethod
    def _no_room(f: int, kv_tokens: int, view: Any) -> bool:
        mb, mk = view.max_batch, view.max_kv_tokens
        return (mb is not None and view.num_requests[f] + 1 > mb) or (
            mk is not None and view.kv_tokens[f] + kv_tokens > mk
        )

    def observe(self, finished: np.ndarray, /, *, now_s: float, view: Any) -> None:
        """Hand each request that left its rank to its replica."""
        k = self.sync.k
        self._begin(now_s, view)
        if k == 1:
            self.replicas[0].observe(finished, now_s=now_s, view=view)
            self._refresh(0)
        else:
            owner = finished % k
            for j in np.unique(owner).tolist():
                self.replicas[j].observe(finished[owner == j], now_s=now_s, view=view)
                self._refresh(j)
        self._views.commit(now_s)

    def migrations(self, *, now_s: float, view: Any) -> list[tuple[int, int]]:
        """The moves of the replica whose turn it is (its own requests only)."""
        j = self._turn
        self._turn = (j + 1) % self.sync.k
        self._begin(now_s, view)
        self._view(j, now_s)
        moves = self.replicas[j].migrations(now_s=now_s, view=view)
        if moves:
            self._refresh(j)
        self._views.commit(now_s)
        return moves


def prefill_replicas(sync: ReplicaSync, /, **options: Any) -> Callable[..., PrefillReplicas]:
    """A prefill policy factory ``(num_engines, ranks_per_engine, *, cost, rng)`` of
    :class:`PrefillReplicas` under ``sync`` (for ``simulate_prefill`` and the goodput search).

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> make = prefill_replicas(ReplicaSync(k=4, mode="reports"))
    >>> len(make(2, 2, cost=PRESETS["unit"].prefill, rng=0).replicas)
    4
    """
    _sync_iv(sync)

    def make(num_engines: int, ranks_per_engine: int, *, cost: Any, rng: Any = None):
        return PrefillReplicas(num_engines, ranks_per_engine, sync=sync, cost=cost, rng=rng,
                               **options)  # fmt: skip

    return make


def decode_replicas(sync: ReplicaSync, /, **options: Any) -> Callable[..., DecodeReplicas]:
    """A decode policy factory ``(num_engines, ranks_per_engine, *, cost, rng)`` of
    :class:`DecodeReplicas` under ``sync``.

    Examples
    --------
    >>> make = decode_replicas(ReplicaSync(k=2, mode="none"), migrate_every_s=None)
    >>> make(1, 4, rng=0).sync.mode
    'none'
    """
    _sync_iv(sync)

    def make(num_engines: int, ranks_per_engine: int, *, cost: Any = None, rng: Any = None):
        return DecodeReplicas(num_engines, ranks_per_engine, sync=sync, cost=cost, rng=rng,
                              **options)  # fmt: skip

    return make
