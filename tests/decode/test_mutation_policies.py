"""The decode policy functions' names, documents, defaults and refusals, pinned exactly."""

from __future__ import annotations

import pytest

from lbkit.decode import POLICIES


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_policy_is_named_and_documented(name):
    policy = POLICIES[name]
    assert policy.__name__ == policy.__qualname__ == name
    assert "Parameters" in policy.__doc__ and "Returns" in policy.__doc__


def test_round_robin_starts_at_rank_zero_by_default():
    assert POLICIES["round_robin"]([0, 0, 0], [0, 0, 0], 5).rank == 0
    assert POLICIES["round_robin"]([0, 0, 0], [0, 0, 0], 5, cursor=2).rank == 2


def test_a_negative_cursor_is_refused_by_name():
    with pytest.raises(ValueError, match="cursor"):
        POLICIES["round_robin"]([0, 0, 0], [0, 0, 0], 5, cursor=-1)


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_refusal_has_rank_minus_one_and_its_reason(name):
    full = POLICIES[name]([1, 1], [10, 10], 5, max_batch=[1, 1])
    assert (full.rank, full.reason) == (-1, "batch_full")
    no_room = POLICIES[name]([0, 0], [10, 10], 5, max_kv_tokens=[12, 12])
    assert no_room.rank == -1 and no_room.reason != "placed"
