"""``DecodeBalancer``: the stateful decode router that a serving front end embeds.

It keeps the ledger a router must remember (per rank: requests ``B_r`` and KV tokens ``S_r``;
per request: rank, KV tokens, tokens generated, expected output) and places each request with
the policy kernel of :mod:`lbkit.decode.policies`:

- **admit** a request (returns a :class:`~lbkit.decode.Decision`; refused requests stay with the
  caller, counted by reason);
- **step** grows KV: one token per running request, or the tokens the caller reports per rank or
  per request;
- **finish / abort** release a request;
- **set_foreign_load** adds the load other routers placed on the ranks (see below);
- **statistics / _check**;
- in ``control.py`` (:class:`~lbkit.decode.control.RankControl`, which the class inherits):
  **migrate / rebalance** move running requests; **drain_rank / remove_rank / restore_rank**
  take a rank out of service (draining: no new work; removed: its requests are handed back to
  the caller, none lost) and back; **report** reconciles the ledger with an engine's per-rank
  load report (the *Reconciliation rule* is documented there);
- in ``persistence.py`` (:class:`~lbkit.decode.persistence.Persistent`, inherited too):
  **state_dict / from_state_dict** and pickling.

Capacities bound admission only: KV growth in :meth:`DecodeBalancer.step` may take a rank past
``max_kv_tokens`` (the engine then preempts; :class:`DecodeStatistics` counts such ranks).

Foreign load
------------
Router replicas in front of one engine each admit their own requests. The load the others
placed, per rank (:meth:`DecodeBalancer.set_foreign_load`, fed by any transport:
:class:`lbkit.replicas.RedisStore` or the caller's own), counts in every score and capacity
check but in no request of the ledger (:mod:`lbkit.decode.foreign`): ``step`` grows, ``finish``
releases and migrations move only the own requests. Reports are of the whole engine: drift is
reported minus (ledger plus foreign load), and a KV correction sets the own requests' KV to the
reported KV minus the foreign KV (none when that is negative). :meth:`DecodeBalancer.num_requests`
and :meth:`DecodeBalancer.kv_tokens` are the ledger's; the balance figures of
:meth:`DecodeBalancer.statistics` are of the totals, what the engine runs.

With ``lookahead_steps > 0`` ranks are scored by their state that many steps ahead
(:mod:`lbkit.decode.ledger`, *Look-ahead*). Limits: a request holds at most ``MAX_TOKENS``
(2**52) KV tokens and a rank at most ``MAX_RANK_TOKENS`` (2**53), so that every sum stays exact;
larger admissions, steps and reports are refused with a ``ValueError``.

Complexity: :meth:`admit`, :meth:`finish`, :meth:`abort` O(ranks); :meth:`step` O(ranks +
requests) (vectorised); :meth:`report` O(requests on the rank); :meth:`remove_rank` O(requests).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from lbkit.core.cost import DecodeCost
from lbkit.core.engines import ACTIVE, OUT, STATE_NAMES
from lbkit.core.metrics import max_over_mean
from lbkit.core.replica import ReplicaLink, Store, replica_id_iv
from lbkit.core.validation import as_int_array, as_rng, check_choice, check_int, to_numpy
from lbkit.decode import _kernels as K
from lbkit.decode._state import DEFAULT_COST, capacity_iv, params
from lbkit.decode.control import RankControl
from lbkit.decode.foreign import ForeignLoad, foreign_iv
from lbkit.decode.ledger import EXPECT, GEN, KV, MAX_RANK_TOKENS, MAX_TOKENS, ORDER, RANK, Ledger
from lbkit.decode.migration import MIGRATION_SOURCES
from lbkit.decode.persistence import Persistent
from lbkit.decode.policies import DEFAULT_POLICY, POLICIES, POLICY_CODES, Decision
from lbkit.decode.reasons import BATCH_FULL, FULL, KV_FULL, PLACED, REASONS
from lbkit.decode.results import (
    COUNTERS,
    DecodeStatistics,
    Migration,
    RemovedRequests,
    ReportResult,
    RequestInfo,
)

__all__ = [
    "DecodeBalancer",
    "DecodeStatistics",
    "Migration",
    "RemovedRequests",
    "ReportResult",
    "RequestInfo",
]

_REFUSED = tuple(Decision(-1, reason) for reason in REASONS)
#: Refusals that room on one rank would have avoided (the pool is not empty of room).
_NO_ROOM = frozenset(REASONS.index(r) for r in (BATCH_FULL, KV_FULL, FULL))
#: Default moves per :meth:`DecodeBalancer.rebalance` that lower the balance objective.
DEFAULT_MAX_MIGRATIONS = 1
#: Largest look-ahead, decode steps (projected KV sums stay exact).
MAX_LOOKAHEAD_STEPS = 2**20
#: Admissions of more KV tokens check that no rank can pass ``MAX_RANK_TOKENS``; below it a
#: rank would need more than 2**31 requests (``step`` checks growth itself).
ADMIT_CHECK_TOKENS = 2**22


def _request_id(request_id: Any) -> Hashable:
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
        raise TypeError(
            f"request_id: must be an int or a str (JSON-serialisable), got "
            f"{type(request_id).__name__}"
        )
    return request_id


class DecodeBalancer(RankControl, Persistent):
    """Stateful decode balancer over the ``num_ranks`` ranks of one engine.

    Parameters
    ----------
    num_ranks : int
        Ranks of the engine (>= 1).
    policy : str, default ``DEFAULT_POLICY``
        A key of :data:`~lbkit.decode.POLICIES`.
    max_batch, max_kv_tokens : int or array_like of int, shape (num_ranks,), optional
        Admission capacities per rank (``None``: no limit).
    scale : {"mean", "capacity"}
        Normalisers of the two-dimensional scores (see :mod:`lbkit.decode.policies`).
    cost : DecodeCost, optional
        Cost model of the ``"cost"`` policy and of ``statistics().step_time_s`` (default: the
        ``h800_dsv3`` decode preset with ``combine="max"``).
    lookahead_steps : int, default 0
        Score ranks by their projected state this many steps ahead (see the module
        documentation); 0 scores the current state (at most 2**20).
    max_migrations : int, default ``DEFAULT_MAX_MIGRATIONS`` (1)
        Moves of :meth:`rebalance` without an argument that lower the balance objective (0:
        none).
    make_room : bool, default True
        Whether :meth:`rebalance` frees a rank for the last request refused for lack of room
        (see there).
    migration_sources : {"heaviest", "all"}, default "heaviest"
        Candidates of a balance move (:func:`~lbkit.decode.plan_migrations`' ``sources``):
        the requests of the heaviest rank (``O(requests + B * ranks)`` per move, for a call
        before every admission), or every request (``O(requests * ranks)``).
    rng : numpy Generator, int seed or None
        Randomness of the ``"random"`` policy (``None`` means seed 0).
    store : Store, optional
        A load store shared by the router replicas of this engine (e.g.
        :class:`lbkit.replicas.RedisStore`); ``None`` (default): this balancer is alone.
    replica_id : str, optional
        This replica's name in ``store`` (required with it; unique among the replicas).

    Notes
    -----
    The defaults are what lbkit's measurements run (``benchmarks/decode_goodput.py``, the
    simulator's ``lbkit`` decode policy): the ``"min_max"`` rule, and :meth:`rebalance` called
    before every admission, which makes room for a waiting request and moves one request when
    that lowers the balance objective. The earlier defaults are explicit arguments:
    ``policy="sum_of_squares", max_migrations=0, make_room=False`` admits only, and
    ``make_room=False, migration_sources="all"`` makes ``rebalance(k)`` the earlier global plan.

    With ``store``, the caller's code stays the same: :meth:`admit` and :meth:`rebalance` first
    view the store (the foreign load is the store's totals minus this replica's contribution,
    :meth:`set_foreign_load`), and every change of the ledger (admission, finish, abort, step,
    corrected report, migration, removed rank) publishes the replica's per-rank load. An
    admission costs two store calls. When the store does not answer within its budget the
    decision runs on an estimate and ``statistics().store_fallbacks`` counts it
    (:mod:`lbkit.core.replica`).

    Examples
    --------
    >>> bal = DecodeBalancer(2)
    >>> [bal.admit(rid, kv).rank for rid, kv in [("a", 9000), ("b", 100), ("c", 120)]]
    [0, 1, 1]
    >>> bal.admit("d", 6000)  # long: goes to the rank with little KV despite its 2 requests
    Decision(rank=1, reason='placed')
    >>> bal.admit("e", 50)    # short: goes to the rank with fewer requests
    Decision(rank=0, reason='placed')
    >>> bal.step()
    >>> bal.statistics().kv_tokens, bal.statistics().num_requests
    ((9052, 6223), (2, 3))
    >>> bal.finish("a")
    0
    >>> bal.remove_rank(1)
    RemovedRequests(request_ids=('b', 'c', 'd'), kv_tokens=(101, 121, 6001))
    >>> bal.admit("b", 101)
    Decision(rank=0, reason='placed')
    >>> bal.statistics().handed_back, len(bal)
    (3, 2)
    """

    def __init__(
        self,
        num_ranks: int,
        *,
        policy: str = DEFAULT_POLICY,
        max_batch: Any = None,
        max_kv_tokens: Any = None,
        scale: str = "mean",
        cost: DecodeCost | None = None,
        lookahead_steps: int = 0,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        make_room: bool = True,
        migration_sources: str = "heaviest",
        rng: np.random.Generator | int | None = None,
        store: Store | None = None,
        replica_id: str | None = None,
    ) -> None:
        n = check_int(num_ranks, "num_ranks", min_value=1)
        rid = replica_id_iv(store, replica_id)
        self._max_moves = check_int(max_migrations, "max_migrations", min_value=0)
        if not isinstance(make_room, (bool, np.bool_)):
            raise TypeError(f"make_room: must be a bool, got {type(make_room).__name__}")
        self._make_room = bool(make_room)
        self._sources = check_choice(migration_sources, "migration_sources", MIGRATION_SOURCES)
        self._room: tuple[Hashable, int] | None = None  # last request refused for lack of room
        self._room_failed = -1  # releases when room-making last failed (retried after one more)
        check_choice(policy, "policy", tuple(POLICIES))
        h = check_int(
            lookahead_steps, "lookahead_steps", min_value=0, max_value=MAX_LOOKAHEAD_STEPS
        )
        self._P = params(POLICY_CODES[policy], scale, cost, proj=h > 0)
        self._cost = DEFAULT_COST if cost is None else cost
        self._policy = policy
        self._scale = scale
        self._code = POLICY_CODES[policy]
        self._h = h
        self._n = n
        self._rng = as_rng(rng)
        self._L = Ledger(
            n, h, capacity_iv(max_batch, "max_batch", n),
            capacity_iv(max_kv_tokens, "max_kv_tokens", n),
        )  # fmt: skip
        self._state = np.zeros(n, dtype=np.int8)
        self._seq = np.full(n, -1, dtype=np.int64)
        self._cursor = 0
        self._order = 0
        self._refused = [0] * len(REASONS)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._placed = tuple(Decision(r, PLACED) for r in range(n))  # no allocation per call
        self._link: ReplicaLink | None = None
        if rid is not None:
            self._attach(store, rid)

    def _attach(self, store: Any, replica_id: str) -> None:
        """Join ``store`` as ``replica_id``: publish the whole ledger."""
        self._link = ReplicaLink(store, replica_id, key="decode", num_ranks=self._n, columns=2)
        self._push()

    # ------------------------------------------------------------------ properties
    @property
    def num_ranks(self) -> int:
        """Ranks of the engine."""
        return self._n

    @property
    def policy(self) -> str:
        """Name of the rank-choice policy."""
        return self._policy

    def num_requests(self) -> np.ndarray:
        """Requests of the ledger per rank, shape (num_ranks,), int64 (a copy; without the
        foreign load)."""
        return self._L.X[K.ROW_B].astype(np.int64) - self._L.fb

    def kv_tokens(self) -> np.ndarray:
        """KV tokens of the ledger per rank, shape (num_ranks,), int64 (a copy; without the
        foreign load)."""
        return self._L.X[K.ROW_S].astype(np.int64) - self._L.fs

    def foreign_load(self) -> ForeignLoad:
        """The foreign load in force (copies; zeros until :meth:`set_foreign_load`)."""
        return ForeignLoad(self._L.fb.copy(), self._L.fs.copy())

    def set_foreign_load(self, *, num_requests: Any, kv_tokens: Any) -> None:
        """Set the load that other routers placed on the ranks (replacing the previous one).

        It counts in every later decision's scores and capacities, and in
        :meth:`statistics`' balance figures, but in no request of the ledger (module
        documentation, *Foreign load*).

        Parameters
        ----------
        num_requests : array_like of int, shape (num_ranks,)
            Requests of other routers per rank (0 to 2**52).
        kv_tokens : array_like of int, shape (num_ranks,)
            KV tokens they hold per rank (0 to 2**52; with the own KV at most 2**53).

        Raises
        ------
        ValueError, TypeError
            A wrong shape, negative or non-integer values (nothing changes).

        Runtime complexity: O(ranks).

        Examples
        --------
        >>> bal = DecodeBalancer(2)
        >>> bal.set_foreign_load(num_requests=[3, 0], kv_tokens=[3000, 0])
        >>> bal.admit("a", 100)
        Decision(rank=1, reason='placed')
        >>> bal.num_requests().tolist(), bal.statistics().foreign_requests
        ([0, 1], (3, 0))
        """
        new = foreign_iv(num_requests, kv_tokens, self._n, MAX_TOKENS)
        total = self._L.own()[1] + new.kv_tokens
        if int(total.max()) > MAX_RANK_TOKENS:
            raise ValueError(
                f"kv_tokens: rank {int(total.argmax())} would hold more than {MAX_RANK_TOKENS} "
                "KV tokens with its own requests"
            )
        self._L.set_foreign(new.num_requests, new.kv_tokens)

    # ------------------------------------------------------------------ store
    def _pull(self) -> None:
        """View the store before a decision: its foreign load replaces ours."""
        f = self._link.view(self._L.own())
        self._L.set_foreign(np.minimum(f[0], MAX_TOKENS), np.minimum(f[1], MAX_TOKENS))

    def _push(self) -> None:
        """Publish the ledger's per-rank load after a change."""
        if self._link is not None:
            self._link.publish(self._L.own())

    def __len__(self) -> int:
        return len(self._L.ids)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._L.ids

    def request(self, request_id: Hashable) -> RequestInfo:
        """Ledger entry of a running request; ``KeyError`` if unknown."""
        c = self._L.slots[:, self._L.slot_of(request_id)].tolist()
        return RequestInfo(c[RANK], c[KV], c[GEN], c[EXPECT])

    def requests_on(self, rank: int) -> tuple[Hashable, ...]:
        """Ids of the requests on ``rank``, oldest first."""
        rank = self._rank_iv(rank)
        return tuple(self._L.rid_of[i] for i in self._L.slots_on(rank))

    # ------------------------------------------------------------------ internals
    def _rank_iv(self, rank: Any) -> int:
        return check_int(rank, "rank", min_value=0, max_value=self._n - 1)

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        request_id: Hashable,
        kv_tokens: int,
        *,
        expected_output_tokens: int | None = None,
    ) -> Decision:
        """Place a request holding ``kv_tokens`` KV tokens (its prompt, cached or computed).

        Parameters
        ----------
        request_id : int or str
            New id (not running).
        kv_tokens : int
            KV tokens the request holds on arrival (>= 0).
        expected_output_tokens : int, optional
            Expected tokens still to generate (>= 0), used by look-ahead.

        Returns
        -------
        Decision
            ``(rank, "placed")``, or ``(-1, reason)``: the request is not admitted and stays
            with the caller (the refusal is counted in :meth:`statistics`).

        Raises
        ------
        ValueError
            Negative tokens, or an id that is already running.
        TypeError
            An id that is not an int or str, or non-integer tokens.

        Runtime complexity: O(ranks), one numba call.
        """
        if type(kv_tokens) is not int or not 0 <= kv_tokens <= MAX_TOKENS:
            kv_tokens = check_int(kv_tokens, "kv_tokens", min_value=0, max_value=MAX_TOKENS)
        if type(request_id) is not str and type(request_id) is not int:
            _request_id(request_id)
        L = self._L
        if request_id in L.ids:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if expected_output_tokens is None:
            expect = -1
        else:
            expect = check_int(
                expected_output_tokens, "expected_output_tokens", min_value=0,
                max_value=MAX_TOKENS,
            )  # fmt: skip
        if self._link is not None:
            self._pull()
        if kv_tokens > ADMIT_CHECK_TOKENS:
            self._admit_range(kv_tokens)
        free = L.free
        if not free:
            L.grow(L.slots.shape[1])
        slot = free[-1]
        h = self._h
        if h:
            s_score = kv_tokens + h
            present = expect < 0 or expect > h
            add_pb = 1.0 if present else 0.0
            add_ps = float(kv_tokens + h) if present else 0.0
        else:
            s_score = kv_tokens
            add_pb = add_ps = 0.0
        if self._code == K.RANDOM:
            self._rng.random(out=L.X[K.ROW_KEY])
        r = K.place(
            L.X, L.slots, self._P, slot, kv_tokens, s_score, add_pb, add_ps, expect, self._order,
            self._cursor,
        )  # fmt: skip
        if r < 0:
            self._refused[-r] += 1
            if -r in _NO_ROOM:
                self._room = (request_id, kv_tokens)
            return _REFUSED[-r]
        self._room = None  # the room went to this request (FIFO callers offer the head first)
        L.take(request_id, slot)
        self._order += 1
        self._cursor = r + 1 if r + 1 < self._n else 0
        if self._link is not None:
            self._push()
        return self._placed[r]

    def _admit_range(self, kv_tokens: int) -> None:
        if float(self._L.X[K.ROW_S].max()) + kv_tokens > MAX_RANK_TOKENS:
            raise ValueError(
                f"kv_tokens: {kv_tokens} more KV tokens could take a rank past {MAX_RANK_TOKENS} "
                "(the most the ledger sums exactly)"
            )

    def finish(self, request_id: Hashable) -> int:
        """Release a finished request; returns the rank it ran on. ``KeyError`` if unknown."""
        r = self._L.release(self._L.slot_of(request_id))
        self._counts["finished"] += 1
        self._push()
        return r

    def abort(self, request_id: Hashable) -> int:
        """Release an aborted request; returns its rank. ``KeyError`` if unknown."""
        r = self._L.release(self._L.slot_of(request_id))
        self._counts["aborted"] += 1
        self._push()
        return r

    # ------------------------------------------------------------------ progress
    def step(
        self, tokens: Any = None, *, request_tokens: Mapping[Hashable, int] | None = None
    ) -> None:
        """Record one engine step: KV grows by the tokens generated.

        Parameters
        ----------
        tokens : int or array_like of int, shape (num_ranks,), optional
            Tokens each running request generated, for all ranks or per rank (e.g. accepted
            speculative tokens; 0 for a rank that did not step). Default: 1 each.
        request_tokens : mapping of request id to int, optional
            Tokens generated by each listed request; unlisted requests generated none. Exclusive
            with ``tokens``.

        Raises
        ------
        ValueError, TypeError, KeyError
            Both arguments, negative tokens, a wrong shape or an unknown id (nothing is applied).

        Runtime complexity: O(ranks + requests), vectorised.
        """
        if request_tokens is not None:
            if tokens is not None:
                raise ValueError("tokens, request_tokens: give at most one of them")
            if not isinstance(request_tokens, Mapping):
                raise TypeError(
                    "request_tokens: must be a mapping of request id to tokens, got "
                    f"{type(request_tokens).__name__}"
                )
            todo = [
                (
                    self._L.slot_of(rid),
                    check_int(t, f"request_tokens[{rid!r}]", min_value=0, max_value=MAX_TOKENS),
                )
                for rid, t in request_tokens.items()
            ]
            self._L.growth_iv(todo)
            self._L.grow_requests(todo)
        else:
            n = self._n
            if tokens is None:
                inc = np.ones(n + 1, dtype=np.int64)
            else:
                arr = to_numpy(tokens, "tokens")
                inc = np.empty(n + 1, dtype=np.int64)
                if arr.ndim == 0:
                    inc[:] = check_int(tokens, "tokens", min_value=0, max_value=MAX_TOKENS)
                else:
                    inc[:n] = as_int_array(
                        arr, "tokens", shape=(n,), min_value=0, max_value=MAX_TOKENS
                    )
            inc[n] = 0  # free slots
            self._L.growth_iv(inc)
            self._L.grow_ranks(inc)
        self._counts["steps"] += 1
        self._push()

    # ------------------------------------------------------------------ introspection
    def statistics(self) -> DecodeStatistics:
        """A snapshot of per-rank load, balance and counters (see :class:`DecodeStatistics`)."""
        L = self._L
        tb = L.X[K.ROW_B].astype(np.int64)
        ts = L.X[K.ROW_S].astype(np.int64)
        live = self._state != OUT
        if live.any():
            count_imb = float(max_over_mean(tb[live].astype(np.float64)))
            kv_imb = float(max_over_mean(ts[live].astype(np.float64)))
            step = self._cost.engine_step_s(tb[live], ts[live])
        else:
            count_imb = kv_imb = 1.0
            step = 0.0
        return DecodeStatistics(
            num_requests=tuple((tb - L.fb).tolist()),
            kv_tokens=tuple((ts - L.fs).tolist()),
            rank_state=tuple(STATE_NAMES[x] for x in self._state.tolist()),
            count_imbalance=count_imb,
            kv_imbalance=kv_imb,
            step_time_s=step,
            over_capacity=int((L.X[K.ROW_S] > L.X[K.ROW_CAP_S]).sum()),
            running=len(L.ids),
            admitted=self._order,
            refused=sum(self._refused),
            refused_by_reason=tuple(
                (reason, k) for reason, k in zip(REASONS, self._refused, strict=True) if k
            ),
            foreign_requests=tuple(L.fb.tolist()),
            foreign_kv_tokens=tuple(L.fs.tolist()),
            **self._counts,
            **self._store_counts(),
        )

    def _store_counts(self) -> dict[str, int]:
        return {} if self._link is None else self._link.statistics()

    def _check(self) -> None:
        """Assert every internal invariant (for tests; O(ranks + requests))."""
        L = self._L
        L.check()
        used = L.used()
        assert (L.slots[ORDER, used] < self._order).all(), "admission number from the future"
        assert (L.X[K.ROW_OK] == (self._state == ACTIVE)).all(), "eligibility is stale"
        own_b = L.own()[0]
        assert not (own_b[self._state == OUT]).any(), "a rank out of service holds requests"
        assert 0 <= self._cursor < self._n
        c = self._counts
        assert self._order == len(L.ids) + c["finished"] + c["aborted"] + c["handed_back"], (
            "admitted requests are not all running, finished, aborted or handed back"
        )
        assert self._refused[0] == 0
