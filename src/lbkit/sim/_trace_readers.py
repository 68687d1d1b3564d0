"""Readers of the public trace formats: Mooncake JSONL and Azure LLM inference CSV.

Part of :mod:`lbkit.sim.traces` (import the readers from there), whose docstring describes the
formats, the error messages and the limits the readers enforce.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from lbkit.core.validation import as_rng, check_choice, check_int, check_real
from lbkit.sim._trace_container import Trace, sorted_trace

__all__ = [
    "AZURE_COLUMNS",
    "MAX_TIMESTAMP_MS",
    "MAX_TOKENS",
    "MOONCAKE_BLOCK_TOKENS",
    "SPREADS",
    "load_azure",
    "load_mooncake",
]

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
        trace = sorted_trace(arrival, total, output, hash_ids, hash_offsets, order, name)
    if spread == "none":
        return trace
    return dataclasses.replace(
        trace, arrival_s=_spread(trace.arrival_s, spread=spread, slot_s=slot_s, rng=rng)
    )


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
        return sorted_trace(
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
