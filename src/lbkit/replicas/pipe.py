"""``Pipe``: one connection of a :class:`lbkit.replicas.RedisStore` on which publishes are
pipelined.

A call that needs its answer (a view, an inspection) waits for it: one round trip. A publish
does not: it is written to the socket and the caller goes on; its reply is read before the
next call's, or whenever the socket has it (:meth:`Pipe.poll`), in the order sent (the server
answers one connection's commands in order). A publish that was lost with the connection is
caught by the versions: the next view returns the version the server holds, older than the
replica's, and the replica publishes whole (:mod:`lbkit.core.replica`).

The connection is the pipe's own (from the client's pool, never returned to it), and its
scripts are loaded on every connect, so ``EVALSHA`` finds them after a server restart.
``redis-py`` makes the connection (address, TLS, authentication, database, handshake); the
pipe then writes and reads its socket itself: the command is packed here (``RESP``: ``*N``,
then ``$len`` and the bytes of each argument) and the replies are read by the small reader of
:class:`Wire` (``RESP2`` and ``RESP3``), which costs a few microseconds a reply where
``redis-py``'s general one costs tens (a connection object without the socket attribute
``_sock`` of ``redis-py`` 4.5 to 8 is read by ``redis-py`` itself).

Runtime complexity: O(bytes sent and received) per call.
"""

from __future__ import annotations

import hashlib
import select
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lbkit.core.replica import StoreError

__all__ = ["MAX_PENDING", "STALE_S", "Pipe", "Wire", "pack"]

#: Seconds after which an idle connection is checked before a send (shorter than any server
#: restart: a connection that broke since is found before it loses a publish).
STALE_S = 0.001
#: Publishes in flight at most; one more waits for the oldest reply (keeps the socket's
#: buffers and the error latency bounded).
MAX_PENDING = 64


def pack(args: Iterable[bytes]) -> bytes:
    """One command in ``RESP``: ``*N`` then each argument as a bulk string."""
    parts = [b"$%d\r\n%b\r\n" % (len(a), a) for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(parts)


#: Bytes a read asks the socket for at once.
READ_SIZE = 65536


class Wire:
    """Writes and reads one connected ``redis-py`` connection's socket: replies in ``RESP2`` or
    ``RESP3`` (simple, bulk and verbatim strings as bytes, integers, arrays and sets as lists,
    maps as dicts, nil and null as ``None``; an error reply raises
    ``redis.exceptions.ResponseError``). Socket errors raise ``redis-py``'s
    ``TimeoutError`` (the socket's timeout: the store's budget) and ``ConnectionError`` (a
    closed or broken connection), as its own reader does.
    """

    def __init__(self, conn: Any) -> None:
        import redis

        self._conn = conn
        self._buf = bytearray()
        self._pos = 0
        self._timeout = redis.exceptions.TimeoutError
        self._lost = redis.exceptions.ConnectionError
        self._reply_error = redis.exceptions.ResponseError

    def reset(self) -> None:
        """Forget what was read (a new connection)."""
        self._buf = bytearray()
        self._pos = 0

    def _sock(self) -> Any:
        conn = self._conn
        if conn._sock is None:
            conn.connect()  # redis-py's errors; the connect callbacks reset this wire
        return conn._sock

    def send(self, data: bytes) -> None:
        """Write ``data`` (connecting first if needed)."""
        sock = self._sock()
        try:
            sock.sendall(data)
        except TimeoutError as exc:
            raise self._timeout("Timeout writing to socket") from exc
        except OSError as exc:
            raise self._lost(f"Error while writing to socket: {exc}") from exc

    def can_read(self) -> bool:
        """Whether a reply (or the connection's end) can be read without waiting."""
        if self._pos < len(self._buf):
            return True
        sock = self._conn._sock
        if sock is None:
            return False
        pending = getattr(sock, "pending", None)  # TLS: bytes already decrypted
        if pending is not None and pending():
            return True
        try:
            return bool(select.select([sock], [], [], 0)[0])
        except (OSError, ValueError) as exc:
            raise self._lost(f"Error while polling the socket: {exc}") from exc

    def _fill(self) -> None:
        sock = self._conn._sock
        if sock is None:
            raise self._lost("Connection closed")
        try:
            chunk = sock.recv(READ_SIZE)
        except TimeoutError as exc:
            raise self._timeout("Timeout reading from socket") from exc
        except OSError as exc:
            raise self._lost(f"Error while reading from socket: {exc}") from exc
        if not chunk:
            raise self._lost("Connection closed by server.")
        if self._pos and self._pos == len(self._buf):
            self._buf = bytearray(chunk)
            self._pos = 0
        else:
            self._buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._pos)
            if end >= 0:
                line = bytes(self._buf[self._pos : end])
                self._pos = end + 2
                return line
            self._fill()

    def read(self) -> Any:
        """Read one reply (waiting for it within the socket's timeout)."""
        reply = self._reply()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self._buf) - self._pos < n + 2:
                self._fill()
            data = bytes(self._buf[self._pos : self._pos + n])
            self._pos += n + 2
            return data
        if kind == b":":
            return int(rest)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        if kind == b"+":
            return rest
        if kind == b"-":
            return self._reply_error(rest.decode(errors="replace"))
        # RESP3 (redis-py's default protocol from version 8)
        if kind == b"_":
            return None
        if kind == b"%":
            n = int(rest)
            return {self._reply(): self._reply() for _ in range(n)}
        if kind == b"~":
            return [self._reply() for _ in range(int(rest))]
        if kind == b"#":
            return rest == b"t"
        if kind == b",":
            return float(rest)
        if kind == b"(":
            return int(rest)
        if kind in (b"=", b"!"):  # verbatim string, blob error: a bulk
            n = int(rest)
            while len(self._buf) - self._pos < n + 2:
                self._fill()
            data = bytes(self._buf[self._pos : self._pos + n])
            self._pos += n + 2
            if kind == b"!":
                return self._reply_error(data.decode(errors="replace"))
            return data[4:]  # after "txt:"
        if kind == b"|":  # attributes, then the reply they describe
            for _ in range(2 * int(rest)):
                self._reply()
            return self._reply()
        raise self._lost(f"Protocol error: unexpected reply {line[:32]!r}")


