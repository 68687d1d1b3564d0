"""Trace replay: request traces, prefix caching and synthetic workloads.

- :mod:`lbkit.sim.traces`: the :class:`~lbkit.sim.traces.Trace` container and readers for
  Mooncake JSONL and Azure CSV traces.
- :mod:`lbkit.sim.prefix_cache`: ``cached_tokens`` from Mooncake-style prefix-block ids under an
  LRU cache of a given capacity.
- :mod:`lbkit.sim.workload`: seeded synthetic traces calibrated on the Mooncake conversation
  trace, and the default workload of ``lbkit bench``.
"""

from lbkit.sim.prefix_cache import apply_prefix_cache, prefix_hit_blocks
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
    "FORMATS",
    "Trace",
    "TraceSummary",
    "apply_prefix_cache",
    "default_workload",
    "load_azure",
    "load_mooncake",
    "load_trace",
    "prefix_hit_blocks",
    "synthetic_trace",
]
