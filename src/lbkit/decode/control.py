"""The rank-level methods of :class:`~lbkit.decode.DecodeBalancer`: migration, service, reports.

:class:`RankControl` holds the balancer's methods that move running requests or change a rank,
which :class:`~lbkit.decode.DecodeBalancer` inherits (``balancer.py`` has the set-up and the
request path: ``admit``, ``step``, ``finish``, ``abort``, statistics):

- **migrate / rebalance**: move running requests with their KV, one by hand or as planned by
  :mod:`lbkit.decode.migration` (room for a refused request, then moves towards balance);
- **drain_rank / remove_rank / restore_rank**: a rank out of service (draining: no new work;
  removed: its requests handed back to the caller, none lost) and back; the states are
  :mod:`lbkit.core.engines`', shared with the prefill balancer;
- **report**: reconcile the ledger with an engine's per-rank load report.

Reconciliation rule
-------------------
An engine reports, per rank, ``(sequence number, requests, KV tokens)``. A report whose sequence
number is not newer than the rank's last accepted one is stale and ignored. Otherwise the drift
(reported minus ledger, for requests and for KV tokens) is recorded. The request count is never
corrected: the router sees every admission and release, and a mismatch means the engine's
snapshot and the ledger see different request sets (requests in flight). When the counts agree
and the rank holds requests, the ledger's KV becomes the reported KV, spread over the requests
in proportion (:mod:`lbkit.decode.ledger`, *Reconciliation rule*). With a foreign load, drift is
reported minus (ledger plus foreign load), and a KV correction sets the own requests' KV to the
reported KV minus the foreign KV (none when that is negative).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from lbkit.core.engines import ACTIVE, DRAINING, OUT, STATE_NAMES
from lbkit.core.replica import ReplicaLink
from lbkit.core.validation import check_int
from lbkit.decode import _kernels as K
from lbkit.decode.ledger import KV, MAX_TOKENS, RANK, Ledger
from lbkit.decode.migration import ROOM_MAX_MOVES, plan_on, room_on
from lbkit.decode.results import Migration, RemovedRequests, ReportResult

__all__ = ["MAX_SEQ", "ROOM_GROW_STEPS", "RankControl"]

#: Steps of KV growth kept free on a rank freed for a waiting request.
ROOM_GROW_STEPS = 4
#: Largest sequence number and request count of a report (int64).
MAX_SEQ = 2**63 - 1


class RankControl:
    """The migration, service and report methods of :class:`~lbkit.decode.DecodeBalancer`
    (module docstring).

    Not used on its own: it works on the state the balancer's ``__init__`` sets, declared here,
    and calls the balancer's ``_rank_iv``, ``_pull`` and ``_push``.
    """

    _n: int
    _L: Ledger
    _P: np.ndarray
    _state: np.ndarray
    _seq: np.ndarray
    _counts: dict[str, int]
    _link: ReplicaLink | None
    _max_moves: int
    _make_room: bool
    _sources: str
    _room: tuple[Hashable, int] | None
    _room_failed: int

    # ------------------------------------------------------------------ migration
    def migrate(self, request_id: Hashable, rank: int) -> int:
        """Move a running request (with its KV) to ``rank``; returns the rank it left.

        Its age, generated and expected tokens stay; look-ahead projections follow it.

        Raises
        ------
        KeyError
            Unknown request.
        ValueError
            ``rank`` unknown, not active, the request's own rank, or without room for it
            (``max_batch``, ``max_kv_tokens``). Nothing changes then.

        Runtime complexity: O(1).
        """
        slot = self._L.slot_of(request_id)
        rank = self._rank_iv(rank)
        s, X = self._L.slots, self._L.X
        a = int(s[RANK, slot])
        kv = int(s[KV, slot])
        if rank == a:
            raise ValueError(f"rank: request {request_id!r} already runs on rank {rank}")
        if self._state[rank] != ACTIVE:
            raise ValueError(f"rank: {rank} is {STATE_NAMES[self._state[rank]]}, not active")
        if X[K.ROW_B, rank] + 1 > X[K.ROW_CAP_B, rank]:
            raise ValueError(f"rank: {rank} is at max_batch ({int(X[K.ROW_CAP_B, rank])})")
        if X[K.ROW_S, rank] + kv > X[K.ROW_CAP_S, rank]:
            raise ValueError(
                f"rank: {rank} has no room for {kv} KV tokens (max_kv_tokens "
                f"{int(X[K.ROW_CAP_S, rank])})"
            )
        self._move(slot, rank)
        self._push()
        return a

    def _move(self, slot: int, rank: int) -> None:
        """Move the request in ``slot`` to ``rank`` in the ledger (checked by the caller)."""
        self._L.move(slot, rank)
        self._counts["migrated"] += 1

    def rebalance(self, max_moves: int | None = None) -> tuple[Migration, ...]:
        """Migrate running requests: room for a waiting request, then moves towards balance.

        1. *Room* (with ``make_room``): when an admission was refused for lack of room
           (``batch_full``, ``kv_full``, ``full``) and no request has been admitted since, the
           moves of :func:`lbkit.decode.migration.plan_room` that free one active rank for that
           request (each moved request goes where the admission rule places it among the other
           active ranks; ``ROOM_GROW_STEPS`` steps of growth kept free; at most
           ``ROOM_MAX_MOVES``, and none unless they free the rank). Until a request is admitted,
           that rank receives no balance move.
        2. *Balance*: up to ``max_moves`` moves of :func:`lbkit.decode.migration.plan_migrations`
           on the ledger (candidates: ``migration_sources``): every running request may move
           once, to an active rank with room; requests on draining ranks may leave them.

        The caller transfers each request's KV cache from ``source`` to ``target``. Calling this
        before every admission is what the defaults are measured with (the class notes).

        Parameters
        ----------
        max_moves : int, optional
            Balance moves (>= 0); default the constructor's ``max_migrations``.

        Returns
        -------
        tuple of Migration
            The moves made, in order (empty when no move is needed).

        Runtime complexity: balance moves ``O(moves * (requests + B * ranks))`` (``B`` requests
        on the heaviest rank; ``O(moves * requests * ranks)`` with ``migration_sources="all"``),
        room ``O(room moves * (requests + ranks))``; two numba calls.

        Examples
        --------
        A long request leaves rank 1; a short request of rank 0 takes its place:

        >>> from lbkit.decode import DecodeBalancer
        >>> bal = DecodeBalancer(2, policy="sum_of_squares")
        >>> for i, kv in enumerate([5000, 5000, 100, 100, 100, 100]):
        ...     _ = bal.admit(i, kv)
        >>> bal.finish(1)
        1
        >>> bal.num_requests().tolist(), bal.kv_tokens().tolist()
        ([3, 2], [5200, 200])
        >>> bal.rebalance(4)
        (Migration(request_id=2, source=0, target=1, kv_tokens=100),)
        >>> bal.num_requests().tolist(), bal.kv_tokens().tolist()
        ([2, 3], [5100, 300])

        Two ranks of 1,000 tokens hold 550 and 500: a request of 600 fits neither, though they
        have 950 free together. Rank 1 sends away its smallest request that frees enough:

        >>> bal = DecodeBalancer(2, max_kv_tokens=1000, max_migrations=0)
        >>> [bal.admit(i, kv).rank for i, kv in enumerate([400, 300, 200, 150])]
        [0, 1, 1, 0]
        >>> bal.kv_tokens().tolist(), bal.admit("long", 600)
        ([550, 500], Decision(rank=-1, reason='kv_full'))
        >>> bal.rebalance()
        (Migration(request_id=2, source=1, target=0, kv_tokens=200),)
        >>> bal.admit("long", 600)
        Decision(rank=1, reason='placed')
        """
        moves = (
            self._max_moves if max_moves is None else check_int(max_moves, "max_moves", min_value=0)
        )
        used = np.flatnonzero(self._L.slots[RANK] < self._n)
        if not len(used):
            return ()
        if self._link is not None:
            self._pull()
        out: list[Migration] = []
        reserved = -1
        released = self._counts["finished"] + self._counts["aborted"] + self._counts["handed_back"]
        if self._make_room and self._room is not None and released != self._room_failed:
            X = self._L.X.copy()
            rank = self._L.slots[RANK, used]  # a copy (fancy indexing)
            room = room_on(
                rank, self._L.slots[KV, used].astype(np.float64), X, self._room[1], self._P,
                ROOM_GROW_STEPS, ROOM_MAX_MOVES,
            )  # fmt: skip
            if room.complete:
                reserved = room.rank
                for i, dst in zip(room.request.tolist(), room.target.tolist(), strict=True):
                    out.append(self._moved(int(used[i]), dst))
                self._counts["migrated_for_room"] += len(room.request)
            else:  # no room to be made until a request leaves
                self._room_failed = released
        if moves:
            X = self._L.X.copy()
            if reserved >= 0:
                X[K.ROW_OK, reserved] = 0.0
            # The ledger is the plan's state matrix: counts, KV, capacities, eligibility.
            plan = plan_on(
                self._L.slots[RANK, used], self._L.slots[KV, used].astype(np.float64), X, moves,
                self._sources == "heaviest", False,
            )  # fmt: skip
            for i, dst in zip(plan.request.tolist(), plan.target.tolist(), strict=True):
                out.append(self._moved(int(used[i]), dst))
        if out:
            self._push()
        return tuple(out)

    def _moved(self, slot: int, rank: int) -> Migration:
        """Move the request in ``slot`` to ``rank``; the :class:`Migration` record."""
        m = Migration(self._L.rid_of[slot], int(self._L.slots[RANK, slot]), rank,
                      int(self._L.slots[KV, slot]))  # fmt: skip
        self._move(slot, rank)
        return m

    # ------------------------------------------------------------------ service
    def drain_rank(self, rank: int) -> None:
        """Stop placing new requests on ``rank``; its running requests continue.

        Raises ``ValueError`` for an unknown rank or one that is not active.
        """
        rank = self._rank_iv(rank)
        if self._state[rank] != ACTIVE:
            raise ValueError(f"rank: {rank} is {STATE_NAMES[self._state[rank]]}, not active")
        self._state[rank] = DRAINING
        self._L.X[K.ROW_OK, rank] = 0.0

    def remove_rank(self, rank: int) -> RemovedRequests:
        """Take ``rank`` out of service and hand its requests back (oldest first).

        The returned requests are released from the ledger (counted as handed back); the caller
        re-admits them, e.g. with their current KV tokens. Raises ``ValueError`` for an unknown
        rank or one already out of service.
        """
        rank = self._rank_iv(rank)
        if self._state[rank] == OUT:
            raise ValueError(f"rank: {rank} is already out of service")
        idx = self._L.slots_on(rank)
        ids = tuple(self._L.rid_of[i] for i in idx)
        kv = tuple(self._L.slots[KV, idx].tolist())
        for i in idx.tolist():
            self._L.release(i)
        self._state[rank] = OUT
        self._L.X[K.ROW_OK, rank] = 0.0
        self._counts["handed_back"] += len(ids)
        self._push()
        return RemovedRequests(ids, kv)

    def restore_rank(self, rank: int) -> None:
        """Put a draining or removed rank back into service. ``ValueError`` if it is active."""
        rank = self._rank_iv(rank)
        if self._state[rank] == ACTIVE:
            raise ValueError(f"rank: {rank} is already active")
        self._state[rank] = ACTIVE
        self._L.X[K.ROW_OK, rank] = 1.0

    # ------------------------------------------------------------------ reports
    def report(self, rank: int, seq: int, num_requests: int, kv_tokens: int) -> ReportResult:
        """Reconcile the ledger with an engine's load report for ``rank``.

        See the module documentation for the rule: stale reports (``seq`` not newer than the
        last accepted) are ignored; drift is always measured; KV is corrected only when the
        request counts agree. The report is of the whole rank: with a foreign load, drift is
        against the ledger plus the foreign load, and a correction gives the own requests the
        reported KV minus the foreign KV.

        Raises
        ------
        ValueError, TypeError
            Unknown rank, negative sequence number, requests or tokens (nothing changes).

        Runtime complexity: O(requests on the rank) when correcting, else O(1).
        """
        rank = self._rank_iv(rank)
        seq = check_int(seq, "seq", min_value=0, max_value=MAX_SEQ)
        got_b = check_int(num_requests, "num_requests", min_value=0, max_value=MAX_SEQ)
        got_s = check_int(kv_tokens, "kv_tokens", min_value=0, max_value=MAX_TOKENS)
        c = self._counts
        if seq <= self._seq[rank]:
            c["reports_stale"] += 1
            return ReportResult(False, False, 0, 0)
        self._seq[rank] = seq
        fb, fs = int(self._L.fb[rank]), int(self._L.fs[rank])
        have_b = int(self._L.X[K.ROW_B, rank])
        have_s = int(self._L.X[K.ROW_S, rank])
        db, ds = got_b - have_b, got_s - have_s
        c["reports_accepted"] += 1
        c["drift_requests_last"] = db
        c["drift_kv_tokens_last"] = ds
        c["drift_requests_max"] = max(c["drift_requests_max"], abs(db))
        c["drift_kv_tokens_max"] = max(c["drift_kv_tokens_max"], abs(ds))
        c["drift_kv_tokens_total"] += abs(ds)
        if db != 0 or have_b == fb or ds == 0 or got_s < fs:
            return ReportResult(True, False, db, ds)
        self._L.reconcile(rank, got_s - fs)  # the own requests' part of the reported KV
        c["reports_corrected"] += 1
        self._push()
        return ReportResult(True, True, db, ds)
