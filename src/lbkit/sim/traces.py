"""Request traces: the :class:`Trace` container and readers for public trace formats.

A trace is a table of requests sorted by arrival. Two public formats are read:

- **Mooncake JSONL** (:func:`load_mooncake`): one JSON object per line with ``timestamp``
  (milliseconds), ``input_length``, ``output_length`` and optionally ``hash_ids`` (ids of
  512-token prefix blocks; equal ids mean a reusable prefix).
- **Azure LLM inference CSV** (:func:`load_azure`): header ``TIMESTAMP,ContextTokens,
  GeneratedTokens`` with wall-clock timestamps of 100-ns resolution.

:func:`load_trace` detects the format. Every reader reports a malformed line as
``"<file>: line <n>: <field>: <rule>, got <value>"``; a file that is missing, a directory, or not
UTF-8 text is reported with its name. The readers refuse numbers they cannot hold exactly: token
counts above :data:`MAX_TOKENS`, Mooncake timestamps above :data:`MAX_TIMESTAMP_MS` and block ids
beyond int64.

Request invariants (checked whenever a :class:`Trace` is built):

- ``arrival_s`` finite, ``>= 0`` and non-decreasing (ties keep file order);
- ``total_tokens >= 1`` (a prompt has at least one token);
- ``0 <= cached_tokens <= total_tokens``;
- ``output_tokens >= 1``: prefill itself produces the first output token, so every request that
  is served yields at least one token (traces whose requests produce nothing are not supported);
- ``request_id`` non-negative and unique.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections.abc import Mapping
from datetime import date
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import (
    as_float_array,
    as_int_array,
    as_rng,
    check_choice,
    check_int,
    check_real,
)
from lbkit.prefill.buckets import DEFAULT_EDGES, check_edges

__all__ = [
    "BUCKET_EDGES_TOKENS",
    "FORMATS",
    "MAX_TIMESTAMP_MS",
    "MAX_TOKENS",
    "MOONCAKE_BLOCK_TOKENS",
    "SPREADS",
    "Percentiles",
    "Trace",
    "TraceSummary",
    "bucket_labels",
    "load_azure",
    "load_mooncake",
    "load_trace",
]

#: Default bucket edges by ``total_tokens`` (lower edge inclusive): 16K, 64K, 256K, those of
#: :data:`lbkit.prefill.DEFAULT_EDGES`.
BUCKET_EDGES_TOKENS: tuple[int, ...] = DEFAULT_EDGES
#: Trace formats understood by :func:`load_trace`.
FORMATS: tuple[str, ...] = ("mooncake", "azure")
#: Ways to place requests that share a quantised Mooncake timestamp (see :func:`load_mooncake`).
SPREADS: tuple[str, ...] = ("none", "even", "uniform")
#: Tokens per prefix block in Mooncake's ``hash_ids``.
MOONCAKE_BLOCK_TOKENS = 512
#: Largest input or output length the readers accept, 2**40 (about 1.1e12) tokens: far beyond any
#: context window, and small enough that sums over millions of requests stay exact in int64.
MAX_TOKENS = 2**40
#: Largest Mooncake timestamp, 2**53 ms (about 285,000 years): integers up to it are exact in
#: float64, so differences of timestamps are exact.
MAX_TIMESTAMP_MS = 2**53
_INT64_MAX = 2**63 - 1

AZURE_COLUMNS: tuple[str, ...] = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TICKS_PER_S = 10_000_000  # Azure timestamps have 100-ns resolution (7 decimals)
_AZURE_TIME = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,7}))?\s*\Z", re.ASCII
)


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


def _percentiles(values: np.ndarray) -> Percentiles:
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
            total_tokens=_percentiles(total),
            output_tokens=_percentiles(self.output_tokens),
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


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------


def _read_lines(path: str | Path) -> tuple[Path, list[str]]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path.name}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        raise ValueError(f"{path.name}: empty file (no requests)")
    return path, lines


def _bad(name: str, lineno: int, field: str, rule: str, value: Any) -> ValueError:
    return ValueError(f"{name}: line {lineno}: {field}: {rule}, got {_shorten(value)}")


def _shorten(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive_int(value: Any, name: str, lineno: int, field: str) -> int:
    if type(value) is not int or value < 1:  # bool is not an int here
        raise _bad(name, lineno, field, "must be a positive integer", value)
    if value > MAX_TOKENS:
        raise _bad(name, lineno, field, f"must be at most 2**40 = {MAX_TOKENS:,} tokens", value)
    return value


def load_mooncake(
    path: str | Path,
    /,
    *,
    spread: str = "none",
    slot_s: float | None = None,
    rng: Any = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """Read a Mooncake JSONL trace.

    Each non-blank line is a JSON object with ``timestamp`` (arrival in milliseconds, a
    non-negative number), ``input_length`` and ``output_length`` (positive integers) and
    optionally ``hash_ids`` (non-negative integers, one per ``block_tokens`` block of the prompt,
    so ``len(hash_ids) == ceil(input_length / block_tokens)``; present on every line or on none).
    Requests are numbered ``0..n-1`` in file order; if the file is not sorted by timestamp, it
    is sorted stably (ids keep the file order). Arrivals become seconds since the earliest
    timestamp.

    Mooncake quantises timestamps to slots about 3 s apart with about 10 requests per slot.
    ``spread`` chooses how requests sharing a timestamp are placed in their slot:

    - ``"none"``: all at the slot's timestamp (a batch every 3 s);
    - ``"even"``: the ``k`` requests of a slot of width ``w`` at ``t + j·w/k``, ``j = 0..k-1``,
      in file order;
    - ``"uniform"``: ``k`` uniform draws in ``[t, t + w)`` from ``rng``, sorted and given to the
      requests in file order (the same arrival times as independent draws; file order kept).

    The slot width ``w`` is the gap to the next distinct timestamp (the median gap for the last
    slot); ``slot_s`` caps it (and sets the last slot's width), so a spread never reorders slots.

    Parameters
    ----------
    path : str or Path
    spread : {"none", "even", "uniform"}, default "none"
    slot_s : float, optional
        Slot width in seconds (only with a spread); default: inferred as above.
    rng : numpy Generator, int seed or None
        Randomness for ``spread="uniform"`` (``None`` means seed 0).
    block_tokens : int, default 512
        Tokens per prefix block of ``hash_ids``.

    Returns
    -------
    Trace
        With ``hash_ids`` when the file has them; ``source`` is the file name.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        Empty file, malformed JSON, missing or invalid field (the message names the file, the
        line and the field), or a bad option.

    Runtime complexity: O(lines + hash ids); about 0.1 s for the 12,031-line Mooncake trace.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.jsonl")
    >>> with open(p, "w") as f:
    ...     _ = f.write('{"timestamp": 0, "input_length": 600, "output_length": 5, '
    ...                 '"hash_ids": [0, 1]}\\n'
    ...                 '{"timestamp": 0, "input_length": 700, "output_length": 9, '
    ...                 '"hash_ids": [0, 2]}\\n'
    ...                 '{"timestamp": 3000, "input_length": 100, "output_length": 1, '
    ...                 '"hash_ids": [3]}\\n')
    >>> t = load_mooncake(p, spread="even")
    >>> t.arrival_s.tolist(), t.total_tokens.tolist(), t.hash_ids_of(1).tolist()
    ([0.0, 1.5, 3.0], [600, 700, 100], [0, 2])
    """
    spread = check_choice(spread, "spread", SPREADS)
    block_tokens = check_int(block_tokens, "block_tokens", min_value=1)
    if slot_s is not None:
        if spread == "none":
            raise ValueError("slot_s: only used with spread='even' or 'uniform'")
        slot_s = check_real(slot_s, "slot_s", min_value=0.0, strict_min=True)
    path, lines = _read_lines(path)
    name = path.name
    stamps: list[int | float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    hash_flat: list[int] = []
    hash_counts: list[int] = []
    has_hashes: bool | None = None
    first_line = 0
    loads = json.loads
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{name}: line {lineno}: malformed JSON ({exc.msg} at column {exc.colno})"
            ) from None
        except RecursionError:
            raise ValueError(f"{name}: line {lineno}: JSON nested too deeply") from None
        except ValueError:  # an integer of more than 4300 digits
            raise ValueError(
                f"{name}: line {lineno}: a number with more than 4300 digits"
            ) from None
        if type(rec) is not dict:
            raise ValueError(
                f"{name}: line {lineno}: expected a JSON object, got {type(rec).__name__}"
            )
        for field in ("timestamp", "input_length", "output_length"):
            if field not in rec:
                raise ValueError(f"{name}: line {lineno}: missing field {field!r}")
        stamp = rec["timestamp"]
        if type(stamp) not in (int, float) or not (0 <= stamp < math.inf):
            raise _bad(name, lineno, "timestamp", "must be a non-negative number of ms", stamp)
        if stamp > MAX_TIMESTAMP_MS:
            raise _bad(name, lineno, "timestamp", "must be at most 2**53 ms", stamp)
        length = _positive_int(rec["input_length"], name, lineno, "input_length")
        outputs.append(_positive_int(rec["output_length"], name, lineno, "output_length"))
        if has_hashes is None:
            has_hashes, first_line = "hash_ids" in rec, lineno
        elif has_hashes != ("hash_ids" in rec):
            state = "present" if has_hashes else "absent"
            raise ValueError(
                f"{name}: line {lineno}: hash_ids: must be on every line or on none "
                f"({state} on line {first_line})"
            )
        if has_hashes:
            ids = rec["hash_ids"]
            if type(ids) is not list or not all(type(v) is int and v >= 0 for v in ids):
                raise _bad(name, lineno, "hash_ids", "must be a list of non-negative integers", ids)
            if ids and max(ids) > _INT64_MAX:
                raise _bad(name, lineno, "hash_ids", "ids must be at most 2**63 - 1", max(ids))
            want = -(-length // block_tokens)
            if len(ids) != want:
                raise ValueError(
                    f"{name}: line {lineno}: hash_ids: must hold ceil(input_length / "
                    f"{block_tokens}) = {want} block ids, got {len(ids)}"
                )
            hash_flat.extend(ids)
            hash_counts.append(want)
        stamps.append(stamp)
        inputs.append(length)

    stamp_arr = np.array(stamps)
    order = None
    if stamp_arr.size > 1 and (np.diff(stamp_arr) < 0).any():
        order = np.argsort(stamp_arr, kind="stable")
    start = stamp_arr.min()
    arrival = (stamp_arr - start) / 1000.0  # integer ms minus integer ms is exact
    total = np.array(inputs, dtype=np.int64)
    output = np.array(outputs, dtype=np.int64)
    hash_ids = hash_offsets = None
    if has_hashes:
        hash_ids = np.array(hash_flat, dtype=np.int64)
        hash_offsets = np.zeros(total.size + 1, dtype=np.int64)
        np.cumsum(hash_counts, out=hash_offsets[1:])
    if order is None:
        trace = Trace(
            arrival_s=arrival,
            total_tokens=total,
            output_tokens=output,
            hash_ids=hash_ids,
            hash_offsets=hash_offsets,
            source=name,
        )
    else:
        trace = _sorted_trace(arrival, total, output, hash_ids, hash_offsets, order, name)
    if spread == "none":
        return trace
    return dataclasses.replace(
        trace, arrival_s=_spread(trace.arrival_s, spread=spread, slot_s=slot_s, rng=rng)
    )


def _sorted_trace(arrival, total, output, hash_ids, hash_offsets, order, name) -> Trace:
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


def _spread(arrival: np.ndarray, *, spread: str, slot_s: float | None, rng: Any) -> np.ndarray:
    """Spread requests that share an arrival time over their slot (see :func:`load_mooncake`)."""
    n = arrival.size
    starts = np.flatnonzero(np.r_[True, arrival[1:] != arrival[:-1]])
    sizes = np.diff(np.r_[starts, n])
    times = arrival[starts]
    gaps = np.diff(times)
    if slot_s is None:
        if gaps.size == 0:
            raise ValueError(
                "slot_s: cannot infer the slot width from a single distinct timestamp; pass slot_s"
            )
        width = np.r_[gaps, np.median(gaps)]
    else:
        width = np.minimum(np.r_[gaps, np.inf], slot_s)
    group = np.repeat(np.arange(starts.size), sizes)
    if spread == "even":
        fraction = (np.arange(n) - starts[group]) / sizes[group]
    else:
        draws = as_rng(rng).random(n)
        fraction = draws[np.lexsort((draws, group))]  # sorted within each slot
    out = times[group] + fraction * width[group]
    # Rounding can push a late draw onto the next slot's start; keep the order exact.
    return np.maximum.accumulate(out)


def load_azure(path: str | Path, /) -> Trace:
    """Read an Azure LLM inference trace (CSV, 2023 or 2024 releases).

    The header must name ``TIMESTAMP``, ``ContextTokens`` and ``GeneratedTokens`` (other columns
    are ignored). ``TIMESTAMP`` reads ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (up to 7 decimals, i.e.
    100-ns ticks; no time zone). Times are converted to integer ticks and then to seconds since
    the earliest row, ``(ticks - ticks_min) / 1e7``, which is the correctly rounded float of the
    exact difference (no accumulated drift). Rows are numbered ``0..n-1`` in file order and
    sorted stably by time if needed. ``ContextTokens`` becomes ``total_tokens``,
    ``GeneratedTokens`` becomes ``output_tokens``; there are no hash ids.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        Empty file, wrong header, wrong number of columns, bad timestamp, non-positive or
        non-integer counts (the message names the file, the line and the column).

    Runtime complexity: O(rows); about 0.05 s for the 19,366-row conversation trace.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.csv")
    >>> with open(p, "w") as f:
    ...     _ = f.write("TIMESTAMP,ContextTokens,GeneratedTokens\\n"
    ...                 "2023-11-16 18:15:46.6805900,374,44\\n"
    ...                 "2023-11-16 18:15:50.9951690,396,109\\n")
    >>> t = load_azure(p)
    >>> t.arrival_s.tolist(), t.total_tokens.tolist(), t.output_tokens.tolist()
    ([0.0, 4.314579], [374, 396], [44, 109])
    """
    path, lines = _read_lines(path)
    name = path.name
    first = next(i for i, line in enumerate(lines) if line.strip())
    columns = [c.strip() for c in lines[first].split(",")]
    missing = [c for c in AZURE_COLUMNS if c not in columns]
    if missing:
        raise ValueError(
            f"{name}: line {first + 1}: header must name columns {', '.join(AZURE_COLUMNS)}; "
            f"missing {', '.join(missing)} in {lines[first].strip()[:80]!r}"
        )
    width = len(columns)
    i_time, i_ctx, i_gen = (columns.index(c) for c in AZURE_COLUMNS)
    days_of: dict[str, int] = {}
    ticks: list[int] = []
    contexts: list[int] = []
    generated: list[int] = []
    match = _AZURE_TIME.match
    for lineno in range(first + 2, len(lines) + 1):
        line = lines[lineno - 1]
        if not line.strip():
            continue
        fields = line.split(",")
        if len(fields) != width:
            raise ValueError(f"{name}: line {lineno}: expected {width} columns, got {len(fields)}")
        stamp = fields[i_time].strip()
        m = match(stamp)
        if m is None:
            raise _bad(name, lineno, "TIMESTAMP", "must read YYYY-MM-DD HH:MM:SS[.fffffff]", stamp)
        day, hh, mm, ss, frac = m.groups()
        if day not in days_of:
            try:
                days_of[day] = date.fromisoformat(day).toordinal()
            except ValueError:
                raise _bad(name, lineno, "TIMESTAMP", "has an invalid date", stamp) from None
        h, mi, s = int(hh), int(mm), int(ss)
        if h > 23 or mi > 59 or s > 59:
            raise _bad(name, lineno, "TIMESTAMP", "has an invalid time of day", stamp)
        seconds = (days_of[day] * 24 + h) * 3600 + mi * 60 + s
        ticks.append(seconds * _TICKS_PER_S + (int(frac.ljust(7, "0")) if frac else 0))
        contexts.append(_csv_count(fields[i_ctx], name, lineno, "ContextTokens"))
        generated.append(_csv_count(fields[i_gen], name, lineno, "GeneratedTokens"))
    if not ticks:
        raise ValueError(f"{name}: no data rows after the header")
    tick_arr = np.array(ticks, dtype=np.int64)
    # int64 difference is exact; its float64 conversion is exact below 2**53 ticks (28 years).
    arrival = (tick_arr - tick_arr.min()) / _TICKS_PER_S
    total = np.array(contexts, dtype=np.int64)
    output = np.array(generated, dtype=np.int64)
    if tick_arr.size > 1 and (np.diff(tick_arr) < 0).any():
        return _sorted_trace(
            arrival, total, output, None, None, np.argsort(tick_arr, kind="stable"), name
        )
    return Trace(arrival_s=arrival, total_tokens=total, output_tokens=output, source=name)


def _csv_count(text: str, name: str, lineno: int, field: str) -> int:
    text = text.strip()
    try:
        value = int(text)
    except ValueError:
        raise _bad(name, lineno, field, "must be a positive integer", text) from None
    if value < 1:
        raise _bad(name, lineno, field, "must be a positive integer", value)
    if value > MAX_TOKENS:
        raise _bad(name, lineno, field, f"must be at most 2**40 = {MAX_TOKENS:,} tokens", value)
    return value


_LOADERS: Mapping[str, Any] = {"mooncake": load_mooncake, "azure": load_azure}


def detect_format(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(4096).decode("utf-8-sig", errors="replace")
    first = next((line.strip() for line in head.splitlines() if line.strip()), "")
    if first.startswith("{"):
        return "mooncake"
    if "TIMESTAMP" in first.split(",")[0].upper() or "ContextTokens" in first:
        return "azure"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    raise ValueError(
        f"{path.name}: cannot tell the trace format from suffix {path.suffix!r} or first line "
        f"{first[:40]!r}; pass format='mooncake' or format='azure'"
    )


def load_trace(path: str | Path, /, *, format: str | None = None, **options: Any) -> Trace:
    """Read a trace file in any supported format.

    The format is taken from ``format`` or detected: a first line that is a JSON object means
    Mooncake, a CSV header with ``TIMESTAMP`` means Azure; otherwise the suffix decides
    (``.jsonl``/``.json``/``.ndjson`` Mooncake, ``.csv`` Azure).

    Parameters
    ----------
    path : str or Path
    format : {"mooncake", "azure"}, optional
    **options
        Passed to the reader (e.g. ``spread="even"`` for Mooncake).

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ValueError
        Unknown ``format`` (the message lists the allowed ones), ``path`` is not a regular
        file, undetectable format, or any error of the reader.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "requests.log")
    >>> with open(p, "w") as f:
    ...     _ = f.write('{"timestamp": 5, "input_length": 10, "output_length": 2}\\n')
    >>> load_trace(p).total_tokens.tolist()
    [10]
    >>> load_trace(p, format="parquet")
    Traceback (most recent call last):
    ...
    ValueError: format: must be one of 'mooncake', 'azure'; got 'parquet'
    """
    if format is not None:
        format = check_choice(format, "format", FORMATS)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    fmt = format if format is not None else detect_format(path)
    return _LOADERS[fmt](path, **options)
