"""The policy protocol of the simulator: events, views, and what a policy or cache hook provides.

Every piece of the simulator that a routing policy touches is defined here, so that policies
(:mod:`lbkit.sim.policies`, :mod:`lbkit.sim.peers`, :mod:`lbkit.sim.policies_decode`, or a
user's own) import this module and nothing of the engine, and the engine
(:mod:`lbkit.sim.engine`) imports policies only to resolve a policy *name*.

**Prefill policies** (:class:`PrefillPolicy`): ``route(request, total_tokens, cached_tokens, /,
*, now_s, view)`` returns the flat rank (``engine * ranks_per_engine + rank``) of a new request
or ``-1`` to refuse it; ``observe(requests, kinds, tokens, /, *, now_s)`` receives the events
since the last call as three equal-length int64 arrays (reused by the simulator: copy what you
keep), ``kinds`` one of :data:`EV_FINISH` (prefill done; the request leaves the pool),
:data:`EV_PROGRESS` (``tokens`` more tokens prefilled since the request's previous event) and
:data:`EV_MOVE` (engine-side work sharing moved the request, which had not started, to flat rank
``tokens``). A factory ``(num_engines, ranks_per_engine, *, cost, rng)`` builds one.

**Decode policies** (:class:`DecodePolicy`): ``route(request, kv_tokens, /, *, now_s, view)``
returns a flat rank or ``-1`` when no rank can take the request now (it then waits: back-pressure);
``observe(finished, /, *, now_s, view)`` receives the requests that left their ranks.

**Per-rank prefix caches** (:class:`RankCache`): the ``simulate_prefill(rank_cache=...)`` hook.

The views are read-only: a policy never writes them, and the simulator never reads a policy's
state.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

__all__ = [
    "BLOCK_TOKENS",
    "EV_FINISH",
    "EV_MOVE",
    "EV_PROGRESS",
    "PREFILL_KV_CAPACITY_TOKENS",
    "DecodePolicy",
    "DecodeView",
    "PrefillPolicy",
    "PrefillView",
    "RankCache",
]

#: Event kinds of :meth:`PrefillPolicy.observe`.
EV_FINISH, EV_PROGRESS, EV_MOVE = 0, 1, 2

#: DeepSeek-V3 KV bytes per token (MLA, bf16): 61 layers x (512 + 64) values x 2 bytes.
_KV_BYTES_PER_TOKEN = 61 * (512 + 64) * 2
#: Tokens per prefix block (Mooncake ``hash_ids``).
BLOCK_TOKENS = 512
#: Default KV capacity of a prefill rank (tokens): the KV memory left on an 80 GB H800 running
#: DeepSeek-V3 in FP8 (one byte per parameter) with expert parallelism over 32 GPUs as in
#: DeepSeek's prefill deployment: 16.6 B replicated parameters (attention, dense layers, shared
#: experts, embeddings) plus 654 B / 32 routed-expert parameters make 37 GB of weights; 8 GB for
#: activations and communication buffers leaves 35 GB, ``35e9 // 70,272 = 498,064`` tokens. (An
#: engine of only 8 such ranks could not hold the weights: 16.6 + 654 / 8 > 80 GB.)
PREFILL_KV_CAPACITY_TOKENS = int((80e9 - 37e9 - 8e9) // _KV_BYTES_PER_TOKEN)
_NO_HASHES = np.zeros(0, dtype=np.int64)
_NO_HASHES.setflags(write=False)


class PrefillView(NamedTuple):
    """What a prefill policy may read: the pool's shape and per-rank state (read-only arrays).

    The per-rank arrays are live: they change as the replay goes on (copy what must be kept).

    Attributes
    ----------
    num_engines, ranks_per_engine : int
    num_requests : ndarray of int64, shape (ranks,)
        Requests queued or running on each rank (flat index ``engine * ranks_per_engine + r``).
    tokens : ndarray of int64, shape (ranks,)
        Uncached prompt tokens still to prefill on each rank.
    num_waiting : ndarray of int64, shape (ranks,)
        Requests on each rank that are not running yet (vLLM's "waiting"): a request waits from
        its admission until the start of the engine step that computes its first chunk; from
        then on it is *running* (``num_running = num_requests - num_waiting``) until its prefill
        ends. Work sharing moves only waiting requests.
    kv_tokens : ndarray of int64, shape (ranks,)
        KV tokens held by each rank's running requests: their cached prefix (counted from the
        start of their first step) plus the tokens prefilled so far (counted at the end of each
        step); a request's KV leaves when its prefill ends (it goes to decode).
    kv_capacity_tokens : int
        KV capacity of a rank (tokens); informational, a prefill rank never refuses on it.
    hit_tokens : ndarray of int64, shape (ranks,)
        Cached prompt tokens of the request being routed on each rank (valid during ``route``):
        ``rank_cache.hit_tokens(request)`` with a local prefix-cache hook, else the trace's
        ``cached_tokens`` on every rank.
    block_hashes : ndarray of int64
        Chained prefix-block ids of the request being routed (Mooncake ``hash_ids``, one per
        ``block_tokens`` tokens; empty if the trace has none); valid during ``route``.
    block_tokens : int
        Tokens per prefix block (512).
    step_start_s, step_end_s : ndarray of float64, shape (num_engines,)
        Each engine's running step: its start and its end (``step_end_s`` is ``inf`` between
        steps, when ``step_start_s`` is the end of the last step or the arrival that woke the
        engine). What an engine tells a router when it starts a step: its planned duration,
        which in the simulator is exact (engines and routers share the cost model).

    The simulator fills every field; a view built by hand with the first four only (e.g. to
    try a policy) has ``None`` for the other arrays.
    """

    num_engines: int
    ranks_per_engine: int
    num_requests: np.ndarray
    tokens: np.ndarray
    num_waiting: np.ndarray | None = None
    kv_tokens: np.ndarray | None = None
    kv_capacity_tokens: int = PREFILL_KV_CAPACITY_TOKENS
    hit_tokens: np.ndarray | None = None
    block_hashes: np.ndarray = _NO_HASHES
    block_tokens: int = BLOCK_TOKENS
    step_start_s: np.ndarray | None = None
    step_end_s: np.ndarray | None = None

    @property
    def num_running(self) -> np.ndarray:
        """Requests running (partially prefilled or in the current step) on each rank."""
        return self.num_requests - self.num_waiting


class DecodeView(NamedTuple):
    """What a decode policy may read (read-only arrays, flat rank index).

    Attributes
    ----------
    num_engines, ranks_per_engine : int
    num_requests : ndarray of int64, shape (ranks,)
        Requests admitted to each rank (running, waiting for the next step, or migrated to it
        and waiting for their KV transfer), ``B_r``.
    kv_tokens : ndarray of int64, shape (ranks,)
        KV tokens they hold, ``S_r``.
    steps : ndarray of int64, shape (engines,)
        Decode steps each engine has completed so far (each grew every running request's KV by
        one token).
    max_batch, max_kv_tokens : int or None
        Per-rank admission limits (``None``: unlimited); a policy must not exceed them and
        returns -1 when no rank can take the request (it then waits). ``max_kv_tokens`` is the
        KV capacity less the watermark (see :func:`simulate_decode`).
    """

    num_engines: int
    ranks_per_engine: int
    num_requests: np.ndarray
    kv_tokens: np.ndarray
    steps: np.ndarray
    max_batch: int | None
    max_kv_tokens: int | None


class PrefillPolicy(Protocol):
    """A prefill routing policy (see the module docstring)."""

    def route(self, request: int, total_tokens: int, cached_tokens: int, /, *, now_s: float,
              view: PrefillView) -> int: ...  # fmt: skip

    def observe(self, requests: np.ndarray, kinds: np.ndarray, tokens: np.ndarray, /, *,
                now_s: float) -> None: ...  # fmt: skip


class DecodePolicy(Protocol):
    """A decode routing policy (see the module docstring)."""

    def route(self, request: int, kv_tokens: int, /, *, now_s: float, view: DecodeView) -> int: ...

    def observe(self, finished: np.ndarray, /, *, now_s: float, view: DecodeView) -> None: ...


class RankCache(Protocol):
    """Per-rank prefix caches of a replay (``simulate_prefill(rank_cache=...)``).

    ``hit_tokens(request)`` gives the request's cached tokens on each rank now (int64, shape
    (ranks,), at most ``total_tokens - 1``), called before it is routed; ``admitted(request,
    rank)`` says where it went (its hit blocks are touched there); ``finished(request, rank)``
    that its prefill ended on ``rank`` (its blocks enter that rank's cache).
    :class:`lbkit.sim.prefix_cache.LocalPrefixCaches` implements it for a trace.
    """

    def hit_tokens(self, request: int, /) -> np.ndarray: ...

    def admitted(self, request: int, rank: int, /) -> None: ...

    def finished(self, request: int, rank: int, /) -> None: ...
