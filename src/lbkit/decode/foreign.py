"""Foreign load of a decode engine: what other routers placed on its ranks.

Several router replicas in front of one engine each keep a ledger of the requests *they*
admitted. The engine runs all of them, so each replica's decisions must count the others' load
too. :meth:`lbkit.decode.DecodeBalancer.set_foreign_load` takes that load per rank, from
whatever transport the replicas share (a store such as :class:`lbkit.replicas.RedisStore`, a
broadcast, engine reports minus the own ledger): requests and KV tokens per rank that count in
every score and capacity check (admission, migration, room-making) but belong to no request of
the ledger. The own ledger alone grows with :meth:`~lbkit.decode.DecodeBalancer.step` and is
released by ``finish``; the foreign load changes only when it is set again.

Under look-ahead a foreign request is projected to stay (its expected output is unknown): it
counts once in the projected requests and with ``h`` tokens of growth in the projected KV.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_int_array

__all__ = ["ForeignLoad", "foreign_iv"]


class ForeignLoad(NamedTuple):
    """Load of other routers per rank (int64 arrays of shape (num_ranks,))."""

    num_requests: np.ndarray
    kv_tokens: np.ndarray


def foreign_iv(num_requests: Any, kv_tokens: Any, n: int, max_tokens: int) -> ForeignLoad:
    """Validate a foreign load of ``n`` ranks (non-negative integers; requests and KV per rank
    at most ``max_tokens`` so that sums stay exact in float64)."""
    b = as_int_array(num_requests, "num_requests", shape=(n,), min_value=0, max_value=max_tokens)
    s = as_int_array(kv_tokens, "kv_tokens", shape=(n,), min_value=0, max_value=max_tokens)
    return ForeignLoad(b.astype(np.int64, copy=True), s.astype(np.int64, copy=True))
