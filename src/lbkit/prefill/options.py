"""The options of :class:`~lbkit.prefill.PrefillBalancer`, in three frozen objects.

- :class:`RankChoice`: how a request picks its rank among the engines serving its bucket (the
  rule and the refinements that apply to it);
- :class:`Buckets`: the length buckets and their per-bucket engine bounds;
- :class:`Rounds`: how often engines are re-planned between buckets, and with what hysteresis.

Their defaults are the configuration ``lbkit bench`` measures (the ``lbkit`` policy of
:mod:`lbkit.sim.policies`): the lockstep rule on one bucket. Each object validates itself when
it is made: a value out of range is a ``ValueError`` (``TypeError`` for a wrong type) naming the
field, and a field that does not apply to the chosen rule is a ``ValueError`` naming both, so
that a contradictory configuration cannot be expressed.

Examples
--------
>>> RankChoice(rule="least_load", wake_penalty_s=0.05)
RankChoice(rule='least_load', step_budget_s=1.0, growth_weight=0.6, idle_growth_weight=0.1, sample=None, wake_penalty_s=0.05, fill_holes=False, spill_ratio=None)
>>> RankChoice(sample=4)
Traceback (most recent call last):
...
ValueError: sample: applies to rule='least_load' only, not to rule='lockstep'
>>> Buckets(edges=(16384, 65536)).num_buckets
3
"""  # noqa: E501

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from lbkit.core.validation import as_int_array, check_choice, check_int, check_real
from lbkit.prefill.apportion import DEFAULT_METHOD, METHODS
from lbkit.prefill.buckets import check_edges

__all__ = ["RANK_RULES", "Buckets", "RankChoice", "Rounds"]

#: Rank-choice rules: the earliest estimated finish with engines in lockstep
#: (:mod:`lbkit.prefill.lockstep`), the least quota load (:func:`lbkit.prefill.pick_rank`), and
#: the least mean quota load of an engine, for engines with context parallelism.
RANK_RULES = ("lockstep", "least_load", "engine_mean")

#: The rules each rule-specific field of :class:`RankChoice` applies to.
_APPLIES = {
    "step_budget_s": ("lockstep",),
    "growth_weight": ("lockstep",),
    "idle_growth_weight": ("lockstep",),
    "sample": ("least_load",),
    "wake_penalty_s": ("least_load", "engine_mean"),
    "fill_holes": ("least_load",),
}


def _rules(names: tuple[str, ...]) -> str:
    return " or ".join(f"rule={n!r}" for n in names)


