"""Terms shared by the prefill and decode cost models of :mod:`lbkit.core.cost`.

Validation of the shared routed-expert fields and of per-rank inputs, and the shared cost
``s_per_unit * total / num_ranks`` that every rank of an engine pays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.validation import as_float_array, check_real

__all__ = ["check_moe", "per_rank", "scalar_or_array", "shared_s_of"]


def scalar_or_array(x: np.ndarray) -> Any:
    """A 0-d array as its Python scalar, any other array as it is."""
    return x.item() if x.ndim == 0 else x


def check_moe(obj: Any) -> None:
    """Validate the shared-cost fields ``b_moe >= 0`` and ``moe_lb >= 1`` in place."""
    object.__setattr__(obj, "b_moe", check_real(obj.b_moe, "b_moe", min_value=0.0))
    object.__setattr__(obj, "moe_lb", check_real(obj.moe_lb, "moe_lb", min_value=1.0))


def per_rank(value: Any, name: str) -> np.ndarray:
    """A non-negative array with ranks on its first axis (at least one rank)."""
    x = as_float_array(value, name, nonnegative=True)
    if x.ndim not in (1, 2) or x.shape[0] == 0:
        raise ValueError(
            f"{name}: must have shape (ranks,) or (ranks, chunks) with at least one rank, "
            f"got shape {x.shape}"
        )
    return x


def shared_s_of(s_per_unit: float, total: Any, num_ranks: Any, name: str) -> Any:
    """``s_per_unit * total / num_ranks``, validated (``total`` named ``name`` in errors)."""
    t = as_float_array(total, name, nonnegative=True)
    r = as_float_array(num_ranks, "num_ranks")
    if (r < 1).any() or (r != np.floor(r)).any():
        raise ValueError("num_ranks: must be whole numbers >= 1")
    return scalar_or_array(s_per_unit * t / r)
