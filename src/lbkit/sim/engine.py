"""The engine model: a deterministic discrete-event replay of a prefill pool and a decode pool.

**Prefill pool.** ``num_engines`` engines of ``ranks_per_engine`` ranks. A request is routed at
its arrival by a prefill policy (:mod:`lbkit.sim.policies`) to one rank, where it joins a FIFO
queue and stays until its uncached tokens are prefilled. An engine with work steps
synchronously: at a step's start each rank plans its queue with the per-GPU plan of SPEC §2.5
(:func:`lbkit.prefill.plan_chunks` under the time budget ``budget_s``), and the step lasts as long
as the slowest rank's plan (``QuadraticCost``: fixed cost once, then the chunks' work). Chunks are
applied at the step's end; a request whose last token is prefilled then has its *time to first
token* (TTFT) and is handed to the decode pool at that instant. Requests routed during a step
wait for the next one; an engine that ends a step at the instant of an arrival starts its next
step after routing that arrival (ties between a step end and an arrival go to the arrival).

**Decode pool.** ``num_engines`` engines of ``ranks_per_engine`` ranks (default one engine of 64).
A request arriving from prefill is routed by a decode policy (:mod:`lbkit.sim.policies_decode`)
to a rank, with ``total_tokens`` KV tokens (its prompt), and joins at the engine's next step. One
synchronous step costs ``max_r DecodeCost.step_time(B_r, S_r)`` over the engine's ranks (``B_r``
requests holding ``S_r`` KV tokens; an idle rank still steps and pays the fixed cost); every
active request generates one token and its KV grows by one. A request with ``o`` output tokens
needs ``o - 1`` decode steps (prefill produced the first token); ``o = 1`` finishes at handover.

Time starts at the first arrival's time stamp as it is in the trace; nothing reads a clock.
Policies get every piece of information through a *view* (read-only arrays of the pool's state)
and a stream of events (finished requests, prefill progress), never the simulator's internals.

**Shared expert work** (SPEC §8). With expert parallelism the routed experts of an engine run on
the tokens of all its ``R`` ranks: a step in which rank ``r`` computes ``c_r`` tokens lasts
``max_r T_r`` with ``T_r = a + local_r + shared`` (``local_r`` the rank's own work, ``a`` only if it
computes anything) and ``shared = b_moe * moe_lb * sum_r c_r / R``, paid by every rank of the
engine, idle ones included. Ranks plan their chunks for a balanced engine (per-token linear cost
``b + b_moe * moe_lb``). ``b_moe = 0`` is the per-rank model of SPEC §2.5.

**Utilisation** (:func:`utilization_factor`): the prefill work of a trace is ``W = sum_i
(cost.quota(uncached_i, cached_i) + b_moe * moe_lb * uncached_i)`` rank-seconds (local plus
shared work, the fixed cost per step excluded); arrivals spanning ``D`` seconds offer ``W / (D *
N)`` to ``N`` prefill ranks. The trace is time-scaled by ``f = W / (U * N * D)`` so that this
offered utilisation (the pool's busy share) equals ``U``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lbkit.core.cost import DecodeCost, QuadraticCost
from lbkit.core.validation import as_rng, check_choice, check_int, check_real
from lbkit.sim import _kernels as K
from lbkit.sim.protocol import (
    BLOCK_TOKENS,
    PREFILL_KV_CAPACITY_TOKENS,
    DecodeView,
    PrefillView,
)
from lbkit.sim.traces import Trace

_NO_HASHES = np.zeros(0, dtype=np.int64)  # the block hashes of a trace without any
_NO_HASHES.setflags(write=False)

__all__ = [
    "DECODE_KV_CAPACITY_TOKENS",
    "DECODE_KV_WATERMARK_TOKENS",
    "PREFILL_KV_CAPACITY_TOKENS",
    "REFUSALS",
    "SHARING",
    "DecodeRun",
    "DecodeView",
    "PrefillRun",
    "PrefillView",
    "prefill_work_s",
    "scale_to_utilization",
    "simulate_decode",
    "simulate_prefill",
    "utilization_factor",
    "warmup",
]

#: Number of time bins of the balance-over-time series.
NUM_BINS = 200
#: Work-sharing modes of the prefill engines (see :func:`simulate_prefill`).
SHARING = ("off", "budget", "level", "split")


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillRun:
    """Outcome of :func:`simulate_prefill` (arrays in trace order).

    Attributes
    ----------
    policy : str
    trace : Trace
        The replayed trace (after any time scaling).
    num_engines, ranks_per_engine : int
    cost : QuadraticCost
    budget_s : float
    rank : ndarray of int64
        Flat rank of each request; -1 if refused.
    finish_s : ndarray of float64
        End of the step that finished its prefill (``nan``: refused or still in flight).
    alone_s : ndarray of float64
        Its prefill time alone on an idle rank under the same plan, alone in its engine (the
        shared expert work of its own tokens only), from the trace's ``cached_tokens`` whatever
        it hit where it ran: the slowdown denominator, the same for every policy.
    step_mean_s, step_max_s : float
        Sums over all engine steps of the mean and the max over the engine's ranks of the
        modelled rank time (the numerator and denominator of balance efficiency).
    num_steps, overruns : int
        Engine steps; rank plans over budget (progress guarantee).
    tokens_computed : int
        Prompt tokens prefilled (work conservation: the uncached tokens of finished requests plus
        the progress of requests in flight).
    rank_busy_s : ndarray, shape (ranks,)
        Modelled busy seconds of each rank.
    bin_s : float
        Width of the time bins of ``bin_mean_s`` / ``bin_max_s`` (per-bin sums as above).
    end_s : float
        Time at which the replay stopped (last step end, or the horizon).
    num_arrived : int
        Requests that arrived before the replay stopped (the first ``num_arrived`` of the trace).
    work_sharing : str
        The engines' work sharing (see :func:`simulate_prefill`).
    moves : int
        Requests that work sharing moved to another rank of their engine.
    busy_steps : ndarray of int64, shape (ranks_per_engine + 1,)
        Engine steps with ``k`` busy ranks (ranks with a non-empty plan), ``k = 0..R``.
    busy_mean_s, busy_max_s : ndarray, shape (ranks_per_engine + 1,)
        The balance sums (mean and max rank time) over the steps with ``k`` busy ranks.
    few_steps : int
        Steps of an engine that held fewer requests than it has ranks (some rank must idle
        whatever the plan, since a request runs on one rank).
    few_mean_s, few_max_s : float
        The balance sums over those steps.
    cached_tokens : ndarray of int64
        Cached prompt tokens of each request where it ran (with a ``rank_cache``, its hit on
        the rank it was admitted to; else, and for requests not routed, the trace's); the
        engines computed ``total_tokens - cached_tokens`` tokens of each finished request.
    """

    policy: str
    trace: Trace
    num_engines: int
    ranks_per_engine: int
    cost: QuadraticCost
    budget_s: float
    rank: np.ndarray
    finish_s: np.ndarray
    alone_s: np.ndarray
    step_mean_s: float
    step_max_s: float
    num_steps: int
    overruns: int
    tokens_computed: int
    rank_busy_s: np.ndarray
    bin_s: float
    bin_mean_s: np.ndarray
    bin_max_s: np.ndarray
    end_s: float
    num_arrived: int
    work_sharing: str = "off"
    moves: int = 0
    busy_steps: np.ndarray | None = None
    busy_mean_s: np.ndarray | None = None
    busy_max_s: np.ndarray | None = None
    few_steps: int = 0
    few_mean_s: float = 0.0
    few_max_s: float = 0.0
    cached_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.cached_tokens is None:
            object.__setattr__(self, "cached_tokens", self.trace.cached_tokens)

    @property
    def refused(self) -> np.ndarray:
        """Boolean mask of refused requests (arrived, not routed)."""
        return (self.rank < 0) & (np.arange(self.rank.shape[0]) < self.num_arrived)

    @property
    def finished(self) -> np.ndarray:
        """Boolean mask of requests whose prefill finished."""
        return ~np.isnan(self.finish_s)

    @property
    def ttft_s(self) -> np.ndarray:
        """Time to first token (``nan`` where not finished)."""
        return self.finish_s - self.trace.arrival_s


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeRun:
    """Outcome of :func:`simulate_decode` (arrays in trace order).

    Attributes
    ----------
    policy : str
    num_engines, ranks_per_engine : int
    cost : DecodeCost
    handover_s : ndarray
        Time each request entered decode (its prefill end; ``nan`` if it never did).
    rank : ndarray of int64
        Decode rank (-1: refused or never entered; -2: finished at handover, ``o = 1``).
    finish_s : ndarray
        End of the step that generated the last token (``nan``: not finished).
    output_tokens : ndarray of int64
    step_mean_s, step_max_s : float
        Balance-efficiency sums over engine steps (modelled rank times).
    step_time_s : float
        Sum of step durations (time-weighting of the imbalances).
    count_imbalance_s, kv_imbalance_s : float
        Sums over steps of ``duration * max_r B_r / mean_r B_r`` (and for ``S_r``).
    count_floor_s : float
        Sum over steps of ``duration * ceil(mean_r B_r) / mean_r B_r``: the smallest count
        imbalance integer request counts allow.
    num_steps, tokens_generated : int
    bin_s : float
    bin_mean_s, bin_max_s : ndarray
    end_s : float
    window_s : (float, float) or None
        The measurement window of ``window_sums``.
    window_sums : ndarray or None
        Over the steps starting in the window, the sums above in the order of
        ``_kernels.DACC_*``: mean and max rank time, duration, count and KV imbalance, count
        floor, steps and tokens generated (see :func:`lbkit.sim.metrics.decode_metrics`).
    migrations : int
        Moves of running requests the policy made (see the protocol's ``migrations``).
    migration_s : float
        Sum of their KV transfer times (requests in transit do not decode).
    wait_s : ndarray or None
        Seconds each request spent in the wait queue (back-pressure; preempted time included).
    refusal : ndarray of int8 or None
        Refusal code of each request: 0 none, else ``REFUSALS[code - 1]`` (``None``: a run
        without codes, where ``rank == -1`` means refused).
    preemptions : int
        Running requests preempted back to the wait queue because KV growth filled their rank.
    kv_capacity_tokens : int or None
        Per-rank KV capacity of the run.
    """

    policy: str
    num_engines: int
    ranks_per_engine: int
    cost: DecodeCost
    handover_s: np.ndarray
    rank: np.ndarray
    finish_s: np.ndarray
    output_tokens: np.ndarray
    step_mean_s: float
    step_max_s: float
    step_time_s: float
    count_imbalance_s: float
    kv_imbalance_s: float
    count_floor_s: float
    num_steps: int
    tokens_generated: int
    bin_s: float
    bin_mean_s: np.ndarray
    bin_max_s: np.ndarray
    end_s: float
    window_s: tuple[float, float] | None = None
    window_sums: np.ndarray | None = None
    migrations: int = 0
    migration_s: float = 0.0
    wait_s: np.ndarray | None = None
    refusal: np.ndarray | None = None
    preemptions: int = 0
    kv_capacity_tokens: int | None = None

    @property
    def arrived(self) -> np.ndarray:
        """Requests that reached the decode pool."""
        return ~np.isnan(self.handover_s)

    @property
    def refused(self) -> np.ndarray:
        """Requests refused: they could never fit an empty rank (see ``refusal``)."""
        if self.refusal is not None:
            return self.arrived & (self.refusal > 0)
        return self.arrived & (self.rank == -1)

    @property
    def refused_by_reason(self) -> dict[str, int]:
        """Refused requests counted by reason (``REFUSALS``), reasons that occurred only."""
        if self.refusal is None:
            return {}
        counts = np.bincount(self.refusal[self.arrived], minlength=len(REFUSALS) + 1)
        return {r: int(counts[j + 1]) for j, r in enumerate(REFUSALS) if counts[j + 1]}

    @property
    def finished(self) -> np.ndarray:
        """Requests that generated all their tokens."""
        return ~np.isnan(self.finish_s)

    @property
    def tpot_s(self) -> np.ndarray:
        """Time per output token after the first, ``(finish - handover) / (o - 1)`` (else nan)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            out = (self.finish_s - self.handover_s) / (self.output_tokens - 1)
        return np.where(self.output_tokens > 1, out, np.nan)


# ------------------------------------------------------------------------ utilisation
def prefill_work_s(trace: Trace, cost: QuadraticCost) -> np.ndarray:
    """Quota of every request: ``cost.quota(total - cached, cached)`` seconds of one rank.

    Local work only (what a router can move); the shared expert work is not in it.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace: must be a Trace, got {type(trace).__name__}")
    if not isinstance(cost, QuadraticCost):
        raise TypeError(f"cost: must be a QuadraticCost, got {type(cost).__name__}")
    return np.asarray(
        cost.quota(trace.total_tokens - trace.cached_tokens, trace.cached_tokens), dtype=np.float64
    ).reshape(-1)


def utilization_factor(
    trace: Trace, utilization: float, /, *, num_ranks: int, cost: QuadraticCost
) -> float:
    """Time-scaling factor ``f = W / (U * N * D)`` that makes the offered utilisation ``U``.

    ``W`` is the trace's prefill work in rank-seconds: its total quota (local work) plus the
    shared expert work ``b_moe * moe_lb`` per uncached token (which some rank of the engine
    runs), so that ``U`` is the pool's busy share; ``D`` is the span of its arrivals, ``N =
    num_ranks``. Multiplying every arrival by ``f`` makes ``W / (f D N) = U``.

    Raises
    ------
    ValueError
        ``utilization <= 0``, ``num_ranks < 1``, fewer than two distinct arrival times.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> t = Trace(arrival_s=[0.0, 10.0], total_tokens=[1000, 1000], output_tokens=[1, 1])
    >>> utilization_factor(t, 0.5, num_ranks=2, cost=PRESETS["unit"].prefill)
    300.0
    """
    u = check_real(utilization, "utilization", min_value=0.0, strict_min=True)
    n = check_int(num_ranks, "num_ranks", min_value=1)
    work = float(prefill_work_s(trace, cost).sum())
    work += _moe_s_per_token(cost) * float((trace.total_tokens - trace.cached_tokens).sum())
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) if len(trace) else 0.0
    if not span > 0:
        raise ValueError(
            "trace: arrivals must span a positive time to be scaled to a utilisation "
            f"(got {len(trace)} requests over {span} s)"
        )
    return work / (u * n * span)


def scale_to_utilization(
    trace: Trace, utilization: float, /, *, num_ranks: int, cost: QuadraticCost
) -> tuple[Trace, float]:
    """The trace time-scaled to offered prefill utilisation ``utilization``, and the factor.

    Arrivals are shifted to start at 0 before scaling.
    """
    f = utilization_factor(trace, utilization, num_ranks=num_ranks, cost=cost)
    shifted = trace.arrival_s - trace.arrival_s[0]
    return dataclasses.replace(trace, arrival_s=shifted * f), f


# ------------------------------------------------------------------------ prefill
def _moe_s_per_token(cost: QuadraticCost) -> float:
    """Effective shared seconds per token, ``b_moe * moe_lb`` (0 for a cost without them)."""
    return cost.moe_s_per_token


def _policy_of(policy: Any, table: Mapping[str, Callable[..., Any]], kind: str, *args, **kw):
    if isinstance(policy, str):
        if policy not in table:
            raise ValueError(
                f"policy: unknown {kind} policy {policy!r}; choose from {', '.join(table)}"
            )
        return policy, table[policy](*args, **kw)
    if not (hasattr(policy, "route") and hasattr(policy, "observe")):
        raise TypeError(
            f"policy: must be a {kind} policy name or an object with route() and observe(), "
            f"got {type(policy).__name__}"
        )
    return getattr(policy, "name", type(policy).__name__), policy


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.setflags(write=False)
    return v


def _horizon(horizon_s: Any) -> float:
    if horizon_s is None:
        return math.inf
    return check_real(horizon_s, "horizon_s", min_value=0.0)


def _prefill_iv(
    trace, num_engines, ranks_per_engine, cost, budget_s, min_chunk, align, report, share
):
    if not isinstance(trace, Trace):
        raise TypeError(f"trace: must be a Trace, got {type(trace).__name__}")
    e = check_int(num_engines, "num_engines", min_value=1)
    r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    if not isinstance(cost, QuadraticCost):
        raise TypeError(f"cost: must be a QuadraticCost, got {type(cost).__name__}")
    share = SHARING.index(check_choice(share, "work_sharing", SHARING))
    budget = check_real(budget_s, "budget_s", min_value=0.0, strict_min=True)
    min_chunk = check_int(min_chunk, "min_chunk", min_value=1)
    align = check_int(align, "align", min_value=1)
    report = check_real(report, "report_quantum", min_value=0.0, max_value=1.0)
    return e, r, budget, min_chunk, align, report, share


def simulate_prefill(
    trace: Trace,
    policy: Any,
    /,
    *,
    num_engines: int = 8,
    ranks_per_engine: int = 8,
    cost: QuadraticCost,
    budget_s: float = 1.0,
    min_chunk: int = 1,
    align: int = 1,
    report_quantum: float = 0.02,
    work_sharing: str = "off",
    cp_efficiency: float = 1.0,
    kv_capacity_tokens: int = PREFILL_KV_CAPACITY_TOKENS,
    rank_cache: Any = None,
    horizon_s: float | None = None,
    rng: np.random.Generator | int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> PrefillRun:
    """Replay ``trace`` through a prefill pool routed by ``policy``.

    Parameters
    ----------
    trace : Trace
        Requests in arrival order (times as they should be simulated; see
        :func:`scale_to_utilization`).
    policy : str or policy object
        A key of :data:`lbkit.sim.policies.PREFILL_POLICIES`, or an object with ``route`` and
        ``observe`` (see :mod:`lbkit.sim.policies`).
    num_engines, ranks_per_engine : int
        Pool shape (default 8 x 8, SPEC §8).
    cost : QuadraticCost
        Prefill step cost of one rank: local work, plus the shared expert work ``b_moe *
        moe_lb`` per token of the engine's step spread over its ranks (see the module notes;
        a cost without ``b_moe`` has none). Ranks plan for a balanced engine.
    budget_s : float, default 1.0
        Time budget ``tau`` of a rank's step plan.
    min_chunk, align : int
        Options of the plan (:func:`lbkit.prefill.plan_chunks`).
    report_quantum : float in [0, 1], default 0.02
        A request's prefill progress is reported to the policy when its remaining quota has
        fallen by at least this share of its initial quota since the last report (0: after every
        step); completions are always reported. Models engine progress reports and keeps the
        event stream short for long prompts.
    work_sharing : {"off", "budget", "level", "split"}, default "off"
        Engine-side sharing of un-started requests among an engine's ranks (late binding).
        ``"off"``: each rank plans its own FIFO queue (SPEC §2.5). ``"budget"``: at each
        step's start the engine pools the requests of its ranks that have not started and
        gives them, earliest first, to the rank with the least planned time (ties: lowest
        rank; a rank keeps its started request, planned first), whole while they fit the
        budget, then one partial chunk that fills the rank. ``"level"``: the same, with the
        step's budget (started requests included) lowered to the *level* ``T``: the largest
        step that the engine's requests fill on every rank, each giving at most ``T`` to one
        rank (``T = sum_i min(w_i, T) / R`` over the requests' remaining work ``w_i``); with
        fewer requests than ranks, ``T = sum_i w_i / R`` (short steps, so that new requests
        join soon). ``"split"``: ``"level"`` plus context parallelism, an optimistic model:
        ranks left idle help the ranks whose step is one partial prompt chunk, and a group of
        ``n`` ranks runs the largest chunk whose work split ``n`` ways fits the budget (the
        communication of context-parallel attention is not charged unless ``cp_efficiency``
        says so). A request that changes rank is reported to the policy as an ``EV_MOVE``
        event (``tokens`` = the new flat rank) before the step's progress.
    cp_efficiency : float in (0, 1], default 1.0
        Parallel efficiency of a ``"split"`` group: ``n`` ranks run a chunk ``n *
        cp_efficiency`` times as fast as one (a group that would not beat one rank does not
        form); 1 is free communication, 0.8 charges a fifth of the group's time to it.
    kv_capacity_tokens : int, default :data:`PREFILL_KV_CAPACITY_TOKENS`
        Per-rank KV capacity shown to policies (``PrefillView.kv_capacity_tokens``, e.g. for a
        KV-usage score); prefill ranks never refuse on it.
    rank_cache : object, optional
        Local prefix caches (e.g. :mod:`lbkit.sim.prefix_cache`'s per-rank LRUs), an object with
        ``hit_tokens(request) -> int64 array (ranks,)`` (cached tokens of the request on each
        rank now, at most ``total_tokens - 1``), ``admitted(request, rank)`` and
        ``finished(request, rank)``. Before routing request ``i`` the view's ``hit_tokens`` is
        ``rank_cache.hit_tokens(i)``; admitted to flat rank ``f`` the request's cached prefix is
        ``hit_tokens[f]`` (it prefills the rest), then ``admitted(i, f)`` is called; when its
        prefill ends on rank ``g`` (its rank then, after any work-sharing move),
        ``finished(i, g)``. Without it every rank hits the trace's ``cached_tokens``. ``alone_s``
        (the slowdown denominator) always uses the trace's ``cached_tokens``, whatever the
        policy's hits, so that it is the same for every policy.
    horizon_s : float, optional
        Stop at this time (requests not finished by then are *in flight*). Default: run until
        every routed request is prefilled.
    rng : numpy Generator, int seed or None
        Seed of randomised policies (``None`` means seed 0).
    on_progress : callable(done, total), optional
        Called every 1,000 arrivals (for progress bars; never affects the result).

    Returns
    -------
    PrefillRun

    Raises
    ------
    ValueError
        Bad options, a policy's rank outside the pool, or ``rank_cache.hit_tokens`` not of
        shape (ranks,) or outside ``[0, total_tokens - 1]``.

    Runtime complexity: O(requests * route + steps * ranks_per_engine * requests per step).

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> t = Trace(arrival_s=[0.0, 0.0, 1.0], total_tokens=[100, 300, 200], output_tokens=[1, 1, 1])
    >>> run = simulate_prefill(t, "round_robin", num_engines=1, ranks_per_engine=2,
    ...                        cost=PRESETS["unit"].prefill, budget_s=1000.0)
    >>> run.rank.tolist(), run.finish_s.tolist()
    ([0, 1, 0], [346.0, 346.0, 567.0])

    With shared expert work the engine's step lasts longer than a rank's own work: a cost of
    ``a = 1``, ``b = 1``, ``b_moe * moe_lb = 2`` (no attention terms) and 100 + 300 tokens on two
    ranks in one step is ``1 + 300 + 2 * 400 / 2 = 701`` seconds; the two ranks plan for ``3 s``
    per token and fit the whole prompts in the 1,000 s budget.

    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class MoeCost(QuadraticCost):
    ...     b_moe: float = 0.0
    ...     moe_lb: float = 1.0
    >>> moe = MoeCost(a=1.0, b=1.0, k=0.0, q=0.0, b_moe=1.6, moe_lb=1.25)
    >>> two = t.head(2)
    >>> simulate_prefill(two, "round_robin", num_engines=1, ranks_per_engine=2, cost=moe,
    ...                  budget_s=1000.0).finish_s.tolist()
    [701.0, 701.0]
    """
    e, r, budget, min_chunk, align, report, share = _prefill_iv(
        trace,
        num_engines,
        ranks_per_engine,
        cost,
        budget_s,
        min_chunk,
        align,
        report_quantum,
        work_sharing,
    )
    cp_eff = check_real(cp_efficiency, "cp_efficiency", min_value=0.0, strict_min=True,
                        max_value=1.0)  # fmt: skip
    kv_cap = check_int(kv_capacity_tokens, "kv_capacity_tokens", min_value=1)
    if rank_cache is not None:
        for method in ("hit_tokens", "admitted", "finished"):
            if not callable(getattr(rank_cache, method, None)):
                raise TypeError(f"rank_cache: must have a callable {method}() method")
    horizon = _horizon(horizon_s)
    gen = as_rng(rng)
    name, pol = _policy_of(policy, _prefill_table(), "prefill", e, r, cost=cost, rng=gen)
    n = len(trace)
    nr = e * r
    arrival = trace.arrival_s
    total = trace.total_tokens
    cached = trace.cached_tokens
    uncached = total - cached

    RI = np.zeros((K.N_RI, n), dtype=np.int64)
    RI[K.RI_REM] = uncached
    RI[K.RI_PREFIX] = cached
    RI[K.RI_NEXT] = -1
    RI[K.RI_RANK] = -1
    RI[K.RI_UNCACHED] = uncached
    RF = np.zeros((K.N_RF, n))
    RF[K.RF_ARRIVAL] = arrival
    RF[K.RF_FINISH] = np.nan
    q0 = prefill_work_s(trace, cost) if n else np.zeros(0)
    RF[K.RF_QREPORT] = q0
    RF[K.RF_Q0] = q0
    KI = np.zeros((K.N_KI, nr), dtype=np.int64)
    KI[K.KI_HEAD] = -1
    KI[K.KI_TAIL] = -1
    KF = np.zeros((K.N_KF, nr))
    EF = np.zeros((K.N_EF, e))
    EF[K.EF_END] = np.inf
    EI = np.zeros((K.N_EI, e), dtype=np.int64)
    # Time bins cover the arrivals plus the same span again for the drain (the last bin takes
    # everything later).
    bin_s = max(2.0 * float(arrival[-1]), 1e-9) / K_BINS if n else 1.0
    P = np.array(
        [cost.a, cost.b, cost.k, cost.q, cost.gamma, budget, min_chunk, align, r, report, bin_s,
         float(share), cp_eff, _moe_s_per_token(cost)],
        dtype=np.float64,
    )  # fmt: skip
    ACC = np.zeros(K.N_ACC)
    BINS = np.zeros((K.N_BIN, K_BINS))
    KS = np.zeros((K.N_KS, r + 1))
    SCR = np.zeros((3, max(n, r) if share else 1), dtype=np.int64)
    cap = n + 2 * nr + 16
    EVR = np.zeros(cap, dtype=np.int64)
    EVK = np.zeros(cap, dtype=np.int64)
    EVT = np.zeros(cap, dtype=np.int64)
    alone = np.zeros(n)
    if n:
        K.prefill_alone(RI, P, alone)

    hit = np.zeros(nr, dtype=np.int64)
    hash_ids, hash_offsets = trace.hash_ids, trace.hash_offsets
    with_hashes = hash_ids is not None and hash_offsets is not None
    offsets = hash_offsets.tolist() if with_hashes else []
    view = PrefillView(e, r, _readonly(KI[K.KI_NREQ]), _readonly(KI[K.KI_TOKENS]),
                       _readonly(KI[K.KI_WAIT]), _readonly(KI[K.KI_KV]), kv_cap, _readonly(hit),
                       _NO_HASHES, BLOCK_TOKENS)  # fmt: skip
    ran_cached = cached.copy()
    observe = pol.observe
    route = pol.route
    advance = K.prefill_advance
    admit = K.prefill_admit

    def _advance(t: float) -> None:
        while True:
            nev, complete = advance(t, RI, RF, KI, KF, EF, EI, P, ACC, BINS, KS, EVR, EVK, EVT, SCR)
            if nev:
                if rank_cache is not None:
                    done = EVR[:nev][EVK[:nev] == K.EV_FINISH]
                    for j, g in zip(done.tolist(), RI[K.RI_RANK, done].tolist(), strict=True):
                        rank_cache.finished(j, g)
                now = t if t < math.inf else float(EF[K.EF_READY].max())
                observe(EVR[:nev], EVK[:nev], EVT[:nev], now_s=now)
            if complete:
                return

    arrived = 0
    for i in range(n):
        t = float(arrival[i])
        if t > horizon:
            break
        arrived += 1
        _advance(t)
        if rank_cache is None:
            hit.fill(cached[i])
        else:
            hit[:] = _hits_of(rank_cache, i, nr, int(total[i]))
        v = view
        if with_hashes:  # trace.hash_ids_of(i), without its checks
            v = view._replace(block_hashes=hash_ids[offsets[i] : offsets[i + 1]])
        f = route(i, int(total[i]), int(cached[i]), now_s=t, view=v)
        if f < 0:
            continue
        if not 0 <= f < nr:
            raise ValueError(f"policy {name!r} returned rank {f} outside [0, {nr})")
        if rank_cache is not None:
            _set_prefix(i, int(hit[f]), int(total[i]), RI, RF, cost)
            ran_cached[i] = hit[f]
        admit(i, f, t, RI, KI, EF, EI, P)
        if rank_cache is not None:
            rank_cache.admitted(i, f)
        if on_progress is not None and (i + 1) % 1000 == 0:
            on_progress(i + 1, n)
    _advance(horizon)
    end = float(np.nanmax(RF[K.RF_FINISH])) if n and (RI[K.RI_RANK] >= 0).any() else 0.0
    if horizon < math.inf:
        end = horizon
    rank = RI[K.RI_RANK].copy()
    return PrefillRun(
        policy=name,
        trace=trace,
        num_engines=e,
        ranks_per_engine=r,
        cost=cost,
        budget_s=budget,
        rank=rank,
        finish_s=RF[K.RF_FINISH].copy(),
        alone_s=alone,
        step_mean_s=float(ACC[K.ACC_MEAN]),
        step_max_s=float(ACC[K.ACC_MAX]),
        num_steps=int(ACC[K.ACC_STEPS]),
        overruns=int(ACC[K.ACC_OVERRUNS]),
        tokens_computed=int(ACC[K.ACC_TOKENS]),
        rank_busy_s=KF[K.KF_BUSY].copy(),
        bin_s=bin_s,
        bin_mean_s=BINS[K.BIN_MEAN].copy(),
        bin_max_s=BINS[K.BIN_MAX].copy(),
        end_s=end if not math.isnan(end) else 0.0,
        num_arrived=arrived,
        work_sharing=SHARING[share],
        moves=int(ACC[K.ACC_MOVES]),
        busy_steps=KS[K.KS_STEPS].astype(np.int64),
        busy_mean_s=KS[K.KS_MEAN].copy(),
        busy_max_s=KS[K.KS_MAX].copy(),
        few_steps=int(ACC[K.ACC_FEW_STEPS]),
        few_mean_s=float(ACC[K.ACC_FEW_MEAN]),
        few_max_s=float(ACC[K.ACC_FEW_MAX]),
        cached_tokens=ran_cached,
    )


def _hits_of(rank_cache: Any, i: int, nr: int, total: int) -> np.ndarray:
    """``rank_cache.hit_tokens(i)`` checked: int64 of shape (nr,) within ``[0, total - 1]``."""
    h = np.asarray(rank_cache.hit_tokens(i))
    if h.shape != (nr,) or h.dtype.kind not in "iu":
        raise ValueError(
            f"rank_cache: hit_tokens({i}) must be an integer array of shape ({nr},), got "
            f"{h.dtype} of shape {h.shape}"
        )
    if nr and (int(h.min()) < 0 or int(h.max()) > total - 1):
        raise ValueError(
            f"rank_cache: hit_tokens({i}) must be within [0, total_tokens - 1 = {total - 1}], "
            f"got [{int(h.min())}, {int(h.max())}]"
        )
    return h


def _set_prefix(i: int, prefix: int, total: int, RI, RF, cost: QuadraticCost) -> None:
    """Request ``i`` hits ``prefix`` cached tokens where it is admitted: it prefills the rest."""
    rem = total - prefix
    RI[K.RI_PREFIX, i] = prefix
    RI[K.RI_REM, i] = rem
    RI[K.RI_UNCACHED, i] = rem
    # cost.quota of one request, without its array validation (this runs once per admission).
    q = rem * (cost.b + cost.k * prefix + cost.q * rem) + cost.gamma * prefix if rem > 0 else 0.0
    RF[K.RF_QREPORT, i] = q
    RF[K.RF_Q0, i] = q


K_BINS = NUM_BINS


def _prefill_table():
    from lbkit.sim.policies import PREFILL_POLICIES

    return PREFILL_POLICIES


def _decode_table():
    from lbkit.sim.policies_decode import DECODE_POLICIES

    return DECODE_POLICIES


#: Default per-rank KV capacity (tokens) of a decode rank: an H800 (80 GB of HBM) in a 64-rank
#: expert-parallel engine serving DeepSeek-V3 in FP8. Routed experts: 58 MoE layers x 256
#: experts x 3 x 7168 x 2048 = 653.9e9 parameters, 10.22 GB per rank; the other ~17e9
#: parameters (MLA, dense layers, shared experts, embeddings) are replicated on every rank under
#: data-parallel attention, 17 GB; activations, CUDA graphs and all-to-all buffers take about
#: 10% of HBM, 8 GB. KV budget 80 - 10.22 - 17 - 8 = 44.78 GB, over 70,272 bytes per token
#: (61 layers x (512 + 64) values x 2 bytes, MLA in BF16): 637,276 tokens.
DECODE_KV_CAPACITY_TOKENS = 637_276
#: Default watermark of the decode-only bench: 1% of the capacity kept free at admission
#: (vLLM's block-manager watermark) so that running requests can grow before a preemption.
DECODE_KV_WATERMARK_TOKENS = DECODE_KV_CAPACITY_TOKENS // 100
#: Why a decode request was refused (``DecodeRun.refusal`` is 1 + the index): its prompt
#: exceeds the admission limit of an empty rank, or its prompt plus output exceeds the capacity
#: (vLLM checks ``prompt + max_tokens <= max_model_len`` likewise), or the policy refused it
#: while the pool was empty.
REFUSALS = ("too_long", "outgrows", "policy")


# ------------------------------------------------------------------------ decode
def simulate_decode(
    prefill: PrefillRun | Trace,
    policy: Any,
    /,
    *,
    num_engines: int = 1,
    ranks_per_engine: int = 64,
    cost: DecodeCost,
    max_batch: int | None = None,
    max_kv_tokens: int | None = None,
    kv_watermark_tokens: int = 0,
    horizon_s: float | None = None,
    window_s: tuple[float, float] | None = None,
    migration_latency_s: float = 0.0,
    migration_s_per_kv_token: float = 0.0,
    rng: np.random.Generator | int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> DecodeRun:
    """Replay the handovers of a prefill run through a decode pool routed by ``policy``.

    Every request whose prefill finished enters decode at its prefill end with ``total_tokens``
    KV tokens (ties in handover time keep trace order) and needs ``output_tokens - 1`` steps.

    Parameters
    ----------
    prefill : PrefillRun or Trace
        A prefill run, or a trace for a *decode-only* replay: each request enters decode at its
        arrival time (as if prefill took no time), which lets the decode pool be loaded
        independently of a prefill pool (time-scale the trace to the load wanted).
    policy : str or policy object
        A key of :data:`lbkit.sim.policies_decode.DECODE_POLICIES` or an object with ``route``
        and ``observe`` (see :mod:`lbkit.sim.policies_decode`).
    num_engines, ranks_per_engine : int
        Pool shape (default one engine of 64 ranks).
    cost : DecodeCost
    max_batch, max_kv_tokens : int, optional
        Per-rank capacities (requests; KV tokens). A request no rank can take now waits
        (back-pressure) in the pool's FIFO wait queue; see *Capacity* below.
    kv_watermark_tokens : int, default 0
        KV tokens of a rank kept free at admission: a policy sees the admission limit
        ``max_kv_tokens - kv_watermark_tokens`` as ``view.max_kv_tokens``.
    horizon_s : float, optional
        Stop at this time; default: run until every admitted request finished.
    window_s : (float, float), optional
        Also sum the step statistics over the steps that start in ``[start, stop)`` (e.g. the
        steady state between ramp-up and drain); see ``DecodeRun.window_sums``.
    migration_latency_s, migration_s_per_kv_token : float, default 0
        KV transfer time of a migrated request: ``latency + s_per_kv_token * kv_tokens``
        seconds, during which it does not decode (it finishes its step and joins the first step
        of its new rank's engine that starts after the transfer; its KV is reserved there
        meanwhile). With both 0 a request moved within its engine keeps decoding without a
        pause; one moved to another engine joins that engine's next step. For example a model with
        70,272 KV bytes per token (DeepSeek-V3's MLA cache in BF16: 61 layers x 576 values x 2
        bytes) over 40 GB/s is ``migration_s_per_kv_token=1.76e-6``.
    rng : numpy Generator, int seed or None
    on_progress : callable(done, total), optional

    Returns
    -------
    DecodeRun

    Notes
    -----
    *Shared MoE work*: with ``cost.b_moe > 0`` every rank of an engine also pays
    ``b_moe * moe_lb * sum_r B_r / R`` per step (the routed experts run on every rank's tokens);
    rank times and the balance statistics include it.

    *Capacity* (back-pressure, preemption). A request that the policy does not place (-1) joins
    the tail of the pool's FIFO wait queue; while the queue is not empty a new request joins its
    tail without being offered (no request overtakes an earlier one, as in vLLM's and SGLang's
    schedulers). After every step end where requests finished, the queue's head is offered to
    the policy again, in order, until one is not placed. A step starts only when every rank's
    KV plus its growth (one token per running request) fits ``max_kv_tokens``; otherwise the
    rank's newest requests are preempted: they free their KV and go back to the head of the
    queue (older first), keeping the tokens they generated (as vLLM's recompute preemption:
    their KV, prompt plus generated tokens, is rebuilt at readmission, at no modelled cost).
    Only a request that could never run on an empty rank is refused, at handover: prompt above
    the admission limit (``"too_long"``) or prompt plus output above the capacity
    (``"outgrows"``); a request the policy refuses while the pool holds nothing is refused
    (``"policy"``). Waiting time counts in TPOT (``finish - handover``) and in ``wait_s``.
    Complexity: a preemption costs O(running requests of the engine).

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> t = Trace(arrival_s=[0.0, 0.0], total_tokens=[100, 300], output_tokens=[3, 2])
    >>> unit = PRESETS["unit"]
    >>> pre = simulate_prefill(t, "round_robin", num_engines=1, ranks_per_engine=2,
    ...                        cost=unit.prefill, budget_s=1000.0)
    >>> dec = simulate_decode(pre, "round_robin", num_engines=1, ranks_per_engine=2,
    ...                       cost=unit.decode)
    >>> dec.handover_s.tolist(), dec.finish_s.tolist()
    ([346.0, 346.0], [350.401, 348.3])

    With room for one request per rank, the third request waits for the first to finish:

    >>> t = Trace(arrival_s=[0.0, 0.0, 0.0], total_tokens=[10, 10, 10], output_tokens=[3, 3, 3])
    >>> dec = simulate_decode(t, "least_requests", num_engines=1, ranks_per_engine=2,
    ...                       cost=unit.decode, max_batch=1)
    >>> dec.wait_s.tolist(), dec.finish_s.tolist()
    ([0.0, 0.0, 4.021], [4.021, 4.021, 8.042])
    """
    if not isinstance(prefill, (PrefillRun, Trace)):
        raise TypeError(f"prefill: must be a PrefillRun or a Trace, got {type(prefill).__name__}")
    e = check_int(num_engines, "num_engines", min_value=1)
    r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    if not isinstance(cost, DecodeCost):
        raise TypeError(f"cost: must be a DecodeCost, got {type(cost).__name__}")
    mb = None if max_batch is None else check_int(max_batch, "max_batch", min_value=1)
    mk = None if max_kv_tokens is None else check_int(max_kv_tokens, "max_kv_tokens", min_value=1)
    wm = check_int(kv_watermark_tokens, "kv_watermark_tokens", min_value=0)
    if mk is not None and wm >= mk:
        raise ValueError(f"kv_watermark_tokens: must be below max_kv_tokens ({mk}), got {wm}")
    limit = None if mk is None else mk - wm  # admission limit the policies see
    horizon = _horizon(horizon_s)
    window = _window_iv(window_s)
    lat = check_real(migration_latency_s, "migration_latency_s", min_value=0.0)
    per_token = check_real(migration_s_per_kv_token, "migration_s_per_kv_token", min_value=0.0)
    gen = as_rng(rng)
    name, pol = _policy_of(policy, _decode_table(), "decode", e, r, cost=cost, rng=gen)
    if isinstance(prefill, Trace):
        trace = prefill
        handover = np.asarray(trace.arrival_s, dtype=np.float64).copy()
    else:
        trace = prefill.trace
        handover = prefill.finish_s.copy()
    n = len(trace)
    nr = e * r
    kv0 = trace.total_tokens
    out = trace.output_tokens
    order = np.argsort(np.where(np.isnan(handover), np.inf, handover), kind="stable")
    order = order[~np.isnan(handover[order])]

    DI = np.zeros((K.N_DI, n), dtype=np.int64)
    DI[K.DI_RANK] = -1
    DI[K.DI_LEFT] = out - 1
    DI[K.DI_KV] = kv0
    DI[K.DI_NEXT] = -1
    DI[K.DI_POS] = -1
    DF = np.full((K.N_DF, n), np.nan)
    DK = np.zeros((K.N_DK, nr), dtype=np.int64)
    DE = np.zeros((K.N_DE, e))
    DE[K.DE_END] = np.inf
    DE[K.DE_PHEAD] = -1
    DE[K.DE_PTAIL] = -1
    DE[K.DE_THEAD] = -1
    steps = np.zeros(e, dtype=np.int64)
    ACT = np.zeros((e, max(n, 1)), dtype=np.int64)
    start = float(handover[order[0]]) if order.size else 0.0
    stop = float(handover[order[-1]]) if order.size else 1.0
    span = max(stop - start, 1e-9)
    bin_s = 2.0 * max(stop, span) / K_BINS
    w0, w1 = (-np.inf, -np.inf) if window is None else window
    moe = cost.moe_s_per_token
    D = np.array(
        [cost.a, cost.b, cost.k, 1.0 if cost.combine == "max" else 0.0, r, bin_s, w0, w1,
         lat, per_token, math.inf if mk is None else float(mk), 0.0, moe],
        dtype=np.float64,
    )  # fmt: skip
    ACC = np.zeros(2 * K.N_DACC)
    BINS = np.zeros((2, K_BINS))
    EVR = np.zeros(n + 16 if mk is None else 2 * n + 16, dtype=np.int64)
    view = DecodeView(e, r, _readonly(DK[K.DK_B]), _readonly(DK[K.DK_S]), _readonly(steps), mb,
                      limit)  # fmt: skip
    observe = pol.observe
    route = pol.route
    migrations = getattr(pol, "migrations", None)
    advance = K.decode_advance
    admit = K.decode_admit
    wait = np.zeros(n)
    refusal = np.zeros(n, dtype=np.int8)
    queue: deque[int] = deque()  # the wait queue (FIFO; preempted requests at its head)
    queued_at = np.zeros(n)
    seq = 0
    preempted = 0

    def _place(i: int, t: float) -> bool:
        """Offer request ``i`` to the policy at ``t``; admit it if it is placed."""
        nonlocal seq
        kv = int(DI[K.DI_KV, i])
        f = route(i, kv, now_s=t, view=view)
        if f < 0:
            return False
        if not 0 <= f < nr:
            raise ValueError(f"policy {name!r} returned rank {f} outside [0, {nr})")
        if _over_capacity(DK, f, kv, mb, limit):
            raise ValueError(f"policy {name!r} placed request {i} beyond a rank's capacity")
        admit(i, f, t, seq, DI, DF, DK, DE, D)
        seq += 1
        return True

    def _offer(t: float) -> None:
        """Offer the wait queue's head to the policy, in order, until one is not placed."""
        while queue:
            i = queue[0]
            if not _place(i, t):
                if DK[K.DK_B].any():
                    break
                refusal[i] = 1 + REFUSALS.index("policy")  # refused on an empty pool
            else:
                wait[i] += t - queued_at[i]
            queue.popleft()
        D[K.D_STOP] = 1.0 if queue else 0.0

    def _advance(t: float) -> None:
        nonlocal preempted
        while True:
            nev, complete, last_t = advance(t, DI, DF, DK, DE, ACT, D, ACC, BINS, EVR)
            steps[:] = DE[K.DE_STEPS]
            if nev:
                now = t if complete and t < math.inf else float(DE[K.DE_READY].max())
                if not complete:
                    now = last_t
                ev = EVR[:nev]
                back = ev < 0
                if back.any():  # preempted: they left their rank too
                    left = np.where(back, -1 - ev, ev)
                    observe(left, now_s=now, view=view)
                    ids = left[back]
                    ids = ids[np.argsort(DI[K.DI_SEQ, ids], kind="stable")]
                    queue.extendleft(ids[::-1].tolist())
                    queued_at[ids] = DF[K.DF_JOIN, ids]  # the preemption time
                    preempted += int(ids.size)
                    D[K.D_STOP] = 1.0
                else:
                    observe(ev, now_s=now, view=view)
                if queue and not complete and D[K.D_STOP] > 0 and ev[-1] >= 0:
                    _offer(now)  # the kernel stopped at a step end where requests finished
            if complete:
                return

    count = order.size
    num_moves, move_s = 0, 0.0
    for j, i in enumerate(order.tolist()):
        t = float(handover[i])
        if t > horizon:
            break
        if out[i] == 1:
            DI[K.DI_RANK, i] = -2
            DF[K.DF_JOIN, i] = t
            DF[K.DF_FINISH, i] = t
            continue
        if limit is not None and kv0[i] > limit:
            refusal[i] = 1 + REFUSALS.index("too_long")
            continue
        if mk is not None and kv0[i] + out[i] - 1 > mk:
            refusal[i] = 1 + REFUSALS.index("outgrows")
            continue
        _advance(t)
        if migrations is not None:
            moved, moved_s = _migrate(migrations(now_s=t, view=view), name, t, DI, DF, DK, DE,
                                      ACT, D, nr, mb, limit)  # fmt: skip
            num_moves += moved
            move_s += moved_s
        if queue or not _place(i, t):
            queue.append(i)
            queued_at[i] = t
            D[K.D_STOP] = 1.0
            if not DK[K.DK_B].any():
                _offer(t)  # nothing runs: no step end would offer the queue
        if on_progress is not None and (j + 1) % 1000 == 0:
            on_progress(j + 1, count)
    _advance(horizon)
    while queue and horizon == math.inf:  # only policy refusals on an empty pool remain
        _offer(float(DE[K.DE_READY].max()))
        _advance(horizon)
    fin = DF[K.DF_FINISH]
    end = float(np.nanmax(fin)) if (~np.isnan(fin)).any() else 0.0
    if horizon < math.inf:
        end = horizon
    return DecodeRun(
        policy=name,
        num_engines=e,
        ranks_per_engine=r,
        cost=cost,
        handover_s=handover,
        rank=DI[K.DI_RANK].copy(),
        finish_s=fin.copy(),
        output_tokens=np.asarray(out),
        step_mean_s=float(ACC[K.DACC_MEAN]),
        step_max_s=float(ACC[K.DACC_MAX]),
        step_time_s=float(ACC[K.DACC_TIME]),
        count_imbalance_s=float(ACC[K.DACC_BIMB]),
        kv_imbalance_s=float(ACC[K.DACC_SIMB]),
        count_floor_s=float(ACC[K.DACC_BFLOOR]),
        num_steps=int(ACC[K.DACC_STEPS]),
        tokens_generated=int(ACC[K.DACC_TOKENS]),
        bin_s=bin_s,
        bin_mean_s=BINS[0].copy(),
        bin_max_s=BINS[1].copy(),
        end_s=end,
        window_s=window,
        window_sums=None if window is None else ACC[K.DACC_W :].copy(),
        migrations=num_moves,
        migration_s=move_s,
        wait_s=wait,
        refusal=refusal,
        preemptions=preempted,
        kv_capacity_tokens=mk,
    )


def _over_capacity(DK: np.ndarray, f: int, kv: int, mb: int | None, mk: int | None) -> bool:
    """Whether one more request of ``kv`` tokens on flat rank ``f`` exceeds a capacity."""
    return (mb is not None and DK[K.DK_B, f] + 1 > mb) or (
        mk is not None and DK[K.DK_S, f] + kv > mk
    )


def _migrate(moves: Any, name: str, t: float, DI, DF, DK, DE, ACT, D, nr: int,
             mb: int | None, mk: int | None) -> tuple[int, float]:  # fmt: skip
    """Apply a decode policy's migrations ``[(request, flat rank), ...]`` (see the protocol).

    Returns the number of moves and the sum of their transfer times.
    """
    count, total_s = 0, 0.0
    for i, g in moves:
        if not 0 <= g < nr:
            raise ValueError(f"policy {name!r} migrated request {i} to rank {g} outside [0, {nr})")
        same = DI[K.DI_RANK, i] == g
        if not same and _over_capacity(DK, g, DI[K.DI_KV, i], mb, mk):
            raise ValueError(f"policy {name!r} migrated request {i} beyond a rank's capacity")
        code = K.decode_migrate(i, g, t, DI, DF, DK, DE, ACT, D)
        if code == -1:
            raise ValueError(f"policy {name!r} migrated request {i}, which is not running")
        if same:
            continue
        count += 1
        total_s += float(D[K.D_MIG_LAT] + D[K.D_MIG_TOKEN] * DI[K.DI_KV, i])
    return count, total_s


def _window_iv(window_s: Any) -> tuple[float, float] | None:
    if window_s is None:
        return None
    try:
        w0, w1 = window_s
    except (TypeError, ValueError):
        raise TypeError("window_s: must be a pair (start_s, stop_s) or None") from None
    w0 = check_real(w0, "window_s[0]", allow_inf=True)
    w1 = check_real(w1, "window_s[1]", allow_inf=True)
    if not w1 > w0:
        raise ValueError(f"window_s: stop must be after start, got ({w0}, {w1})")
    return w0, w1


def warmup() -> None:
    """Compile every kernel of :mod:`lbkit.sim` on a tiny scenario."""
    from lbkit.core.cost import PRESETS

    trace = Trace(arrival_s=[0.0, 0.5, 1.0], total_tokens=[100, 2000, 300], output_tokens=[3, 1, 5])
    unit = PRESETS["unit"]
    # The lbkit policies too: their balancers' kernels compile on first use.
    run = simulate_prefill(trace, "lbkit", num_engines=2, ranks_per_engine=2,
                           cost=unit.prefill, budget_s=500.0)  # fmt: skip
    simulate_decode(run, "lbkit", num_engines=1, ranks_per_engine=2, cost=unit.decode)
    DI = np.zeros((K.N_DI, 1), dtype=np.int64)
    DI[K.DI_LEFT] = 1
    DI[K.DI_POS] = -1
    DK = np.ones((K.N_DK, 2), dtype=np.int64)
    D = np.full(K.N_D, 2.0)
    D[K.D_MIG_LAT] = 0.0
    D[K.D_MIG_TOKEN] = 0.0
    D[K.D_CAP] = np.inf
    DE = np.zeros((K.N_DE, 1))
    K.decode_migrate(0, 1, 0.0, DI, np.zeros((K.N_DF, 1)), DK, DE, np.zeros((1, 1), np.int64), D)
