"""RedisStore on a real server: the SYNC script's arithmetic, versions and atomicity."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lbkit.core.replica import StoreError
from lbkit.replicas import RedisStore


def _sync(store, replica, version, values: dict, size=4, whole=False):
    fields = np.array(list(values), dtype=np.int64)
    vals = np.array(list(values.values()), dtype=np.int64)
    return store.sync("decode", replica, version, fields, vals, size, whole=whole)


def test_sync_sums_contributions_and_ignores_old_versions(any_server, closing):
    store = closing(RedisStore(any_server.url, namespace="s", budget_s=2.0))
    tot, ver = _sync(store, "a", 1, {0: 3, 2: 2**50}, whole=True)
    assert tot.tolist() == [3, 0, 2**50, 0] and ver == 1
    tot, ver = _sync(store, "b", 1, {0: 1, 1: 5}, whole=True)
    assert tot.tolist() == [4, 5, 2**50, 0] and ver == 1
    tot, _ = _sync(store, "a", 2, {0: 1, 2: 7})  # absolute values: totals move by the change
    assert tot.tolist() == [2, 5, 7, 0]
    for version in (2, 1):  # a retried or late publish changes nothing
        tot, ver = _sync(store, "a", version, {0: 99})
        assert tot.tolist() == [2, 5, 7, 0] and ver == 2
    tot, ver = _sync(store, "a", -1, {})  # a view
    assert tot.tolist() == [2, 5, 7, 0] and ver == 2
    # A partial publish applies only on top of version - 1 (the store holds what was sent).
    assert _sync(store, "a", 4, {0: 50})[1] == 2
    assert _sync(store, "c", 7, {0: 50})[1] == -1  # never published whole
    assert store.contributions("decode", 4)["a"].tolist() == [1, 0, 7, 0]
    assert _sync(store, "c", -1, {})[1] == -1  # never published
    contrib = store.contributions("decode", 4)
    assert sorted(contrib) == ["a", "b"]
    assert (sum(contrib.values()) == store.totals("decode", 4)).all()
    store.clear()
    assert store.totals("decode", 4).tolist() == [0, 0, 0, 0]


def test_an_unreachable_server_raises_store_error(own_server, closing):
    store = closing(RedisStore(own_server.url, namespace="x", budget_s=0.2))
    _sync(store, "a", 1, {0: 1}, whole=True)
    own_server.stop()
    with pytest.raises(StoreError):
        _sync(store, "a", 2, {0: 2})
    own_server.start()  # the script cache is empty again: it is loaded on connect
    tot, ver = _sync(store, "a", 3, {0: 2})
    assert tot.tolist() == [0, 0, 0, 0] and ver == -1  # nothing persisted: refused partial
    tot, ver = _sync(store, "a", 4, {0: 2}, whole=True)
    assert tot.tolist() == [2, 0, 0, 0] and ver == 4


def test_a_paused_server_times_out_within_the_budget(own_server, closing):
    store = closing(RedisStore(own_server.url, namespace="p", budget_s=0.1))
    _sync(store, "a", 1, {0: 1})
    own_server.pause()
    try:
        with pytest.raises(StoreError, match="Timeout"):
            _sync(store, "a", 2, {0: 2})
    finally:
        own_server.resume()


@pytest.mark.parametrize(
    ("kw", "match"),
    [(dict(namespace=""), "namespace"), (dict(namespace="a:b"), "namespace"),
     (dict(namespace="n", budget_s=0.0), "budget_s")],
)  # fmt: skip
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        RedisStore("redis://127.0.0.1:1/0", **kw)


def test_a_paused_leader_is_replaced_and_its_late_write_refused(any_server, closing):
    store = closing(RedisStore(any_server.url, namespace="lease", budget_s=2.0))
    a = store.acquire_lease("round", "a", ttl_s=0.3)
    assert a == 1
    assert store.acquire_lease("round", "b", ttl_s=0.3) == -1  # a holds it
    assert store.acquire_lease("round", "a", ttl_s=0.3) == 1  # renewal keeps the epoch
    assert store.write_fenced("round", a, '{"plan": 1}') == 1
    time.sleep(0.5)  # a pauses past its lease (no renewal)
    b = store.acquire_lease("round", "b", ttl_s=5.0)
    assert b == 2
    assert store.write_fenced("round", a, '{"plan": "late"}') == -1  # fenced off
    assert store.acquire_lease("round", "a", ttl_s=0.3) == -1
    assert store.write_fenced("round", b, '{"plan": 2}') == 2
    assert store.read_fenced("round") == (2, 2, '{"plan": 2}')
    assert not store.release_lease("round", "a", a)
    assert store.release_lease("round", "b", b)
    assert store.acquire_lease("round", "a", ttl_s=1.0) == 3
    assert store.read_fenced("other") is None
    with pytest.raises(ValueError, match="name"):
        store.acquire_lease("a:b", "a", ttl_s=1.0)


def test_clear_removes_every_key_of_its_namespace_and_no_other(any_server, closing):
    """Tables, leases, epochs and fenced payloads go; a namespace the unescaped pattern would
    match (``[l]``, ``*`` and ``?`` are glob characters) keeps its keys."""
    import redis

    stores = [closing(RedisStore(any_server.url, namespace=ns, budget_s=2.0))
              for ns in ("c[l]*r?", "clxrz")]  # fmt: skip
    for store in stores:
        _sync(store, "a", 1, {0: 3}, whole=True)
        store.sync("prefill-demand", "a", 1, np.array([0]), np.array([5]), 1, whole=True)
        epoch = store.acquire_lease("round-prefill", "a", ttl_s=30.0)
        assert store.write_fenced("round-prefill", epoch, "{}") == 1
        store.reap("decode", max_silence_s=60.0)
        store.flush()
    with redis.Redis.from_url(any_server.url) as client:
        before = {k for k in client.scan_iter() if k.startswith(b"lbkit:{clxrz}:")}
        assert len(before) >= 8  # the table's, the demand's, the lease's
        stores[0].clear()
        left = set(client.scan_iter())
    assert not {k for k in left if k.startswith(b"lbkit:{c[l]*r?}:")}
    assert {k for k in left if k.startswith(b"lbkit:{clxrz}:")} == before
    assert stores[0].read_fenced("round-prefill") is None
    assert stores[0].acquire_lease("round-prefill", "b", ttl_s=1.0) == 1  # epochs start anew
    assert stores[1].read_fenced("round-prefill") == (1, 1, "{}")
    for store in stores:
        store.clear()


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_store_reads_both_protocols(any_server, closing, protocol):
    """The pipe reads its socket itself: RESP2 and RESP3 replies (integers, bulk strings, nil
    and null, arrays, sets) come out alike, an error reply is a StoreError and the connection
    goes on."""
    import redis

    client = redis.Redis.from_url(any_server.url, protocol=protocol, socket_timeout=2.0)
    store = closing(RedisStore(any_server.url, namespace=f"resp{protocol}", client=client))
    tot, ver = _sync(store, "a", 1, {0: 3, 3: -(2**50)}, whole=True)
    assert tot.tolist() == [3, 0, 0, -(2**50)] and ver == 1
    _sync(store, "b", 1, {1: 4}, whole=True)
    store.flush()
    assert store.totals("decode", 4).tolist() == [3, 4, 0, -(2**50)]
    assert {k: v.tolist() for k, v in store.contributions("decode", 4).items()} == {
        "a": [3, 0, 0, -(2**50)], "b": [0, 4, 0, 0]}  # fmt: skip
    assert store.read_fenced("none") is None  # HMGET of nil (RESP2) or null (RESP3) fields
    epoch = store.acquire_lease("l", "a", ttl_s=5.0)
    assert store.write_fenced("l", epoch, "p\r\nq") == 1
    assert store.read_fenced("l") == (epoch, 1, "p\r\nq")
    with pytest.raises(StoreError, match="unknown command"):
        store._pipe.command("NO-SUCH-COMMAND")
    assert _sync(store, "a", -1, {})[0].tolist() == [3, 4, 0, -(2**50)]
    store.clear()
    assert store.totals("decode", 4).tolist() == [0, 0, 0, 0]


def test_a_call_beats_once_the_heartbeat_spacing_has_passed(redis_server, closing):
    """The server records a replica's last call (``seen``) at most ``HEARTBEAT_S`` late: a call
    sends a heartbeat once that long has passed since the last, a call with nothing to publish
    or view always."""
    import redis

    from lbkit.replicas.redis_store import HEARTBEAT_S

    store = closing(RedisStore(redis_server.url, namespace="beat", budget_s=2.0))
    clock = [100.0]
    store._clock = lambda: clock[0]

    def seen():
        store.flush()
        with redis.Redis.from_url(redis_server.url) as client:
            return client.hget("lbkit:{beat}:decode:seen", "a")

    _sync(store, "a", 1, {0: 1}, whole=True)  # the first call beats
    first = seen()
    assert first is not None
    time.sleep(0.005)  # the server's clock moves on by some milliseconds
    clock[0] += HEARTBEAT_S / 2
    _sync(store, "a", 2, {0: 2})
    _sync(store, "a", -1, {})
    assert seen() == first
    clock[0] += HEARTBEAT_S  # HEARTBEAT_S and more since the first call
    _sync(store, "a", -1, {})
    second = seen()
    assert int(second) > int(first)
    time.sleep(0.005)
    store.sync("decode", "a", -1, np.zeros(0, np.int64), np.zeros(0, np.int64), 0)  # heartbeat
    assert int(seen()) > int(second)
    assert store.totals("decode", 4).tolist() == [2, 0, 0, 0]
    store.clear()
