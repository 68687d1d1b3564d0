"""The :class:`Trace` container: requests sorted by arrival, validated when built.

Part of :mod:`lbkit.sim.traces` (import :class:`Trace` from there), whose docstring lists the
invariants every trace satisfies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from lbkit.core.validation import as_float_array, as_int_array, check_int, check_real
from lbkit.prefill.buckets import check_edges
from lbkit.sim._trace_summary import BUCKET_EDGES_TOKENS, TraceSummary, bucket_labels, percentiles

__all__ = ["Trace", "sorted_trace"]


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr = np.array(arr, copy=True)
    arr.setflags(write=False)
    return arr


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Trace:
    """Requests sorted by arrival, as equal-length read-only numpy arrays.

    Build one with keyword arguments (every array has shape ``(n,)``); the constructor validates
    the invariants listed in :mod:`lbkit.sim.traces` and copies the arrays.

    Attributes
    ----------
    arrival_s : ndarray of float64
        Arrival time in seconds since the start of the trace, non-decreasing.
    total_tokens : ndarray of int64
        Prompt length including any cached prefix, ``>= 1``.
    output_tokens : ndarray of int64
        Generated tokens, ``>= 1``.
    cached_tokens : ndarray of int64, optional
        Prefix already in KV cache, ``0 <= cached_tokens <= total_tokens``. Default zeros; set by
        :func:`lbkit.sim.prefix_cache.apply_prefix_cache`.
    request_id : ndarray of int64, optional
        Stable unique id; readers number requests ``0..n-1`` in file order. Default ``arange(n)``.
    hash_ids : ndarray of int64, optional
        Prefix-block ids of every request, concatenated (``None`` when the trace has none).
    hash_offsets : ndarray of int64, shape (n + 1,), optional
        Request ``i`` owns ``hash_ids[hash_offsets[i]:hash_offsets[i + 1]]``. Given with
        ``hash_ids``.
    source : str
        Where the trace came from (file name or generator), for reports.

    Examples
    --------
    >>> t = Trace(arrival_s=[0.0, 0.5, 2.0], total_tokens=[100, 20000, 70000],
    ...           output_tokens=[10, 20, 30], source="example")
    >>> len(t), t.cached_tokens.tolist(), t.request_id.tolist()
    (3, [0, 0, 0], [0, 1, 2])
    >>> t.time_scaled(0.5).arrival_s.tolist()
    [0.0, 0.25, 1.0]
    >>> t[1:].total_tokens.tolist()
    [20000, 70000]
    >>> print(t.summary())
    trace example: 3 requests over 2.0 s (1.50 req/s); cached 0.0% of tokens
    total_tokens   mean 30,033  p50 20,000  p90 60,000  p99 69,000  max 70,000
    output_tokens  mean 20  p50 20  p90 28  p99 30  max 30
    bucket      requests   share  tokens
    <16K               1  33.33%   0.11%
    16K-64K            1  33.33%  22.20%
    64K-256K           1  33.33%  77.69%
    >=256K             0   0.00%   0.00%
    """

    arrival_s: np.ndarray
    total_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray | None = None
    request_id: np.ndarray | None = None
    hash_ids: np.ndarray | None = None
    hash_offsets: np.ndarray | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for name, value in _trace_iv(self).items():
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    def __repr__(self) -> str:
        duration = float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) else 0.0
        hashes = "with" if self.hash_ids is not None else "without"
        return (
            f"Trace(source={self.source!r}, num_requests={len(self)}, "
            f"duration_s={duration:.3f}, {hashes} hash_ids)"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        if self.source != other.source or len(self) != len(other):
            return False
        for field in dataclasses.fields(self):
            a, b = getattr(self, field.name), getattr(other, field.name)
            if field.name == "source":
                continue
            if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # holds arrays; equality is by value

    def __getitem__(self, key: slice | np.ndarray) -> Trace:
        """Select requests by a slice with positive step or a boolean mask of shape ``(n,)``.

        Ids and arrival times are kept as they are (not renumbered, not shifted).
        """
        if isinstance(key, slice):
            if key.step is not None and key.step <= 0:
                raise ValueError(f"key: slice step must be positive, got {key.step}")
            index = np.arange(len(self))[key]
        else:
            mask = np.asarray(key)
            if mask.dtype != np.bool_ or mask.shape != (len(self),):
                raise TypeError(
                    f"key: index a Trace with a slice or a boolean mask of shape ({len(self)},); "
                    f"got {type(key).__name__}"
                )
            index = np.flatnonzero(mask)
        return self._take(index)

    def _take(self, index: np.ndarray) -> Trace:
        hash_ids = hash_offsets = None
        if self.hash_ids is not None and self.hash_offsets is not None:
            starts, ends = self.hash_offsets[index], self.hash_offsets[index + 1]
            lengths = ends - starts
            hash_offsets = np.zeros(index.size + 1, dtype=np.int64)
            np.cumsum(lengths, out=hash_offsets[1:])
            pos = np.arange(hash_offsets[-1]) - np.repeat(hash_offsets[:-1] - starts, lengths)
            hash_ids = self.hash_ids[pos]
        return Trace(
            arrival_s=self.arrival_s[index],
            total_tokens=self.total_tokens[index],
            output_tokens=self.output_tokens[index],
            cached_tokens=self.cached_tokens[index],  # type: ignore[index]
            request_id=self.request_id[index],  # type: ignore[index]
            hash_ids=hash_ids,
            hash_offsets=hash_offsets,
            source=self.source,
        )

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (all of them if the trace is shorter).

        Examples
        --------
        >>> Trace(arrival_s=[0, 1, 2], total_tokens=[5, 6, 7], output_tokens=[1, 1, 1]).head(2)
        Trace(source='', num_requests=2, duration_s=1.000, without hash_ids)
        """
        return self[: check_int(n, "n", min_value=0)]

    def time_scaled(self, factor: float) -> Trace:
        """The same requests with every arrival time multiplied by ``factor``.

        ``factor < 1`` compresses the trace (a higher request rate), ``factor > 1`` stretches it.
        Lengths, ids and hash ids are unchanged.

        Runtime complexity: O(n).
        """
        factor = check_real(factor, "factor", min_value=0.0, strict_min=True)
        return dataclasses.replace(self, arrival_s=self.arrival_s * factor)

    def with_cached_tokens(self, cached_tokens: Any) -> Trace:
        """The same trace with ``cached_tokens`` replaced (validated like the constructor)."""
        return dataclasses.replace(self, cached_tokens=cached_tokens)

    def hash_ids_of(self, i: int) -> np.ndarray:
        """Prefix-block ids of the ``i``-th request (position, not ``request_id``).

        Raises
        ------
        ValueError
            The trace has no hash ids.
        """
        if self.hash_ids is None or self.hash_offsets is None:
            raise ValueError(f"trace {self.source!r} has no hash_ids")
        i = check_int(i, "i", min_value=-len(self), max_value=len(self) - 1) % len(self)
        return self.hash_ids[self.hash_offsets[i] : self.hash_offsets[i + 1]]

    def summary(
        self, *, bucket_edges_tokens: tuple[int, ...] = BUCKET_EDGES_TOKENS
    ) -> TraceSummary:
        """Counts, rate, length percentiles and the share of requests and tokens per bucket.

        Runtime complexity: O(n log n) (percentiles).
        """
        edges = check_edges(bucket_edges_tokens, "bucket_edges_tokens", allow_empty=True)
        n = len(self)
        duration = float(self.arrival_s[-1] - self.arrival_s[0]) if n else 0.0
        total = self.total_tokens
        bucket = np.searchsorted(np.asarray(edges), total, side="right")
        counts = np.bincount(bucket, minlength=len(edges) + 1)
        tokens = np.bincount(bucket, weights=total, minlength=len(edges) + 1)
        token_sum = int(total.sum())
        return TraceSummary(
            source=self.source,
            num_requests=n,
            duration_s=duration,
            rate_per_s=n / duration if duration > 0 else math.nan,
            total_tokens=percentiles(total),
            output_tokens=percentiles(self.output_tokens),
            cached_share=float(self.cached_tokens.sum() / token_sum) if token_sum else 0.0,  # type: ignore[union-attr]
            bucket_labels=bucket_labels(edges),
            bucket_edges_tokens=edges,
            bucket_counts=tuple(int(c) for c in counts),
            bucket_request_shares=tuple(float(c / n) if n else 0.0 for c in counts),
            bucket_token_shares=tuple(float(t / token_sum) if token_sum else 0.0 for t in tokens),
        )


