"""Per-rank LRU prefix caches against a plain-Python model (one OrderedDict per rank)."""

from __future__ import annotations

import tracemalloc
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.sim.prefix_cache import (
    BYTES_PER_CACHED_BLOCK,
    DEFAULT_PREFILL_KV_BYTES,
    LocalPrefixCaches,
    RankCaches,
    capacity_blocks_for,
    prefix_hit_blocks,
)
from lbkit.sim.traces import Trace

BLOCK = 512


class ModelCaches:
    """Brute force: per rank an OrderedDict LRU (least recent first); hits walk the prefix."""

    def __init__(self, num_ranks: int, capacity: int | None) -> None:
        self.lru = [OrderedDict() for _ in range(num_ranks)]
        self.capacity = capacity
        self.evictions = 0

    def hits(self, blocks: list[int]) -> list[int]:
        out = []
        for lru in self.lru:
            hit = 0
            while hit < len(blocks) and blocks[hit] in lru:
                hit += 1
            out.append(hit)
        return out

    def admit(self, rank: int, blocks: list[int]) -> int:
        hit = self.hits(blocks)[rank]
        for b in reversed(blocks[:hit]):
            self.lru[rank].move_to_end(b)
        return hit

    def finish(self, rank: int, blocks: list[int]) -> None:
        lru = self.lru[rank]
        for b in reversed(blocks):
            lru[b] = None
            lru.move_to_end(b)
            if self.capacity is not None and len(lru) > self.capacity:
                lru.popitem(last=False)
                self.evictions += 1


@st.composite
def chained_requests(draw, max_requests: int = 20) -> list[list[int]]:
    """Requests whose ids are chained: each extends a prefix of an earlier one with fresh ids."""
    requests: list[list[int]] = []
    fresh = 0
    for _ in range(draw(st.integers(1, max_requests))):
        base: list[int] = []
        if requests and draw(st.booleans()):
            parent = requests[draw(st.integers(0, len(requests) - 1))]
            base = parent[: draw(st.integers(0, len(parent)))]
        extra = draw(st.integers(0 if base else 1, 5))
        requests.append(base + list(range(fresh, fresh + extra)))
        fresh += extra
    return requests


def _trace(requests: list[list[int]], tokens: list[int]) -> Trace:
    offsets = np.cumsum([0] + [len(b) for b in requests])
    return Trace(
        arrival_s=np.arange(len(requests), dtype=float),
        total_tokens=tokens,
        output_tokens=np.ones(len(requests), dtype=np.int64),
        hash_ids=[b for blocks in requests for b in blocks],
        hash_offsets=offsets,
    )


@st.composite
def schedules(draw):
    """A chained trace, a rank count, a capacity and an interleaving of admissions and finishes."""
    requests = draw(chained_requests())
    tokens = [(len(b) - 1) * BLOCK + draw(st.sampled_from([1, BLOCK - 1, BLOCK])) for b in requests]
    num_ranks = draw(st.integers(1, 4))
    capacity = draw(st.one_of(st.none(), st.integers(0, 12)))
    events: list[tuple[str, int, int]] = []
    pending: list[tuple[int, int]] = []
    nxt = 0
    while nxt < len(requests) or pending:
        if nxt < len(requests) and (not pending or draw(st.booleans())):
            rank = draw(st.integers(0, num_ranks - 1))
            events.append(("admit", nxt, rank))
            pending.append((nxt, rank))
            nxt += 1
        else:
            i, rank = pending.pop(draw(st.integers(0, len(pending) - 1)))
            events.append(("finish", i, rank))
    return requests, tokens, num_ranks, capacity, events


def _run(requests, tokens, num_ranks, capacity, events):
    lc = LocalPrefixCaches(_trace(requests, tokens), num_ranks, capacity_blocks=capacity)
    seen = []
    for kind, i, rank in events:
        if kind == "admit":
            seen.append(lc.hit_tokens(i))
            lc.admitted(i, rank)
        else:
            lc.finished(i, rank)
        lc.caches._check()
    return lc, seen


@given(schedules())
def test_local_caches_match_the_model_request_by_request(schedule):
    requests, tokens, num_ranks, capacity, events = schedule
    lc = LocalPrefixCaches(_trace(requests, tokens), num_ranks, capacity_blocks=capacity)
    model = ModelCaches(num_ranks, capacity)
    for kind, i, rank in events:
        if kind == "admit":
            want = [min(h * BLOCK, tokens[i] - 1) for h in model.hits(requests[i])]
            assert lc.hit_tokens(i).tolist() == want
            assert lc.caches.hit_blocks(requests[i]).tolist() == model.hits(requests[i])
            hit = model.admit(rank, requests[i])
            lc.admitted(i, rank)
            assert lc.cached_tokens[i] == min(hit * BLOCK, tokens[i] - 1) == want[rank]
            assert lc.ranks[i] == rank
        else:
            model.finish(rank, requests[i])
            lc.finished(i, rank)
        lc.caches._check()
        for r in range(num_ranks):
            assert lc.caches.cached(r) == list(model.lru[r])
    assert lc.caches.statistics().evictions.sum() == model.evictions


