"""Saving and restoring a :class:`~lbkit.prefill.PrefillBalancer`: its state as plain types.

A state is ``{"version": 2, "config": ..., "state": ...}`` of JSON types: the configuration
(pool, cost model, and the three option objects as dicts) and the ledger, engines, round and
counters. :func:`read_config` also reads version-1 states (the flat keyword options of the
balancer before the option objects). :func:`read_state` checks every field of a state before the
balancer trusts it: a ``ValueError`` names the field (``state.requests[3]``, ...) and the rule it
breaks. Nothing here relies on ``assert`` (which ``python -O`` drops).

:class:`Persistent` holds the balancer's :meth:`~Persistent.state_dict` and
:meth:`~Persistent.from_state_dict` (and pickling through them), which
:class:`~lbkit.prefill.PrefillBalancer` inherits.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from functools import partial
from typing import Any, Self

import numpy as np

from lbkit.core.cost import QuadraticCost
from lbkit.core.engines import DRAINING, OUT
from lbkit.core.replica import ReplicaLink, Store, reduce_by_state, replica_id_iv
from lbkit.core.validation import (
    as_float_array,
    check_int,
    check_int_list,
    check_real,
    set_rng_state,
)
from lbkit.prefill.foreign import foreign_iv
from lbkit.prefill.ledger import MAX_TOKENS, Ledger, Request, remaining_quota
from lbkit.prefill.legacy import BUCKET_KEYWORDS, CHOICE_KEYWORDS, ROUND_KEYWORDS, from_keywords
from lbkit.prefill.options import Buckets, RankChoice, Rounds
from lbkit.prefill.pool import EnginePool

__all__ = [
    "COUNTERS",
    "STATE_VERSION",
    "Persistent",
    "config_dict",
    "read_config",
    "read_state",
]

#: Version of :meth:`PrefillBalancer.state_dict` (2: options as :class:`RankChoice`,
#: :class:`Buckets`, :class:`Rounds` dicts; 1: flat keyword options).
STATE_VERSION = 2
#: The balancer's counters (see :class:`~lbkit.prefill.PrefillStatistics`).
COUNTERS = (
    "routed", "finished", "refused", "handed_back", "rerouted", "moves", "rounds",
    "reports_accepted", "reports_stale", "reassigned", "steps_reported", "steps_stale",
)  # fmt: skip
_COST_FIELDS = ("a", "b", "k", "q", "gamma", "b_moe", "moe_lb")
_LOAD_RTOL = 1e-9  # saved rank loads against the sums of the saved quotas


def config_dict(
    num_engines: int,
    ranks_per_engine: int,
    cost: QuadraticCost,
    choice: RankChoice,
    buckets: Buckets,
    rounds: Rounds,
) -> dict[str, Any]:
    """The configuration part of a state."""
    return {
        "num_engines": num_engines,
        "ranks_per_engine": ranks_per_engine,
        "cost": {f: getattr(cost, f) for f in _COST_FIELDS},
        "choice": choice.to_dict(),
        "buckets": buckets.to_dict(),
        "rounds": rounds.to_dict(),
    }


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: must be a mapping, got {type(value).__name__}")
    return value


def _options(cls: Any, value: Any, name: str) -> Any:
    value = _mapping(value, name)
    try:
        out = cls(**value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {exc}") from None
    for key, v in value.items():  # an integer that a float field rounds would not save back
        if isinstance(getattr(out, key, None), float):
            _exact(v, f"{name}.{key}")
    return out


def read_config(state: Any) -> tuple[int, int, QuadraticCost, RankChoice, Buckets, Rounds]:
    """The pool, cost model and options of a state of version 1 or 2.

    Raises
    ------
    ValueError
        Not a state, an unknown version, or a configuration field out of its rules.
    """
    if not isinstance(state, Mapping) or state.get("version") not in (1, STATE_VERSION):
        raise ValueError(f"state: expected a state_dict of version {STATE_VERSION} (or 1)")
    cfg = _mapping(state.get("config"), "state.config")
    try:
        e = check_int(cfg.get("num_engines"), "state.config.num_engines", min_value=1)
        r = check_int(cfg.get("ranks_per_engine"), "state.config.ranks_per_engine", min_value=1)
    except TypeError as exc:
        raise ValueError(f"state.config: {exc}") from None
    cost = _options(QuadraticCost, cfg.get("cost"), "state.config.cost")
    if state["version"] == 1:
        keys = CHOICE_KEYWORDS + BUCKET_KEYWORDS + ROUND_KEYWORDS
        flat = {k: cfg[k] for k in keys if k in cfg}
        # Version 1 saved the rule in force (states older than the lockstep rule: none, and
        # least load was the only rule); the lockstep fields are kept only under that rule.
        flat.setdefault("rank_rule", "least_load")
        if flat.pop("context_parallel", False):
            flat["context_parallel"] = True
        if flat["rank_rule"] != "lockstep":
            flat.pop("step_budget_s", None)
            flat.pop("growth_weight", None)
            flat.pop("idle_growth_weight", None)
        try:
            choice, buckets, rounds = from_keywords(flat, None, None, None, warn=False)
        except TypeError as exc:
            raise ValueError(f"state.config: {exc}") from None
        return e, r, cost, choice, buckets, rounds
    choice = _options(RankChoice, cfg.get("choice"), "state.config.choice")
    buckets = _options(Buckets, cfg.get("buckets"), "state.config.buckets")
    rounds = _options(Rounds, cfg.get("rounds"), "state.config.rounds")
    return e, r, cost, choice, buckets, rounds


def _exact(value: Any, name: str) -> None:
    """A saved float is a float; an integer in its place must convert to one exactly (a
    restored state must save back to what was given)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            exact = float(value) == value
        except OverflowError:
            exact = False
        if not exact:
            raise ValueError(f"{name}: the integer {value} has no exact float value")


