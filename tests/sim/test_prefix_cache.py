"""Prefix caching from hash ids, against two plain-Python models of the same LRU cache."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.sim.prefix_cache import apply_prefix_cache, prefix_hit_blocks
from lbkit.sim.traces import Trace, load_mooncake

DATA = Path(__file__).resolve().parent / "data"
MOONCAKE_SMALL = DATA / "mooncake_small.jsonl"
MOONCAKE_FULL = (
    Path(__file__).resolve().parents[2]
    / ".."
    / "shared"
    / "traces"
    / "mooncake_conversation"
    / "conversation_trace.jsonl"
)


def lru_model(requests: list[list[int]], capacity: int | None) -> list[int]:
    """OrderedDict LRU: look up the longest cached prefix, then touch blocks tail first."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = []
    for blocks in requests:
        hit = 0
        while hit < len(blocks) and blocks[hit] in cache:
            hit += 1
        hits.append(hit)
        for b in reversed(blocks):
            cache[b] = None
            cache.move_to_end(b)
            if capacity is not None and len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def history_model(requests: list[list[int]], capacity: int | None) -> list[int]:
    """By definition: an LRU cache of capacity C holds the C most recently touched blocks."""
    history: list[int] = []  # every touch, oldest first
    hits = []
    for blocks in requests:
        recent: list[int] = []
        for b in reversed(history):
            if capacity is not None and len(recent) == capacity:
                break
            if b not in recent:
                recent.append(b)
        hit = 0
        while hit < len(blocks) and blocks[hit] in recent:
            hit += 1
        hits.append(hit)
        history.extend(reversed(blocks))
    return hits


def _flatten(requests: list[list[int]]) -> tuple[list[int], list[int]]:
    offsets = [0]
    for blocks in requests:
        offsets.append(offsets[-1] + len(blocks))
    return [b for blocks in requests for b in blocks], offsets


@st.composite
def chained_requests(draw, max_requests: int = 25) -> list[list[int]]:
    """Requests whose ids are chained: each extends a prefix of an earlier one with fresh ids."""
    requests: list[list[int]] = []
    fresh = 0
    for _ in range(draw(st.integers(1, max_requests))):
        base: list[int] = []
        if requests and draw(st.booleans()):
            parent = requests[draw(st.integers(0, len(requests) - 1))]
            base = parent[: draw(st.integers(0, len(parent)))]
        extra = draw(st.integers(0 if base else 1, 6))
        requests.append(base + list(range(fresh, fresh + extra)))
        fresh += extra
    return requests


arbitrary_requests = st.lists(
    st.lists(st.integers(0, 12), min_size=1, max_size=8), min_size=1, max_size=25
)
capacities = st.one_of(st.none(), st.integers(0, 40))


@given(chained_requests(), capacities)
def test_hits_match_both_models_on_chained_ids(requests, capacity):
    ids, offsets = _flatten(requests)
    got = prefix_hit_blocks(ids, offsets, capacity_blocks=capacity).tolist()
    assert got == lru_model(requests, capacity) == history_model(requests, capacity)


@given(arbitrary_requests, capacities)
def test_hits_match_the_model_on_arbitrary_ids(requests, capacity):
    # Repeated ids, also within a request: lookups happen before any of the request's touches.
    ids, offsets = _flatten(requests)
    got = prefix_hit_blocks(ids, offsets, capacity_blocks=capacity).tolist()
    assert got == lru_model(requests, capacity) == history_model(requests, capacity)


@given(st.one_of(chained_requests(), arbitrary_requests), st.integers(0, 40))
def test_a_larger_cache_never_hits_less(requests, capacity):
    # LRU is a stack algorithm: the smaller cache's content is always a subset of the larger's.
    ids, offsets = _flatten(requests)
    small = prefix_hit_blocks(ids, offsets, capacity_blocks=capacity)
    large = prefix_hit_blocks(ids, offsets, capacity_blocks=capacity + 1)
    unbounded = prefix_hit_blocks(ids, offsets)
    assert (small <= large).all() and (large <= unbounded).all()
    big_enough = prefix_hit_blocks(ids, offsets, capacity_blocks=len(set(ids)))
    np.testing.assert_array_equal(big_enough, unbounded)


@given(chained_requests(), capacities, st.randoms(use_true_random=False))
def test_renaming_ids_changes_nothing(requests, capacity, random):
    ids, offsets = _flatten(requests)
    names = list(range(10_000, 10_000 + len(set(ids)) * 7, 7))
    random.shuffle(names)
    rename = dict(zip(sorted(set(ids)), names, strict=True))
    renamed = [rename[b] for b in ids]
    np.testing.assert_array_equal(
        prefix_hit_blocks(renamed, offsets, capacity_blocks=capacity),
        prefix_hit_blocks(ids, offsets, capacity_blocks=capacity),
    )


