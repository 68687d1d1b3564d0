"""``RedisStore``: per-rank load totals and each replica's contribution on a Redis server.

Keys, per table (``kind`` is ``"decode"`` or ``"prefill"``; every key of a namespace carries the
hash tag ``{namespace}``, so a cluster keeps them in one slot):

- ``lbkit:{ns}:KIND:tot``: hash, field ``i`` (flat index ``column * ranks + rank``) to the
  total over replicas, an integer;
- ``lbkit:{ns}:KIND:c:REPLICA``: hash, the same fields, this replica's contribution;
- ``lbkit:{ns}:KIND:ver``: hash, replica to the version of its last applied publish;
- ``lbkit:{ns}:KIND:replicas``: set of the replicas holding a contribution;
- ``lbkit:{ns}:KIND:seen``: hash, replica to the server's time of its last call, ms (the
  heartbeat: every call is one);
- ``lbkit:{ns}:KIND:reaped``: set of the replicas whose contribution :meth:`RedisStore.reap`
  removed.

One Lua script (``SYNC``) publishes and views atomically: when the version is newer than the
replica's last applied one, each published field's total moves by (new - old contribution)
and the contribution becomes the new value; then the totals are returned as one comma-separated
string (a reply of one string parses far faster than one of every field; ``size = 0`` returns
none, for a publish whose caller needs no view), with the version of the replica's last
applied publish. The totals are read with one ``HGETALL`` (linear in the fields even in the
compact encoding of small hashes, where each ``HMGET`` field is a scan).
Values are integers (``HINCRBY``); Lua holds them as doubles, exact below ``2**53``.

Reaping
-------
A replica that crashed leaves its contribution in the totals. :meth:`RedisStore.reap` (run by
any replica, or by an operator's job; atomic per replica, so concurrent reapers are safe) takes
out the contribution of every replica silent for ``max_silence_s``: the totals move by minus
its contribution, and the replica is marked reaped. A reaped replica that was only paused is
refused every partial publish and told so (its stored version reads ``-2``): it publishes its
whole ledger again at once (:mod:`lbkit.core.replica`, *rebuild*), so nothing is lost when it
comes back, and nothing is counted twice if it does not. A replica idle for longer than the
silence has nothing at stake either: its next call rebuilds it.

Leader lease
------------
Once-per-round work (a prefill round's plan, EPLB scheduler state) has one writer: the holder
of a lease, ``lbkit:{ns}:lease:NAME`` (``SET NX PX``, value ``REPLICA:EPOCH``), renewed by its
holder (:meth:`RedisStore.acquire_lease`). Each grant takes a new *fencing epoch* from the
counter ``lbkit:{ns}:epoch:NAME``, and :meth:`RedisStore.write_fenced` applies a write only
under the latest epoch: a leader that paused past its lease and was replaced finds its late
writes refused. Followers read the versioned payload with :meth:`RedisStore.read_fenced` and
apply a version newer than the one they hold.

Commands: ``EVALSHA``/``EVAL``, ``TIME``, ``GET``, ``SET``, ``INCR``, ``PEXPIRE``, ``HGET``,
``HMGET``, ``HSET``, ``HDEL``, ``HINCRBY``, ``HGETALL``, ``HKEYS``, ``SADD``, ``SREM``,
``SISMEMBER``, ``SMEMBERS``, ``DEL``, all in Redis 6.2 and
Valkey (scripts replicate by effects, the default since Redis 5, so ``TIME`` may precede
writes).

Every call has a time budget (``budget_s``: socket connect and read timeouts, no retries); a
call that fails or exceeds it raises :class:`lbkit.core.replica.StoreError`, and the balancer
falls back (:mod:`lbkit.core.replica`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.replica import StoreError
from lbkit.core.validation import check_real

__all__ = ["RedisStore"]

SYNC = """
local t0 = redis.call('TIME')
local ms = tonumber(t0[1]) * 1000 + math.floor(tonumber(t0[2]) / 1000)
local cur = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '-1')
local ver = tonumber(ARGV[2])
local whole = ARGV[4] == '1'
local reaped = redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1
local applied = 0
if ver >= 0 and ver > cur and (whole or not reaped) then
  for i = 5, #ARGV, 2 do
    local f = ARGV[i]
    local new = tonumber(ARGV[i + 1])
    local old = tonumber(redis.call('HGET', KEYS[2], f) or '0')
    if new ~= old then
      redis.call('HINCRBY', KEYS[1], f, string.format('%.0f', new - old))
      redis.call('HSET', KEYS[2], f, ARGV[i + 1])
    end
  end
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
  redis.call('SADD', KEYS[4], ARGV[1])
  redis.call('SREM', KEYS[5], ARGV[1])
  reaped = false
  applied = 1
