"""``EplbScheduler``: accumulate expert loads and re-plan the placement only when it pays.

The scheduler holds the plan in service and a load estimate: the sum of the last ``window``
recordings (sliding window) or an exponential moving average (``ema_alpha``). Recordings whose
total is zero (an idle engine, a dense layer dump) are ignored.
:meth:`EplbScheduler.maybe_rebalance` decides, in this order (the first rule that applies gives
the reason):

1. no load recorded yet: skip;
2. fewer than ``min_interval_s`` seconds since the last re-plan: skip;
3. the plan in service is within ``min_gain`` of the lower bound (already balanced): skip;
4. re-plan with :func:`lbkit.eplb.replan.replan_experts` (few moves, never worse than keeping
   the plan per layer); skip unless the predicted mean ``moe_lb`` drops by at least a relative
   ``min_gain``; otherwise adopt it.

**Robust option** (``robust_windows=k``, window mode): the window is cut into ``k`` consecutive
chunks of recordings; candidates are the re-plans for each chunk and for the whole window, plus
the plan in service, and each layer takes the candidate whose *worst* ``moe_lb`` over the chunks
is lowest (ties: fewer moves, then the whole-window candidate). The predicted ``moe_lb`` is then
that worst case, so a plan fitted to one burst of traffic is not adopted if it hurts the others.

Time comes in as ``now_s``; nothing reads a clock. The state is plain JSON types
(:meth:`EplbScheduler.state_dict`), so a restarted router keeps its plan and window.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_float_array, as_int_array, check_int, check_real
from lbkit.eplb._plan import EplbPlan, finish_plan, rebalance_iv
from lbkit.eplb.bounds import lower_bound, moe_lb
from lbkit.eplb.placement import check_placement
from lbkit.eplb.rebalance import rebalance_experts
from lbkit.eplb.replan import (
    DEFAULT_TOLERANCE,
    ExpertMoves,
    moves_list,
    replan_experts,
    replan_iv,
)

__all__ = ["EplbScheduler", "EplbSchedulerStats", "RebalanceDecision"]

_FORMAT = "lbkit.eplb.EplbScheduler"
_VERSION = 1


@dataclass(frozen=True)
class EplbSchedulerStats:
    """Snapshot of an :class:`EplbScheduler` (see :meth:`EplbScheduler.statistics`)."""

    num_recordings: int  # recordings accepted
    num_ignored: int  # empty recordings ignored
    window_recordings: int  # recordings in the current estimate (window mode) or 1/0 (EMA)
    num_replans: int  # decisions that adopted a new plan
    num_skipped: int  # decisions that kept the plan
    total_moves: int  # replicas moved over all adopted re-plans
    last_replan_s: float | None  # now_s of the last adopted re-plan
    current_moe_lb: float  # mean moe_lb of the plan in service under the estimate (nan: none)


class RebalanceDecision(NamedTuple):
    """Outcome of :meth:`EplbScheduler.maybe_rebalance`.

    Attributes
    ----------
    replanned : bool
        ``True`` when the new plan was adopted.
    reason : str
        Why (module docstring): ``"no load recorded"``, ``"min interval not passed"``,
        ``"already balanced"``, ``"gain below min_gain"`` or ``"re-planned"``.
    plan : EplbPlan or None
        The adopted plan (``None`` when skipped).
    moves : ExpertMoves or None
        Moves from the previous plan (``None`` when skipped).
    num_moves : int
        ``len(moves.slot)``, 0 when skipped.
    moe_lb_before, moe_lb_after : float
        Predicted mean ``moe_lb`` over layers of the plan in service and of the candidate
        (worst over chunks with ``robust_windows > 1``); ``nan`` when not computed.
    """

    replanned: bool
    reason: str
    plan: EplbPlan | None
    moves: ExpertMoves | None
    num_moves: int
    moe_lb_before: float
    moe_lb_after: float


class EplbScheduler:
    """Decide when to re-plan an EPLB placement and re-plan it with few moves.

    Parameters
    ----------
    num_layers, num_experts : int
        Shape of every load recording ``[num_layers, num_experts]``.
    num_replicas, num_groups, num_nodes, num_gpus : int
        As in :func:`lbkit.eplb.rebalance_experts`.
    policy : {None, "global", "hierarchical"}
        As in :func:`lbkit.eplb.rebalance_experts`.
    window : int, default 8
        Recordings kept by the sliding window (window mode).
    ema_alpha : float in (0, 1], optional
        Use an exponential moving average with this weight of the newest recording instead.
    min_interval_s : float, default 600
        Seconds between two adopted re-plans.
    min_gain : float, default 0.02
        Relative drop of the predicted mean ``moe_lb`` required to re-plan.
    robust_windows : int, default 1
        Chunks of the window to plan against (module docstring); window mode only.
    max_moves, max_moves_total, tolerance, tolerance_scope
        Passed to :func:`lbkit.eplb.replan.replan_experts` (default: the mean ``moe_lb`` over
        layers within 1% of a fresh plan's).
    initial_phy2log : array_like of int, shape (num_layers, num_replicas), optional
        Plan in service; default the plan for uniform loads.

    Examples
    --------
    >>> from lbkit.eplb import synthetic_expert_load, drift
    >>> sched = EplbScheduler(2, 16, 20, 4, 1, 4, window=2, min_interval_s=60.0)
    >>> w = synthetic_expert_load(2, 16, rng=0)
    >>> sched.record(w), sched.record(w * 0)
    (True, False)
    >>> d = sched.maybe_rebalance(now_s=0.0)
    >>> d.replanned, d.reason, d.moe_lb_after < d.moe_lb_before
    (True, 're-planned', True)
    >>> sched.maybe_rebalance(now_s=30.0).reason
    'min interval not passed'
    >>> sched._check()
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_gpus: int,
        /,
        *,
        policy: str | None = None,
        window: int = 8,
        ema_alpha: float | None = None,
        min_interval_s: float = 600.0,
        min_gain: float = 0.02,
        robust_windows: int = 1,
        max_moves: Any = None,
        max_moves_total: int | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
        tolerance_scope: str = "mean",
        initial_phy2log: Any = None,
    ) -> None:
        num_layers = check_int(num_layers, "num_layers", min_value=1)
        num_experts = check_int(num_experts, "num_experts", min_value=1)
        ones = np.ones((num_layers, num_experts))
        self._problem = rebalance_iv(ones, num_replicas, num_groups, num_nodes, num_gpus, policy)
        self._sizes = (int(num_replicas), int(num_groups), int(num_nodes), int(num_gpus))
        self._policy = "hierarchical" if self._problem.hierarchical else "global"
        self._window = check_int(window, "window", min_value=1)
        if ema_alpha is not None:
            ema_alpha = check_real(ema_alpha, "ema_alpha", min_value=0.0, strict_min=True)
            if ema_alpha > 1.0:
                raise ValueError(f"ema_alpha: must be <= 1, got {ema_alpha}")
        self._alpha = ema_alpha
        self._min_interval_s = check_real(min_interval_s, "min_interval_s", min_value=0.0)
        self._min_gain = check_real(min_gain, "min_gain", min_value=0.0)
        self._robust = check_int(robust_windows, "robust_windows", min_value=1)
        if self._robust > 1 and ema_alpha is not None:
            raise ValueError("robust_windows: needs window mode (ema_alpha=None)")
        if self._robust > self._window:
            raise ValueError(
                f"robust_windows: must be <= window ({self._window}), got {self._robust}"
            )
        self._max_moves = max_moves
        self._max_moves_total = max_moves_total
        self._tolerance = check_real(tolerance, "tolerance", min_value=0.0)
        if initial_phy2log is None:
            phy2log = rebalance_experts(ones, *self._sizes, policy=self._policy).phy2log
        else:
            phy2log = self._check_phy2log(initial_phy2log, "initial_phy2log")
        # Validate the budgets once (replan_experts would raise later otherwise).
        replan_iv(ones, phy2log, *self._sizes, self._policy, max_moves, max_moves_total,
                   tolerance, 0.0, tolerance_scope)  # fmt: skip
        self._scope = str(tolerance_scope)
        self._phy2log = phy2log
        self._recordings: deque[np.ndarray] = deque(maxlen=self._window)
        self._ema: np.ndarray | None = None
        self._num_recordings = 0
        self._num_ignored = 0
        self._num_replans = 0
        self._num_skipped = 0
        self._total_moves = 0
        self._last_replan_s: float | None = None
        self._last_now_s: float | None = None

    # ---------------------------------------------------------------------------------------
    def _check_phy2log(self, value: Any, name: str) -> np.ndarray:
        ones = np.ones(self._problem.weight.shape)
        try:
            args = replan_iv(ones, value, *self._sizes, self._policy, None, None, 0.0, 0.0)
        except ValueError as exc:
            raise ValueError(str(exc).replace("previous_phy2log", name, 1)) from None
        return args.previous.copy()

    @property
    def phy2log(self) -> np.ndarray:
        """The plan in service, ``[num_layers, num_replicas]`` (a copy)."""
        return self._phy2log.copy()

    @property
    def plan(self) -> EplbPlan:
        """The plan in service as ``(phy2log, log2phy, logcnt)``."""
        return self._as_plan(self._phy2log)

    def _as_plan(self, phy2log: np.ndarray) -> EplbPlan:
        layers, slots = phy2log.shape
        logcnt = np.zeros(self._problem.weight.shape, dtype=np.int64)
        np.add.at(logcnt, (np.repeat(np.arange(layers), slots), phy2log.ravel()), 1)
        return finish_plan(self._problem, phy2log.copy(), logcnt)

    def window_load(self) -> np.ndarray | None:
        """The load estimate ``[num_layers, num_experts]`` (``None`` before any recording)."""
        if self._alpha is not None:
            return None if self._ema is None else self._ema.copy()
        if not self._recordings:
            return None
        return np.sum(self._recordings, axis=0)

    def record(self, load: Any, /) -> bool:
        """Add one recording of expert loads ``[num_layers, num_experts]`` (e.g. routed tokens).

        Returns ``False`` (and changes nothing) when the recording is all zeros.

        Raises
        ------
        TypeError, ValueError
            Non-numeric, wrong shape, NaN, infinite or negative loads (state unchanged).
        """
        w = as_float_array(load, "load", shape=self._problem.weight.shape, nonnegative=True)
        if not w.any():
            self._num_ignored += 1
            return False
        self._num_recordings += 1
        if self._alpha is None:
            self._recordings.append(w.copy())
        elif self._ema is None:
            self._ema = w.copy()
        else:
            self._ema = self._alpha * w + (1.0 - self._alpha) * self._ema
        return True

    def _chunks(self) -> list[np.ndarray]:
        recs = list(self._recordings)
        k = min(self._robust, len(recs))
        bounds = np.linspace(0, len(recs), k + 1).round().astype(int)
        return [np.sum(recs[a:b], axis=0) for a, b in itertools.pairwise(bounds)]

    def _score(self, phy2log: np.ndarray, loads: list[np.ndarray]) -> np.ndarray:
        """Per-layer worst moe_lb of ``phy2log`` over ``loads``."""
        g = self._sizes[3]
        return np.max([moe_lb(w, phy2log, num_gpus=g) for w in loads], axis=0)

    def maybe_rebalance(self, *, now_s: float) -> RebalanceDecision:
        """Re-plan if it pays (module docstring); returns the decision.

        Raises
        ------
        ValueError
            ``now_s`` not finite or earlier than a previous call's (state unchanged).

        Runtime complexity: a lower bound, then 1 (or ``robust_windows + 1``) calls of
        :func:`lbkit.eplb.replan.replan_experts`.
        """
        now_s = check_real(now_s, "now_s")
        if self._last_now_s is not None and now_s < self._last_now_s:
            raise ValueError(f"now_s: must not decrease (last {self._last_now_s}, got {now_s})")
        self._last_now_s = now_s
        nan = float("nan")
        load = self.window_load()
        if load is None:
            return self._skip("no load recorded", nan, nan)
        if self._last_replan_s is not None and now_s - self._last_replan_s < self._min_interval_s:
            return self._skip("min interval not passed", nan, nan)
        loads = self._chunks() if self._robust > 1 else [load]
        before_l = self._score(self._phy2log, loads)
        before = float(before_l.mean())
        r, k, n, g = self._sizes
        bound = float(lower_bound(load, r, k, n, g, policy=self._policy).mean())
        if before <= bound * (1.0 + self._min_gain):
            return self._skip("already balanced", before, nan)
        kw = dict(
            policy=self._policy,
            max_moves=self._max_moves,
            max_moves_total=self._max_moves_total,
            tolerance=self._tolerance,
            tolerance_scope=self._scope,
        )
        result = replan_experts(load, self._phy2log, r, k, n, g, **kw)
        new, moves = result.plan.phy2log, result.num_moves
        if self._robust > 1:
            cands = [(self._phy2log, np.zeros_like(moves)), (new, moves)]
            for w in loads:
                res = replan_experts(w, self._phy2log, r, k, n, g, **kw)
                cands.append((res.plan.phy2log, res.num_moves))
            scores = np.array([self._score(p, loads) for p, _ in cands])  # (cands, layers)
            cand_moves = np.array([m for _, m in cands])
            pick = np.lexsort((cand_moves, scores), axis=0)[0]
            cols = np.arange(len(pick))
            new = np.stack([cands[c][0][i] for i, c in enumerate(pick)])
            moves = cand_moves[pick, cols]
            if self._max_moves_total is not None and moves.sum() > self._max_moves_total:
                new, moves = result.plan.phy2log, result.num_moves
        new = np.asarray(new, dtype=np.int64)
        after = float(self._score(new, loads).mean())
        if before - after < self._min_gain * before:
            return self._skip("gain below min_gain", before, after)
        move_list = moves_list(self._phy2log, new, g, self._sizes[2])
        self._phy2log = new
        self._last_replan_s = now_s
        self._num_replans += 1
        self._total_moves += int(moves.sum())
        return RebalanceDecision(
            True, "re-planned", self._as_plan(new), move_list, int(moves.sum()), before, after
        )

    def _skip(self, reason: str, before: float, after: float) -> RebalanceDecision:
        self._num_skipped += 1
        return RebalanceDecision(False, reason, None, None, 0, before, after)

    # ---------------------------------------------------------------------------------------
    def statistics(self) -> EplbSchedulerStats:
        """A frozen snapshot of the counters and the balance of the plan in service."""
        load = self.window_load()
        cur = math.nan
        if load is not None:
            cur = float(moe_lb(load, self._phy2log, num_gpus=self._sizes[3]).mean())
        if self._alpha is None:
            n = len(self._recordings)
        else:
            n = int(self._ema is not None)
        return EplbSchedulerStats(
            self._num_recordings,
            self._num_ignored,
            n,
            self._num_replans,
            self._num_skipped,
            self._total_moves,
            self._last_replan_s,
            cur,
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as JSON-serialisable plain types."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "config": {
                "num_layers": int(self._problem.weight.shape[0]),
                "num_experts": int(self._problem.weight.shape[1]),
                "num_replicas": self._sizes[0],
                "num_groups": self._sizes[1],
                "num_nodes": self._sizes[2],
                "num_gpus": self._sizes[3],
                "policy": self._policy,
                "window": self._window,
                "ema_alpha": self._alpha,
                "min_interval_s": self._min_interval_s,
                "min_gain": self._min_gain,
                "robust_windows": self._robust,
                "max_moves": (
                    self._max_moves
                    if self._max_moves is None or np.ndim(self._max_moves) == 0
                    else np.asarray(self._max_moves).tolist()
                ),
                "max_moves_total": self._max_moves_total,
                "tolerance": self._tolerance,
                "tolerance_scope": self._scope,
            },
            "phy2log": self._phy2log.tolist(),
            "recordings": [r.tolist() for r in self._recordings],
            "ema": None if self._ema is None else self._ema.tolist(),
            "num_recordings": self._num_recordings,
            "num_ignored": self._num_ignored,
            "num_replans": self._num_replans,
            "num_skipped": self._num_skipped,
            "total_moves": self._total_moves,
            "last_replan_s": self._last_replan_s,
            "last_now_s": self._last_now_s,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> EplbScheduler:
        """Rebuild a scheduler from :meth:`state_dict` (validated like the constructor).

        Raises
        ------
        ValueError
            Unknown format or version, or values that the constructor or :meth:`record` would
            reject.
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"state: must be a dict with format {_FORMAT!r}")
        if state.get("version") != _VERSION:
            raise ValueError(f"state: unsupported version {state.get('version')!r}")
        c = dict(state["config"])
        sizes = [c.pop(k) for k in ("num_layers", "num_experts", "num_replicas", "num_groups",
                                    "num_nodes", "num_gpus")]  # fmt: skip
        sched = cls(*sizes, initial_phy2log=state["phy2log"], **c)
        recs = state["recordings"]
        if sched._alpha is not None and recs:
            raise ValueError("state: recordings are only kept in window mode")
        if len(recs) > sched._window:
            raise ValueError(f"state: more recordings ({len(recs)}) than window ({sched._window})")
        for r in recs:
            if not sched.record(r):
                raise ValueError("state: recordings must not be all zeros")
        if state["ema"] is not None:
            if sched._alpha is None:
                raise ValueError("state: ema is only kept in EMA mode")
            sched.record(state["ema"])
        for key in ("num_recordings", "num_ignored", "num_replans", "num_skipped", "total_moves"):
            setattr(sched, f"_{key}", check_int(state[key], key, min_value=0))
        for key in ("last_replan_s", "last_now_s"):
            v = state[key]
            setattr(sched, f"_{key}", None if v is None else check_real(v, key))
        sched._check()
        return sched

    def _check(self) -> None:
        """Assert every internal invariant (tests call this after each step)."""
        layers, experts = self._problem.weight.shape
        r, k, n, g = self._sizes
        p2l = as_int_array(self._phy2log, "phy2log", shape=(layers, r))
        plan = self._as_plan(p2l)
        check_placement(*plan, num_experts=experts, num_gpus=g, num_groups=k, num_nodes=n,
                        policy=self._policy)  # fmt: skip
        assert (plan.logcnt >= 1).all() and (plan.logcnt.sum(axis=1) == r).all()
        assert len(self._recordings) <= self._window
        for rec in self._recordings:
            assert rec.shape == (layers, experts) and (rec >= 0).all() and rec.any()
        assert (self._alpha is None) == (self._ema is None) or self._ema is None
        if self._alpha is not None:
            assert not self._recordings
        if self._ema is not None:
            assert self._ema.shape == (layers, experts) and (self._ema >= 0).all()
        assert self._num_recordings >= len(self._recordings)
        assert min(self._num_ignored, self._num_replans, self._num_skipped) >= 0
        assert self._total_moves >= 0
        assert (self._last_replan_s is None) == (self._num_replans == 0) or (
            self._last_replan_s is not None
        )
        if self._last_replan_s is not None:
            assert self._last_now_s is not None and self._last_replan_s <= self._last_now_s
