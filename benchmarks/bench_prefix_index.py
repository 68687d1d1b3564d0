"""``lbkit.prefill.PrefixIndex``: lookup at 64 ranks, event and admission throughput, memory.

Timing (pytest-benchmark; groups ``<method>|<size>``)::

    python -m pytest benchmarks/bench_prefix_index.py --benchmark-enable -p no:cacheprovider

Every rank is full (``CAPACITY`` hashes of other prompts) before anything is timed. The lookup
probe is a 30-block (15K-token) prompt held to a different depth on every rank (``staggered``:
the walk meets up to 30 sets of ranks, the costliest case) or whole by one rank (``one_rank``: one
set, the common case of a prefix sent where it was cached). ``stored+removed`` is a 30-block
``BlockStored`` event and the ``BlockRemoved`` of the same blocks on one rank;
``admitted`` admits the probe on one full rank (touch, insertion, 0-30 evictions).

Memory (``bench_memory_per_cached_block``, run with ``-s`` to print): tracemalloc's growth per
held (hash, rank) pair while 64 ranks store 1,000 hashes each, with every hash held by 1, 2 or 8
ranks; it is recorded in ``extra_info`` and checked against ``BYTES_PER_CACHED_BLOCK``.
Under the default ``--benchmark-disable`` each body runs once and checks its result.
"""

from __future__ import annotations

import tracemalloc

import pytest

from lbkit.prefill import BYTES_PER_CACHED_BLOCK, PrefixIndex

RANKS = 64
BLOCKS = 30  # a 15K-token prompt of 512-token blocks
CAPACITY = 1111  # a rank's KV memory in 512-token blocks (40 GB of DeepSeek-V3 KV)
FRESH = 10**7  # hashes of the filler prompts start here, above the probe's


def _depths(num_ranks: int) -> list[int]:
    # Distinct depths from BLOCKS down (13 and BLOCKS + 1 = 31 are coprime): rank 0 holds it all.
    return [BLOCKS - (r * 13) % (BLOCKS + 1) for r in range(num_ranks)]


def _full_index(num_ranks: int, placement: str) -> tuple[PrefixIndex, list[int]]:
    idx = PrefixIndex(num_ranks, capacity_blocks=CAPACITY)
    fresh = FRESH
    for r in range(num_ranks):
        for _ in range(CAPACITY // BLOCKS):
            idx.stored(r, list(range(fresh, fresh + BLOCKS)))
            fresh += BLOCKS
    probe = list(range(BLOCKS))
    if placement == "staggered":
        for r, depth in enumerate(_depths(num_ranks)):
            idx.stored(r, probe[:depth])
    else:
        idx.stored(num_ranks // 2, probe)
    return idx, probe


@pytest.mark.parametrize("placement", ["staggered", "one_rank"])
@pytest.mark.parametrize("num_ranks", [8, RANKS])
def bench_hit_tokens(benchmark, num_ranks, placement):
    benchmark.group = f"PrefixIndex.hit_tokens|{BLOCKS} blocks"
    idx, probe = _full_index(num_ranks, placement)
    total = BLOCKS * 512
    hits = benchmark(idx.hit_tokens, probe, total)
    depths = _depths(num_ranks) if placement == "staggered" else [0] * num_ranks
    if placement == "one_rank":
        depths[num_ranks // 2] = BLOCKS
    assert hits.tolist() == [min(d * 512, total - 1) for d in depths]


def bench_stored_removed(benchmark):
    benchmark.group = f"PrefixIndex.stored+removed|{BLOCKS} blocks"
    idx, _ = _full_index(RANKS, "one_rank")
    event = list(range(-BLOCKS, 0))
    idx.removed(3, idx.blocks(3)[:BLOCKS])  # room for the event: no eviction is timed
    held = len(idx.blocks(3))

    def store_and_remove():
        idx.stored(3, event)
        idx.removed(3, event)

    benchmark(store_and_remove)
    s = idx.statistics()
    assert s.cached_blocks[3] == held and s.unknown_removed.sum() == 0 and s.evictions[3] == 0


def bench_admitted(benchmark):
    benchmark.group = f"PrefixIndex.admitted|{BLOCKS} blocks"
    idx, probe = _full_index(RANKS, "staggered")
    benchmark(idx.admitted, 5, probe)
    assert idx.hit_blocks(probe)[5] == BLOCKS and idx.statistics().cached_blocks[5] == CAPACITY


def _bytes_per_pair(holders: int, num_ranks: int = RANKS, per_rank: int = 1000) -> float:
    idx = PrefixIndex(num_ranks)
    groups = num_ranks // holders  # ranks r, r + groups, ... hold the same hashes
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for r in range(num_ranks):
        start = 2**40 + (r % groups) * per_rank  # 64-bit-sized hashes, as engines send
        idx.stored(r, list(range(start, start + per_rank)))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert idx.statistics().distinct_blocks == groups * per_rank
    return used / (num_ranks * per_rank)


def bench_memory_per_cached_block(benchmark):
    benchmark.group = "PrefixIndex memory|bytes per (hash, rank)"
    figures = benchmark.pedantic(
        lambda: {h: round(_bytes_per_pair(h), 1) for h in (1, 2, 8)}, rounds=1, iterations=1
    )
    benchmark.extra_info["bytes_per_pair_by_holders"] = figures
    print(f"\nbytes per held (hash, rank) pair at {RANKS} ranks, by ranks per hash: {figures}")
    assert all(30 < b <= BYTES_PER_CACHED_BLOCK for b in figures.values())
