"""The ideal late-binding reference of the prefill pool (SPEC section 8).

No router that commits a request to a rank at its arrival can beat *late binding*: one central
queue for the whole pool, from which a rank takes work only when it has room. The ideal
reference replays a trace through the same engines as :func:`lbkit.sim.engine.simulate_prefill`
(``num_engines`` engines of ``ranks_per_engine`` ranks stepping synchronously, the same cost
model, step budget and per-GPU plan) with that queue in place of a router:

- An engine with work starts a step as soon as it is idle: at a step's end, or at the arrival of
  a request when it was idle (several idle engines: the lowest index starts first).
- At a step's start the engine plans its ranks together: repeatedly, its open rank with the
  least planned time (ties: lowest rank) takes the next piece of work: the head of the central
  queue, whole while it fits the rank's budget left, else the largest chunk that fits (aligned,
  at least ``min_chunk``), which makes it the rank's *started* request and closes the rank. A
  rank holds at most one started request (its KV cache lives there); it continues it with the
  budget left, unless the queue's head is more urgent and fits whole, which then runs first (a
  started request may pause, never move). A rank that has planned nothing yet takes
  ``min_chunk`` tokens when nothing fits (the progress guarantee of the plan).
- **Order.** With ``deadline_s`` the queue (and the choice between a started request and the
  queue's head) follows each request's SLO deadline, earliest first, ties by arrival; without
  it, arrival order (FIFO). A FIFO central queue is *not* an upper bound on SLO attainment: in a
  burst it makes short prompts wait behind long ones, while per-rank queues routed by least
  tokens let a short prompt overtake them, and the SLO gives a long prompt a budget in
  proportion to its own work. Measured on the built-in workload (8 x 8 ranks, ``h800_dsv3``,
  SLO defaults): at 3.4 requests/s FIFO late binding meets the SLO for 0.9899 of requests,
  ``least_tokens`` routing 0.9927, deadline order 1.0; at 4.0 requests/s 0.666, 0.708 and
  0.9999.
- **Level** (``level=True``, the default): an engine starting a step takes from the queue only
  until each of its ranks holds its share of the queued work (queued work over all the pool's
  ranks; at least one request per rank), leaving the rest to the engines whose steps end next,
  so that steps stay short while the queue is short. Without it every step is filled to the
  budget and arrivals wait for long steps: on the first 2,000 requests of the Azure 2023
  conversation trace at 255 requests/s, deadline order meets the SLO for 1.0 of requests with
  levels and 0.982 without (``least_tokens`` routing 0.99); on the built-in workload at 4.0
  requests/s 0.9996 and 0.9999.
- Rank ``r`` of an engine of ``R`` ranks takes ``a + local_r + shared`` seconds with
  ``shared = b_moe * moe_lb * sum_r c_r / R`` (routed experts over all the engine's tokens); the
  step lasts as long as its slowest rank. Ranks plan for a balanced engine: a chunk's planned
  cost uses the linear coefficient ``b + b_moe * moe_lb``.
- A request's prefill ends at the end of the step that computes its last token.

Requests are never refused. Every cached prefix counts as a hit wherever the request runs
(``trace.cached_tokens``: the caller passes the global cache's hits, which bounds what per-rank
caches can give).

Runtime complexity: O(steps * (ranks_per_engine + requests per step) + requests * (num_engines
+ log requests)).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lbkit.core._jit import jit
from lbkit.core.cost import QuadraticCost
from lbkit.core.validation import as_float_array, check_int, check_real
from lbkit.sim import _prefill_layout as L
from lbkit.sim._plan_kernels import fit_chunk, local_work, plan_work
from lbkit.sim._prefill_layout import P_A, P_BUDGET, P_MIN_CHUNK, P_MOE
from lbkit.sim.traces import Trace

__all__ = ["IdealRun", "alone_s", "simulate_ideal_prefill"]


class IdealRun(NamedTuple):
    """Outcome of :func:`simulate_ideal_prefill` (arrays in trace order).

    Attributes
    ----------
    finish_s : ndarray of float64, shape (n,)
        End of the step that finished each request's prefill.
    ttft_s : ndarray of float64, shape (n,)
        Time to first token, ``finish_s - arrival_s``.
    num_steps : int
        Engine steps.
    busy_s : float
        Sum over steps of the step time times the engine's ranks (rank-seconds the pool spent).
    """

    finish_s: np.ndarray
    ttft_s: np.ndarray
    num_steps: int
    busy_s: float


@jit
def _before(key, i, j):
    # Heap order: smaller key first, ties by trace position.
    return key[i] < key[j] or (key[i] == key[j] and i < j)


@jit
def _push(heap, size, key, i):
    heap[size] = i
    c = size
    while c > 0:
        parent = (c - 1) // 2
        if not _before(key, heap[c], heap[parent]):
            break
        heap[c], heap[parent] = heap[parent], heap[c]
        c = parent
    return size + 1


@jit
def _pop(heap, size, key):
    size -= 1
    heap[0] = heap[size]
    c = 0
    while True:
        left = 2 * c + 1
        if left >= size:
            break
        child = left
        if left + 1 < size and _before(key, heap[left + 1], heap[left]):
            child = left + 1
        if not _before(key, heap[child], heap[c]):
            break
        heap[c], heap[child] = heap[child], heap[c]
        c = child
    return size


@jit
def _ideal_kernel(arrival, rem0, prefix0, key, num_engines, ranks, P, level, finish):
    n = arrival.shape[0]
    rem = rem0.copy()
    pref = prefix0.copy()
    nr = num_engines * ranks
    partial = np.full(nr, -1, dtype=np.int64)
    end = np.full(num_engines, np.inf)
    planned = np.zeros(ranks)
    local = np.zeros(ranks)
    tokens = np.zeros(ranks, dtype=np.int64)
    is_open = np.zeros(ranks, dtype=np.bool_)
    ran = np.zeros(ranks, dtype=np.bool_)
    done = np.empty(n, dtype=np.int64)
    heap = np.empty(n, dtype=np.int64)  # the central queue, ordered by key (none started)
    size = 0
    arrived = 0
    steps = 0
    busy = 0.0
    queued = 0.0  # planned work of the requests in the central queue
    budget = P[P_BUDGET]
    a = P[P_A]
    min_chunk = np.int64(P[P_MIN_CHUNK])
    while True:
        t_arr = arrival[arrived] if arrived < n else np.inf
        t_end = np.inf
        for e in range(num_engines):
            if end[e] < t_end:
                t_end = end[e]
        t = t_arr if t_arr < t_end else t_end
        if t == np.inf:
            break
        for e in range(num_engines):
            if end[e] == t:
                end[e] = np.inf
        while arrived < n and arrival[arrived] <= t:
            queued += plan_work(P, rem[arrived], pref[arrived])
            size = _push(heap, size, key, arrived)
            arrived += 1
        for e in range(num_engines):
            if end[e] < np.inf:
                continue
            base = e * ranks
            work = size > 0
            for r in range(ranks):
                if partial[base + r] >= 0:
                    work = True
            if not work:
                continue
            # Plan one step of engine e at time t.
            ndone = 0
            for r in range(ranks):
                planned[r] = a
                local[r] = 0.0
                tokens[r] = 0
                is_open[r] = True
                ran[r] = False
            share = queued / (num_engines * ranks)
            while True:
                best = -1
                for r in range(ranks):
                    if is_open[r] and (best < 0 or planned[r] < planned[best]):
                        best = r
                if best < 0:
                    break
                p = partial[base + best]
                if ran[best]:
                    p = -1  # its started request has had its chunk this step
                h = -1
                if size > 0 and (not level or planned[best] == a or planned[best] - a < share):
                    h = heap[0]  # (level: the rank does not yet hold its share of the queue)
                room = budget - planned[best]
                if h >= 0 and p >= 0:
                    # The queue's head overtakes the rank's started request only if it is more
                    # urgent and fits whole (a rank holds at most one started request).
                    if not (_before(key, h, p) and fit_chunk(P, room, rem[h], pref[h]) >= rem[h]):
                        h = -1
                if h < 0 and p < 0:
                    is_open[best] = False
                    continue
                i = h if h >= 0 else p
                c = fit_chunk(P, room, rem[i], pref[i])
                if c == 0:
                    if planned[best] > a:
                        is_open[best] = False  # full: the next open rank may take it
                        continue
                    c = min_chunk if min_chunk < rem[i] else rem[i]  # progress guarantee
                planned[best] += plan_work(P, c, pref[i])
                local[best] += local_work(P, c, pref[i])
                tokens[best] += c
                if h >= 0:
                    queued -= plan_work(P, rem[i], pref[i])
                    size = _pop(heap, size, key)
                else:
                    ran[best] = True
                rem[i] -= c
                pref[i] += c
                if rem[i] == 0:
                    done[ndone] = i
                    ndone += 1
                    if h < 0:
                        partial[base + best] = -1
                else:
                    partial[base + best] = i
                    is_open[best] = False
            total = 0
            slowest = 0.0
            for r in range(ranks):
                total += tokens[r]
                if local[r] > slowest:
                    slowest = local[r]
            step = a + slowest + P[P_MOE] * total / ranks
            end[e] = t + step
            steps += 1
            busy += step * ranks
            for j in range(ndone):  # the plan's finished requests end with the step
                finish[done[j]] = t + step
    return steps, busy


@jit
def _alone_kernel(rem0, prefix0, ranks, P, out):
    # Each request's plan alone on an idle rank of an engine of `ranks` ranks: the plan of
    # _plan_kernels.prefill_alone (PrefillRun.alone_s), with each step's time summed as fixed
    # plus local work plus its shared share rather than as the planned time less the
    # balanced-engine guess; the two agree to rounding, and the SLO's denominator is this one.
    a = P[P_A]
    min_chunk = np.int64(P[P_MIN_CHUNK])
    for i in range(rem0.shape[0]):
        rem = rem0[i]
        pref = prefix0[i]
        t = 0.0
        while rem > 0:
            c = fit_chunk(P, P[P_BUDGET] - a, rem, pref)
            if c == 0:
                c = min_chunk if min_chunk < rem else rem
            t += a + local_work(P, c, pref) + P[P_MOE] * c / ranks
            rem -= c
            pref += c
        out[i] = t


def _params(cost: Any, budget_s: Any, min_chunk: Any, align: Any) -> np.ndarray:
    if not isinstance(cost, QuadraticCost):
        raise TypeError(f"cost: must be a QuadraticCost, got {type(cost).__name__}")
    budget = check_real(budget_s, "budget_s", min_value=0.0, strict_min=True)
    min_chunk = check_int(min_chunk, "min_chunk", min_value=1)
    align = check_int(align, "align", min_value=1)
    # The prefill pool's parameter layout, so that the plan's kernels serve both.
    P = np.zeros(L.N_P)
    P[L.P_A], P[L.P_B], P[L.P_K] = cost.a, cost.b, cost.k
    P[L.P_Q], P[L.P_GAMMA], P[L.P_MOE] = cost.q, cost.gamma, cost.moe_s_per_token
    P[L.P_BUDGET], P[L.P_MIN_CHUNK], P[L.P_ALIGN] = budget, min_chunk, align
    return P


def alone_s(
    trace: Trace,
    /,
    *,
    ranks_per_engine: int = 8,
    cost: QuadraticCost,
    budget_s: float = 1.0,
    min_chunk: int = 1,
    align: int = 1,
) -> np.ndarray:
    """Each request's prefill time alone on an idle engine (the SLO's slowdown denominator).

    The request runs on one rank under the per-GPU plan (a chunk per step that fits the budget),
    each step costing ``a + local + b_moe * moe_lb * c / R`` (its routed-expert work spread over
    the engine's ``R`` ranks); the cached prefix is ``trace.cached_tokens``.

    Returns
    -------
    ndarray of float64, shape (n,)
        Seconds.

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> t = Trace(arrival_s=[0.0, 1.0], total_tokens=[100, 300], output_tokens=[1, 1])
    >>> alone_s(t, ranks_per_engine=2, cost=PRESETS["unit"].prefill, budget_s=1000.0).tolist()
    [106.0, 346.0]
    """
    r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    P = _params(cost, budget_s, min_chunk, align)
    cached = np.ascontiguousarray(trace.cached_tokens, dtype=np.int64)
    rem = np.ascontiguousarray(trace.total_tokens, dtype=np.int64) - cached
    out = np.zeros(len(trace))
    _alone_kernel(rem, cached, r, P, out)
    return out


def simulate_ideal_prefill(
    trace: Trace,
    /,
    *,
    num_engines: int = 8,
    ranks_per_engine: int = 8,
    cost: QuadraticCost,
    budget_s: float = 1.0,
    min_chunk: int = 1,
    align: int = 1,
    deadline_s: np.ndarray | None = None,
    level: bool = True,
) -> IdealRun:
    """Replay ``trace`` through the prefill pool under ideal late binding (see module docstring).

    Parameters
    ----------
    trace : Trace
        Requests in arrival order; ``cached_tokens`` are hits wherever the request runs.
    num_engines, ranks_per_engine : int
        Pool shape (default 8 x 8, SPEC section 8).
    cost : QuadraticCost
        Prefill step cost of one rank (its ``b_moe``/``moe_lb`` give the shared work).
    budget_s : float, default 1.0
        Time budget of a rank's step plan.
    min_chunk, align : int
        Options of the plan, as in :func:`lbkit.sim.engine.simulate_prefill`.
    deadline_s : array_like, shape (n,), optional
        SLO deadline of each request (absolute seconds); the central queue is served earliest
        deadline first. Default: arrival order.
    level : bool, default True
        Engines take only their share of the queued work per step (see the module docstring).

    Returns
    -------
    IdealRun

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> t = Trace(arrival_s=[0.0, 0.0, 1.0], total_tokens=[100, 300, 200], output_tokens=[1, 1, 1])
    >>> run = simulate_ideal_prefill(t, num_engines=1, ranks_per_engine=2,
    ...                              cost=PRESETS["unit"].prefill, budget_s=1000.0)
    >>> run.finish_s.tolist()
    [346.0, 346.0, 567.0]
    """
    e = check_int(num_engines, "num_engines", min_value=1)
    r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    P = _params(cost, budget_s, min_chunk, align)
    n = len(trace)
    finish = np.full(n, np.nan)
    if n == 0:
        return IdealRun(finish, finish.copy(), 0, 0.0)
    arrival = np.ascontiguousarray(trace.arrival_s, dtype=np.float64)
    cached = np.ascontiguousarray(trace.cached_tokens, dtype=np.int64)
    rem = np.ascontiguousarray(trace.total_tokens, dtype=np.int64) - cached
    if deadline_s is None:
        key = np.arange(n, dtype=np.float64)
    else:
        key = as_float_array(deadline_s, "deadline_s", shape=(n,))
    steps, busy = _ideal_kernel(arrival, rem, cached, key, e, r, P, bool(level), finish)
    return IdealRun(finish, finish - arrival, int(steps), float(busy))
