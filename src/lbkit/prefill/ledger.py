"""The prefill balancer's ledger: every request it routed, and the sums per rank it routes by.

A :class:`Request` remembers its rank, bucket, tokens (total, cached, prefilled) and its
*remaining quota*, ``cost.quota(remaining_tokens, cached_tokens + done_tokens)``: the work of
its remaining tokens as if run in one chunk. A rank's *quota load* is the sum of the remaining
quotas of its requests; its *work* adds the routed-expert seconds of their remaining tokens
(what the lockstep rule plans with). Both are kept as *exact* sums: each rank holds the
non-overlapping partials of Shewchuk's algorithm (the one behind :func:`math.fsum`), so that a
request's arrival, progress or departure adds or subtracts its terms exactly, in time
proportional to the few partials rather than to the queue. The figure a rank routes by is the
correctly rounded value of its partials, bit for bit what :func:`math.fsum` over the queue gives
(:meth:`Ledger.resum` recomputes it that way): no cancellation error builds up, and a rank whose
queue empties is back at exactly zero.

With the physical tie ``q = k/2`` (and ``gamma = 0``) a fall of the remaining quota is exactly
the work of the chunk just run, whatever the chunking. Otherwise it is not (``q > k/2`` charges
chunking less than the one-chunk estimate, ``q < k/2`` more), but the decrements telescope: the
load is the remaining quota of what is left, and zero once the request finishes.

The sums a rank is routed by (``load``, ``work``, ``count``) are the ledger's own plus the
*foreign* load of other routers (:mod:`lbkit.prefill.foreign`; zero unless set): ``own`` keeps
the ledger's quota load alone, and with no foreign load the two are the same floats.

The per-rank sums are kept in *slot* order (the layout of :mod:`lbkit.prefill.choice`: the ranks
of each bucket's engines contiguous), ``slot[flat]`` and ``rank_at[slot]`` translating.

Examples
--------
>>> from lbkit.core import PRESETS
>>> led = Ledger(2, 2, PRESETS["unit"].prefill)
>>> led.add(Request("a", 1, 0, 100, 0, 0, led.quota(100, 0)))
>>> float(led.rank_loads()[1]) == led.quota(100, 0)
True
>>> led.record(["a"], [100], [True])
(1, {1})
>>> led.rank_loads().tolist()
[0.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.validation import as_int_array, check_int, check_real
from lbkit.prefill._kernels import int_bounds

__all__ = [
    "MAX_TOKENS",
    "Ledger",
    "Request",
    "as_request_id",
    "as_time",
    "as_tokens",
    "hits_iv",
    "remaining_quota",
    "route_iv",
]


#: Largest token count of a request (2**40, as the trace readers): quotas, sums and the
#: kernels' int64 arithmetic stay far from overflow.
MAX_TOKENS = 2**40


def as_tokens(value: Any, name: str) -> int:
    """A token count: an int in ``[0, MAX_TOKENS]`` (``ValueError``/``TypeError`` naming
    ``name``)."""
    if type(value) is int and 0 <= value <= MAX_TOKENS:
        return value
    return check_int(value, name, min_value=0, max_value=MAX_TOKENS)


def as_request_id(value: Any) -> int | str:
    """A request id: an int (numpy integers become ``int``) or a str."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, str):
        return str(value)
    raise TypeError(f"request_id: must be an int or a str, got {type(value).__name__}")


def as_time(value: Any) -> float:
    """A finite time in seconds (``now_s``)."""
    if type(value) is float and value - value == 0.0:  # finite float: the common case
        return value
    return check_real(value, "now_s")


def route_iv(total_tokens: Any, cached_tokens: Any, now_s: Any) -> tuple[int, int, float]:
    """Validate a request's tokens and time (``PrefillBalancer.route``'s slow path)."""
    total = as_tokens(total_tokens, "total_tokens")
    cached = as_tokens(cached_tokens, "cached_tokens")
    if total == 0:
        raise ValueError("total_tokens: must be >= 1, got 0")
    if cached > total:
        raise ValueError(f"cached_tokens: must be <= total_tokens ({total}), got {cached}")
    return total, cached, as_time(now_s)


