"""Trace replay: request traces, prefix caching and synthetic workloads.

- :mod:`lbkit.sim.traces`: the :class:`~lbkit.sim.traces.Trace` container and readers for
  Mooncake JSONL and Azure CSV traces.
- :mod:`lbkit.sim.prefix_cache`: ``cached_tokens`` from Mooncake-style prefix-block ids under an
  LRU cache of a given capacity.
- :mod:`lbkit.sim.workload`: seeded synthetic traces calibrated on the Mooncake conversation
  trace, and the default workload of ``lbkit bench``.
- :mod:`lbkit.sim.engine`: the deterministic engine model (``simulate_prefill``,
  ``simulate_decode``) over the pools of :mod:`lbkit.sim.prefill_pool` and
  :mod:`lbkit.sim.decode_pool`, replayed by :mod:`lbkit.sim.replay`;
  :mod:`lbkit.sim.utilization`: the utilisation scaling; :mod:`lbkit.sim.policies` and
  :mod:`lbkit.sim.policies_decode`: routing
  policies; :mod:`lbkit.sim.metrics`: SPEC section 5 metrics; :mod:`lbkit.sim.bench`: the
  scenario runner of ``lbkit bench``; :mod:`lbkit.sim.streams`: seeded decode-only streams
  replayed through a :class:`~lbkit.decode.DecodeBalancer` (policy comparisons in engine steps);
  :mod:`lbkit.sim.replicas`: ``K`` router replicas of lbkit's policies and how they sync
  (:class:`~lbkit.sim.replicas.ReplicaSync`).
"""

from lbkit.sim.bench import BenchResult, run_bench
from lbkit.sim.engine import (
    DecodeRun,
    PrefillRun,
    scale_to_utilization,
    simulate_decode,
    simulate_prefill,
    utilization_factor,
)
from lbkit.sim.metrics import decode_metrics, prefill_metrics
from lbkit.sim.policies import PREFILL_POLICIES
from lbkit.sim.policies_decode import DECODE_POLICIES
from lbkit.sim.prefix_cache import apply_prefix_cache, prefix_hit_blocks
from lbkit.sim.replicas import DecodeReplicas, PrefillReplicas, ReplicaSync
from lbkit.sim.traces import (
    BUCKET_EDGES_TOKENS,
    FORMATS,
    Trace,
    TraceSummary,
    load_azure,
    load_mooncake,
    load_trace,
)
from lbkit.sim.workload import default_workload, synthetic_trace

__all__ = [
    "BUCKET_EDGES_TOKENS",
    "DECODE_POLICIES",
    "FORMATS",
    "PREFILL_POLICIES",
    "BenchResult",
    "DecodeReplicas",
    "DecodeRun",
    "PrefillReplicas",
    "PrefillRun",
    "ReplicaSync",
    "Trace",
    "TraceSummary",
    "apply_prefix_cache",
    "decode_metrics",
    "default_workload",
    "load_azure",
    "load_mooncake",
    "load_trace",
    "prefill_metrics",
    "prefix_hit_blocks",
    "run_bench",
    "scale_to_utilization",
    "simulate_decode",
    "simulate_prefill",
    "synthetic_trace",
    "utilization_factor",
]
