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

The container lives in :mod:`lbkit.sim._trace_container` (with its summary in
:mod:`lbkit.sim._trace_summary`) and the readers in :mod:`lbkit.sim._trace_readers`; this module
detects the format and is where every name is imported from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lbkit.core.validation import check_choice
from lbkit.sim._trace_container import Trace
from lbkit.sim._trace_readers import AZURE_COLUMNS as AZURE_COLUMNS
from lbkit.sim._trace_readers import (
    MAX_TIMESTAMP_MS,
    MAX_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    SPREADS,
    load_azure,
    load_mooncake,
)
from lbkit.sim._trace_summary import BUCKET_EDGES_TOKENS, Percentiles, TraceSummary, bucket_labels

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

#: Trace formats understood by :func:`load_trace`.
FORMATS: tuple[str, ...] = ("mooncake", "azure")


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
