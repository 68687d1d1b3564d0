"""Plumbing shared by the peers' policies (:mod:`lbkit.sim.peers`): the base class, a stale
copy of view arrays, view accessors that tolerate older views, and a router-side prefix index."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from lbkit.core.validation import as_rng, check_int
from lbkit.sim.protocol import EV_FINISH

__all__ = [
    "PeerPolicy",
    "PrefixIndex",
    "StaleStats",
    "view_block_hashes",
    "view_block_tokens",
    "view_field",
    "view_kv_usage",
]


def view_field(view: Any, name: str, n: int) -> np.ndarray:
    """``view.<name>`` as an array, zeros when the view has no such field (older engines)."""
    value = getattr(view, name, None)
    if value is None:
        return np.zeros(n, dtype=np.int64)
    return np.asarray(value)


def view_block_hashes(view: Any) -> np.ndarray:
    """``view.block_hashes`` (the request's chained 512-token block ids), empty if absent."""
    value = getattr(view, "block_hashes", None)
    return np.zeros(0, dtype=np.int64) if value is None else np.asarray(value)


def view_block_tokens(view: Any) -> int:
    """``view.block_tokens`` (tokens per block of ``block_hashes``), 512 if absent."""
    return int(getattr(view, "block_tokens", 512) or 512)


def view_kv_usage(view: Any, n: int) -> np.ndarray:
    """KV tokens held over capacity per rank (zeros without a capacity)."""
    cap = int(getattr(view, "kv_capacity_tokens", 0) or 0)
    if cap <= 0:
        return np.zeros(n)
    return view_field(view, "kv_tokens", n).astype(np.float64) / cap


class PeerPolicy:
    """Shared plumbing of the peers' policies: pool shape, rng, the rank of each routed request.

    Subclasses implement ``_choose(request, total_tokens, cached_tokens, now_s, view) -> rank``
    and may override ``_routed`` / ``_finished`` to keep their own counters. The rank of a
    routed request is remembered until its ``EV_FINISH`` event.

    Parameters
    ----------
    num_engines, ranks_per_engine : int
    cost : ignored (the peers' rules know no cost model)
    rng : numpy Generator, int seed or None
    """

    name = ""

    def __init__(
        self, num_engines: int, ranks_per_engine: int, *, cost: Any = None, rng: Any = None
    ) -> None:
        e = check_int(num_engines, "num_engines", min_value=1)
        r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
        self._n = e * r
        self._rng = as_rng(rng)
        self._rank_of: dict[int, int] = {}

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: Any) -> int:  # fmt: skip
        f = int(self._choose(int(request), int(total_tokens), int(cached_tokens), now_s, view))
        if f >= 0:
            self._rank_of[int(request)] = f
            self._routed(int(request), f, int(total_tokens), view)
        return f

    def observe(self, requests: np.ndarray, kinds: np.ndarray, tokens: np.ndarray, /, *,
                now_s: float) -> None:  # fmt: skip
        """Completion events drop requests from the policy's counts; others are not seen."""
        for i in np.asarray(requests)[np.asarray(kinds) == EV_FINISH].tolist():
            f = self._rank_of.pop(int(i), None)
            if f is not None:
                self._finished(int(i), f)

    def _choose(self, request: int, total_tokens: int, cached_tokens: int, now_s: float,
                view: Any) -> int:  # fmt: skip
        raise NotImplementedError

    def _routed(self, request: int, rank: int, total_tokens: int, view: Any) -> None:
        """Hook: ``request`` was just routed to ``rank``."""

    def _finished(self, request: int, rank: int) -> None:
        """Hook: ``request`` finished its prefill on ``rank``."""


class StaleStats:
    """A periodically refreshed copy of some per-rank view arrays (a router's stats feed).

    ``due(now_s)`` is true when ``now_s - last_s >= refresh_s`` (always before the first copy);
    ``take(now_s, **arrays)`` stores float64 copies the policy may then add its decisions to.
    """

    def __init__(self, refresh_s: float) -> None:
        self.refresh_s = refresh_s
        self.last_s = -np.inf
        self.arrays: dict[str, np.ndarray] = {}

    def due(self, now_s: float) -> bool:
        return now_s - self.last_s >= self.refresh_s

    def take(self, now_s: float, **arrays: np.ndarray) -> None:
        self.last_s = now_s
        self.arrays = {k: np.array(v, dtype=np.float64) for k, v in arrays.items()}


class PrefixIndex:
    """A router-side index of the prompt blocks routed to each rank, with LRU eviction.

    ``holders[block]`` is the set of ranks whose index holds ``block``; each rank keeps its
    blocks in least-recently-used order. Blocks are added (or touched) last block first, so a
    prefix is always more recent than its extensions and eviction removes leaves first, as a
    radix tree's leaf eviction does.

    Parameters
    ----------
    num_ranks : int
    capacity_blocks : int
        Blocks per rank before the least recently used ones go.
    """

    def __init__(self, num_ranks: int, capacity_blocks: int) -> None:
        self.capacity_blocks = check_int(capacity_blocks, "capacity_blocks", min_value=1)
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_ranks)]
        self.holders: dict[int, set[int]] = {}

    def add(self, blocks: np.ndarray, rank: int, *, evict: bool = True) -> None:
        """Record that ``blocks`` were routed to ``rank`` (and evict past capacity if asked)."""
        lru = self.lru[rank]
        for b in reversed(blocks.tolist()):
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
                self.holders.setdefault(b, set()).add(rank)
        if evict:
            self.evict(rank)

    def evict(self, rank: int) -> None:
        """Drop ``rank``'s least recently used blocks beyond the capacity."""
        lru = self.lru[rank]
        while len(lru) > self.capacity_blocks:
            b, _ = lru.popitem(last=False)
            s = self.holders[b]
            s.discard(rank)
            if not s:
                del self.holders[b]

    def deepest(self, blocks: np.ndarray) -> tuple[int, list[int]]:
        """Longest run of leading blocks some rank holds, and the ranks that hold all of it."""
        alive: set[int] | None = None
        depth = 0
        for b in blocks.tolist():
            s = self.holders.get(b)
            if not s:
                break
            nxt = set(s) if alive is None else alive & s
            if not nxt:
                break
            alive, depth = nxt, depth + 1
        return depth, sorted(alive) if alive else []

    def counts(self, blocks: np.ndarray, num_ranks: int) -> np.ndarray:
        """Per rank, how many of the leading blocks it holds, up to the first block nobody holds."""
        out = np.zeros(num_ranks, dtype=np.int64)
        for b in blocks.tolist():
            s = self.holders.get(b)
            if not s:
                break
            out[list(s)] += 1
        return out
