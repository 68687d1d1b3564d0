"""What :class:`~lbkit.prefill.PrefillBalancer`'s methods return: plain, immutable records."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

from lbkit.prefill.chunking import ChunkPlan
from lbkit.prefill.hysteresis import Move

__all__ = [
    "REASONS",
    "EnginePlan",
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
    Per rank (flat ``engine * ranks_per_engine + rank``): ``rank_load`` (the ledger's quota
    load, s), ``rank_foreign_load`` and ``rank_foreign_requests`` (other routers' quota load, s,
    and requests: :meth:`PrefillBalancer.set_foreign_load`).
    Per engine: ``engine_bucket`` (home bucket), ``engine_state`` (``"active"``, ``"draining"``,
    ``"out"``) and ``engine_step_end_s`` (when its last reported step ends, ``-inf`` if none was
    reported: :meth:`PrefillBalancer.step_started`). Counters: requests ``queued`` (in the
    ledger, queued or running), ``routed`` (admitted), ``finished``, ``refused``,
    ``handed_back``, ``rerouted``; ``moves`` and ``rounds`` so far; reports ``reports_accepted``
    and ``reports_stale``; ledger drift ``drift_last_s`` and ``drift_max_s``; ``reassigned``
    (requests moved between ranks of their engine, :meth:`PrefillBalancer.reassign`);
    ``steps_reported`` and ``steps_stale`` (engine step reports taken and ignored as older than
    the engine's last, :meth:`PrefillBalancer.step_started`). With a store: ``store_views``
    (good store calls), ``store_fallbacks`` (decisions on the fallback estimate),
    ``store_errors`` (failed calls), ``store_reconnects`` (whole publishes after a failure or a
    lost store) and the leader's duties (:mod:`lbkit.core.replica`): ``store_reaped`` (silent
    replicas' contributions reaped as the holder of the reaper's lease, counted per table: the
    load's and the round demand's), ``store_rounds_led`` (rounds planned as the holder of the
    round's lease), ``store_plans_followed`` (the leader's plans applied),
    ``store_plans_fenced`` (own plans refused by the fencing epoch: a newer leader exists) and
    ``store_round_fallbacks`` (rounds planned on this replica's own figures because the store
    did not answer).
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
    steps_reported: int = 0
    steps_stale: int = 0
    engine_step_end_s: tuple[float, ...] = ()
    rank_foreign_load: tuple[float, ...] = ()
    rank_foreign_requests: tuple[int, ...] = ()
    store_views: int = 0
    store_fallbacks: int = 0
    store_errors: int = 0
    store_reconnects: int = 0
    store_reaped: int = 0
    store_rounds_led: int = 0
    store_plans_followed: int = 0
    store_plans_fenced: int = 0
    store_round_fallbacks: int = 0