def hits_iv(cached_tokens: Any, total_tokens: Any, n: int) -> tuple[np.ndarray, int, bool]:
    """Per-rank cached tokens of ``n`` flat ranks, their least and whether one is the whole
    prompt. The common case, an int64 array of the right shape and a valid total, costs one
    kernel pass; anything else is validated in full."""
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


def _exact_add(partials: list[float], x: float) -> None:
    """Add ``x`` to the exact sum held by ``partials`` (non-overlapping, increasing magnitude).

    Shewchuk's error-free accumulation (Python's ``msum`` recipe): ``math.fsum(partials)`` is
    then the correctly rounded value of every number added so far. O(len(partials)).
    """
    i = 0
    for y in partials:
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo:
            partials[i] = lo
            i += 1
        x = hi
    partials[i:] = [x]


class Request:
    """One routed request: id, flat rank, bucket, tokens and remaining quota (seconds)."""

    __slots__ = ("bucket", "cached", "done", "quota", "rank", "rid", "total")

    def __init__(self, rid, rank, bucket, total, cached, done, quota):
        self.rid = rid
        self.rank = rank
        self.bucket = bucket
        self.total = total
        self.cached = cached
        self.done = done
        self.quota = quota

    @property
    def left(self) -> int:
        """Tokens still to prefill."""
        return self.total - self.cached - self.done


