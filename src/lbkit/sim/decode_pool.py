"""The decode pool of a replay: the state it owns, its wait queue, migration, and a run's record.

:class:`DecodePool` allocates the pool's state arrays (rows named in
:mod:`lbkit.sim._decode_kernels`), hands them to the numba kernels and gives the policy its live,
read-only :class:`~lbkit.sim.protocol.DecodeView`; it holds the pool's FIFO wait queue
(back-pressure, preempted requests at its head) and applies a policy's migrations.
:func:`lbkit.sim.replay.replay` drives it; :func:`lbkit.sim.engine.simulate_decode` validates
the options, builds it and returns its :class:`DecodeRun`. The rules (capacity, preemption,
migration) are described there.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import numpy as np

from lbkit.core.cost import DecodeCost
from lbkit.sim import _decode_kernels as K
from lbkit.sim._bins import BIN_MAX, BIN_MEAN, N_BIN, NUM_BINS
from lbkit.sim.protocol import DecodeView
from lbkit.sim.replay import readonly
from lbkit.sim.traces import Trace

__all__ = [
    "DECODE_KV_CAPACITY_TOKENS",
    "DECODE_KV_WATERMARK_TOKENS",
    "REFUSALS",
    "DecodePool",
    "DecodeRun",
    "warmup_migrate",
]

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
_TOO_LONG, _OUTGROWS, _POLICY = (1 + REFUSALS.index(r) for r in REFUSALS)
#: ``DecodeRun.rank`` of a request that finished at handover (one output token).
RANK_AT_HANDOVER = -2


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
        ``lbkit.sim._decode_kernels.DACC_*``: mean and max rank time, duration, count and KV
        imbalance, steps, tokens generated and count floor (see
        :func:`lbkit.sim.metrics.decode_metrics`).
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


class DecodePool:
    """A decode pool's state during a replay, routed by ``policy`` (its replay hooks).

    Parameters
    ----------
    trace : Trace
    handover_s : ndarray of float64, shape (requests,)
        When each request enters decode (``nan``: never).
    policy : decode policy
        An object with ``route`` and ``observe`` (:class:`lbkit.sim.protocol.DecodePolicy`),
        optionally ``migrations``.
    name : str
        The policy's name (in error messages and the run).
    num_engines, ranks_per_engine, cost, max_batch, max_kv_tokens, window_s,
    migration_latency_s, migration_s_per_kv_token
        As in :func:`lbkit.sim.engine.simulate_decode`, validated.
    admission_limit_tokens : int or None
        ``max_kv_tokens`` less the watermark (what the policy sees as ``view.max_kv_tokens``).
    bin_s : float
        Width of the time bins.

    Attributes
    ----------
    view : DecodeView
        What the policy reads (live, read-only arrays).

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> from lbkit.sim.policies_decode import DECODE_POLICIES
    >>> from lbkit.sim.replay import replay
    >>> t = Trace(arrival_s=[0.0, 0.0], total_tokens=[100, 300], output_tokens=[3, 2])
    >>> cost = PRESETS["unit"].decode
    >>> pool = DecodePool(t, t.arrival_s, DECODE_POLICIES["round_robin"](1, 2, cost=cost, rng=0),
    ...                   "round_robin", num_engines=1, ranks_per_engine=2, cost=cost, bin_s=1.0)
    >>> replay(pool, np.arange(2), t.arrival_s, horizon_s=math.inf)
    2
    >>> pool.result(math.inf).finish_s.tolist()
    [4.401, 2.3]
    """

    def __init__(
        self,
        trace: Trace,
        handover_s: np.ndarray,
        policy: Any,
        name: str,
        /,
        *,
        num_engines: int,
        ranks_per_engine: int,
        cost: DecodeCost,
        bin_s: float,
        max_batch: int | None = None,
        max_kv_tokens: int | None = None,
        admission_limit_tokens: int | None = None,
        window_s: tuple[float, float] | None = None,
        migration_latency_s: float = 0.0,
        migration_s_per_kv_token: float = 0.0,
    ) -> None:
        e, r = num_engines, ranks_per_engine
        n = len(trace)
        nr = e * r
        self.policy, self.name, self.cost = policy, name, cost
        self.num_engines, self.ranks_per_engine, self.num_ranks = e, r, nr
        self.handover_s, self.bin_s, self.window_s = handover_s, bin_s, window_s
        self.max_batch, self.max_kv_tokens = max_batch, max_kv_tokens
        self.limit = admission_limit_tokens
        self._kv0 = trace.total_tokens
        self._out = trace.output_tokens

        DI = np.zeros((K.N_DI, n), dtype=np.int64)
        DI[K.DI_RANK] = -1
        DI[K.DI_LEFT] = self._out - 1
        DI[K.DI_KV] = self._kv0
        DI[K.DI_NEXT] = -1
        DI[K.DI_POS] = -1
        DF = np.full((K.N_DF, n), np.nan)
        DK = np.zeros((K.N_DK, nr), dtype=np.int64)
        DE = np.zeros((K.N_DE, e))
        DE[K.DE_END] = np.inf
        DE[K.DE_PHEAD] = -1
        DE[K.DE_PTAIL] = -1
        DE[K.DE_THEAD] = -1
        ACT = np.zeros((e, max(n, 1)), dtype=np.int64)
        w0, w1 = (-np.inf, -np.inf) if window_s is None else window_s
        D = np.zeros(K.N_D)
        D[K.D_A], D[K.D_B], D[K.D_K] = cost.a, cost.b, cost.k
        D[K.D_MAX] = 1.0 if cost.combine == "max" else 0.0
        D[K.D_RANKS], D[K.D_BIN_S], D[K.D_W0], D[K.D_W1] = r, bin_s, w0, w1
        D[K.D_MIG_LAT], D[K.D_MIG_TOKEN] = migration_latency_s, migration_s_per_kv_token
        D[K.D_CAP] = math.inf if max_kv_tokens is None else float(max_kv_tokens)
        D[K.D_MOE] = cost.moe_s_per_token
        ACC = np.zeros(2 * K.N_DACC)
        BINS = np.zeros((N_BIN, NUM_BINS))
        # events of one kernel call: every request once, and once more preempted with a capacity
        EVR = np.zeros(n + 16 if max_kv_tokens is None else 2 * n + 16, dtype=np.int64)
        self.DI, self.DF, self.DK, self.DE, self.ACT = DI, DF, DK, DE, ACT
        self.D, self.ACC, self.BINS, self.EVR = D, ACC, BINS, EVR
        # The kernels are looked up now (tests swap them for their plain-Python versions).
        self._advance = K.decode_advance
        self._admit = K.decode_admit
        self._migrate = K.decode_migrate
        self._state = (DI, DF, DK, DE, ACT, D, ACC, BINS, EVR)
        self._admit_state = (DI, DF, DK, DE, D)
        self._migrate_state = (DI, DF, DK, DE, ACT, D)
        self._steps = np.zeros(e, dtype=np.int64)
        self.view = DecodeView(e, r, readonly(DK[K.DK_B]), readonly(DK[K.DK_S]),
                               readonly(self._steps), max_batch, self.limit)  # fmt: skip
        self._migrations = getattr(policy, "migrations", None)
        self.wait_s = np.zeros(n)
        self.refusal = np.zeros(n, dtype=np.int8)
        self.queue: deque[int] = deque()  # the wait queue (FIFO; preempted requests at its head)
        self._queued_at = np.zeros(n)
        self._seq = 0
        self.preemptions = 0
        self.migrations = 0
        self.migration_s = 0.0

    # ------------------------------------------------------------------ replay hooks
    def screen(self, request: int, t: float, /) -> bool:
        """Settle at handover what needs no decode step (one output token) or can never run on
        an empty rank (refused, with its reason); ``True`` for the rest."""
        i = request
        if self._out[i] == 1:
            self.DI[K.DI_RANK, i] = RANK_AT_HANDOVER
            self.DF[K.DF_JOIN, i] = t
            self.DF[K.DF_FINISH, i] = t
            return False
        if self.limit is not None and self._kv0[i] > self.limit:
            self.refusal[i] = _TOO_LONG
            return False
        if self.max_kv_tokens is not None and self._kv0[i] + self._out[i] - 1 > self.max_kv_tokens:
            self.refusal[i] = _OUTGROWS
            return False
        return True

    def step(self, t_until: float, /) -> bool:
        """Run the engines towards ``t_until`` and hand the events to the policy: finished
        requests, and preempted ones (which rejoin the wait queue's head, older first). At a
        step end where requests finished, the wait queue is offered again. ``True`` once the
        pool reached ``t_until``."""
        DE = self.DE
        nev, complete, last_t = self._advance(t_until, *self._state)
        self._steps[:] = DE[K.DE_STEPS]
        if nev:
            DI, DF, D = self.DI, self.DF, self.D
            now = t_until if complete and t_until < math.inf else float(DE[K.DE_READY].max())
            if not complete:
                now = last_t
            ev = self.EVR[:nev]
            back = ev < 0
            if back.any():  # preempted: they left their rank too
                left = np.where(back, -1 - ev, ev)
                self.policy.observe(left, now_s=now, view=self.view)
                ids = left[back]
                ids = ids[np.argsort(DI[K.DI_SEQ, ids], kind="stable")]
                self.queue.extendleft(ids[::-1].tolist())
                self._queued_at[ids] = DF[K.DF_JOIN, ids]  # the preemption time
                self.preemptions += int(ids.size)
                D[K.D_STOP] = 1.0
            else:
                self.policy.observe(ev, now_s=now, view=self.view)
            if self.queue and not complete and D[K.D_STOP] > 0 and ev[-1] >= 0:
                self._offer_queue(now)  # the kernel stopped at a step end where requests finished
        return bool(complete)

    def offer(self, request: int, t: float, /) -> bool:
        """Apply the policy's migrations at ``t``, then place the request, or queue it (behind
        any request already waiting). Never refuses (``True``)."""
        i = request
        if self._migrations is not None:
            self.migrate(self._migrations(now_s=t, view=self.view), t)
        if self.queue or not self._place(i, t):
            self.queue.append(i)
            self._queued_at[i] = t
            self.D[K.D_STOP] = 1.0
            if not self.DK[K.DK_B].any():
                self._offer_queue(t)  # nothing runs: no step end would offer the queue
        return True

    def retry(self, horizon_s: float, /) -> bool:
        """Without a horizon, offer a wait queue left behind by an empty pool once more (only
        policy refusals on an empty pool remain then)."""
        if self.queue and horizon_s == math.inf:
            self._offer_queue(float(self.DE[K.DE_READY].max()))
            return True
        return False

    # ------------------------------------------------------------------ state
    def admit(self, request: int, rank: int, t: float, /) -> None:
        """Admit ``request`` to flat ``rank`` at ``t``: it joins the engine's next step."""
        self._admit(request, rank, t, self._seq, *self._admit_state)
        self._seq += 1

    def migrate(self, moves: Any, t: float, /) -> None:
        """Apply a policy's migrations ``[(request, flat rank), ...]`` at ``t`` (see the protocol).

        Counts the moves and sums their transfer times (``migrations``, ``migration_s``).
        """
        DI, D, nr = self.DI, self.D, self.num_ranks
        count, total_s = 0, 0.0
        for i, g in moves:
            if not 0 <= g < nr:
                raise ValueError(
                    f"policy {self.name!r} migrated request {i} to rank {g} outside [0, {nr})"
                )
            same = DI[K.DI_RANK, i] == g
            if not same and self._over_capacity(g, DI[K.DI_KV, i]):
                raise ValueError(
                    f"policy {self.name!r} migrated request {i} beyond a rank's capacity"
                )
            code = self._migrate(i, g, t, *self._migrate_state)
            if code == -1:
                raise ValueError(f"policy {self.name!r} migrated request {i}, which is not running")
            if same:
                continue
            count += 1
            total_s += float(D[K.D_MIG_LAT] + D[K.D_MIG_TOKEN] * DI[K.DI_KV, i])
        self.migrations += count
        self.migration_s += total_s  # summed per call first, as the run's figure always was

    def _over_capacity(self, f: int, kv: int) -> bool:
        """Whether one more request of ``kv`` tokens on flat rank ``f`` exceeds a capacity."""
        mb, mk = self.max_batch, self.limit
        return (mb is not None and self.DK[K.DK_B, f] + 1 > mb) or (
            mk is not None and self.DK[K.DK_S, f] + kv > mk
        )

    def _place(self, i: int, t: float) -> bool:
        """Offer request ``i`` to the policy at ``t``; admit it if it is placed."""
        kv = int(self.DI[K.DI_KV, i])
        f = self.policy.route(i, kv, now_s=t, view=self.view)
        if f < 0:
            return False
        if not 0 <= f < self.num_ranks:
            raise ValueError(
                f"policy {self.name!r} returned rank {f} outside [0, {self.num_ranks})"
            )
        if self._over_capacity(f, kv):
            raise ValueError(f"policy {self.name!r} placed request {i} beyond a rank's capacity")
        self.admit(i, f, t)
        return True

    def _offer_queue(self, t: float) -> None:
        """Offer the wait queue's head to the policy, in order, until one is not placed."""
        queue = self.queue
        while queue:
            i = queue[0]
            if not self._place(i, t):
                if self.DK[K.DK_B].any():
                    break
                self.refusal[i] = _POLICY  # refused on an empty pool
            else:
                self.wait_s[i] += t - self._queued_at[i]
            queue.popleft()
        self.D[K.D_STOP] = 1.0 if queue else 0.0

    def result(self, horizon_s: float, /) -> DecodeRun:
        """The record of the replay so far (stopped at ``horizon_s``)."""
        fin = self.DF[K.DF_FINISH]
        end = float(np.nanmax(fin)) if (~np.isnan(fin)).any() else 0.0
        if horizon_s < math.inf:
            end = horizon_s
        ACC = self.ACC
        return DecodeRun(
            policy=self.name,
            num_engines=self.num_engines,
            ranks_per_engine=self.ranks_per_engine,
            cost=self.cost,
            handover_s=self.handover_s,
            rank=self.DI[K.DI_RANK].copy(),
            finish_s=fin.copy(),
            output_tokens=np.asarray(self._out),
            step_mean_s=float(ACC[K.DACC_MEAN]),
            step_max_s=float(ACC[K.DACC_MAX]),
            step_time_s=float(ACC[K.DACC_TIME]),
            count_imbalance_s=float(ACC[K.DACC_BIMB]),
            kv_imbalance_s=float(ACC[K.DACC_SIMB]),
            count_floor_s=float(ACC[K.DACC_BFLOOR]),
            num_steps=int(ACC[K.DACC_STEPS]),
            tokens_generated=int(ACC[K.DACC_TOKENS]),
            bin_s=self.bin_s,
            bin_mean_s=self.BINS[BIN_MEAN].copy(),
            bin_max_s=self.BINS[BIN_MAX].copy(),
            end_s=end,
            window_s=self.window_s,
            window_sums=None if self.window_s is None else ACC[K.DACC_W :].copy(),
            migrations=self.migrations,
            migration_s=self.migration_s,
            wait_s=self.wait_s,
            refusal=self.refusal,
            preemptions=self.preemptions,
            kv_capacity_tokens=self.max_kv_tokens,
        )


def warmup_migrate() -> None:
    """Compile the migration kernel on a tiny state (a replay compiles the others)."""
    DI = np.zeros((K.N_DI, 1), dtype=np.int64)
    DI[K.DI_LEFT] = 1
    DI[K.DI_POS] = -1
    DK = np.ones((K.N_DK, 2), dtype=np.int64)
    D = np.full(K.N_D, 2.0)
    D[K.D_MIG_LAT] = 0.0
    D[K.D_MIG_TOKEN] = 0.0
    D[K.D_CAP] = np.inf
    DE = np.zeros((K.N_DE, 1))
    ACT = np.zeros((1, 1), np.int64)
    K.decode_migrate(0, 1, 0.0, DI, np.zeros((K.N_DF, 1)), DK, DE, ACT, D)
