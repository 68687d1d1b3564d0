"""The replay driver shared by the prefill and decode pools, against a scripted pool."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lbkit.sim.replay import PROGRESS_EVERY, readonly, replay


class _Scripted:
    """Records the driver's calls; screens out ``skip``, refuses ``refuse``, needs ``steps``
    kernel calls per advance and asks for ``retries`` offers after the horizon."""

    def __init__(self, skip=(), refuse=(), steps=1, retries=0):
        self.calls = []
        self.skip, self.refuse, self.steps, self.retries = set(skip), set(refuse), steps, retries
        self._left = steps

    def screen(self, request, t, /):
        self.calls.append(("screen", request, t))
        return request not in self.skip

    def step(self, t_until, /):
        self.calls.append(("step", t_until))
        self._left -= 1
        if self._left == 0:
            self._left = self.steps
            return True
        return False

    def offer(self, request, t, /):
        self.calls.append(("offer", request, t))
        return request not in self.refuse

    def retry(self, horizon_s, /):
        self.calls.append(("retry", horizon_s))
        self.retries -= 1
        return self.retries >= 0


def test_each_arrival_is_screened_advanced_to_and_offered_in_order():
    pool = _Scripted(skip={1}, steps=2)
    arrived = replay(pool, np.array([2, 0, 1]), np.array([5.0, 7.0, 1.0]), horizon_s=math.inf)
    assert arrived == 3
    assert pool.calls == [
        ("screen", 2, 1.0), ("step", 1.0), ("step", 1.0), ("offer", 2, 1.0),
        ("screen", 0, 5.0), ("step", 5.0), ("step", 5.0), ("offer", 0, 5.0),
        ("screen", 1, 7.0),  # settled at screening: no advance, no offer
        ("step", math.inf), ("step", math.inf), ("retry", math.inf),
    ]  # fmt: skip


def test_the_horizon_stops_arrivals_and_the_pool():
    pool = _Scripted()
    arrived = replay(pool, np.arange(3), np.array([0.0, 2.0, 3.0]), horizon_s=2.0)
    assert arrived == 2
    assert [c for c in pool.calls if c[0] == "screen"] == [("screen", 0, 0.0), ("screen", 1, 2.0)]
    assert pool.calls[-2:] == [("step", 2.0), ("retry", 2.0)]


def test_retries_advance_again_until_the_pool_has_nothing_to_offer():
    pool = _Scripted(retries=2)
    replay(pool, np.zeros(0, dtype=np.int64), np.zeros(0), horizon_s=math.inf)
    assert pool.calls == [("step", math.inf), ("retry", math.inf), ("step", math.inf),
                          ("retry", math.inf), ("step", math.inf), ("retry", math.inf)]  # fmt: skip


@pytest.mark.parametrize("refuse", [set(), {PROGRESS_EVERY - 1}])
def test_progress_counts_arrivals_that_were_not_refused(refuse):
    n = PROGRESS_EVERY + 5
    seen = []
    pool = _Scripted(refuse=refuse)
    replay(pool, np.arange(n), np.zeros(n), horizon_s=math.inf,
           on_progress=lambda done, total: seen.append((done, total)))  # fmt: skip
    assert seen == ([] if refuse else [(PROGRESS_EVERY, n)])


def test_readonly_is_a_live_view():
    a = np.zeros(3)
    v = readonly(a)
    a[1] = 2.0
    assert v.tolist() == [0.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="read-only"):
        v[0] = 1.0