def _trace_iv(trace: Trace) -> dict[str, Any]:
    """Validate and normalise the fields of ``trace`` (returns the clean values)."""
    arrival = as_float_array(trace.arrival_s, "arrival_s", ndim=1, nonnegative=True)
    n = arrival.shape[0]
    if n > 1 and (np.diff(arrival) < 0).any():
        bad = int(np.flatnonzero(np.diff(arrival) < 0)[0]) + 1
        raise ValueError(
            f"arrival_s: must be non-decreasing (index {bad}: {arrival[bad]} < {arrival[bad - 1]})"
        )
    total = as_int_array(trace.total_tokens, "total_tokens", shape=(n,), min_value=1)
    output = as_int_array(trace.output_tokens, "output_tokens", shape=(n,), min_value=1)
    if trace.cached_tokens is None:
        cached = np.zeros(n, dtype=np.int64)
    else:
        cached = as_int_array(trace.cached_tokens, "cached_tokens", shape=(n,), min_value=0)
        if (cached > total).any():
            bad = int(np.flatnonzero(cached > total)[0])
            raise ValueError(
                f"cached_tokens: must be <= total_tokens (index {bad}: {cached[bad]} > "
                f"{total[bad]})"
            )
    if trace.request_id is None:
        ids = np.arange(n, dtype=np.int64)
    else:
        ids = as_int_array(trace.request_id, "request_id", shape=(n,), min_value=0)
        if np.unique(ids).size != n:
            raise ValueError("request_id: must be unique")
    if (trace.hash_ids is None) != (trace.hash_offsets is None):
        raise ValueError("hash_ids, hash_offsets: give both or neither")
    hash_ids = hash_offsets = None
    if trace.hash_ids is not None:
        hash_ids = as_int_array(trace.hash_ids, "hash_ids", ndim=1, min_value=0)
        hash_offsets = as_int_array(trace.hash_offsets, "hash_offsets", shape=(n + 1,))
        if hash_offsets[0] != 0 or hash_offsets[-1] != hash_ids.size:
            raise ValueError(
                f"hash_offsets: must start at 0 and end at len(hash_ids) = {hash_ids.size}, "
                f"got {hash_offsets[0]}..{hash_offsets[-1]}"
            )
        if (np.diff(hash_offsets) < 0).any():
            raise ValueError("hash_offsets: must be non-decreasing")
        hash_ids, hash_offsets = _readonly(hash_ids), _readonly(hash_offsets)
    if not isinstance(trace.source, str):
        raise TypeError(f"source: must be a str, got {type(trace.source).__name__}")
    return {
        "arrival_s": _readonly(arrival),
        "total_tokens": _readonly(total),
        "output_tokens": _readonly(output),
        "cached_tokens": _readonly(cached),
        "request_id": _readonly(ids),
        "hash_ids": hash_ids,
        "hash_offsets": hash_offsets,
    }


def sorted_trace(arrival, total, output, hash_ids, hash_offsets, order, name) -> Trace:
    """The trace of rows given in file order, put in the order ``order`` (a stable sort by time).

    ``hash_ids`` and ``hash_offsets`` (or ``None``) describe the rows in file order; request ids
    keep the file order.
    """
    unsorted = Trace(
        arrival_s=np.zeros(arrival.size),
        total_tokens=total,
        output_tokens=output,
        hash_ids=hash_ids,
        hash_offsets=hash_offsets,
        source=name,
    )
    picked = unsorted._take(order)
    return dataclasses.replace(picked, arrival_s=arrival[order])