def _real(value: Any, name: str, **kw: Any) -> float:
    _exact(value, name)
    try:
        return check_real(value, name, **kw)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _floats(value: Any, name: str, n: int) -> np.ndarray:
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{name}: must be a list of {n} numbers")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name}[{i}]: must be a number, got {type(v).__name__} {v!r}")
        _exact(v, f"{name}[{i}]")
    arr = as_float_array(value, name, shape=(n,), nonnegative=True)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: must be finite")
    return arr


def _requests(rows: Any, n: int, quota: Any) -> list[tuple[Any, int, int, int, int, float]]:
    if not isinstance(rows, list):
        raise ValueError(f"state.requests: must be a list, got {type(rows).__name__}")
    out = []
    seen: set[Any] = set()
    for i, row in enumerate(rows):
        name = f"state.requests[{i}]"
        if not isinstance(row, (list, tuple)) or len(row) != 6:
            raise ValueError(f"{name}: must be [id, rank, total, cached, done, quota]")
        rid, rank, total, cached, done, q = row
        if type(rid) not in (int, str):
            raise ValueError(f"{name}: the id must be an int or a str, got {rid!r}")
        if rid in seen:
            raise ValueError(f"state: request {rid!r} appears twice")
        seen.add(rid)
        rank = check_int(rank, f"{name}.rank", min_value=0, max_value=n - 1)
        total = check_int(total, f"{name}.total", min_value=1, max_value=MAX_TOKENS)
        cached = check_int(cached, f"{name}.cached", min_value=0, max_value=total)
        done = check_int(done, f"{name}.done", min_value=0, max_value=total - cached)
        q = _real(q, f"{name}.quota", min_value=0.0)
        want = quota(total - cached - done, cached + done)
        if not math.isclose(q, want, rel_tol=1e-12, abs_tol=0.0):
            raise ValueError(f"{name}.quota: {q} is not the remaining quota {want} of its tokens")
        out.append((rid, rank, total, cached, done, q))
    return out


def _steps(start: Any, end: Any, e: int) -> tuple[np.ndarray, np.ndarray]:
    """The engines' last reported steps (``None``: never; both lists absent in states saved
    before step reports: none reported)."""
    if start is None and end is None:
        return np.full(e, -np.inf), np.full(e, -np.inf)
    out = []
    for name, value in (("state.step_start_s", start), ("state.step_end_s", end)):
        if not isinstance(value, list) or len(value) != e:
            raise ValueError(f"{name}: must be a list of {e} times or None")
        out.append(np.asarray(
            [-np.inf if t is None else _real(t, f"{name}[{i}]") for i, t in enumerate(value)],
            dtype=np.float64,
        ))  # fmt: skip
    for i, (a, b) in enumerate(zip(*out, strict=True)):
        if (a == -np.inf) != (b == -np.inf) or a > b:
            raise ValueError(
                f"state.step_end_s[{i}]: a step must end at or after its start "
                f"(start {start[i]}, end {end[i]})"
            )
    return out[0], out[1]


