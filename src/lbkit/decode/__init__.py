"""Decode balancer: place requests on the synchronously stepping ranks of a decode engine.

A decode step lasts as long as the slowest rank, and a rank's step grows with both its request
count ``B`` and its KV tokens ``S``. Pure decision functions (numpy in, NamedTuples out):

- :func:`pick_rank`: one request, by a policy of :data:`POLICIES` (default ``"min_max"``: the
  greedy step of minimising ``max_r max(B_r/Bhat, S_r/Shat)``; ``policies.py``);
- :func:`assign_batch`: a batch of arrivals, longest first, in one kernel call (``batch.py``);
- :func:`plan_migrations`: running requests to move between ranks when departures have
  unbalanced them, and :func:`plan_room`: running requests to move so that one rank has room
  for a request that fits none (``migration.py``).

:class:`DecodeBalancer` (``balancer.py``) embeds them in a router: admission with capacities,
KV growth, release, ranks out of service, engine-report reconciliation, look-ahead, migration
(``rebalance``: by default room for a refused request and one balance move), persistence, and
the load of other router replicas (``set_foreign_load``, :mod:`lbkit.decode.foreign`). Its
migration, service and report methods are in ``control.py``, its saved states in
``persistence.py``, its ledger in ``ledger.py``.
Reason codes of every decision are documented in :mod:`lbkit.decode.reasons`.
"""

from lbkit.decode.balancer import (
    DecodeBalancer,
    DecodeStatistics,
    Migration,
    RemovedRequests,
    ReportResult,
    RequestInfo,
)
from lbkit.decode.batch import ORDERS, BatchAssignment, assign_batch, batch_bound
from lbkit.decode.foreign import ForeignLoad
from lbkit.decode.migration import (
    Migrations,
    Room,
    migration_objective,
    plan_migrations,
    plan_room,
)
from lbkit.decode.policies import DEFAULT_POLICY, POLICIES, Decision, pick_rank
from lbkit.decode.reasons import REASONS, REFUSALS

__all__ = [
    "DEFAULT_POLICY",
    "ORDERS",
    "POLICIES",
    "REASONS",
    "REFUSALS",
    "BatchAssignment",
    "Decision",
    "DecodeBalancer",
    "DecodeStatistics",
    "ForeignLoad",
    "Migration",
    "Migrations",
    "RemovedRequests",
    "ReportResult",
    "RequestInfo",
    "Room",
    "assign_batch",
    "batch_bound",
    "migration_objective",
    "pick_rank",
    "plan_migrations",
    "plan_room",
]
