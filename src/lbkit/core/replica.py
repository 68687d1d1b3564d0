"""The link between a balancer and a shared load store: views, publishes and fallback.

Router replicas in front of one pool share, per rank, the *totals* of their load and each
replica's own *contribution* in a store (:class:`lbkit.replicas.RedisStore`). A balancer given
``store=`` and ``replica_id=`` holds a :class:`ReplicaLink`, which

- **views** the store before each decision: one call returns the totals and this replica's
  contribution; the foreign load is their difference (what the other replicas placed), fed to
  the balancer's ``set_foreign_load``;
- **publishes** the replica's own per-rank load (its ledger) after each change, as absolute
  values per rank under an increasing version: the store applies a publish only if its version
  is newer than the last applied one, so a retried or late publish changes nothing and no load
  is lost or counted twice (a publish never sends a delta);
- **falls back** when a store call fails or exceeds its time budget: the decision then runs on
  the own ledger plus an estimate of the foreign load (below), the fallback is counted, and the
  store is not called again for ``retry_s`` seconds; the first call that succeeds after that
  publishes the whole own load again (reconnect) before it views. A good call that finds the
  store without our last applied version (the server restarted and lost it, or another process
  published under our id) is followed at once by a whole publish.

Fallback estimate
-----------------
With ``F`` the foreign load of the last good view, ``O_v`` the own load then and ``O`` the own
load now, the share of the fleet's traffic this replica carries is ``p = own requests / total
requests`` at the last view (clipped to ``[MIN_SHARE, 1]``; 1 before any view). Each change of
the own load since the view is taken as the replica's part of a change of the fleet:
``F_est = max(0, F + (1/p - 1) * (O - O_v))``, rank by rank. A replica that routes to a rank
during an outage thus expects the others to be doing the same, rather than routing greedily on
a snapshot that grows stale (the herd effect). With one replica ``p = 1`` and ``F_est = F``.

A store is any object with the method ``sync(key, replica_id, version, fields, values,
size)``
(below); it raises :class:`StoreError` when it cannot answer within its budget.

Duties of a leader
------------------
A store that also offers leases (``acquire_lease``, ``write_fenced``, ``read_fenced``, and
``reap``, as :class:`lbkit.replicas.RedisStore` does) gives the link two duties:

- **reaping**: every ``reap_after_s / 3`` seconds (the store's ``reap_after_s``; ``None``: never)
  the link sends a heartbeat, takes or renews the lease ``reaper-KEY`` and, while it holds it,
  takes out of the table the contribution of every replica silent for ``reap_after_s`` (a
  crashed one; a paused one publishes whole again when it comes back);
- **rounds** (:meth:`ReplicaLink.round_demand`, :meth:`ReplicaLink.round_plan`, called by a
  prefill balancer's ``end_round``): each replica adds its routed quota per bucket to a table
  of its own in the store (cumulative microseconds, published like the load), so that the
  round's demand is the fleet's: its own quota plus the growth of the others' since its last
  round. The holder of the lease ``round-KEY`` (renewed each round for the store's
  ``lease_s``) plans the round and writes the engines' buckets after its moves under its
  fencing epoch; a follower applies the latest plan it has not applied (the moves from its
  buckets to the plan's) instead of its own. A leader that paused past its lease and was
  replaced finds its write refused, counted in ``fenced``.

A round whose store calls fail is planned on the replica's own figures (counted in
``round_fallbacks``). A balancer's ``statistics()`` shows the counters as ``store_reaped``,
``store_rounds_led``, ``store_plans_followed``, ``store_plans_fenced`` and
``store_round_fallbacks``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from lbkit.core.validation import check_real

__all__ = [
    "MIN_SHARE",
    "FollowedPlan",
    "PlanMove",
    "ReplicaLink",
    "Store",
    "StoreError",
    "reduce_by_state",
    "replica_id_iv",
]

#: Smallest traffic share of the fallback estimate (caps the extrapolation at 20x).
MIN_SHARE = 0.05
#: Seconds without a store call after a failed one.
DEFAULT_RETRY_S = 0.5


#: Units of the cumulative demand a store holds: microseconds of quota.
DEMAND_US = 1e6


class PlanMove(NamedTuple):
    """One engine changing bucket under the leader's plan (the fields of a prefill move)."""

    engine: int
    from_bucket: int
    to_bucket: int