end
redis.call('HSET', KEYS[6], ARGV[1], ms)
local stored = redis.call('HGET', KEYS[3], ARGV[1]) or '-1'
if reaped then stored = '-2' end
local size = tonumber(ARGV[3])
if size == 0 then return {applied, '', stored} end
local t = {}
for i = 1, size do t[i] = '0' end
local kv = redis.call('HGETALL', KEYS[1])
for i = 1, #kv, 2 do
  local f = tonumber(kv[i])
  if f < size then t[f + 1] = kv[i + 1] end
end
return {applied, table.concat(t, ','), stored}
"""

REAP = """
local t0 = redis.call('TIME')
local ms = tonumber(t0[1]) * 1000 + math.floor(tonumber(t0[2]) / 1000)
local last = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '-1')
if last < 0 or ms - last < tonumber(ARGV[2]) then return 0 end
local kv = redis.call('HGETALL', KEYS[2])
for i = 1, #kv, 2 do
  redis.call('HINCRBY', KEYS[1], kv[i], string.format('%.0f', -tonumber(kv[i + 1])))
end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 1
"""
ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder, epoch = string.match(cur, '^(.*):(%d+)$')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(epoch)
  end
  return -1
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. epoch, 'NX', 'PX', ARGV[2])
return epoch
"""

