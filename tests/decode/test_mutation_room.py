"""Room-making places each moved request where the policy would, with the balancer's cost model
(its ``combine`` included): checked step by step against the public policy function."""

from __future__ import annotations

import numpy as np
import pytest

from lbkit.core import DecodeCost
from lbkit.decode import POLICIES
from lbkit.decode import _kernels as K
from lbkit.decode._state import params
from lbkit.decode.migration import room_on
from lbkit.decode.policies import POLICY_CODES

# Found by search: the two combine modes of the cost policy send the second move apart.
RANK = np.array([2, 1, 2, 2, 0, 0, 2, 1])
KV = np.array([24, 191, 152, 173, 172, 126, 196, 197])
NEW, CAP = 881, 1000.0


def _room(cost):
    n = 3
    X = np.zeros((K.NUM_ROWS, n))
    X[K.ROW_B] = np.bincount(RANK, minlength=n)
    X[K.ROW_S] = np.bincount(RANK, weights=KV.astype(float), minlength=n)
    X[K.ROW_CAP_B] = np.inf
    X[K.ROW_CAP_S] = CAP
    X[K.ROW_OK] = 1.0
    P = params(POLICY_CODES["cost"], "mean", cost)
    return room_on(RANK.copy(), KV.astype(float), X, NEW, P, 0, 4)


@pytest.mark.parametrize("combine", ["sum", "max"])
def test_room_moves_follow_the_cost_policy_with_its_combine(combine):
    cost = DecodeCost(a=1.0, b=1.0, k=0.01).with_combine(combine)
    room = _room(cost)
    assert room.complete and room.rank == 0
    b = np.bincount(RANK, minlength=3)
    s = np.bincount(RANK, weights=KV, minlength=3).astype(np.int64)
    others = [r != room.rank for r in range(3)]
    for req, dst in zip(room.request, room.target, strict=True):
        want = POLICIES["cost"](b.tolist(), s.tolist(), int(KV[req]), eligible=others, cost=cost,
                                max_kv_tokens=[int(CAP)] * 3)  # fmt: skip
        assert dst == want.rank
        b[room.rank] -= 1
        s[room.rank] -= KV[req]
        b[dst] += 1
        s[dst] += KV[req]
    assert room.target.tolist() == ([1, 1] if combine == "sum" else [1, 2])
