"""The decode-only bench of ``lbkit bench``: every decode policy at a realistic batch per rank.

Part of :mod:`lbkit.sim.bench` (import :func:`run_decode_bench` and its constants from there).
The trace is time-scaled by :func:`~lbkit.sim.bench.scale_to_decode_batch` and every request
enters decode at its arrival.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from lbkit.core.cost import PRESETS
from lbkit.core.validation import check_choice, check_int, check_real
from lbkit.sim._bench_common import policy_names
from lbkit.sim._decode_calibration import scale_to_decode_batch, steady_window
from lbkit.sim.engine import DECODE_KV_CAPACITY_TOKENS, warmup
from lbkit.sim.metrics import decode_metrics
from lbkit.sim.policies_decode import DECODE_POLICIES
from lbkit.sim.prefix_cache import DSV3_KV_BYTES_PER_TOKEN
from lbkit.sim.replicas import REPLICAS_ROW, DecodeReplicas, ReplicaSync
from lbkit.sim.traces import Trace

__all__ = [
    "CAPACITY_BOUND",
    "MIGRATION_BYTES_PER_S",
    "MIGRATION_S_PER_KV_TOKEN",
    "OCCUPANCY_RANGE",
    "run_decode_bench",
]

#: Effective bandwidth of a migrated request's KV transfer in the decode-only bench: one 400 Gb/s
#: RDMA NIC per GPU (50 GB/s at line rate) at 80%.
MIGRATION_BYTES_PER_S = 40e9
#: Seconds per KV token of that transfer for DeepSeek-V3 (70,272 bytes per token: 61 layers x
#: 576 values x 2 bytes, MLA in BF16): 1.76 us.
MIGRATION_S_PER_KV_TOKEN = DSV3_KV_BYTES_PER_TOKEN / MIGRATION_BYTES_PER_S

#: Running requests per rank where a decode comparison is meaningful (SPEC section 8).
OCCUPANCY_RANGE = (32.0, 128.0)
#: A calibrated batch below this share of the target counts as capacity-bound.
CAPACITY_BOUND = 0.99


def run_decode_bench(
    trace: Trace,
    /,
    *,
    batch_per_rank: float = 32.0,
    seed: int = 0,
    decode_engines: int = 1,
    decode_ranks: int = 64,
    decode_policies: Sequence[str] | None = None,
    cost: str = "h800_dsv3",
    migrate_every_s: float | None = None,
    max_migrations: int = 1,
    migration_latency_s: float = 0.0,
    migration_s_per_kv_token: float = MIGRATION_S_PER_KV_TOKEN,
    max_kv_tokens: int | None = DECODE_KV_CAPACITY_TOKENS,
    kv_watermark_tokens: int | None = None,
    replicas: Any = None,
) -> dict[str, Any]:
    """Decode-only replay of ``trace`` loaded to ``batch_per_rank``, through every decode policy.

    Each request enters decode at its (time-scaled, see :func:`scale_to_decode_batch`) arrival,
    so the decode pool runs at a realistic batch whatever the prefill pool would deliver.
    A decode comparison says something only where ranks run a realistic batch: each policy's
    entry has ``mean_running_per_rank`` (steady window, waiting requests excluded) and
    ``meaningful`` (``OCCUPANCY_RANGE[0] <= mean_running_per_rank <= OCCUPANCY_RANGE[1]``);
    ``report["meaningful"]`` holds when every policy's does.

    Parameters
    ----------
    max_kv_tokens : int or None, default ``DECODE_KV_CAPACITY_TOKENS``
        Per-rank KV capacity (see :data:`~lbkit.sim.engine.DECODE_KV_CAPACITY_TOKENS` for the
        arithmetic); requests beyond it wait (back-pressure). ``None``: unlimited.
    kv_watermark_tokens : int, optional
        KV tokens kept free at admission; default 1% of ``max_kv_tokens``.
    migrate_every_s : float, optional
        Also run a variant of lbkit's balancer (``"lbkit_migrate"``:
        :class:`~lbkit.sim.policies_decode.LbkitDecode` calling ``rebalance(max_migrations)`` at
        most every ``migrate_every_s`` seconds; moves may cross engines). The ``"lbkit"`` row
        migrates too: its balancer's defaults, ``rebalance()`` before every routing decision.
    max_migrations : int, default 1
        Balance moves per rebalance of ``"lbkit_migrate"``.
    migration_latency_s : float, default 0
    migration_s_per_kv_token : float, default ``MIGRATION_S_PER_KV_TOKEN``
        KV transfer time of a move, for every policy that migrates (see
        :func:`~lbkit.sim.engine.simulate_decode`; the default is 40 GB/s for DeepSeek-V3).
    replicas : ReplicaSync, optional
        Also run the row ``"lbkit_replicas"`` (:data:`lbkit.sim.replicas.REPLICAS_ROW`): the
        ``lbkit`` policy as ``replicas.k`` router replicas under its sync mode
        (:class:`~lbkit.sim.replicas.DecodeReplicas`). With a KV capacity and views that are
        not exact (``not replicas.exact``) its replicas admit only (no migration, which is
        modelled there only with exact views); ``options["replicas"]`` says so.

    Returns
    -------
    dict
        ``{"workload": {...}, "decode": {POLICY: decode metrics}, "timing": {...}}``.

    Examples
    --------
    >>> from lbkit.sim.workload import default_workload
    >>> rep = run_decode_bench(default_workload(num_requests=300), batch_per_rank=4.0,
    ...                        decode_ranks=8, decode_policies=["round_robin", "lbkit"])
    >>> list(rep["decode"]), rep["decode"]["lbkit"]["finished"] > 0
    (['round_robin', 'lbkit'], True)
    """
    from lbkit.sim.engine import simulate_decode

    seed = check_int(seed, "seed", min_value=0)
    de = check_int(decode_engines, "decode_engines", min_value=1)
    dr = check_int(decode_ranks, "decode_ranks", min_value=1)
    dnames = policy_names(decode_policies, DECODE_POLICIES, "decode")
    check_choice(cost, "cost", tuple(PRESETS))
    dcost = PRESETS[cost].decode
    policies: dict[str, Any] = dict.fromkeys(dnames)
    migration = None
    if migrate_every_s is not None:
        from lbkit.sim.policies_decode import LbkitDecode

        # validates migrate_every_s and max_migrations
        LbkitDecode(de, dr, migrate_every_s=migrate_every_s, max_migrations=max_migrations)
        policies["lbkit_migrate"] = lambda: LbkitDecode(
            de, dr, rng=seed, migrate_every_s=migrate_every_s, max_migrations=max_migrations
        )
    if replicas is not None:
        if not isinstance(replicas, ReplicaSync):
            raise TypeError(f"replicas: must be a ReplicaSync, got {type(replicas).__name__}")
        moves = max_kv_tokens is None or replicas.exact
        every = 0.0 if moves else None
        policies[REPLICAS_ROW] = lambda: DecodeReplicas(de, dr, sync=replicas, rng=seed,
                                                        migrate_every_s=every)  # fmt: skip
        sync_info = {**dataclasses.asdict(replicas), "migration": moves}
    transfer = {
        "migration_latency_s": check_real(
            migration_latency_s, "migration_latency_s", min_value=0.0
        ),
        "migration_s_per_kv_token": check_real(
            migration_s_per_kv_token, "migration_s_per_kv_token", min_value=0.0
        ),
    }
    if migrate_every_s is not None:
        migration = {
            "every_s": float(migrate_every_s),
            "max_migrations": int(max_migrations),
            "latency_s": transfer["migration_latency_s"],
            "s_per_kv_token": transfer["migration_s_per_kv_token"],
        }
    if max_kv_tokens is not None:
        max_kv_tokens = check_int(max_kv_tokens, "max_kv_tokens", min_value=1)
    if kv_watermark_tokens is None:
        kv_watermark_tokens = 0 if max_kv_tokens is None else max_kv_tokens // 100
    capacity = {"max_kv_tokens": max_kv_tokens, "kv_watermark_tokens": kv_watermark_tokens}
    warmup()
    start = time.perf_counter()
    scaled, factor, measured = scale_to_decode_batch(
        trace, batch_per_rank, num_engines=de, ranks_per_engine=dr, cost=dcost, **capacity
    )
    report: dict[str, Any] = {
        "workload": {
            "source": trace.source,
            "requests": len(trace),
            "time_scale": factor,
            "duration_s": float(scaled.arrival_s[-1]),
            "batch_per_rank_target": float(batch_per_rank),
            "batch_per_rank_calibrated": measured,
            # the KV capacity keeps the running batch below the target
            "capacity_bound": bool(measured < CAPACITY_BOUND * batch_per_rank),
        },
        "options": {"decode_engines": de, "decode_ranks": dr, "cost": cost, "seed": seed,
                    "migration": migration, "transfer": transfer,
                    "kv_capacity_tokens": max_kv_tokens,
                    "kv_watermark_tokens": kv_watermark_tokens},
        "decode": {},
    }  # fmt: skip
    if replicas is not None:
        report["options"]["replicas"] = sync_info
    timing: dict[str, Any] = {"calibration_s": time.perf_counter() - start, "decode": {}}
    for name, make in policies.items():
        start = time.perf_counter()
        run = simulate_decode(
            scaled, name if make is None else make(), num_engines=de, ranks_per_engine=dr,
            cost=dcost, rng=seed, window_s=steady_window(scaled), **transfer, **capacity,
        )  # fmt: skip
        timing["decode"][name] = time.perf_counter() - start
        m = decode_metrics(run, total_tokens=scaled.total_tokens)
        lo, hi = OCCUPANCY_RANGE
        m["meaningful"] = bool(lo <= m["mean_running_per_rank"] <= hi)
        report["decode"][name] = m
    report["meaningful"] = all(m["meaningful"] for m in report["decode"].values())
    timing["requests_per_s"] = {
        f"decode/{k}": len(trace) / v if v > 0 else None for k, v in timing["decode"].items()
    }
    report["timing"] = timing
    return report
