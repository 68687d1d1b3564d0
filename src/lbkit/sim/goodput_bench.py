"""Goodput of routing policies on one trace: the runs behind ``lbkit bench``'s headline table.

For a prefill policy, :func:`prefill_goodput` searches the highest arrival rate at which at
least ``slo.attainment`` of the requests meet their SLO (:mod:`lbkit.sim.goodput`): each
evaluation replays the trace, time-scaled to the rate, through the prefill pool under the
policy. The search first judges TTFT alone (the prefill pool is what a prefill router changes),
then replays the decode pool at the rate found, fed by that run's handovers and routed by
``decode_policy``, and judges TTFT and TPOT together; if TPOT fails there, the search goes on
below that rate with both judged. Since a request that meets both parts meets the TTFT part,
the result is the goodput with both parts judged.

The SLO's slowdown denominator is a request's prefill time alone on an idle rank with the
cached prefix it could have had: with ``cache="none"`` none, with ``"global"`` its hit in the
shared cache, with ``"local"`` its longest hit on any rank when it was routed (a router that
sends it elsewhere makes it wait for the tokens it recomputes; a prefix that no rank holds any
more, or not yet, is not held against the router).

:func:`ideal_goodput` does the same for the ideal late-binding reference
(:mod:`lbkit.sim.ideal`), whose decode pool is fed by its own prefill ends.

**Caches** (``options.cache``, SPEC section 8): ``"none"`` (nothing cached), ``"global"`` (one LRU
cache shared by every rank, DeepSeek's design: a request's cached tokens are its hits in the
trace's arrival order, :func:`lbkit.sim.prefix_cache.apply_prefix_cache`), ``"local"`` (each
rank its own LRU cache of 512-token blocks, so that a request's cached tokens depend on where it
is routed). A trace without block hashes has no prefix structure: its cached tokens are as the
trace gives them in every mode but ``"none"``. The ideal reference uses the global cache's hits
in both cached modes (taken at arrival: an upper bound on what per-rank caches can hit).

**Options**: the pools, SLO, cache mode, decode policy, search tolerance, step budget and seed
of a search are one frozen :class:`GoodputOptions` (:mod:`lbkit.sim.goodput_options`, names
re-exported here); its defaults, :data:`DEFAULT_GOODPUT_OPTIONS`, are what ``lbkit bench`` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.cost import CostPreset
from lbkit.core.validation import check_choice, check_int, check_real
from lbkit.sim.bench import MIGRATION_S_PER_KV_TOKEN
from lbkit.sim.engine import (
    DECODE_KV_CAPACITY_TOKENS,
    DECODE_KV_WATERMARK_TOKENS,
    simulate_decode,
    simulate_prefill,
    utilization_factor,
)
from lbkit.sim.goodput import GoodputSearch, attainment, find_goodput, with_rate
from lbkit.sim.goodput_options import (
    CACHE_MODES,
    DEFAULT_GOODPUT_OPTIONS,
    GoodputOptions,
    Pools,
)
from lbkit.sim.ideal import alone_s, simulate_ideal_prefill
from lbkit.sim.peers import PEER_POLICIES
from lbkit.sim.policies import PREFILL_POLICIES
from lbkit.sim.prefix_cache import LocalPrefixCaches, apply_prefix_cache, capacity_blocks_for
from lbkit.sim.replicas import REPLICAS_ROW, ReplicaSync, prefill_replicas
from lbkit.sim.traces import Trace

__all__ = [
    "CACHE_MODES",
    "DEFAULT_GOODPUT_OPTIONS",
    "PEER_NAMES",
    "REPLICAS_ROW",
    "GoodputOptions",
    "PolicyGoodput",
    "Pools",
    "best_of",
    "goodput_row",
    "ideal_goodput",
    "local_caches",
    "prefill_goodput",
    "prepare_cache",
    "run_goodput",
]


class PolicyGoodput(NamedTuple):
    """Goodput of one policy and what users see at that rate.

    Attributes
    ----------
    search : GoodputSearch
        The rate found and every (rate, attainment) evaluated (TTFT judged alone while
        searching, both parts at the end; see the module docstring).
    metrics : dict
        At the goodput rate: ``attainment`` (both parts), ``ttft_p50_s``, ``ttft_p99_s``,
        ``tpot_p50_s``, ``tpot_p99_s``, ``mean_running_per_rank`` of the decode pool,
        ``cached_share`` (cached over prompt tokens: with per-rank caches, what the requests hit
        where they ran) and ``evaluations``.
    """

    search: GoodputSearch
    metrics: dict[str, Any]


def prepare_cache(trace: Trace, mode: str, /, *, capacity_blocks: int | None = None) -> Trace:
    """``trace`` with the ``cached_tokens`` that ``mode`` gives before routing.

    ``"none"``: zeros. ``"global"`` and ``"local"``: the hits of one LRU cache over the whole
    pool (``capacity_blocks``, default unbounded) in arrival order, when the trace has block
    hashes; otherwise the trace's own ``cached_tokens``.

    Examples
    --------
    >>> t = Trace(arrival_s=[0, 1], total_tokens=[1024, 1024], output_tokens=[1, 1],
    ...           hash_ids=[7, 8, 7, 8], hash_offsets=[0, 2, 4])
    >>> prepare_cache(t, "global").cached_tokens.tolist(), prepare_cache(t, "none").cached_tokens
    ([0, 1023], array([0, 0]))
    """
    check_choice(mode, "cache", CACHE_MODES)
    if mode == "none":
        return trace.with_cached_tokens(np.zeros(len(trace), dtype=np.int64))
    if trace.hash_ids is None:
        return trace
    return apply_prefix_cache(trace, capacity_blocks=capacity_blocks)


def local_caches(num_ranks: int, /, *, capacity_blocks: int | None = None) -> Callable:
    """Factory of the per-rank prefix caches of one replay (``cache="local"``).

    Every one of ``num_ranks`` prefill ranks gets its own LRU cache of ``capacity_blocks``
    512-token blocks (default :func:`lbkit.sim.prefix_cache.capacity_blocks_for`: a prefill
    rank's KV memory); call the result with the replayed trace for a fresh cache state.

    Examples
    --------
    >>> t = Trace(arrival_s=[0, 1], total_tokens=[1024, 1024], output_tokens=[1, 1],
    ...           hash_ids=[7, 8, 7, 8], hash_offsets=[0, 2, 4])
    >>> local_caches(4)(t).hit_tokens(0).tolist()
    [0, 0, 0, 0]
    """
    ranks = check_int(num_ranks, "num_ranks", min_value=1)
    capacity = capacity_blocks_for() if capacity_blocks is None else capacity_blocks
    return lambda trace: LocalPrefixCaches(trace, ranks, capacity_blocks=capacity)


def _tpot(trace: Trace, finish_s: np.ndarray, run_decode: Callable[[Any], Any]) -> tuple:
    # Decode the requests whose prefill ended at finish_s (a decode-only replay of the handovers
    # in time order), mapped back to trace order.
    tpot = np.full(len(trace), np.nan)
    done = np.flatnonzero(np.isfinite(finish_s))
    if done.size == 0:
        return tpot, None
    order = done[np.argsort(finish_s[done], kind="stable")]
    handover = Trace(
        arrival_s=finish_s[order],
        total_tokens=trace.total_tokens[order],
        output_tokens=trace.output_tokens[order],
        cached_tokens=trace.cached_tokens[order],
    )
    dec = run_decode(handover)
    tpot[order] = dec.tpot_s
    return tpot, dec


def _summary(ttft: np.ndarray, tpot: np.ndarray, met: float, dec: Any, trace: Trace) -> dict:
    def pct(x: np.ndarray, q: float) -> float | None:
        x = x[np.isfinite(x)]
        return float(np.percentile(x, q)) if x.size else None

    running = None
    if dec is not None and dec.num_steps > 0:
        # Running requests per rank, averaged over the decode engine's steps.
        running = dec.tokens_generated / (dec.num_steps * dec.ranks_per_engine)
    total = float(trace.total_tokens.sum())
    return {
        "cached_share": float(trace.cached_tokens.sum()) / total if total > 0 else 0.0,
        "attainment": met,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "mean_running_per_rank": running,
    }


def _search(
    trace: Trace,
    replay: Callable[[Trace], tuple[np.ndarray, np.ndarray, Trace]],
    *,
    cost: CostPreset,
    options: GoodputOptions,
    start_rate: float,
) -> PolicyGoodput:
    # replay(trace at a rate) -> (TTFT, prefill time alone, trace with the cached tokens hit).
    slo, rel_tol = options.slo, options.rel_tol
    decode_of = _decoder(cost, options)
    last: dict[float, tuple] = {}

    def prefill_at(rate: float) -> tuple[np.ndarray, np.ndarray, Trace]:
        return replay(with_rate(trace, rate))

    def ttft_only(rate: float) -> float:
        ttft, alone, t = prefill_at(rate)
        last.clear()
        last[rate] = (ttft, alone, t)
        return attainment(ttft, alone, np.zeros(ttft.shape[0]), slo=slo)

    def both(rate: float) -> tuple[float, tuple]:
        ttft, alone, t = last[rate] if rate in last else prefill_at(rate)
        tpot, dec = decode_of(t, ttft + t.arrival_s)
        return attainment(ttft, alone, tpot, slo=slo), (ttft, tpot, dec, t)

    first = find_goodput(ttft_only, start_rate=start_rate, target=slo.attainment, rel_tol=rel_tol)
    evals = list(first.evaluations)
    if first.requests_per_s <= 0.0:
        return PolicyGoodput(first, {"attainment": None, "evaluations": len(evals)})
    rate = first.requests_per_s
    met, seen = both(rate)
    evals.append((rate, met))
    search = first._replace(attainment=met, evaluations=tuple(evals))
    if met < slo.attainment:
        full: dict[float, tuple] = {}

        def judge(r: float) -> float:
            a, s = both(r)
            full[r] = s
            return a

        second = find_goodput(
            judge, start_rate=rate / 2.0, target=slo.attainment, rel_tol=rel_tol, upper_rate=rate
        )
        evals.extend(second.evaluations)
        search = second._replace(evaluations=tuple(evals))
        if second.requests_per_s <= 0.0:
            return PolicyGoodput(search, {"attainment": None, "evaluations": len(evals)})
        met, seen = search.attainment, full[second.requests_per_s]
    ttft, tpot, dec, t = seen
    out = _summary(ttft, tpot, met, dec, t)
    out["evaluations"] = len(evals)
    return PolicyGoodput(search, out)


def _check(trace: Trace, cost: CostPreset, options: GoodputOptions) -> None:
    if not isinstance(trace, Trace):
        raise TypeError(f"trace: must be a Trace, got {type(trace).__name__}")
    if not isinstance(cost, CostPreset):
        raise TypeError(f"cost: must be a CostPreset (lbkit.core.PRESETS), got {cost!r}")
    if not isinstance(options, GoodputOptions):
        raise TypeError(f"options: must be a GoodputOptions, got {type(options).__name__}")


def _setup(trace: Trace, cost: CostPreset, options: GoodputOptions, start_rate: float):
    # What every goodput search checks and computes first: its inputs, and each request's
    # prefill time alone on an idle rank with the trace's cached tokens (the SLO's denominator).
    _check(trace, cost, options)
    check_real(start_rate, "start_rate", min_value=0.0, strict_min=True)
    return _alone(trace, cost, options)


def _alone(trace: Trace, cost: CostPreset, options: GoodputOptions) -> np.ndarray:
    ranks = options.pools.ranks_per_engine
    return alone_s(trace, ranks_per_engine=ranks, cost=cost.prefill, budget_s=options.budget_s)


def prefill_goodput(
    trace: Trace,
    policy: Any,
    /,
    *,
    cost: CostPreset,
    options: GoodputOptions = DEFAULT_GOODPUT_OPTIONS,
    start_rate: float,
    rank_cache: Callable[[Trace], Any] | None = None,
) -> PolicyGoodput:
    """Goodput of prefill ``policy`` on ``trace`` (see the module docstring).

    Parameters
    ----------
    trace : Trace
        Prepared by :func:`prepare_cache` for ``options.cache``; its arrivals are scaled in time.
    policy : str or callable
        A prefill policy name, or a factory ``(num_engines, ranks_per_engine, *, cost, rng)``.
    cost : CostPreset
        Prefill and decode cost models.
    options : GoodputOptions, default :data:`DEFAULT_GOODPUT_OPTIONS`
        Pools, SLO, cache mode, decode policy, search tolerance, step budget and seed.
    start_rate : float
        First rate tried, requests per second (> 0).
    rank_cache : callable(trace) -> hook, optional
        With ``options.cache == "local"``: builds the per-rank caches of one replay (the
        ``simulate_prefill(rank_cache=...)`` hook, e.g. :func:`local_caches`); required there.

    Returns
    -------
    PolicyGoodput

    Runtime complexity: about ``log2(1 / rel_tol) + 2`` prefill replays of ``trace`` and one to a
    few decode replays (see :func:`lbkit.sim.goodput.find_goodput`).

    Examples
    --------
    Per-rank caches on two prefill ranks:

    >>> from lbkit.core import PRESETS
    >>> from lbkit.sim.workload import default_workload
    >>> pools = Pools(prefill_engines=1, ranks_per_engine=2, decode_ranks=4)
    >>> opts = GoodputOptions(pools=pools, cache="local", rel_tol=0.05)
    >>> trace = prepare_cache(default_workload(num_requests=200, rng=1), opts.cache)
    >>> g = prefill_goodput(trace, "least_tokens", cost=PRESETS["h800_dsv3"], options=opts,
    ...                     start_rate=1.0, rank_cache=local_caches(pools.num_prefill_ranks))
    >>> g.search.requests_per_s > 0, g.metrics["attainment"] >= opts.slo.attainment
    (True, True)
    """
    alone = _setup(trace, cost, options, start_rate)
    if options.cache == "local" and rank_cache is None:
        raise ValueError("rank_cache: required with cache='local' (the per-rank caches)")
    kw: dict[str, Any] = dict(
        num_engines=options.pools.prefill_engines,
        ranks_per_engine=options.pools.ranks_per_engine,
        cost=cost.prefill,
        budget_s=options.budget_s,
        rng=options.seed,
    )

    def replay(t: Trace) -> tuple[np.ndarray, np.ndarray, Trace]:
        if options.cache != "local":
            return simulate_prefill(t, policy, **kw).ttft_s, alone, t
        hook = _BestHit(rank_cache(t), len(t))
        run = simulate_prefill(t, policy, rank_cache=hook, **kw)
        best = t.with_cached_tokens(hook.best)
        # The denominator: the best hit when routed; the trace: what it hit where it ran.
        return run.ttft_s, _alone(best, cost, options), t.with_cached_tokens(run.cached_tokens)

    return _search(trace, replay, cost=cost, options=options, start_rate=start_rate)


class _BestHit:
    """The engine's ``rank_cache`` hook, recording each request's best hit over the ranks when it
    was routed (the slowdown denominator of the SLO with per-rank caches)."""

    def __init__(self, hook: Any, n: int) -> None:
        self._hook = hook
        self.best = np.zeros(n, dtype=np.int64)

    def hit_tokens(self, request: int) -> np.ndarray:
        hits = self._hook.hit_tokens(request)
        self.best[request] = hits.max() if hits.shape[0] else 0
        return hits

    def admitted(self, request: int, rank: int) -> None:
        self._hook.admitted(request, rank)

    def finished(self, request: int, rank: int) -> None:
        self._hook.finished(request, rank)


def _decoder(cost: CostPreset, options: GoodputOptions):
    pools = options.pools

    def decode_of(trace: Trace, finish_s: np.ndarray) -> tuple[np.ndarray, Any]:
        return _tpot(
            trace,
            finish_s,
            lambda t: simulate_decode(
                t,
                options.decode_policy,
                num_engines=pools.decode_engines,
                ranks_per_engine=pools.decode_ranks,
                cost=cost.decode,
                max_kv_tokens=DECODE_KV_CAPACITY_TOKENS,
                kv_watermark_tokens=DECODE_KV_WATERMARK_TOKENS,
                migration_s_per_kv_token=MIGRATION_S_PER_KV_TOKEN,  # lbkit's decode migrates
                rng=options.seed,
            ),
        )

    return decode_of


def ideal_goodput(
    trace: Trace,
    /,
    *,
    cost: CostPreset,
    options: GoodputOptions = DEFAULT_GOODPUT_OPTIONS,
    start_rate: float,
) -> PolicyGoodput:
    """Goodput of the ideal late-binding reference on ``trace`` (see :mod:`lbkit.sim.ideal`).

    Its central queue is served in SLO-deadline order (``arrival + max(slo.ttft_s,
    slo.ttft_slowdown * alone)``); it sees the trace's cached tokens whatever ``options.cache``
    says (the global cache's hits in both cached modes). Parameters as :func:`prefill_goodput`.

    Examples
    --------
    No policy beats it (here without caches, on one engine of two ranks):

    >>> from lbkit.core import PRESETS
    >>> from lbkit.sim.workload import default_workload
    >>> trace = prepare_cache(default_workload(num_requests=200, rng=1), "none")
    >>> kw = dict(cost=PRESETS["h800_dsv3"], options=GoodputOptions(
    ...     pools=Pools(1, 2, 1, 4), cache="none", rel_tol=0.05))
    >>> ideal = ideal_goodput(trace, start_rate=1.0, **kw)
    >>> got = prefill_goodput(trace, "least_tokens", start_rate=ideal.search.requests_per_s, **kw)
    >>> 0 < got.search.requests_per_s <= ideal.search.requests_per_s
    True
    """
    alone = _setup(trace, cost, options, start_rate)
    slo, pools = options.slo, options.pools
    slack = np.maximum(slo.ttft_s, slo.ttft_slowdown * alone)

    def replay(t: Trace) -> tuple[np.ndarray, np.ndarray, Trace]:
        run = simulate_ideal_prefill(
            t, num_engines=pools.prefill_engines, ranks_per_engine=pools.ranks_per_engine,
            cost=cost.prefill, budget_s=options.budget_s, deadline_s=t.arrival_s + slack,
        )  # fmt: skip
        return run.ttft_s, alone, t

    return _search(trace, replay, cost=cost, options=options, start_rate=start_rate)


def goodput_row(result: PolicyGoodput, *, ideal: float, best_peer: float | None) -> dict:
    """The JSON row of one policy (SPEC section 10 keys first, then details)."""
    rate = result.search.requests_per_s
    row = {
        "requests_per_s": rate,
        "vs_ideal": rate / ideal if ideal > 0 else None,
        "vs_best_peer": rate / best_peer if best_peer else None,
        "ttft_p99_s": result.metrics.get("ttft_p99_s"),
        "tpot_p99_s": result.metrics.get("tpot_p99_s"),
        "attainment": result.metrics.get("attainment"),
    }
    for k, v in result.metrics.items():
        row.setdefault(k, v)
    row["bracketed"] = result.search.bracketed
    row["curve"] = [list(p) for p in result.search.evaluations]
    return row


def best_of(rows: dict[str, PolicyGoodput], names: Sequence[str]) -> float | None:
    """Highest goodput among ``names`` present in ``rows`` (``None`` if none is)."""
    rates = [rows[n].search.requests_per_s for n in names if n in rows]
    return max(rates) if rates else None


#: The peers' routing rules of SPEC section 8 (``vs_best_peer`` compares with the best of them).
PEER_NAMES = tuple(PEER_POLICIES)


def run_goodput(
    trace: Trace,
    /,
    *,
    policies: Sequence[str],
    cost: CostPreset,
    options: GoodputOptions = DEFAULT_GOODPUT_OPTIONS,
    rank_cache: Callable[[Trace], Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    replicas: ReplicaSync | None = None,
) -> dict[str, Any]:
    """Goodput of the ideal reference and of every prefill policy in ``policies`` on ``trace``.

    ``policies`` are keys of :data:`lbkit.sim.policies.PREFILL_POLICIES`; ``trace`` is prepared
    by :func:`prepare_cache` for ``options.cache``; ``rank_cache`` as in :func:`prefill_goodput`;
    ``progress(label, done, total)`` is called before each search. The ideal's search starts
    where the trace's prefill work fills half the pool, each policy's at the ideal's goodput.
    Returns the JSON sections of SPEC section 10: ``{"goodput": {POLICY: row}, "ideal": {...},
    "best_peer_requests_per_s": ..., "slo": {...}, "cache": cache}`` with rows as
    :func:`goodput_row` makes them (each with its ``curve`` of (rate, attainment) points).
    With ``replicas`` (a :class:`~lbkit.sim.replicas.ReplicaSync`), one more row,
    :data:`REPLICAS_ROW`: the ``lbkit`` policy as ``replicas.k`` router replicas under its sync
    mode (:class:`~lbkit.sim.replicas.PrefillReplicas`).

    Examples
    --------
    The defaults with smaller pools and a coarser search:

    >>> import dataclasses
    >>> from lbkit.core import PRESETS
    >>> from lbkit.sim.workload import default_workload
    >>> opts = dataclasses.replace(DEFAULT_GOODPUT_OPTIONS, pools=Pools(1, 2, 1, 4), rel_tol=0.05)
    >>> out = run_goodput(prepare_cache(default_workload(num_requests=200, rng=1), opts.cache),
    ...                   policies=["round_robin", "vllm"], cost=PRESETS["h800_dsv3"], options=opts)
    >>> sorted(out["goodput"]), out["cache"], out["ideal"]["vs_ideal"]
    (['round_robin', 'vllm'], 'global', 1.0)
    """
    _check(trace, cost, options)
    names = list(policies)
    for name in names:
        check_choice(name, "policies", tuple(PREFILL_POLICIES))
    makers: dict[str, Any] = dict(zip(names, names, strict=True))
    if replicas is not None:
        if not isinstance(replicas, ReplicaSync):
            raise TypeError(f"replicas: must be a ReplicaSync, got {type(replicas).__name__}")
        makers[REPLICAS_ROW] = prefill_replicas(replicas)
        names.append(REPLICAS_ROW)
    total = len(names) + 1
    if progress is not None:
        progress("goodput ideal", 0, total)
    start = _start_rate(trace, cost, options.pools.num_prefill_ranks)
    ideal = ideal_goodput(trace, cost=cost, options=options, start_rate=start)
    ref = ideal.search.requests_per_s
    results: dict[str, PolicyGoodput] = {}
    for j, name in enumerate(names):
        if progress is not None:
            progress(f"goodput {name}", j + 1, total)
        results[name] = prefill_goodput(
            trace,
            makers[name],
            cost=cost,
            options=options,
            start_rate=ref or 1.0,
            rank_cache=rank_cache,
        )
    best_peer = best_of(results, PEER_NAMES)
    rows = {n: goodput_row(g, ideal=ref, best_peer=best_peer) for n, g in results.items()}
    ideal_row = goodput_row(ideal, ideal=ref, best_peer=best_peer)
    return {
        "goodput": rows,
        "ideal": ideal_row,
        "best_peer_requests_per_s": best_peer,
        "slo": options.slo.as_dict(),
        "cache": options.cache,
    }


def _start_rate(trace: Trace, cost: CostPreset, num_ranks: int) -> float:
    # The rate at which the trace's prefill work would fill half the pool: a first guess.
    factor = utilization_factor(trace, 0.5, num_ranks=num_ranks, cost=cost.prefill)
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) * factor
    return (len(trace) - 1) / span if span > 0 else 1.0
