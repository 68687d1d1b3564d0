"""Helpers shared by the tamper tests of the balancers' saved states."""

from __future__ import annotations

import copy
import json

from hypothesis import strategies as st


def json_copy(state):
    """``state`` after a round trip through JSON."""
    return json.loads(json.dumps(state))


def leaves(obj, path=()):
    """The paths (tuples of keys and indices) of every leaf of a nested dict/list state."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from leaves(v, (*path, i))
    else:
        yield path


def tampered(state, path, value):
    """A deep copy of ``state`` with the leaf at ``path`` set to ``value``."""
    out = copy.deepcopy(state)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def values(*edges: int):
    """Values a tamperer may write into one leaf: small and huge integers, the integer ``edges``
    (float-exactness and int64 limits), every float, None, booleans, strings and lists."""
    return st.one_of(
        st.integers(-3, 3),
        st.integers(-(2**70), 2**70),
        st.sampled_from(list(edges)),
        st.floats(allow_nan=True, allow_infinity=True),
        st.none(),
        st.booleans(),
        st.text(max_size=3),
        st.lists(st.integers(-2, 5), max_size=4),
    )