class FollowedPlan(NamedTuple):
    """The leader's plan as a follower applies it (the fields of a prefill re-plan that
    ``end_round`` reads; the bottlenecks are the leader's to know: infinite here)."""

    moves: tuple[PlanMove, ...]
    bottleneck_before: float = float("inf")
    bottleneck_after: float = float("inf")


class StoreError(Exception):
    """A store call failed: the server is unreachable, slow beyond the budget, or refused."""


class Store(Protocol):
    """What a balancer needs from a shared store (see :class:`lbkit.replicas.RedisStore`)."""

    def sync(
        self,
        key: str,
        replica_id: str,
        version: int,
        fields: np.ndarray,
        values: np.ndarray,
        size: int,
        whole: bool = False,
    ) -> tuple[np.ndarray | None, int]:
        """Publish ``values`` (int64) at flat ``fields`` of this replica's contribution to table
        ``key`` if ``version`` is newer than the last applied one (``version < 0``: publish
        nothing); then return the totals (int64, the ``size`` fields; ``None`` when ``size`` is
        0) and the version of the replica's last applied publish (-1: none; -2: the replica
        was reaped, and only a ``whole`` publish of every field is applied), in one atomic
        step."""
        ...


def replica_id_iv(store: Any, replica_id: Any) -> str | None:
    """Validate the ``store=`` / ``replica_id=`` pair of a balancer; the id or ``None``."""
    if store is None:
        if replica_id is not None:
            raise ValueError("replica_id: given without a store")
        return None
    if not callable(getattr(store, "sync", None)):
        raise TypeError(f"store: must have a sync method (a Store), got {type(store).__name__}")
    if not isinstance(replica_id, str) or not replica_id or ":" in replica_id:
        raise ValueError(
            f"replica_id: must be a non-empty str without ':' when a store is given, "
            f"got {replica_id!r}"
        )
    return replica_id


def reduce_by_state(balancer: Any, link: ReplicaLink | None) -> tuple[Any, tuple[Any]]:
    """``balancer.__reduce__``: pickled and copied as its ``state_dict()``, rebuilt by
    ``from_state_dict``; a balancer attached to a store (``link``) refuses, since a copy that
    published as the same replica would count its load twice."""
    if link is not None:
        name = type(balancer).__name__
        raise TypeError(
            f"{name}: a balancer with a store cannot be pickled; pickle its state_dict() and "
            "pass store= and replica_id= to from_state_dict"
        )
    return (type(balancer).from_state_dict, (balancer.state_dict(),))


