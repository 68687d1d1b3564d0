"""Shared Hypothesis strategies and plain-Python oracles of the decode policies."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from lbkit.core import DecodeCost

# Few distinct values so that ties are common; KV values span short and long contexts.
COUNTS = st.integers(0, 6)
KV = st.sampled_from([0, 1, 7, 100, 512, 2048, 8192, 30000])
UNIT_MAX = DecodeCost(a=1.0, b=1.0, k=0.001, combine="max")


@st.composite
def rank_states(draw, min_ranks=1, max_ranks=8, caps=True):
    """``(B, S, s, kwargs)`` with optional capacities and eligibility."""
    n = draw(st.integers(min_ranks, max_ranks))
    b = np.array(draw(st.lists(COUNTS, min_size=n, max_size=n)), dtype=np.int64)
    s = np.array(draw(st.lists(KV, min_size=n, max_size=n)), dtype=np.int64)
    new = draw(KV)
    kw = {}
    if caps and draw(st.booleans()):
        per_rank = st.lists(st.integers(0, 8), min_size=n, max_size=n)
        kw["max_batch"] = draw(st.one_of(st.integers(0, 8), per_rank))
    if caps and draw(st.booleans()):
        per_rank = st.lists(st.integers(0, 40000), min_size=n, max_size=n)
        kw["max_kv_tokens"] = draw(st.one_of(st.integers(0, 40000), per_rank))
    if draw(st.booleans()):
        kw["eligible"] = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return b, s, new, kw


def _row(value, n):
    if value is None:
        return [math.inf] * n
    if np.ndim(value) == 0:
        return [float(value)] * n
    return [float(v) for v in value]


def feasible(b, s, new, kw):
    """Ranks a request may go to, and the refusal reason when there are none."""
    n = len(b)
    cb, cs = _row(kw.get("max_batch"), n), _row(kw.get("max_kv_tokens"), n)
    ok = kw.get("eligible")
    ok = [True] * n if ok is None else [bool(x) for x in ok]
    elig = [r for r in range(n) if ok[r]]
    fit = [r for r in elig if new <= cs[r]]
    good = [r for r in fit if b[r] + 1 <= cb[r] and s[r] + new <= cs[r]]
    if good:
        return good, "placed"
    if not elig:
        return [], "no_rank"
    if not fit:
        return [], "too_long"
    if not any(b[r] + 1 <= cb[r] for r in fit):
        return [], "batch_full"
    if not any(s[r] + new <= cs[r] for r in fit):
        return [], "kv_full"
    return [], "full"


def normalisers(b, s, new, kw, scale="mean"):
    """Per-rank ``(Bh, Sh)`` as documented: means over eligible ranks with the new request, or
    finite positive capacities."""
    n = len(b)
    ok = kw.get("eligible")
    elig = [r for r in range(n) if ok is None or ok[r]]
    m = len(elig)
    bh = (sum(int(b[r]) for r in elig) + 1) / m
    sh = (sum(int(s[r]) for r in elig) + new) / m
    cb, cs = _row(kw.get("max_batch"), n), _row(kw.get("max_kv_tokens"), n)
    out = []
    for r in range(n):
        x, y = bh, sh
        if scale == "capacity":
            x = cb[r] if 0 < cb[r] < math.inf else bh
            y = cs[r] if 0 < cs[r] < math.inf else sh
        out.append((x, y))
    return out


def objective_increase(b, s, new, kw, r, scale="mean"):
    """Increase of ``sum_q (B_q/Bh_q)^2 + (S_q/Sh_q)^2`` when the request goes to rank ``r``."""
    bh, sh = normalisers(b, s, new, kw, scale)[r]
    inc = ((b[r] + 1) ** 2 - b[r] ** 2) / bh**2
    if sh > 0:
        inc += ((s[r] + new) ** 2 - s[r] ** 2) / sh**2
    return inc


def linf_after(b, s, new, kw, r):
    """``max_q max(B_q/Bh, S_q/Sh)`` over eligible ranks after placing on ``r`` (mean scale)."""
    n = len(b)
    ok = kw.get("eligible")
    bh, sh = normalisers(b, s, new, kw)[r]
    worst = 0.0
    for q in range(n):
        if ok is not None and not ok[q]:
            continue
        bq, sq = b[q] + (q == r), s[q] + new * (q == r)
        worst = max(worst, bq / bh, sq / sh if sh > 0 else 0.0)
    return worst


def score(policy, b, s, new, kw, r):
    """What ``policy`` minimises when placing on rank ``r`` (``UNIT_MAX`` for ``"cost"``)."""
    if policy == "sum_of_squares":
        return objective_increase(b, s, new, kw, r)
    if policy == "min_max":
        return linf_after(b, s, new, kw, r)
    if policy == "cost":
        return float(UNIT_MAX.step_time(b[r] + 1, s[r] + new))
    if policy == "least_requests":
        return float(b[r])
    if policy == "least_kv":
        return float(s[r])
    raise ValueError(policy)
