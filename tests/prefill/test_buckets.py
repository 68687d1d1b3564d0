"""Length buckets: edges, vectorisation and validation."""

from __future__ import annotations

import bisect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.prefill import DEFAULT_EDGES, bucket_of
from lbkit.prefill.buckets import check_edges


def test_default_edges_lower_edge_inclusive():
    tokens = [0, 16383, 16384, 65535, 65536, 262143, 262144, 10**7]
    assert bucket_of(tokens).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert DEFAULT_EDGES == (16384, 65536, 262144)


@given(
    edges=st.lists(st.integers(1, 10**6), min_size=1, max_size=6, unique=True).map(sorted),
    tokens=st.lists(st.integers(0, 2 * 10**6), max_size=30),
)
def test_bucket_of_matches_a_scan(edges, tokens):
    got = bucket_of(np.array(tokens, dtype=np.int64), edges=edges)
    assert got.tolist() == [bisect.bisect_right(edges, t) for t in tokens]
    for t in tokens[:3]:
        assert bucket_of(t, edges=edges) == bisect.bisect_right(edges, t)


def test_bucket_of_keeps_shape():
    assert bucket_of(np.array([[1, 20000], [70000, 300000]])).tolist() == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("edges", "match"),
    [
        ([100, 100], "strictly increasing"),
        ([200, 100], "strictly increasing"),
        ([0, 100], "positive"),
        ([-5], "positive"),
        ([], "must not be empty"),
        ([1.5], "must hold integers"),
    ],
)
def test_bad_edges(edges, match):
    with pytest.raises(ValueError, match=match):
        check_edges(edges)
    with pytest.raises(ValueError, match=match):
        bucket_of(10, edges=edges)


@pytest.mark.parametrize(("tokens", "match"), [(-1, ">= 0"), (2.5, "integers"), ([3, -7], ">= 0")])
def test_bad_tokens(tokens, match):
    with pytest.raises(ValueError, match=match):
        bucket_of(tokens)
