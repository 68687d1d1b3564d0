"""Rank choice of the prefill balancer: which rank of the engines serving a bucket gets a request.

Two pieces:

- :func:`layout`: the *slot* order of the ranks, the ranks of each bucket's active engines
  contiguous (engines in index order, each rank by rank), then the ranks of engines not taking
  work; each bucket routes to the slot range ``lo[j]:hi[j]`` of the bucket serving it
  (:func:`~lbkit.prefill.serving_buckets`). Rebuilt whenever an engine changes state or bucket.
- :class:`RankChooser`: one :class:`~lbkit.prefill.RankChoice` rule over those ranges, with the
  ledger's per-slot sums: ``"lockstep"`` (kernel ``lockstep_scored``), ``"least_load"`` (kernel
  ``least_scored``, ``sample`` in numpy, ``fill_holes`` with ``roomy_slot``), ``"engine_mean"``
  (kernel ``least_engine``), each with spill-over to a neighbouring bucket under
  ``spill_ratio``.

Each rule reads each candidate rank once: O(ranks of the bucket's engines) per request (with
``fill_holes`` or ``spill_ratio``, at most three more passes over the active ranks).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.engines import ACTIVE
from lbkit.prefill._kernels import least_engine, least_scored, roomy_slot
from lbkit.prefill.apportion import serving_buckets
from lbkit.prefill.ledger import Ledger
from lbkit.prefill.lockstep import (
    C_B,
    C_BUDGET,
    C_GAMMA,
    C_GROWTH,
    C_IDLE_GROWTH,
    C_K,
    C_MOE,
    C_Q,
    N_COEF,
    lockstep_scored,
)
from lbkit.prefill.options import RankChoice

__all__ = ["Layout", "RankChooser", "layout"]

_NO_HITS = np.zeros(0, dtype=np.int64)
_NO_ENDS = np.zeros(0)  # no step reports: no engine's running step is waited out


class Layout(NamedTuple):
    """Slot order and routing ranges (see :func:`layout`)."""

    order: list[int]  # slot -> flat rank
    lo: list[int]  # per bucket: first slot it routes to
    hi: list[int]  # per bucket: end of its slot range
    server: list[int]  # per bucket: the bucket whose engines serve it (-1: none)
    active_end: int  # slots of active engines: 0 .. active_end

    def neighbours(self, bucket: int) -> list[tuple[int, int]]:
        """Slot ranges of the neighbouring buckets a request of ``bucket`` may spill to: served
        by other engines than its own, and holding at least one engine."""
        out = []
        lo, hi, server = self.lo, self.hi, self.server
        for nbr in (bucket - 1, bucket + 1):
            if 0 <= nbr < len(lo) and server[nbr] != server[bucket] and lo[nbr] != hi[nbr]:
                out.append((lo[nbr], hi[nbr]))
        return out


def layout(home: np.ndarray, state: np.ndarray, num_buckets: int, ranks: int) -> Layout:
    """The slot layout of engines in ``state`` with home buckets ``home`` (both per engine).

    Examples
    --------
    >>> lay = layout(np.array([0, 1, 0]), np.array([0, 0, 2]), 2, 2)
    >>> lay.order, lay.lo, lay.hi, lay.active_end
    ([0, 1, 2, 3, 4, 5], [0, 2], [2, 4], 4)
    """
    active = state == ACTIVE
    counts = np.bincount(home[active], minlength=num_buckets)
    server = serving_buckets(counts).tolist()
    order: list[int] = []
    start = [0] * num_buckets
    stop = [0] * num_buckets
    for j in range(num_buckets):
        start[j] = len(order)
        for e in np.flatnonzero(active & (home == j)).tolist():
            order.extend(range(e * ranks, e * ranks + ranks))
        stop[j] = len(order)
    active_end = len(order)
    for e in np.flatnonzero(~active).tolist():
        order.extend(range(e * ranks, e * ranks + ranks))
    lo = [start[h] if h >= 0 else 0 for h in server]
    hi = [stop[h] if h >= 0 else 0 for h in server]
    return Layout(order, lo, hi, server, active_end)


class RankChooser:
    """A :class:`RankChoice` rule applied to the ledger's slots.

    Parameters
    ----------
    choice : RankChoice
    cost : QuadraticCost
    ranks_per_engine : int
    rng : numpy Generator
        Randomness for ``sample``.
    """

    def __init__(
        self,
        choice: RankChoice,
        cost: QuadraticCost,
        ranks_per_engine: int,
        rng: np.random.Generator,
    ) -> None:
        self.choice = choice
        self.rng = rng
        self._rule = choice.rule
        self._ranks = ranks_per_engine
        self._spill = choice.spill_ratio
        self._sample = choice.sample
        self._wake = choice.wake_penalty_s
        self._fill = choice.fill_holes
        coef = np.zeros(N_COEF)
        coef[C_B], coef[C_K], coef[C_Q], coef[C_GAMMA] = cost.b, cost.k, cost.q, cost.gamma
        coef[C_MOE] = float(cost.moe_s_per_token)
        coef[C_BUDGET] = choice.step_budget_s
        coef[C_GROWTH] = choice.growth_weight
        coef[C_IDLE_GROWTH] = choice.idle_growth_weight
        self._coef = coef

    def choose(
        self,
        led: Ledger,
        lay: Layout,
        order: np.ndarray,
        bucket: int,
        total: int,
        cached: int,
        hits: np.ndarray | None,
        ends: np.ndarray = _NO_ENDS,
        now: float = 0.0,
    ) -> tuple[int, str, int]:
        """Slot for a new request of ``bucket`` (-1 if no engine), the reason and the request's
        cached tokens there (``hits``: per flat rank, or ``None`` for ``cached`` everywhere;
        ``order``: ``lay.order`` as an array; ``ends``: when the running step of the engine of
        each block of ``ranks_per_engine`` slots ends, empty without step reports, and ``now``
        the time of the choice: the lockstep rule waits out ``max(0, ends - now)``)."""
        lo = lay.lo[bucket]
        hi = lay.hi[bucket]
        if lo == hi:
            return -1, "no_engine", cached
        if self._rule == "lockstep":
            return self._lockstep(led, lay, order, bucket, lo, hi, total, cached, hits, ends, now)
        if self._rule == "engine_mean":
            slot, reason = self._engine_mean(led, lay, bucket, lo, hi)
        else:
            quota = led.quota(total - cached, cached)
            slot, reason = self._least(led, lay, bucket, lo, hi, quota)
        return slot, reason, cached if hits is None else int(hits[led.rank_at[slot]])

    def _lockstep(self, led, lay, order, bucket, lo, hi, total, cached, hits, ends, now):
        """The lockstep rule (kernel ``lockstep_scored``, one pass per range)."""
        work, count, r, coef = led.work, led.count, self._ranks, self._coef
        h = _NO_HITS if hits is None else hits[order]
        k, score, hit = lockstep_scored(work, count, lo, hi, r, total, h, cached, coef, ends, now)
        slot = lo + k
        reason = "own_bucket" if lay.server[bucket] == bucket else "shared_bucket"
        if self._spill is not None:
            best = score
            for nlo, nhi in lay.neighbours(bucket):
                nk, nscore, nhit = lockstep_scored(work, count, nlo, nhi, r, total, h, cached,
                                                   coef, ends, now)  # fmt: skip
                if score > self._spill * nscore and nscore < best:
                    slot, best, hit, reason = nlo + nk, nscore, nhit, "spill"
        return slot, reason, int(hit)

    def _least(self, led, lay, bucket, lo, hi, quota):
        """The least-load rule: scores and holes from the kernels ``least_scored`` and
        ``roomy_slot`` (one pass over the slots each); ``sample`` draws its candidates in numpy.
        """
        load = led.load
        r = self._ranks
        wake = 0.0 if self._wake is None else self._wake
        if self._sample is None or self._sample >= hi - lo:
            k, score, top = least_scored(load, lo, hi, r, wake)
        else:
            vals = self.scores(load, lo, hi)
            pick = np.sort(self.rng.choice(hi - lo, size=self._sample, replace=False))
            k = int(pick[np.argmin(vals[pick])])
            score = vals[k]
            top = load[lo + k - k % r : lo + k - k % r + r].max()
        slot = lo + k
        reason = "own_bucket" if lay.server[bucket] == bucket else "shared_bucket"
        best = score
        if self._spill is not None and score > 0.0:  # a zero own score never spills
            for nlo, nhi in lay.neighbours(bucket):
                # the neighbour's idle engines pay the wake penalty too
                nk, nscore, ntop = least_scored(load, nlo, nhi, r, wake)
                if score > self._spill * nscore and nscore < best:
                    slot, best, top, reason = nlo + nk, nscore, ntop, "spill"
        # An own choice that runs within its engine's steps is a hole already; otherwise ties go
        # to the hole (the own choice would lengthen its engine's steps).
        if self._fill and load[slot] + quota > top and lay.active_end:
            hole = roomy_slot(load, lay.active_end, r, quota)
            if hole >= 0 and load[hole] <= best:
                slot, reason = hole, "fill"
        return slot, reason

    def _engine_mean(self, led, lay, bucket, lo, hi):
        """The engine-mean rule: engines scored by their mean quota load."""
        load = led.load
        r = self._ranks
        wake = 0.0 if self._wake is None else self._wake
        k, score = least_engine(load, lo, hi, r, wake)
        slot = lo + k
        reason = "own_bucket" if lay.server[bucket] == bucket else "shared_bucket"
        if self._spill is not None and score > 0.0:
            best = score
            for nlo, nhi in lay.neighbours(bucket):
                nk, nscore = least_engine(load, nlo, nhi, r, wake)
                if score > self._spill * nscore and nscore < best:
                    slot, best, reason = nlo + nk, nscore, "spill"
        return slot, reason

    def scores(self, load: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Least-load scores of the slots ``lo:hi`` in numpy (the ``sample`` path;
        ``least_scored`` is the same rule in one pass): the quota loads, plus the wake penalty
        on the ranks of idle engines (all ranks at zero load) when ``wake_penalty_s`` is set.

        Slots of one engine are contiguous (:func:`layout` lays engines out rank by rank), so
        the slice reshapes to (engines, ranks).
        """
        vals = load[lo:hi]
        if self._wake is None or self._wake == 0.0:
            return vals
        block = vals.reshape(-1, self._ranks)
        top = block.max(axis=1)
        return (block + np.where(top > 0.0, 0.0, self._wake)[:, None]).ravel()
