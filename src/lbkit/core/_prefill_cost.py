"""The prefill step-cost model :class:`QuadraticCost`.

Part of :mod:`lbkit.core.cost` (import :class:`QuadraticCost` from there), whose docstring
states the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lbkit.core._cost_common import check_moe, per_rank, scalar_or_array, shared_s_of
from lbkit.core._fit import CostFit
from lbkit.core.validation import as_float_array, check_int, check_real

__all__ = ["MAX_CHUNK", "QuadraticCost"]

#: The largest chunk :meth:`QuadraticCost.solve_chunk` returns, tokens (far beyond any prompt;
#: keeps ``chunk + 1`` and the solver's float conversions exact within int64).
MAX_CHUNK = 2**62


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
        check_moe(self)
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
        return scalar_or_array(np.where(c > 0, w, 0.0))

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
        return scalar_or_array(self.a + w + self.moe_s_per_token * c)

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
        return shared_s_of(
            self.moe_s_per_token, total_chunk_tokens, num_ranks, "total_chunk_tokens"
        )

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
        c = per_rank(chunk_tokens, "chunk_tokens")
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
        so rounding never returns a chunk that overruns the budget: a few steps either way, and
        where those do not reach the largest fitting chunk (a per-token cost below about
        ``1e-15`` of the budget, where ``c*`` loses its precision), an integer bisection on the
        exact evaluation (``predict`` is non-decreasing in the chunk).

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
        c = np.floor(np.minimum(root, float(MAX_CHUNK))).astype(np.int64)
        # Exact correction of floating-point rounding: at most a step or two either way.
        for _ in range(3):
            up = (self._total(c + 1, p) <= budget) & (slack > 0)
            c = np.where(up, c + 1, c)
        for _ in range(3):
            down = (c > 0) & (self._total(c, p) > budget)
            c = np.where(down, c - 1, c)
        over = (c > 0) & (self._total(c, p) > budget)
        short = (slack > 0) & (c < MAX_CHUNK) & (self._total(c + 1, p) <= budget)
        wrong = over | short
        if wrong.any():
            c = c.copy()
            c[wrong] = self._bisect_chunk(budget[wrong], p[wrong])
        if max_chunk is not None:
            c = np.minimum(c, max_chunk)
        c = (c // align) * align
        c = np.where(c < min_chunk, 0, c)
        return scalar_or_array(c)

    def _bisect_chunk(self, budget: np.ndarray, p: np.ndarray) -> np.ndarray:
        """Largest ``c`` in ``[0, MAX_CHUNK]`` with ``_total(c, p) <= budget`` (0 if none), by
        bisection over the integers (63 evaluations)."""
        lo = np.zeros(budget.shape, dtype=np.int64)  # 0: no chunk, always possible
        hi = np.full(budget.shape, MAX_CHUNK + 1, dtype=np.int64)  # does not fit
        while (hi - lo > 1).any():
            mid = lo + (hi - lo) // 2
            fits = self._total(mid, p) <= budget
            lo = np.where(fits, mid, lo)
            hi = np.where(fits, hi, mid)
        return lo

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
