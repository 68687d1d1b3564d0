"""The prefill pool of a replay: the state it owns, its replay hooks, and the record of a run.

:class:`PrefillPool` allocates the pool's state arrays (rows named in
:mod:`lbkit.sim._prefill_layout`), hands them to the numba kernels
(:mod:`lbkit.sim._prefill_kernels`, :mod:`lbkit.sim._plan_kernels`) and gives the policy its
live, read-only :class:`~lbkit.sim.protocol.PrefillView`. :func:`lbkit.sim.replay.replay` drives
it; :func:`lbkit.sim.engine.simulate_prefill` validates the options, builds it and returns its
:class:`PrefillRun`. The engine model is described in :mod:`lbkit.sim.engine`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.sim import _plan_kernels, _prefill_kernels
from lbkit.sim import _prefill_layout as L
from lbkit.sim._bins import BIN_MAX, BIN_MEAN, N_BIN, NUM_BINS
from lbkit.sim.protocol import EV_FINISH, PREFILL_KV_CAPACITY_TOKENS, PrefillView
from lbkit.sim.replay import readonly
from lbkit.sim.traces import Trace
from lbkit.sim.utilization import prefill_work_s

__all__ = ["SHARING", "PrefillPool", "PrefillRun"]

#: Work-sharing modes of the prefill engines (see :func:`lbkit.sim.engine.simulate_prefill`).
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


class PrefillPool:
    """A prefill pool's state during a replay, routed by ``policy`` (its replay hooks).

    Parameters
    ----------
    trace : Trace
    policy : prefill policy
        An object with ``route`` and ``observe`` (:class:`lbkit.sim.protocol.PrefillPolicy`).
    name : str
        The policy's name (in error messages and the run).
    num_engines, ranks_per_engine, cost, budget_s, min_chunk, align, report_quantum,
    cp_efficiency, kv_capacity_tokens, rank_cache
        As in :func:`lbkit.sim.engine.simulate_prefill`, validated.
    share : int
        Work-sharing mode, the index in :data:`SHARING`.

    Attributes
    ----------
    view : PrefillView
        What the policy reads (live, read-only arrays).
    alone_s : ndarray of float64, shape (requests,)
        Each request's prefill time alone (see :class:`PrefillRun`).

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> from lbkit.sim.policies import PREFILL_POLICIES
    >>> from lbkit.sim.replay import replay
    >>> t = Trace(arrival_s=[0.0, 0.0], total_tokens=[100, 300], output_tokens=[1, 1])
    >>> cost = PRESETS["unit"].prefill
    >>> pool = PrefillPool(t, PREFILL_POLICIES["round_robin"](1, 2, cost=cost, rng=0),
    ...                    "round_robin", num_engines=1, ranks_per_engine=2, cost=cost,
    ...                    budget_s=1000.0)
    >>> replay(pool, np.arange(2), t.arrival_s, horizon_s=math.inf)
    2
    >>> pool.result(2, math.inf).finish_s.tolist()
    [346.0, 346.0]
    """

    def __init__(
        self,
        trace: Trace,
        policy: Any,
        name: str,
        /,
        *,
        num_engines: int,
        ranks_per_engine: int,
        cost: QuadraticCost,
        budget_s: float = 1.0,
        min_chunk: int = 1,
        align: int = 1,
        report_quantum: float = 0.02,
        share: int = 0,
        cp_efficiency: float = 1.0,
        kv_capacity_tokens: int = PREFILL_KV_CAPACITY_TOKENS,
        rank_cache: Any = None,
    ) -> None:
        e, r = num_engines, ranks_per_engine
        n = len(trace)
        nr = e * r
        self.trace, self.policy, self.name, self.cost = trace, policy, name, cost
        self.num_engines, self.ranks_per_engine, self.num_ranks = e, r, nr
        self.budget_s, self.share, self.rank_cache = budget_s, share, rank_cache
        arrival = trace.arrival_s
        cached = trace.cached_tokens
        uncached = trace.total_tokens - cached

        RI = np.zeros((L.N_RI, n), dtype=np.int64)
        RI[L.RI_REM] = uncached
        RI[L.RI_PREFIX] = cached
        RI[L.RI_NEXT] = -1
        RI[L.RI_RANK] = -1
        RI[L.RI_UNCACHED] = uncached
        RF = np.zeros((L.N_RF, n))
        RF[L.RF_ARRIVAL] = arrival
        RF[L.RF_FINISH] = np.nan
        q0 = prefill_work_s(trace, cost) if n else np.zeros(0)
        RF[L.RF_QREPORT] = q0
        RF[L.RF_Q0] = q0
        KI = np.zeros((L.N_KI, nr), dtype=np.int64)
        KI[L.KI_HEAD] = -1
        KI[L.KI_TAIL] = -1
        KF = np.zeros((L.N_KF, nr))
        EF = np.zeros((L.N_EF, e))
        EF[L.EF_END] = np.inf
        EI = np.zeros((L.N_EI, e), dtype=np.int64)
        # Time bins cover the arrivals plus the same span again for the drain (the last bin takes
        # everything later).
        self.bin_s = max(2.0 * float(arrival[-1]), 1e-9) / NUM_BINS if n else 1.0
        P = np.zeros(L.N_P)
        P[L.P_A], P[L.P_B], P[L.P_K], P[L.P_Q], P[L.P_GAMMA] = (
            cost.a, cost.b, cost.k, cost.q, cost.gamma
        )  # fmt: skip
        P[L.P_BUDGET], P[L.P_MIN_CHUNK], P[L.P_ALIGN] = budget_s, min_chunk, align
        P[L.P_RANKS], P[L.P_REPORT], P[L.P_BIN_S] = r, report_quantum, self.bin_s
        P[L.P_SHARE], P[L.P_CP_EFF], P[L.P_MOE] = share, cp_efficiency, cost.moe_s_per_token
        ACC = np.zeros(L.N_ACC)
        BINS = np.zeros((N_BIN, NUM_BINS))
        KS = np.zeros((L.N_KS, r + 1))
        SCR = np.zeros((L.N_SCR, max(n, r) if share else 1), dtype=np.int64)
        cap = n + 2 * nr + 16  # events of one kernel call: room for every request and more
        EVR = np.zeros(cap, dtype=np.int64)
        EVK = np.zeros(cap, dtype=np.int64)
        EVT = np.zeros(cap, dtype=np.int64)
        self.RI, self.RF, self.KI, self.KF, self.EF, self.EI = RI, RF, KI, KF, EF, EI
        self.P, self.ACC, self.BINS, self.KS = P, ACC, BINS, KS
        self.EVR, self.EVK, self.EVT = EVR, EVK, EVT
        # The kernels are looked up now (tests swap them for their plain-Python versions).
        self._advance = _prefill_kernels.prefill_advance
        self._admit = _prefill_kernels.prefill_admit
        self._state = (RI, RF, KI, KF, EF, EI, P, ACC, BINS, KS, EVR, EVK, EVT, SCR)
        self._admit_state = (RI, RF, KI, EF, EI, P)
        self.alone_s = np.zeros(n)
        if n:
            _plan_kernels.prefill_alone(RI, P, self.alone_s)

        self._hit = np.zeros(nr, dtype=np.int64)
        self._total = trace.total_tokens
        self._cached = cached
        hash_ids, hash_offsets = trace.hash_ids, trace.hash_offsets
        self._hash_ids = hash_ids if hash_ids is not None and hash_offsets is not None else None
        self._offsets = hash_offsets.tolist() if self._hash_ids is not None else []
        self.view = PrefillView(e, r, readonly(KI[L.KI_NREQ]), readonly(KI[L.KI_TOKENS]),
                                readonly(KI[L.KI_WAIT]), readonly(KI[L.KI_KV]),
                                kv_capacity_tokens, readonly(self._hit),
                                step_start_s=readonly(EF[L.EF_READY]),
                                step_end_s=readonly(EF[L.EF_END]))  # fmt: skip
        self.ran_cached = cached.copy()

    # ------------------------------------------------------------------ replay hooks
    def screen(self, request: int, t: float, /) -> bool:
        """Every arrival is routed."""
        return True

    def step(self, t_until: float, /) -> bool:
        """Run the engines towards ``t_until``; the events go to the policy's ``observe`` (and
        finished prefills to the rank cache). ``True`` once the pool reached ``t_until``."""
        nev, complete = self._advance(t_until, *self._state)
        if nev:
            EVR, EVK = self.EVR[:nev], self.EVK[:nev]
            if self.rank_cache is not None:
                done = EVR[EVK == EV_FINISH]
                ranks = self.RI[L.RI_RANK, done].tolist()
                for j, g in zip(done.tolist(), ranks, strict=True):
                    self.rank_cache.finished(j, g)
            now = t_until if t_until < math.inf else float(self.EF[L.EF_READY].max())
            self.policy.observe(EVR, EVK, self.EVT[:nev], now_s=now)
        return bool(complete)

    def offer(self, request: int, t: float, /) -> bool:
        """Route the request at ``t`` and admit it where the policy says; ``False``: refused."""
        i = request
        total = int(self._total[i])
        if self.rank_cache is None:
            self._hit.fill(self._cached[i])
        else:
            self._hit[:] = _hits_of(self.rank_cache, i, self.num_ranks, total)
        v = self.view
        if self._hash_ids is not None:  # trace.hash_ids_of(i), without its checks
            v = v._replace(block_hashes=self._hash_ids[self._offsets[i] : self._offsets[i + 1]])
        f = self.policy.route(i, total, int(self._cached[i]), now_s=t, view=v)
        if f < 0:
            return False
        if not 0 <= f < self.num_ranks:
            raise ValueError(
                f"policy {self.name!r} returned rank {f} outside [0, {self.num_ranks})"
            )
        if self.rank_cache is None:
            self.admit(i, f, t)
        else:
            self.admit(i, f, t, prefix_tokens=int(self._hit[f]))
            self.rank_cache.admitted(i, f)
        return True

    def retry(self, horizon_s: float, /) -> bool:
        """Nothing waits outside the ranks' queues."""
        return False

    # ------------------------------------------------------------------ state
    def admit(self, request: int, rank: int, t: float, /, *, prefix_tokens: int = -1) -> None:
        """Append ``request`` to the FIFO queue of flat ``rank`` at ``t``.

        ``prefix_tokens >= 0``: the request hits that many cached tokens there (it prefills the
        rest); by default, the trace's ``cached_tokens``.
        """
        if prefix_tokens >= 0:
            self.ran_cached[request] = prefix_tokens
        self._admit(request, rank, t, prefix_tokens, *self._admit_state)

    def result(self, num_arrived: int, horizon_s: float, /) -> PrefillRun:
        """The record of the replay so far (``num_arrived`` arrivals, stopped at ``horizon_s``)."""
        RI, RF, ACC, KS = self.RI, self.RF, self.ACC, self.KS
        n = RI.shape[1]
        end = float(np.nanmax(RF[L.RF_FINISH])) if n and (RI[L.RI_RANK] >= 0).any() else 0.0
        if horizon_s < math.inf:
            end = horizon_s
        return PrefillRun(
            policy=self.name,
            trace=self.trace,
            num_engines=self.num_engines,
            ranks_per_engine=self.ranks_per_engine,
            cost=self.cost,
            budget_s=self.budget_s,
            rank=RI[L.RI_RANK].copy(),
            finish_s=RF[L.RF_FINISH].copy(),
            alone_s=self.alone_s,
            step_mean_s=float(ACC[L.ACC_MEAN]),
            step_max_s=float(ACC[L.ACC_MAX]),
            num_steps=int(ACC[L.ACC_STEPS]),
            overruns=int(ACC[L.ACC_OVERRUNS]),
            tokens_computed=int(ACC[L.ACC_TOKENS]),
            rank_busy_s=self.KF[L.KF_BUSY].copy(),
            bin_s=self.bin_s,
            bin_mean_s=self.BINS[BIN_MEAN].copy(),
            bin_max_s=self.BINS[BIN_MAX].copy(),
            end_s=end if not math.isnan(end) else 0.0,
            num_arrived=num_arrived,
            work_sharing=SHARING[self.share],
            moves=int(ACC[L.ACC_MOVES]),
            busy_steps=KS[L.KS_STEPS].astype(np.int64),
            busy_mean_s=KS[L.KS_MEAN].copy(),
            busy_max_s=KS[L.KS_MAX].copy(),
            few_steps=int(ACC[L.ACC_FEW_STEPS]),
            few_mean_s=float(ACC[L.ACC_FEW_MEAN]),
            few_max_s=float(ACC[L.ACC_FEW_MAX]),
            cached_tokens=self.ran_cached,
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
