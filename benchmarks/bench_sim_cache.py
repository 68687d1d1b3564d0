"""Per-rank prefix caches: lookup of one prompt on every rank, and admission plus insertion."""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.sim.prefix_cache import RankCaches

RANKS = 64
BLOCKS = 30  # a 15K-token prompt
CAPACITY = 1111  # capacity_blocks_for(): 40 GB of DeepSeek-V3 KV per rank


def _warm_caches(num_ranks: int) -> tuple[RankCaches, list[int]]:
    """Every rank full of other prompts; the probe's prefix is cached to a different depth on
    each rank (0..BLOCKS blocks), so the lookup meets many rank sets."""
    rng = np.random.default_rng(0)
    c = RankCaches(num_ranks, capacity_blocks=CAPACITY)
    fresh = 10**7
    for r in range(num_ranks):
        for _ in range(CAPACITY // BLOCKS):
            c.insert(r, list(range(fresh, fresh + BLOCKS)))
            fresh += BLOCKS
    probe = list(range(BLOCKS))
    for r in range(num_ranks):
        c.insert(r, probe[: int(rng.integers(0, BLOCKS + 1))])
    return c, probe


@pytest.mark.parametrize("num_ranks", [8, RANKS])
def bench_hit_blocks(benchmark, num_ranks):
    benchmark.group = f"RankCaches.hit_blocks|{BLOCKS} blocks"
    c, probe = _warm_caches(num_ranks)
    hits = benchmark(c.hit_blocks, probe)
    assert hits.shape == (num_ranks,) and hits.max() <= BLOCKS


def bench_touch_and_insert(benchmark):
    benchmark.group = f"RankCaches.touch+insert|{BLOCKS} blocks"
    c, probe = _warm_caches(RANKS)

    def admit_and_finish():
        hit = int(c.hit_blocks(probe)[5])
        c.touch(5, probe, hit)
        c.insert(5, probe)

    benchmark(admit_and_finish)
    assert c.statistics().cached_blocks[5] == CAPACITY
