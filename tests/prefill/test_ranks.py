"""Rank choice: lowest quota load, lowest flat index on ties; sampling; metamorphic laws."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.prefill import pick_rank

# Few distinct values so that ties are common.
loads = st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.25, 7.0]), min_size=1, max_size=24)


@st.composite
def loads_and_mask(draw):
    x = draw(loads)
    mask = draw(st.lists(st.booleans(), min_size=len(x), max_size=len(x)))
    return np.array(x), np.array(mask)


def oracle(load, mask):
    ok = [i for i in range(len(load)) if mask[i]]
    return min(ok, key=lambda i: (load[i], i)) if ok else -1


@given(lm=loads_and_mask())
def test_matches_oracle(lm):
    load, mask = lm
    assert pick_rank(load, eligible=mask) == oracle(load, mask)


@given(lm=loads_and_mask(), ranks=st.sampled_from([1, 2, 3, 4]))
def test_two_dimensional_is_flat_order(lm, ranks):
    load, mask = lm
    n = (load.size // ranks) * ranks
    if n == 0:
        return
    got = pick_rank(load[:n].reshape(-1, ranks), eligible=mask[:n].reshape(-1, ranks))
    assert got == oracle(load[:n], mask[:n])


@given(lm=loads_and_mask(), i=st.integers(0, 23), extra=st.floats(0.0, 10.0))
def test_more_load_never_attracts(lm, i, extra):
    load, mask = lm
    i %= load.size
    before = pick_rank(load, eligible=mask)
    more = load.copy()
    more[i] += extra
    after = pick_rank(more, eligible=mask)
    if after == i:
        assert before == i
    if before != i:
        assert after == before


@given(x=st.lists(st.floats(0, 100), min_size=1, max_size=20, unique=True), seed=st.integers(0, 99))
def test_permuting_ranks_permutes_the_choice(x, seed):
    load = np.array(x)
    perm = np.random.default_rng(seed).permutation(load.size)
    assert perm[pick_rank(load[perm])] == pick_rank(load)


@given(lm=loads_and_mask(), k=st.integers(-30, 30))
def test_scaling_loads_changes_nothing(lm, k):
    load, mask = lm
    assert pick_rank(load * 2.0**k, eligible=mask) == pick_rank(load, eligible=mask)


@given(lm=loads_and_mask(), d=st.integers(1, 5), seed=st.integers(0, 10))
def test_sampling_picks_an_eligible_rank_deterministically(lm, d, seed):
    load, mask = lm
    a = pick_rank(load, eligible=mask, sample=d, rng=seed)
    assert a == pick_rank(load, eligible=mask, sample=d, rng=np.random.default_rng(seed))
    if not mask.any():
        assert a == -1
        return
    assert mask[a]
    # No eligible rank lighter than the choice can have been... at least d-1 are not worse.
    assert (load[mask] >= load[a]).sum() >= min(d, int(mask.sum()))
    if d >= mask.sum():
        assert a == oracle(load, mask)


def test_sampling_spreads_over_stale_loads():
    load = np.zeros(64)
    picks = {pick_rank(load, sample=2, rng=np.random.default_rng(s)) for s in range(200)}
    assert len(picks) > 30  # the full argmin would always answer 0


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (([],), {}, ValueError, "quota_load: must not be empty"),
        (([1.0, np.nan],), {}, ValueError, "quota_load: must be finite"),
        ((np.zeros((2, 2, 2)),), {}, ValueError, "quota_load: must be 1-D"),
        (
            ([1.0, 2.0],),
            {"eligible": np.array([True])},
            ValueError,
            "eligible: must have the shape",
        ),
        (([1.0, 2.0],), {"eligible": [1, 0]}, TypeError, "eligible: must be a boolean mask"),
        (([1.0, 2.0],), {"sample": 0}, ValueError, "sample: must be >= 1"),
        (([1.0, 2.0],), {"sample": 2, "rng": "x"}, TypeError, "rng: must be"),
    ],
)
def test_bad_input(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pick_rank(*args, **kwargs)