def _trace_of(requests: list[list[int]], data: st.DataObject, block_tokens: int) -> Trace:
    ids, offsets = _flatten(requests)
    totals = [
        data.draw(st.integers((len(b) - 1) * block_tokens + 1, len(b) * block_tokens))
        for b in requests
    ]
    return Trace(
        arrival_s=np.arange(len(requests), dtype=float),
        total_tokens=totals,
        output_tokens=np.ones(len(requests), dtype=np.int64),
        cached_tokens=[t // 2 for t in totals],  # replaced by apply_prefix_cache
        hash_ids=ids,
        hash_offsets=offsets,
        source="chained",
    )


@given(chained_requests(), capacities, st.sampled_from([1, 16, 512]), st.data())
def test_cached_tokens_are_whole_blocks_and_leave_a_token_to_compute(
    requests, capacity, block_tokens, data
):
    trace = _trace_of(requests, data, block_tokens)
    out = apply_prefix_cache(trace, capacity_blocks=capacity, block_tokens=block_tokens)
    hits = np.array(lru_model(requests, capacity))
    total, cached = out.total_tokens, out.cached_tokens
    np.testing.assert_array_equal(cached, np.minimum(hits * block_tokens, total - 1))
    assert (cached <= total - 1).all() and (cached >= 0).all()
    clipped = hits * block_tokens >= total
    assert (cached[~clipped] % block_tokens == 0).all()
    assert (cached[clipped] == total[clipped] - 1).all()
    for name in ("arrival_s", "total_tokens", "output_tokens", "request_id", "hash_ids"):
        np.testing.assert_array_equal(getattr(out, name), getattr(trace, name))
    assert out.source == trace.source


def test_first_request_and_full_hits():
    t = Trace(
        arrival_s=[0, 0, 1],
        total_tokens=[1024, 1024, 1025],
        output_tokens=[1, 1, 1],
        hash_ids=[0, 1, 0, 1, 0, 1, 2],
        hash_offsets=[0, 2, 4, 7],
    )
    # The first request finds nothing; the second repeats it (clipped to total - 1); the third
    # reuses both blocks and computes its last token.
    assert apply_prefix_cache(t).cached_tokens.tolist() == [0, 1023, 1024]
    assert apply_prefix_cache(t, capacity_blocks=0).cached_tokens.tolist() == [0, 0, 0]


def test_a_request_longer_than_the_cache_keeps_its_head():
    requests = [[0, 1, 2, 3, 4], [0, 1, 2, 9]]
    ids, offsets = _flatten(requests)
    # Tail-first touches leave blocks 0 and 1 (the head) in a 2-block cache.
    assert prefix_hit_blocks(ids, offsets, capacity_blocks=2).tolist() == [0, 2]


def test_errors_are_named():
    plain = Trace(arrival_s=[0.0], total_tokens=[600], output_tokens=[1], source="azure.csv")
    with pytest.raises(ValueError, match="trace: azure.csv has no hash_ids"):
        apply_prefix_cache(plain)
    t = Trace(
        arrival_s=[0.0, 1.0],
        total_tokens=[600, 100],
        output_tokens=[1, 1],
        request_id=[7, 8],
        hash_ids=[0, 1, 2],
        hash_offsets=[0, 2, 3],
    )
    with pytest.raises(ValueError, match=r"request 7 has 2 blocks .* = 3; is block_tokens right"):
        apply_prefix_cache(t, block_tokens=256)
    with pytest.raises(ValueError, match="block_tokens: must be >= 1"):
        apply_prefix_cache(t, block_tokens=0)
    with pytest.raises(ValueError, match="capacity_blocks: must be >= 0"):
        apply_prefix_cache(t, capacity_blocks=-1)
    with pytest.raises(TypeError, match="capacity_blocks: must be an integer"):
        apply_prefix_cache(t, capacity_blocks=2.5)
    with pytest.raises(TypeError, match="trace: must be a Trace"):
        apply_prefix_cache({"hash_ids": []})
    with pytest.raises(ValueError, match="hash_offsets: must be non-decreasing from 0"):
        prefix_hit_blocks([1, 2], [0, 3])
    with pytest.raises(ValueError, match="hash_offsets: must not be empty"):
        prefix_hit_blocks([], [])
    with pytest.raises(ValueError, match="hash_ids: entries must be >= 0"):
        prefix_hit_blocks([-1], [0, 1])
    assert prefix_hit_blocks([], [0]).tolist() == []


@pytest.mark.parametrize("capacity", [None, 0, 40, 300, 5000])
def test_fixture_matches_the_model(capacity):
    trace = load_mooncake(MOONCAKE_SMALL)
    requests = [trace.hash_ids_of(i).tolist() for i in range(len(trace))]
    got = prefix_hit_blocks(trace.hash_ids, trace.hash_offsets, capacity_blocks=capacity)
    assert got.tolist() == lru_model(requests, capacity)


@pytest.mark.skipif(not MOONCAKE_FULL.is_file(), reason="shared Mooncake trace not present")
def test_real_trace_reuse_ratio_and_capacity_monotonicity():
    trace = load_mooncake(MOONCAKE_FULL)
    unbounded = apply_prefix_cache(trace)
    reuse = unbounded.cached_tokens.sum() / unbounded.total_tokens.sum()
    assert reuse == pytest.approx(0.3736, abs=5e-4)  # PROVENANCE: 0.37
    assert unbounded.summary().cached_share == reuse
    previous = np.zeros(len(trace), dtype=np.int64)
    for capacity in (1000, 10_000, 100_000, 288_500):
        cached = apply_prefix_cache(trace, capacity_blocks=capacity).cached_tokens
        assert (cached >= previous).all()
        previous = cached
    np.testing.assert_array_equal(previous, unbounded.cached_tokens)  # 288,500 blocks hold all
