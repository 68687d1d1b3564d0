"""Fixtures of the replica tests: real servers on 127.0.0.1 (see ``server.py``)."""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest

from .server import Server, require_binary, server_binaries

if importlib.util.find_spec("redis") is None and os.environ.get("CI", "").lower() not in (
    "1", "true", "yes",
):  # fmt: skip
    # Without the client (not the dev extra) the store tests cannot run; under CI they must.
    collect_ignore = ["test_redis_store.py", "test_store_balancers.py", "worker.py"]

_names = itertools.count()


@pytest.fixture(scope="session")
def redis_server():
    """One server for the session (tests keep apart by namespace)."""
    srv = Server(require_binary())
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def own_server():
    """A server of the test's own, which it may stop, pause and restart."""
    srv = Server(require_binary())
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(params=sorted(server_binaries()) or ["none"])
def any_server(request):
    """Each available server binary in turn (Redis 6.2 and Valkey from the dev extra)."""
    if request.param == "none":
        require_binary()
    srv = Server(server_binaries()[request.param])
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def closing():
    """``closing(store)`` returns the store and closes it when the test ends, passed or not."""
    opened = []

    def keep(store):
        opened.append(store)
        return store

    yield keep
    for store in reversed(opened):
        store.close()


@pytest.fixture
def namespace():
    return f"t{next(_names)}"
