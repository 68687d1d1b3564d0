"""What a trace holds, at a glance: bucket names, percentiles and :class:`TraceSummary`.

Part of :mod:`lbkit.sim.traces` (import the names from there): :meth:`Trace.summary
<lbkit.sim.traces.Trace.summary>` builds a :class:`TraceSummary`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, NamedTuple

import numpy as np

from lbkit.prefill.buckets import DEFAULT_EDGES

__all__ = ["BUCKET_EDGES_TOKENS", "Percentiles", "TraceSummary", "bucket_labels", "percentiles"]

#: Default bucket edges by ``total_tokens`` (lower edge inclusive): 16K, 64K, 256K, those of
#: :data:`lbkit.prefill.DEFAULT_EDGES`.
BUCKET_EDGES_TOKENS: tuple[int, ...] = DEFAULT_EDGES


def _format_tokens(value: int) -> str:
    if value % 1048576 == 0:
        return f"{value // 1048576}M"
    if value % 1024 == 0:
        return f"{value // 1024}K"
    return str(value)


def bucket_labels(edges_tokens: tuple[int, ...] = BUCKET_EDGES_TOKENS) -> tuple[str, ...]:
    """Names of the buckets that ``edges_tokens`` cut (lower edge inclusive).

    Examples
    --------
    >>> bucket_labels()
    ('<16K', '16K-64K', '64K-256K', '>=256K')
    >>> bucket_labels((1000,))
    ('<1000', '>=1000')
    """
    names = [_format_tokens(e) for e in edges_tokens]
    if not names:
        return ("all",)
    inner = [f"{a}-{b}" for a, b in itertools.pairwise(names)]
    return (f"<{names[0]}", *inner, f">={names[-1]}")


class Percentiles(NamedTuple):
    """Summary statistics of one column of a trace (``nan`` for an empty trace)."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def percentiles(values: np.ndarray) -> Percentiles:
    """Mean, median, 90th and 99th percentiles and maximum of ``values`` (``nan`` when empty)."""
    if values.size == 0:
        return Percentiles(*(math.nan,) * 5)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return Percentiles(
        float(values.mean()), float(p50), float(p90), float(p99), float(values.max())
    )


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    """What a trace contains, at a glance; ``str()`` renders it as a small table.

    Attributes
    ----------
    source : str
        Where the trace came from.
    num_requests : int
    duration_s : float
        Last arrival minus first arrival (0 for fewer than two requests).
    rate_per_s : float
        ``num_requests / duration_s``; ``nan`` when ``duration_s`` is 0.
    total_tokens, output_tokens : Percentiles
        Prompt lengths (including cached prefix) and generated lengths.
    cached_share : float
        ``sum(cached_tokens) / sum(total_tokens)`` (0 for an empty trace).
    bucket_labels : tuple of str
        One name per bucket, e.g. ``('<16K', '16K-64K', '64K-256K', '>=256K')``.
    bucket_edges_tokens : tuple of int
    bucket_counts : tuple of int
        Requests per bucket of ``total_tokens`` (lower edge inclusive).
    bucket_request_shares, bucket_token_shares : tuple of float
        Share of requests and of ``total_tokens`` per bucket (each sums to 1; 0 when empty).
    """

    source: str
    num_requests: int
    duration_s: float
    rate_per_s: float
    total_tokens: Percentiles
    output_tokens: Percentiles
    cached_share: float
    bucket_labels: tuple[str, ...]
    bucket_edges_tokens: tuple[int, ...]
    bucket_counts: tuple[int, ...]
    bucket_request_shares: tuple[float, ...]
    bucket_token_shares: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (percentiles become ``{"mean": ..., "p50": ...}``)."""
        out = dataclasses.asdict(self)
        for key in ("total_tokens", "output_tokens"):
            out[key] = getattr(self, key)._asdict()
        return out

    def __str__(self) -> str:
        rate = "n/a" if math.isnan(self.rate_per_s) else f"{self.rate_per_s:,.2f}"
        lines = [
            f"trace {self.source or '(unnamed)'}: {self.num_requests:,} requests over "
            f"{self.duration_s:,.1f} s ({rate} req/s); cached {self.cached_share:.1%} of tokens"
        ]
        for name in ("total_tokens", "output_tokens"):
            p = getattr(self, name)
            if math.isnan(p.mean):
                lines.append(f"{name:<14} (no requests)")
                continue
            lines.append(
                f"{name:<14} mean {p.mean:,.0f}  p50 {p.p50:,.0f}  p90 {p.p90:,.0f}  "
                f"p99 {p.p99:,.0f}  max {p.max:,.0f}"
            )
        lines.append(f"{'bucket':<10} {'requests':>9} {'share':>7} {'tokens':>7}")
        for label, count, share, tokens in zip(
            self.bucket_labels,
            self.bucket_counts,
            self.bucket_request_shares,
            self.bucket_token_shares,
            strict=True,
        ):
            lines.append(f"{label:<10} {count:>9,} {share:>7.2%} {tokens:>7.2%}")
        return "\n".join(lines)
