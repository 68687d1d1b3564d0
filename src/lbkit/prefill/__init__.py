"""Prefill balancer: length buckets, engine apportionment, rank choice and chunk planning.

Pure decision functions (numpy in, indices or NamedTuples out):

- :func:`bucket_of`: length bucket of each request (``buckets.py``);
- :func:`allocate_engines`: engines per bucket, Adams' method by default (``apportion.py``);
- :func:`rebalance`: one hysteresis step of engine moves (``hysteresis.py``);
- :func:`pick_rank`: least quota load, lowest index on ties (``ranks.py``);
- :func:`lockstep_rank`: the earliest estimated finish, engines stepping together
  (``lockstep.py``; the balancer's default rule);
- :func:`plan_chunks`: one step of a rank's FIFO queue under a time budget (``chunking.py``).

:class:`PrefillBalancer` (``balancer.py``) embeds them in a router, configured by three frozen
option objects (``options.py``): :class:`RankChoice` (the rank-choice rule), :class:`Buckets`
(length buckets and engine bounds) and :class:`Rounds` (re-planning of engines). Its parts:
``control.py`` (its pool-level methods: rounds, engines out of service and back, engine
reports), ``pool.py`` (the engines' buckets and service states, the routing layout),
``ledger.py`` (requests and per-rank sums), ``choice.py`` (the rank-choice rules),
``rounds.py`` (a round's re-plan), ``results.py`` (what its methods return),
``persistence.py`` (saved states) and ``legacy.py`` (the old keyword options).
:class:`PrefixIndex` (``prefix_index.py``) gives it the cached prefix tokens of a request on
every rank, fed by the engines' KV-cache events or by the router's own admissions.
``foreign.py`` holds the load other router replicas queued on the ranks
(:meth:`PrefillBalancer.set_foreign_load`) and its form in a shared store.
"""

from lbkit.prefill.apportion import (
    DEFAULT_METHOD,
    METHODS,
    Allocation,
    allocate_engines,
    bottleneck,
    serving_buckets,
)
from lbkit.prefill.balancer import PrefillBalancer
from lbkit.prefill.buckets import DEFAULT_EDGES, bucket_of
from lbkit.prefill.chunking import ChunkPlan, plan_chunks
from lbkit.prefill.foreign import ForeignLoad
from lbkit.prefill.hysteresis import Move, Rebalance, rebalance
from lbkit.prefill.lockstep import lockstep_rank
from lbkit.prefill.options import RANK_RULES, Buckets, RankChoice, Rounds
from lbkit.prefill.prefix_index import (
    BYTES_PER_CACHED_BLOCK,
    DEFAULT_BLOCK_TOKENS,
    PrefixIndex,
    PrefixIndexStatistics,
)
from lbkit.prefill.ranks import pick_rank
from lbkit.prefill.results import (
    REASONS,
    EnginePlan,
    PrefillStatistics,
    ReportResult,
    RoundResult,
    RouteDecision,
)

__all__ = [
    "BYTES_PER_CACHED_BLOCK",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_EDGES",
    "DEFAULT_METHOD",
    "METHODS",
    "RANK_RULES",
    "REASONS",
    "Allocation",
    "Buckets",
    "ChunkPlan",
    "EnginePlan",
    "ForeignLoad",
    "Move",
    "PrefillBalancer",
    "PrefillStatistics",
    "PrefixIndex",
    "PrefixIndexStatistics",
    "RankChoice",
    "Rebalance",
    "ReportResult",
    "RoundResult",
    "Rounds",
    "RouteDecision",
    "allocate_engines",
    "bottleneck",
    "bucket_of",
    "lockstep_rank",
    "pick_rank",
    "plan_chunks",
    "rebalance",
    "serving_buckets",
]