def read_state(
    s: Any, num_engines: int, ranks_per_engine: int, num_buckets: int, quota: Any
) -> dict[str, Any]:
    """Check the ``state`` part of a saved balancer and return its fields as arrays and lists.

    ``quota(remaining, prefix)`` is the balancer's remaining-quota function (the saved quotas
    must be it). Checks shapes, ranges and the consistency of the parts: each request on an
    engine in service, each draining engine holding a request, the saved rank loads equal to
    the sums of their requests' quotas, the counters adding up.

    Raises
    ------
    ValueError
        Naming the first field that breaks a rule.
    """
    s = _mapping(s, "state.state")
    e, nb, n = num_engines, num_buckets, num_engines * ranks_per_engine
    try:
        home = check_int_list(s.get("engine_bucket"), "state.engine_bucket", e, min_value=0,
                              max_value=nb - 1)  # fmt: skip
        eng_state = check_int_list(s.get("engine_state"), "state.engine_state", e, min_value=0,
                                   max_value=OUT)  # fmt: skip
        seq = check_int_list(s.get("seq"), "state.seq", e, min_value=-1)
        last = s.get("last_move_s")
        if not isinstance(last, list) or len(last) != e:
            raise ValueError(f"state.last_move_s: must be a list of {e} times or None")
        last_move = np.asarray(
            [-np.inf if t is None else _real(t, "state.last_move_s") for t in last],
            dtype=np.float64,
        )
        step_start, step_end = _steps(s.get("step_start_s"), s.get("step_end_s"), e)
        load = _floats(s.get("rank_load"), "state.rank_load", n)
        round_quota = _floats(s.get("round_quota"), "state.round_quota", nb)
        demand = _floats(s.get("demand"), "state.demand", nb)
        round_start = _real(s.get("round_start_s"), "state.round_start_s")
        drift_last = _real(s.get("drift_last_s"), "state.drift_last_s", min_value=0.0)
        drift_max = _real(s.get("drift_max_s"), "state.drift_max_s", min_value=0.0)
        counts_in = _mapping(s.get("counts"), "state.counts")
        counts = {
            k: check_int(counts_in.get(k, 0), f"state.counts.{k}", min_value=0) for k in COUNTERS
        }
        requests = _requests(s.get("requests"), n, quota)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    held = np.zeros(e, dtype=np.int64)
    sums: list[list[float]] = [[] for _ in range(n)]
    for i, (rid, rank, *_, q) in enumerate(requests):
        engine = rank // ranks_per_engine
        if eng_state[engine] == OUT:
            raise ValueError(f"state.requests[{i}]: request {rid!r} is on engine {engine}, "
                             "which is out of service")  # fmt: skip
        held[engine] += 1
        sums[rank].append(q)
    for engine in np.flatnonzero((eng_state == DRAINING) & (held == 0)).tolist():
        raise ValueError(f"state.engine_state: engine {engine} drains but holds no request")
    for f in range(n):
        total = math.fsum(sums[f])
        if abs(load[f] - total) > _LOAD_RTOL * max(total, 1e-300) * (len(sums[f]) + 1):
            raise ValueError(
                f"state.rank_load: rank {f} has load {load[f]}, its requests' quotas sum to "
                f"{total} (inconsistent state)"
            )
    if counts["routed"] != len(requests) + counts["finished"] + counts["handed_back"]:
        raise ValueError("state.counts: routed must equal queued + finished + handed_back")
    rng = _mapping(s.get("rng"), "state.rng")
    foreign = None
    if s.get("foreign") is not None:
        f = _mapping(s["foreign"], "state.foreign")
        for key in ("quota_s", "work_s"):
            if isinstance(f.get(key), (list, tuple)):
                for i, v in enumerate(f[key]):
                    _exact(v, f"state.foreign.{key}[{i}]")
        try:
            foreign = foreign_iv(f.get("quota_s"), f.get("work_s"), f.get("num_requests"), n)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state.foreign.{exc}") from None
    return {
        "home": home, "state": eng_state.astype(np.int8), "seq": seq, "last_move": last_move,
        "step_start": step_start, "step_end": step_end,
        "load": load, "round_quota": round_quota.tolist(), "demand": demand,
        "round_start": round_start, "drift_last": drift_last, "drift_max": drift_max,
        "counts": counts, "requests": requests, "rng": rng, "foreign": foreign,
    }  # fmt: skip


