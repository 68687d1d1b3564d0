"""PrefixIndex against a brute-force model: per rank a plain list of hashes, least recent first."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lbkit.prefill import BYTES_PER_CACHED_BLOCK, PrefixIndex, PrefixIndexStatistics
from lbkit.sim.prefix_cache import prefix_hit_blocks


class Model:
    """Each rank a list of the hashes it holds, least recently used first; lookups brute force."""

    def __init__(self, num_ranks: int, capacity: int | None) -> None:
        self.held: list[list[int]] = [[] for _ in range(num_ranks)]
        self.capacity = capacity
        names = ("inserted", "removed", "unknown_removed", "cleared_blocks", "evictions")
        names += ("admissions", "admitted_blocks", "admitted_hit_blocks")
        self.count = {k: [0] * num_ranks for k in names}
        self.lookups = self.lookup_blocks = self.lookup_hit_blocks = 0

    def run_on(self, rank: int, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.held[rank]:
            n += 1
        return n

    def hits(self, hashes: list[int]) -> list[int]:
        out = [self.run_on(r, hashes) for r in range(len(self.held))]
        self.lookups += 1
        self.lookup_blocks += len(hashes)
        self.lookup_hit_blocks += max(out, default=0)
        return out

    def store(self, rank: int, hashes: list[int]) -> None:
        lst = self.held[rank]
        for h in reversed(hashes):
            if h in lst:
                lst.remove(h)
                lst.append(h)
                continue
            lst.append(h)
            self.count["inserted"][rank] += 1
            if self.capacity is not None and len(lst) > self.capacity:
                lst.pop(0)
                self.count["evictions"][rank] += 1

    def remove(self, rank: int, hashes: list[int]) -> None:
        for h in hashes:
            if h in self.held[rank]:
                self.held[rank].remove(h)
                self.count["removed"][rank] += 1
            else:
                self.count["unknown_removed"][rank] += 1

    def clear(self, rank: int) -> None:
        self.count["cleared_blocks"][rank] += len(self.held[rank])
        self.held[rank] = []

    def admit(self, rank: int, hashes: list[int], *, insert: bool) -> int:
        hit = self.run_on(rank, hashes)
        self.count["admissions"][rank] += 1
        self.count["admitted_blocks"][rank] += len(hashes)
        self.count["admitted_hit_blocks"][rank] += hit
        if insert:
            self.store(rank, hashes)
        else:
            for h in reversed(hashes[:hit]):
                self.held[rank].remove(h)
                self.held[rank].append(h)
        return hit


#: Prompts are prefixes of these chains (chained hashes: a shared hash means a shared prefix).
CHAINS = ([0, 1, 2, 3, 4, 5], [0, 1, 6, 7], [8, 9, 10], [0, 11], [2**64 - 1, -5, 2**70])
prompts = st.sampled_from(CHAINS).flatmap(lambda c: st.integers(0, len(c)).map(lambda k: c[:k]))
any_hashes = st.lists(st.sampled_from([0, 1, 2, 3, 6, 8, 9, 11, 12, 2**64 - 1]), max_size=5)
hash_lists = st.one_of(prompts, any_hashes)


class IndexMachine(RuleBasedStateMachine):
    """Random interleavings of events, admissions, lookups, evictions and state round trips."""

    @initialize(
        num_ranks=st.sampled_from([1, 2, 3, 8, 9, 65]),
        capacity=st.one_of(st.none(), st.integers(0, 6)),
        block_tokens=st.sampled_from([1, 4, 512]),
    )
    def start(self, num_ranks, capacity, block_tokens):
        self.idx = PrefixIndex(num_ranks, block_tokens=block_tokens, capacity_blocks=capacity)
        self.model = Model(num_ranks, capacity)
        self.bt = block_tokens

    def rank(self, r: int) -> int:
        return r % self.idx.num_ranks

    @rule(r=st.integers(0, 64), hashes=hash_lists, as_array=st.booleans())
    def stored(self, r, hashes, as_array):
        fits = all(-(2**63) <= h < 2**63 for h in hashes)
        arg = np.array(hashes, dtype=np.int64) if as_array and fits else hashes
        self.idx.stored(self.rank(r), arg)
        self.model.store(self.rank(r), hashes)

    @rule(r=st.integers(0, 64), hashes=hash_lists)
    def removed(self, r, hashes):
        self.idx.removed(self.rank(r), tuple(hashes))
        self.model.remove(self.rank(r), hashes)

    @rule(r=st.integers(0, 64))
    def cleared(self, r):
        self.idx.cleared(self.rank(r))
        self.model.clear(self.rank(r))

    @rule(r=st.integers(0, 64), hashes=prompts)
    def admitted(self, r, hashes):
        assert self.idx.admitted(self.rank(r), hashes) == self.model.admit(
            self.rank(r), hashes, insert=True
        )

    @rule(r=st.integers(0, 64), hashes=prompts)
    def touch(self, r, hashes):
        got = self.idx.touch(self.rank(r), hashes)
        assert got == self.model.admit(self.rank(r), hashes, insert=False)

    @rule(hashes=hash_lists, short=st.integers(0, 511))
    def lookup(self, hashes, short):
        want = self.model.hits(hashes)
        assert self.idx.hit_blocks(hashes).tolist() == want
        assert [self.idx.held_blocks(r, hashes) for r in range(self.idx.num_ranks)] == want
        # A prompt whose last block is partial (or full when short = 0): the hits are clipped.
        total = max(1, len(hashes) * self.bt - min(short, self.bt - 1))
        self.model.hits(hashes)
        got = self.idx.hit_tokens(hashes, total)
        assert got.dtype == np.int64 and got.shape == (self.idx.num_ranks,)
        assert got.tolist() == [min(h * self.bt, total - 1) for h in want]

    @rule()
    def round_trip(self):
        self.idx = PrefixIndex.from_state_dict(json.loads(json.dumps(self.idx.state_dict())))

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "idx"):
            return
        self.idx._check()
        s = self.idx.statistics()
        for r in range(self.idx.num_ranks):
            assert self.idx.blocks(r) == self.model.held[r]
        for name, want in self.model.count.items():
            assert getattr(s, name).tolist() == want, name
        assert s.cached_blocks.tolist() == [len(x) for x in self.model.held]
        assert s.distinct_blocks == len({h for x in self.model.held for h in x})
        m = self.model
        looks = (s.lookups, s.lookup_blocks, s.lookup_hit_blocks)
        assert looks == (m.lookups, m.lookup_blocks, m.lookup_hit_blocks)


IndexMachine.TestCase.settings = settings(stateful_step_count=50, deadline=None)
TestIndexMachine = IndexMachine.TestCase


# --- admissions alone keep the index prefix-closed, and match the simulator's global cache ---
@st.composite
def chained_requests(draw) -> list[list[int]]:
    """Requests as root-to-node paths of a random prefix tree (a node's id stands for its path)."""
    size = draw(st.integers(1, 20))
    parent = [draw(st.integers(-1, i - 1)) for i in range(size)]  # -1: the first block

    def path(node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = parent[node]
        return out[::-1]

    return [path(n) for n in draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=15))]


