"""The engines of a prefill pool: each one's bucket, service state and last move, and the layout.

:class:`EnginePool` holds one entry per engine in numpy arrays (the :class:`PrefillBalancer`
keeps one and calls it):

- ``home[e]``: the length bucket the engine serves (or moves to, while it drains);
- ``state[e]``: its service state (:mod:`lbkit.core.engines`: ``ACTIVE``, ``DRAINING``,
  ``OUT``);
- ``last_move[e]``: when it last changed bucket, seconds (``-inf``: never);
- ``seq[e]``: the sequence number of its last accepted report (``-1``: none);
- ``step_start[e]``, ``step_end[e]``: when its last reported step started and ends
  (``-inf``: never reported);

and the routing :class:`~lbkit.prefill.choice.Layout` these give (:func:`layout`), rebuilt, with
the ledger's slot order, whenever an engine changes state or bucket.

Moving engines
--------------
A moving engine stops taking new work at once and joins its new bucket when its queue is empty
(it drains; it does not hand its queue back: the prefill already done on it, and the KV it holds,
would be lost). An engine taken out of service, in contrast, hands its requests back: the
balancer re-routes them from the start of their uncached tokens (``done`` resets to 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from lbkit.core.engines import ACTIVE, DRAINING, OUT, STATE_NAMES
from lbkit.core.validation import check_int
from lbkit.prefill.apportion import serving_buckets
from lbkit.prefill.choice import layout
from lbkit.prefill.ledger import Ledger

__all__ = ["EnginePool"]


class EnginePool:
    """Buckets, service states, last moves and report numbers of a pool's engines (module doc).

    Parameters
    ----------
    home : numpy.ndarray of int64, shape (num_engines,)
        The bucket of each engine (kept, not copied); every engine starts ``ACTIVE``.
    num_buckets : int
    ledger : Ledger
        The balancer's ledger, whose slot order follows the layout.
    """

    def __init__(self, home: np.ndarray, num_buckets: int, ledger: Ledger) -> None:
        e = home.shape[0]
        self.home = home
        self.state = np.full(e, ACTIVE, dtype=np.int8)
        self.last_move = np.full(e, -np.inf)
        self.seq = np.full(e, -1, dtype=np.int64)
        self.step_start = np.full(e, -np.inf)
        self.step_end = np.full(e, -np.inf)
        self.last_end = -np.inf  # the latest step end: no step runs after it
        self.num_buckets = num_buckets
        self.ranks = ledger.ranks
        self.ledger = ledger
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute the routing slices after engines changed state or bucket."""
        self.layout = layout(self.home, self.state, self.num_buckets, self.ranks)
        self.order = np.asarray(self.layout.order, dtype=np.int64)
        self.block_engine = self.order[:: self.ranks] // self.ranks  # engine of each slot block
        self.engine_block = np.argsort(self.block_engine)  # and the block of each engine
        self.block_end = self.step_end[self.block_engine]  # step ends in slot-block order
        self.ledger.relayout(self.layout.order)

    def start_step(self, engine: int, start: float, end: float) -> None:
        """Take an engine's report of a step from ``start`` to ``end`` (checked by the caller)."""
        self.step_start[engine] = start
        self.step_end[engine] = end
        self.block_end[self.engine_block[engine]] = end
        self.last_end = float(self.step_end.max())  # a report may shorten the engine's step

    def step_ends(self, now: float) -> np.ndarray | None:
        """When each slot block's engine's running step ends (``-inf``: never reported), in
        slot-block order: the lockstep rule's ``ends``; ``None`` when no step runs at ``now``
        (O(1))."""
        return self.block_end if self.last_end > now else None

    def restore(
        self,
        home: np.ndarray,
        state: np.ndarray,
        last_move: np.ndarray,
        seq: np.ndarray,
        step_start: np.ndarray,
        step_end: np.ndarray,
    ) -> None:
        """Take the arrays of a saved state (checked by :func:`~.persistence.read_state`)."""
        self.home, self.state, self.last_move, self.seq = home, state, last_move, seq
        self.step_start, self.step_end = step_start, step_end
        self.last_end = float(step_end.max())
        self.rebuild()

    def counts(self, state: int | None = None) -> np.ndarray:
        """Engines per bucket: in service (``state=None``) or in ``state``."""
        mask = self.state != OUT if state is None else self.state == state
        return np.bincount(self.home[mask], minlength=self.num_buckets)

    # ------------------------------------------------------------------ service
    def take_out(self, engine: int) -> None:
        """Take ``engine`` (a valid index) out of service; its requests stay for the caller."""
        if self.state[engine] == OUT:
            raise ValueError(f"engine: {engine} is already out of service")
        self.state[engine] = OUT
        self.rebuild()

    def put_back(self, engine: int, bucket: Any, now: float) -> None:
        """Put ``engine`` back into service, in its bucket or in ``bucket`` (``ValueError``
        for an engine in service or a bucket out of range)."""
        if self.state[engine] != OUT:
            raise ValueError(f"engine: {engine} is in service")
        if bucket is not None:
            bucket = check_int(bucket, "bucket", min_value=0, max_value=self.num_buckets - 1)
        if bucket is not None and bucket != self.home[engine]:
            self.home[engine] = bucket
            self.last_move[engine] = now
        self.state[engine] = ACTIVE
        self.rebuild()

    def join_if_drained(self, engine: int) -> None:
        """A draining engine whose queue emptied joins its new bucket."""
        if self.state[engine] == DRAINING and self.ledger.engine_requests(engine) == 0:
            self.state[engine] = ACTIVE
            self.rebuild()

    def move(self, moves: Iterable[Any], now: float) -> None:
        """Apply a re-plan's moves (``engine``, ``to_bucket``): busy engines drain first."""
        for mv in moves:
            self.home[mv.engine] = mv.to_bucket
            self.last_move[mv.engine] = now
            busy = self.ledger.engine_requests(mv.engine) > 0
            self.state[mv.engine] = DRAINING if busy else ACTIVE
        self.rebuild()

    # ------------------------------------------------------------------ introspection
    def statistics(self) -> dict[str, tuple[Any, ...]]:
        """The engine fields of :class:`~lbkit.prefill.PrefillStatistics`."""
        return {
            "bucket_engines": tuple(self.counts(ACTIVE).tolist()),
            "bucket_draining": tuple(self.counts(DRAINING).tolist()),
            "bucket_server": tuple(self.layout.server),
            "engine_bucket": tuple(self.home.tolist()),
            "engine_state": tuple(STATE_NAMES[s] for s in self.state.tolist()),
            "engine_step_end_s": tuple(self.step_end.tolist()),
        }

    def check(self) -> None:
        """Assert the engines' invariants and the layout's agreement with them and the ledger."""
        nb = self.num_buckets
        r = self.ranks
        led = self.ledger
        for f, queue in enumerate(led.queues):
            engine = f // r
            assert not (queue and self.state[engine] == OUT), f"engine {engine} is out, busy"
        for e in range(self.home.shape[0]):
            if self.state[e] == DRAINING:
                assert led.engine_requests(e) > 0, f"engine {e} drains an empty queue"
        assert ((self.home >= 0) & (self.home < nb)).all()
        assert not np.isnan(self.step_end).any() and (self.step_end < np.inf).all()
        assert (self.step_start <= self.step_end).all(), "a step ends before it starts"
        assert self.last_end == self.step_end.max(), "the latest step end is stale"
        assert (self.block_engine == self.order[::r] // r).all(), "slot blocks are stale"
        assert (self.block_engine[self.engine_block] == np.arange(self.home.shape[0])).all()
        assert (self.block_end == self.step_end[self.block_engine]).all(), "block ends are stale"
        active = self.state == ACTIVE
        lay = self.layout
        assert lay.server == serving_buckets(self.counts(ACTIVE)).tolist(), "serving map is stale"
        assert lay.order == led.rank_at, "the ledger's slots are not the routing layout's"
        for j in range(nb):
            h = lay.server[j]
            members = sorted(lay.order[lay.lo[j] : lay.hi[j]])
            want = [f for e in np.flatnonzero(active & (self.home == h)).tolist()
                    for f in range(e * r, e * r + r)] if h >= 0 else []  # fmt: skip
            assert members == want, f"bucket {j}: routing slice is stale"
            if active.any():
                assert lay.hi[j] > lay.lo[j], f"bucket {j} has no engine to serve it"