def _state_part(
    pool: EnginePool,
    led: Ledger,
    *,
    round_quota: list[float],
    round_start: float,
    demand: np.ndarray,
    counts: dict[str, int],
    drift_last: float,
    drift_max: float,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """The ``state`` part of a state: the engines of ``pool``, the ledger's requests and sums,
    the round, the counters and the rng, as JSON types (what :func:`read_state` reads back)."""
    return {
        "engine_bucket": pool.home.tolist(),
        "engine_state": pool.state.tolist(),
        "last_move_s": [None if t == -np.inf else t for t in pool.last_move.tolist()],
        "seq": pool.seq.tolist(),
        "step_start_s": [None if t == -np.inf else t for t in pool.step_start.tolist()],
        "step_end_s": [None if t == -np.inf else t for t in pool.step_end.tolist()],
        "rank_load": led.rank_loads().tolist(),
        "requests": [
            [q.rid, q.rank, q.total, q.cached, q.done, q.quota]
            for queue in led.queues
            for q in queue.values()
        ],
        "round_quota": list(round_quota),
        "round_start_s": round_start,
        "demand": demand.tolist(),
        "counts": dict(counts),
        "drift_last_s": drift_last,
        "drift_max_s": drift_max,
        "rng": rng.bit_generator.state,
        "foreign": dict(
            zip(
                ("quota_s", "work_s", "num_requests"),
                (a.tolist() for a in led.foreign()),
                strict=True,
            )
        ),
    }


def _restore_ledger(led: Ledger, s: Mapping[str, Any], edges: tuple[int, ...]) -> None:
    """Fill ``led`` (fresh, laid out as the saved engines route) from :func:`read_state`'s
    fields: the requests in their saved queue order, the foreign load and the saved loads."""
    for rid, rank, total, cached, done, quota in s["requests"]:
        bucket = bisect.bisect_right(edges, total)
        req = Request(rid, rank, bucket, total, cached, done, quota)
        led.requests[rid] = req
        led.queues[rank][rid] = req
    for f in range(len(led.queues)):
        led.resum(f)
    if s["foreign"] is not None:
        led.set_foreign(*s["foreign"])
    led.own = s["load"][np.asarray(led.rank_at, dtype=np.int64)]  # as saved (checked)
    led.load = led.own + led.f_load


class Persistent:
    """The saving and restoring methods of :class:`~lbkit.prefill.PrefillBalancer`, which
    inherits them: :meth:`state_dict`, :meth:`from_state_dict` and pickling through them.

    Not used on its own: it reads and sets the state the balancer's ``__init__`` sets, declared
    here (and calls its ``_attach``).
    """

    _num_engines: int
    _ranks: int
    _cost: QuadraticCost
    _choice: RankChoice
    _buckets: Buckets
    _rounds: Rounds
    _edges: tuple[int, ...]
    _rng: np.random.Generator
    _ledger: Ledger
    _pool: EnginePool
    _link: ReplicaLink | None
    _counts: dict[str, int]
    _round_quota: list[float]
    _round_start: float
    _demand: np.ndarray
    _drift_last: float
    _drift_max: float

    def state_dict(self) -> dict[str, Any]:
        """The configuration and state as JSON-serialisable plain types.

        The options are saved as plain dicts (:meth:`RankChoice.to_dict`, ...). Request ids
        must be ints or strs (``route`` enforces it). ``from_state_dict`` of the result
        continues exactly where this balancer stands, including the sampling rng. ``pickle``
        and ``copy`` go through it too (a balancer with a store is not picklable: save its state
        and pass the store to :meth:`from_state_dict`).
        """
        config = config_dict(self._num_engines, self._ranks, self._cost, self._choice,
                             self._buckets, self._rounds)  # fmt: skip
        state = _state_part(self._pool, self._ledger, round_quota=self._round_quota,
                            round_start=self._round_start, demand=self._demand,
                            counts=self._counts, drift_last=self._drift_last,
                            drift_max=self._drift_max, rng=self._rng)  # fmt: skip
        return {"version": STATE_VERSION, "config": config, "state": state}

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return reduce_by_state(self, self._link)

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Any], *, store: Store | None = None, replica_id: str | None = None
    ) -> Self:
        """Rebuild a balancer from :meth:`state_dict` output (e.g. after ``json.loads``).

        With ``store`` and ``replica_id`` (not saved in a state) the rebuilt balancer is that
        replica again: it publishes its whole ledger before it returns.

        Reads states of version 2 and 1 (flat keyword options).

        Raises
        ------
        ValueError
            Unknown version, or a field out of its rules or inconsistent with the others,
            named (:func:`lbkit.prefill.persistence.read_state`).
        """
        me = replica_id_iv(store, replica_id)
        e, r, cost, choice, buckets, rounds = read_config(state)
        nb = buckets.num_buckets
        # Checked before anything is allocated for e x r ranks: a tampered pool size is refused
        # by the lengths of the saved lists, never allocated.
        s = read_state(state.get("state"), e, r, nb, partial(remaining_quota, cost))
        initial = np.bincount(s["home"], minlength=nb)
        bal = cls(
            e, r, cost=cost, choice=choice, rounds=rounds, now_s=s["round_start"],
            buckets=Buckets(buckets.edges, buckets.min_engines, buckets.max_engines,
                            tuple(initial.tolist())),
        )  # fmt: skip
        bal._buckets = buckets
        bal._pool.restore(s["home"], s["state"], s["last_move"], s["seq"], s["step_start"],
                          s["step_end"])  # fmt: skip
        _restore_ledger(bal._ledger, s, bal._edges)
        bal._round_quota = s["round_quota"]
        bal._demand = s["demand"]
        bal._counts = s["counts"]
        bal._drift_last = s["drift_last"]
        bal._drift_max = s["drift_max"]
        set_rng_state(bal._rng, s["rng"])
        if me is not None:
            bal._attach(store, me)
        return bal
