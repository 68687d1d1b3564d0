"""Least-squares fit of :class:`lbkit.core.cost.QuadraticCost` to measured steps.

Kept apart from :mod:`lbkit.core.cost` so that the model stays short to read; users call
:meth:`lbkit.core.cost.QuadraticCost.fit`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, check_real

if TYPE_CHECKING:  # the model module imports this one
    from lbkit.core.cost import QuadraticCost

__all__ = ["CostFit", "fit_quadratic"]

#: A column whose distance from the span of the others is below this share of its norm (after
#: scaling to unit norm) is treated as collinear with them.
COLLINEAR_TOL = 1e-6


class CostFit(NamedTuple):
    """Result of :meth:`QuadraticCost.fit`.

    Attributes
    ----------
    cost : lbkit.core.cost.QuadraticCost
        Fitted model.
    rel_rmse : float
        Root-mean-square relative error ``predict/seconds - 1`` over the samples.
    max_rel_error : float
        Largest absolute relative error.
    r_squared_log : float
        Coefficient of determination of ``log(seconds)``.
    num_samples : int
        Samples used.
    """

    cost: QuadraticCost
    rel_rmse: float
    max_rel_error: float
    r_squared_log: float
    num_samples: int


def _engine_column(c: np.ndarray, engine_tokens: Any, num_ranks: Any) -> np.ndarray:
    """``engine_tokens / num_ranks`` per sample, validated against the rank's own chunk."""
    if num_ranks is None:
        raise ValueError("num_ranks: required with engine_tokens (ranks of the engine, >= 1)")
    e = as_float_array(engine_tokens, "engine_tokens", ndim=1)
    r = as_float_array(num_ranks, "num_ranks")
    if e.shape != c.shape:
        raise ValueError(
            f"engine_tokens: must have one value per sample ({c.shape[0]}), got {e.shape[0]}"
        )
    if r.ndim > 1 or (r.ndim == 1 and r.shape != c.shape):
        raise ValueError(f"num_ranks: must be an int or one value per sample ({c.shape[0]})")
    if (r < 1).any() or (r != np.floor(r)).any():
        raise ValueError("num_ranks: must be whole numbers >= 1")
    if (e < c).any():
        raise ValueError(
            "engine_tokens: the engine's total chunk tokens of a step include this rank's chunk, "
            "so engine_tokens >= chunk_tokens on every sample"
        )
    return e / r


def _check_not_collinear(design: np.ndarray, j: int) -> None:
    """Raise when column ``j`` of the unit-scaled design lies in the span of the others."""
    col = design[:, j]
    rest = np.delete(design, j, axis=1)
    coef, *_ = np.linalg.lstsq(rest, col, rcond=None)
    if np.linalg.norm(col - rest @ coef) <= COLLINEAR_TOL * np.linalg.norm(col):
        raise ValueError(
            "engine_tokens: engine_tokens/num_ranks is (nearly) a linear combination of the "
            "other columns (e.g. every sample is a balanced step, engine_tokens == num_ranks * "
            "chunk_tokens), so the local cost b and the shared cost b_moe cannot be told apart; "
            "add steps in which this rank's chunk differs from the engine's mean chunk (ranks "
            "given unequal chunks, or idle while others run)"
        )


def fit_quadratic(
    cls: type,
    chunk_tokens: Any,
    prefix_tokens: Any,
    seconds: Any,
    *,
    tied: bool,
    fit_gamma: bool,
    engine_tokens: Any,
    num_ranks: Any,
    moe_lb: float,
) -> CostFit:
    """Fit ``cls`` (``QuadraticCost``) to measured steps; see ``QuadraticCost.fit``."""
    c = as_float_array(chunk_tokens, "chunk_tokens", ndim=1)
    p = as_float_array(prefix_tokens, "prefix_tokens", ndim=1)
    t = as_float_array(seconds, "seconds", ndim=1)
    if not (c.shape == p.shape == t.shape):
        raise ValueError(
            f"chunk_tokens, prefix_tokens, seconds: must have equal lengths, got "
            f"{c.shape[0]}, {p.shape[0]}, {t.shape[0]}"
        )
    if (c < 1).any():
        raise ValueError("chunk_tokens: every measured step must run at least 1 token")
    if (p < 0).any():
        raise ValueError("prefix_tokens: must be non-negative")
    if (t <= 0).any():
        raise ValueError("seconds: every duration must be > 0")
    moe_lb = check_real(moe_lb, "moe_lb", min_value=1.0)
    names = ["a", "b", "k"]
    cols = [np.ones_like(c), c, c * p + (0.5 * c * c if tied else 0.0)]
    if not tied:
        names.append("q")
        cols.append(c * c)
    if fit_gamma:
        names.append("gamma")
        cols.append(p)
    if engine_tokens is not None:
        names.append("b_moe")
        cols.append(_engine_column(c, engine_tokens, num_ranks))
    elif num_ranks is not None:
        raise ValueError("num_ranks: only meaningful together with engine_tokens")
    n = c.shape[0]
    if n < len(names):
        raise ValueError(
            f"seconds: need at least {len(names)} samples to fit {', '.join(names)}, got {n}"
        )
    from scipy.optimize import nnls  # imported here: routers that never fit stay light

    design = np.stack(cols, axis=1) / t[:, None]
    scale = np.linalg.norm(design, axis=0)
    scale[scale == 0] = 1.0
    if engine_tokens is not None:
        _check_not_collinear(design / scale, len(names) - 1)
    coef, _ = nnls(design / scale, np.ones(n))
    coef = coef / scale
    predicted = np.stack(cols, axis=1) @ coef
    params = dict(zip(names, coef.tolist(), strict=True))
    params.setdefault("gamma", 0.0)
    if tied:
        params["q"] = params["k"] / 2.0
    if "b_moe" in params:
        params["b_moe"] /= moe_lb  # the column's coefficient is b_moe * moe_lb
        params["moe_lb"] = moe_lb
    if params["b"] == 0.0 and params["q"] == 0.0 and params.get("b_moe", 0.0) == 0.0:
        raise ValueError(
            "chunk_tokens, seconds: the data determine no per-token cost (fitted b = q = 0)"
        )
    cost = cls(**params)
    rel = predicted / t - 1.0
    log_t = np.log(t)
    ss_res = float(((np.log(predicted) - log_t) ** 2).sum())
    ss_tot = float(((log_t - log_t.mean()) ** 2).sum())
    return CostFit(
        cost=cost,
        rel_rmse=float(np.sqrt((rel**2).mean())),
        max_rel_error=float(np.abs(rel).max()),
        r_squared_log=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        num_samples=n,
    )
