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

**Caches** (``cache``, SPEC section 8): ``"none"`` (nothing cached), ``"global"`` (one LRU
cache shared by every rank, DeepSeek's design: a request's cached tokens are its hits in the
trace's arrival order, :func:`lbkit.sim.prefix_cache.apply_prefix_cache`), ``"local"`` (each
rank its own LRU cache of 512-token blocks, so that a request's cached tokens depend on where it
is routed). A trace without block hashes has no prefix structure: its cached tokens are as the
trace gives them in every mode but ``"none"``. The ideal reference uses the global cache's hits
in both cached modes (taken at arrival: an upper bound on what per-rank caches can hit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.cost import CostPreset
from lbkit.core.validation import check_choice, check_int, check_real
from lbkit.sim.engine import (
    DECODE_KV_CAPACITY_TOKENS,
    DECODE_KV_WATERMARK_TOKENS,
    simulate_decode,
    simulate_prefill,
    utilization_factor,
)
from lbkit.sim.goodput import DEFAULT_SLO, GoodputSearch, Slo, attainment, find_goodput, with_rate
from lbkit.sim.ideal import alone_s, simulate_ideal_prefill
from lbkit.sim.peers import PEER_POLICIES
from lbkit.sim.prefix_cache import LocalPrefixCaches, apply_prefix_cache, capacity_blocks_for
from lbkit.sim.traces import Trace

__all__ = [
    "CACHE_MODES",
    "PEER_NAMES",
    "PolicyGoodput",
    "best_of",
    "goodput_row",
    "ideal_goodput",
    "local_caches",
    "prefill_goodput",
    "prepare_cache",
    "run_goodput",
]

#: Prefix-cache modes of the prefill pool (``lbkit bench --cache``).
CACHE_MODES = ("none", "global", "local")


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
    prefill_at: Callable[[float], tuple[np.ndarray, np.ndarray, Trace]],
    decode_of: Callable[[Trace, np.ndarray], tuple[np.ndarray, Any]],
    *,
    slo: Slo,
    start_rate: float,
    rel_tol: float,
) -> PolicyGoodput:
    last: dict[float, tuple] = {}

    def ttft_only(rate: float) -> float:
        ttft, alone, trace = prefill_at(rate)
        last.clear()
        last[rate] = (ttft, alone, trace)
        return attainment(ttft, alone, np.zeros(ttft.shape[0]), slo=slo)

    def both(rate: float) -> tuple[float, tuple]:
        ttft, alone, trace = last[rate] if rate in last else prefill_at(rate)
        tpot, dec = decode_of(trace, ttft + trace.arrival_s)
        return attainment(ttft, alone, tpot, slo=slo), (ttft, tpot, dec, trace)

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
    ttft, tpot, dec, trace = seen
    out = _summary(ttft, tpot, met, dec, trace)
    out["evaluations"] = len(evals)
    return PolicyGoodput(search, out)


def prefill_goodput(
    trace: Trace,
    policy: Any,
    /,
    *,
    cost: CostPreset,
    cache: str = "global",
    num_engines: int = 8,
    ranks_per_engine: int = 8,
    decode_engines: int = 1,
    decode_ranks: int = 64,
    decode_policy: str = "lbkit",
    slo: Slo = DEFAULT_SLO,
    start_rate: float,
    rel_tol: float = 0.01,
    budget_s: float = 1.0,
    seed: int = 0,
    rank_cache: Callable[[Trace], Any] | None = None,
) -> PolicyGoodput:
    """Goodput of prefill ``policy`` on ``trace`` (see the module docstring).

    Parameters
    ----------
    trace : Trace
        Prepared by :func:`prepare_cache` for ``cache``; its arrival pattern is scaled in time.
    policy : str or callable
        A prefill policy name, or a factory ``(num_engines, ranks_per_engine, *, cost, rng)``.
    cost : CostPreset
        Prefill and decode cost models.
    cache : {"none", "global", "local"}, default "global"
    num_engines, ranks_per_engine, decode_engines, decode_ranks : int
        Pools (default 8 x 8 prefill ranks, one decode engine of 64 ranks).
    decode_policy : str, default "lbkit"
        Routes the decode pool of every evaluation judged on TPOT.
    slo : Slo
    start_rate : float
        First rate tried, requests per second.
    rel_tol : float, default 0.01
    budget_s : float, default 1.0
    seed : int, default 0
    rank_cache : callable(trace) -> hook, optional
        With ``cache="local"``: builds the per-rank caches of one replay (the
        ``simulate_prefill(rank_cache=...)`` hook); required there.

    Returns
    -------
    PolicyGoodput
    """
    check_choice(cache, "cache", CACHE_MODES)
    if cache == "local" and rank_cache is None:
        raise ValueError("rank_cache: required with cache='local' (the per-rank caches)")
    e = check_int(num_engines, "num_engines", min_value=1)
    r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    alone = alone_s(trace, ranks_per_engine=r, cost=cost.prefill, budget_s=budget_s)

    def prefill_at(rate: float) -> tuple[np.ndarray, np.ndarray, Trace]:
        t = with_rate(trace, rate)
        if cache != "local":
            run = simulate_prefill(
                t, policy, num_engines=e, ranks_per_engine=r, cost=cost.prefill,
                budget_s=budget_s, rng=seed,
            )  # fmt: skip
            return run.ttft_s, alone, t
        hook = _BestHit(rank_cache(t), len(t))
        run = simulate_prefill(
            t, policy, num_engines=e, ranks_per_engine=r, cost=cost.prefill, budget_s=budget_s,
            rng=seed, rank_cache=hook,
        )  # fmt: skip
        best = t.with_cached_tokens(hook.best)
        return (
            run.ttft_s,
            alone_s(best, ranks_per_engine=r, cost=cost.prefill, budget_s=budget_s),
            t.with_cached_tokens(run.cached_tokens),  # what each request hit where it ran
        )

    return _search(
        prefill_at,
        _decoder(cost, decode_policy, decode_engines, decode_ranks, seed),
        slo=slo,
        start_rate=start_rate,
        rel_tol=rel_tol,
    )


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