@dataclass(frozen=True, slots=True)
class RankChoice:
    """How a request picks its rank among the engines that serve its bucket.

    Parameters
    ----------
    rule : {"lockstep", "least_load", "engine_mean"}, default "lockstep"
        ``"lockstep"``: the earliest estimated finish with the ranks of an engine stepping
        together (:mod:`lbkit.prefill.lockstep`; cache-aware with per-rank ``cached_tokens``).
        ``"least_load"``: the least quota load (lowest flat index on ties).
        ``"engine_mean"``: for engines with context parallelism (an engine's idle ranks help a
        busy rank's prompt chunk, so it finishes its work in about its *mean* rank load): the
        engine of the bucket with the least mean quota load (ties: the lowest), then its least
        loaded rank (the queue owner).
    step_budget_s : float, default 1.0
        ``"lockstep"`` only: the engines' step time budget, seconds (> 0).
    growth_weight : float, default 0.6
        ``"lockstep"`` only: seconds of score per second a request adds to the busiest rank of
        a busy engine (>= 0): it delays the requests already sharing that engine's steps.
    idle_growth_weight : float, default 0.1
        ``"lockstep"`` only: the same for an idle engine that the request wakes (>= 0).
    sample : int, optional
        ``"least_load"`` only: power-of-d choices, the best of ``sample`` ranks drawn with the
        balancer's ``rng`` instead of the full argmin (>= 1).
    wake_penalty_s : float, optional
        ``"least_load"`` and ``"engine_mean"``: a rank of an idle engine (all its ranks at zero
        load) scores ``wake_penalty_s`` seconds more, so requests fill the engines that step
        already before they wake an idle one (>= 0).
    fill_holes : bool, default False
        ``"least_load"`` only: a request whose own choice would lengthen its engine's steps may
        go to a rank of any active engine, of any bucket, where it runs within that engine's
        steps (its load plus the request's quota stays within the engine's busiest rank), when
        that rank's load is at most the own choice's score; the least loaded such rank wins
        (ties: buckets in order, then the lowest engine and rank). Reason ``"fill"``.
    spill_ratio : float, optional
        Any rule: send a request to a neighbouring bucket's engines when its own best score is
        above ``spill_ratio`` times the neighbour's (>= 1). Off by default.

    Raises
    ------
    ValueError
        A value out of range, an unknown rule, or a field set away from its default for a rule
        it does not apply to.
    TypeError
        A value of the wrong type.
    """

    rule: str = "lockstep"
    step_budget_s: float = 1.0
    growth_weight: float = 0.6
    idle_growth_weight: float = 0.1
    sample: int | None = None
    wake_penalty_s: float | None = None
    fill_holes: bool = False
    spill_ratio: float | None = None

    def __post_init__(self) -> None:
        rule = check_choice(self.rule, "rule", RANK_RULES)
        put = object.__setattr__
        put(self, "step_budget_s", check_real(self.step_budget_s, "step_budget_s",
                                              min_value=0.0, strict_min=True))  # fmt: skip
        put(self, "growth_weight", check_real(self.growth_weight, "growth_weight", min_value=0.0))
        put(self, "idle_growth_weight",
            check_real(self.idle_growth_weight, "idle_growth_weight", min_value=0.0))  # fmt: skip
        if self.sample is not None:
            put(self, "sample", check_int(self.sample, "sample", min_value=1))
        if self.wake_penalty_s is not None:
            put(self, "wake_penalty_s",
                check_real(self.wake_penalty_s, "wake_penalty_s", min_value=0.0))  # fmt: skip
        if not isinstance(self.fill_holes, (bool, np.bool_)):
            raise TypeError(f"fill_holes: must be a bool, got {type(self.fill_holes).__name__}")
        put(self, "fill_holes", bool(self.fill_holes))
        if self.spill_ratio is not None:
            put(self, "spill_ratio", check_real(self.spill_ratio, "spill_ratio", min_value=1.0))
        defaults = {f.name: f.default for f in fields(self)}
        for name, rules in _APPLIES.items():
            if rule not in rules and getattr(self, name) != defaults[name]:
                raise ValueError(f"{name}: applies to {_rules(rules)} only, not to rule={rule!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON types (``RankChoice(**d)`` rebuilds the object)."""
        return asdict(self)


def _bounds(value: Any, name: str, nb: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(as_int_array(value, name, shape=(nb,), min_value=0).tolist())


@dataclass(frozen=True, slots=True)
class Buckets:
    """The length buckets of requests and the engines each may hold.

    Parameters
    ----------
    edges : sequence of int, default ``()``
        Bucket edges in tokens, strictly increasing, lower edge inclusive: ``len(edges) + 1``
        buckets. Default: one bucket, the whole pool (DeepSeek's length buckets,
        :data:`~lbkit.prefill.DEFAULT_EDGES`, cost goodput with the lockstep rule on every
        scenario of ``benchmarks/goodput_world.py``; see docs/simulator.md).
    min_engines, max_engines : sequence of int, length ``num_buckets``, optional
        Per-bucket bounds on the engines of a bucket; a round in which the engines in service
        cannot meet them re-plans without them.
    initial_engines : sequence of int, length ``num_buckets``, optional
        Engines per bucket at the start (summing to the pool's engines), given to buckets in
        index order (engine 0 to the lowest bucket). Default: the pool spread evenly, or all in
        the lowest bucket under a cold start (:class:`Rounds`).

    The lengths of the bounds are checked here; their sums against the pool's engines when a
    balancer is made (``ValueError`` naming the field).

    Raises
    ------
    ValueError, TypeError
        Edges not strictly increasing positive integers, bounds of the wrong length or negative,
        or a minimum above its bucket's maximum.
    """

    edges: tuple[int, ...] = ()
    min_engines: tuple[int, ...] | None = None
    max_engines: tuple[int, ...] | None = None
    initial_engines: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        edges = check_edges(self.edges, allow_empty=True)
        put(self, "edges", edges)
        nb = len(edges) + 1
        for name in ("min_engines", "max_engines", "initial_engines"):
            put(self, name, _bounds(getattr(self, name), name, nb))
        lo, hi = self.min_engines, self.max_engines
        if lo is not None and hi is not None:
            for j, (a, b) in enumerate(zip(lo, hi, strict=True)):
                if a > b:
                    raise ValueError(
                        f"min_engines, max_engines: bucket {j} has minimum {a} above its cap {b}"
                    )

    @property
    def num_buckets(self) -> int:
        """Number of buckets, ``len(edges) + 1``."""
        return len(self.edges) + 1

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON types (lists; ``Buckets(**d)`` rebuilds the object)."""
        return {f.name: _listed(getattr(self, f.name)) for f in fields(self)}


def _listed(value: Any) -> Any:
    return None if value is None else list(value)


@dataclass(frozen=True, slots=True)
class Rounds:
    """When and how engines are re-planned between buckets (nothing moves with one bucket).

    Parameters
    ----------
    round_s : float, default 30
        Nominal round length, seconds (> 0); :meth:`PrefillBalancer.round_due` tells the caller
        when to call :meth:`PrefillBalancer.end_round`.
    ema_alpha : float in (0, 1], default 0.5
        Weight of the latest round in the demand EMA (1: no smoothing).
    deadband : float in [0, 1], default 0.1
        Relative improvement of the bottleneck a re-plan must bring (:func:`rebalance`).
    max_moves : int, default 2
        Engines moved per round at most (>= 0).
    min_dwell_s : float, default 60
        Seconds before an engine may move again (>= 0).
    method : str, default "adams"
        Apportionment method (:data:`~lbkit.prefill.METHODS`).
    cold_start_s : float or None, default 5
        Cold start: the pool starts as one group (every engine in the lowest bucket, within
        ``max_engines``, unless ``initial_engines`` is given), the first round lasts
        ``cold_start_s`` seconds, and its re-plan moves engines to the ideal allocation of the
        demand seen so far, free of hysteresis: buckets that saw no request get no engine.
        ``None``: the first round is an ordinary one.
    max_drain_s : float or None, default 30
        An engine whose busiest rank holds more than ``max_drain_s`` seconds of quota does not
        move (its drain would keep it from both buckets that long). ``None``: any active engine
        may move.

    Raises
    ------
    ValueError, TypeError
        A value out of range or of the wrong type, or an unknown method.
    """

    round_s: float = 30.0
    ema_alpha: float = 0.5
    deadband: float = 0.1
    max_moves: int = 2
    min_dwell_s: float = 60.0
    method: str = DEFAULT_METHOD
    cold_start_s: float | None = 5.0
    max_drain_s: float | None = 30.0

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "round_s", check_real(self.round_s, "round_s", min_value=0.0, strict_min=True))
        put(self, "ema_alpha", check_real(self.ema_alpha, "ema_alpha", min_value=0.0,
                                          max_value=1.0, strict_min=True))  # fmt: skip
        put(self, "deadband",
            check_real(self.deadband, "deadband", min_value=0.0, max_value=1.0))  # fmt: skip
        put(self, "max_moves", check_int(self.max_moves, "max_moves", min_value=0))
        put(self, "min_dwell_s", check_real(self.min_dwell_s, "min_dwell_s", min_value=0.0))
        check_choice(self.method, "method", tuple(METHODS))
        if self.cold_start_s is not None:
            put(self, "cold_start_s", check_real(self.cold_start_s, "cold_start_s",
                                                 min_value=0.0, strict_min=True))  # fmt: skip
        if self.max_drain_s is not None:
            put(self, "max_drain_s", check_real(self.max_drain_s, "max_drain_s", min_value=0.0))

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON types (``Rounds(**d)`` rebuilds the object)."""
        return asdict(self)