@given(chained_requests(), st.integers(1, 4), st.one_of(st.none(), st.integers(0, 12)), st.data())
def test_admissions_keep_every_rank_prefix_closed(requests, num_ranks, capacity, data):
    parent = {
        b: (blocks[j - 1] if j else None) for blocks in requests for j, b in enumerate(blocks)
    }
    idx = PrefixIndex(num_ranks, capacity_blocks=capacity)
    for blocks in requests:
        idx.admitted(data.draw(st.integers(0, num_ranks - 1)), blocks)
        for r in range(num_ranks):
            held = set(idx.blocks(r))
            assert all(parent[b] is None or parent[b] in held for b in held)


@given(chained_requests(), st.one_of(st.none(), st.integers(0, 30)))
def test_one_rank_fed_by_admissions_is_the_simulators_global_cache(requests, capacity):
    idx = PrefixIndex(1, capacity_blocks=capacity)
    got = [idx.admitted(0, blocks) for blocks in requests]
    offsets = np.cumsum([0] + [len(b) for b in requests])
    flat = [b for blocks in requests for b in blocks]
    assert got == prefix_hit_blocks(flat, offsets, capacity_blocks=capacity).tolist()


@given(chained_requests(), st.integers(2, 5), st.randoms(use_true_random=False), st.data())
def test_permuting_ranks_permutes_the_hits(requests, num_ranks, rnd, data):
    perm = list(range(num_ranks))
    rnd.shuffle(perm)
    a, b = PrefixIndex(num_ranks, capacity_blocks=8), PrefixIndex(num_ranks, capacity_blocks=8)
    for blocks in requests:
        r = data.draw(st.integers(0, num_ranks - 1))
        a.admitted(r, blocks)
        b.admitted(perm[r], blocks)
    for blocks in requests:
        total = 512 * len(blocks) + 1
        np.testing.assert_array_equal(
            b.hit_tokens(blocks, total)[perm], a.hit_tokens(blocks, total)
        )


