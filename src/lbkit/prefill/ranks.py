"""Rank choice inside a bucket's engines: the rank with the lowest quota load.

A rank's quota load is the summed remaining quota (seconds of work) of the requests queued or
running on it. The default rule takes the least-loaded eligible rank; ties go to the lowest engine,
then the lowest rank index, i.e. the lowest flat index of the ``(engines, ranks)`` array. For large
fleets whose loads are reported with delay, *power-of-d choices* samples ``d`` eligible ranks and
takes the least loaded of them, which keeps stale loads from sending every request to the same
rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.validation import as_float_array, as_rng, check_int, to_numpy

__all__ = ["pick_rank"]


def _pick_rank_iv(
    quota_load: Any, eligible: Any, sample: Any, rng: Any
) -> tuple[np.ndarray, np.ndarray, np.random.Generator | None]:
    load = as_float_array(quota_load, "quota_load", allow_empty=False)
    if load.ndim not in (1, 2):
        raise ValueError(
            f"quota_load: must be 1-D (ranks) or 2-D (engines, ranks), got shape {load.shape}"
        )
    if eligible is None:
        ok = np.ones(load.shape, dtype=bool)
    else:
        ok = to_numpy(eligible, "eligible")
        if ok.dtype != np.bool_:
            raise TypeError(f"eligible: must be a boolean mask, got dtype {ok.dtype}")
        if ok.shape != load.shape:
            raise ValueError(
                f"eligible: must have the shape of quota_load {load.shape}, got {ok.shape}"
            )
    gen = None
    if sample is not None:
        check_int(sample, "sample", min_value=1)
        gen = as_rng(rng)
    return load.ravel(), ok.ravel(), gen


def pick_rank(
    quota_load: Any,
    /,
    *,
    eligible: Any = None,
    sample: int | None = None,
    rng: np.random.Generator | int | None = None,
) -> int:
    """Flat index of the eligible rank with the lowest quota load.

    Parameters
    ----------
    quota_load : array_like of float, shape (ranks,) or (engines, ranks)
        Remaining quota per rank, seconds.
    eligible : array_like of bool, same shape, optional
        False for ranks that may not take work (engine out of service, draining, other bucket).
    sample : int, optional
        Power-of-d choices: draw ``sample`` distinct eligible ranks uniformly (with ``rng``) and
        pick the least loaded of them. Default: consider every eligible rank.
    rng : numpy Generator, int seed or None
        Randomness for ``sample`` (``None`` means seed 0).

    Returns
    -------
    int
        Flat (C-order) index ``engine * ranks + rank``, or ``-1`` if no rank is eligible. Ties go
        to the lowest flat index (lowest engine, then lowest rank).

    Runtime complexity: O(ranks), or O(ranks + sample) with sampling.

    Examples
    --------
    >>> load = np.array([[3.0, 1.0], [1.0, 0.5]])
    >>> pick_rank(load)
    3
    >>> divmod(pick_rank(load, eligible=np.array([[True, True], [False, False]])), 2)
    (0, 1)
    >>> pick_rank([2.0, 1.0, 1.0])
    1
    >>> pick_rank([2.0, 1.0], eligible=np.array([False, False]))
    -1
    """
    load, ok, gen = _pick_rank_iv(quota_load, eligible, sample, rng)
    idx = np.flatnonzero(ok)
    if idx.size == 0:
        return -1
    if gen is not None and sample < idx.size:
        idx = np.sort(gen.choice(idx, size=sample, replace=False))
    return int(idx[np.argmin(load[idx])])
