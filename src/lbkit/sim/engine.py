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

The two functions here validate their options, build the pool
(:class:`~lbkit.sim.prefill_pool.PrefillPool`, :class:`~lbkit.sim.decode_pool.DecodePool`: its
state arrays, the policy's view, the numba kernels' calls) and replay it with
:func:`lbkit.sim.replay.replay`, the one arrival loop of both pools.

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

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lbkit.core.cost import DecodeCost, QuadraticCost
from lbkit.core.validation import as_rng, check_choice, check_int, check_real
from lbkit.sim._bins import NUM_BINS
from lbkit.sim.decode_pool import (
    DECODE_KV_CAPACITY_TOKENS,
    DECODE_KV_WATERMARK_TOKENS,
    REFUSALS,
    DecodePool,
    DecodeRun,
)
from lbkit.sim.prefill_pool import SHARING, PrefillPool, PrefillRun
from lbkit.sim.protocol import PREFILL_KV_CAPACITY_TOKENS, DecodeView, PrefillView
from lbkit.sim.replay import replay
from lbkit.sim.traces import Trace
from lbkit.sim.utilization import prefill_work_s, scale_to_utilization, utilization_factor

__all__ = [
    "DECODE_KV_CAPACITY_TOKENS",
    "DECODE_KV_WATERMARK_TOKENS",
    "NUM_BINS",
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


# ------------------------------------------------------------------------ options
def _policy_of(policy: Any, table: Mapping[str, Callable[..., Any]], kind: str, *args, **kw):
    if isinstance(policy, str):
        if policy not in table:
            raise ValueError(
                f"policy: unknown {kind} policy {policy!r}; choose from {', '.join(table)}"
            )
        return policy, table[policy](*args, **kw)
    made = policy
    if isinstance(policy, type) or not hasattr(policy, "route"):
        if callable(policy):  # a factory (num_engines, ranks_per_engine, *, cost, rng)
            made = policy(*args, **kw)
    if isinstance(made, type) or not (hasattr(made, "route") and hasattr(made, "observe")):
        raise TypeError(
            f"policy: must be a {kind} policy name, an object with route() and observe() or "
            f"a factory of one, got {type(policy).__name__}"
        )
    policy = made
    return getattr(policy, "name", type(policy).__name__), policy


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


def _prefill_table():
    from lbkit.sim.policies import PREFILL_POLICIES

    return PREFILL_POLICIES


def _decode_table():
    from lbkit.sim.policies_decode import DECODE_POLICIES

    return DECODE_POLICIES


# ------------------------------------------------------------------------ prefill
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
    policy : str, policy object or factory
        A key of :data:`lbkit.sim.policies.PREFILL_POLICIES`, an object with ``route`` and
        ``observe`` (see :mod:`lbkit.sim.policies`), or a factory ``(num_engines,
        ranks_per_engine, *, cost, rng)`` of one (called once, with ``rng`` as a Generator).
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
        trace, num_engines, ranks_per_engine, cost, budget_s, min_chunk, align, report_quantum,
        work_sharing,
    )  # fmt: skip
    cp_eff = check_real(cp_efficiency, "cp_efficiency", min_value=0.0, strict_min=True,
                        max_value=1.0)  # fmt: skip
    kv_cap = check_int(kv_capacity_tokens, "kv_capacity_tokens", min_value=1)
    if rank_cache is not None:
        for method in ("hit_tokens", "admitted", "finished"):
            if not callable(getattr(rank_cache, method, None)):
                raise TypeError(f"rank_cache: must have a callable {method}() method")
    horizon = _horizon(horizon_s)
    name, pol = _policy_of(policy, _prefill_table(), "prefill", e, r, cost=cost, rng=as_rng(rng))
    pool = PrefillPool(
        trace, pol, name, num_engines=e, ranks_per_engine=r, cost=cost, budget_s=budget,
        min_chunk=min_chunk, align=align, report_quantum=report, share=share,
        cp_efficiency=cp_eff, kv_capacity_tokens=kv_cap, rank_cache=rank_cache,
    )  # fmt: skip
    order = np.arange(len(trace))
    arrived = replay(pool, order, trace.arrival_s, horizon_s=horizon, on_progress=on_progress)
    return pool.result(arrived, horizon)


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
    policy : str, policy object or factory
        A key of :data:`lbkit.sim.policies_decode.DECODE_POLICIES`, an object with ``route``
        and ``observe`` (see :mod:`lbkit.sim.policies_decode`), or a factory ``(num_engines,
        ranks_per_engine, *, cost, rng)`` of one (called once, with ``rng`` as a Generator).
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
    name, pol = _policy_of(policy, _decode_table(), "decode", e, r, cost=cost, rng=as_rng(rng))
    if isinstance(prefill, Trace):
        trace = prefill
        handover = np.asarray(trace.arrival_s, dtype=np.float64).copy()
    else:
        trace = prefill.trace
        handover = prefill.finish_s.copy()
    order = np.argsort(np.where(np.isnan(handover), np.inf, handover), kind="stable")
    order = order[~np.isnan(handover[order])]
    # Time bins cover the handovers plus as long again for the drain.
    start = float(handover[order[0]]) if order.size else 0.0
    stop = float(handover[order[-1]]) if order.size else 1.0
    span = max(stop - start, 1e-9)
    bin_s = 2.0 * max(stop, span) / NUM_BINS
    pool = DecodePool(
        trace, handover, pol, name, num_engines=e, ranks_per_engine=r, cost=cost, bin_s=bin_s,
        max_batch=mb, max_kv_tokens=mk, admission_limit_tokens=limit, window_s=window,
        migration_latency_s=lat, migration_s_per_kv_token=per_token,
    )  # fmt: skip
    replay(pool, order, handover, horizon_s=horizon, on_progress=on_progress)
    return pool.result(horizon)


def warmup() -> None:
    """Compile every kernel of :mod:`lbkit.sim` on a tiny scenario."""
    from lbkit.core.cost import PRESETS
    from lbkit.sim.decode_pool import warmup_migrate

    trace = Trace(arrival_s=[0.0, 0.5, 1.0], total_tokens=[100, 2000, 300], output_tokens=[3, 1, 5])
    unit = PRESETS["unit"]
    # The lbkit policies too: their balancers' kernels compile on first use.
    run = simulate_prefill(trace, "lbkit", num_engines=2, ranks_per_engine=2,
                           cost=unit.prefill, budget_s=500.0)  # fmt: skip
    simulate_decode(run, "lbkit", num_engines=1, ranks_per_engine=2, cost=unit.decode)
    warmup_migrate()
