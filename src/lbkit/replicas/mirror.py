"""``Mirror``: a local copy of a store's totals, kept current by the announcements of every
change, so that a decision reads no store at all.

Each applied publish or reap moves the totals of a table and announces the move on the
table's channel (``PUBLISH`` inside the script, so the order of announcements is the order of
the changes): ``SEQ|REPLICA|f,d,f,d...`` with ``SEQ`` the table's change counter and ``d`` the
move of total ``f``. A mirror subscribes to the channel first, then takes a snapshot (the
counter, the totals and the contribution of each replica it serves, in one atomic script);
announcements up to the snapshot's counter are skipped, later ones applied in order. A gap in
the counter (an announcement lost: Pub/Sub delivers at most once, e.g. across a reconnect or
an output buffer limit) or the announcement ``0|`` of :meth:`RedisStore.clear` takes a new
snapshot; a server restart breaks the subscription. A lost subscription raises
:class:`lbkit.core.replica.StoreError`: the balancer falls back, and the next good call
subscribes and snapshots again.

What a replica's own publishes did is kept apart (its contribution as the server applied it),
so that the foreign load is ``totals - own``, however many of its publishes are still in
flight.

Runtime complexity: O(fields announced) per announcement; a snapshot is one round trip and
O(fields) work. Every replica reads every other replica's announcements: with ``K`` replicas
each deciding at rate ``r``, a replica parses about ``2 K r`` announcements per second (an
admission and a finish each), the price of reading no store before a decision.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from lbkit.core.replica import StoreError
from lbkit.replicas.pipe import pack

__all__ = ["Mirror", "Subscription", "parse_table"]


class Subscription:
    """A subscription on a socket of its own, read without waiting (``RESP2``: a message is
    ``*3 $7 message $len channel $len data``; the parser here costs a few microseconds a
    message, ``redis-py``'s general one several times that).

    Parameters
    ----------
    kwargs : mapping
        The client pool's connection arguments: ``host`` and ``port``, or ``path`` (a Unix
        socket); ``username`` and ``password`` when the server asks for them;
        ``socket_timeout`` and ``socket_connect_timeout`` (the budget).
    """

    def __init__(self, kwargs: dict[str, Any]) -> None:
        if kwargs.get("ssl") or "ssl_keyfile" in kwargs or "ssl_cert_reqs" in kwargs:
            raise ValueError("mirror: needs a server reached without TLS (redis:// or unix://)")
        self._kw = kwargs
        self._sock: socket.socket | None = None
        self._buf = b""

    def open(self, channels: list[bytes]) -> None:
        """Connect and subscribe (waits for the confirmations, within the budget)."""
        kw = self._kw
        timeout = kw.get("socket_connect_timeout") or kw.get("socket_timeout")
        if kw.get("path"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(kw["path"])
        else:
            sock = socket.create_connection((kw.get("host", "localhost"), kw.get("port", 6379)),
                                            timeout=timeout)  # fmt: skip
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(kw.get("socket_timeout"))
        self._sock, self._buf = sock, b""
        cmds = []
        if kw.get("password"):
            auth = [b"AUTH", *([kw["username"].encode()] if kw.get("username") else []),
                    kw["password"].encode()]  # fmt: skip
            cmds.append(pack(auth))
        cmds.append(pack([b"SUBSCRIBE", *channels]))
        sock.sendall(b"".join(cmds))
        want = len(channels) + bool(kw.get("password"))
        got = 0
        while got < want:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("subscription closed by the server")
            self._buf += chunk
            while True:
                item, rest = _parse(self._buf)
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                self._buf = rest
                got += 1
        sock.settimeout(0.0)  # from here on, reads never wait

    def messages(self) -> list[tuple[bytes, bytes]]:
        """The ``(channel, data)`` of the messages that have come (no waiting); raises
        ``ConnectionError`` when the server closed the subscription."""
        sock = self._sock
        while True:
            try:
                chunk = sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                raise ConnectionError("subscription closed by the server")
            self._buf += chunk
            if len(chunk) < 1 << 16:
                break
        out = []
        buf = self._buf
        while buf:
            item, rest = _parse(buf)
            if item is None:
                break
            buf = rest
            if isinstance(item, list) and len(item) == 3 and item[0] == b"message":
                out.append((item[1], item[2]))
        self._buf = buf
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _parse(buf: bytes) -> tuple[Any, bytes]:
    """One ``RESP2`` item from the start of ``buf``: ``(item, rest)``, or ``(None, buf)`` when
    it is not complete yet (arrays of bulk strings and integers, errors as exceptions)."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None, buf
    head, kind = buf[1:end], buf[:1]
    pos = end + 2
    if kind == b"*":
        items = []
        rest = buf[pos:]
        for _ in range(int(head)):
            item, rest2 = _parse(rest)
            if item is None:
                return None, buf
            items.append(item)
            rest = rest2
        return items, rest
    if kind == b"$":
        n = int(head)
        if n < 0:
            return b"", buf[pos:]
        if len(buf) < pos + n + 2:
            return None, buf
        return buf[pos : pos + n], buf[pos + n + 2 :]
    if kind == b":" or kind == b"+":
        return head, buf[pos:]
    return ConnectionError(f"the server refused the subscription: {head.decode()}"), buf[pos:]


