"""The selection rules of the routers users run today, as simulator prefill policies.

Each policy is written from its project's public source (the file and version are cited in its
docstring), in our own words and code. They follow the protocol of :mod:`lbkit.sim.policies`:
``route(request, total_tokens, cached_tokens, /, *, now_s, view)`` and ``observe(requests,
kinds, tokens, /, *, now_s)``, built by ``factory(num_engines, ranks_per_engine, *, cost,
rng)`` (:data:`PEER_POLICIES`). One simulator rank plays one data-parallel rank (vLLM, SGLang) or
one worker / pod (SGLang's gateway, Dynamo, llm-d).

========================= ============================================ =========================
policy                    source (file, version)                       rule
========================= ============================================ =========================
``vllm``                  vllm-project/vllm ``vllm/v1/engine/          lowest ``4*waiting +
                          core_client.py`` at ``364631ab``              running``
``vllm_kv``               same file at ``00080ee1``                     lowest ``max(inflight,
                                                                       waiting+running) +
                                                                       6*waiting*max(0, kv-0.5)``
``sglang_total_tokens``   sgl-project/sglang ``python/sglang/srt/      lowest (tokens, requests)
                          managers/data_parallel_controller.py``
                          (``DPBudget``, after PR #22614)
``sglang_shortest_queue`` same file and version                         lowest running + waiting
``sglang_cache_aware``    sgl-project/sglang ``sgl-model-gateway/src/  least in-flight if
                          policies/cache_aware.rs`` at ``b93974f1``     imbalanced, else longest
                                                                       routed prefix if > 30%
``dynamo``                ai-dynamo/dynamo ``lib/kv-router/src/         lowest ``prefill_blocks +
                          scheduling/selector.rs`` at ``01690d42``      decode_blocks``
``llm_d``                 llm-d/llm-d-inference-scheduler ``pkg/epp/    highest ``2*queue +
                          config/loader/defaults.go`` at ``520af478``   2*(1-kv) + 3*prefix``
========================= ============================================ =========================

What each sees and how often (a *stale* field is read from the policy's own snapshot of the
view, taken when ``now_s - last_refresh >= refresh_s``; between refreshes the policy adds its
own decisions as its source does):

========================= ======================================================== ===========
policy                    view fields                                              refresh
========================= ======================================================== ===========
``vllm``                  ``num_waiting``, ``num_requests`` (stale) + own routings  0.1 s
``vllm_kv``               the same and ``kv_tokens / kv_capacity_tokens`` (stale);  0.1 s
                          own in-flight count (exact)
``sglang_total_tokens``   ``num_requests``, ``kv_tokens + tokens`` (stale) + own    0.02 s
``sglang_shortest_queue`` ``num_requests`` (stale) + own routings                   0.02 s
``sglang_cache_aware``    own in-flight count; own index of routed ``block_hashes`` exact
``dynamo``                ``hit_tokens`` (KV events); own active prefill tokens     exact
                          and blocks
``llm_d``                 ``num_waiting``, ``kv_tokens / kv_capacity_tokens``       0.05 s
                          (stale); own LRU index of routed ``block_hashes``
========================= ======================================================== ===========

Common modelling choices: a request's life on a prefill rank ends with its prefill
(``EV_FINISH``), which is when the routers' in-flight counts drop it; progress events are not
seen by any of them; an engine-internal move (``EV_MOVE``) is not seen either (the count stays
with the rank the router chose). Router-side prefix indexes work on the trace's 512-token
``block_hashes`` (``view.block_tokens``) whatever the block or character granularity of the
source; a trace without block hashes gives every prefix term zero.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from lbkit.sim.peers_common import (
    PeerPolicy,
    PrefixIndex,
    StaleStats,
    view_block_hashes,
    view_block_tokens,
    view_field,
    view_kv_usage,
)

__all__ = [
    "PEER_POLICIES",
    "Dynamo",
    "LlmD",
    "SglangCacheAware",
    "SglangDP",
    "Vllm",
    "VllmKv",
]

#: vLLM's DP coordinator publishes request counts at most every 100 ms.
VLLM_REFRESH_S = 0.1
#: vLLM's weight of a waiting request against a running one (older rule).
VLLM_WAITING_WEIGHT = 4
#: vLLM's KV-pressure penalty: per waiting request, ``6 * (kv_usage - 0.5)`` above half usage.
VLLM_KV_PENALTY = 6.0
VLLM_KV_KNEE = 0.5
#: SGLang's DP controller reads the schedulers' load snapshots at most every 20 ms.
SGLANG_REFRESH_S = 0.02
#: SGLang gateway defaults (``cache_threshold``, ``balance_abs_threshold``,
#: ``balance_rel_threshold``, ``eviction_interval_secs``, ``max_tree_size`` in characters).
SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5
SGLANG_EVICTION_S = 120.0
SGLANG_MAX_TREE_CHARS = 2**26
#: Characters per token assumed to express the gateway's character budget in tokens (the value
#: llm-d's approximate prefix index uses for the same conversion).
CHARS_PER_TOKEN = 4
#: Dynamo's default ``overlap_score_weight`` (prefill blocks against decode blocks).
DYNAMO_OVERLAP_WEIGHT = 1.0
#: llm-d's default profile: queue, KV-utilisation and prefix-cache scorer weights.
LLMD_WEIGHTS = (2.0, 2.0, 3.0)
#: llm-d's default metrics refresh interval (the data layer's ``defaultRefreshInterval``).
LLMD_REFRESH_S = 0.05
#: llm-d's prefix index: at most 256 blocks matched, 31,250 entries per pod without metrics.
LLMD_MAX_PREFIX_BLOCKS = 256
LLMD_DEFAULT_CAPACITY_BLOCKS = 31250


class Vllm(PeerPolicy):
    """vLLM's internal data-parallel balancer: the rank with the lowest ``4*waiting + running``.

    Source: vllm-project/vllm, ``vllm/v1/engine/core_client.py``,
    ``DPLBAsyncMPClient.get_core_engine_for_request`` at commit ``364631ab07d2`` (the rule of
    the 0.1x releases). The API server keeps per-rank (waiting, running) counts that the DP
    coordinator overwrites with the engines' own counts, published at most every 100 ms; between
    two publications the client adds one waiting request to the rank it picks. Ranks are scanned
    from the client's start index (0 with one API server) and a strictly lower score wins, so
    ties go to the lowest index.

    Sees: ``view.num_waiting`` and ``view.num_requests - view.num_waiting`` (running), copied
    every :data:`VLLM_REFRESH_S` seconds, plus its own routings since the copy. Matches SPEC §8.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> v = SimpleNamespace(num_waiting=np.array([1, 0, 0]), num_requests=np.array([1, 3, 2]))
    >>> p = Vllm(1, 3)
    >>> [p.route(i, 100, 0, now_s=0.0, view=v) for i in range(3)]  # 4, 3, 2; a pick adds 4
    [2, 1, 0]
    """

    name = "vllm"
    refresh_s = VLLM_REFRESH_S

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                 rng: Any = None) -> None:  # fmt: skip
        super().__init__(num_engines, ranks_per_engine, cost=cost, rng=rng)
        self._stats = StaleStats(self.refresh_s)

    def _refresh(self, now_s: float, view: Any) -> dict[str, np.ndarray]:
        s = self._stats
        if s.due(now_s):
            waiting = view_field(view, "num_waiting", self._n)
            s.take(now_s, waiting=waiting, running=np.asarray(view.num_requests) - waiting,
                   kv=view_kv_usage(view, self._n))  # fmt: skip
        return s.arrays

    def _choose(self, request: int, total_tokens: int, cached_tokens: int, now_s: float,
                view: Any) -> int:  # fmt: skip
        a = self._refresh(now_s, view)
        f = int(np.argmin(VLLM_WAITING_WEIGHT * a["waiting"] + a["running"]))
        a["waiting"][f] += 1
        return f


class VllmKv(Vllm):
    """vLLM's newer DP balancer, with the client's exact in-flight count and KV pressure.

    Source: vllm-project/vllm, ``vllm/v1/engine/core_client.py``,
    ``DPLBAsyncMPClient.get_core_engine_for_request`` at commit ``00080ee13c7a`` (PR #49204).
    Score per rank: ``max(inflight, waiting + running)``, plus, when the rank has waiting
    requests, ``6 * waiting * max(0, kv_usage - 0.5)``; lowest wins. ``inflight`` is the
    client's own count of unfinished requests it sent to the rank (exact); waiting, running and
    KV usage come from the coordinator's snapshot (every 100 ms), and the client still adds one
    waiting request to its pick between snapshots. The scan start rotates by one after every
    decision, so ties go to the first rank at or after the rotating start. Matches SPEC §8
    (the penalty applies only when ``waiting > 0``, which the formula implies).

    Sees: ``view.num_waiting``, ``view.num_requests``, ``view.kv_tokens /
    view.kv_capacity_tokens`` (stale, :data:`VLLM_REFRESH_S`), its own in-flight counts.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> v = SimpleNamespace(num_waiting=np.array([2, 2]), num_requests=np.array([3, 3]),
    ...                     kv_tokens=np.array([900, 500]), kv_capacity_tokens=1000)
    >>> VllmKv(1, 2).route(0, 10, 0, now_s=0.0, view=v)  # 3 + 2*6*0.4 = 7.8 against 3
    1
    """

    name = "vllm_kv"

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                 rng: Any = None) -> None:  # fmt: skip
        super().__init__(num_engines, ranks_per_engine, cost=cost, rng=rng)
        self._inflight = np.zeros(self._n, dtype=np.int64)
        self._start = 0

    def _choose(self, request: int, total_tokens: int, cached_tokens: int, now_s: float,
                view: Any) -> int:  # fmt: skip
        a = self._refresh(now_s, view)
        w = a["waiting"]
        score = np.maximum(self._inflight, w + a["running"])
        score = score + VLLM_KV_PENALTY * w * np.maximum(0.0, a["kv"] - VLLM_KV_KNEE)
        order = np.roll(np.arange(self._n), -self._start)
        f = int(order[np.argmin(score[order])])
        w[f] += 1
        self._start = (self._start + 1) % self._n
        return f

    def _routed(self, request: int, rank: int, total_tokens: int, view: Any) -> None:
        self._inflight[rank] += 1

    def _finished(self, request: int, rank: int) -> None:
        self._inflight[rank] -= 1


class SglangDP(PeerPolicy):
    """SGLang's data-parallel controller, ``total_tokens`` or ``shortest_queue`` method.

    Source: sgl-project/sglang, ``python/sglang/srt/managers/data_parallel_controller.py``,
    ``DPBudget`` as changed by PR #22614 (merged 2026-04-12; the stored copy at commit
    ``000a3db1c0c4`` predates it and shows the older water-filling ``shortest_queue`` budget).
    The controller keeps per-rank request and token totals, overwritten from the schedulers'
    load snapshots at most every 20 ms (``refresh_load_budget``); ``total_tokens`` picks the
    lowest (tokens, requests) pair, ``shortest_queue`` (the method now named
    ``total_requests``) the fewest requests, the first such rank on ties (Python ``min`` /
    ``index``). After a pick it adds one request, and for ``total_tokens`` the request's
    tokens, to the chosen rank until the next snapshot.

    Sees: ``view.num_requests`` (running + waiting) and ``view.kv_tokens + view.tokens`` (the
    scheduler's ``num_total_tokens``: tokens in use plus those still to prefill), stale, every
    :data:`SGLANG_REFRESH_S` seconds. The added tokens are the whole prompt (``total_tokens``);
    which length SGLang adds could not be checked beyond the PR's description.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> v = SimpleNamespace(num_requests=np.array([1, 3]), tokens=np.array([500, 100]),
    ...                     kv_tokens=np.array([0, 0]))
    >>> SglangDP(1, 2, method="total_tokens").route(0, 10, 0, now_s=0.0, view=v)
    1
    >>> SglangDP(1, 2, method="shortest_queue").route(0, 10, 0, now_s=0.0, view=v)
    0
    """

    refresh_s = SGLANG_REFRESH_S

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                 rng: Any = None, method: str = "total_tokens") -> None:  # fmt: skip
        super().__init__(num_engines, ranks_per_engine, cost=cost, rng=rng)
        if method not in ("total_tokens", "shortest_queue"):
            raise ValueError(f"method: must be 'total_tokens' or 'shortest_queue', got {method!r}")
        self.method = method
        self.name = "sglang_" + method
        self._stats = StaleStats(self.refresh_s)

    def _choose(self, request: int, total_tokens: int, cached_tokens: int, now_s: float,
                view: Any) -> int:  # fmt: skip
        s = self._stats
        if s.due(now_s):
            tok = view_field(view, "kv_tokens", self._n) + np.asarray(view.tokens)
            s.take(now_s, requests=view.num_requests, tokens=tok)
        req, tok = s.arrays["requests"], s.arrays["tokens"]
        if self.method == "total_tokens":
            f = int(np.lexsort((req, tok))[0])
            tok[f] += total_tokens
        else:
            f = int(np.argmin(req))
        req[f] += 1
        return f


class SglangCacheAware(PeerPolicy):
    """SGLang's router / model gateway ``cache_aware`` policy.

    Source: sgl-project/sglang, ``sgl-model-gateway/src/policies/cache_aware.rs`` at commit
    ``b93974f140de`` (the same rule as the earlier ``sgl-router/src/policies/cache_aware.rs``).
    The gateway counts its own in-flight requests per worker. If the pool is imbalanced, i.e.
    ``max - min > 64`` *and* ``max > 1.5 * min`` in-flight requests, it takes the least loaded
    worker. Otherwise it looks the prompt up in an approximate radix tree of the prompts it
    routed to each worker: if the longest match covers more than 30% of the prompt, the worker
    holding it wins, else the least loaded one. Either way the prompt is then inserted in the
    chosen worker's tree. Every 120 s a background task evicts each worker's least recently
    used leaves down to ``max_tree_size`` (2**26 characters). Least loaded ties go to the first
    worker (Rust ``min_by_key``). The defaults (0.3, 64, 1.5, 120 s, 2**26) are the router's
    launch arguments (``RouterArgs`` of the ``sglang_router`` Python package).

    Modelled with 512-token blocks (``view.block_hashes``) instead of characters: the match
    rate is ``min(matched_blocks * block_tokens, total_tokens) / total_tokens``, and the tree
    budget is 2**26 characters at 4 characters per token, ``2**24 / 512 = 32768`` blocks per
    rank. Ties between workers holding the same longest match (the gateway takes whichever the
    tree lists first, an arbitrary order) are broken uniformly with ``rng``. The in-flight
    count drops at the request's prefill completion (the gateway's prefill router releases its
    load when the prefill response returns). The SPEC §8 wording matches; it does not mention
    that the tree keeps learning in the imbalanced branch, which the source does.

    Sees: its own in-flight counts and index (exact, no refresh), ``view.block_hashes``.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> p = SglangCacheAware(1, 2)
    >>> v = SimpleNamespace(block_hashes=np.array([7, 8, 9]), block_tokens=512)
    >>> p.route(0, 1500, 0, now_s=0.0, view=v), p.route(1, 1500, 0, now_s=0.0, view=v)
    (0, 0)
    """

    name = "sglang_cache_aware"

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                 rng: Any = None) -> None:  # fmt: skip
        super().__init__(num_engines, ranks_per_engine, cost=cost, rng=rng)
        self._load = np.zeros(self._n, dtype=np.int64)
        blocks = SGLANG_MAX_TREE_CHARS // CHARS_PER_TOKEN // 512
        self.index = PrefixIndex(self._n, blocks)
        self._next_evict_s: float | None = None

    def _choose(self, request: int, total_tokens: int, cached_tokens: int, now_s: float,
                view: Any) -> int:  # fmt: skip
        if self._next_evict_s is None:
            self._next_evict_s = now_s + SGLANG_EVICTION_S
        while now_s >= self._next_evict_s:
            for r in range(self._n):
                self.index.evict(r)
            self._next_evict_s += SGLANG_EVICTION_S
        load = self._load
        lo, hi = int(load.min()), int(load.max())
        if hi - lo > SGLANG_BALANCE_ABS and hi > SGLANG_BALANCE_REL * lo:
            return int(np.argmin(load))
        blocks = view_block_hashes(view)
        depth, best = self.index.deepest(blocks)
        matched = min(depth * view_block_tokens(view), total_tokens)
        rate = matched / total_tokens if total_tokens > 0 and blocks.size else 0.0
        if rate > SGLANG_CACHE_THRESHOLD:
            return best[int(self._rng.integers(len(best)))] if len(best) > 1 else best[0]
        return int(np.argmin(load))

    def _routed(self, request: int, rank: int, total_tokens: int, view: Any) -> None:
        self._load[rank] += 1
        blocks = view_block_hashes(view)
        if blocks.size:
            # The gateway's tree only shrinks at its periodic eviction.
            self.index.add(blocks, rank, evict=False)

    def _finished(self, request: int, rank: int) -> None:
        self._load[rank] -= 1


class Dynamo(PeerPolicy):
    """NVIDIA Dynamo's KV router: the worker with the lowest prefill plus decode block cost.

    Source: ai-dynamo/dynamo, ``lib/kv-router/src/scheduling/selector.rs``
    (``DefaultWorkerSelector::worker_logit``) at commit ``01690d42e3b9``; earlier releases had
    the same formula in ``lib/llm/src/kv_router/scheduler.rs``. Per worker, with block size
    ``B``: ``logit = w * max(0, (active_prefill_tokens + isl) / B - overlap_blocks) +
    potential_decode_blocks``, lowest wins; ``w`` is the overlap score weight (default 1.0).
    ``overlap_blocks`` are the prompt's blocks already cached on the worker, known exactly from
    the workers' KV events; ``active_prefill_tokens`` are the uncached tokens of the requests
    the router sent there whose prefill has not completed; ``potential_decode_blocks`` the
    blocks of the worker's active requests plus the new blocks this one adds. All three are the
    router's own bookkeeping, so no refresh interval applies. With temperature 0 (the default)
    the minimum is taken; ties follow hash-map order in the source, modelled as uniform with
    ``rng``.

    The newer source also has an overlap-credit decay, host/disk tier credits, a prefill load
    scale and an active-request weight; this model takes them at their neutral values (decay 0,
    no tiers, scale 1, weight 0), which the defaults were not checked to equal. SPEC §8 states
    the same rule.

    Sees: ``view.hit_tokens`` (cached prefix per rank), ``view.block_tokens`` as ``B``;
    counts its own routed requests' prefill tokens (``total_tokens - hit_tokens[rank]``) and
    blocks (``ceil(total_tokens / B)``) until their ``EV_FINISH``.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> v = SimpleNamespace(hit_tokens=np.array([0, 1024]), block_tokens=512)
    >>> Dynamo(1, 2, rng=0).route(0, 2048, 0, now_s=0.0, view=v)  # 4+4 against 2+2 blocks
    1
    """

    name = "dynamo"

    def __init__(
        self,
        num_engines: int,
        ranks_per_engine: int,
        *,
        cost: Any = None,
        rng: Any = None,
        overlap_weight: float = DYNAMO_OVERLAP_WEIGHT,
    ) -> None:
        super().__init__(num_engines, ranks_per_engine, cost=cost, rng=rng)
        self.overlap_weight = float(overlap_weight)
        self._prefill = np.zeros(self._n, dtype=np.int64)
        self._blocks = np.zeros(self._n, dtype=np.int64)
        self._mine: dict[int, tuple[int, int]] = {}

    def logits(self, total_tokens: int, view: Any) -> np.ndarray:
        """The cost of each rank for a prompt of ``total_tokens`` (lower is better)."""
        b = view_block_tokens(view)
        overlap = view_field(view, "hit_tokens", self._n) // b
        prefill = np.maximum(0.0, (self._prefill + total_tokens) / b - overlap)
        new_blocks = np.maximum(0, -(-total_tokens // b) - overlap)
        return self.overlap_weight * prefill + self._blocks + new_blocks

    def _choose(self, request: int, total_tokens: int, cached_tokens: int, now_s: float,
                view: Any) -> int:  # fmt: skip
        cost = self.logits(total_tokens, view)
        ties = np.flatnonzero(cost == cost.min())
        return int(ties[self._rng.integers(ties.size)]) if ties.size > 1 else int(ties[0])

    def _routed(self, request: int, rank: int, total_tokens: int, view: Any) -> None:
        b = view_block_tokens(view)
        hit = int(view_field(view, "hit_tokens", self._n)[rank])
        entry = (max(0, total_tokens - hit), -(-total_tokens // b))
        self._mine[request] = entry
        self._prefill[rank] += entry[0]
        self._blocks[rank] += entry[1]

    def _finished(self, request: int, rank: int) -> None:
        tokens, blocks = self._mine.pop(request)
        self._prefill[rank] -= tokens
        self._blocks[rank] -= blocks


class LlmD(PeerPolicy):
    """llm-d's inference scheduler, default profile: queue, KV-utilisation and prefix scorers.

    Source: llm-d/llm-d-inference-scheduler (the ``llm-d-router`` module) at commit
    ``520af47896e5``: ``pkg/epp/config/loader/defaults.go`` (weights 2, 2, 3),
    ``pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go``,
    ``.../scorer/kvcacheutilization/kvcache_utilization.go``, ``.../scorer/prefix/plugin.go``,
    ``pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/`` and
    ``.../picker/maxscore/picker.go``. Score per pod, highest wins:
    ``2 * queue + 2 * (1 - kv_usage) + 3 * prefix`` where ``queue = (max_q - q) / (max_q -
    min_q)`` over the candidates' waiting-queue sizes (1 for all when they are equal), and
    ``prefix = matched_blocks / total_blocks``. The default is the *approximate* prefix index:
    the scheduler hashes the prompt into chained blocks (at most 256), counts for each pod the
    leading blocks its own LRU index holds (stopping at the first block no pod holds), and
    after picking adds the prompt's blocks to the chosen pod's index; the index holds as many
    entries per pod as the pod's KV cache has blocks (``autoTune``; 31,250 without metrics).
    Queue sizes and KV usage come from scraped metrics, refreshed every 50 ms, with no
    correction for the scheduler's own decisions. Ties: the picker shuffles the candidates
    before a stable sort, i.e. uniformly at random (``rng``). Matches SPEC §8, which leaves
    the queue normalisation implicit.

    Modelled with 512-token blocks (``view.block_hashes``, capacity
    ``kv_capacity_tokens // block_tokens`` blocks per rank); the source uses the engine's KV
    block size (e.g. 16 tokens) and about 4 characters per token.

    Sees: ``view.num_waiting`` and ``view.kv_tokens / view.kv_capacity_tokens`` (stale,
    :data:`LLMD_REFRESH_S`), ``view.block_hashes`` into its own index.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> v = SimpleNamespace(num_waiting=np.array([0, 4]), kv_tokens=np.array([800, 0]),
    ...                     kv_capacity_tokens=1000, block_hashes=np.zeros(0, np.int64))
    >>> LlmD(1, 2, rng=0).route(0, 10, 0, now_s=0.0, view=v)  # 2*1 + 2*0.2 against 0 + 2*1
    0
    """

    name = "llm_d"
    refresh_s = LLMD_REFRESH_S

    def __init__(self, num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                 rng: Any = None) -> None:  # fmt: skip
        super().__init__(num_engines, ranks_per_engine, cost=cost, rng=rng)
        self._stats = StaleStats(self.refresh_s)
        self.index: PrefixIndex | None = None

    def scores(self, now_s: float, view: Any) -> np.ndarray:
        """Each rank's weighted score for the request being routed (higher is better)."""
        n = self._n
        s = self._stats
        if s.due(now_s):
            s.take(now_s, queue=view_field(view, "num_waiting", n), kv=view_kv_usage(view, n))
        q, kv = s.arrays["queue"], s.arrays["kv"]
        lo, hi = q.min(), q.max()
        queue = np.ones(n) if hi == lo else (hi - q) / (hi - lo)
        blocks = view_block_hashes(view)[:LLMD_MAX_PREFIX_BLOCKS]
        prefix = np.zeros(n)
        if blocks.size:
            if self.index is None:
                self.index = PrefixIndex(n, self._capacity(view))
            prefix = self.index.counts(blocks, n) / blocks.size
        wq, wk, wp = LLMD_WEIGHTS
        return wq * queue + wk * (1.0 - kv) + wp * prefix

    @staticmethod
    def _capacity(view: Any) -> int:
        cap = int(getattr(view, "kv_capacity_tokens", 0) or 0)
        blocks = cap // view_block_tokens(view)
        return blocks if blocks > 0 else LLMD_DEFAULT_CAPACITY_BLOCKS

    def _choose(self, request: int, total_tokens: int, cached_tokens: int, now_s: float,
                view: Any) -> int:  # fmt: skip
        score = self.scores(now_s, view)
        ties = np.flatnonzero(score == score.max())
        return int(ties[self._rng.integers(ties.size)]) if ties.size > 1 else int(ties[0])

    def _routed(self, request: int, rank: int, total_tokens: int, view: Any) -> None:
        blocks = view_block_hashes(view)[:LLMD_MAX_PREFIX_BLOCKS]
        if blocks.size and self.index is not None:
            self.index.add(blocks, rank)


def _sglang_total_tokens(num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                         rng: Any = None) -> SglangDP:  # fmt: skip
    return SglangDP(num_engines, ranks_per_engine, cost=cost, rng=rng, method="total_tokens")


def _sglang_shortest_queue(num_engines: int, ranks_per_engine: int, *, cost: Any = None,
                           rng: Any = None) -> SglangDP:  # fmt: skip
    return SglangDP(num_engines, ranks_per_engine, cost=cost, rng=rng, method="shortest_queue")


#: The peers' prefill policies by name: ``factory(num_engines, ranks_per_engine, *, cost, rng)``
#: returns a fresh policy object (the protocol of :mod:`lbkit.sim.policies`).
PEER_POLICIES: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {
        "vllm": Vllm,
        "vllm_kv": VllmKv,
        "sglang_total_tokens": _sglang_total_tokens,
        "sglang_shortest_queue": _sglang_shortest_queue,
        "sglang_cache_aware": SglangCacheAware,
        "dynamo": Dynamo,
        "llm_d": LlmD,
    }
)
