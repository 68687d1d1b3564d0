"""Decode routing policies of the simulator: the baselines and lbkit's decode balancer.

The protocol of :func:`lbkit.sim.engine.simulate_decode` is an object with

``route(request, kv_tokens, /, *, now_s, view) -> int``
    The flat rank (``engine * ranks_per_engine + rank``) of a request entering decode with
    ``kv_tokens`` KV tokens (its prompt; a preempted request's prompt plus the tokens it
    generated), or ``-1`` when no rank can take it now: the request then waits in the pool's
    FIFO wait queue and is offered again after a step end where requests finished (see
    :func:`~lbkit.sim.engine.simulate_decode`); it is never dropped.
``observe(left, /, *, now_s, view) -> None``
    Requests that left their rank since the last call (an int64 array the simulator reuses):
    they finished decoding, or were preempted back to the wait queue (KV growth filled their
    rank; they are routed again later).
``migrations(*, now_s, view) -> sequence of (request, rank)`` (optional)
    Called before each routing decision: running requests to move to another rank (their KV
    goes with them; with ``simulate_decode(migration_latency_s=, migration_s_per_kv_token=)``
    they stop decoding while it does, and a request moved to another engine joins that engine's
    next step; a move to the request's own rank is ignored). The simulator checks each move
    (running request, rank in range, capacities) and raises ``ValueError`` otherwise.

``view`` is a :class:`~lbkit.sim.engine.DecodeView`: per rank the requests admitted ``B_r`` and
their KV tokens ``S_r`` (exact at ``now_s``), the steps each engine has run, and the capacities.
A policy must respect the capacities (``B_r + 1 <= max_batch``, ``S_r + s <= max_kv_tokens``, the
admission limits) and return -1 when no rank can take the request (every policy here does).

What each policy uses (ties: lowest flat index):

==================  =================================================================
``round_robin``     nothing but the capacities: the next feasible rank in flat order
``random``          nothing but the capacities: a uniform feasible rank
``least_requests``  ``view.num_requests``
``least_kv``        ``view.kv_tokens``
``power_of_two``    ``view.num_requests`` of two distinct uniform ranks (then KV, then index)
``lbkit``           :class:`lbkit.decode.DecodeBalancer` with its default arguments: its own
                    ledger (admissions, step counts, completions); the ``min_max`` rule
                    (:data:`lbkit.decode.DEFAULT_POLICY`) and ``rebalance()`` before every
                    routing decision (room for a waiting request, one balance move)
==================  =================================================================

This is the only module of the simulator that imports :mod:`lbkit.decode`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from lbkit.core.validation import as_rng, check_int, check_real

__all__ = [
    "DECODE_POLICIES",
    "DEFAULT_DECODE_POLICY",
    "LbkitDecode",
]


def _feasible(view: Any, kv_tokens: int) -> np.ndarray | None:
    """Mask of ranks that can take ``kv_tokens`` more (``None``: every rank can)."""
    if view.max_batch is None and view.max_kv_tokens is None:
        return None
    ok = np.ones(view.num_requests.shape[0], dtype=bool)
    if view.max_batch is not None:
        ok &= view.num_requests + 1 <= view.max_batch
    if view.max_kv_tokens is not None:
        ok &= view.kv_tokens + kv_tokens <= view.max_kv_tokens
    return ok


def _argmin(values: np.ndarray, ok: np.ndarray | None) -> int:
    if ok is None:
        return int(values.argmin())
    if not ok.any():
        return -1
    idx = np.flatnonzero(ok)
    return int(idx[values[idx].argmin()])


class _Baseline:
    name = ""

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                 rng: Any = None):  # fmt: skip
        self._n = num_engines * ranks_per_engine
        self._rng = as_rng(rng)

    def observe(self, finished: np.ndarray, /, *, now_s: float, view: Any) -> None:
        """Baselines read the view only."""


class _RoundRobin(_Baseline):
    name = "round_robin"

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                 rng: Any = None):  # fmt: skip
        super().__init__(num_engines, ranks_per_engine, cost=cost, rng=rng)
        self._next = 0

    def route(self, request: int, kv_tokens: int, /, *, now_s: float, view: Any) -> int:
        ok = _feasible(view, kv_tokens)
        f = self._next
        if ok is not None:
            order = np.roll(np.arange(self._n), -f)
            hits = order[ok[order]]
            if hits.size == 0:
                return -1
            f = int(hits[0])
        self._next = (f + 1) % self._n
        return f


class _Random(_Baseline):
    name = "random"

    def route(self, request: int, kv_tokens: int, /, *, now_s: float, view: Any) -> int:
        ok = _feasible(view, kv_tokens)
        if ok is None:
            return int(self._rng.integers(self._n))
        idx = np.flatnonzero(ok)
        return int(idx[self._rng.integers(idx.size)]) if idx.size else -1


class _LeastRequests(_Baseline):
    name = "least_requests"

    def route(self, request: int, kv_tokens: int, /, *, now_s: float, view: Any) -> int:
        return _argmin(view.num_requests, _feasible(view, kv_tokens))


class _LeastKv(_Baseline):
    name = "least_kv"

    def route(self, request: int, kv_tokens: int, /, *, now_s: float, view: Any) -> int:
        return _argmin(view.kv_tokens, _feasible(view, kv_tokens))


class _PowerOfTwo(_Baseline):
    name = "power_of_two"

    def route(self, request: int, kv_tokens: int, /, *, now_s: float, view: Any) -> int:
        ok = _feasible(view, kv_tokens)
        idx = np.arange(self._n) if ok is None else np.flatnonzero(ok)
        m = idx.size
        if m <= 1:
            return int(idx[0]) if m else -1
        a = int(self._rng.integers(m))
        b = int(self._rng.integers(m - 1))
        b += b >= a
        i, j = int(idx[min(a, b)]), int(idx[max(a, b)])
        key_i = (int(view.num_requests[i]), int(view.kv_tokens[i]))
        key_j = (int(view.num_requests[j]), int(view.kv_tokens[j]))
        return j if key_j < key_i else i


class LbkitDecode:
    """lbkit's :class:`~lbkit.decode.DecodeBalancer` (default arguments) behind the protocol.

    The balancer keeps its own ledger: ``admit`` at routing, ``step`` with the decode steps each
    engine completed since the last call (every running request grew by one token per step),
    ``finish`` when a request leaves. It reads only the view's step counters (the clock of KV
    growth), never the per-rank loads. A request admitted during a step is charged that step's
    token too (at most one token of drift per request).

    Migration: at most every ``migrate_every_s`` seconds of simulated time (default 0: before
    every routing decision, as the balancer's defaults are measured; ``None``: never),
    :meth:`~lbkit.decode.DecodeBalancer.rebalance` over all ranks of all engines, handed to the
    simulator through ``migrations``: with ``max_migrations=None`` (default) the balancer's own
    default moves (``DecodeBalancer(max_migrations=, make_room=)``), else ``rebalance(
    max_migrations)``. ``migrated_kv_tokens`` sums the KV tokens moved. While a move's KV
    transfer is modelled the request does not decode, but the ledger still grows its KV by a
    token per step (a drift of a few tokens per move). ``**options`` go to the balancer (none by
    default: the ``lbkit`` policy is exactly ``DecodeBalancer(num_ranks)`` plus the pool's
    admission limits).

    With capacities the balancer gets the view's admission limits. When no rank is eligible its
    ``admit`` refuses and leaves the request out of its ledger (:mod:`lbkit.decode.reasons`:
    the caller keeps it), so ``route`` returns -1 and the simulator queues the request; offered
    again later, it is admitted afresh. A preempted request is ``finish``-ed from the ledger by
    ``observe`` and admitted afresh when offered again. The ledger never counts less KV than the
    pool (the drifts above only add tokens), so the balancer never places beyond a capacity.
    """

    name = "lbkit"

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                 rng: Any = None, migrate_every_s: float | None = 0.0,
                 max_migrations: int | None = None, **options: Any):  # fmt: skip
        from lbkit.decode import DecodeBalancer

        if migrate_every_s is not None:
            migrate_every_s = check_real(migrate_every_s, "migrate_every_s", min_value=0.0)
        self._every = migrate_every_s
        if max_migrations is not None:
            max_migrations = check_int(max_migrations, "max_migrations", min_value=0)
        self._moves = max_migrations
        self._next_s = -np.inf
        self.migrated_kv_tokens = 0
        self._r = ranks_per_engine
        self._e = num_engines
        self._steps = np.zeros(num_engines, dtype=np.int64)
        self._options = options
        self._caps_set = False
        self.balancer = DecodeBalancer(num_engines * ranks_per_engine, rng=rng, **options)
        self._factory = DecodeBalancer
        self._rng = rng

    def sync(self, view: Any) -> None:
        """Bring the ledger up to ``view``: the first time, rebuild the balancer with the view's
        admission limits (if any); then ``step`` it by the decode steps each engine completed
        since the last call. ``route``, ``observe`` and ``migrations`` call it; a wrapper that
        reads the ledger between calls (:mod:`lbkit.sim.replicas`) calls it first."""
        if not self._caps_set:
            self._caps_set = True
            if view.max_batch is not None or view.max_kv_tokens is not None:
                self.balancer = self._factory(
                    self._e * self._r, max_batch=view.max_batch,
                    max_kv_tokens=view.max_kv_tokens, rng=self._rng, **self._options,
                )  # fmt: skip
        delta = view.steps - self._steps
        if delta.any():
            if self._e == 1:
                self.balancer.step(int(delta[0]))
            else:
                self.balancer.step(np.repeat(delta, self._r))
            self._steps = view.steps.copy()

    def route(self, request: int, kv_tokens: int, /, *, now_s: float, view: Any) -> int:
        self.sync(view)
        return self.balancer.admit(request, kv_tokens).rank

    def observe(self, finished: np.ndarray, /, *, now_s: float, view: Any) -> None:
        self.sync(view)
        finish = self.balancer.finish
        for rid in finished.tolist():
            finish(rid)

    def migrations(self, *, now_s: float, view: Any) -> list[tuple[int, int]]:
        if self._every is None or now_s < self._next_s or not len(self.balancer):
            return []
        self._next_s = now_s + self._every
        self.sync(view)
        moves = self.balancer.rebalance(self._moves)
        self.migrated_kv_tokens += sum(m.kv_tokens for m in moves)
        return [(int(m.request_id), m.target) for m in moves]


#: Decode policies by name: ``factory(num_engines, ranks_per_engine, *, cost, rng)``.
DECODE_POLICIES: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        "round_robin": _RoundRobin,
        "random": _Random,
        "least_requests": _LeastRequests,
        "least_kv": _LeastKv,
        "power_of_two": _PowerOfTwo,
        "lbkit": LbkitDecode,
    }
)

#: The decode policy the simulator compares the others with.
DEFAULT_DECODE_POLICY = "lbkit"