def parse_table(buf: bytes | None, size: int) -> np.ndarray:
    """A table string (big-endian int64 fields) as ``size`` int64 values (missing: 0)."""
    buf = buf or b""
    n = 8 * size
    if len(buf) < n:
        buf = buf + bytes(n - len(buf))
    return np.frombuffer(buf, dtype=">i8", count=size).astype(np.int64)


class _Table:
    """The mirror of one table."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.seq = -1  # -1: no snapshot in force
        self.totals = np.zeros(size, dtype=np.int64)
        self.own: dict[str, np.ndarray] = {}  # the served replicas' contributions, as applied


class Mirror:
    """The mirrored tables of one store (see the module documentation).

    Parameters
    ----------
    kwargs : mapping
        The client pool's connection arguments (:class:`Subscription`).
    snapshot : callable
        ``snapshot(table, replica_ids) -> (seq, totals bytes, [contribution bytes])``, one
        atomic call.
    channel : callable
        ``channel(table) -> bytes``, the table's channel.
    """

    def __init__(self, kwargs: dict[str, Any], snapshot: Any, channel: Any) -> None:
        self._sub = Subscription(kwargs)
        self._open = False
        self._snapshot = snapshot
        self._channel = channel
        self._tables: dict[str, _Table] = {}
        self._by_channel: dict[bytes, _Table] = {}
        self.counts = {"announcements": 0, "snapshots": 0, "gaps": 0}

    def _close_subscription(self) -> None:
        self._sub.close()
        self._open = False
        for t in self._tables.values():
            t.seq = -1

    def _resync(self, name: str, t: _Table) -> None:
        seq, tot, own = self._snapshot(name, list(t.own))
        t.seq = int(seq)
        t.totals = parse_table(tot, t.size)
        for rid, buf in zip(list(t.own), own, strict=True):
            t.own[rid] = parse_table(buf, t.size)
        self.counts["snapshots"] += 1

    def foreign(self, table: str, replica_id: str, size: int) -> np.ndarray:
        """The current foreign load of ``replica_id`` in ``table`` (``size`` fields): the
        totals less its own contribution as applied. Raises :class:`StoreError` when the
        subscription or a snapshot fails."""
        t = self._tables.get(table)
        if t is None or t.size != size:
            t = self._tables[table] = _Table(size)
            self._by_channel[self._channel(table)] = t
            self._close_subscription()  # subscribed again, to every channel
        if replica_id not in t.own:
            t.own[replica_id] = np.zeros(size, dtype=np.int64)
            t.seq = -1
        try:
            if not self._open:
                self._sub.open(list(self._by_channel))
                self._open = True
            self._read()
            if t.seq < 0:
                self._resync(table, t)
                self._read()
        except OSError as exc:  # ConnectionError and socket timeouts included
            self._close_subscription()
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        except StoreError:
            self._close_subscription()
            raise
        return t.totals - t.own[replica_id]

    def _read(self) -> None:
        """Apply the announcements that have come (no waiting)."""
        for ch, data in self._sub.messages():
            t = self._by_channel.get(ch)
            if t is None or t.seq < 0:
                continue
            seq_s, rest = data.split(b"|", 1)
            rid_s, pairs = rest.rsplit(b"|", 1)
            seq = int(seq_s)
            if 0 < seq <= t.seq:
                continue  # in the snapshot already
            if seq != t.seq + 1:
                # Lost, or 0: the table was cleared (RedisStore.clear announces it).
                self.counts["gaps"] += 1
                t.seq = -1  # a new snapshot at the next look
                continue
            t.seq = seq
            self.counts["announcements"] += 1
            if not pairs:
                continue
            fd = pairs.split(b",")
            own = t.own.get(rid_s.decode())
            tot = t.totals
            for i in range(0, len(fd), 2):
                f, d = int(fd[i]), int(fd[i + 1])
                if f < t.size:
                    tot[f] += d
                    if own is not None:
                        own[f] += d

    def close(self) -> None:
        """Close the subscription."""
        self._close_subscription()