def _decoder(cost: CostPreset, policy: str, engines: int, ranks: int, seed: int):
    def decode_of(trace: Trace, finish_s: np.ndarray) -> tuple[np.ndarray, Any]:
        return _tpot(
            trace,
            finish_s,
            lambda t: simulate_decode(
                t,
                policy,
                num_engines=engines,
                ranks_per_engine=ranks,
                cost=cost.decode,
                max_kv_tokens=DECODE_KV_CAPACITY_TOKENS,
                kv_watermark_tokens=DECODE_KV_WATERMARK_TOKENS,
                rng=seed,
            ),
        )

    return decode_of


def ideal_goodput(
    trace: Trace,
    /,
    *,
    cost: CostPreset,
    num_engines: int = 8,
    ranks_per_engine: int = 8,
    decode_engines: int = 1,
    decode_ranks: int = 64,
    decode_policy: str = "lbkit",
    slo: Slo = DEFAULT_SLO,
    start_rate: float,
    rel_tol: float = 0.01,
    budget_s: float = 1.0,
    seed: int = 0,
) -> PolicyGoodput:
    """Goodput of the ideal late-binding reference on ``trace`` (see :mod:`lbkit.sim.ideal`).

    Its central queue is served in SLO-deadline order (``arrival + max(slo.ttft_s,
    slo.ttft_slowdown * alone)``); other parameters as :func:`prefill_goodput`.
    """
    e = check_int(num_engines, "num_engines", min_value=1)
    r = check_int(ranks_per_engine, "ranks_per_engine", min_value=1)
    check_real(start_rate, "start_rate", min_value=0.0, strict_min=True)
    alone = alone_s(trace, ranks_per_engine=r, cost=cost.prefill, budget_s=budget_s)
    slack = np.maximum(slo.ttft_s, slo.ttft_slowdown * alone)

    def prefill_at(rate: float) -> tuple[np.ndarray, np.ndarray, Trace]:
        t = with_rate(trace, rate)
        run = simulate_ideal_prefill(
            t, num_engines=e, ranks_per_engine=r, cost=cost.prefill, budget_s=budget_s,
            deadline_s=t.arrival_s + slack,
        )  # fmt: skip
        return run.ttft_s, alone, t

    return _search(
        prefill_at,
        _decoder(cost, decode_policy, decode_engines, decode_ranks, seed),
        slo=slo,
        start_rate=start_rate,
        rel_tol=rel_tol,
    )


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
    cache: str = "global",
    num_engines: int = 8,
    ranks_per_engine: int = 8,
    decode_engines: int = 1,
    decode_ranks: int = 64,
    slo: Slo = DEFAULT_SLO,
    rel_tol: float = 0.01,
    budget_s: float = 1.0,
    seed: int = 0,
    rank_cache: Callable[[Trace], Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Goodput of the ideal reference and of every prefill policy in ``policies`` on ``trace``.

    ``trace`` is prepared by :func:`prepare_cache` for ``cache``. Each policy's search starts
    at the ideal's goodput. Returns the JSON sections of SPEC section 10: ``{"goodput":
    {POLICY: row}, "ideal": {...}, "slo": {...}, "cache": cache}`` with rows as
    :func:`goodput_row` makes them (each with its ``curve`` of (rate, attainment) points).
    """
    kw: dict[str, Any] = dict(
        cost=cost,
        num_engines=num_engines,
        ranks_per_engine=ranks_per_engine,
        decode_engines=decode_engines,
        decode_ranks=decode_ranks,
        slo=slo,
        rel_tol=rel_tol,
        budget_s=budget_s,
        seed=seed,
    )
    names = list(policies)
    total = len(names) + 1
    if progress is not None:
        progress("goodput ideal", 0, total)
    start = _start_rate(trace, cost, num_engines * ranks_per_engine)
    ideal = ideal_goodput(trace, start_rate=start, **kw)
    ref = ideal.search.requests_per_s
    results: dict[str, PolicyGoodput] = {}
    for j, name in enumerate(names):
        if progress is not None:
            progress(f"goodput {name}", j + 1, total)
        results[name] = prefill_goodput(
            trace, name, cache=cache, rank_cache=rank_cache, start_rate=ref or 1.0, **kw
        )
    best_peer = best_of(results, PEER_NAMES)
    rows = {n: goodput_row(g, ideal=ref, best_peer=best_peer) for n, g in results.items()}
    ideal_row = goodput_row(ideal, ideal=ref, best_peer=best_peer)
    return {
        "goodput": rows,
        "ideal": ideal_row,
        "best_peer_requests_per_s": best_peer,
        "slo": slo.as_dict(),
        "cache": cache,
    }


def _start_rate(trace: Trace, cost: CostPreset, num_ranks: int) -> float:
    # The rate at which the trace's prefill work would fill half the pool: a first guess.
    factor = utilization_factor(trace, 0.5, num_ranks=num_ranks, cost=cost.prefill)
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) * factor
    return (len(trace) - 1) / span if span > 0 else 1.0
