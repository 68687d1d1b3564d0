"""Checks of ``lbkit bench``, run before any simulation: its options, its trace, its workload.

:func:`check_options` checks every option alone and in combination (an option that does nothing
in the given combination is refused, with the option that makes it idle), and that the output
paths can be written. :func:`read_trace` reads ``--trace`` and refuses what the simulator cannot
replay meaningfully, naming the file and line: too few or too many requests, a prompt or an
output above :data:`~lbkit.cli.checks.MAX_REQUEST_TOKENS`, requests that all arrive at once, and
an outlier timestamp that leaves the trace idle for most of its span (``--utilization`` would
then load the other requests many times harder than asked). :func:`check_workload` bounds the
work of one replay (:func:`predicted_prefill_steps`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from lbkit.cli.checks import (
    MAX_POOL_RANKS,
    MAX_PREFILL_STEPS,
    MAX_REQUEST_TOKENS,
    MAX_REQUESTS,
    MAX_SEED,
    check_count,
    check_input_file,
    check_outputs,
    check_real_option,
    refuse_ignored,
)

__all__ = [
    "OUTLIER_GAP_SHARE",
    "check_options",
    "check_workload",
    "predicted_prefill_steps",
    "read_trace",
]

#: A trace is refused when one idle gap between consecutive arrivals holds more than this share
#: of its span: time-scaled to ``--utilization``, the rest of it would run at ten or more times
#: the utilisation asked for.
OUTLIER_GAP_SHARE = 0.9
#: Field names of each trace format, for messages: (timestamp, prompt, output).
_FIELDS = {
    "mooncake": ("timestamp", "input_length", "output_length"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
}
_SLO_OPTIONS = ("slo_ttft", "slo_ttft_slowdown", "slo_tpot", "attainment")


def check_options(args: argparse.Namespace) -> dict[str, Any]:
    """Check every option of ``lbkit bench`` (``args.given``: the options the user gave).

    Returns the resolved ``{"prefill_policies", "decode_policies"}`` (``None``: all).
    """
    from lbkit.core import PRESETS
    from lbkit.sim.policies import PREFILL_POLICIES
    from lbkit.sim.policies_decode import DECODE_POLICIES

    given = getattr(args, "given", frozenset())
    why = f"the largest pool lbkit bench simulates has {MAX_POOL_RANKS:,} ranks"
    for pool, engines, ranks in (
        ("prefill", "prefill_engines", "ranks_per_engine"),
        ("decode", "decode_engines", "decode_ranks"),
    ):
        e = check_count(args, engines, 1, MAX_POOL_RANKS, why)
        r = check_count(args, ranks, 1, MAX_POOL_RANKS, why)
        if e * r > MAX_POOL_RANKS:
            raise ValueError(
                f"--{engines.replace('_', '-')} x --{ranks.replace('_', '-')}: {e:,} x {r:,} = "
                f"{e * r:,} {pool} ranks, more than the largest pool lbkit bench simulates "
                f"({MAX_POOL_RANKS:,} ranks)"
            )
    if args.max_requests is not None:
        check_count(args, "max_requests", 2, MAX_REQUESTS, "the most lbkit bench replays")
    check_count(args, "seed", 0, MAX_SEED)
    check_real_option(args, "utilization", 0.01, 10.0)
    check_real_option(args, "budget", 0.001, 3600.0, unit=" seconds")
    check_real_option(args, "cp_efficiency", 0.01, 1.0)
    check_real_option(args, "decode_batch", 0.01, 4096.0, unit=" requests per rank")
    if args.migrate_every is not None:
        check_real_option(args, "migrate_every", 0.0, 86400.0, unit=" seconds")
    check_count(args, "max_migrations", 1, 4096)
    check_real_option(args, "migration_gbps", 0.001, 100_000.0, unit=" GB/s")
    check_count(args, "kv_bytes_per_token", 1, 2**24)
    check_real_option(args, "slo_ttft", 0.001, 86400.0, unit=" seconds")
    check_real_option(args, "slo_ttft_slowdown", 0.0, 10_000.0)
    check_real_option(args, "slo_tpot", 0.0001, 3600.0, unit=" seconds")
    check_real_option(args, "attainment", 0.0, 1.0, low_open=True)
    if args.cost not in PRESETS:
        raise ValueError(f"--cost: unknown preset {args.cost!r}; choose from {', '.join(PRESETS)}")

    pp = dp = None
    if args.policies is not None:
        names = [t.strip() for t in args.policies.split(",") if t.strip()]
        known = sorted(set(PREFILL_POLICIES) | set(DECODE_POLICIES))
        unknown = [n for n in names if n not in PREFILL_POLICIES and n not in DECODE_POLICIES]
        if not names:
            raise ValueError(f"--policies: names no policy; choose from {', '.join(known)}")
        if unknown:
            raise ValueError(
                f"--policies: unknown policy {unknown[0]!r}; choose from {', '.join(known)}"
            )
        pp = [n for n in names if n in PREFILL_POLICIES] or ["lbkit"]
        dp = [n for n in names if n in DECODE_POLICIES] or ["lbkit"]

    # Options that would do nothing in this combination.
    if args.trace is None:
        refuse_ignored(given, "format", "ignored without --trace (the built-in workload)")
    if args.work_sharing != "split":
        refuse_ignored(given, "cp_efficiency", "needs --work-sharing split")
    if args.migrate_every is None:
        refuse_ignored(given, "max_migrations", "ignored without --migrate-every")
    if args.no_goodput:
        for dest in _SLO_OPTIONS:
            refuse_ignored(given, dest, "ignored with --no-goodput (the SLO judges the goodput)")
    migrating = args.migrate_every is not None or dp is None or "lbkit" in dp
    if not migrating:
        for dest in ("migration_gbps", "kv_bytes_per_token"):
            refuse_ignored(
                given, dest, "ignored: no decode policy of --policies migrates (lbkit does)"
            )
    replicas = _replicas(args, given)
    if args.plot is not None:
        _check_plot(args.plot)
    check_outputs({"--json": args.json, "--plot": args.plot}, {"--trace": args.trace})
    if args.trace is not None:
        check_input_file(args.trace, "--trace")
    return {"prefill_policies": pp, "decode_policies": dp, "replicas": replicas}


def _replicas(args: argparse.Namespace, given: Any) -> Any:
    """The ``ReplicaSync`` of ``--replicas K`` and its sync options (``None`` for one router)."""
    from lbkit.sim.replicas import MAX_REPLICAS, ReplicaSync

    k = check_count(args, "replicas", 1, MAX_REPLICAS, "the most replicas lbkit bench models")
    check_real_option(args, "sync_delay", 0.0, 3600.0, unit=" seconds")
    check_real_option(args, "sync_period", 0.0, 86400.0, low_open=True, unit=" seconds")
    if k == 1:
        for dest in ("sync", "sync_delay", "sync_period"):
            refuse_ignored(given, dest, "needs --replicas K with K > 1")
        return None
    if args.sync != "shared":
        refuse_ignored(given, "sync_delay", "needs --sync shared")
    if args.sync not in ("reports", "polled"):
        refuse_ignored(given, "sync_period", "needs --sync reports or polled")
    return ReplicaSync(k=k, mode=args.sync, delay_s=args.sync_delay, period_s=args.sync_period)


def _check_plot(path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(
            "--plot: needs matplotlib; install it with pip install 'lbkit[plot]'"
        ) from None
    kinds = Figure().canvas.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in kinds:
        raise ValueError(
            f"--plot: cannot tell the image format from suffix {path.suffix!r}; "
            f"use one of {', '.join('.' + k for k in sorted(kinds))}"
        )


class _Lines:
    """Line numbers of the requests of a trace file (requests are numbered in file order)."""

    def __init__(self, path: Path, fmt: str | None):
        self.path = path
        self.fmt = fmt
        self._lines: list[int] | None = None

    def format(self) -> str:
        if self.fmt is None:
            self._scan()
        return self.fmt  # type: ignore[return-value]

    def _scan(self) -> None:
        text = self.path.read_bytes().decode("utf-8-sig", errors="replace")
        numbered = [i for i, line in enumerate(text.splitlines(), start=1) if line.strip()]
        if self.fmt is None:
            first = next((line.strip() for line in text.splitlines() if line.strip()), "")
            self.fmt = "mooncake" if first.startswith("{") else "azure"
        # Mooncake: every non-blank line is a request; Azure: every one after the header.
        self._lines = numbered if self.fmt == "mooncake" else numbered[1:]

    def of(self, request_id: int) -> int:
        if self._lines is None:
            self._scan()
        return self._lines[request_id]  # type: ignore[index]

    def field(self, which: int) -> str:
        return _FIELDS[self.format()][which]


def read_trace(args: argparse.Namespace) -> Any:
    """Read ``--trace`` as ``lbkit bench`` replays it, after checking it (see the module doc)."""
    from lbkit.sim.bench import load_bench_trace
    from lbkit.sim.traces import load_trace

    path: Path = args.trace
    name = path.name
    raw = load_trace(path, format=args.format)  # Mooncake: not spread, the file's timestamps
    lines = _Lines(path, args.format)
    if len(raw) < 2:
        raise ValueError(f"{name}: holds {len(raw)} request; lbkit bench needs at least 2")
    if args.max_requests is not None:
        if args.max_requests >= len(raw):
            raise ValueError(
                f"--max-requests: ignored: {name} holds only {len(raw):,} requests "
                f"(give fewer than that, or leave it out)"
            )
        raw = raw.head(args.max_requests)
    elif len(raw) > MAX_REQUESTS:
        raise ValueError(
            f"{name}: holds {len(raw):,} requests, more than lbkit bench replays "
            f"({MAX_REQUESTS:,}); replay the first ones with --max-requests"
        )
    for which, column in ((1, raw.total_tokens), (2, raw.output_tokens)):
        over = np.flatnonzero(column > MAX_REQUEST_TOKENS)
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"{name}: line {lines.of(int(raw.request_id[i]))}: {lines.field(which)}: "
                f"{int(column[i]):,} tokens, more than the largest request lbkit bench "
                f"simulates (2**24 = {MAX_REQUEST_TOKENS:,} tokens)"
            )
    _check_arrivals(raw, name, lines, args.utilization)
    if raw.hash_ids is None and "cache" in getattr(args, "given", ()) and args.cache != "none":
        raise ValueError(
            f"--cache {args.cache}: ignored: {name} has no prefix block ids (hash_ids), so "
            f"nothing is cached; use --cache none or leave it out"
        )
    check_workload(raw, args, source=name, lines=lines)
    trace = load_bench_trace(path, format=args.format)
    if args.max_requests is not None:
        trace = trace.head(args.max_requests)
    return trace


def _check_arrivals(raw: Any, name: str, lines: _Lines, utilization: float) -> None:
    arrival = raw.arrival_s
    span = float(arrival[-1] - arrival[0])
    if span == 0.0:
        raise ValueError(
            f"{name}: every request has the same {lines.field(0)} (line "
            f"{lines.of(int(raw.request_id[0]))}); lbkit bench scales arrivals over time to "
            f"--utilization and needs at least two distinct arrival times"
        )
    if len(raw) < 3:
        return
    gaps = np.diff(arrival)
    j = int(np.argmax(gaps))
    share = float(gaps[j]) / span
    if share <= OUTLIER_GAP_SHARE:
        return
    # The outlier is on the side of the gap with fewer requests.
    late = len(raw) - j - 1 <= j + 1
    pos = j + 1 if late else j
    where = "after the previous request" if late else "before the next request"
    raise ValueError(
        f"{name}: line {lines.of(int(raw.request_id[pos]))}: {lines.field(0)}: an outlier: "
        f"it arrives {float(gaps[j]):,.6g} s {where}, {share:.2%} of the trace's span, so "
        f"scaled to --utilization {utilization:g} the other requests would offer a utilisation "
        f"of {utilization / (1.0 - share):,.3g}; remove it or cut the trace with --max-requests"
    )


def predicted_prefill_steps(total_tokens: Any, /, *, cost: Any, budget_s: float) -> np.ndarray:
    """Prefill steps each request needs alone on a rank (an estimate), float64.

    A prompt of ``n`` tokens has local work ``W = L n + max(k / 2, q) n**2`` seconds (``L`` the
    linear cost per token; the chunked sum of the quadratic terms is at most that) and a step
    of budget ``tau`` runs ``tau - a`` seconds of it, but at least one token:
    ``steps = min(n, ceil(W / (tau - a)))`` (``n`` when ``tau <= a``). Against the simulator
    (one prompt alone on one rank, ``h800_dsv3``, 10**3 to 10**6 tokens, budgets 0.005 to 1 s) the
    estimate is within 0.8 to 1.25 times the steps it takes (tests/cli/test_cli_limits.py).

    Runtime complexity: O(n).

    Examples
    --------
    >>> from lbkit.core import PRESETS
    >>> predicted_prefill_steps([1000, 10**6], cost=PRESETS["h800_dsv3"].prefill, budget_s=1.0)
    array([1.000e+00, 5.754e+03])
    """
    n = np.asarray(total_tokens, dtype=np.float64)
    work = cost.linear_s_per_token * n + max(cost.k / 2.0, cost.q) * n * n
    usable = budget_s - cost.a
    steps = n.copy() if usable <= 0 else np.minimum(n, np.ceil(work / usable))
    return np.maximum(steps, 1.0)


def check_workload(
    trace: Any, args: argparse.Namespace, *, source: str, lines: _Lines | None = None
) -> None:
    """Refuse a workload whose replay would need more than ``MAX_PREFILL_STEPS`` steps."""
    from lbkit.core import PRESETS

    steps = predicted_prefill_steps(
        trace.total_tokens, cost=PRESETS[args.cost].prefill, budget_s=args.budget
    )
    worst = int(np.argmax(steps))
    if steps[worst] > MAX_PREFILL_STEPS and lines is not None:
        raise ValueError(
            f"{source}: line {lines.of(int(trace.request_id[worst]))}: {lines.field(1)}: a "
            f"prompt of {int(trace.total_tokens[worst]):,} tokens needs about "
            f"{steps[worst]:,.3g} prefill steps of --budget {args.budget:g} s, more than "
            f"lbkit bench allows for a whole replay ({MAX_PREFILL_STEPS:,}); raise --budget "
            f"or remove the request"
        )
    total = float(steps.sum())
    if total > MAX_PREFILL_STEPS:
        raise ValueError(
            f"{source}: its {len(trace):,} requests need about {total:,.3g} prefill steps per "
            f"replay at --budget {args.budget:g} s, more than lbkit bench allows "
            f"({MAX_PREFILL_STEPS:,}; the goodput search replays every policy about ten "
            f"times); replay fewer requests with --max-requests, or raise --budget"
        )
