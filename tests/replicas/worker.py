"""One router replica for the tests: ``python worker.py URL NAMESPACE ID SEED OPS [hold]
[mirror] [reap=SECONDS]``.

Admits, finishes and steps requests of a decode balancer and routes, progresses and finishes
requests of a prefill balancer, both on the shared store, with retried finishes (a second
``finish`` of the same id is refused by the ledger and changes nothing). Prints its own
ledgers' per-rank loads as JSON once the store applied every publish, then (with ``hold``)
waits to be killed. With ``mirror`` the store mirrors the totals (no view reads the store);
``reap=SECONDS`` is the store's ``reap_after_s`` (default: none, this replica never reaps).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from lbkit.core import PRESETS
from lbkit.decode import DecodeBalancer
from lbkit.prefill import PrefillBalancer
from lbkit.replicas import RedisStore

DECODE_RANKS, ENGINES, RANKS = 8, 2, 2


def main() -> None:
    url, ns, rid, seed, ops = sys.argv[1:6]
    hold = "hold" in sys.argv[6:]
    rng = np.random.default_rng(int(seed))
    reap = [float(a[5:]) for a in sys.argv[6:] if a.startswith("reap=")]
    store = RedisStore(url, namespace=ns, budget_s=5.0, mirror="mirror" in sys.argv[6:],
                       reap_after_s=reap[0] if reap else None)  # fmt: skip
    dec = DecodeBalancer(DECODE_RANKS, store=store, replica_id=rid)
    pre = PrefillBalancer(ENGINES, RANKS, cost=PRESETS["h800_dsv3"].prefill, store=store,
                          replica_id=rid)  # fmt: skip
    live_d: list[str] = []
    live_p: list[str] = []
    for i in range(int(ops)):
        x = rng.random()
        now = float(i)
        if x < 0.4:
            if dec.admit(f"{rid}.{i}", int(rng.integers(1, 5000))).rank >= 0:
                live_d.append(f"{rid}.{i}")
            pre.route(f"{rid}.{i}", int(rng.integers(1, 30000)), now_s=now)
            live_p.append(f"{rid}.{i}")
        elif x < 0.6 and live_d:
            j = live_d.pop(int(rng.integers(len(live_d))))
            dec.finish(j)
            try:
                dec.finish(j)  # a retried finish
            except KeyError:
                pass
        elif x < 0.8 and live_p:
            j = live_p[int(rng.integers(len(live_p)))]
            left = pre.chunk_done(j, 0, now_s=now)
            left = pre.chunk_done(j, min(left, int(rng.integers(0, 2000))), now_s=now)
            if left == 0 or rng.random() < 0.3:
                pre.finish(j, now_s=now)
                live_p.remove(j)
        else:
            dec.step()
    store.flush()
    d, p = dec.statistics(), pre.statistics()
    quota = np.rint(np.asarray(pre.rank_loads()) * 1e9).astype(np.int64)
    print(json.dumps({
        "decode": [list(d.num_requests), list(d.kv_tokens)],
        "prefill_count": [len(pre.requests_on(f // RANKS, f % RANKS))
                          for f in range(ENGINES * RANKS)],
        "prefill_quota_ns": quota.tolist(),
        "fallbacks": d.store_fallbacks + p.store_fallbacks,
    }), flush=True)  # fmt: skip
    if hold:
        time.sleep(120)
    store.close()


if __name__ == "__main__":
    main()
