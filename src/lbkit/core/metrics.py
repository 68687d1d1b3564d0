"""Balance metrics of SPEC section 5.

- **Balance efficiency** of a synchronous group with load ``L[r, t]`` (rank ``r``, step ``t``):
  ``eta = sum_t mean_r L[r, t] / sum_t max_r L[r, t]``, a ratio of sums; 1.0 is perfect and the
  imbalance is ``1/eta``.
- **max/mean imbalance** of one snapshot (request count or KV tokens per rank).
- **moe_lb** of an MoE layer: max GPU load / mean GPU load, where a GPU's load is the sum over its
  slots of ``weight[e] / logcnt[e]`` (an expert's tokens split evenly over its replicas).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.validation import as_float_array, as_int_array, check_int

__all__ = ["balance_efficiency", "gpu_loads", "imbalance", "max_over_mean", "moe_lb"]

#: Above this largest value the ratios are computed on the values scaled by a power of two: the
#: sums of up to 2**60 values of at most 2**962 stay finite, and scaling by a power of two is
#: exact, so the ratios are what exact arithmetic on the unscaled values would round to.
SAFE_MAX = 2.0**962


def _safe(arr: np.ndarray) -> np.ndarray:
    """``arr`` scaled by a power of two so that its sums cannot overflow (module constant)."""
    peak = float(arr.max()) if arr.size else 0.0
    if not peak > SAFE_MAX:
        return arr
    return np.ldexp(arr, -(int(np.frexp(peak)[1]) - 962))


def balance_efficiency(load: Any, /) -> float:
    """Balance efficiency ``sum_t mean_r L[r,t] / sum_t max_r L[r,t]`` of a synchronous group.

    Parameters
    ----------
    load : array_like, shape (ranks,) or (ranks, steps)
        Non-negative load (seconds, tokens, requests...) of each rank in each step.

    Returns
    -------
    float
        In ``(0, 1]``; 1.0 when every step is perfectly balanced or the group is idle.

    Runtime complexity: O(ranks × steps).

    Examples
    --------
    >>> balance_efficiency([[1.0, 2.0], [3.0, 2.0]])
    0.8
    >>> balance_efficiency([0.0, 0.0])
    1.0
    """
    arr = as_float_array(load, "load", nonnegative=True, allow_empty=False)
    if arr.ndim == 1:
        arr = arr[:, None]
    elif arr.ndim != 2:
        raise ValueError(f"load: must be 1- or 2-dimensional (ranks, steps), got shape {arr.shape}")
    arr = _safe(arr)
    peak = float(arr.max(axis=0).sum())
    if peak == 0.0:
        return 1.0
    return float(arr.mean(axis=0).sum()) / peak


def imbalance(load: Any, /) -> float:
    """Imbalance ``1 / balance_efficiency(load)`` (>= 1; 1.0 is perfect).

    Examples
    --------
    >>> imbalance([[1.0, 2.0], [3.0, 2.0]])
    1.25
    """
    return 1.0 / balance_efficiency(load)


def max_over_mean(values: Any, /, *, axis: int = -1) -> Any:
    """``max / mean`` along ``axis`` (1.0 where the mean is zero).

    Examples
    --------
    >>> max_over_mean([1.0, 2.0, 3.0])
    1.5
    >>> max_over_mean([[0.0, 0.0], [1.0, 3.0]])
    array([1. , 1.5])
    """
    arr = _safe(as_float_array(values, "values", nonnegative=True, allow_empty=False))
    mean = arr.mean(axis=axis)
    peak = arr.max(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)
    return out.item() if out.ndim == 0 else out


def gpu_loads(weight: Any, phy2log: Any, /, *, num_gpus: int) -> np.ndarray:
    """Load of every GPU under a placement: ``sum over its slots of weight[e] / logcnt[e]``.

    Parameters
    ----------
    weight : array_like, shape (layers, experts)
        Load per logical expert (e.g. routed tokens).
    phy2log : array_like of int, shape (layers, slots)
        Logical expert held by each physical slot; slots ``g*S .. (g+1)*S-1`` are on GPU ``g``
        with ``S = slots / num_gpus``.
    num_gpus : int
        Number of GPUs; must divide ``slots``.

    Returns
    -------
    ndarray, shape (layers, num_gpus)

    Runtime complexity: O(layers × slots).

    Examples
    --------
    >>> gpu_loads([[4.0, 2.0]], [[0, 1, 0, 1]], num_gpus=2)
    array([[3., 3.]])
    """
    w, p2l = _placement_iv(weight, phy2log, num_gpus)
    layers, slots = p2l.shape
    counts = np.zeros_like(w)
    np.add.at(counts, (np.repeat(np.arange(layers), slots), p2l.ravel()), 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_replica = np.where(counts > 0, w / np.where(counts > 0, counts, 1.0), 0.0)
    slot_load = np.take_along_axis(per_replica, p2l, axis=1)
    return slot_load.reshape(layers, num_gpus, slots // num_gpus).sum(axis=2)


def moe_lb(weight: Any, phy2log: Any, /, *, num_gpus: int) -> np.ndarray:
    """Per-layer ``moe_lb`` = max GPU load / mean GPU load under a placement.

    Parameters and shapes as in :func:`gpu_loads`. A layer with no load has ``moe_lb = 1``.

    Returns
    -------
    ndarray, shape (layers,)

    Examples
    --------
    >>> moe_lb([[4.0, 2.0]], [[0, 0, 1, 1]], num_gpus=2)
    array([1.33333333])
    """
    w = _safe(as_float_array(weight, "weight", ndim=2, nonnegative=True))
    return np.asarray(max_over_mean(gpu_loads(w, phy2log, num_gpus=num_gpus), axis=1))


def _placement_iv(weight: Any, phy2log: Any, num_gpus: Any) -> tuple[np.ndarray, np.ndarray]:
    w = as_float_array(weight, "weight", ndim=2, nonnegative=True)
    if w.ndim == 2 and w.shape[1] == 0:
        raise ValueError("weight: must have at least one expert per layer")
    p2l = as_int_array(
        phy2log, "phy2log", shape=(w.shape[0], None), min_value=0, max_value=w.shape[1] - 1
    )
    num_gpus = check_int(num_gpus, "num_gpus", min_value=1)
    if p2l.shape[1] % num_gpus:
        raise ValueError(
            f"num_gpus: must divide the number of slots ({p2l.shape[1]}), got {num_gpus}"
        )
    return w, p2l
