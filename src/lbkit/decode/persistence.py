"""Saving and restoring a :class:`~lbkit.decode.DecodeBalancer`: its state as plain types.

A state is ``{"version": 1, "config": ..., "state": ...}`` of JSON types: the configuration
(the constructor's arguments, capacities per rank, the cost model) and the ledger, rank states,
report sequence numbers, counters and the random policy's rng. :func:`read_state` checks every
field before the balancer trusts it: a ``ValueError`` names the field (``state.requests[3].kv``,
...) and the rule it breaks, including the consistency of the parts (each request on a rank in
service, every rank's KV within the ledger's exact range, the counters adding up). Nothing here
relies on ``assert``, which ``python -O`` drops.

:class:`Persistent` holds the balancer's :meth:`~Persistent.state_dict` and
:meth:`~Persistent.from_state_dict` (and pickling through them), which
:class:`~lbkit.decode.DecodeBalancer` inherits.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Self

import numpy as np

from lbkit.core.cost import DecodeCost
from lbkit.core.engines import ACTIVE, OUT
from lbkit.core.replica import ReplicaLink, Store, reduce_by_state, replica_id_iv
from lbkit.core.validation import check_int, check_int_list, set_rng_state
from lbkit.decode import _kernels as K
from lbkit.decode.foreign import foreign_iv
from lbkit.decode.ledger import MAX_RANK_TOKENS, MAX_TOKENS, Ledger
from lbkit.decode.reasons import REASONS
from lbkit.decode.results import COUNTERS

__all__ = ["COST_FIELDS", "STATE_VERSION", "Persistent", "caps_list", "read_config", "read_state"]

#: Version of :meth:`DecodeBalancer.state_dict`.
STATE_VERSION = 1
#: Fields of the saved :class:`~lbkit.core.DecodeCost`.
COST_FIELDS = ("a", "b", "k", "combine", "b_moe", "moe_lb")
_MAX_COUNT = 2**62  # counters, admission numbers: far from int64 overflow
_SIGNED = ("drift_requests_last", "drift_kv_tokens_last")  # counters that may be negative
_REQUEST_FIELDS = ("rank", "kv", "gen", "expect", "order")


def caps_list(row: np.ndarray) -> list[int | None] | None:
    """A capacity row (``inf``: none) as saved: ``None`` without any, else one entry per rank."""
    if np.isinf(row).all():
        return None
    return [None if np.isinf(v) else int(v) for v in row.tolist()]


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: must be a mapping, got {type(value).__name__}")
    return value


def _int(value: Any, name: str, **kw: Any) -> int:
    try:
        return check_int(value, name, **kw)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _caps(value: Any, name: str, n: int) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{name}: must be None or a list of {n} capacities (int or None)")
    return [
        np.inf if v is None else float(_int(v, f"{name}[{i}]", min_value=0, max_value=2**53))
        for i, v in enumerate(value)
    ]


def read_config(state: Any) -> tuple[dict[str, Any], dict[str, list[float] | None]]:
    """The constructor's keyword arguments of a state (``cost`` as a :class:`DecodeCost`) and
    its per-rank capacities (``None``: no limit on any rank).

    Raises
    ------
    ValueError
        Not a state, an unknown version, or a configuration field out of its rules.
    """
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        raise ValueError(f"state: expected a state_dict of version {STATE_VERSION}")
    cfg = dict(_mapping(state.get("config"), "state.config"))
    cost = _mapping(cfg.pop("cost", None), "state.config.cost")
    unknown = set(cost) - set(COST_FIELDS)
    if unknown:
        raise ValueError(f"state.config.cost: unknown fields {sorted(unknown)}")
    try:
        cfg["cost"] = DecodeCost(**cost)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"state.config.cost: {exc}") from None
    n = _int(cfg.get("num_ranks"), "state.config.num_ranks", min_value=1)
    caps = {
        key: _caps(cfg.pop(key, None), f"state.config.{key}", n)
        for key in ("max_batch", "max_kv_tokens")
    }
    return cfg, caps


def _requests(rows: Any, n: int, order: int) -> list[tuple[Any, int, int, int, int, int]]:
    if not isinstance(rows, list):
        raise ValueError(f"state.requests: must be a list, got {type(rows).__name__}")
    out = []
    seen: set[Any] = set()
    orders: set[int] = set()
    bounds = {
        "rank": (0, n - 1), "kv": (0, MAX_TOKENS), "gen": (0, _MAX_COUNT),
        "expect": (-1, MAX_TOKENS), "order": (0, order - 1),
    }  # fmt: skip
    for i, row in enumerate(rows):
        name = f"state.requests[{i}]"
        if not isinstance(row, (list, tuple)) or len(row) != 1 + len(_REQUEST_FIELDS):
            raise ValueError(f"{name}: must be [id, rank, kv, gen, expect, order]")
        rid = row[0]
        if type(rid) not in (int, str):
            raise ValueError(f"{name}: the id must be an int or a str, got {rid!r}")
        if rid in seen:
            raise ValueError(f"{name}: request {rid!r} appears twice")
        seen.add(rid)
        vals = [
            _int(v, f"{name}.{field}", min_value=bounds[field][0], max_value=bounds[field][1])
            for field, v in zip(_REQUEST_FIELDS, row[1:], strict=True)
        ]
        if vals[-1] in orders:
            raise ValueError(f"{name}.order: admission number {vals[-1]} appears twice")
        orders.add(vals[-1])
        out.append((rid, *vals))
    return out


def read_state(s: Any, n: int) -> dict[str, Any]:
    """Check the ``state`` part of a saved balancer of ``n`` ranks; return its fields.

    Raises
    ------
    ValueError
        Naming the first field that breaks a rule.
    """
    s = _mapping(s, "state.state")
    rank_state = check_int_list(
        s.get("rank_state"), "state.rank_state", n, min_value=0, max_value=OUT
    )
    seq = check_int_list(s.get("seq"), "state.seq", n, min_value=-1, max_value=2**63 - 1)
    cursor = _int(s.get("cursor"), "state.cursor", min_value=0, max_value=n - 1)
    order = _int(s.get("order"), "state.order", min_value=0, max_value=_MAX_COUNT)
    requests = _requests(s.get("requests"), n, order)
    refused = check_int_list(s.get("refused"), "state.refused", len(REASONS), min_value=0,
                    max_value=_MAX_COUNT).tolist()  # fmt: skip
    if refused[0]:
        raise ValueError(f"state.refused: the first entry ({REASONS[0]!r}) must be 0")
    counts_in = _mapping(s.get("counts"), "state.counts")
    unknown = set(counts_in) - set(COUNTERS)
    if unknown:
        raise ValueError(f"state.counts: unknown counters {sorted(unknown)}")
    counts = {
        k: _int(counts_in.get(k, 0), f"state.counts.{k}",
                min_value=-_MAX_COUNT if k in _SIGNED else 0, max_value=_MAX_COUNT)
        for k in COUNTERS
    }  # fmt: skip
    foreign = None
    if s.get("foreign") is not None:
        f = s["foreign"]
        if not isinstance(f, (list, tuple)) or len(f) != 2:
            raise ValueError("state.foreign: must be [requests per rank, KV tokens per rank]")
        try:
            foreign = foreign_iv(f[0], f[1], n, MAX_TOKENS)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state.foreign.{exc}") from None
    kv = np.zeros(n, dtype=np.float64) if foreign is None else foreign.kv_tokens.astype(float)
    for i, (rid, rank, r_kv, *_) in enumerate(requests):
        if rank_state[rank] == OUT:
            raise ValueError(
                f"state.requests[{i}].rank: request {rid!r} is on rank {rank}, which is out of "
                "service"
            )
        kv[rank] += r_kv
    if n and kv.max() > MAX_RANK_TOKENS:
        raise ValueError(
            f"state.requests: rank {int(kv.argmax())} would hold more than {MAX_RANK_TOKENS} "
            "KV tokens"
        )
    c = counts
    if order != len(requests) + c["finished"] + c["aborted"] + c["handed_back"]:
        raise ValueError(
            "state.order: admissions must equal running + finished + aborted + handed_back"
        )
    for last, most in (("drift_requests_last", "drift_requests_max"),
                       ("drift_kv_tokens_last", "drift_kv_tokens_max")):  # fmt: skip
        if abs(c[last]) > c[most]:
            raise ValueError(f"state.counts.{most}: must be >= |{last}|")
    if c["drift_kv_tokens_max"] > c["drift_kv_tokens_total"]:
        raise ValueError("state.counts.drift_kv_tokens_total: must be >= drift_kv_tokens_max")
    if c["reports_corrected"] > c["reports_accepted"]:
        raise ValueError("state.counts.reports_corrected: must be <= reports_accepted")
    if c["migrated_for_room"] > c["migrated"]:
        raise ValueError("state.counts.migrated_for_room: must be <= migrated")
    room = s.get("room")
    if room is not None:
        if not isinstance(room, (list, tuple)) or len(room) != 2 or type(room[0]) not in (int, str):
            raise ValueError("state.room: must be None or [request id, KV tokens]")
        room = (room[0], _int(room[1], "state.room[1]", min_value=0, max_value=MAX_TOKENS))
    return {
        "rank_state": rank_state.astype(np.int8), "seq": seq.astype(np.int64), "cursor": cursor,
        "order": order, "requests": requests, "refused": refused, "counts": counts,
        "rng": _mapping(s.get("rng"), "state.rng"), "room": room, "foreign": foreign,
    }  # fmt: skip


class Persistent:
    """The saving and restoring methods of :class:`~lbkit.decode.DecodeBalancer`, which
    inherits them: :meth:`state_dict`, :meth:`from_state_dict` and pickling through them.

    Not used on its own: it reads and sets the state the balancer's ``__init__`` sets, declared
    here (and calls its ``_attach``).
    """

    _n: int
    _policy: str
    _scale: str
    _cost: DecodeCost
    _h: int
    _max_moves: int
    _make_room: bool
    _sources: str
    _rng: np.random.Generator
    _L: Ledger
    _state: np.ndarray
    _seq: np.ndarray
    _cursor: int
    _order: int
    _refused: list[int]
    _counts: dict[str, int]
    _room: tuple[Hashable, int] | None
    _link: ReplicaLink | None

    def state_dict(self) -> dict[str, Any]:
        """The configuration and state as JSON-serialisable plain types.

        :meth:`from_state_dict` of the result continues exactly where this balancer stands
        (decisions, reports, counters and the random policy's rng). ``pickle`` and ``copy``
        go through it too (a balancer with a store is not picklable: save its state and pass
        the store to :meth:`from_state_dict`).
        """
        L = self._L
        return {
            "version": STATE_VERSION,
            "config": {
                "num_ranks": self._n,
                "policy": self._policy,
                "max_batch": caps_list(L.X[K.ROW_CAP_B]),
                "max_kv_tokens": caps_list(L.X[K.ROW_CAP_S]),
                "scale": self._scale,
                "cost": {f: getattr(self._cost, f) for f in COST_FIELDS},
                "lookahead_steps": self._h,
                "max_migrations": self._max_moves,
                "make_room": self._make_room,
                "migration_sources": self._sources,
            },
            "state": {
                "rank_state": self._state.tolist(),
                "seq": self._seq.tolist(),
                "cursor": self._cursor,
                "order": self._order,
                "requests": [[L.rid_of[i], *L.slots[:, i].tolist()] for i in L.by_age()],
                "refused": list(self._refused),
                "counts": dict(self._counts),
                "rng": self._rng.bit_generator.state,
                "room": None if self._room is None else list(self._room),
                "foreign": [L.fb.tolist(), L.fs.tolist()],
            },
        }

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return reduce_by_state(self, self._link)

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Any], *, store: Store | None = None, replica_id: str | None = None
    ) -> Self:
        """Rebuild a balancer from :meth:`state_dict` output (e.g. after ``json.loads``).

        With ``store`` and ``replica_id`` (not saved in a state) the rebuilt balancer is that
        replica again: it publishes its whole ledger before it returns.

        Raises
        ------
        ValueError
            Unknown version, or a field out of its rules or inconsistent with the others,
            named (:func:`lbkit.decode.persistence.read_state`); every check is an explicit
            ``if``, so ``python -O`` checks the same.
        """
        me = replica_id_iv(store, replica_id)
        cfg, caps = read_config(state)
        try:
            bal = cls(**cfg)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state.config: {exc}") from None
        n = bal._n
        s = read_state(state.get("state"), n)
        L = bal._L
        for key, row in (("max_batch", K.ROW_CAP_B), ("max_kv_tokens", K.ROW_CAP_S)):
            if caps[key] is not None:
                L.X[row] = caps[key]
        bal._state = s["rank_state"]
        L.X[K.ROW_OK] = bal._state == ACTIVE
        bal._seq = s["seq"]
        bal._cursor = s["cursor"]
        bal._order = s["order"]
        for rid, rank, kv, gen, expect, order in s["requests"]:
            L.insert(rid, rank, kv, gen, expect, order)
        if s["foreign"] is not None:
            L.set_foreign(s["foreign"].num_requests, s["foreign"].kv_tokens)
        L.reproject()
        bal._refused = s["refused"]
        bal._counts = s["counts"]
        set_rng_state(bal._rng, s["rng"])
        bal._room = s["room"]
        if me is not None:
            bal._attach(store, me)
        return bal