def _flag(value: Any, i: int) -> bool:
    """``finished[i]`` as a bool: ``bool``, numpy bools and the integers 0 and 1 only (a
    string, ``None`` or a float such as NaN is refused, never taken for its truth value)."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"finished[{i}]: must be a bool (or 0/1), got {type(value).__name__} {value!r}")


def remaining_quota(c: QuadraticCost, remaining: int, prefix: int) -> float:
    """``c.quota(remaining, prefix)`` in plain floats, seconds (0 for nothing left): the quota
    of :class:`Ledger` (which needs no pool to compute it)."""
    return (
        remaining * (c.b + c.k * prefix + c.q * remaining) + c.gamma * prefix if remaining else 0.0
    )


class Ledger:
    """Requests by id, their FIFO queue per flat rank, and the per-rank sums in slot order.

    Parameters
    ----------
    num_engines, ranks_per_engine : int
    cost : QuadraticCost
        The rank's step-cost model (its quota and routed-expert seconds per token).

    Attributes
    ----------
    requests : dict
        Request id to :class:`Request`.
    queues : list of dict
        Per flat rank, its requests in arrival order.
    load, work : ndarray of float, shape (num_ranks,)
        Quota load and step-time work per slot, seconds, foreign load included.
    count : ndarray of int, shape (num_ranks,)
        Requests per slot, foreign requests included.
    own, own_work : ndarray of float, shape (num_ranks,)
        The ledger's own quota load and work per slot, seconds.
    own_count : ndarray of int, shape (num_ranks,)
        The ledger's own requests per slot.
    f_load, f_work : ndarray of float, shape (num_ranks,)
        Foreign quota load and work per slot, seconds.
    f_count : ndarray of int, shape (num_ranks,)
        Foreign requests per slot.
    slot, rank_at : list of int
        Flat rank to slot and back.
    """

    def __init__(self, num_engines: int, ranks_per_engine: int, cost: QuadraticCost) -> None:
        n = num_engines * ranks_per_engine
        self.ranks = ranks_per_engine
        self.cost = cost
        self.moe = float(cost.moe_s_per_token)
        self.requests: dict[Hashable, Request] = {}
        self.queues: list[dict[Hashable, Request]] = [{} for _ in range(n)]
        self.load = np.zeros(n)
        self.work = np.zeros(n)
        self.count = np.zeros(n, dtype=np.int64)
        self.own = np.zeros(n)
        self.own_work = np.zeros(n)
        self.own_count = np.zeros(n, dtype=np.int64)
        self.f_load = np.zeros(n)
        self.f_work = np.zeros(n)
        self.f_count = np.zeros(n, dtype=np.int64)
        # Exact partial sums of each flat rank's quotas and work terms (module docstring).
        self._load_parts: list[list[float]] = [[] for _ in range(n)]
        self._work_parts: list[list[float]] = [[] for _ in range(n)]
        self.slot: list[int] = list(range(n))
        self.rank_at: list[int] = list(range(n))

    def quota(self, remaining: int, prefix: int) -> float:
        """``cost.quota(remaining, prefix)`` in plain floats, seconds (0 for nothing left)."""
        return remaining_quota(self.cost, remaining, prefix)

    def relayout(self, order: list[int]) -> None:
        """Put the per-rank sums in a new slot order (``order[slot]`` is a flat rank)."""
        to_flat = np.asarray(self.slot, dtype=np.int64)
        names = ("load", "work", "count", "own", "own_work", "own_count", "f_load", "f_work",
                 "f_count")  # fmt: skip
        flat = [getattr(self, name)[to_flat] for name in names]
        self.rank_at = order
        slot = [0] * len(order)
        for s, f in enumerate(order):
            slot[f] = s
        self.slot = slot
        where = np.asarray(order, dtype=np.int64)
        for name, arr in zip(names, flat, strict=True):
            setattr(self, name, arr[where])

    def rank_loads(self) -> np.ndarray:
        """The ledger's quota load per rank in flat order, shape (num_ranks,), seconds (a
        copy; without the foreign load)."""
        return self.own[np.asarray(self.slot, dtype=np.int64)]

    def total_loads(self) -> np.ndarray:
        """Quota load per rank in flat order with the foreign load, seconds (a copy)."""
        return self.load[np.asarray(self.slot, dtype=np.int64)]

    def set_foreign(self, quota_s: np.ndarray, work_s: np.ndarray, count: np.ndarray) -> None:
        """Set the foreign load, given per flat rank (validated by the caller)."""
        where = np.asarray(self.rank_at, dtype=np.int64)
        self.f_load = quota_s[where]
        self.f_work = work_s[where]
        self.f_count = count[where]
        self.load = self.own + self.f_load
        self.work = self.own_work + self.f_work
        self.count = self.own_count + self.f_count

    def own_flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ledger's own quota, work and requests per flat rank (copies)."""
        to_flat = np.asarray(self.slot, dtype=np.int64)
        return self.own[to_flat], self.own_work[to_flat], self.own_count[to_flat]

    def foreign(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The foreign quota, work and requests per flat rank (copies)."""
        to_flat = np.asarray(self.slot, dtype=np.int64)
        return self.f_load[to_flat], self.f_work[to_flat], self.f_count[to_flat]

    def get(self, rid: Hashable) -> Request:
        """The request of id ``rid`` (``KeyError`` naming it when unknown)."""
        try:
            return self.requests[rid]
        except (KeyError, TypeError):
            raise KeyError(f"request_id: unknown request {rid!r}") from None

    def add(self, req: Request) -> None:
        """Queue a request at the end of its rank's queue."""
        self.requests[req.rid] = req
        self.queues[req.rank][req.rid] = req
        self._credit(req, 1.0)
        self._refresh(req.rank)

    def drop(self, req: Request) -> None:
        """Remove a request from the ledger."""
        self._credit(req, -1.0)
        del self.requests[req.rid]
        del self.queues[req.rank][req.rid]
        self._refresh(req.rank)

    def move(self, req: Request, rank: int) -> None:
        """Move a request to the end of another rank's queue."""
        old = req.rank
        self._credit(req, -1.0)
        del self.queues[old][req.rid]
        self.queues[rank][req.rid] = req
        req.rank = rank
        self._credit(req, 1.0)
        for f in (old, rank):
            self._refresh(f)

    def advance(self, req: Request, done: int) -> float:
        """Set ``req.done``; update its quota and its rank's sums; return |quota change|."""
        new = self.quota(req.total - req.cached - done, req.cached + done)
        delta = req.quota - new
        self._credit(req, -1.0)
        req.done = done
        req.quota = new
        self._credit(req, 1.0)
        self._refresh(req.rank)
        return abs(delta)

    def _credit(self, req: Request, sign: float) -> None:
        """Add (``sign = 1.0``) or subtract (``-1.0``) a request's terms to its rank's partials:
        its remaining quota, and its work (the quota plus its remaining routed-expert seconds)."""
        q = req.quota
        _exact_add(self._load_parts[req.rank], sign * q)
        _exact_add(
            self._work_parts[req.rank], sign * (q + self.moe * (req.total - req.cached - req.done))
        )

    def _refresh(self, flat: int) -> None:
        """Set a rank's quota load, work and count from its partials and its queue."""
        slot = self.slot[flat]
        n = len(self.queues[flat])
        if n:
            own = math.fsum(self._load_parts[flat])
            work = math.fsum(self._work_parts[flat])
        else:  # exactly zero already; dropping the partials keeps them few
            self._load_parts[flat] = []
            self._work_parts[flat] = []
            own = work = 0.0
        self.own[slot] = own
        self.own_work[slot] = work
        self.own_count[slot] = n
        self.load[slot] = own + self.f_load[slot]
        self.work[slot] = work + self.f_work[slot]
        self.count[slot] = n + self.f_count[slot]

    def resum(self, flat: int) -> None:
        """Re-sum a rank's quota load, step-time work and request count from its queue
        (O(queue); the incremental updates give the same figures bit for bit)."""
        self._load_parts[flat] = []
        self._work_parts[flat] = []
        for r in self.queues[flat].values():
            self._credit(r, 1.0)
        self._refresh(flat)

    def engine_requests(self, engine: int) -> int:
        """Requests held by the ranks of ``engine``."""
        r = self.ranks
        return sum(len(self.queues[f]) for f in range(engine * r, engine * r + r))

    def record(self, request_ids: Any, toks: Any, finished: Any) -> tuple[int, set[int]]:
        """Apply a batch of progress and completions (see :meth:`PrefillBalancer.record`).

        The batch is validated as a whole first: if an entry is bad nothing is applied.

        Returns
        -------
        tuple of (int, set of int)
            Requests that left, and the flat ranks touched (each re-summed once).
        """
        ids = list(request_ids.tolist() if isinstance(request_ids, np.ndarray) else request_ids)
        toks = list(toks.tolist() if isinstance(toks, np.ndarray) else toks)
        fins = list(finished.tolist() if isinstance(finished, np.ndarray) else finished)
        if not len(ids) == len(toks) == len(fins):
            raise ValueError(
                "request_ids, tokens, finished: must have the same length, got "
                f"{len(ids)}, {len(toks)} and {len(fins)}"
            )
        requests = self.requests
        done: dict[int, int] = {}
        gone: set[int] = set()
        entries: list[tuple[Request, int, bool]] = []
        for i, (rid, tok, fin) in enumerate(zip(ids, toks, fins, strict=True)):
            req = requests.get(rid) if isinstance(rid, (int, str)) else None
            if req is None or id(req) in gone:
                raise KeyError(f"request_id: unknown request {rid!r}")
            if not (type(tok) is int and tok >= 0):
                tok = as_tokens(tok, "tokens")
            key = id(req)
            d = done.get(key, req.done) + tok
            if d > req.total - req.cached:
                raise ValueError(
                    f"tokens: request {rid!r} has {req.total - req.cached - d + tok} tokens left "
                    f"to prefill, got {tok}"
                )
            done[key] = d
            if type(fin) is not bool:
                fin = _flag(fin, i)
            if fin:
                gone.add(key)
            entries.append((req, tok, fin))
        touched: set[int] = set()
        quota = self.quota
        n_fin = 0
        credit = self._credit
        for req, tok, fin in entries:
            if tok:
                credit(req, -1.0)
                req.done += tok
                req.quota = quota(req.total - req.cached - req.done, req.cached + req.done)
                if not fin:
                    credit(req, 1.0)
            elif fin:
                credit(req, -1.0)
            touched.add(req.rank)
            if fin:
                del requests[req.rid]
                del self.queues[req.rank][req.rid]
                n_fin += 1
        for f in touched:
            self._refresh(f)
        return n_fin, touched

    def reported(
        self, engine: int, progress: Mapping[Hashable, int]
    ) -> tuple[list[tuple[Request, int]], tuple[Hashable, ...]]:
        """Validate an engine's report of cumulative prefilled tokens per request id.

        Returns the requests of the ledger on ``engine`` with their reported tokens, and the
        reported ids the ledger does not hold there (``ValueError`` naming ``progress[id]``
        for tokens outside ``[0, uncached tokens]``; nothing changes).
        """
        r = self.ranks
        ranks = range(engine * r, engine * r + r)
        known: list[tuple[Request, int]] = []
        unknown: list[Hashable] = []
        for rid, toks in progress.items():
            req = self.requests.get(rid) if isinstance(rid, (int, str)) else None
            if req is None or req.rank not in ranks:
                unknown.append(rid)
                continue
            toks = as_tokens(toks, f"progress[{rid!r}]")
            if toks > req.total - req.cached:
                raise ValueError(
                    f"progress[{rid!r}]: must be <= the request's uncached tokens "
                    f"({req.total - req.cached}), got {toks}"
                )
            known.append((req, toks))
        return known, tuple(unknown)

    def reconcile(
        self, engine: int, known: list[tuple[Request, int]]
    ) -> tuple[float, tuple[Hashable, ...]]:
        """Apply reported progress (forward only) of ``engine``'s requests (from
        :meth:`reported`); return the drift, seconds (sum of ``|ledger remaining quota -
        reported remaining quota|`` before), and the ids held there that were not reported."""
        drift = 0.0
        for req, toks in known:
            reported = self.quota(req.total - req.cached - toks, req.cached + toks)
            drift += abs(req.quota - reported)
            if toks > req.done:
                self.advance(req, toks)
        seen = {id(req) for req, _ in known}
        r = self.ranks
        missing = tuple(
            rid
            for f in range(engine * r, engine * r + r)
            for rid, req in self.queues[f].items()
            if id(req) not in seen
        )
        return drift, missing

    def check(self, bucket_of: Any) -> None:
        """Assert the ledger's invariants (for tests); ``bucket_of(total)`` gives a bucket."""
        n = len(self.queues)
        assert sorted(self.rank_at) == list(range(n)), "slots are not a permutation"
        assert all(self.rank_at[self.slot[f]] == f for f in range(n)), "slot maps disagree"
        flat = self.rank_loads()
        seen = 0
        for f, queue in enumerate(self.queues):
            total = 0.0
            scale = 0.0
            for rid, req in queue.items():
                assert self.requests.get(rid) is req, f"request {rid!r} on rank {f} not in ledger"
                assert req.rank == f, f"request {rid!r} records rank {req.rank}, queued on {f}"
                assert 0 <= req.done <= req.total - req.cached, f"request {rid!r} progress"
                assert 0 <= req.cached <= req.total and req.total >= 1
                assert req.bucket == bucket_of(req.total)
                want = self.quota(req.total - req.cached - req.done, req.cached + req.done)
                assert math.isclose(req.quota, want, rel_tol=1e-12, abs_tol=0.0)
                total += req.quota
                scale = max(scale, req.quota)
                seen += 1
            tol = 1e-9 * max(scale, 1e-300) * (len(queue) + 1)
            assert abs(flat[f] - total) <= tol, f"rank {f}: load {flat[f]} != quota sum {total}"
            # The incremental exact sums are bit for bit the correctly rounded sums of the queue.
            exact = math.fsum(r.quota for r in queue.values())
            assert flat[f] == exact, f"rank {f}: load {flat[f]!r} != exact quota sum {exact!r}"
            work = math.fsum(r.quota + self.moe * r.left for r in queue.values())
            got = self.own_work[self.slot[f]]
            assert got == work, f"rank {f}: work {got!r} != exact sum {work!r}"
            assert math.fsum(self._load_parts[f]) == (exact if queue else 0.0)
            if not queue:
                assert flat[f] == 0.0, f"rank {f}: empty queue with load {flat[f]}"
        assert seen == len(self.requests), "a request is in the ledger but in no queue"
        assert (self.load == self.own + self.f_load).all(), "total load is not own + foreign"
        counts = np.array([len(self.queues[f]) for f in self.rank_at], dtype=np.int64)
        assert (self.own_count == counts).all(), "request counts are stale"
        assert (self.count == counts + self.f_count).all(), "request counts are stale"
        assert (self.work == self.own_work + self.f_work).all(), "total work is not own + foreign"
