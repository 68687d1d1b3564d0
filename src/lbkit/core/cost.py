"""Step-cost models of prefill and decode ranks.

A prefill rank that runs chunks ``c_i`` (new tokens) on top of prefixes ``p_i`` (tokens already
in KV cache) in one step has *local* work

.. math::

    L = \\sum_i \\left(b c_i + k c_i p_i + q c_i^2 + \\gamma p_i\\right)

seconds: linear work ``b`` per token on the rank's own tokens (MLA projections, norms, shared
expert, dense layers), attention ``k`` per (new, cached) token pair and ``q`` per new-token pair,
and an optional cost ``gamma`` per cached token read. Causal attention gives the physical tie
``q = k/2``; under it the local work of a request does not depend on how it is chunked, which is
what makes its *quota* (local work) a property of the request.

The routed experts of an expert-parallel MoE run on the tokens of *every* rank of the engine
(all-to-all), balanced by EPLB, not by the router: a rank of an engine of ``R`` ranks pays
``shared = b_moe * moe_lb * sum_r C_r / R`` per step, ``C_r`` being the tokens rank ``r`` runs.
Rank ``r`` takes ``T_r = a + L_r + shared`` (``a``: fixed cost of a step) and the engine's
synchronous step takes ``max_r T_r``. With ``b_moe = 0`` (the default) this is the plain model
``a + L``.

A decode rank with ``B`` requests holding ``S`` KV tokens has local work ``b_d*B + k_d*S``
(``combine="sum"``) or ``max(b_d*B, k_d*S)`` (``combine="max"``: two micro-batches overlap
attention with MoE and communication), and pays ``b_d_moe * moe_lb * sum_r B_r / R`` shared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from lbkit.core._fit import CostFit
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


def _check_moe(obj: Any) -> None:
    """Validate the shared-cost fields ``b_moe >= 0`` and ``moe_lb >= 1`` in place."""
    object.__setattr__(obj, "b_moe", check_real(obj.b_moe, "b_moe", min_value=0.0))
    object.__setattr__(obj, "moe_lb", check_real(obj.moe_lb, "moe_lb", min_value=1.0))


def _per_rank(value: Any, name: str) -> np.ndarray:
    """A non-negative array with ranks on its first axis (at least one rank)."""
    x = as_float_array(value, name, nonnegative=True)
    if x.ndim not in (1, 2) or x.shape[0] == 0:
        raise ValueError(
            f"{name}: must have shape (ranks,) or (ranks, chunks) with at least one rank, "
            f"got shape {x.shape}"
        )
    return x


def _shared_s(s_per_unit: float, total: Any, num_ranks: Any, name: str) -> Any:
    t = as_float_array(total, name, nonnegative=True)
    r = as_float_array(num_ranks, "num_ranks")
    if (r < 1).any() or (r != np.floor(r)).any():
        raise ValueError("num_ranks: must be whole numbers >= 1")
    return _scalar_or_array(s_per_unit * t / r)


@dataclass(frozen=True, slots=True)
class QuadraticCost:
    """Prefill step cost: local ``a + sum_i (b c_i + k c_i p_i + q c_i^2 + gamma p_i)`` plus the
    shared routed-expert cost ``b_moe * moe_lb * (engine tokens) / R``.

    Parameters
    ----------
    a : float
        Fixed cost of one step, seconds.
    b : float
        Local seconds per new token (MLA projections, norms, shared expert, dense layers: work
        on the rank's own tokens). Before ``b_moe`` existed this also held the MoE cost.
    k : float
        Seconds per (new token, cached token) attention pair.
    q : float
        Seconds per (new token, new token) pair; ``k / 2`` for causal attention.
    gamma : float, default 0
        Seconds per cached token read by a scheduled chunk.
    b_moe : float, default 0
        Routed-expert seconds per token as if one GPU did all of it; with expert parallelism
        over ``R`` ranks every rank pays ``b_moe * moe_lb * sum_r C_r / R`` per step.
    moe_lb : float, default 1
        EPLB imbalance ``max GPU load / mean GPU load`` of the routed experts (>= 1).

    All coefficients are finite and non-negative, ``moe_lb >= 1``, and ``b``, ``b_moe`` or ``q``
    is positive so that a chunk's cost grows with its length (otherwise no time budget bounds
    the chunk).

    Notes
    -----
    :meth:`work` and :meth:`quota` count local work only: the work a router can move.
    :meth:`predict`, :meth:`step_time` and :meth:`solve_chunk` plan one rank's step for a
    *balanced* engine (every rank runs as many tokens as this one), so their linear coefficient
    is :attr:`linear_s_per_token` ``= b + b_moe * moe_lb``. :meth:`rank_step_s` and
    :meth:`engine_step_s` price one step of a whole engine from every rank's chunks.

    Examples
    --------
    >>> cost = QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005)
    >>> cost.predict(1000, 0)
    1501.0
    >>> cost.quota(1000, 0)
    1500.0
    >>> cost.solve_chunk(1501.0, 0)
    1000
    >>> moe = QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005, b_moe=0.4, moe_lb=1.25)
    >>> moe.moe_s_per_token, moe.predict(1000, 0), moe.quota(1000, 0)
    (0.5, 2001.0, 1500.0)
    >>> moe.engine_step_s([1000, 0], [0, 0])  # rank 0 pays 1500 local, both pay 250 shared
    1751.0
    """

    a: float
    b: float
    k: float
    q: float
    gamma: float = 0.0
    b_moe: float = 0.0
    moe_lb: float = 1.0

    def __post_init__(self) -> None:
        for field in ("a", "b", "k", "q", "gamma"):
            object.__setattr__(self, field, check_real(getattr(self, field), field, min_value=0.0))
        _check_moe(self)
        if self.b == 0.0 and self.q == 0.0 and self.b_moe == 0.0:
            raise ValueError(
                "b, b_moe, q: at least one must be > 0 so that a chunk's cost grows with it"
            )

    @property
    def tied(self) -> bool:
        """Whether ``q == k/2`` (causal attention), so quota is independent of chunking."""
        return math.isclose(self.q, self.k / 2.0, rel_tol=1e-9, abs_tol=0.0)

    @property
    def moe_s_per_token(self) -> float:
        """Effective shared seconds per token of the engine, ``b_moe * moe_lb``."""
        return self.b_moe * self.moe_lb

    @property
    def linear_s_per_token(self) -> float:
        """Linear seconds per token of a rank in a balanced engine, ``b + b_moe * moe_lb``."""
        return self.b + self.moe_s_per_token

    def work(self, chunk_tokens: Any, prefix_tokens: Any) -> Any:
        """Local variable cost of one chunk (no fixed cost ``a``, no shared cost); 0 if empty.

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

        The rank assumes a balanced engine, so it pays ``moe_s_per_token`` per token of its own
        chunk on top of :meth:`work`. Vectorised elementwise (each element is its own step). See
        :meth:`step_time` for one step that runs several chunks.

        Examples
        --------
        >>> QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005).predict([1000, 2000], [0, 1000])
        array([1501., 6001.])
        """
        c = as_float_array(chunk_tokens, "chunk_tokens", nonnegative=True)
        w = np.asarray(self.work(c, prefix_tokens), dtype=np.float64)
        return _scalar_or_array(self.a + w + self.moe_s_per_token * c)

    def step_time(self, chunk_tokens: Any, prefix_tokens: Any) -> float:
        """Seconds for one step of a rank running all the given chunks, in a balanced engine.

        The fixed cost is charged once; the shared cost is ``moe_s_per_token`` per token run.

        Examples
        --------
        >>> QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005).step_time([1000, 500], [0, 2000])
        3126.0
        """
        c = as_float_array(chunk_tokens, "chunk_tokens", nonnegative=True)
        w = np.asarray(self.work(c, prefix_tokens), dtype=np.float64)
        return float(self.a + w.sum() + self.moe_s_per_token * c.sum())

    def shared_s(self, total_chunk_tokens: Any, num_ranks: Any) -> Any:
        """Shared routed-expert seconds every rank pays, ``b_moe * moe_lb * total / num_ranks``.

        Parameters
        ----------
        total_chunk_tokens : float or array_like
            New tokens run by all ranks of the engine in the step (``sum_r C_r``), >= 0.
        num_ranks : int or array_like of int
            Ranks of the engine (expert-parallel degree), >= 1. Broadcasts.

        Examples
        --------
        >>> QuadraticCost(a=1.0, b=0.5, k=0.0, q=0.0, b_moe=0.4, moe_lb=1.25).shared_s(800, 8)
        50.0
        """
        return _shared_s(self.moe_s_per_token, total_chunk_tokens, num_ranks, "total_chunk_tokens")

    def rank_step_s(self, chunk_tokens: Any, prefix_tokens: Any) -> np.ndarray:
        """Time ``T_r = a + local_r + shared`` of every rank of one engine step.

        Parameters
        ----------
        chunk_tokens : array_like, shape (ranks,) or (ranks, chunks)
            New tokens of each chunk run by each rank (one chunk per rank, or several per rank,
            zero-padded). 0 is an idle rank (or slot): it still takes part in the step's
            all-to-all, so it pays ``a + shared``.
        prefix_tokens : array_like
            Cached tokens before each chunk; broadcasts against ``chunk_tokens``.

        Returns
        -------
        ndarray of float64, shape (ranks,)
            Seconds of each rank; ``shared = b_moe * moe_lb * chunk_tokens.sum() / ranks``.

        Runtime complexity: O(ranks × chunks).

        Examples
        --------
        >>> cost = QuadraticCost(a=1.0, b=0.5, k=0.0, q=0.0, b_moe=0.4, moe_lb=1.25)
        >>> cost.rank_step_s([[100, 60], [40, 0]], 0)  # 200 tokens: shared = 0.5 * 200 / 2
        array([131., 71.])
        """
        c = _per_rank(chunk_tokens, "chunk_tokens")
        p = as_float_array(prefix_tokens, "prefix_tokens", nonnegative=True)
        try:
            fits = np.broadcast_shapes(c.shape, p.shape) == c.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"prefix_tokens: must broadcast to the shape of chunk_tokens {c.shape}, "
                f"got shape {p.shape}"
            )
        p = np.broadcast_to(p, c.shape)
        w = np.asarray(self.work(c, p), dtype=np.float64).reshape(c.shape[0], -1).sum(axis=1)
        return self.a + w + self.moe_s_per_token * c.sum() / c.shape[0]

    def engine_step_s(self, chunk_tokens: Any, prefix_tokens: Any) -> float:
        """Seconds of one synchronous engine step, ``max_r (a + local_r) + shared``.

        Same arguments as :meth:`rank_step_s`, of which this is the maximum.

        Examples
        --------
        >>> cost = QuadraticCost(a=1.0, b=0.5, k=0.0, q=0.0, b_moe=0.4, moe_lb=1.25)
        >>> cost.engine_step_s([[100, 60], [40, 0]], 0)
        131.0
        >>> cost.engine_step_s([100, 100], 0) == cost.predict(100, 0)  # balanced: as planned
        True
        """
        return float(self.rank_step_s(chunk_tokens, prefix_tokens).max())

    def quota(self, remaining_tokens: Any, prefix_tokens: Any) -> Any:
        """Compute quota of a request: the local work of its remaining tokens.

        The quota leaves out the fixed cost and the shared routed-expert cost (which EPLB, not
        the router, spreads over the engine): it is the work a router can move. With
        ``q == k/2`` it equals the summed work of any chunking of the remaining tokens (ignoring
        ``gamma``, which is charged per chunk), so a balancer can count it at arrival.

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

        The rank plans for a balanced engine: its linear coefficient is
        ``b + b_moe * moe_lb``. With ``B = budget_s - a - gamma*p`` and
        ``beta = b + b_moe*moe_lb + k*p`` the real root is
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
        beta = self.linear_s_per_token + self.k * p
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
        """``predict`` of chunks ``c >= 1``, evaluated in the same order (bit-identical)."""
        cf = c.astype(np.float64)
        w = cf * (self.b + self.k * p + self.q * cf) + self.gamma * p
        return self.a + w + self.moe_s_per_token * cf

    @classmethod
    def fit(
        cls,
        chunk_tokens: Any,
        prefix_tokens: Any,
        seconds: Any,
        *,
        tied: bool = True,
        fit_gamma: bool = False,
        engine_tokens: Any = None,
        num_ranks: Any = None,
        moe_lb: float = 1.0,
    ) -> CostFit:
        """Fit the coefficients to measured steps.

        Non-negative least squares (``scipy.optimize.nnls``) on rows weighted by ``1/seconds``,
        so that the fit minimises relative error (an unweighted fit is dominated by the longest
        steps and loses the fixed cost ``a``), with columns scaled to unit norm.

        Parameters
        ----------
        chunk_tokens, prefix_tokens, seconds : array_like, shape (n,)
            One measured step per row: this rank's chunk length (>= 1), its prefix length
            (>= 0), and the rank's duration in seconds (> 0).
        tied : bool, default True
            Impose ``q = k/2`` (causal attention); fits ``a, b, k``. Otherwise ``q`` is free.
        fit_gamma : bool, default False
            Also fit the per-cached-token cost ``gamma``.
        engine_tokens : array_like, shape (n,), optional
            New tokens run by the whole engine in each step (this rank's chunk included, so
            ``>= chunk_tokens``). Adds the column ``engine_tokens / num_ranks`` whose coefficient
            is ``b_moe * moe_lb``, splitting the linear cost into local ``b`` and shared
            ``b_moe``. The samples must include imbalanced steps (this rank's chunk unlike the
            engine's mean chunk), or the two cannot be told apart. Without it ``b`` holds all of
            the linear cost and ``b_moe = 0``.
        num_ranks : int or array_like of int, shape (n,), optional
            Ranks of the engine in each step; required with ``engine_tokens``.
        moe_lb : float, default 1
            EPLB imbalance of the measured engine: the fit reports
            ``b_moe = coefficient / moe_lb`` and this ``moe_lb``.

        Returns
        -------
        CostFit
            The fitted :class:`QuadraticCost` and goodness of fit.

        Raises
        ------
        ValueError
            Fewer samples than parameters, mismatched lengths, non-finite data, empty chunks or
            non-positive durations, ``engine_tokens < chunk_tokens``, an engine column that the
            other columns explain (balanced samples only), or data that determine no per-token
            cost.

        Examples
        --------
        >>> truth = QuadraticCost(a=0.01, b=1e-4, k=1e-8, q=5e-9)
        >>> c = np.array([64, 512, 2048, 8192, 100, 4000])
        >>> p = np.array([0, 1000, 0, 30000, 50000, 8000])
        >>> fitted = QuadraticCost.fit(c, p, truth.predict(c, p))
        >>> round(fitted.cost.a, 6), round(fitted.cost.b / 1e-4, 6), round(fitted.rel_rmse, 9)
        (0.01, 1.0, 0.0)

        Splitting local and shared cost from steps of an 8-rank engine:

        >>> truth = QuadraticCost(a=0.01, b=4e-5, k=1e-8, q=5e-9, b_moe=6e-5, moe_lb=1.1)
        >>> engine = np.array([512, 20000, 16384, 8192, 40000, 4000])
        >>> seconds = truth.predict(c, p) + truth.shared_s(engine, 8) - truth.shared_s(8 * c, 8)
        >>> fitted = QuadraticCost.fit(c, p, seconds, engine_tokens=engine, num_ranks=8,
        ...                            moe_lb=1.1).cost
        >>> round(fitted.b / 1e-5, 6), round(fitted.b_moe / 1e-5, 6), fitted.moe_lb
        (4.0, 6.0, 1.1)
        """
        from lbkit.core._fit import fit_quadratic  # the fitting code lives apart from the model

        return fit_quadratic(
            cls,
            chunk_tokens,
            prefix_tokens,
            seconds,
            tied=tied,
            fit_gamma=fit_gamma,
            engine_tokens=engine_tokens,
            num_ranks=num_ranks,
            moe_lb=moe_lb,
        )


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """Decode step cost of one rank with ``B`` requests holding ``S`` KV tokens.

    Local work ``b*B + k*S`` (``combine="sum"``) or ``max(b*B, k*S)`` (``combine="max"``: two
    micro-batches overlap attention against MoE and communication); every rank of an engine of
    ``R`` ranks also pays the shared routed-expert cost ``b_moe * moe_lb * sum_r B_r / R``.
    Rank time ``T_r = a + local_r + shared``; the engine's step takes ``max_r T_r``.

    Parameters
    ----------
    a : float
        Fixed cost of a step, seconds.
    b : float
        Local seconds per running request (its token's MLA projections, dense layers, shared
        expert, LM head, and its side of the all-to-all).
    k : float
        Seconds per KV token attended.
    combine : {"sum", "max"}, default "sum"
    b_moe : float, default 0
        Routed-expert seconds per request as if one GPU did all of it.
    moe_lb : float, default 1
        EPLB imbalance ``max GPU load / mean GPU load`` of the routed experts (>= 1).

    Examples
    --------
    >>> DecodeCost(a=1.0, b=1.0, k=0.001).step_time(10, 5000)
    16.0
    >>> DecodeCost(a=1.0, b=1.0, k=0.001, combine="max").step_time([10, 2], [5000, 100])
    array([11.,  3.])
    >>> moe = DecodeCost(a=1.0, b=1.0, k=0.001, b_moe=0.5, moe_lb=1.2)
    >>> moe.step_time(10, 5000), moe.engine_step_s([10, 2], [5000, 100])  # shared 0.6 * 12 / 2
    (22.0, 19.6)
    """

    a: float
    b: float
    k: float
    combine: str = "sum"
    b_moe: float = 0.0
    moe_lb: float = 1.0

    def __post_init__(self) -> None:
        for field in ("a", "b", "k"):
            object.__setattr__(self, field, check_real(getattr(self, field), field, min_value=0.0))
        check_choice(self.combine, "combine", ("sum", "max"))
        _check_moe(self)

    @property
    def moe_s_per_token(self) -> float:
        """Effective shared seconds per request (one token each) of the engine, ``b_moe*moe_lb``."""
        return self.b_moe * self.moe_lb

    def _local(self, n: np.ndarray, s: np.ndarray) -> np.ndarray:
        if self.combine == "sum":
            return self.b * n + self.k * s
        return np.maximum(self.b * n, self.k * s)

    def step_time(self, num_requests: Any, kv_tokens: Any) -> Any:
        """Seconds of one decode step of a rank in a balanced engine; vectorised over ranks.

        Each element is a rank whose engine's ranks all run as many requests as it does, so its
        shared cost is ``b_moe * moe_lb * num_requests``: ``a + local + b_moe*moe_lb*B``.
        Arguments broadcast. See :meth:`engine_step_s` for an engine of unequal ranks.
        """
        n = as_float_array(num_requests, "num_requests", nonnegative=True)
        s = as_float_array(kv_tokens, "kv_tokens", nonnegative=True)
        return _scalar_or_array(self.a + self._local(n, s) + self.moe_s_per_token * n)

    def shared_s(self, total_requests: Any, num_ranks: Any) -> Any:
        """Shared seconds every rank pays, ``b_moe * moe_lb * total_requests / num_ranks``.

        Examples
        --------
        >>> DecodeCost(a=1.0, b=1.0, k=0.0, b_moe=0.5, moe_lb=1.2).shared_s([64, 640], 64)
        array([0.6, 6. ])
        """
        return _shared_s(self.moe_s_per_token, total_requests, num_ranks, "total_requests")

    def rank_step_s(self, num_requests: Any, kv_tokens: Any) -> np.ndarray:
        """Time ``T_r = a + local_r + shared`` of every rank of one engine step.

        Parameters
        ----------
        num_requests : array_like, shape (ranks,)
            Running requests ``B_r`` of each rank (at least one rank).
        kv_tokens : array_like, shape (ranks,)
            KV tokens ``S_r`` they hold; broadcasts against ``num_requests``.

        Returns
        -------
        ndarray of float64, shape (ranks,)

        Runtime complexity: O(ranks).

        Examples
        --------
        >>> DecodeCost(a=1.0, b=1.0, k=0.001, b_moe=0.5, moe_lb=1.2).rank_step_s([10, 2], 0)
        array([14.6,  6.6])
        """
        n = _per_rank(num_requests, "num_requests")
        if n.ndim != 1:
            raise ValueError(f"num_requests: must have shape (ranks,), got shape {n.shape}")
        s = as_float_array(kv_tokens, "kv_tokens", nonnegative=True)
        if s.ndim > 1 or (s.ndim == 1 and s.shape != n.shape and s.shape != (1,)):
            raise ValueError(
                f"kv_tokens: must broadcast to the shape of num_requests {n.shape}, "
                f"got shape {s.shape}"
            )
        s = np.broadcast_to(s, n.shape)
        return self.a + self._local(n, s) + self.moe_s_per_token * n.sum() / n.shape[0]

    def engine_step_s(self, num_requests: Any, kv_tokens: Any) -> float:
        """Seconds of one synchronous engine step, ``max_r (a + local_r) + shared``.

        Same arguments as :meth:`rank_step_s`, of which this is the maximum.

        Examples
        --------
        >>> cost = DecodeCost(a=1.0, b=1.0, k=0.001, b_moe=0.5, moe_lb=1.2)
        >>> cost.engine_step_s([10, 2], [0, 0])
        14.6
        >>> cost.engine_step_s([4, 4], [800, 800]) == cost.step_time(4, 800)
        True
        """
        return float(self.rank_step_s(num_requests, kv_tokens).max())

    def with_combine(self, combine: str) -> DecodeCost:
        """The same coefficients (shared cost included) with another combiner."""
        return replace(self, combine=combine)


class CostPreset(NamedTuple):
    """A named pair of prefill and decode cost models."""

    prefill: QuadraticCost
    decode: DecodeCost


#: Built-in cost presets. ``h800_dsv3`` is *derived* from public DeepSeek-V3 hyper-parameters and
#: published throughput (per GPU), not measured: the linear cost is split into local ``b`` and
#: shared routed-expert ``b_moe`` in proportion to the work per token of each part, with
#: ``moe_lb`` measured by :func:`lbkit.eplb.rebalance_experts` on SGLang's DeepSeek-V3 expert
#: loads (docs/cost-model.md has the derivation); replace it by :meth:`QuadraticCost.fit` on your
#: own step timings. ``unit`` has round numbers for tests (attention overtakes linear work at
#: 2,000 tokens) and no shared cost.
PRESETS: Mapping[str, CostPreset] = MappingProxyType(
    {
        "h800_dsv3": CostPreset(
            prefill=QuadraticCost(
                a=10e-3, b=62.4e-6, k=11.1e-9, q=5.55e-9, b_moe=81.1e-6, moe_lb=1.03
            ),
            decode=DecodeCost(a=5e-3, b=0.123e-3, k=23.4e-9, b_moe=0.124e-3, moe_lb=1.03),
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
