"""Results of :class:`~lbkit.decode.DecodeBalancer`: plain records a caller may keep.

:class:`DecodeStatistics` is a snapshot of the ledger, the balance of the totals and the
counters; :class:`RemovedRequests`, :class:`ReportResult`, :class:`RequestInfo` and
:class:`Migration` are what single calls return.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "COUNTERS",
    "DecodeStatistics",
    "Migration",
    "RemovedRequests",
    "ReportResult",
    "RequestInfo",
]


class RemovedRequests(NamedTuple):
    """Requests handed back by :meth:`DecodeBalancer.remove_rank`, oldest first."""

    request_ids: tuple[Hashable, ...]
    kv_tokens: tuple[int, ...]


class ReportResult(NamedTuple):
    """Result of :meth:`DecodeBalancer.report`.

    Attributes
    ----------
    accepted : bool
        False for a stale report (sequence number not newer than the last accepted one).
    corrected : bool
        Whether the ledger's KV tokens were set to the reported ones.
    drift_requests, drift_kv_tokens : int
        Reported minus ledger, before any correction (0 for a stale report).
    """

    accepted: bool
    corrected: bool
    drift_requests: int
    drift_kv_tokens: int


class RequestInfo(NamedTuple):
    """Ledger entry of a running request (``expected_output_tokens`` is -1 when unknown)."""

    rank: int
    kv_tokens: int
    generated_tokens: int
    expected_output_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeStatistics:
    """Snapshot of a :class:`DecodeBalancer` (plain tuples and numbers; safe to keep).

    Per rank: ``num_requests``, ``kv_tokens`` (the ledger's), ``foreign_requests``,
    ``foreign_kv_tokens`` (other routers' load, :meth:`DecodeBalancer.set_foreign_load`),
    ``rank_state`` (``"active"``, ``"draining"``, ``"out"``). Balance of the totals (ledger
    plus foreign load) over ranks in service (active or draining): ``count_imbalance`` and
    ``kv_imbalance`` (max/mean, 1.0 when idle) and ``step_time_s`` (the modelled engine step
    under ``cost``, ``DecodeCost.engine_step_s``: slowest rank plus the shared expert cost).
    ``over_capacity``: ranks whose total KV grew past ``max_kv_tokens``.
    Counters: ``running``, ``admitted``, ``refused`` (with ``refused_by_reason``), ``finished``,
    ``aborted``, ``handed_back``, ``steps``; reports ``reports_accepted``, ``reports_stale``,
    ``reports_corrected``; drift (reported minus ledger) of the last accepted report
    (``drift_requests_last``, ``drift_kv_tokens_last``), the largest absolute drift
    (``drift_requests_max``, ``drift_kv_tokens_max``) and the summed absolute KV drift
    (``drift_kv_tokens_total``); ``migrated`` (every move) and ``migrated_for_room`` (those
    :meth:`DecodeBalancer.rebalance` made to free a rank for a refused request; they come first
    in its result and do not count against ``max_moves``). With a store: ``store_views`` (good
    store calls), ``store_fallbacks`` (decisions on the fallback estimate), ``store_errors``
    (failed calls), ``store_reconnects`` (whole publishes after a failure or a lost store) and
    the leader's duties (:mod:`lbkit.core.replica`): ``store_reaped`` (silent replicas whose
    contribution this replica reaped as the holder of the reaper's lease); the round counters
    ``store_rounds_led``, ``store_plans_followed``, ``store_plans_fenced`` and
    ``store_round_fallbacks`` are a prefill balancer's (0 here).
    """

    num_requests: tuple[int, ...]
    kv_tokens: tuple[int, ...]
    rank_state: tuple[str, ...]
    count_imbalance: float
    kv_imbalance: float
    step_time_s: float
    over_capacity: int
    running: int
    admitted: int
    refused: int
    refused_by_reason: tuple[tuple[str, int], ...]
    finished: int
    aborted: int
    handed_back: int
    steps: int
    reports_accepted: int
    reports_stale: int
    reports_corrected: int
    drift_requests_last: int
    drift_kv_tokens_last: int
    drift_requests_max: int
    drift_kv_tokens_max: int
    drift_kv_tokens_total: int
    migrated: int
    migrated_for_room: int
    foreign_requests: tuple[int, ...] = ()
    foreign_kv_tokens: tuple[int, ...] = ()
    store_views: int = 0
    store_fallbacks: int = 0
    store_errors: int = 0
    store_reconnects: int = 0
    store_reaped: int = 0
    store_rounds_led: int = 0
    store_plans_followed: int = 0
    store_plans_fenced: int = 0
    store_round_fallbacks: int = 0


class Migration(NamedTuple):
    """A running request moved by :meth:`DecodeBalancer.rebalance` (its KV goes with it)."""

    request_id: Hashable
    source: int
    target: int
    kv_tokens: int


#: The balancer's counters (fields of :class:`DecodeStatistics`).
COUNTERS = (
    "finished", "aborted", "handed_back", "steps",
    "reports_accepted", "reports_stale", "reports_corrected",
    "drift_requests_last", "drift_kv_tokens_last", "drift_requests_max", "drift_kv_tokens_max",
    "drift_kv_tokens_total", "migrated", "migrated_for_room",
)  # fmt: skip
