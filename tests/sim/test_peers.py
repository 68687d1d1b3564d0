"""The peers' routing rules (lbkit.sim.peers): hand-computed decisions from each source's
semantics, stale views and own counts, determinism, valid ranks on random views, the prefix
index against brute force, and every rule end to end through simulate_prefill."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.sim.peers import (
    PEER_POLICIES,
    Dynamo,
    LlmD,
    SglangCacheAware,
    SglangDP,
    Vllm,
    VllmKv,
)
from lbkit.sim.peers_common import PrefixIndex
from lbkit.sim.protocol import EV_FINISH, EV_PROGRESS

NAMES = (
    "vllm",
    "vllm_kv",
    "sglang_total_tokens",
    "sglang_shortest_queue",
    "sglang_cache_aware",
    "dynamo",
    "llm_d",
)
EMPTY = np.zeros(0, dtype=np.int64)


def view(n, *, waiting=None, requests=None, tokens=None, kv=None, cap=0, hit=None,
         hashes=EMPTY, block_tokens=512):  # fmt: skip
    """A prefill view with the fields of the shared contract (zeros where not given)."""

    def arr(x):
        return np.zeros(n, dtype=np.int64) if x is None else np.asarray(x, dtype=np.int64)

    return SimpleNamespace(
        num_engines=1,
        ranks_per_engine=n,
        num_requests=arr(requests),
        tokens=arr(tokens),
        num_waiting=arr(waiting),
        kv_tokens=arr(kv),
        kv_capacity_tokens=cap,
        hit_tokens=arr(hit),
        block_hashes=np.asarray(hashes, dtype=np.int64),
        block_tokens=block_tokens,
    )


def finish(policy, requests, now_s):
    r = np.asarray(requests, dtype=np.int64)
    policy.observe(r, np.full(r.size, EV_FINISH), np.zeros(r.size, np.int64), now_s=now_s)


def test_names_are_the_contract():
    assert tuple(PEER_POLICIES) == NAMES
    for name, factory in PEER_POLICIES.items():
        assert factory(2, 2, cost=None, rng=0).name == name


# --- vLLM ---------------------------------------------------------------------------------


def test_vllm_hand_example():
    # waiting (0, 1, 0), running (2, 0, 3): scores 4*w + r = (2, 4, 3) -> rank 0; rank 0 gets
    # one more waiting request (score 6), so the next pick is rank 2 (3), then rank 1 (4).
    p = Vllm(1, 3)
    v = view(3, waiting=[0, 1, 0], requests=[2, 1, 3])
    assert [p.route(i, 100, 0, now_s=0.0, view=v) for i in range(3)] == [0, 2, 1]


def test_vllm_ties_go_to_the_lowest_index():
    p = Vllm(2, 2)
    assert p.route(0, 100, 0, now_s=0.0, view=view(4)) == 0


def test_vllm_stale_counts_refresh_after_100ms():
    p = Vllm(1, 2)
    assert p.route(0, 10, 0, now_s=0.0, view=view(2)) == 0  # tie -> 0; rank 0 scores 4 now
    busy1 = view(2, waiting=[0, 5], requests=[0, 5])  # rank 1 became busy (the truth)
    # Still the snapshot taken at 0 s plus the own pick: (4, 0) -> rank 1, although busy.
    assert p.route(1, 10, 0, now_s=0.099, view=busy1) == 1
    # After 100 ms the snapshot is the truth again (own picks forgotten): (0, 20) -> rank 0.
    assert p.route(2, 10, 0, now_s=0.1, view=busy1) == 0


# --- vLLM with KV pressure ----------------------------------------------------------------


def test_vllm_kv_penalty_hand_example():
    # waiting (1, 0), running (0, 2), KV usage (1.0, 0.0):
    # rank 0: max(0, 1) + 6*1*(1.0-0.5) = 4; rank 1: max(0, 2) = 2 -> rank 1.
    v = view(2, waiting=[1, 0], requests=[1, 2], kv=[1000, 0], cap=1000)
    assert VllmKv(1, 2).route(0, 10, 0, now_s=0.0, view=v) == 1
    # At half usage the penalty is off: 1 against 2 -> rank 0.
    v = view(2, waiting=[1, 0], requests=[1, 2], kv=[500, 0], cap=1000)
    assert VllmKv(1, 2).route(0, 10, 0, now_s=0.0, view=v) == 0


def test_vllm_kv_rotating_start_spreads_ties_and_inflight_survives_snapshots():
    p = VllmKv(1, 2)
    # Burst on an idle pool: 0 (scan from 0), then rank 1 (score 0 against 1), then a tie
    # (1, 1) scanned from the rotated start 0 -> 0.
    assert [p.route(i, 10, 0, now_s=0.0, view=view(2)) for i in range(3)] == [0, 1, 0]
    # A new snapshot claiming an empty pool cannot erase the exact in-flight counts (2, 1).
    assert p.route(3, 10, 0, now_s=0.2, view=view(2)) == 1
    # Completions drop the counts: requests 0 and 2 finished on rank 0 -> (0, 2) -> rank 0.
    finish(p, [0, 2], now_s=0.3)
    assert p.route(4, 10, 0, now_s=0.3, view=view(2)) == 0


# --- SGLang DP controller -----------------------------------------------------------------


def test_sglang_total_tokens_hand_example():
    # num_total_tokens = kv + tokens = (100, 100, 110); requests (2, 1, 0):
    # lowest (tokens, requests) is (100, 1) -> rank 1, which then counts 100 + 30 tokens;
    # next lowest is (100, 2) -> rank 0.
    p = SglangDP(1, 3, method="total_tokens")
    v = view(3, requests=[2, 1, 0], tokens=[100, 100, 50], kv=[0, 0, 60])
    assert [p.route(i, 30, 0, now_s=0.0, view=v) for i in range(2)] == [1, 0]


def test_sglang_shortest_queue_hand_example():
    # requests (2, 1, 1): rank 1, then (2, 2, 1) -> rank 2, then a three-way tie -> rank 0.
    p = SglangDP(1, 3, method="shortest_queue")
    v = view(3, requests=[2, 1, 1], tokens=[0, 999, 999])
    assert [p.route(i, 30, 0, now_s=0.0, view=v) for i in range(3)] == [1, 2, 0]


def test_sglang_dp_snapshot_refreshes_after_20ms():
    p = SglangDP(1, 2, method="shortest_queue")
    assert p.route(0, 10, 0, now_s=0.0, view=view(2, requests=[0, 3])) == 0
    later = view(2, requests=[5, 0])
    assert p.route(1, 10, 0, now_s=0.019, view=later) == 0  # snapshot (0, 3) + own pick
    assert p.route(2, 10, 0, now_s=0.02, view=later) == 1


def test_sglang_dp_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        SglangDP(1, 2, method="minimum_tokens")


# --- SGLang gateway cache-aware -----------------------------------------------------------


def test_sglang_cache_aware_match_threshold():
    p = SglangCacheAware(1, 2)
    # A: 4 blocks, nothing known -> least loaded, rank 0 (first of the tie).
    assert p.route(0, 2048, 0, now_s=0.0, view=view(2, hashes=[1, 2, 3, 4])) == 0
    # B: 10 blocks whose first 4 rank 0 holds: 2048 / 5120 = 0.4 > 0.3 -> rank 0 (busier).
    b = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert p.route(1, 5120, 0, now_s=0.0, view=view(2, hashes=b)) == 0
    # C: shares 3 of 10 blocks: 1536 / 5120 = 0.3, not above -> least loaded, rank 1.
    c = [1, 2, 3, 11, 12, 13, 14, 15, 16, 17]
    assert p.route(2, 5120, 0, now_s=0.0, view=view(2, hashes=c)) == 1
    # No block hashes: the prefix part is zero -> least loaded (loads 2, 1) -> rank 1.
    assert p.route(3, 5120, 0, now_s=0.0, view=view(2)) == 1


def test_sglang_cache_aware_imbalance_overrides_affinity():
    # The same prompt sticks to rank 0 while balanced; after 65 in-flight on rank 0 against 0,
    # max - min = 65 > 64 and 65 > 1.5 * 0: the 66th goes to the least loaded rank 1.
    p = SglangCacheAware(1, 2)
    v = view(2, hashes=[1, 2])
    got = [p.route(i, 1024, 0, now_s=0.0, view=v) for i in range(66)]
    assert got == [0] * 65 + [1]
    # The imbalanced branch still records the prompt in the chosen worker's tree.
    assert p.index.deepest(np.array([1, 2])) == (2, [0, 1])
    # Loads (65, 1): max - min = 64 is not above 64, so balanced; a miss -> least loaded.
    assert p.route(66, 1024, 0, now_s=0.0, view=view(2, hashes=[5])) == 1
    finish(p, range(10), now_s=1.0)  # loads (55, 2)
    p2 = view(2, hashes=[1, 2, 3])
    assert p.route(67, 1536, 0, now_s=1.0, view=p2) in (0, 1)  # both hold 2 of 3 blocks
    assert p.route(68, 1024, 0, now_s=1.0, view=view(2, hashes=[9])) == 1  # miss: least loaded


# --- Dynamo -------------------------------------------------------------------------------


def test_dynamo_hand_example():
    p = Dynamo(1, 2, rng=0)
    # isl 2048 = 4 blocks; rank 1 has 1024 cached (2 blocks):
    # rank 0: 4 prefill + 0 active + 4 new = 8; rank 1: 2 prefill + 0 + 2 new = 4 -> rank 1.
    assert p.route(0, 2048, 0, now_s=0.0, view=view(2, hit=[0, 1024])) == 1
    # isl 1024, nothing cached: rank 0: 2 + 0 + 2 = 4; rank 1 carries 1024 prefill tokens and
    # 4 active blocks: (1024 + 1024)/512 + 4 + 2 = 10 -> rank 0.
    assert p.route(1, 1024, 0, now_s=0.0, view=view(2)) == 0
    # Request 0 finished its prefill: rank 1 is empty again, 2 + 0 + 2 = 4 against rank 0's
    # (1024 + 1024)/512 + 2 + 2 = 8 -> rank 1.
    finish(p, [0], now_s=1.0)
    assert p.route(2, 1024, 0, now_s=1.0, view=view(2)) == 1


def test_dynamo_ties_are_drawn_from_rng():
    picks = {Dynamo(1, 4, rng=s).route(0, 512, 0, now_s=0.0, view=view(4)) for s in range(40)}
    assert picks == {0, 1, 2, 3}


# --- llm-d --------------------------------------------------------------------------------


def test_llm_d_hand_example():
    # queue (1, 3) -> normalised (1, 0); KV usage (0.9, 0.0):
    # rank 0: 2*1 + 2*0.1 = 2.2; rank 1: 2*0 + 2*1 = 2.0 -> rank 0.
    v = view(2, waiting=[1, 3], kv=[900, 0], cap=1000)
    assert LlmD(1, 2, rng=0).route(0, 10, 0, now_s=0.0, view=v) == 0


def test_llm_d_prefix_scorer():
    p = LlmD(1, 3, rng=0)
    first = p.route(0, 2048, 0, now_s=0.0, view=view(3, hashes=[1, 2, 3, 4], cap=10**6))
    # Same queue and KV everywhere (4 each); the pod that got [1, 2, 3, 4] scores
    # 4 + 3 * 2/4 = 5.5 for [1, 2, 9, 10] -> it wins.
    assert p.route(1, 2048, 0, now_s=0.0, view=view(3, hashes=[1, 2, 9, 10], cap=10**6)) == first
    # Matching stops at the first block no pod holds: [7, 1, 2] scores zero everywhere.
    assert p.scores(0.0, view(3, hashes=[7, 1, 2], cap=10**6)).tolist() == [4.0, 4.0, 4.0]


def test_llm_d_stale_metrics_refresh_after_50ms():
    p = LlmD(1, 2, rng=0)
    assert p.route(0, 10, 0, now_s=0.0, view=view(2, waiting=[0, 2])) == 0
    later = view(2, waiting=[9, 0])
    # llm-d adds nothing of its own: the old snapshot still says (0, 2).
    assert p.route(1, 10, 0, now_s=0.049, view=later) == 0
    assert p.route(2, 10, 0, now_s=0.05, view=later) == 1


# --- prefix index -------------------------------------------------------------------------


def test_prefix_index_evicts_leaves_first():
    idx = PrefixIndex(1, 2)
    idx.add(np.array([1, 2, 3]), 0)
    assert idx.deepest(np.array([1, 2, 3])) == (2, [0])
    assert idx.counts(np.array([1, 2, 3]), 1).tolist() == [2]


@settings(max_examples=60, deadline=None)
@given(
    routed=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 5), min_size=1, max_size=5)),
        max_size=12,
    ),
    query=st.lists(st.integers(0, 5), max_size=6),
    capacity=st.integers(1, 8),
)
def test_prefix_index_matches_brute_force(routed, query, capacity):
    idx = PrefixIndex(3, capacity)
    lru = [[] for _ in range(3)]  # oldest first
    for rank, blocks in routed:
        idx.add(np.array(blocks), rank)
        for b in reversed(blocks):
            if b in lru[rank]:
                lru[rank].remove(b)
            lru[rank].append(b)
        del lru[rank][: max(0, len(lru[rank]) - capacity)]
    q = np.array(query, dtype=np.int64)
    held = [set(x) for x in lru]
    depth = [next((k for k, b in enumerate(query) if b not in h), len(query)) for h in held]
    best = max(depth)
    expect = (best, [r for r in range(3) if depth[r] == best]) if best else (0, [])
    assert idx.deepest(q) == expect
    stop = next((k for k, b in enumerate(query) if not any(b in h for h in held)), len(query))
    counts = [sum(b in h for b in query[:stop]) for h in held]
    assert idx.counts(q, 3).tolist() == counts


# --- all rules: determinism and valid ranks -----------------------------------------------


@st.composite
def random_views(draw, n):
    req = np.array(draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)))
    wait = np.array([draw(st.integers(0, int(x))) for x in req])
    cap = draw(st.sampled_from([0, 4096, 10**6]))
    kv = np.array(draw(st.lists(st.integers(0, max(cap, 1)), min_size=n, max_size=n)))
    return view(
        n,
        waiting=wait,
        requests=req,
        tokens=draw(st.lists(st.integers(0, 10**5), min_size=n, max_size=n)),
        kv=kv,
        cap=cap,
        hit=draw(st.lists(st.integers(0, 4096), min_size=n, max_size=n)),
        hashes=draw(st.lists(st.integers(0, 6), max_size=5)),
    )


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_valid_rank_on_random_views(name, data):
    n = 6
    p = PEER_POLICIES[name](2, 3, cost=None, rng=data.draw(st.integers(0, 9)))
    t = 0.0
    for i in range(8):
        t += data.draw(st.sampled_from([0.0, 0.01, 0.2]))
        f = p.route(i, data.draw(st.integers(1, 9000)), 0, now_s=t, view=data.draw(random_views(n)))
        assert f == -1 or 0 <= f < n
        if data.draw(st.booleans()):
            kinds = np.array([EV_FINISH, EV_PROGRESS])
            p.observe(np.array([i, i]), kinds[::-1], np.array([5, 0]), now_s=t)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_given_the_seed(name):
    def run(seed):
        gen = np.random.default_rng(123)
        p = PEER_POLICIES[name](2, 2, cost=None, rng=seed)
        out = []
        for i in range(40):
            v = view(
                4,
                waiting=gen.integers(0, 3, 4),
                requests=gen.integers(3, 6, 4),
                tokens=gen.integers(0, 5000, 4),
                kv=gen.integers(0, 1000, 4),
                cap=1000,
                hit=gen.integers(0, 3, 4) * 512,
                hashes=gen.integers(0, 4, gen.integers(0, 5)),
            )
            out.append(p.route(i, int(gen.integers(1, 4000)), 0, now_s=i * 0.03, view=v))
            if i % 3 == 2:
                finish(p, [i - 2], now_s=i * 0.03)
        return out

    assert run(7) == run(7)


def test_bad_pool_shape_is_refused():
    with pytest.raises(ValueError, match="num_engines"):
        Vllm(0, 2)


# --- end to end ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_end_to_end_replay(name):
    from lbkit.core import PRESETS
    from lbkit.sim.engine import PrefillView, simulate_prefill
    from lbkit.sim.workload import synthetic_trace

    if "hit_tokens" not in PrefillView._fields:
        pytest.skip("PrefillView lacks hit_tokens: the peers need the engine's new view fields")
    trace = synthetic_trace(200, rate_per_s=20.0, rng=3)
    unit = PRESETS["h800_dsv3"].prefill
    policy = PEER_POLICIES[name](2, 2, cost=unit, rng=1)
    run = simulate_prefill(trace, policy, num_engines=2, ranks_per_engine=2, cost=unit, rng=1)
    assert run.policy == name
    done = ~np.isnan(run.finish_s)
    assert done.all()
