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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from lbkit.core.validation import check_real

__all__ = ["MIN_SHARE", "ReplicaLink", "Store", "StoreError", "replica_id_iv"]

#: Smallest traffic share of the fallback estimate (caps the extrapolation at 20x).
MIN_SHARE = 0.05
#: Seconds without a store call after a failed one.
DEFAULT_RETRY_S = 0.5


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
    server restart without persistence: published whole again at once).
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
        names = ("views", "publishes", "fallbacks", "errors", "reconnects", "rebuilds")
        self.counts = dict.fromkeys(names, 0)

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
            self.counts["errors"] += 1
            self.dirty = self.failed = True
            self.retry_at = self.clock() + self.retry_s
            return False
        if self.failed:
            self.counts["reconnects"] += 1
            self.failed = False
        self.dirty = False
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

    def statistics(self) -> dict[str, int]:
        """The ``store_*`` fields of a balancer's statistics: views, fallbacks, errors, and
        reconnects (rebuilds included)."""
        c = self.counts
        return {
            "store_views": c["views"],
            "store_fallbacks": c["fallbacks"],
            "store_errors": c["errors"],
            "store_reconnects": c["reconnects"] + c["rebuilds"],
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
