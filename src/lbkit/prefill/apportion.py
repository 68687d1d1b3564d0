"""Apportionment of a prefill pool's engines to length buckets.

Bucket ``j`` receives demand ``D_j`` (quota seconds per second, EMA-smoothed) and ``s_j`` engines;
the busiest engine carries ``D_j / s_j``. Adams' divisor method (every non-empty bucket gets one
engine, then each next engine goes to ``argmax_j D_j / s_j``) minimises ``max_j D_j / s_j`` over
all allocations that give every non-empty bucket an engine (proof in
``docs/prefill-apportionment.md``). Webster, D'Hondt and Hamilton are offered for comparison.

**Serving map.** An allocation is a count vector ``engines[j]`` (engines whose *home* is bucket
``j``). A bucket without engines is served by the engines of the nearest bucket *below* it that
has engines, or, when there is none below, of the nearest bucket above (``serving_buckets``). So
every bucket is always served once the pool has an engine, and buckets that share form contiguous
groups. The *bottleneck* of an allocation is the largest group load: the summed demand of the
buckets a group serves divided by its engines.

**Fewer engines than non-empty buckets** (Adams only, without minimums): the non-empty buckets
are split into ``num_engines`` contiguous groups, one engine each, chosen to minimise the largest
group demand (a linear-partition dynamic programme); each group's engine lives in its first
non-empty bucket and empty buckets join their neighbours by the serving rule.

**No demand at all**: all methods treat the demand as uniform, so idle engines spread evenly over
the buckets (the lowest buckets get the extra engines). With some demand, empty buckets get no
engine unless a minimum asks for one or every non-empty bucket has reached its cap (then the
lowest-index bucket with room gets the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, as_int_array, check_choice, check_int
from lbkit.prefill._kernels import divisor_apportion, partition_min_max

__all__ = [
    "DEFAULT_METHOD",
    "METHODS",
    "Allocation",
    "adams",
    "allocate_engines",
    "bottleneck",
    "dhondt",
    "hamilton",
    "serving_buckets",
    "webster",
]


class Allocation(NamedTuple):
    """Engines per bucket, the serving map and the resulting bottleneck.

    Attributes
    ----------
    engines : ndarray of int64, shape (num_buckets,)
        Engines whose home is each bucket; sums to the number of engines.
    server : ndarray of int64, shape (num_buckets,)
        Bucket whose engines serve each bucket (``server[j] == j`` when ``engines[j] > 0``).
    bottleneck : float
        Largest group load ``sum(demand of the buckets served) / engines``, quota seconds per
        second per engine.
    """

    engines: np.ndarray
    server: np.ndarray
    bottleneck: float


def serving_buckets(engines: Any, /) -> np.ndarray:
    """Bucket whose engines serve each bucket, from engines per bucket.

    A bucket with engines serves itself; one without is served by the nearest bucket below with
    engines, else by the nearest above. All ``-1`` when there are no engines at all.

    Runtime complexity: O(num_buckets).

    Examples
    --------
    >>> serving_buckets([0, 2, 0, 0, 1, 0])
    array([1, 1, 1, 1, 4, 4])
    """
    s = as_int_array(engines, "engines", ndim=1, min_value=0)
    return _serving(s)


def _serving(s: np.ndarray) -> np.ndarray:
    n = s.shape[0]
    out = np.full(n, -1, dtype=np.int64)
    last = -1
    for j in range(n):
        if s[j] > 0:
            last = j
        out[j] = last
    if n and out[-1] >= 0:
        first = int(np.flatnonzero(s > 0)[0])
        out[:first] = first
    return out


def bottleneck(demand: Any, engines: Any, /) -> float:
    """Largest group load of an allocation under the serving map.

    Returns ``inf`` if there is demand but no engine, ``0.0`` if there is no demand.

    Runtime complexity: O(num_buckets).

    Examples
    --------
    >>> bottleneck([4.0, 1.0, 1.0], [2, 1, 0])
    2.0
    """
    d = as_float_array(demand, "demand", ndim=1, nonnegative=True)
    s = as_int_array(engines, "engines", shape=d.shape, min_value=0)
    return bottleneck_unchecked(d, s)


def bottleneck_unchecked(d: np.ndarray, s: np.ndarray) -> float:
    """:func:`bottleneck` of clean arrays (``d`` float, ``s`` int of the same shape), unchecked."""
    if s.sum() == 0:
        return float(np.inf) if d.sum() > 0 else 0.0
    server = _serving(s)
    group = np.bincount(server, weights=d, minlength=d.shape[0])
    has = s > 0
    return float((group[has] / s[has]).max())


def _allocate_iv(
    demand: Any, num_engines: Any, min_engines: Any, max_engines: Any
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    d = as_float_array(demand, "demand", ndim=1, nonnegative=True, allow_empty=False)
    e = check_int(num_engines, "num_engines", min_value=1)
    n = d.shape[0]
    lo = (
        np.zeros(n, dtype=np.int64)
        if min_engines is None
        else as_int_array(min_engines, "min_engines", shape=(n,), min_value=0)
    )
    hi = (
        np.full(n, e, dtype=np.int64)
        if max_engines is None
        else as_int_array(max_engines, "max_engines", shape=(n,), min_value=0)
    )
    if (lo > hi).any():
        j = int(np.flatnonzero(lo > hi)[0])
        raise ValueError(
            f"min_engines, max_engines: bucket {j} has minimum {lo[j]} above its cap {hi[j]}"
        )
    if lo.sum() > e:
        raise ValueError(
            f"min_engines: the minimums need {int(lo.sum())} engines, only {e} available"
        )
    if hi.sum() < e:
        raise ValueError(f"max_engines: the caps admit {int(hi.sum())} engines, {e} to place")
    if d.sum() == 0.0:
        d = np.ones(n)  # no demand: spread the engines evenly
    return d, e, lo, hi


def _pack(d: np.ndarray, s: np.ndarray) -> Allocation:
    return Allocation(s, _serving(s), bottleneck_unchecked(d, s))


def _divisor(
    demand: Any, num_engines: Any, min_engines: Any, max_engines: Any, offset: float
) -> Allocation:
    d, e, lo, hi = _allocate_iv(demand, num_engines, min_engines, max_engines)
    out = np.zeros(d.shape[0], dtype=np.int64)
    divisor_apportion(d, e, lo, hi, offset, out)
    return _pack(d, out)


def adams(
    demand: Any, num_engines: Any, /, *, min_engines: Any = None, max_engines: Any = None
) -> Allocation:
    """Adams' method: one engine per non-empty bucket, then each next to ``argmax D_j / s_j``.

    Minimises the bottleneck ``max_j D_j / s_j`` over all allocations within the bounds that
    give each non-empty bucket (with a cap >= 1) an engine. With fewer engines than non-empty
    buckets (and no minimums), contiguous groups of buckets share one engine each, chosen to
    minimise the largest group demand (see the module docstring). Ties: lowest bucket index.

    Parameters
    ----------
    demand : array_like of float, shape (num_buckets,)
        Non-negative demand per bucket (quota seconds per second).
    num_engines : int
        Engines to place (>= 1).
    min_engines, max_engines : array_like of int, shape (num_buckets,), optional
        Per-bucket minimum and cap; must admit ``num_engines`` in total.

    Returns
    -------
    Allocation

    Raises
    ------
    ValueError
        Negative or non-finite demand, infeasible bounds, or minimums with too few engines.

    Runtime complexity: O(num_engines × num_buckets), or O(num_buckets³) when buckets share.

    Examples
    --------
    >>> adams([6.0, 3.0, 0.0, 1.0], 5)
    Allocation(engines=array([3, 1, 0, 1]), server=array([0, 1, 1, 3]), bottleneck=3.0)
    >>> adams([6.0, 3.0, 0.0, 1.0], 2).engines  # buckets 1..3 share one engine
    array([1, 1, 0, 0])
    """
    d, e, lo, hi = _allocate_iv(demand, num_engines, min_engines, max_engines)
    need = np.maximum(lo, ((d > 0) & (hi > 0)).astype(np.int64))
    if need.sum() <= e:
        out = np.zeros(d.shape[0], dtype=np.int64)
        divisor_apportion(d, e, need, hi, 0.0, out)
        return _pack(d, out)
    if (lo > 0).any() or (hi == 0).any():
        raise ValueError(
            f"num_engines: {e} engines cannot give each of the {int(need.sum())} non-empty "
            "buckets an engine, and shared buckets cannot honour per-bucket minimums or "
            "zero caps"
        )
    idx = np.flatnonzero(d > 0)
    starts = np.zeros(e, dtype=np.int64)
    partition_min_max(d[idx], e, starts)
    out = np.zeros(d.shape[0], dtype=np.int64)
    out[idx[starts]] = 1
    return _pack(d, out)


def webster(
    demand: Any, num_engines: Any, /, *, min_engines: Any = None, max_engines: Any = None
) -> Allocation:
    """Webster (Sainte-Laguë) divisor method: next engine to ``argmax D_j / (s_j + 1/2)``.

    Same signature as :func:`adams`; a bucket may get no engine (it is then served by a
    neighbour, see :func:`serving_buckets`). Ties: lowest bucket index.

    Runtime complexity: O(num_engines × num_buckets).

    Examples
    --------
    >>> webster([6.0, 3.0, 0.0, 1.0], 5).engines
    array([3, 2, 0, 0])
    """
    return _divisor(demand, num_engines, min_engines, max_engines, 0.5)


def dhondt(
    demand: Any, num_engines: Any, /, *, min_engines: Any = None, max_engines: Any = None
) -> Allocation:
    """D'Hondt (Jefferson) divisor method: next engine to ``argmax D_j / (s_j + 1)``.

    Same signature as :func:`adams`; favours the buckets with most demand. Ties: lowest index.

    Runtime complexity: O(num_engines × num_buckets).

    Examples
    --------
    >>> dhondt([6.0, 3.0, 0.0, 1.0], 5).engines
    array([4, 1, 0, 0])
    """
    return _divisor(demand, num_engines, min_engines, max_engines, 1.0)


def hamilton(
    demand: Any, num_engines: Any, /, *, min_engines: Any = None, max_engines: Any = None
) -> Allocation:
    """Hamilton (largest remainder): floors of the quotas ``E D_j / sum D``, then the rest by
    largest remainder (lowest index on ties).

    Without bounds every bucket gets the floor or the ceiling of its quota (the quota rule).
    With bounds the floors are clipped into them and the engines still missing (or in excess)
    are added to the buckets furthest below (removed from those furthest above) their quota.

    Runtime complexity: O(num_buckets × (1 + number of clipped engines)).

    Examples
    --------
    >>> hamilton([6.0, 3.0, 0.0, 1.0], 5).engines
    array([3, 2, 0, 0])
    """
    d, e, lo, hi = _allocate_iv(demand, num_engines, min_engines, max_engines)
    quota = e * d / d.sum()
    s = np.clip(np.floor(quota).astype(np.int64), lo, hi)
    while s.sum() < e:
        gap = np.where(s < hi, quota - s, -np.inf)
        s[int(np.argmax(gap))] += 1
    while s.sum() > e:
        gap = np.where(s > lo, quota - s, np.inf)
        s[int(np.argmin(gap))] -= 1
    return _pack(d, s)


#: Apportionment methods by name; all share the signature of :func:`adams`.
METHODS: Mapping[str, Callable[..., Allocation]] = MappingProxyType(
    {"adams": adams, "webster": webster, "dhondt": dhondt, "hamilton": hamilton}
)

#: The default method: the only one that minimises the busiest engine's load.
DEFAULT_METHOD = "adams"


def allocate_engines(
    demand: Any,
    num_engines: Any,
    /,
    *,
    method: str = DEFAULT_METHOD,
    min_engines: Any = None,
    max_engines: Any = None,
) -> Allocation:
    """Apportion ``num_engines`` engines to buckets by ``METHODS[method]``.

    Parameters
    ----------
    demand : array_like of float, shape (num_buckets,)
        Non-negative demand per bucket (quota seconds per second).
    num_engines : int
        Engines to place (>= 1).
    method : str, default ``DEFAULT_METHOD`` ("adams")
        One of ``METHODS``.
    min_engines, max_engines : array_like of int, shape (num_buckets,), optional
        Per-bucket bounds.

    Returns
    -------
    Allocation
        ``engines`` per bucket, the ``server`` map (which bucket's engines serve each bucket)
        and the ``bottleneck`` (largest demand per engine).

    Runtime complexity: see the method.

    Examples
    --------
    >>> allocate_engines([8.0, 4.0, 2.0, 1.0], 6).engines
    array([3, 1, 1, 1])
    >>> allocate_engines([8.0, 4.0, 2.0, 1.0], 6, method="dhondt").engines
    array([4, 2, 0, 0])
    """
    check_choice(method, "method", tuple(METHODS))
    return METHODS[method](demand, num_engines, min_engines=min_engines, max_engines=max_engines)