class Pipe:
    """A connection with pipelined publishes (see the module documentation).

    Parameters
    ----------
    pool : redis.ConnectionPool
        Makes the connection (with its timeouts: the store's budget).
    scripts : mapping of str to str
        Lua scripts by name, loaded on every connect; :meth:`call` and :meth:`post` take the
        name.
    errors : tuple of exception types
        ``redis-py``'s errors, turned into :class:`lbkit.core.replica.StoreError`.
    """

    def __init__(self, pool: Any, scripts: Mapping[str, str], errors: tuple[type, ...]) -> None:
        import redis

        self._pool = pool
        self._texts = dict(scripts)
        self._sha = {k: hashlib.sha1(v.encode()).hexdigest().encode() for k, v in scripts.items()}
        self._conn: Any = None
        self._wire: Wire | None = None
        self._last_send = -float("inf")
        self._pending: deque[Callable[[Any], None] | None] = deque()
        self._errors = errors
        self._lost = redis.exceptions.ConnectionError
        self._timeout = redis.exceptions.TimeoutError
        self._reply_error = redis.exceptions.ResponseError

    @property
    def pending(self) -> int:
        """Replies in flight."""
        return len(self._pending)

    # ------------------------------------------------------------------ connection
    def _connection(self) -> Any:
        if self._conn is None:
            conn = self._pool.make_connection()
            conn.register_connect_callback(self._on_connect)
            self._conn = conn
            self._wire = Wire(conn) if hasattr(conn, "_sock") else None
        return self._conn

    def _on_connect(self, conn: Any) -> None:
        for text in self._texts.values():
            conn.send_command("SCRIPT", "LOAD", text)
        for _ in self._texts:
            conn.read_response()
        if self._wire is not None:
            self._wire.reset()

    # The connection's I/O: the pipe's own wire, or redis-py's (RESP3).
    def _write(self, data: bytes) -> None:
        if self._wire is not None:
            self._wire.send(data)
        else:
            self._conn.send_packed_command([data], check_health=False)

    def _read(self) -> Any:
        return self._conn.read_response() if self._wire is None else self._wire.read()

    def _can_read(self) -> bool:
        return self._conn.can_read(0) if self._wire is None else self._wire.can_read()

    def _drop(self, exc: BaseException | None = None) -> None:
        """Forget the connection and the replies in flight (told ``None``)."""
        if self._conn is not None:
            self._conn.disconnect()
        if self._wire is not None:
            self._wire.reset()
        lost, self._pending = self._pending, deque()
        for on_reply in lost:
            if on_reply is not None:
                on_reply(None)

    def _evalsha(self, script: str, keys: list[bytes], args: list[bytes]) -> bytes:
        return pack([b"EVALSHA", self._sha[script], b"%d" % len(keys), *keys, *args])

    # ------------------------------------------------------------------ replies
    def _read_one(self) -> Exception | None:
        """Read the oldest reply in flight and hand it over; a reply that is an error is
        returned (the others are read on), a lost connection raises."""
        on_reply = self._pending.popleft()
        try:
            reply = self._read()
        except self._reply_error as exc:
            if on_reply is not None:
                on_reply(None)
            return exc
        except BaseException:
            self._pending.appendleft(on_reply)
            raise
        if on_reply is not None:
            on_reply(reply)
        return None

    def drain(self) -> None:
        """Wait for every reply in flight. Raises :class:`StoreError` when one is an error or
        does not come within the budget; a connection lost on the way is dropped (its
        publishes are caught by the versions)."""
        first: Exception | None = None
        try:
            while self._pending:
                exc = self._read_one()
                first = first or exc
        except self._timeout as exc:
            self._drop(exc)
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        except self._errors as exc:
            self._drop(exc)
        if first is not None:
            raise StoreError(f"{type(first).__name__}: {first}") from first

    def poll(self) -> None:
        """Read the replies that have come, without waiting (:class:`StoreError` as
        :meth:`drain`)."""
        first: Exception | None = None
        try:
            while self._pending and self._can_read():
                exc = self._read_one()
                first = first or exc
        except self._errors as exc:
            self._drop(exc)
        if first is not None:
            raise StoreError(f"{type(first).__name__}: {first}") from first

    # ------------------------------------------------------------------ calls
    def _send(self, data: bytes) -> None:
        """Write one command. A connection idle for ``STALE_S`` is first checked (a server that
        restarted since closed it: the replies in flight are read, and an idle connection
        that has something to read is made again); a broken one is made again once."""
        self._connection()
        now = time.monotonic()
        if now - self._last_send > STALE_S:
            try:
                self.poll()
            except StoreError:
                pass
            self._connection()
            if not self._pending:
                try:
                    stale = self._can_read()
                except self._errors:
                    stale = True
                if stale:
                    self._drop()
        self._last_send = now
        try:
            self._write(data)
            return
        except self._timeout as exc:
            self._drop(exc)
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        except self._errors as exc:
            self._drop(exc)
        try:
            self._write(data)
        except self._errors as exc:
            self._drop(exc)
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def post(
        self,
        script: str,
        keys: list[bytes],
        args: list[bytes],
        on_reply: Callable[[Any], None] | None = None,
    ) -> None:
        """Send a script call without waiting; ``on_reply`` gets its reply (``None``: lost or
        an error) when it is read."""
        if len(self._pending) >= MAX_PENDING:
            self.drain()
        self._send(self._evalsha(script, keys, args))
        self._pending.append(on_reply)

    def call(self, script: str, keys: list[bytes], args: list[bytes]) -> Any:
        """Run a script and wait for its reply (the replies in flight first)."""
        return self._wait(self._evalsha(script, keys, args))

    def command(self, *args: Any) -> Any:
        """Run a plain command and wait for its reply (the replies in flight first)."""
        return self._wait(pack([a if isinstance(a, bytes) else str(a).encode() for a in args]))

    def _wait(self, data: bytes) -> Any:
        # Sent at once, behind the publishes in flight: their replies are read first, the
        # whole costing one round trip.
        try:
            return self._round_trip(data)
        except self._lost as exc:
            # The connection broke (the server restarted between two calls): once more on a
            # new one (a view and the versioned publishes are safe to send twice).
            self._drop(exc)
        try:
            return self._round_trip(data)
        except self._errors as exc:
            if not isinstance(exc, self._reply_error):
                self._drop(exc)
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    def _round_trip(self, data: bytes) -> Any:
        if len(self._pending) >= MAX_PENDING:
            self.drain()
        self._send(data)
        self._pending.append(None)
        first: Exception | None = None
        try:
            while len(self._pending) > 1:
                exc = self._read_one()
                first = first or exc
            self._pending.popleft()
            reply = self._read()
        except self._timeout as exc:
            self._drop(exc)
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        except self._reply_error as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc
        if first is not None:
            raise StoreError(f"{type(first).__name__}: {first}") from first
        return reply

    def close(self) -> None:
        """Read the replies in flight (best effort) and close the connection."""
        try:
            self.drain()
        except StoreError:
            pass
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None
