"""Seeded synthetic expert loads for examples, tests and benchmarks.

Two families cover what public MoE load statistics look like: **lognormal** loads (most experts
near the mean, a heavy tail whose weight grows with ``sigma``) and **Zipf** loads (the expert of
rank ``i`` gets load proportional to ``i**-exponent``; ranks shuffled per layer). Both are scaled
to ``tokens_per_layer`` and rounded to integers, as routed-token counts are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.validation import as_float_array, as_rng, check_choice, check_int, check_real

__all__ = ["drift", "synthetic_expert_load"]


def synthetic_expert_load(
    num_layers: int = 58,
    num_experts: int = 256,
    /,
    *,
    kind: str = "lognormal",
    sigma: float = 1.0,
    exponent: float = 1.0,
    tokens_per_layer: int = 8 * 65536,
    rng: Any = None,
) -> np.ndarray:
    """Draw a ``[num_layers, num_experts]`` matrix of routed-token counts.

    Parameters
    ----------
    num_layers, num_experts : int
        Shape; the defaults are DeepSeek-V3's 58 MoE layers of 256 routed experts.
    kind : {"lognormal", "zipf"}
        Load family.
    sigma : float
        Log-scale standard deviation of the lognormal family.
    exponent : float
        Exponent of the Zipf family.
    tokens_per_layer : int
        Total routed tokens per layer (top-k routing counts a token k times).
    rng : numpy Generator, int seed or None
        Source of randomness (``None`` is seed 0).

    Returns
    -------
    ndarray of float64, shape (num_layers, num_experts)
        Non-negative integer-valued loads.

    Examples
    --------
    >>> w = synthetic_expert_load(2, 8, kind="zipf", exponent=1.0, tokens_per_layer=1000, rng=1)
    >>> w.shape, bool((w >= 0).all())
    ((2, 8), True)
    >>> np.array_equal(w, synthetic_expert_load(2, 8, kind="zipf", tokens_per_layer=1000, rng=1))
    True
    """
    num_layers = check_int(num_layers, "num_layers", min_value=1)
    num_experts = check_int(num_experts, "num_experts", min_value=1)
    check_choice(kind, "kind", ("lognormal", "zipf"))
    sigma = check_real(sigma, "sigma", min_value=0.0)
    exponent = check_real(exponent, "exponent", min_value=0.0)
    tokens_per_layer = check_int(tokens_per_layer, "tokens_per_layer", min_value=1)
    gen = as_rng(rng)
    if kind == "lognormal":
        raw = gen.lognormal(0.0, sigma, size=(num_layers, num_experts))
    else:
        base = np.arange(1, num_experts + 1, dtype=np.float64) ** -exponent
        raw = np.stack([gen.permutation(base) for _ in range(num_layers)])
    return np.round(raw / raw.sum(axis=1, keepdims=True) * tokens_per_layer)


def drift(weight: Any, /, *, sigma: float, rng: Any = None) -> np.ndarray:
    """Multiply every load by an independent lognormal factor ``exp(N(0, sigma))``.

    Models how expert loads move between two recording windows. The factors are drawn by the
    generator's ``lognormal`` (its exponential is the C library's), so the same seed gives the
    same loads on every machine (``numpy.exp`` on arrays differs by an ulp on some CPUs, where
    it runs its own vector code).

    Examples
    --------
    >>> w = np.array([[100.0, 200.0]])
    >>> bool(np.array_equal(drift(w, sigma=0.0), w))
    True
    """
    w = as_float_array(weight, "weight", ndim=2, nonnegative=True)
    sigma = check_real(sigma, "sigma", min_value=0.0)
    gen = as_rng(rng)
    return w * gen.lognormal(0.0, sigma, size=w.shape)
