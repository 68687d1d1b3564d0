"""Sessions in synthetic traces: chained block ids, unchanged lengths, Mooncake-like reuse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbkit.sim.prefix_cache import apply_prefix_cache, prefix_hit_blocks
from lbkit.sim.traces import load_mooncake
from lbkit.sim.workload import DEFAULT_WORKLOAD, Sessions, default_workload, synthetic_trace

BLOCK = 512
_REPO = Path(__file__).resolve().parents[2]
_CANDIDATES = [
    base / "shared" / "traces" / "mooncake_conversation" / "conversation_trace.jsonl"
    for base in (_REPO.parent, _REPO.parent.parent)
]
MOONCAKE_FULL = next((p for p in _CANDIDATES if p.is_file()), _CANDIDATES[0])
#: Block reuse of the Mooncake conversation trace (stated in docs/traces.md and the workload's
#: docstring): cached over total prompt tokens with an unbounded global cache, and share of
#: requests reusing more than the common first block.
MOONCAKE_TOKEN_REUSE = 0.374
MOONCAKE_REUSING_REQUESTS = 0.387
#: How close the default workload must come (seed-to-seed spread is about +-2 points).
TOLERANCE = 0.03


def block_reuse(trace) -> tuple[float, float]:
    """(cached share of prompt tokens, share of requests hitting more than one block)."""
    cached = apply_prefix_cache(trace).cached_tokens.sum() / trace.total_tokens.sum()
    hits = prefix_hit_blocks(trace.hash_ids, trace.hash_offsets)
    return float(cached), float((hits > 1).mean())


def check_chained(trace) -> None:
    """Every id has one parent and one position, and stands for the same block content."""
    blocks = np.diff(trace.hash_offsets)
    np.testing.assert_array_equal(blocks, -(-trace.total_tokens // BLOCK))
    parent: dict[int, int] = {}
    position: dict[int, int] = {}
    fill: dict[int, int] = {}
    for i in range(len(trace)):
        ids = trace.hash_ids_of(i).tolist()
        for j, b in enumerate(ids):
            tokens = min(BLOCK, int(trace.total_tokens[i]) - j * BLOCK)
            assert parent.setdefault(b, ids[j - 1] if j else -1) == (ids[j - 1] if j else -1)
            assert position.setdefault(b, j) == j
            assert fill.setdefault(b, tokens) == tokens


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 400),
    st.integers(0, 2**32 - 1),
    st.floats(0.0, 1.0),
    st.floats(0.0, 0.9),
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.sampled_from(["poisson", "gamma"]),
)
def test_session_traces_have_valid_chains_and_the_same_lengths(
    n, seed, single, ratio, prompts, arrival
):
    sessions = Sessions(
        single_turn_share=single,
        turn_ratio=ratio,
        system_prompt_blocks=tuple(prompts),
        system_prompt_weights=(1.0,) * len(prompts),
    )
    kw = dict(rate_per_s=2.0, arrival=arrival, long_share={"64K-256K": 0.05}, rng=seed)
    if arrival == "gamma":
        kw["burstiness"] = 2.0
    t = synthetic_trace(n, sessions=sessions, **kw)
    plain = synthetic_trace(n, **kw)
    assert len(t) == n and plain.hash_ids is None
    check_chained(t)
    # The same length draws, assigned to sessions; outputs untouched.
    np.testing.assert_array_equal(np.sort(t.total_tokens), np.sort(plain.total_tokens))
    np.testing.assert_array_equal(t.output_tokens, plain.output_tokens)
    if n:
        assert t.arrival_s[0] == 0.0 and (np.diff(t.arrival_s) >= 0).all()


def test_a_continuing_session_reuses_its_history():
    # Sessions start about 10^5 s apart and last a few thousand seconds, so consecutive requests
    # closer than 2 * 10^4 s are turns of one session: each turn reuses all the full blocks of
    # the previous one, so its cached tokens are the previous prompt rounded down to blocks.
    t = synthetic_trace(
        60, rate_per_s=0.001, sessions=Sessions(single_turn_share=0.0, turn_ratio=0.99), rng=3
    )
    c = apply_prefix_cache(t).cached_tokens
    same = np.diff(t.arrival_s) < 2e4
    assert same.sum() >= 30
    assert (np.diff(t.total_tokens)[same] >= 0).all()
    expect = np.minimum(t.total_tokens[:-1] // BLOCK * BLOCK, t.total_tokens[1:] - 1)
    np.testing.assert_array_equal(c[1:][same], expect[same])


def test_same_seed_same_session_trace():
    a = default_workload(num_requests=2000, rng=5)
    assert a == default_workload(num_requests=2000, rng=5)
    b = default_workload(num_requests=2000, rng=6)
    assert not np.array_equal(a.hash_ids, b.hash_ids)


def test_default_workload_reuse_is_close_to_mooncake():
    t = default_workload()
    assert len(t) == 20_000 and DEFAULT_WORKLOAD["sessions"] == Sessions()
    tokens, requests = block_reuse(t)
    if MOONCAKE_FULL.is_file():
        ref_tokens, ref_requests = block_reuse(load_mooncake(MOONCAKE_FULL))
    else:
        ref_tokens, ref_requests = MOONCAKE_TOKEN_REUSE, MOONCAKE_REUSING_REQUESTS
    assert abs(tokens - ref_tokens) <= TOLERANCE
    assert abs(requests - ref_requests) <= TOLERANCE


@pytest.mark.skipif(not MOONCAKE_FULL.is_file(), reason="shared Mooncake trace not present")
def test_stated_mooncake_reuse_is_measured():
    tokens, requests = block_reuse(load_mooncake(MOONCAKE_FULL))
    assert tokens == pytest.approx(MOONCAKE_TOKEN_REUSE, abs=5e-4)
    assert requests == pytest.approx(MOONCAKE_REUSING_REQUESTS, abs=5e-4)


@pytest.mark.parametrize(
    ("sessions", "error", "message"),
    [
        ("yes", TypeError, "sessions: must be a Sessions or None"),
        (Sessions(single_turn_share=1.5), ValueError, "sessions.single_turn_share"),
        (Sessions(turn_ratio=1.0), ValueError, "sessions.turn_ratio"),
        (Sessions(think_ln_sigma=-1.0), ValueError, "sessions.think_ln_sigma"),
        (Sessions(system_prompt_blocks=()), ValueError, "sessions.system_prompt_weights"),
        (
            Sessions(system_prompt_blocks=(0,), system_prompt_weights=(1.0,)),
            ValueError,
            "sessions.system_prompt_blocks",
        ),
        (
            Sessions(system_prompt_blocks=(1, 2), system_prompt_weights=(0.0, 0.0)),
            ValueError,
            "sessions.system_prompt_weights",
        ),
    ],
)
def test_bad_sessions_are_named(sessions, error, message):
    with pytest.raises(error, match=message):
        synthetic_trace(10, rate_per_s=1.0, sessions=sessions)
