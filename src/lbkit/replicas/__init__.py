"""Router replicas sharing one fleet's load through a store.

Users outgrow one router process: several replicas behind an L4 balancer serve one fleet, and
each must count the load the others placed. :class:`RedisStore` keeps, per pool, the totals of
every rank and each replica's own contribution on a Redis or Valkey server (commands common to
Redis >= 6.2 and Valkey; client ``redis-py``, the ``lbkit[redis]`` extra). A balancer takes it
as ``store=`` with a ``replica_id=``, and its code stays the same::

    from lbkit.decode import DecodeBalancer
    from lbkit.replicas import RedisStore

    store = RedisStore("redis://127.0.0.1:6379/0", namespace="decode-engine-0")
    bal = DecodeBalancer(64, store=store, replica_id="router-3")
    bal.admit("req-1", 20_001)  # views the store, decides, publishes

The decision stays in lbkit's kernels, over the totals read from the store (one call before a
decision, one after each change of the ledger); the protocol between balancer and store, and
what a replica does when the store does not answer, are :mod:`lbkit.core.replica`'s.
"""

from lbkit.replicas.redis_store import RedisStore

__all__ = ["RedisStore"]
