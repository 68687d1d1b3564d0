"""Router-side prefix index: how much of a prompt each rank holds in its KV cache.

A cache-aware router needs, per request, the cached prefix tokens on every rank (the
``cached_tokens`` array of :meth:`lbkit.prefill.PrefillBalancer.route`). :class:`PrefixIndex`
derives it from *chained* block hashes: the hash of block ``j`` stands for that block and every
block before it (Mooncake's ``hash_ids``, vLLM's and Dynamo's KV-cache events), so a rank's
cached prefix of a prompt is the longest leading run of the prompt's hashes that it holds.

Rules (those of the simulator's per-rank caches, ``lbkit.sim.prefix_cache``):

1. **Lookup** (:meth:`~PrefixIndex.hit_tokens`): per rank, the longest run ``L`` of leading
   hashes held; ``cached_tokens = min(L * block_tokens, total_tokens - 1)``: the forward pass over
   the last prompt token yields the first output token, so one prompt token is always computed.
2. **Insertion** (:meth:`~PrefixIndex.stored`, :meth:`~PrefixIndex.admitted`): tail first, a
   held hash becomes most recently used and a missing one is inserted; past ``capacity_blocks``
   the rank's least recently used hash is evicted after each insertion. The head of a prefix ends
   more recent than its tail, so eviction trims prefixes from their end (as vLLM and SGLang
   evict) and an index fed by admissions stays prefix-closed (each held hash's parent is held).
3. **Removal** (:meth:`~PrefixIndex.removed`, :meth:`~PrefixIndex.cleared`) drops the named
   hashes (or all of a rank's). Hashes behind a removed one stay held but unreachable until their
   own removal arrives; lookups count leading runs only, so they never make a hit.

**From KV-cache events.** vLLM publishes per data-parallel rank ``BlockStored(block_hashes,
parent_block_hash, token_ids, block_size, ..., medium)`` when full blocks enter its prefix cache,
``BlockRemoved(block_hashes, medium)`` when a cached block is evicted for reuse and
``AllBlocksCleared()`` on a prefix-cache reset (``vllm/distributed/kv_events.py``,
vllm-project/vllm commit 0181ea3; emitted in ``vllm/v1/core/block_pool.py``, commit c59cb79, by
``cache_full_blocks``, ``_maybe_evict_cached_block`` and ``reset_prefix_cache``; hashes are the
low 64 bits of the digest under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default). Feed the
GPU-medium ones to :meth:`stored`, :meth:`removed` and :meth:`cleared` of the flat rank
``engine * ranks_per_engine + dp_rank``. Dynamo's KV router applies them to a radix tree
(``lib/kv-router/src/radix_tree.rs``, ai-dynamo/dynamo commit 4276866) that rejects a store whose
parent is unknown and clears all DP ranks of a worker at once; with chained hashes no tree is
needed: a store counts once its parent arrives, :meth:`cleared` empties one rank, and removals of
hashes a rank lacks are counted (``unknown_removed``: lost or reordered events). A rank holds a
hash or not (as Dynamo's worker sets): vLLM does not de-duplicate blocks, so a hash computed
twice at once on a rank and evicted once is dropped while a copy remains; the index then
under-states that rank until the hash is stored again, never the other way.

**From the router's own admissions** (no events): :meth:`admitted` records that the chosen rank
will hold the request's blocks (rule 2), ``capacity_blocks`` being the rank's KV capacity in
blocks: each rank is modelled as an LRU cache.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from lbkit.core.validation import check_int

__all__ = ["BYTES_PER_CACHED_BLOCK", "DEFAULT_BLOCK_TOKENS", "PrefixIndex", "PrefixIndexStatistics"]

#: Tokens per hashed block by default: the 512-token blocks of Mooncake's ``hash_ids``. Set
#: ``block_tokens`` to the engine's KV block size when feeding the index from its events.
DEFAULT_BLOCK_TOKENS = 512

#: Upper bound on the Python memory per held (hash, rank) pair, bytes: an ``OrderedDict`` entry
#: plus a share of the hash-to-ranks dictionary, of the bitmask and of the hash's int object.
#: Measured with tracemalloc at 64 ranks (``benchmarks/bench_prefix_index.py``): 186 bytes when
#: each hash is held by one rank, 154 by two, 126 by eight. The KV data itself is not held.
BYTES_PER_CACHED_BLOCK = 200

_STATE_VERSION = 1
_INT_ONLY = {int}
#: Per-rank counters, in the order of the rows of ``PrefixIndex._c``.
_RANK_COUNTERS = tuple(
    "inserted removed unknown_removed cleared_blocks evictions admissions admitted_blocks "
    "admitted_hit_blocks".split()
)
_INS, _REM, _UNK, _CLB, _EVI, _ADM, _ADB, _ADH = range(len(_RANK_COUNTERS))
_LOOKUP_COUNTERS = ("lookups", "lookup_blocks", "lookup_hit_blocks")


@dataclasses.dataclass(frozen=True)
class PrefixIndexStatistics:
    """Counters of a :class:`PrefixIndex`; arrays have shape ``(num_ranks,)`` (int64).

    Attributes
    ----------
    cached_blocks : ndarray
        Hashes held by each rank now (``inserted - removed - cleared_blocks - evictions``).
    distinct_blocks : int
        Hashes held by at least one rank.
    inserted : ndarray
        Hashes inserted by :meth:`PrefixIndex.stored` and :meth:`PrefixIndex.admitted`.
    removed : ndarray
        Hashes dropped by :meth:`PrefixIndex.removed`.
    unknown_removed : ndarray
        Hashes named by :meth:`PrefixIndex.removed` that the rank did not hold.
    cleared_blocks : ndarray
        Hashes dropped by :meth:`PrefixIndex.cleared`.
    evictions : ndarray
        Hashes evicted at capacity.
    admissions, admitted_blocks, admitted_hit_blocks : ndarray
        :meth:`PrefixIndex.admitted` and :meth:`PrefixIndex.touch` calls, the blocks of those
        requests, and the leading blocks the rank already held (the hits routing obtained).
    lookups, lookup_blocks, lookup_hit_blocks : int
        :meth:`PrefixIndex.hit_tokens` / :meth:`PrefixIndex.hit_blocks` calls, their blocks, and
        the longest held prefix over the ranks, summed over calls.
    """

    cached_blocks: np.ndarray
    distinct_blocks: int
    inserted: np.ndarray
    removed: np.ndarray
    unknown_removed: np.ndarray
    cleared_blocks: np.ndarray
    evictions: np.ndarray
    admissions: np.ndarray
    admitted_blocks: np.ndarray
    admitted_hit_blocks: np.ndarray
    lookups: int
    lookup_blocks: int
    lookup_hit_blocks: int


def _as_hashes(value: Any, name: str = "block_hashes") -> list[int]:
    """``value`` as a list of int hashes (the caller's list itself when it holds only ints)."""
    if type(value) is list and (not value or set(map(type, value)) == _INT_ONLY):
        return value
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{name}: must be 1-dimensional, got shape {value.shape}")
        if value.size and value.dtype.kind not in "iu":
            raise TypeError(f"{name}: must hold integer hashes, got dtype {value.dtype}")
        return value.tolist()
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name}: must be a sequence of integer block hashes, got {type(value).__name__}"
        )
    out = []
    for j, h in enumerate(value):
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)):
            hint = " (convert digests with int.from_bytes)" if isinstance(h, bytes) else ""
            raise TypeError(
                f"{name}: must hold integers, found {type(h).__name__} {h!r} at index {j}{hint}"
            )
        out.append(int(h))
    return out