# --- the lookup rule, by example ----------------------------------------------------------------
def test_hits_are_the_leading_run_clipped_to_one_token_short_of_the_prompt():
    idx = PrefixIndex(3, block_tokens=4)
    idx.stored(0, [1, 2, 3])
    idx.stored(1, [2, 3])  # the tail of a prefix whose head rank 1 lacks: no hit
    idx.stored(2, [1])
    assert idx.hit_blocks([1, 2, 3]).tolist() == [3, 0, 1]
    assert idx.hit_tokens([1, 2, 3], 12).tolist() == [11, 0, 4]  # a full hit computes one token
    assert idx.hit_tokens([1, 2, 3], 9).tolist() == [8, 0, 4]  # partial last block, hashed
    assert idx.hit_tokens([1, 2], 9).tolist() == [8, 0, 4]  # ... or not
    assert idx.hit_tokens([1], 1).tolist() == [0, 0, 0]  # a one-token prompt never hits
    assert idx.hit_tokens([], 1).tolist() == [0, 0, 0]
    idx.removed(0, [2])  # the middle goes: block 3 stays held but unreachable
    assert idx.hit_blocks([1, 2, 3]).tolist() == [1, 0, 1] and 3 in idx.blocks(0)
    idx.stored(0, [2])  # a store before its parent arrives... counts once it does
    assert idx.hit_blocks([1, 2, 3]).tolist() == [3, 0, 1]


def test_hashes_compare_as_integers_whatever_their_container():
    idx = PrefixIndex(2)
    big = [2**64 - 1, 2**63, 7]
    idx.stored(1, np.array(big, dtype=np.uint64))
    assert idx.hit_blocks(big).tolist() == [0, 3]
    assert idx.hit_blocks((np.uint64(2**64 - 1), 2**63)).tolist() == [0, 2]
    idx.stored(0, [-1, 2**80])
    assert idx.hit_blocks(np.array([-1], dtype=np.int64)).tolist() == [1, 0]
    assert idx.hit_blocks([-1, 2**80, 5]).tolist() == [2, 0]


def test_capacity_evicts_the_least_recent_tail_first():
    idx = PrefixIndex(1, capacity_blocks=4)
    idx.admitted(0, [1, 2, 3])
    idx.admitted(0, [1, 4, 5])  # 1 refreshed; 5, 4 inserted; 3 (the oldest tail) evicted
    assert idx.blocks(0) == [2, 5, 4, 1]
    assert idx.statistics().evictions.tolist() == [1]
    idx.touch(0, [1, 2, 9])  # refreshes 1 then 2 (tail first): 2 ends older than 1
    assert idx.blocks(0) == [5, 4, 2, 1]
    zero = PrefixIndex(2, capacity_blocks=0)
    zero.stored(0, [1, 2])
    assert zero.hit_blocks([1]).tolist() == [0, 0] and zero.statistics().evictions.tolist() == [
        2,
        0,
    ]


def test_statistics_count_events_admissions_and_lookups():
    idx = PrefixIndex(2, capacity_blocks=3)
    idx.stored(0, [1, 2, 3, 4])  # 4 inserted, 1 evicted
    idx.removed(0, [2, 99])  # one known, one unknown
    idx.admitted(1, [1, 2])
    idx.admitted(1, [1, 5])  # hit 1 of 2
    idx.cleared(1)
    idx.hit_blocks([1, 2])
    s = idx.statistics()
    assert isinstance(s, PrefixIndexStatistics)
    assert s.inserted.tolist() == [4, 3] and s.evictions.tolist() == [1, 0]
    assert s.removed.tolist() == [1, 0] and s.unknown_removed.tolist() == [1, 0]
    assert s.cleared_blocks.tolist() == [0, 3] and s.cached_blocks.tolist() == [2, 0]
    assert s.admissions.tolist() == [0, 2] and s.admitted_blocks.tolist() == [0, 4]
    assert s.admitted_hit_blocks.tolist() == [0, 1]
    assert (s.lookups, s.lookup_blocks, s.lookup_hit_blocks, s.distinct_blocks) == (1, 2, 1, 2)