RELEASE = """
local cur = redis.call('GET', KEYS[1])
if cur and cur == ARGV[1] .. ':' .. ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

WRITE_FENCED = """
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= tonumber(ARGV[1]) then return -1 end
local version = redis.call('HINCRBY', KEYS[2], 'version', 1)
redis.call('HSET', KEYS[2], 'epoch', ARGV[1], 'payload', ARGV[2])
return version
"""

#: Fields of one table at most (for the ``HINCRBY`` sums to stay exact: values below 2**53).
MAX_FIELDS = 1 << 20


def _dense(pairs: list[Any], size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.int64)
    for i in range(0, len(pairs), 2):
        f = int(pairs[i])
        if f < size:
            out[f] = int(pairs[i + 1])
    return out


def _row(text: bytes, size: int) -> np.ndarray:
    return np.array(text.decode().split(","), dtype=np.int64) if size else np.zeros(0, np.int64)


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
        Time budget of each call, seconds (connect and read timeouts; no retries).
    client : redis.Redis, optional
        A client to use instead of one made from ``url`` (its own timeouts then apply).

    Raises
    ------
    ImportError
        ``redis-py`` is not installed (``pip install 'lbkit[redis]'``).
    ValueError
        An empty namespace, or one holding ``{``, ``}`` or ``:``.

    Runtime complexity: one round trip per call; the server's work is O(published fields +
    fields of the table).
    """

    def __init__(
        self, url: str, *, namespace: str, budget_s: float = 0.1, client: Any = None
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "lbkit.replicas.RedisStore needs redis-py: pip install 'lbkit[redis]'"
            ) from None
        if not isinstance(namespace, str) or not namespace or any(c in namespace for c in "{}:"):
            raise ValueError(
                f"namespace: must be a non-empty str without '{{', '}}' or ':', got {namespace!r}"
            )
        self.namespace = namespace
        self.budget_s = check_real(budget_s, "budget_s", min_value=0.0, strict_min=True)
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
        self._sync = client.register_script(SYNC)
        self._reap = client.register_script(REAP)
        self._acquire = client.register_script(ACQUIRE)
        self._release = client.register_script(RELEASE)
        self._write_fenced = client.register_script(WRITE_FENCED)

    def _key(self, table: str, part: str) -> str:
        return f"lbkit:{{{self.namespace}}}:{table}:{part}"

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
        """Publish and view in one atomic script (:class:`lbkit.core.replica.Store`)."""
        keys = [self._key(key, "tot"), self._key(key, f"c:{replica_id}"),
                self._key(key, "ver"), self._key(key, "replicas"), self._key(key, "reaped"),
                self._key(key, "seen")]  # fmt: skip
        if size > MAX_FIELDS:
            raise ValueError(f"size: a table holds at most {MAX_FIELDS} fields, got {size}")
        args: list[Any] = [replica_id, int(version), int(size), int(bool(whole))]
        for f, v in zip(fields.tolist(), values.tolist(), strict=True):
            args += (f, v)
        try:
            _, tot, stored = self._sync(keys=keys, args=args)
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        return (_row(tot, size) if size else None), int(stored)

    def reap(self, key: str, *, max_silence_s: float) -> tuple[str, ...]:
        """Take out of table ``key`` the contribution of every replica whose last call is
        ``max_silence_s`` seconds old or older (server time); return their ids.

        Runtime complexity: one call to list the replicas, then one script per silent one,
        O(its fields).
        """
        silence_ms = round(check_real(max_silence_s, "max_silence_s", min_value=0.0) * 1000)
        keys = [self._key(key, p) for p in ("tot", "", "replicas", "reaped", "seen")]
        out = []
        try:
            for name in sorted(m.decode() for m in self._client.hkeys(keys[4])):
                keys[1] = self._key(key, f"c:{name}")
                if self._reap(keys=keys, args=[name, silence_ms]):
                    out.append(name)
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        return tuple(out)

    # ------------------------------------------------------------------ leader
    def _lease_keys(self, name: str) -> list[str]:
        if not isinstance(name, str) or not name or any(c in name for c in "{}:"):
            raise ValueError(
                f"name: must be a non-empty str without '{{', '}}' or ':', got {name!r}"
            )
        return [f"lbkit:{{{self.namespace}}}:lease:{name}",
                f"lbkit:{{{self.namespace}}}:epoch:{name}",
                f"lbkit:{{{self.namespace}}}:fenced:{name}"]  # fmt: skip

    def acquire_lease(self, name: str, replica_id: str, *, ttl_s: float) -> int:
        """Take or renew the lease ``name`` for ``ttl_s`` seconds; its fencing epoch, or -1
        when another replica holds it.

        A new grant takes a new epoch (1, 2, ...); a renewal by the holder keeps it.
        """
        keys = self._lease_keys(name)
        ttl_ms = max(1, round(check_real(ttl_s, "ttl_s", min_value=0.0, strict_min=True) * 1000))
        if not isinstance(replica_id, str) or not replica_id or ":" in replica_id:
            raise ValueError(f"replica_id: must be a non-empty str without ':', got {replica_id!r}")
        try:
            return int(self._acquire(keys=keys[:2], args=[replica_id, ttl_ms]))
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def release_lease(self, name: str, replica_id: str, epoch: int) -> bool:
        """Give up the lease if ``replica_id`` holds it under ``epoch``; whether it did."""
        keys = self._lease_keys(name)
        try:
            return bool(self._release(keys=keys[:1], args=[replica_id, int(epoch)]))
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def write_fenced(self, name: str, epoch: int, payload: str) -> int:
        """Store ``payload`` under lease ``name`` if ``epoch`` is the latest granted; the new
        version (1, 2, ...), or -1 for a refused write (a newer leader exists)."""
        keys = self._lease_keys(name)
        try:
            return int(self._write_fenced(keys=[keys[1], keys[2]], args=[int(epoch), payload]))
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def read_fenced(self, name: str) -> tuple[int, int, str] | None:
        """``(epoch, version, payload)`` of the last fenced write under ``name`` (``None``:
        none yet)."""
        keys = self._lease_keys(name)
        try:
            got = self._client.hmget(keys[2], ["epoch", "version", "payload"])
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        if got[0] is None:
            return None
        return int(got[0]), int(got[1]), got[2].decode()

    # ------------------------------------------------------------------ inspection
    def totals(self, key: str, size: int) -> np.ndarray:
        """Totals of table ``key`` (``"decode"`` or ``"prefill"``), ``size`` int64 fields."""
        try:
            return _dense(self._flat(self._client.hgetall(self._key(key, "tot"))), size)
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def contributions(self, key: str, size: int) -> dict[str, np.ndarray]:
        """Each replica's contribution to table ``key``, ``size`` int64 fields each."""
        try:
            names = sorted(m.decode() for m in self._client.smembers(self._key(key, "replicas")))
            return {
                name: _dense(self._flat(self._client.hgetall(self._key(key, f"c:{name}"))), size)
                for name in names
            }
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _flat(mapping: dict[Any, Any]) -> list[Any]:
        out: list[Any] = []
        for k, v in mapping.items():
            out += (k, v)
        return out

    def clear(self) -> None:
        """Delete every key of this namespace's tables (for tests and a fresh start)."""
        try:
            for table in ("decode", "prefill"):
                names = self._client.hkeys(self._key(table, "seen"))
                keys = [self._key(table, p) for p in ("tot", "ver", "replicas", "seen", "reaped")]
                keys += [self._key(table, f"c:{m.decode()}") for m in names]
                self._client.delete(*keys)
        except self._errors as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Close the client's connections."""
        self._client.close()