class PrefixIndex:
    """Which leading blocks of a prompt each rank holds, from KV events or admissions.

    Parameters
    ----------
    num_ranks : int
        Ranks indexed (flat: ``engine * ranks_per_engine + rank``), ``>= 1``.
    block_tokens : int, default 512
        Tokens per hashed block (the engine's KV block size when fed from its events).
    capacity_blocks : int or None, default None
        Hashes each rank can hold (``0`` holds nothing); past it the rank's least recently used
        hash is evicted. ``None`` is unbounded (an index fed by complete events needs no bound;
        the engine's block count guards against lost removals).

    Notes
    -----
    Rules: :mod:`lbkit.prefill.prefix_index`. Hashes are compared as Python integers (any size):
    compute a request's chained hashes the way its engines do. Layout: per rank an
    ``OrderedDict`` of held hashes in LRU order, and one dictionary from each held hash to the
    bitmask of its ranks, so that a lookup walks the prompt once for all ranks. Memory: at most
    :data:`BYTES_PER_CACHED_BLOCK` (200) bytes per held (hash, rank) pair. Timing
    (``benchmarks/bench_prefix_index.py``): :meth:`hit_tokens` of a 30-block prompt at 64 ranks,
    held to a different depth on every rank, about 15 microseconds (7 if one rank holds it all).

    Examples
    --------
    >>> idx = PrefixIndex(4, block_tokens=512)
    >>> idx.stored(0, [11, 12, 13])        # engine events: rank 0 caches three blocks,
    >>> idx.stored(2, [11, 12])            # rank 2 two of them,
    >>> idx.removed(0, [12])               # rank 0 evicts the middle one
    >>> idx.hit_tokens([11, 12, 13, 14], 2000).tolist()
    [512, 0, 1024, 0]
    >>> idx.hit_tokens([11, 12], 1024).tolist()   # a full hit still computes one token
    [512, 0, 1023, 0]
    >>> idx.admitted(1, [11, 12, 13, 14])  # routed to rank 1 (no events): it will hold them
    0
    >>> idx.hit_blocks([11, 12, 13, 14]).tolist(), idx.statistics().cached_blocks.tolist()
    ([1, 4, 2, 0], [2, 4, 2, 0])
    """

    def __init__(
        self,
        num_ranks: int,
        /,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        capacity_blocks: int | None = None,
    ) -> None:
        self._n = check_int(num_ranks, "num_ranks", min_value=1)
        self._bt = check_int(block_tokens, "block_tokens", min_value=1)
        if capacity_blocks is not None:
            capacity_blocks = check_int(capacity_blocks, "capacity_blocks", min_value=0)
        self._cap = capacity_blocks
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self._n)]
        self._holders: dict[int, int] = {}  # hash -> bitmask of the ranks holding it
        self._all = (1 << self._n) - 1
        self._nbytes = (self._n + 7) // 8
        self._c = [[0] * self._n for _ in _RANK_COUNTERS]
        self._look = [0, 0, 0]  # lookups, lookup_blocks, lookup_hit_blocks

    @property
    def num_ranks(self) -> int:
        """Ranks indexed."""
        return self._n

    @property
    def block_tokens(self) -> int:
        """Tokens per hashed block."""
        return self._bt

    @property
    def capacity_blocks(self) -> int | None:
        """Hashes each rank can hold (``None``: unbounded)."""
        return self._cap

    def _rank(self, rank: Any) -> int:
        if type(rank) is int and 0 <= rank < self._n:
            return rank
        return check_int(rank, "rank", min_value=0, max_value=self._n - 1)

    # ------------------------------------------------------------------ lookups
    def hit_blocks(self, block_hashes: Any, /) -> np.ndarray:
        """Leading blocks of a prompt held on every rank (no LRU update).

        Parameters
        ----------
        block_hashes : sequence of int, shape (m,)
            The prompt's chained block hashes, head first.

        Returns
        -------
        ndarray of int64, shape (num_ranks,)
            Per rank, the longest run of leading hashes all held there, in blocks.

        Runtime complexity: O(m) dictionary look-ups and big-int ANDs of ``num_ranks`` bits,
        plus O(k * num_ranks) numpy work for the ``k <= m`` distinct sets of ranks met.
        """
        return self._hits(_as_hashes(block_hashes), 1, None)

    def hit_tokens(self, block_hashes: Any, total_tokens: int, /) -> np.ndarray:
        """Cached prefix tokens of a prompt on every rank (no LRU update).

        Parameters
        ----------
        block_hashes : sequence of int, shape (m,)
            The prompt's chained block hashes, head first; at most
            ``ceil(total_tokens / block_tokens)`` (a partial last block may be hashed or not).
        total_tokens : int
            Prompt length in tokens, ``>= 1``.

        Returns
        -------
        ndarray of int64, shape (num_ranks,)
            ``min(hit_blocks * block_tokens, total_tokens - 1)``: what
            :meth:`lbkit.prefill.PrefillBalancer.route` takes as ``cached_tokens``.

        Raises
        ------
        ValueError
            ``total_tokens < 1``, or more hashes than blocks in the prompt (a wrong
            ``block_tokens``).

        Runtime complexity: as :meth:`hit_blocks`.
        """
        hashes = _as_hashes(block_hashes)
        if type(total_tokens) is not int or total_tokens < 1:
            total_tokens = check_int(total_tokens, "total_tokens", min_value=1)
        most = -(-total_tokens // self._bt)
        if len(hashes) > most:
            raise ValueError(
                f"block_hashes: {len(hashes)} blocks of {self._bt} tokens exceed a {total_tokens}-"
                f"token prompt (at most {most}); is block_tokens right?"
            )
        return self._hits(hashes, self._bt, total_tokens - 1)

    def _hits(self, hashes: list[int], scale: int, limit: int | None) -> np.ndarray:
        # One walk with the set of ranks still matching; runs: (that set, its blocks in a row),
        # scaled. Only the ranks of the last run reach depth * scale, and the excess over limit
        # is at most one block (hit_tokens checks the block count), so clipping shortens that run.
        get = self._holders.get
        live = self._all
        masks: list[int] = []
        runs: list[int] = []
        depth = start = 0
        for h in hashes:
            m = live & get(h, 0)
            if m != live:
                if depth > start:
                    masks.append(live)
                    runs.append((depth - start) * scale)
                start, live = depth, m
                if not m:
                    break
            depth += 1
        if live and depth > start:
            masks.append(live)
            runs.append((depth - start) * scale)
        look = self._look
        look[0] += 1
        look[1] += len(hashes)
        look[2] += depth
        if not masks:
            return np.zeros(self._n, dtype=np.int64)
        if limit is not None and depth * scale > limit:
            runs[-1] -= depth * scale - limit
        nb = self._nbytes
        if len(masks) == 1:  # one set of ranks holds the whole matched prefix (the common case)
            raw = np.frombuffer(masks[0].to_bytes(nb, "little"), dtype=np.uint8)
            out = np.unpackbits(raw, count=self._n, bitorder="little").astype(np.int64)
            out *= runs[0]
            return out
        raw = np.frombuffer(b"".join([m.to_bytes(nb, "little") for m in masks]), dtype=np.uint8)
        bits = np.unpackbits(raw.reshape(len(masks), nb), axis=1, count=self._n, bitorder="little")
        return np.asarray(runs, dtype=np.int64) @ bits

    def held_blocks(self, rank: int, block_hashes: Any, /) -> int:
        """Leading blocks of ``block_hashes`` held on ``rank`` (no LRU update; O(m))."""
        return self._held_run(self._rank(rank), _as_hashes(block_hashes))

    def _held_run(self, rank: int, hashes: list[int]) -> int:
        lru = self._lru[rank]
        return next((j for j, h in enumerate(hashes) if h not in lru), len(hashes))

    # ------------------------------------------------------------------ updates
    def stored(self, rank: int, block_hashes: Any, /) -> None:
        """``rank`` now caches ``block_hashes`` (an engine's ``BlockStored`` event).

        Tail first, a held hash becomes most recently used and a missing one is inserted; past
        ``capacity_blocks`` the rank's least recently used hash is evicted after each insertion.
        The parent of the first hash need not be held (it counts once it is).

        Parameters
        ----------
        rank : int
            Flat rank in ``[0, num_ranks)``.
        block_hashes : sequence of int, shape (m,)
            Chained hashes of consecutive blocks, head first (the event's ``block_hashes``).

        Runtime complexity: O(m).
        """
        self._insert(self._rank(rank), _as_hashes(block_hashes))

    def _insert(self, rank: int, hashes: list[int]) -> None:
        lru = self._lru[rank]
        holders = self._holders
        bit = 1 << rank
        cap = self._cap
        inserted = evicted = 0
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            holders[h] = holders.get(h, 0) | bit
            inserted += 1
            if cap is not None and len(lru) > cap:
                old, _ = lru.popitem(last=False)
                self._drop(old, bit)
                evicted += 1
        c = self._c
        c[_INS][rank] += inserted
        c[_EVI][rank] += evicted

    def _drop(self, h: int, bit: int) -> None:
        rest = self._holders[h] & ~bit
        if rest:
            self._holders[h] = rest
        else:
            del self._holders[h]

    def removed(self, rank: int, block_hashes: Any, /) -> None:
        """``rank`` no longer caches ``block_hashes`` (an engine's ``BlockRemoved`` event).

        Hashes the rank does not hold are skipped and counted in ``unknown_removed``.

        Runtime complexity: O(m).
        """
        rank = self._rank(rank)
        lru = self._lru[rank]
        bit = 1 << rank
        gone = unknown = 0
        for h in _as_hashes(block_hashes):
            if h in lru:
                del lru[h]
                self._drop(h, bit)
                gone += 1
            else:
                unknown += 1
        self._c[_REM][rank] += gone
        self._c[_UNK][rank] += unknown

    def cleared(self, rank: int, /) -> None:
        """``rank`` dropped its whole prefix cache (an engine's ``AllBlocksCleared`` event).

        Runtime complexity: O(hashes held by the rank).
        """
        rank = self._rank(rank)
        lru = self._lru[rank]
        bit = 1 << rank
        for h in lru:
            self._drop(h, bit)
        self._c[_CLB][rank] += len(lru)
        lru.clear()

    def touch(self, rank: int, block_hashes: Any, /) -> int:
        """A request using its cached prefix was admitted on ``rank``: refresh that prefix.

        The leading run of ``block_hashes`` held on ``rank`` becomes most recently used, tail
        first, and an admission is counted; nothing is inserted (events or :meth:`stored` do).

        Returns
        -------
        int
            Leading blocks held on ``rank`` (the hashes touched).

        Runtime complexity: O(m).
        """
        rank = self._rank(rank)
        hashes = _as_hashes(block_hashes)
        hit = self._held_run(rank, hashes)
        move = self._lru[rank].move_to_end
        for j in range(hit - 1, -1, -1):
            move(hashes[j])
        self._count_admission(rank, len(hashes), hit)
        return hit

    def admitted(self, rank: int, block_hashes: Any, /) -> int:
        """The router sent a request to ``rank``, which will hold all its blocks (no events).

        Counts an admission, then inserts as :meth:`stored` (tail first: held hashes refreshed,
        missing ones inserted, LRU eviction at capacity), which keeps the index prefix-closed.

        Parameters
        ----------
        rank : int
            Flat rank in ``[0, num_ranks)``.
        block_hashes : sequence of int, shape (m,)
            The request's chained block hashes, head first.

        Returns
        -------
        int
            Leading blocks the rank held before (the request's hit there).

        Runtime complexity: O(m).
        """
        rank = self._rank(rank)
        hashes = _as_hashes(block_hashes)
        hit = self._held_run(rank, hashes)
        self._count_admission(rank, len(hashes), hit)
        self._insert(rank, hashes)
        return hit

    def _count_admission(self, rank: int, blocks: int, hit: int) -> None:
        self._c[_ADM][rank] += 1
        self._c[_ADB][rank] += blocks
        self._c[_ADH][rank] += hit

    # ------------------------------------------------------------------ introspection
    def blocks(self, rank: int, /) -> list[int]:
        """Hashes held by ``rank``, least recently used first.

        Runtime complexity: O(hashes held by the rank).
        """
        return list(self._lru[self._rank(rank)])

    def statistics(self) -> PrefixIndexStatistics:
        """Counters (copies; see :class:`PrefixIndexStatistics`).

        Runtime complexity: O(num_ranks).
        """
        rows = dict(zip(_RANK_COUNTERS, np.array(self._c, dtype=np.int64), strict=True))
        return PrefixIndexStatistics(
            cached_blocks=np.array([len(lru) for lru in self._lru], dtype=np.int64),
            distinct_blocks=len(self._holders),
            **dict(zip(_LOOKUP_COUNTERS, self._look, strict=True)),
            **rows,
        )

    def _counter_problem(self) -> str | None:
        # What from_state_dict rejects and _check asserts: counters that disagree with the state.
        c = self._c
        for r, lru in enumerate(self._lru):
            held = c[_INS][r] - c[_REM][r] - c[_CLB][r] - c[_EVI][r]
            if len(lru) != held:
                return f"rank {r} holds {len(lru)} hashes, its counters {held}"
            if c[_ADH][r] > c[_ADB][r]:
                return f"rank {r} has more admitted_hit_blocks than admitted_blocks"
        if self._look[2] > self._look[1]:
            return "lookup_hit_blocks exceeds lookup_blocks"
        return None

    def _check(self) -> None:
        """Assert every internal invariant (for tests; O(held pairs))."""
        total = 0
        for r, lru in enumerate(self._lru):
            assert self._cap is None or len(lru) <= self._cap, f"rank {r} is over capacity"
            for h in lru:
                assert self._holders[h] >> r & 1, f"rank {r} holds {h} but its bit is clear"
            assert min(row[r] for row in self._c) >= 0, f"rank {r}: negative counter"
            total += len(lru)
        assert all(0 < m <= self._all for m in self._holders.values()), "bad rank mask"
        assert total == sum(m.bit_count() for m in self._holders.values()), "masks disagree"
        assert min(self._look) >= 0, "negative lookup counter"
        problem = self._counter_problem()
        assert problem is None, problem

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Configuration, held hashes (LRU order) and counters as JSON-serialisable types.

        :meth:`from_state_dict` of the result continues exactly where this index stands.

        Runtime complexity: O(held pairs).
        """
        counts: dict[str, Any] = {k: list(v) for k, v in zip(_RANK_COUNTERS, self._c, strict=True)}
        counts.update(zip(_LOOKUP_COUNTERS, self._look, strict=True))
        return {
            "version": _STATE_VERSION,
            "config": {
                "num_ranks": self._n,
                "block_tokens": self._bt,
                "capacity_blocks": self._cap,
            },
            "state": {"blocks": [list(lru) for lru in self._lru], "counts": counts},
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], /) -> PrefixIndex:
        """Rebuild an index from :meth:`state_dict` output (e.g. after ``json.loads``).

        Raises
        ------
        ValueError
            Wrong version, a missing or malformed field (named in the message), a rank over
            capacity or holding a hash twice, or counters that disagree with the held hashes.

        Runtime complexity: O(held pairs).
        """
        state = _field(state, Mapping, "state")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"state.version: must be {_STATE_VERSION}, got {state.get('version')!r}"
            )
        cfg = _field(state.get("config"), Mapping, "state.config")
        try:
            idx = cls(cfg["num_ranks"], **{k: cfg[k] for k in ("block_tokens", "capacity_blocks")})
        except KeyError as exc:
            raise ValueError(f"state.config: missing field {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state.config.{exc}") from None
        body = _field(state.get("state"), Mapping, "state.state")
        n, cap = idx._n, idx._cap
        for r, held in enumerate(_field(body.get("blocks"), list, "state.state.blocks", n)):
            name = f"state.state.blocks[{r}]"
            try:
                hashes = _as_hashes(held, name)
            except TypeError as exc:
                raise ValueError(str(exc)) from None
            if len(set(hashes)) != len(hashes):
                raise ValueError(f"{name}: holds a hash twice")
            if cap is not None and len(hashes) > cap:
                raise ValueError(f"{name}: {len(hashes)} hashes exceed capacity_blocks {cap}")
            for h in hashes:
                idx._lru[r][h] = None
                idx._holders[h] = idx._holders.get(h, 0) | 1 << r
        counts = _field(body.get("counts"), Mapping, "state.state.counts")
        for k, row in enumerate(_RANK_COUNTERS):
            name = f"state.state.counts.{row}"
            idx._c[k] = [_count(v, name) for v in _field(counts.get(row), list, name, n)]
        idx._look = [_count(counts.get(k), f"state.state.counts.{k}") for k in _LOOKUP_COUNTERS]
        problem = idx._counter_problem()
        if problem is not None:
            raise ValueError(f"state.state.counts: {problem}")
        return idx


def _field(value: Any, kind: type, name: str, size: int | None = None) -> Any:
    if not isinstance(value, kind):
        want = "a mapping" if kind is Mapping else f"a {kind.__name__}"
        raise ValueError(f"{name}: must be {want}, got {type(value).__name__}")
    if size is not None and len(value) != size:
        raise ValueError(f"{name}: must have one entry per rank ({size}), got {len(value)}")
    return value


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: must hold non-negative integers, got {value!r}")
    return int(value)
