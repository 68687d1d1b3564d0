"""Step-cost models of prefill and decode ranks.

A prefill rank that runs chunks ``c_i`` (new tokens) on top of prefixes ``p_i`` (tokens already
in KV cache) in one step takes

.. math::

    T = a + \\sum_i \\left(b c_i + k c_i p_i + q c_i^2 + \\gamma p_i\\right)

seconds: a fixed cost ``a`` per step, linear work ``b`` per token, attention ``k`` per (new,
cached) token pair and ``q`` per new-token pair, and an optional cost ``gamma`` per cached token
read. Causal attention gives the physical tie ``q = k/2``; under it the work of a request does not
depend on how it is chunked, which is what makes its *quota* (work without ``a``) a property of the
request.

A decode rank with ``B`` requests holding ``S`` KV tokens steps in ``a_d + b_d*B + k_d*S``
(``combine="sum"``) or ``a_d + max(b_d*B, k_d*S)`` seconds (``combine="max"``: two micro-batches
overlap attention with MoE and communication).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, check_choice, check_int, check_real

__all__ = [
    "PRESETS",
    "CostFit",
    "CostPreset",
    "DecodeCost",
    "QuadraticCost",
    "preset",
]


def _scalar_or_array(x: np.ndarray) -> Any:
    return x.item() if x.ndim == 0 else x


@dataclass(frozen=True, slots=True)
class QuadraticCost:
    """Prefill step cost ``T = a + sum_i (b c_i + k c_i p_i + q c_i^2 + gamma p_i)``.

    Parameters
    ----------
    a : float
        Fixed cost of one step, seconds.
    b : float
        Seconds per new token (linear layers, MoE).
    k : float
        Seconds per (new token, cached token) attention pair.
    q : float
        Seconds per (new token, new token) pair; ``k / 2`` for causal attention.
    gamma : float, default 0
        Seconds per cached token read by a scheduled chunk.

    All coefficients are finite and non-negative, and ``b > 0`` or ``q > 0`` so that a chunk's
    cost grows with its length (otherwise no time budget bounds the chunk).

    Examples
    --------
    >>> cost = QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005)
    >>> cost.predict(1000, 0)
    1501.0
    >>> cost.quota(1000, 0)
    1500.0
    >>> cost.solve_chunk(1501.0, 0)
    1000
    """

    a: float
    b: float
    k: float
    q: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        for field in ("a", "b", "k", "q", "gamma"):
            object.__setattr__(self, field, check_real(getattr(self, field), field, min_value=0.0))
        if self.b == 0.0 and self.q == 0.0:
            raise ValueError("b, q: at least one must be > 0 so that a chunk's cost grows with it")

    @property
    def tied(self) -> bool:
        """Whether ``q == k/2`` (causal attention), so quota is independent of chunking."""
        return math.isclose(self.q, self.k / 2.0, rel_tol=1e-9, abs_tol=0.0)

    def work(self, chunk_tokens: Any, prefix_tokens: Any) -> Any:
        """Variable cost of one chunk (no fixed cost ``a``); 0 for an empty chunk.

        Vectorised: arguments broadcast against each other.

        Examples
        --------
        >>> QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005).work([0, 10], 100)
        array([ 0.  , 11.05])
        """
        c = as_float_array(chunk_tokens, "chunk_tokens", nonnegative=True)
        p = as_float_array(prefix_tokens, "prefix_tokens", nonnegative=True)
        w = c * (self.b + self.k * p + self.q * c) + self.gamma * p
        return _scalar_or_array(np.where(c > 0, w, 0.0))

    def predict(self, chunk_tokens: Any, prefix_tokens: Any) -> Any:
        """Seconds for a step that runs one chunk of ``chunk_tokens`` on ``prefix_tokens``.

        Vectorised elementwise (each element is its own step). See :meth:`step_time` for one step
        that runs several chunks.

        Examples
        --------
        >>> QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005).predict([1000, 2000], [0, 1000])
        array([1501., 6001.])
        """
        return _scalar_or_array(self.a + np.asarray(self.work(chunk_tokens, prefix_tokens)))

    def step_time(self, chunk_tokens: Any, prefix_tokens: Any) -> float:
        """Seconds for one step running all the given chunks (the fixed cost charged once).

        Examples
        --------
        >>> QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005).step_time([1000, 500], [0, 2000])
        3126.0
        """
        w = np.asarray(self.work(chunk_tokens, prefix_tokens), dtype=np.float64)
        return float(self.a + w.sum())

    def quota(self, remaining_tokens: Any, prefix_tokens: Any) -> Any:
        """Compute quota of a request: the work of its remaining tokens, without the fixed cost.

        With ``q == k/2`` this equals the summed work of any chunking of the remaining tokens
        (ignoring ``gamma``, which is charged per chunk), so a balancer can count it at arrival.

        Examples
        --------
        >>> cost = QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005)
        >>> cost.quota(1000, 0) == cost.work(600, 0) + cost.work(400, 600)
        True
        """
        return self.work(remaining_tokens, prefix_tokens)

    def solve_chunk(
        self,
        budget_s: Any,
        prefix_tokens: Any,
        *,
        align: int = 1,
        min_chunk: int = 0,
        max_chunk: int | None = None,
    ) -> Any:
        """Largest integer chunk ``c`` with ``predict(c, prefix_tokens) <= budget_s``.

        With ``B = budget_s - a - gamma*p`` and ``beta = b + k*p`` the real root is
        ``c* = 2B / (beta + sqrt(beta^2 + 4qB))`` (the stable form: no cancellation when ``q``
        is small); ``B <= 0`` gives 0. The floor of ``c*`` is then corrected by exact evaluation,
        so rounding never returns a chunk that overruns the budget.

        Parameters
        ----------
        budget_s : float or array_like
            Time budget of the step, seconds (including the fixed cost ``a``).
        prefix_tokens : int or array_like
            Tokens already in KV before the chunk. Broadcasts against ``budget_s``.
        align : int, default 1
            Round the chunk down to a multiple of ``align`` tokens.
        min_chunk : int, default 0
            Return 0 instead of a chunk smaller than this.
        max_chunk : int, optional
            Cap the chunk at this many tokens.

        Returns
        -------
        int or ndarray of int64
            Chunk length in tokens.

        Runtime complexity: O(1) per element.

        Examples
        --------
        >>> cost = QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005)
        >>> cost.solve_chunk(1500.9, 0), cost.solve_chunk(1501.0, 0)
        (999, 1000)
        >>> cost.solve_chunk(1501.0, 0, align=64)
        960
        >>> cost.solve_chunk(0.5, 0)
        0
        """
        budget = as_float_array(budget_s, "budget_s")
        p = as_float_array(prefix_tokens, "prefix_tokens", nonnegative=True)
        align = check_int(align, "align", min_value=1)
        min_chunk = check_int(min_chunk, "min_chunk", min_value=0)
        if max_chunk is not None:
            max_chunk = check_int(max_chunk, "max_chunk", min_value=0)
        budget, p = np.broadcast_arrays(budget, p)
        slack = budget - self.a - self.gamma * p
        beta = self.b + self.k * p
        with np.errstate(divide="ignore", invalid="ignore"):
            root = 2.0 * slack / (beta + np.sqrt(beta * beta + 4.0 * self.q * slack))
        root = np.where(slack > 0, root, 0.0)
        c = np.floor(np.minimum(root, 2.0**62)).astype(np.int64)
        # Exact correction of floating-point rounding: at most a step or two either way.
        for _ in range(3):
            up = (self._total(c + 1, p) <= budget) & (slack > 0)
            c = np.where(up, c + 1, c)
        for _ in range(3):
            down = (c > 0) & (self._total(c, p) > budget)
            c = np.where(down, c - 1, c)
        if max_chunk is not None:
            c = np.minimum(c, max_chunk)
        c = (c // align) * align
        c = np.where(c < min_chunk, 0, c)
        return _scalar_or_array(c)

    def _total(self, c: np.ndarray, p: np.ndarray) -> np.ndarray:
        cf = c.astype(np.float64)
        return self.a + cf * (self.b + self.k * p + self.q * cf) + self.gamma * p

    @classmethod
    def fit(
        cls,
        chunk_tokens: Any,
        prefix_tokens: Any,
        seconds: Any,
        *,
        tied: bool = True,
        fit_gamma: bool = False,
    ) -> CostFit:
        """Fit the coefficients to measured single-chunk steps.

        Non-negative least squares (``scipy.optimize.nnls``) on rows weighted by ``1/seconds``,
        so that the fit minimises relative error (an unweighted fit is dominated by the longest
        steps and loses the fixed cost ``a``), with columns scaled to unit norm.

        Parameters
        ----------
        chunk_tokens, prefix_tokens, seconds : array_like, shape (n,)
            One measured step per row: chunk length (>= 1), prefix length (>= 0), and its
            duration in seconds (> 0).
        tied : bool, default True
            Impose ``q = k/2`` (causal attention); fits ``a, b, k``. Otherwise ``q`` is free.
        fit_gamma : bool, default False
            Also fit the per-cached-token cost ``gamma``.

        Returns
        -------
        CostFit
            The fitted :class:`QuadraticCost` and goodness of fit.

        Raises
        ------
        ValueError
            Fewer samples than parameters, mismatched lengths, non-finite data, empty chunks or
            non-positive durations, or data that determine no per-token cost.

        Examples
        --------
        >>> truth = QuadraticCost(a=0.01, b=1e-4, k=1e-8, q=5e-9)
        >>> c = np.array([64, 512, 2048, 8192, 100, 4000])
        >>> p = np.array([0, 1000, 0, 30000, 50000, 8000])
        >>> fitted = QuadraticCost.fit(c, p, truth.predict(c, p))
        >>> round(fitted.cost.a, 6), round(fitted.cost.b / 1e-4, 6), round(fitted.rel_rmse, 9)
        (0.01, 1.0, 0.0)
        """
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
        names = ["a", "b", "k"]
        cols = [np.ones_like(c), c, c * p + (0.5 * c * c if tied else 0.0)]
        if not tied:
            names.append("q")
            cols.append(c * c)
        if fit_gamma:
            names.append("gamma")
            cols.append(p)
        n = c.shape[0]
        if n < len(names):
            raise ValueError(
                f"seconds: need at least {len(names)} samples to fit {', '.join(names)}, got {n}"
            )
        from scipy.optimize import nnls  # imported here: routers that never fit stay light

        design = np.stack(cols, axis=1) / t[:, None]
        scale = np.linalg.norm(design, axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(design / scale, np.ones(n))
        coef = coef / scale
        params = dict(zip(names, coef.tolist(), strict=True))
        params.setdefault("gamma", 0.0)
        if tied:
            params["q"] = params["k"] / 2.0
        if params["b"] == 0.0 and params["q"] == 0.0:
            raise ValueError(
                "chunk_tokens, seconds: the data determine no per-token cost (fitted b = q = 0)"
            )
        cost = cls(**params)
        pred = np.asarray(cost.predict(c, p), dtype=np.float64)
        rel = pred / t - 1.0
        log_t = np.log(t)
        ss_res = float(((np.log(pred) - log_t) ** 2).sum())
        ss_tot = float(((log_t - log_t.mean()) ** 2).sum())
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
        return CostFit(
            cost=cost,
            rel_rmse=float(np.sqrt((rel**2).mean())),
            max_rel_error=float(np.abs(rel).max()),
            r_squared_log=r2,
            num_samples=n,
        )


class CostFit(NamedTuple):
    """Result of :meth:`QuadraticCost.fit`.

    Attributes
    ----------
    cost : QuadraticCost
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


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """Decode step cost of one rank with ``B`` requests holding ``S`` KV tokens.

    ``combine="sum"``: ``T = a + b*B + k*S``; ``combine="max"``: ``T = a + max(b*B, k*S)``
    (two micro-batches overlap attention against MoE and communication).

    Parameters
    ----------
    a : float
        Fixed cost of a step, seconds.
    b : float
        Seconds per running request.
    k : float
        Seconds per KV token attended.
    combine : {"sum", "max"}, default "sum"

    Examples
    --------
    >>> DecodeCost(a=1.0, b=1.0, k=0.001).step_time(10, 5000)
    16.0
    >>> DecodeCost(a=1.0, b=1.0, k=0.001, combine="max").step_time([10, 2], [5000, 100])
    array([11.,  3.])
    """

    a: float
    b: float
    k: float
    combine: str = "sum"

    def __post_init__(self) -> None:
        for field in ("a", "b", "k"):
            object.__setattr__(self, field, check_real(getattr(self, field), field, min_value=0.0))
        check_choice(self.combine, "combine", ("sum", "max"))

    def step_time(self, num_requests: Any, kv_tokens: Any) -> Any:
        """Seconds of one decode step; vectorised over ranks (arguments broadcast)."""
        n = as_float_array(num_requests, "num_requests", nonnegative=True)
        s = as_float_array(kv_tokens, "kv_tokens", nonnegative=True)
        if self.combine == "sum":
            t = self.a + self.b * n + self.k * s
        else:
            t = self.a + np.maximum(self.b * n, self.k * s)
        return _scalar_or_array(t)

    def with_combine(self, combine: str) -> DecodeCost:
        """The same coefficients with another combiner."""
        return DecodeCost(self.a, self.b, self.k, combine)