# --- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda i: PrefixIndex(0), ValueError, "num_ranks: must be >= 1"),
        (lambda i: PrefixIndex(2, block_tokens=0), ValueError, "block_tokens: must be >= 1"),
        (lambda i: PrefixIndex(2, capacity_blocks=-1), ValueError, "capacity_blocks"),
        (lambda i: PrefixIndex(2.0), TypeError, "num_ranks: must be an integer"),
        (lambda i: i.stored(2, [1]), ValueError, "rank: must be <= 1"),
        (lambda i: i.removed(-1, [1]), ValueError, "rank: must be >= 0"),
        (lambda i: i.cleared(True), TypeError, "rank: must be an integer"),
        (lambda i: i.admitted(0.0, [1]), TypeError, "rank"),
        (lambda i: i.held_blocks(5, [1]), ValueError, "rank: must be <= 1"),
        (lambda i: i.stored(0, [1.5]), TypeError, "block_hashes: must hold integers"),
        (lambda i: i.stored(0, [1, True]), TypeError, "block_hashes: must hold integers"),
        (lambda i: i.stored(0, ["a"]), TypeError, "block_hashes: must hold integers"),
        (lambda i: i.stored(0, [b"\x01"]), TypeError, "int.from_bytes"),
        (lambda i: i.stored(0, "12"), TypeError, "block_hashes: must be a sequence"),
        (lambda i: i.stored(0, 12), TypeError, "block_hashes: must be a sequence"),
        (lambda i: i.touch(0, np.array([1.0])), TypeError, "block_hashes: must hold integer"),
        (lambda i: i.hit_blocks(np.zeros((2, 2), int)), ValueError, "1-dimensional"),
        (lambda i: i.hit_blocks([[1, 2]]), TypeError, "block_hashes"),
        (lambda i: i.hit_tokens([1], -3), ValueError, "total_tokens: must be >= 1"),
        (lambda i: i.hit_tokens([1], 0), ValueError, "total_tokens: must be >= 1"),
        (lambda i: i.hit_tokens([1], 2.5), TypeError, "total_tokens: must be an integer"),
        (lambda i: i.hit_tokens([1, 2, 3], 1024), ValueError, "is block_tokens right"),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    idx = PrefixIndex(2)
    with pytest.raises(error, match=match):
        call(idx)
    idx._check()
    assert idx.statistics().inserted.sum() == 0


def _state():
    idx = PrefixIndex(2, block_tokens=16, capacity_blocks=3)
    idx.admitted(0, [1, 2])
    idx.stored(1, [2**64 - 1])
    return json.loads(json.dumps(idx.state_dict()))


def _with(path, value):
    s = _state()
    node = s
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return s


_DELETE = object()


@pytest.mark.parametrize(
    "state, match",
    [
        ([], "state: must be a mapping"),
        (_with(["version"], 2), "state.version: must be 1"),
        (_with(["config"], None), "state.config: must be a mapping"),
        (_with(["config", "num_ranks"], _DELETE), "state.config: missing field 'num_ranks'"),
        (_with(["config", "num_ranks"], 0), "state.config.num_ranks: must be >= 1"),
        (_with(["config", "block_tokens"], "16"), "state.config.block_tokens"),
        (_with(["config", "capacity_blocks"], 1), "state.state.blocks.0.: 2 hashes exceed"),
        (_with(["state", "blocks"], [[1]]), r"state.state.blocks: must have one entry per rank"),
        (_with(["state", "blocks", 1], [1.5]), r"state.state.blocks\[1\]: must hold integers"),
        (_with(["state", "blocks", 1], [4, 4]), r"state.state.blocks\[1\]: holds a hash twice"),
        (_with(["state", "counts", "evictions"], [0]), "state.state.counts.evictions"),
        (_with(["state", "counts", "inserted"], [2, -1]), "state.state.counts.inserted"),
        (_with(["state", "counts", "inserted"], [3, 1]), "state.state.counts: rank 0 holds 2"),
        (_with(["state", "counts", "lookups"], _DELETE), "state.state.counts.lookups"),
        (_with(["state", "counts", "lookup_hit_blocks"], 5), "lookup_hit_blocks exceeds"),
        (_with(["state", "counts", "admitted_hit_blocks"], [9, 0]), "admitted_hit_blocks"),
        (_with(["state"], {"blocks": [[], []]}), "state.state.counts: must be a mapping"),
    ],
)
def test_a_bad_state_dict_is_rejected_by_field(state, match):
    with pytest.raises(ValueError, match=match):
        PrefixIndex.from_state_dict(state)


def test_a_state_dict_round_trip_continues_exactly():
    s = _state()
    a = PrefixIndex.from_state_dict(s)
    b = PrefixIndex.from_state_dict(s)
    for idx in (a, b):
        idx.admitted(0, [1, 7, 8])  # evicts the least recent hash, the same on both
    assert a.blocks(0) == b.blocks(0) == [8, 7, 1] and a.state_dict() == b.state_dict()
    assert a.block_tokens == 16 and a.capacity_blocks == 3 and a.num_ranks == 2


def test_memory_per_cached_block_is_within_the_stated_figure():
    # Each hash on one rank (the costliest case): an OrderedDict entry, a holders entry, a mask
    # and the hash's int object per (hash, rank) pair.
    ranks, per = 64, 500
    idx = PrefixIndex(ranks)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for r in range(ranks):
        idx.stored(r, list(range(2**40 + r * per, 2**40 + (r + 1) * per)))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 30 < used / (ranks * per) <= BYTES_PER_CACHED_BLOCK
    assert idx.statistics().cached_blocks.sum() == ranks * per
