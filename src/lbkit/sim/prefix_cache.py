"""Prefix caching from Mooncake-style prefix-block ids.

Mooncake traces give every request the ids of its prompt's blocks (512 tokens each). The ids are
*chained*: an id stands for a block together with everything before it, so two requests that
share an id share the whole prefix up to and including that block.

Model (a static replay: no timing, one global cache):

1. Requests are served in trace order. At its arrival, a request **looks up** its blocks and
   reuses the longest prefix ``h[0..L-1]`` whose blocks are all cached (``L`` hit blocks).
2. Then the request **touches** all its blocks, tail first (``h[m-1]``, ..., ``h[0]``): blocks
   already cached become most recently used, missing ones are inserted. Insertion happens at
   arrival (the request is taken as served at once), so the next request can reuse them.
3. With ``capacity_blocks`` set, inserting into a full cache evicts the least recently used
   block. Touching the tail first makes a prefix's head more recent than its tail, so eviction
   trims prefixes from their end (as vLLM's and SGLang's prefix caches do) and every cached block
   keeps its parent cached: the cache stays prefix-closed.
4. ``cached_tokens = min(L * block_tokens, total_tokens - 1)``: at least one prompt token is always
   computed, because the forward pass over the last prompt token yields the first output token
   (vLLM recomputes the last token of a fully cached prompt for the same reason). So
   ``cached_tokens`` is a multiple of ``block_tokens`` except when a full hit is clipped.

LRU is a stack algorithm: the cache of capacity ``C`` always holds the ``C`` most recently
touched blocks, so a larger cache holds a superset and never gives fewer hits, request by
request.

Local caches (``--cache local``, :class:`RankCaches`, :class:`LocalPrefixCaches`): every rank
keeps its own LRU of blocks with the same lookup, tail-first touch and eviction rules, so a
request's cached tokens depend on the rank it is routed to. They are the router-side index
:class:`lbkit.prefill.PrefixIndex`, fed by the simulator's admissions and prefill ends. Timing
matters there: a request's hit blocks are touched on its rank when it is admitted, and its
blocks enter that rank's cache only when its prefill finishes there.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import numpy as np

from lbkit.core.validation import as_int_array, check_int
from lbkit.prefill.prefix_index import BYTES_PER_CACHED_BLOCK, PrefixIndex
from lbkit.sim.traces import MOONCAKE_BLOCK_TOKENS, Trace

__all__ = [
    "BYTES_PER_CACHED_BLOCK",
    "DEFAULT_PREFILL_KV_BYTES",
    "DSV3_KV_BYTES_PER_TOKEN",
    "CacheStatistics",
    "LocalPrefixCaches",
    "RankCaches",
    "apply_prefix_cache",
    "capacity_blocks_for",
    "prefix_hit_blocks",
]


def _prefix_hit_blocks_iv(
    hash_ids: Any, hash_offsets: Any, capacity_blocks: Any
) -> tuple[np.ndarray, np.ndarray, int | None]:
    ids = as_int_array(hash_ids, "hash_ids", ndim=1, min_value=0)
    offsets = as_int_array(hash_offsets, "hash_offsets", ndim=1, allow_empty=False)
    if offsets[0] != 0 or offsets[-1] != ids.size or (np.diff(offsets) < 0).any():
        raise ValueError(
            f"hash_offsets: must be non-decreasing from 0 to len(hash_ids) = {ids.size}"
        )
    if capacity_blocks is not None:
        capacity_blocks = check_int(capacity_blocks, "capacity_blocks", min_value=0)
    return ids, offsets, capacity_blocks


def prefix_hit_blocks(
    hash_ids: Any, hash_offsets: Any, /, *, capacity_blocks: int | None = None
) -> np.ndarray:
    """Number of leading blocks of each request found in an LRU prefix cache.

    Parameters
    ----------
    hash_ids : array_like of int, shape (total_blocks,)
        Block ids of all requests, concatenated in arrival order.
    hash_offsets : array_like of int, shape (n + 1,)
        Request ``i`` owns ``hash_ids[hash_offsets[i]:hash_offsets[i + 1]]``.
    capacity_blocks : int, optional
        Cache capacity in blocks (``0`` caches nothing); ``None`` is unbounded.

    Returns
    -------
    ndarray of int64, shape (n,)
        ``L_i``, the length of the longest prefix of request ``i``'s blocks that were all cached
        when it arrived (model in :mod:`lbkit.sim.prefix_cache`).

    Runtime complexity: O(total_blocks log total_blocks) unbounded (vectorised); O(total_blocks)
    dictionary operations with a capacity.

    Examples
    --------
    >>> ids = [0, 1, 2,   0, 1, 3,   0, 4,   0, 1, 2, 5]
    >>> prefix_hit_blocks(ids, [0, 3, 6, 8, 12]).tolist()
    [0, 2, 1, 3]
    >>> prefix_hit_blocks(ids, [0, 3, 6, 8, 12], capacity_blocks=3).tolist()
    [0, 2, 1, 2]
    """
    ids, offsets, capacity = _prefix_hit_blocks_iv(hash_ids, hash_offsets, capacity_blocks)
    if capacity is None:
        return _hits_unbounded(ids, offsets)
    return _hits_lru(ids, offsets, capacity)


def _hits_unbounded(ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    n = offsets.size - 1
    lengths = np.diff(offsets)
    request = np.repeat(np.arange(n), lengths)
    # A block is cached at request i iff its id first occurred in an earlier request.
    _, first_pos, inverse = np.unique(ids, return_index=True, return_inverse=True)
    cached = request[first_pos[inverse]] < request
    misses = np.flatnonzero(~cached)
    # L_i = (position of the first miss at or after the request's start, capped at its end) - start
    k = np.searchsorted(misses, offsets[:-1])
    first_miss = np.where(k < misses.size, misses[np.minimum(k, misses.size - 1)], ids.size)
    return (np.minimum(first_miss, offsets[1:]) - offsets[:-1]).astype(np.int64)


def _hits_lru(ids: np.ndarray, offsets: np.ndarray, capacity: int) -> np.ndarray:
    n = offsets.size - 1
    hits = np.zeros(n, dtype=np.int64)
    flat = ids.tolist()
    bounds = offsets.tolist()
    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    touch = cache.move_to_end
    evict = cache.popitem
    for i in range(n):
        blocks = flat[bounds[i] : bounds[i + 1]]
        hit = 0
        for b in blocks:
            if b not in cache:
                break
            hit += 1
        hits[i] = hit
        for b in reversed(blocks):  # tail first: the head ends most recently used
            if b in cache:
                touch(b)
            else:
                cache[b] = None
                if len(cache) > capacity:
                    evict(last=False)
    return hits


def apply_prefix_cache(
    trace: Trace,
    /,
    *,
    capacity_blocks: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """A copy of ``trace`` whose ``cached_tokens`` come from an LRU prefix cache.

    Any ``cached_tokens`` already in ``trace`` are replaced. The model (lookup, tail-first touch,
    LRU eviction, at least one token computed) is described in :mod:`lbkit.sim.prefix_cache`.

    Parameters
    ----------
    trace : Trace
        Must have ``hash_ids``, ``ceil(total_tokens / block_tokens)`` per request.
    capacity_blocks : int, optional
        Cache capacity in blocks; ``None`` (default) is unbounded.
    block_tokens : int, default 512
        Tokens per block.

    Returns
    -------
    Trace
        ``cached_tokens = min(L * block_tokens, total_tokens - 1)`` with ``L`` from
        :func:`prefix_hit_blocks`.

    Raises
    ------
    ValueError
        The trace has no hash ids, a request's block count does not match its length, or a bad
        capacity or block size.

    Runtime complexity: as :func:`prefix_hit_blocks`; about 0.05 s unbounded and 0.2 s with a
    capacity for the 12,031-request Mooncake trace.

    Examples
    --------
    >>> t = Trace(arrival_s=[0, 1, 2], total_tokens=[1024, 1500, 1024], output_tokens=[1, 1, 1],
    ...           hash_ids=[7, 8, 7, 8, 9, 7, 8], hash_offsets=[0, 2, 5, 7])
    >>> apply_prefix_cache(t).cached_tokens.tolist()
    [0, 1024, 1023]
    >>> apply_prefix_cache(t, capacity_blocks=1).cached_tokens.tolist()
    [0, 512, 512]
    """
    block_tokens = check_int(block_tokens, "block_tokens", min_value=1)
    _check_trace_blocks(trace, block_tokens)
    hits = prefix_hit_blocks(trace.hash_ids, trace.hash_offsets, capacity_blocks=capacity_blocks)
    return trace.with_cached_tokens(np.minimum(hits * block_tokens, trace.total_tokens - 1))


# --- local (per-rank) caches -------------------------------------------------------------------

#: DeepSeek-V3 KV cache bytes per token (MLA, bf16): 61 layers x (512 + 64) values x 2 bytes.
DSV3_KV_BYTES_PER_TOKEN = 61 * (512 + 64) * 2
#: Default KV budget of one prefill rank (bytes), as ``lbkit.sim.engine.PREFILL_KV_CAPACITY_TOKENS``
#: counts it: an H800's 80 GB minus 37 GB of DeepSeek-V3 FP8 weights (16.6 B replicated parameters
#: plus 654 B routed-expert parameters over the 32 GPUs of DeepSeek's prefill unit) minus 8 GB of
#: activations and communication buffers: 35 GB, i.e. 972 blocks of 512 tokens per rank.
DEFAULT_PREFILL_KV_BYTES = 35 * 10**9


def capacity_blocks_for(
    kv_bytes: int = DEFAULT_PREFILL_KV_BYTES,
    /,
    *,
    kv_bytes_per_token: int = DSV3_KV_BYTES_PER_TOKEN,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> int:
    """Blocks of ``block_tokens`` tokens that fit in a rank's KV memory.

    Parameters
    ----------
    kv_bytes : int, default :data:`DEFAULT_PREFILL_KV_BYTES` (35 GB)
        KV cache memory of one rank, bytes.
    kv_bytes_per_token : int, default 70,272
        KV bytes per token (DeepSeek-V3 MLA in bf16: 61 x (512 + 64) x 2).
    block_tokens : int, default 512
        Tokens per block.

    Returns
    -------
    int
        ``floor(kv_bytes / (kv_bytes_per_token * block_tokens))``.

    Runtime complexity: O(1).

    Examples
    --------
    >>> capacity_blocks_for()
    972
    >>> capacity_blocks_for(80 * 10**9, kv_bytes_per_token=1024, block_tokens=16)
    4882812
    """
    kv_bytes = check_int(kv_bytes, "kv_bytes", min_value=0)
    per_token = check_int(kv_bytes_per_token, "kv_bytes_per_token", min_value=1)
    block_tokens = check_int(block_tokens, "block_tokens", min_value=1)
    return kv_bytes // (per_token * block_tokens)


@dataclasses.dataclass(frozen=True)
class CacheStatistics:
    """Counters of :class:`RankCaches`, arrays of shape ``(num_ranks,)`` (int64).

    Attributes
    ----------
    lookups : ndarray
        Admissions (:meth:`RankCaches.touch` calls) on each rank.
    lookup_blocks : ndarray
        Blocks of the admitted requests.
    hit_blocks : ndarray
        Of those, blocks found cached (the touched prefix).
    insertions : ndarray
        Blocks inserted by :meth:`RankCaches.insert`.
    evictions : ndarray
        Blocks evicted at capacity.
    cached_blocks : ndarray
        Blocks cached now.
    """

    lookups: np.ndarray
    lookup_blocks: np.ndarray
    hit_blocks: np.ndarray
    insertions: np.ndarray
    evictions: np.ndarray
    cached_blocks: np.ndarray


def _block_list(block_ids: Any) -> list[int]:
    if type(block_ids) is list and all(type(b) is int for b in block_ids):
        return block_ids
    arr = np.asarray(block_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(
            f"block_ids: must be a 1-d sequence of integer block ids, got shape {arr.shape} "
            f"and dtype {arr.dtype}"
        )
    return arr.tolist()


class RankCaches:
    """Independent LRU caches of chained block ids, one per rank.

    Each rank follows the model of :mod:`lbkit.sim.prefix_cache`: a request reuses the longest
    prefix of its blocks cached on the rank, blocks are touched tail first (so each cache stays
    prefix-closed and eviction trims prefixes from their end) and the least recently used block
    is evicted when a rank holds more than ``capacity_blocks``.

    The caches are a :class:`lbkit.prefill.PrefixIndex` (the router-side index, with the same
    rules), fed by admissions (:meth:`touch`) and finished prefills (:meth:`insert`); this class
    adds the simulator's lookup counters and names its arguments ``block_ids``.

    Parameters
    ----------
    num_ranks : int
        Number of ranks, ``>= 1``.
    capacity_blocks : int or None
        Blocks each rank can hold (``0`` caches nothing); ``None`` is unbounded. See
        :func:`capacity_blocks_for`.
    block_tokens : int, default 512
        Tokens per block (for ``index.hit_tokens``).

    Attributes
    ----------
    index : lbkit.prefill.PrefixIndex
        The caches.

    Notes
    -----
    Memory: at most :data:`BYTES_PER_CACHED_BLOCK` (200) bytes of Python objects per cached block
    and rank. Timing: as :class:`lbkit.prefill.PrefixIndex` (``benchmarks/bench_sim_cache.py``
    measures :meth:`hit_blocks` and an admission plus insertion at 8 and 64 ranks).

    Examples
    --------
    >>> c = RankCaches(2, capacity_blocks=3)
    >>> c.insert(0, [7, 8, 9])
    >>> c.insert(1, [7, 5])
    >>> c.hit_blocks([7, 8, 6]).tolist()
    [2, 1]
    >>> c.touch(0, [7, 8, 6], 2)   # admitted on rank 0 with 2 hit blocks
    >>> c.insert(0, [7, 8, 6])     # prefill finished: block 6 evicts 9, the least recent
    >>> c.hit_blocks([7, 8, 9]).tolist(), c.statistics().evictions.tolist()
    ([2, 1], [1, 0])
    """

    def __init__(
        self,
        num_ranks: int,
        /,
        *,
        capacity_blocks: int | None,
        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    ) -> None:
        self.index = PrefixIndex(
            num_ranks, block_tokens=block_tokens, capacity_blocks=capacity_blocks
        )
        self._counts = np.zeros((3, self.index.num_ranks), dtype=np.int64)

    @property
    def num_ranks(self) -> int:
        """Number of ranks."""
        return self.index.num_ranks

    @property
    def capacity_blocks(self) -> int | None:
        """Blocks per rank (``None``: unbounded)."""
        return self.index.capacity_blocks

    def hit_blocks(self, block_ids: Any, /) -> np.ndarray:
        """Longest cached prefix of ``block_ids`` on every rank.

        Parameters
        ----------
        block_ids : array_like of int, shape (m,)
            A request's chained block ids.

        Returns
        -------
        ndarray of int64, shape (num_ranks,)
            Number of leading blocks cached on each rank (no LRU update).

        Runtime complexity: as :meth:`lbkit.prefill.PrefixIndex.hit_blocks`.
        """
        return self.index.hit_blocks(_block_list(block_ids))

    def touch(self, rank: int, block_ids: Any, upto: int, /) -> None:
        """Admission on ``rank``: make its ``upto`` hit blocks most recently used, tail first.

        Counts one lookup of ``len(block_ids)`` blocks with ``upto`` hits in
        :meth:`statistics`.

        Parameters
        ----------
        rank : int
            Rank in ``[0, num_ranks)``.
        block_ids : array_like of int, shape (m,)
            The request's chained block ids.
        upto : int
            Hit blocks to touch, ``0 <= upto <= m``; ``block_ids[:upto]`` must be cached on
            ``rank`` (usually ``hit_blocks(block_ids)[rank]``).

        Runtime complexity: O(m).
        """
        rank = check_int(rank, "rank", min_value=0, max_value=self.num_ranks - 1)
        ids = _block_list(block_ids)
        upto = check_int(upto, "upto", min_value=0, max_value=len(ids))
        hit = self.index.held_blocks(rank, ids)
        if upto > hit:
            raise ValueError(
                f"upto: block {hit} (id {ids[hit]}) is not cached on rank {rank}; upto must not "
                f"exceed the cached prefix ({hit} blocks)"
            )
        self.index.touch(rank, ids[:upto])
        self._count(rank, len(ids), upto)

    def _count(self, rank: int, blocks: int, hit: int) -> None:
        counts = self._counts
        counts[0, rank] += 1
        counts[1, rank] += blocks
        counts[2, rank] += hit

    def insert(self, rank: int, block_ids: Any, /) -> None:
        """Cache all of ``block_ids`` on ``rank`` (a prefill finished there), tail first.

        Cached blocks become most recently used, missing ones are inserted; past capacity the
        least recently used block of the rank is evicted after each insertion.

        Parameters
        ----------
        rank : int
            Rank in ``[0, num_ranks)``.
        block_ids : array_like of int, shape (m,)
            The request's chained block ids.

        Runtime complexity: O(m).
        """
        self.index.stored(rank, _block_list(block_ids))

    def cached(self, rank: int, /) -> list[int]:
        """Block ids cached on ``rank``, least recently used first.

        Runtime complexity: O(cached blocks).
        """
        return self.index.blocks(rank)

    def statistics(self) -> CacheStatistics:
        """Counters per rank (copies).

        Runtime complexity: O(num_ranks).
        """
        c = self._counts.copy()
        s = self.index.statistics()
        return CacheStatistics(c[0], c[1], c[2], s.inserted, s.evictions, s.cached_blocks)

    def _check(self) -> None:
        """Assert the internal invariants (for tests)."""
        self.index._check()
        assert (self._counts >= 0).all() and (self._counts[2] <= self._counts[1]).all()


def _check_trace_blocks(trace: Any, block_tokens: int) -> None:
    if not isinstance(trace, Trace):
        raise TypeError(f"trace: must be a Trace, got {type(trace).__name__}")
    if trace.hash_ids is None or trace.hash_offsets is None:
        raise ValueError(
            f"trace: {trace.source or 'this trace'} has no hash_ids; prefix caching needs "
            "Mooncake-style prefix-block ids"
        )
    counts = np.diff(trace.hash_offsets)
    need = -(-trace.total_tokens // block_tokens)
    if (counts != need).any():
        i = int(np.flatnonzero(counts != need)[0])
        raise ValueError(
            f"hash_ids: request {trace.request_id[i]} has {counts[i]} blocks but its "
            f"{trace.total_tokens[i]} tokens need ceil({trace.total_tokens[i]} / {block_tokens}) "
            f"= {need[i]}; is block_tokens right?"
        )


class LocalPrefixCaches:
    """Per-rank prefix caches driven by a trace's block ids (the ``rank_cache`` engine hook).

    Request ``i`` is the trace's row ``i``. The engine calls :meth:`hit_tokens` when it routes a
    request, :meth:`admitted` once the request is placed (its hit blocks are touched on that
    rank) and :meth:`finished` when its prefill completes (its blocks enter that rank's cache,
    with LRU eviction at capacity).

    Parameters
    ----------
    trace : Trace
        Must have ``hash_ids``, ``ceil(total_tokens / block_tokens)`` per request.
    num_ranks : int
        Ranks (flat index), ``>= 1``.
    capacity_blocks : int or None
        Blocks per rank; ``None`` is unbounded. See :func:`capacity_blocks_for`.
    block_tokens : int, default 512
        Tokens per block.

    Attributes
    ----------
    caches : RankCaches
        The caches (counters in ``caches.statistics()``).

    Examples
    --------
    >>> t = Trace(arrival_s=[0, 1, 2], total_tokens=[1024, 1500, 1024], output_tokens=[1, 1, 1],
    ...           hash_ids=[7, 8, 7, 8, 9, 7, 8], hash_offsets=[0, 2, 5, 7])
    >>> lc = LocalPrefixCaches(t, 2, capacity_blocks=None)
    >>> lc.admitted(0, 1); lc.finished(0, 1)
    >>> lc.hit_tokens(1).tolist()
    [0, 1024]
    >>> lc.admitted(1, 0); lc.admitted(2, 1)
    >>> lc.cached_tokens.tolist(), lc.ranks.tolist()
    ([0, 0, 1023], [1, 0, 1])
    """

    def __init__(
        self,
        trace: Trace,
        num_ranks: int,
        /,
        *,
        capacity_blocks: int | None,
        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    ) -> None:
        block_tokens = check_int(block_tokens, "block_tokens", min_value=1)
        _check_trace_blocks(trace, block_tokens)
        self.caches = RankCaches(
            num_ranks, capacity_blocks=capacity_blocks, block_tokens=block_tokens
        )
        self._index = self.caches.index
        self._block_tokens = block_tokens
        self._n = len(trace)
        self._flat: list[int] = trace.hash_ids.tolist()
        self._bounds: list[int] = trace.hash_offsets.tolist()
        self._total: list[int] = trace.total_tokens.tolist()
        self._cached = np.zeros(self._n, dtype=np.int64)
        self._ranks = np.full(self._n, -1, dtype=np.int64)

    def _ids(self, request: Any) -> list[int]:
        if not isinstance(request, (int, np.integer)) or not 0 <= request < self._n:
            raise ValueError(f"request: must be an int in [0, {self._n}), got {request!r}")
        return self._flat[self._bounds[request] : self._bounds[request + 1]]

    def hit_tokens(self, request: int, /) -> np.ndarray:
        """Cached prompt tokens of ``request`` on every rank now.

        Returns
        -------
        ndarray of int64, shape (num_ranks,)
            ``min(hit_blocks * block_tokens, total_tokens - 1)``.

        Runtime complexity: as :meth:`lbkit.prefill.PrefixIndex.hit_tokens`.
        """
        return self._index.hit_tokens(self._ids(request), self._total[request])

    def admitted(self, request: int, rank: int, /) -> None:
        """``request`` was routed to ``rank``: record its hit and touch its hit blocks there.

        Runtime complexity: O(blocks of the request).
        """
        ids = self._ids(request)
        hit = self._index.touch(rank, ids)
        self.caches._count(rank, len(ids), hit)
        self._cached[request] = min(hit * self._block_tokens, self._total[request] - 1)
        self._ranks[request] = rank

    def finished(self, request: int, rank: int, /) -> None:
        """The prefill of ``request`` completed on ``rank``: cache its blocks there.

        Runtime complexity: O(blocks of the request).
        """
        self._index.stored(rank, self._ids(request))

    @property
    def cached_tokens(self) -> np.ndarray:
        """ndarray of int64, shape (n,): each request's cached tokens at its last admission."""
        return self._cached.copy()

    @property
    def ranks(self) -> np.ndarray:
        """ndarray of int64, shape (n,): the rank of each request's last admission (-1: none)."""
        return self._ranks.copy()