class CostPreset(NamedTuple):
    """A named pair of prefill and decode cost models."""

    prefill: QuadraticCost
    decode: DecodeCost


#: Built-in cost presets. ``h800_dsv3`` is *derived* from public DeepSeek-V3 hyper-parameters and
#: published throughput (per GPU), not measured; replace it by :meth:`QuadraticCost.fit` on your
#: own step timings. ``unit`` has round numbers for tests (attention overtakes linear work at
#: 2,000 tokens).
PRESETS: Mapping[str, CostPreset] = MappingProxyType(
    {
        "h800_dsv3": CostPreset(
            prefill=QuadraticCost(a=10e-3, b=146e-6, k=11.1e-9, q=5.55e-9),
            decode=DecodeCost(a=5e-3, b=0.25e-3, k=23.4e-9),
        ),
        "unit": CostPreset(
            prefill=QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005),
            decode=DecodeCost(a=1.0, b=1.0, k=0.001),
        ),
    }
)


def preset(name: str) -> CostPreset:
    """Return the built-in cost preset ``name`` (see :data:`PRESETS`).

    Examples
    --------
    >>> preset("h800_dsv3").prefill.a
    0.01
    >>> preset("h100")
    Traceback (most recent call last):
    ...
    ValueError: name: must be one of 'h800_dsv3', 'unit'; got 'h100'
    """
    return PRESETS[check_choice(name, "name", tuple(PRESETS))]
