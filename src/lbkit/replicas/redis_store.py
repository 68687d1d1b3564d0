"""``RedisStore``: per-rank load totals and each replica's contribution on a Redis server.

Keys, per table (``kind`` is ``"decode"`` or ``"prefill"``; every key of a namespace carries the
hash tag ``{namespace}``, so a cluster keeps them in one slot), ``lbkit:{ns}:KIND:PART`` with
the parts of :mod:`lbkit.replicas.scripts`: the totals and each replica's contribution (strings
of int64 fields), the versions, the replicas, the heartbeats, the change counter and the
channel announcing each change.

One Lua script (``SYNC``) publishes and views atomically: when the version allows it, each
published field's total moves by (new - old contribution) and the contribution becomes the new
value; then the version of the replica's last applied publish and the totals (int64 fields)
are returned as one string (a publish alone returns the version). A partial publish applies
only on top of the replica's publish of the version before it (the store holds exactly what the
replica last sent); a whole one over any older version. A publish the store refused shows in
the next view's version, older than the replica's: the replica then publishes whole
(:mod:`lbkit.core.replica`, *rebuild*).

Round trips
-----------
A publish is pipelined (:mod:`lbkit.replicas.pipe`): written to the socket without waiting,
its reply read with the next call's. A decision then costs, in the store:

- ``mirror=False`` (default): one round trip, the view (a ``GET`` of the totals in the
  script); a finish or a step none;
- ``mirror=True``: none. The store keeps the totals in a local mirror, current from the
  announcements of every change (:mod:`lbkit.replicas.mirror`); the view is at most the
  announcements in flight old, and each replica parses every other replica's announcements.

Reaping
-------
A replica that crashed leaves its contribution in the totals. :meth:`RedisStore.reap` (run by
any replica, or by an operator's job; atomic per replica, so concurrent reapers are safe) takes
out the contribution of every replica silent for ``max_silence_s``: the totals move by minus
its contribution, and the replica is marked reaped (version ``-2``). A reaped replica that was
only paused is refused every partial publish: it publishes its whole ledger again at once, so
nothing is lost when it comes back, and nothing is counted twice if it does not. A replica idle
for longer than the silence has nothing at stake either: its next call rebuilds it. The server
records a replica's calls through heartbeats: a call carries one when ``HEARTBEAT_S`` (0.1 s;
``reap_after_s / 10`` when shorter) has passed since the last, so a replica that calls is
never more than that silent to the reaper, and most calls do without the two commands.
:class:`lbkit.core.replica.ReplicaLink` runs the reaper of its table itself when its replica
holds the ``reaper`` lease (``reap_s=``).

Leader lease
------------
Once-per-round work (a prefill round's plan, EPLB scheduler state) has one writer: the holder
of a lease, ``lbkit:{ns}:lease:NAME`` (``SET NX PX``, value ``REPLICA:EPOCH``), renewed by its
holder (:meth:`RedisStore.acquire_lease`). Each grant takes a new *fencing epoch* from the
counter ``lbkit:{ns}:epoch:NAME``, and :meth:`RedisStore.write_fenced` applies a write only
under the latest epoch: a leader that paused past its lease and was replaced finds its late
writes refused. Followers read the versioned payload with :meth:`RedisStore.read_fenced` and
apply a version newer than the one they hold. The EPLB scheduler's state goes the same way:
:meth:`RedisStore.save_eplb` writes :meth:`lbkit.eplb.EplbScheduler.state_dict` under the
leader's epoch, :meth:`RedisStore.load_eplb` rebuilds the scheduler (a replica taking over the
lease resumes where the last leader stopped).

Commands: ``EVALSHA``, ``SCRIPT LOAD``, ``TIME``, ``GET``, ``SET``, ``INCR``, ``PEXPIRE``,
``STRLEN``, ``BITFIELD``, ``HGET``, ``HMGET``, ``HSET``, ``HDEL``, ``HINCRBY``, ``HKEYS``,
``SADD``, ``SREM``, ``SMEMBERS``, ``DEL``, ``SCAN``, ``PUBLISH``, ``SUBSCRIBE``, all in Redis
6.2 and Valkey.

Every call has a time budget (``budget_s``: socket connect and read timeouts, no retries but
one on a connection found broken); a call that fails or exceeds it raises
:class:`lbkit.core.replica.StoreError`, and the balancer falls back (:mod:`lbkit.core.replica`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from lbkit.core.validation import check_real
from lbkit.replicas import scripts
from lbkit.replicas.mirror import Mirror, parse_table
from lbkit.replicas.pipe import Pipe

__all__ = ["RedisStore"]

#: Fields of one table at most (for the sums to stay exact: values below 2**53).
MAX_FIELDS = 1 << 20
_SCRIPTS = {
    "sync": scripts.SYNC,
    "snap": scripts.SNAP,
    "reap": scripts.REAP,
    "acquire": scripts.ACQUIRE,
    "release": scripts.RELEASE,
    "write_fenced": scripts.WRITE_FENCED,
}
_TABLES = ("decode", "prefill", "prefill-demand")
#: Default seconds of a round leader's lease (renewed at each round's end).
DEFAULT_LEASE_S = 10.0
#: Default seconds of silence after which a replica is reaped.
DEFAULT_REAP_AFTER_S = 30.0
#: Keys a ``SCAN`` of :meth:`RedisStore.clear` asks for at once.
CLEAR_BATCH = 1000
#: Publishes in flight from which a call reads the replies that have come (fewer reads, each
#: of many replies at once; a refused publish shows within this many calls).
POLL_PENDING = 8
#: Seconds between a replica's heartbeats while it calls (the store's ``reap_after_s / 10``
#: when that is shorter): a call sends one when this much time has passed since the last, so
#: the server records a replica's last call at most this late, and most calls do without the
#: two commands.
HEARTBEAT_S = 0.1


#: The flags argument of ``SYNC`` by value (1: whole, 2: heartbeat).
_FLAGS = (b"0", b"1", b"2", b"3")


def _glob_escape(text: str) -> bytes:
    """``text`` as a ``SCAN MATCH`` pattern that matches it literally."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text).encode()


