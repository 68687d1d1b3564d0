"""Validation of per-rank decode state and capacities into the kernels' state matrix."""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.cost import PRESETS, DecodeCost
from lbkit.core.validation import as_int_array, check_choice, check_int, to_numpy
from lbkit.decode import _kernels as K

__all__ = ["DEFAULT_COST", "SCALES", "capacity_iv", "limits_iv", "params", "state_iv"]

#: Normalisers of the two-dimensional scores: means over eligible ranks, or finite capacities.
SCALES = ("mean", "capacity")

#: Cost model of the ``"cost"`` policy when none is given: the derived H800 / DeepSeek-V3 decode
#: preset with two overlapping micro-batches (``combine="max"``).
DEFAULT_COST = PRESETS["h800_dsv3"].decode.with_combine("max")


def capacity_iv(value: Any, name: str, n: int) -> np.ndarray:
    """A capacity (``None``, a scalar or one value per rank) as a float64 row (``inf`` = none)."""
    if value is None:
        return np.full(n, np.inf)
    arr = to_numpy(value, name)
    if arr.ndim == 0:
        return np.full(n, float(check_int(value, name, min_value=0)))
    return as_int_array(arr, name, shape=(n,), min_value=0).astype(np.float64)


def state_iv(
    num_requests: Any, kv_tokens: Any, max_batch: Any, max_kv_tokens: Any, eligible: Any
) -> np.ndarray:
    """Validate per-rank state and capacities; return a fresh state matrix ``(NUM_ROWS, n)``."""
    b = as_int_array(num_requests, "num_requests", ndim=1, min_value=0, allow_empty=False)
    n = b.shape[0]
    s = as_int_array(kv_tokens, "kv_tokens", shape=(n,), min_value=0)
    X = np.zeros((K.NUM_ROWS, n))
    X[K.ROW_B] = b
    X[K.ROW_S] = s
    limits_iv(X, max_batch, max_kv_tokens, eligible, "like num_requests")
    return X


def limits_iv(X: np.ndarray, max_batch: Any, max_kv_tokens: Any, eligible: Any, like: str) -> None:
    """Validate capacities and eligibility into the rows of ``X`` (``like``: what sets the
    number of ranks, for the shape error)."""
    n = X.shape[1]
    X[K.ROW_CAP_B] = capacity_iv(max_batch, "max_batch", n)
    X[K.ROW_CAP_S] = capacity_iv(max_kv_tokens, "max_kv_tokens", n)
    if eligible is None:
        X[K.ROW_OK] = 1.0
    else:
        ok = to_numpy(eligible, "eligible")
        if ok.dtype != np.bool_:
            raise TypeError(f"eligible: must be a boolean mask, got dtype {ok.dtype}")
        if ok.shape != (n,):
            raise ValueError(f"eligible: must have shape ({n},) {like}, got {ok.shape}")
        X[K.ROW_OK] = ok


def params(code: int, scale: Any, cost: Any, proj: bool = False) -> np.ndarray:
    """The kernels' parameter vector ``P`` (see ``_kernels``), validating ``scale`` and ``cost``."""
    check_choice(scale, "scale", SCALES)
    if cost is None:
        cost = DEFAULT_COST
    elif not isinstance(cost, DecodeCost):
        raise TypeError(f"cost: must be a lbkit.core.DecodeCost, got {type(cost).__name__}")
    P = np.zeros(K.NUM_PARAMS)
    P[K.P_CODE] = code
    P[K.P_CAPSCALE] = scale == "capacity"
    P[K.P_A], P[K.P_B], P[K.P_K] = cost.a, cost.b, cost.k
    P[K.P_CMAX] = cost.combine == "max"
    P[K.P_PROJ] = proj
    return P
