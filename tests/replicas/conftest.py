"""Fixtures of the replica tests: real servers on 127.0.0.1 (see ``server.py``)."""

from __future__ import annotations

import itertools

import pytest

from .server import Server, require_binary, server_binaries

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
def namespace():
    return f"t{next(_names)}"