def _name_iv(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or any(c in value for c in "{}:"):
        raise ValueError(
            f"{name}: must be a non-empty str without '{{', '}}' or ':', got {value!r}"
        )
    return value


class _Sent:
    """What this store sent for one replica in one table."""

    __slots__ = ("beat", "last", "refused", "whole")

    def __init__(self) -> None:
        self.last = -1  # version of the last publish sent
        self.whole = -1  # version of the last whole publish sent
        self.refused: int | None = None  # stored version of a refused publish, until told
        self.beat = -float("inf")  # time.monotonic() of the last heartbeat sent


class RedisStore:
    """Shared per-rank load of router replicas on a Redis (>= 6.2) or Valkey server.

    Parameters
    ----------
    url : str
        Server address, e.g. ``"redis://127.0.0.1:6379/0"`` (``redis-py``'s ``from_url``).
    namespace : str
        Names the pool: every replica of one pool uses the same namespace, and one store may
        serve a decode and a prefill balancer (their tables are apart).
    budget_s : float, default 0.1
        Time budget of each call, seconds (connect and read timeouts).
    mirror : bool, default False
        Keep the totals in a local mirror current from the store's announcements, so that a
        decision makes no round trip (the module documentation).
    lease_s : float, default ``DEFAULT_LEASE_S``
        Seconds a prefill round's leader holds its lease (renewed at each ``end_round``).
    reap_after_s : float or None, default ``DEFAULT_REAP_AFTER_S``
        Seconds of silence after which the holder of the reaper's lease reaps a replica
        (:mod:`lbkit.core.replica`, *duties*); ``None``: no replica reaps by itself.
    client : redis.Redis, optional
        A client to use instead of one made from ``url`` (its pool, with its timeouts, makes
        the store's connections).

    Raises
    ------
    ImportError
        ``redis-py`` is not installed (``pip install 'lbkit[redis]'``).
    ValueError
        An empty namespace, or one holding ``{``, ``}`` or ``:``.

    Runtime complexity: a view is one round trip (none with ``mirror``), a publish none (it is
    pipelined); the server's work is O(published fields + fields of the table).

    A store holds connections until :meth:`close`; ``with RedisStore(...) as store:`` closes
    it at the end of the block.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        budget_s: float = 0.1,
        mirror: bool = False,
        lease_s: float = DEFAULT_LEASE_S,
        reap_after_s: float | None = DEFAULT_REAP_AFTER_S,
        client: Any = None,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "lbkit.replicas.RedisStore needs redis-py: pip install 'lbkit[redis]'"
            ) from None
        self.namespace = _name_iv(namespace, "namespace")
        self.budget_s = check_real(budget_s, "budget_s", min_value=0.0, strict_min=True)
        self.lease_s = check_real(lease_s, "lease_s", min_value=0.0, strict_min=True)
        self.reap_after_s = (
            None
            if reap_after_s is None
            else check_real(reap_after_s, "reap_after_s", min_value=0.0, strict_min=True)
        )
        if type(mirror) is not bool:
            raise TypeError(f"mirror: must be a bool, got {type(mirror).__name__}")
        if client is None:
            client = redis.Redis.from_url(
                url,
                socket_timeout=self.budget_s,
                socket_connect_timeout=self.budget_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        self._client = client
        self._errors = (redis.exceptions.RedisError, OSError)
        self._pipe = Pipe(client.connection_pool, _SCRIPTS, self._errors)
        self._clock = time.monotonic  # the heartbeats' spacing only
        self._beat_s = (
            HEARTBEAT_S if self.reap_after_s is None else min(HEARTBEAT_S, self.reap_after_s / 10.0)
        )
        self._keys: dict[tuple[str, str], list[bytes]] = {}
        self._sent: dict[tuple[str, str], _Sent] = {}
        self._own: dict[tuple[str, str], np.ndarray] = {}
        self._mirror = (
            Mirror(dict(client.connection_pool.connection_kwargs), self._snapshot, self._channel)
            if mirror
            else None
        )

    @property
    def mirrored(self) -> bool:
        """Whether views come from the local mirror."""
        return self._mirror is not None

    def _key(self, table: str, part: str) -> str:
        return f"lbkit:{{{self.namespace}}}:{table}:{part}"

    def _channel(self, table: str) -> bytes:
        return self._key(table, "ch").encode()

    def _table_keys(self, table: str, replica_id: str) -> list[bytes]:
        keys = self._keys.get((table, replica_id))
        if keys is None:
            keys = [
                self._key(table, p + replica_id if p == "c:" else p).encode()
                for p in scripts.TABLE_PARTS
            ]
            self._keys[(table, replica_id)] = keys
        return keys

    # ------------------------------------------------------------------ the protocol
    def sync(
        self,
        key: str,
        replica_id: str,
        version: int,
        fields: np.ndarray,
        values: np.ndarray,
        size: int,
        whole: bool = False,
    ) -> tuple[np.ndarray | None, int]:
        """Publish and view (:class:`lbkit.core.replica.Store`). A publish is pipelined and
        the version returned for it is the one sent (the next view tells the one held)."""
        if size > MAX_FIELDS:
            raise ValueError(f"size: a table holds at most {MAX_FIELDS} fields, got {size}")
        keys = self._table_keys(key, replica_id)
        sent = self._sent.get((key, replica_id))
        if sent is None:
            sent = self._sent[(key, replica_id)] = _Sent()
        now = self._clock()
        flags = 1 if whole else 0
        if (version < 0 and not size) or now - sent.beat >= self._beat_s:
            flags += 2  # a heartbeat (a call with nothing to publish or view is one)
            sent.beat = now
        args = [replica_id.encode(), b"%d" % version, b"%d" % size, _FLAGS[flags]]
        if version >= 0:
            for f, v in zip(fields.tolist(), values.tolist(), strict=True):
                args += (b"%d" % f, b"%d" % v)
        mirror = self._mirror
        if mirror is None and size:  # a view: one round trip (the publishes in flight first)
            reply = self._pipe.call("sync", keys, args)
            cut = reply.index(b"|")
            if version >= 0:
                sent.last = version
                if whole:
                    sent.whole = version
            sent.refused = None
            return parse_table(reply[cut + 1 :], size), int(reply[:cut])
        if self._pipe.pending >= POLL_PENDING:
            self._pipe.poll()  # the replies that have come: a refused publish shows
        if version >= 0:
            args[2] = b"0"
            self._pipe.post("sync", keys, args, self._on_publish(sent, version))
            sent.last = version
            if whole:
                sent.whole = version
        elif not size:  # a heartbeat
            self._pipe.post("sync", keys, args)
        stored = sent.last if sent.refused is None else sent.refused
        sent.refused = None
        if mirror is None or not size:
            return None, stored
        foreign = mirror.foreign(key, replica_id, size)
        own = self._own.setdefault((key, replica_id), np.zeros(size, dtype=np.int64))
        if version >= 0:
            if whole:
                own[:] = 0
            own[fields] = values
        return foreign + own, stored

    def _on_publish(self, sent: _Sent, version: int) -> Any:
        def on_reply(reply: Any) -> None:
            held = -1 if reply is None else int(reply)
            if held != version and version >= sent.whole:
                sent.refused = held

        return on_reply

    def _snapshot(self, table: str, replica_ids: list[str]) -> tuple[Any, bytes, list[bytes]]:
        keys = [self._key(table, "tot").encode(), self._key(table, "seq").encode()]
        keys += [self._key(table, "c:" + r).encode() for r in replica_ids]
        out = self._pipe.call("snap", keys, [])
        return out[0], out[1], out[2:]

    def flush(self) -> None:
        """Wait until the server has applied every publish sent (raises
        :class:`StoreError` when it does not answer within the budget)."""
        self._pipe.drain()

    # ------------------------------------------------------------------ reaping
    def reap(self, key: str, *, max_silence_s: float) -> tuple[str, ...]:
        """Take out of table ``key`` the contribution of every replica whose last heartbeat is
        ``max_silence_s`` seconds old or older (server time); return their ids. A replica that
        calls beats every ``HEARTBEAT_S`` (the module documentation): a silence shorter than
        that may reap a live replica, which then publishes whole again (nothing lost).

        Runtime complexity: one call to list the replicas, then one script per silent one,
        O(its fields).
        """
        silence_ms = round(check_real(max_silence_s, "max_silence_s", min_value=0.0) * 1000)
        out = []
        seen = self._pipe.command("HKEYS", self._key(key, "seen"))
        for name in sorted(m.decode() for m in seen):
            keys = self._table_keys(key, name)
            if self._pipe.call("reap", keys, [name.encode(), b"%d" % silence_ms]):
                out.append(name)
        return tuple(out)

    # ------------------------------------------------------------------ leader
    def _lease_keys(self, name: str) -> list[bytes]:
        _name_iv(name, "name")
        return [f"lbkit:{{{self.namespace}}}:lease:{name}".encode(),
                f"lbkit:{{{self.namespace}}}:epoch:{name}".encode(),
                f"lbkit:{{{self.namespace}}}:fenced:{name}".encode()]  # fmt: skip

    def acquire_lease(self, name: str, replica_id: str, *, ttl_s: float) -> int:
        """Take or renew the lease ``name`` for ``ttl_s`` seconds; its fencing epoch, or -1
        when another replica holds it.

        A new grant takes a new epoch (1, 2, ...); a renewal by the holder keeps it.
        """
        keys = self._lease_keys(name)
        ttl_ms = max(1, round(check_real(ttl_s, "ttl_s", min_value=0.0, strict_min=True) * 1000))
        if not isinstance(replica_id, str) or not replica_id or ":" in replica_id:
            raise ValueError(f"replica_id: must be a non-empty str without ':', got {replica_id!r}")
        return int(self._pipe.call("acquire", keys[:2], [replica_id.encode(), b"%d" % ttl_ms]))

    def release_lease(self, name: str, replica_id: str, epoch: int) -> bool:
        """Give up the lease if ``replica_id`` holds it under ``epoch``; whether it did."""
        keys = self._lease_keys(name)
        return bool(self._pipe.call("release", keys[:1], [replica_id.encode(),
                                                          b"%d" % int(epoch)]))  # fmt: skip

    def write_fenced(self, name: str, epoch: int, payload: str) -> int:
        """Store ``payload`` under lease ``name`` if ``epoch`` is the latest granted; the new
        version (1, 2, ...), or -1 for a refused write (a newer leader exists)."""
        keys = self._lease_keys(name)
        return int(self._pipe.call("write_fenced", [keys[1], keys[2]],
                                   [b"%d" % int(epoch), payload.encode()]))  # fmt: skip

    def read_fenced(self, name: str) -> tuple[int, int, str] | None:
        """``(epoch, version, payload)`` of the last fenced write under ``name`` (``None``:
        none yet)."""
        keys = self._lease_keys(name)
        got = self._pipe.command("HMGET", keys[2], "epoch", "version", "payload")
        if got[0] is None:
            return None
        return int(got[0]), int(got[1]), got[2].decode()

    # ------------------------------------------------------------------ EPLB state
    def save_eplb(self, name: str, epoch: int, scheduler: Any) -> int:
        """Save ``scheduler``'s state (:meth:`lbkit.eplb.EplbScheduler.state_dict`, as JSON)
        under lease ``name`` if ``epoch`` is the latest granted (:meth:`write_fenced`): the
        new version, or -1 for a refused write (a newer leader exists).

        Raises
        ------
        TypeError
            ``scheduler`` is not an :class:`lbkit.eplb.EplbScheduler`.
        """
        from lbkit.eplb import EplbScheduler

        if not isinstance(scheduler, EplbScheduler):
            raise TypeError(f"scheduler: must be an EplbScheduler, got {type(scheduler).__name__}")
        return self.write_fenced(name, epoch, json.dumps(scheduler.state_dict()))

    def load_eplb(self, name: str) -> tuple[int, int, Any] | None:
        """``(epoch, version, scheduler)`` of the last state saved under lease ``name`` by
        :meth:`save_eplb`, the scheduler rebuilt by
        :meth:`lbkit.eplb.EplbScheduler.from_state_dict` (``None``: none saved yet)."""
        from lbkit.eplb import EplbScheduler

        got = self.read_fenced(name)
        if got is None:
            return None
        epoch, version, payload = got
        return epoch, version, EplbScheduler.from_state_dict(json.loads(payload))

    # ------------------------------------------------------------------ inspection
    def totals(self, key: str, size: int) -> np.ndarray:
        """Totals of table ``key`` (``"decode"`` or ``"prefill"``), ``size`` int64 fields."""
        return parse_table(self._pipe.command("GET", self._key(key, "tot")), size)

    def contributions(self, key: str, size: int) -> dict[str, np.ndarray]:
        """Each replica's contribution to table ``key``, ``size`` int64 fields each."""
        members = self._pipe.command("SMEMBERS", self._key(key, "replicas"))
        names = sorted(m.decode() for m in members)
        return {
            name: parse_table(self._pipe.command("GET", self._key(key, f"c:{name}")), size)
            for name in names
        }

    def clear(self) -> None:
        """Delete every key of this namespace (tables, leases, epochs, fenced payloads; for
        tests and a fresh start), and announce it to the mirrors.

        Runtime complexity: the server's ``SCAN`` of its keyspace, ``CLEAR_BATCH`` keys a call.
        """
        pattern = _glob_escape(f"lbkit:{{{self.namespace}}}:") + b"*"
        cursor = b"0"
        while True:
            cursor, keys = self._pipe.command(
                "SCAN", cursor, "MATCH", pattern, "COUNT", CLEAR_BATCH
            )
            if keys:
                self._pipe.command("DEL", *keys)
            if cursor == b"0":
                break
        for table in _TABLES:
            self._pipe.command("PUBLISH", self._channel(table), b"0||")

    def close(self) -> None:
        """Wait for the publishes in flight (best effort) and close the connections (a store
        closed may be used again: it connects anew)."""
        self._pipe.close()
        if self._mirror is not None:
            self._mirror.close()
        self._client.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
