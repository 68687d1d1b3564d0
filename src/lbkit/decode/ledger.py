"""The ledger of :class:`~lbkit.decode.DecodeBalancer`: running requests and per-rank sums.

Two arrays hold everything the decisions read, so that a policy kernel places a request in one
call without Python objects:

- ``slots``, int64 of shape ``(NUM_FIELDS, capacity)``: one column per request slot, rows
  :data:`RANK`, :data:`KV` (KV tokens held), :data:`GEN` (tokens generated), :data:`EXPECT`
  (expected output tokens, -1 when unknown) and :data:`ORDER` (admission number). A free slot
  has rank ``num_ranks`` and zeros elsewhere;
- ``X``, the policy kernels' float64 state matrix of shape ``(NUM_ROWS, num_ranks)``
  (:mod:`lbkit.decode._kernels`): requests and KV tokens per rank (the ledger's plus the
  foreign load), capacities, eligibility and, under look-ahead, the projected state.

Sums of KV tokens stay exact in float64 because a request holds at most :data:`MAX_TOKENS`.

Reconciliation rule
-------------------
When an engine's report of a rank agrees on the request count and the rank holds requests,
:meth:`Ledger.reconcile` sets the ledger's KV to the reported KV: each request's KV is scaled,
``kv_i <- floor(kv_i * R / S)`` (``R // B`` each when ``S == 0``), and the remaining tokens go
one each to the oldest requests. The sum is then exactly ``R``, no request goes negative, and
later releases free what the engine actually holds. With a foreign load, ``R`` is the reported
KV minus the foreign KV.

Look-ahead
----------
With ``lookahead_steps = h > 0`` the policy scores each rank by its *projected* state ``h`` steps
ahead instead of its current one (rows ``ROW_PB``, ``ROW_PS`` of ``X``): a request with a known
expected output that has at most ``h`` tokens left is projected to have left (it releases all of
its KV), every other request is projected to hold ``kv + h`` tokens (one token per step). A rank
of many short requests thus looks both lighter (its requests leave soon) and faster-growing
(``B_r`` tokens per step while they run); the projection counts both. Requests without an
expected output, and the foreign load, are assumed to stay. The incoming request is scored as
holding ``s + h`` tokens (its own growth does not depend on the rank). Capacities are always
checked against the current ledger.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from lbkit.decode import _kernels as K

__all__ = [
    "EXPECT", "GEN", "KV", "MAX_RANK_TOKENS", "MAX_TOKENS", "NUM_FIELDS", "ORDER", "RANK",
    "Ledger",
]  # fmt: skip

#: Rows of the slot matrix.
RANK, KV, GEN, EXPECT, ORDER = range(5)
NUM_FIELDS = 5
#: Largest KV tokens of one request, and of one rank (the ledger's plus the foreign load): the
#: float64 sums of the state matrix stay exact.
MAX_TOKENS = 2**52
MAX_RANK_TOKENS = 2**53


class Ledger:
    """Running requests of one engine (slot matrix, id map) and the kernels' state matrix.

    Parameters
    ----------
    num_ranks : int
    lookahead_steps : int
        ``h``: the projected rows of ``X`` are kept when ``h > 0``.
    cap_b, cap_s : ndarray of float64, shape (num_ranks,)
        Admission capacities (``inf``: none), validated by the caller.

    Every method trusts its arguments (the balancer validates); all are O(1) unless stated.
    """

    __slots__ = ("X", "fb", "free", "fs", "h", "ids", "n", "rid_of", "slots")

    def __init__(self, num_ranks: int, lookahead_steps: int, cap_b: Any, cap_s: Any) -> None:
        n = self.n = num_ranks
        self.h = lookahead_steps
        X = np.zeros((K.NUM_ROWS, n))
        X[K.ROW_CAP_B] = cap_b
        X[K.ROW_CAP_S] = cap_s
        X[K.ROW_OK] = 1.0
        self.X = X
        self.slots = np.zeros((NUM_FIELDS, 0), dtype=np.int64)
        self.rid_of: list[Hashable | None] = []
        self.free: list[int] = []
        self.ids: dict[Hashable, int] = {}
        self.fb = np.zeros(n, dtype=np.int64)  # foreign requests per rank
        self.fs = np.zeros(n, dtype=np.int64)  # foreign KV tokens per rank
        self.grow(64)

    # ------------------------------------------------------------------ slots
    def grow(self, extra: int) -> None:
        """Add ``extra`` free slots (the lowest free slot is used first). O(capacity)."""
        cap = self.slots.shape[1]
        slots = np.zeros((NUM_FIELDS, cap + extra), dtype=np.int64)
        slots[:, :cap] = self.slots
        slots[RANK, cap:] = self.n  # the free-slot sentinel
        self.slots = slots
        self.rid_of.extend([None] * extra)
        self.free.extend(range(cap + extra - 1, cap - 1, -1))

    def slot_of(self, request_id: Any) -> int:
        """The slot of a running request; ``KeyError`` naming it if unknown."""
        try:
            return self.ids[request_id]
        except (KeyError, TypeError):
            raise KeyError(f"request_id: unknown request {request_id!r}") from None

    def used(self) -> np.ndarray:
        """Slots holding a request, ascending. O(capacity)."""
        return np.flatnonzero(self.slots[RANK] < self.n)

    def slots_on(self, rank: int) -> np.ndarray:
        """Slots of the requests on ``rank``, oldest first. O(capacity)."""
        idx = np.flatnonzero(self.slots[RANK] == rank)
        return idx[np.argsort(self.slots[ORDER, idx], kind="stable")]

    def by_age(self) -> np.ndarray:
        """Slots of all running requests, oldest first. O(capacity)."""
        idx = self.used()
        return idx[np.argsort(self.slots[ORDER, idx], kind="stable")]

    def take(self, request_id: Hashable, slot: int) -> None:
        """Name the slot a kernel just filled (``slot`` is ``free[-1]``)."""
        self.free.pop()
        self.ids[request_id] = slot
        self.rid_of[slot] = request_id

    def insert(self, request_id: Hashable, rank: int, kv: int, gen: int, expect: int,
               order: int) -> None:  # fmt: skip
        """Add a request to the ledger as it was saved (restore; projections not updated)."""
        if not self.free:
            self.grow(self.slots.shape[1])
        slot = self.free[-1]
        self.slots[:, slot] = (rank, kv, gen, expect, order)
        self.take(request_id, slot)
        self.X[K.ROW_B, rank] += 1.0
        self.X[K.ROW_S, rank] += kv

    # ------------------------------------------------------------------ projection
    def projected(self, slot_idx: Any) -> Any:
        """Whether the requests in ``slot_idx`` are projected to stay ``h`` steps ahead."""
        ex = self.slots[EXPECT, slot_idx]
        return (ex < 0) | (ex - self.slots[GEN, slot_idx] > self.h)

    def reproject(self) -> None:
        """Recompute the projected rows of ``X`` (no-op without look-ahead). O(capacity)."""
        if not self.h:
            return
        idx = self.used()
        keep = idx[self.projected(idx)]
        ranks = self.slots[RANK, keep]
        n, h = self.n, self.h
        self.X[K.ROW_PB] = np.bincount(ranks, minlength=n) + self.fb
        self.X[K.ROW_PS] = np.bincount(
            ranks, weights=(self.slots[KV, keep] + h).astype(np.float64), minlength=n
        ) + (self.fs + h * self.fb)

    # ------------------------------------------------------------------ changes
    def release(self, slot: int) -> int:
        """Remove the request in ``slot``; returns its rank."""
        s, X = self.slots, self.X
        r = int(s[RANK, slot])
        kv = int(s[KV, slot])
        if self.h and self.projected(slot):
            X[K.ROW_PB, r] -= 1.0
            X[K.ROW_PS, r] -= kv + self.h
        X[K.ROW_B, r] -= 1.0
        X[K.ROW_S, r] -= kv
        s[:, slot] = 0
        s[RANK, slot] = self.n
        rid = self.rid_of[slot]
        self.rid_of[slot] = None
        del self.ids[rid]
        self.free.append(slot)
        return r

    def move(self, slot: int, rank: int) -> None:
        """Move the request in ``slot`` to ``rank`` (its KV with it)."""
        s, X = self.slots, self.X
        a = int(s[RANK, slot])
        kv = int(s[KV, slot])
        if self.h and self.projected(slot):
            X[K.ROW_PB, a] -= 1.0
            X[K.ROW_PS, a] -= kv + self.h
            X[K.ROW_PB, rank] += 1.0
            X[K.ROW_PS, rank] += kv + self.h
        X[K.ROW_B, a] -= 1.0
        X[K.ROW_S, a] -= kv
        X[K.ROW_B, rank] += 1.0
        X[K.ROW_S, rank] += kv
        s[RANK, slot] = rank

    def growth_iv(self, growth: Any) -> None:
        """Refuse a step that would take a request past ``MAX_TOKENS`` or a rank past
        ``MAX_RANK_TOKENS`` KV tokens (the ledger's exact range); ``growth`` is a per-rank
        increment (shape ``(num_ranks + 1,)``) or ``(slot, tokens)`` pairs. O(capacity)."""
        L = self
        if isinstance(growth, list):
            if not growth:
                return
            slots = np.fromiter((slot for slot, _ in growth), np.int64, len(growth))
            t = np.fromiter((t for _, t in growth), np.int64, len(growth))
            kv = L.slots[KV, slots] + t
            add = np.bincount(L.slots[RANK, slots], weights=t.astype(np.float64), minlength=L.n)
        else:
            used = L.used()
            kv = L.slots[KV, used] + growth[L.slots[RANK, used]]
            add = growth[: L.n] * (L.X[K.ROW_B] - L.fb)
        if kv.size and int(kv.max()) > MAX_TOKENS:
            raise ValueError(
                f"tokens: a request would hold {int(kv.max())} KV tokens, more than "
                f"{MAX_TOKENS} (the most the ledger keeps exactly)"
            )
        total = L.X[K.ROW_S] + add
        if float(total.max()) > MAX_RANK_TOKENS:
            raise ValueError(
                f"tokens: rank {int(total.argmax())} would hold more than {MAX_RANK_TOKENS} KV "
                "tokens (the most the ledger sums exactly)"
            )

    def grow_requests(self, todo: list[tuple[int, int]]) -> None:
        """Each ``(slot, tokens)``: the request generated ``tokens`` (KV grows by as many)."""
        s, X = self.slots, self.X
        for slot, t in todo:
            s[KV, slot] += t
            s[GEN, slot] += t
            X[K.ROW_S, s[RANK, slot]] += t
        self.reproject()

    def grow_ranks(self, inc: np.ndarray) -> None:
        """Every own request of rank ``r`` generated ``inc[r]`` tokens. ``inc`` has shape
        ``(num_ranks + 1,)`` with ``inc[num_ranks] == 0`` (free slots). O(capacity)."""
        n = self.n
        grow = inc[self.slots[RANK]]
        self.slots[KV] += grow
        self.slots[GEN] += grow
        self.X[K.ROW_S] += inc[:n] * (self.X[K.ROW_B] - self.fb)
        self.reproject()

    def reconcile(self, rank: int, own_kv: int) -> None:
        """Give the own requests of ``rank`` ``own_kv`` KV tokens in all (module documentation,
        *Reconciliation rule*; the rank holds at least one own request). O(requests on it)."""
        idx = self.slots_on(rank)
        old = self.slots[KV, idx].tolist()
        have_s = sum(old)
        if have_s > 0:
            new = [kv * own_kv // have_s for kv in old]
        else:
            new = [own_kv // len(old)] * len(old)
        for i in range(own_kv - sum(new)):  # fewer than len(old) tokens: oldest first
            new[i] += 1
        self.slots[KV, idx] = new
        self.X[K.ROW_S, rank] = own_kv + self.fs[rank]
        self.reproject()

    # ------------------------------------------------------------------ foreign load
    def set_foreign(self, fb: np.ndarray, fs: np.ndarray) -> None:
        """Replace the foreign load (int64 arrays of shape (num_ranks,))."""
        db = (fb - self.fb).astype(np.float64)
        ds = (fs - self.fs).astype(np.float64)
        X = self.X
        X[K.ROW_B] += db
        X[K.ROW_S] += ds
        if self.h:
            X[K.ROW_PB] += db
            X[K.ROW_PS] += ds + self.h * db
        self.fb, self.fs = fb, fs

    def own(self) -> np.ndarray:
        """The ledger's requests and KV tokens per rank, int64 of shape (2, num_ranks)."""
        own = self.X[K.ROW_B : K.ROW_S + 1].astype(np.int64)
        own[0] -= self.fb
        own[1] -= self.fs
        return own

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Assert the ledger's invariants (for tests). O(capacity + ranks)."""
        n, s, X = self.n, self.slots, self.X
        cap = s.shape[1]
        assert len(self.rid_of) == cap
        used = s[RANK] < n
        assert (s[RANK] >= 0).all() and (s[RANK] <= n).all(), "slot rank out of range"
        assert sorted(self.free) == np.flatnonzero(~used).tolist(), "free list is stale"
        assert sorted(self.ids.values()) == np.flatnonzero(used).tolist(), "id map is stale"
        for rid, slot in self.ids.items():
            assert self.rid_of[slot] == rid, f"slot {slot} does not name {rid!r}"
        assert all(self.rid_of[i] is None for i in self.free), "a free slot names a request"
        assert (s[:, ~used][1:] == 0).all(), "a free slot holds data"
        assert (s[KV] >= 0).all() and (s[GEN] >= 0).all(), "negative tokens"
        assert (s[EXPECT] >= -1).all()
        assert len(set(s[ORDER, used].tolist())) == int(used.sum()), "admission order repeats"
        ranks = s[RANK, used]
        want_b = np.bincount(ranks, minlength=n)
        want_s = np.bincount(ranks, weights=s[KV, used].astype(np.float64), minlength=n)
        assert (self.fb >= 0).all() and (self.fs >= 0).all(), "negative foreign load"
        want_b = want_b + self.fb
        want_s = want_s + self.fs
        assert (X[K.ROW_B] == want_b).all(), f"request counts {X[K.ROW_B]} != {want_b}"
        assert (X[K.ROW_S] == want_s).all(), f"KV sums {X[K.ROW_S]} != {want_s}"
        if self.h:
            pb, ps = X[K.ROW_PB].copy(), X[K.ROW_PS].copy()
            self.reproject()
            assert (pb == X[K.ROW_PB]).all() and (ps == X[K.ROW_PS]).all(), "projection stale"