class ReplicaLink:
    """One balancer's view of, and contribution to, a store's table of ``columns x ranks``
    integers (see the module documentation).

    Parameters
    ----------
    store : Store
    replica_id : str
    key : str
        The table in the store (one per pool and kind of balancer).
    num_ranks, columns : int
        Shape of the table: ``columns`` integer figures per rank (column 0: requests).
    clock : callable, default ``time.monotonic``
        Seconds, for the retry delay only (never for a decision).
    retry_s : float, default ``DEFAULT_RETRY_S``

    Counters: ``views`` (good calls that read the totals), ``publishes``, ``fallbacks``
    (decisions on an estimate), ``errors`` (failed store calls), ``reconnects`` (first good
    call after a failure), ``rebuilds`` (the store did not hold our last publish, e.g. after a
    server restart without persistence: published whole again at once); the duties'
    ``reaped`` (contributions of silent replicas taken out), ``led`` (rounds planned as the
    holder of the round's lease), ``followed`` (leader's plans applied), ``fenced`` (plans
    refused by the fencing epoch: a newer leader exists) and ``round_fallbacks`` (rounds on
    this replica's own figures because the store did not answer).
    """

    def __init__(
        self,
        store: Store,
        replica_id: str,
        *,
        key: str,
        num_ranks: int,
        columns: int,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        self.store = store
        self.replica_id = replica_id
        self.key = key
        self.shape = (columns, num_ranks)
        self.clock = clock
        self.retry_s = check_real(retry_s, "retry_s", min_value=0.0)
        self.version = time.time_ns() // 1000  # increasing across restarts of a replica
        zero = np.zeros(self.shape, dtype=np.int64)
        self.published = zero.copy()  # own load as last sent
        self.foreign = zero.copy()  # foreign load of the last good view
        self.own_at_view = zero.copy()
        self.share = 1.0
        self.dirty = True  # the store may not hold our contribution: publish it whole
        self.failed = False
        self.acked = -1  # version of our last publish the store applied
        self.retry_at = -np.inf
        names = ("views", "publishes", "fallbacks", "errors", "reconnects", "rebuilds",
                 "reaped", "led", "followed", "fenced", "round_fallbacks")  # fmt: skip
        self.counts = dict.fromkeys(names, 0)
        self.next_duty = -np.inf
        self.demand: ReplicaLink | None = None  # the cumulative demand's table (rounds)
        self.demand_cum = np.zeros((1, 0), dtype=np.int64)
        self.foreign_demand: np.ndarray | None = None  # the others' at the last round
        self.round_epoch = -1
        self.plan_version = 0
        self.round_failed = False  # this round's demand came without the store

    # ------------------------------------------------------------------ calls
    def _call(
        self, own: np.ndarray, fields: np.ndarray | None, rebuilt: bool = False, view: bool = True
    ) -> bool:
        """One store call: publish ``own`` at ``fields`` (``None``: nothing; the whole table
        when dirty), then take the view (unless not ``view``). False on failure (counted, retry
        delayed)."""
        if self.clock() < self.retry_at:
            return False
        flat = own.ravel()
        whole = self.dirty
        if whole:
            fields = np.arange(flat.size, dtype=np.int64)
        elif fields is None:
            fields = flat[:0]
        version = -1
        if len(fields):
            self.version += 1
            version = self.version
        try:
            totals, stored = self.store.sync(
                self.key,
                self.replica_id,
                version,
                fields,
                flat[fields],
                flat.size if view else 0,
                whole=whole,
            )
        except StoreError:
            self._failed()
            return False
        if self.failed:
            self.counts["reconnects"] += 1
            self.failed = False
        self.dirty = False
        if self.clock() >= self.next_duty:
            self._reap_duty()
        if version >= 0:
            self.counts["publishes"] += 1
            self.published = own.copy()
            self.acked = version
        if stored != self.acked and not rebuilt:
            # The store lost (a restart without persistence) or never held our contribution,
            # or another process wrote it under our id: publish it whole again.
            self.counts["rebuilds"] += 1
            self.dirty = True
            return self._call(own, None, rebuilt=True, view=view)
        if not view:
            return True
        self.counts["views"] += 1
        totals = totals.reshape(self.shape)
        mine = self.published
        self.foreign = np.maximum(totals - mine, 0)
        self.own_at_view = mine
        tb, ob = int(totals[0].sum()), int(mine[0].sum())
        self.share = 1.0 if tb <= 0 else min(1.0, max(MIN_SHARE, ob / tb))
        return True

    # ------------------------------------------------------------------ duties
    def _failed(self) -> None:
        self.counts["errors"] += 1
        self.dirty = self.failed = True
        self.retry_at = self.clock() + self.retry_s

    def _reap_duty(self) -> None:
        """Heartbeat, take or renew the reaper's lease, and reap while holding it."""
        store = self.store
        after = getattr(store, "reap_after_s", None)
        if after is None or not callable(getattr(store, "reap", None)):
            self.next_duty = np.inf
            return
        self.next_duty = self.clock() + after / 3.0
        empty = np.zeros(0, dtype=np.int64)
        try:
            store.sync(self.key, self.replica_id, -1, empty, empty, 0)  # the heartbeat
            if store.acquire_lease(f"reaper-{self.key}", self.replica_id, ttl_s=after) >= 0:
                self.counts["reaped"] += len(store.reap(self.key, max_silence_s=after))
        except StoreError:
            self._failed()

    def round_demand(self, quota: Sequence[float]) -> list[float]:
        """The fleet's quota routed per bucket this round: ``quota`` (this replica's, s) plus
        the growth of the other replicas' cumulative quota since this replica's last round
        (clipped at 0: a reaped replica's leaves). Publishes this replica's cumulative quota.
        On a store failure: ``quota`` alone, scaled by the traffic share of the last view."""
        q = np.asarray(quota, dtype=np.float64)
        if self.demand is None:
            self.demand = ReplicaLink(self.store, self.replica_id, key=f"{self.key}-demand",
                                      num_ranks=len(q), columns=1, clock=self.clock,
                                      retry_s=self.retry_s)  # fmt: skip
            self.demand_cum = np.zeros((1, len(q)), dtype=np.int64)
        self.demand_cum = self.demand_cum + np.rint(q * DEMAND_US).astype(np.int64)
        d = self.demand
        changed = np.flatnonzero((self.demand_cum != d.published).ravel())
        if not d._call(self.demand_cum, changed):
            self.round_failed = True
            return (q / self.share).tolist()
        now = d.foreign[0].astype(np.float64)
        last, self.foreign_demand = self.foreign_demand, now
        if last is None:
            return q.tolist()
        return (q + np.maximum(now - last, 0.0) / DEMAND_US).tolist()

    def round_plan(self, result: Any, home: np.ndarray, in_service: np.ndarray) -> Any:
        """The re-plan a prefill round applies: its own ``result`` (a re-plan with ``moves``
        of ``engine`` and ``to_bucket``, or ``None``) while this replica holds the round's
        lease, written under the lease's fencing epoch as the engines' buckets after the
        moves; else the leader's latest plan not yet applied, as :class:`FollowedPlan` (only
        engines ``in_service`` move), or ``None``. On a store failure: ``result``."""
        store = self.store
        if not callable(getattr(store, "acquire_lease", None)):
            return result
        failed, self.round_failed = self.round_failed, False
        if failed or self.clock() < self.retry_at:  # the store does not answer: plan alone
            self.counts["round_fallbacks"] += 1
            return result
        name = f"round-{self.key}"
        try:
            epoch = store.acquire_lease(name, self.replica_id, ttl_s=store.lease_s)
            if epoch >= 0:
                self.round_epoch = epoch
                self.counts["led"] += 1
                if result is not None:
                    plan = home.copy()
                    for mv in result.moves:
                        plan[mv.engine] = mv.to_bucket
                    self.write_plan({"home": plan.tolist()})
                return result
            got = store.read_fenced(name)
        except StoreError:
            self._failed()
            self.counts["round_fallbacks"] += 1
            return result
        if got is None or got[1] <= self.plan_version:
            return None
        self.plan_version = got[1]
        self.counts["followed"] += 1
        plan = json.loads(got[2])["home"]
        moves = tuple(
            PlanMove(e, int(home[e]), int(b))
            for e, b in enumerate(plan[: len(home)])
            if b != home[e] and in_service[e]
        )
        return FollowedPlan(moves)

    def write_plan(self, payload: dict[str, Any]) -> bool:
        """Write the round's plan under this replica's last fencing epoch; whether the store
        took it (refused: a newer leader exists, counted in ``fenced``)."""
        version = self.store.write_fenced(f"round-{self.key}", self.round_epoch,
                                          json.dumps(payload))  # fmt: skip
        if version < 0:
            self.counts["fenced"] += 1
            return False
        self.plan_version = version
        return True

    def statistics(self) -> dict[str, int]:
        """The ``store_*`` fields of a balancer's statistics: views, fallbacks, errors and
        reconnects (rebuilds included), and the duties' counters; the calls of the round
        demand's table count with this link's (errors, reconnects, reaped)."""
        c = dict(self.counts)
        if self.demand is not None:
            for name in ("errors", "reconnects", "rebuilds", "reaped"):
                c[name] += self.demand.counts[name]
        return {
            "store_views": c["views"],
            "store_fallbacks": c["fallbacks"],
            "store_errors": c["errors"],
            "store_reconnects": c["reconnects"] + c["rebuilds"],
            "store_reaped": c["reaped"],
            "store_rounds_led": c["led"],
            "store_plans_followed": c["followed"],
            "store_plans_fenced": c["fenced"],
            "store_round_fallbacks": c["round_fallbacks"],
        }

    def view(self, own: np.ndarray) -> np.ndarray:
        """The foreign load for a decision, shape ``(columns, num_ranks)`` int64: from the
        store, or the fallback estimate (counted) when the store does not answer."""
        if self._call(own, None):
            return self.foreign
        self.counts["fallbacks"] += 1
        scale = 1.0 / self.share - 1.0
        est = self.foreign + np.rint(scale * (own - self.own_at_view)).astype(np.int64)
        return np.maximum(est, 0)

    def publish(self, own: np.ndarray) -> None:
        """Publish the own load's changed fields (everything after a failure); a failure
        leaves the link dirty, to publish whole on the next good call."""
        changed = np.flatnonzero((own != self.published).ravel())
        if len(changed) or self.dirty:
            self._call(own, changed, view=False)