@given(schedules())
def test_caches_stay_prefix_closed(schedule):
    requests, tokens, num_ranks, capacity, events = schedule
    parent = {}
    for blocks in requests:
        for j, b in enumerate(blocks):
            parent[b] = blocks[j - 1] if j else None
    lc, _ = _run(requests, tokens, num_ranks, capacity, events)
    for r in range(num_ranks):
        cached = set(lc.caches.cached(r))
        assert all(parent[b] is None or parent[b] in cached for b in cached)


@given(schedules(), st.integers(1, 3))
def test_a_larger_cache_never_hits_less_on_any_rank(schedule, extra):
    requests, tokens, num_ranks, capacity, events = schedule
    capacity = 0 if capacity is None else capacity
    _, small = _run(requests, tokens, num_ranks, capacity, events)
    _, large = _run(requests, tokens, num_ranks, capacity + extra, events)
    _, unbounded = _run(requests, tokens, num_ranks, None, events)
    for s, lg, u in zip(small, large, unbounded, strict=True):
        assert (s <= lg).all() and (lg <= u).all()


@given(schedules())
def test_a_cache_holding_every_block_never_evicts(schedule):
    requests, tokens, num_ranks, _, events = schedule
    everything = len({b for blocks in requests for b in blocks})
    lc, hits = _run(requests, tokens, num_ranks, everything, events)
    _, ref_hits = _run(requests, tokens, num_ranks, None, events)
    assert lc.caches.statistics().evictions.sum() == 0
    for a, b in zip(hits, ref_hits, strict=True):
        np.testing.assert_array_equal(a, b)


@given(chained_requests(), st.one_of(st.none(), st.integers(0, 30)), st.booleans())
def test_one_rank_inserting_at_lookup_is_the_global_cache(requests, capacity, touch_first):
    # The global model inserts a request's blocks at its arrival: lookup, then insert.
    c = RankCaches(1, capacity_blocks=capacity)
    got = []
    for blocks in requests:
        hit = int(c.hit_blocks(blocks)[0])
        got.append(hit)
        if touch_first:
            c.touch(0, blocks, hit)
        c.insert(0, blocks)
    offsets = np.cumsum([0] + [len(b) for b in requests])
    flat = [b for blocks in requests for b in blocks]
    assert got == prefix_hit_blocks(flat, offsets, capacity_blocks=capacity).tolist()


def test_statistics_count_lookups_hits_insertions_and_evictions():
    c = RankCaches(2, capacity_blocks=2)
    c.insert(1, [1, 2, 3])  # 3 inserted, 1 evicted (block 3, the tail)
    assert c.cached(1) == [2, 1]
    c.touch(1, [1, 2, 4], 2)
    s = c.statistics()
    assert s.lookups.tolist() == [0, 1] and s.lookup_blocks.tolist() == [0, 3]
    assert s.hit_blocks.tolist() == [0, 2] and s.insertions.tolist() == [0, 3]
    assert s.evictions.tolist() == [0, 1] and s.cached_blocks.tolist() == [0, 2]


def test_bad_input_is_rejected_with_the_argument_named():
    c = RankCaches(2, capacity_blocks=4)
    with pytest.raises(ValueError, match="num_ranks"):
        RankCaches(0, capacity_blocks=1)
    with pytest.raises(ValueError, match="capacity_blocks"):
        RankCaches(1, capacity_blocks=-1)
    with pytest.raises(ValueError, match="rank"):
        c.insert(2, [1])
    with pytest.raises(ValueError, match="upto"):
        c.touch(0, [1, 2], 1)  # block 1 is not cached on rank 0
    with pytest.raises(ValueError, match="upto"):
        c.touch(0, [1, 2], 3)
    with pytest.raises(TypeError, match="block_ids"):
        c.hit_blocks([[1, 2]])
    with pytest.raises(TypeError, match="block_ids"):
        c.hit_blocks([1.5])
    t = _trace([[0, 1]], [1000])
    with pytest.raises(ValueError, match="request"):
        LocalPrefixCaches(t, 2, capacity_blocks=None).hit_tokens(1)
    with pytest.raises(ValueError, match="hash_ids"):
        LocalPrefixCaches(_trace([[0, 1]], [2000]), 2, capacity_blocks=None)
    no_ids = Trace(arrival_s=[0.0], total_tokens=[10], output_tokens=[1])
    with pytest.raises(ValueError, match="no hash_ids"):
        LocalPrefixCaches(no_ids, 2, capacity_blocks=None)
    with pytest.raises(ValueError, match="kv_bytes"):
        capacity_blocks_for(-1)


def test_default_capacity_follows_the_stated_arithmetic():
    assert capacity_blocks_for() == DEFAULT_PREFILL_KV_BYTES // (61 * 576 * 2 * 512)


def test_memory_per_cached_block_is_within_the_stated_figure():
    # 64 ranks, each block on one rank (the costliest case): per (block, rank) an OrderedDict
    # entry, a holders-dict entry and the id's int object.
    c = RankCaches(64, capacity_blocks=None)
    per = 1000
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for r in range(64):
        c.insert(r, list(range(10**6 + r * per, 10**6 + (r + 1) * per)))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 30 < used / (64 * per) <= BYTES_PER_CACHED_BLOCK
