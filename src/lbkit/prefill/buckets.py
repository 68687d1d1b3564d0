"""Length buckets of prefill requests.

A request belongs to bucket ``j`` when ``edges[j-1] <= total_tokens < edges[j]`` (lower edge
inclusive), with ``edges[-1] = 0`` and ``edges[len(edges)] = +inf`` implied: ``len(edges) + 1``
buckets in all. The default edges ``(16384, 65536, 262144)`` give four buckets: below 16K, 16K to
64K, 64K to 256K, and 256K or more.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.core.validation import as_int_array

__all__ = ["DEFAULT_EDGES", "bucket_of", "check_edges"]

#: Default bucket edges in tokens (16K, 64K, 256K): four buckets.
DEFAULT_EDGES: tuple[int, ...] = (16384, 65536, 262144)


def check_edges(edges: Any, name: str = "edges", *, allow_empty: bool = False) -> tuple[int, ...]:
    """Validate bucket edges: a strictly increasing sequence of positive integers, non-empty
    unless ``allow_empty`` (no edges: one bucket holds every request).

    Returns
    -------
    tuple of int
        The edges, as Python integers.

    Examples
    --------
    >>> check_edges([1000, 8000])
    (1000, 8000)
    >>> check_edges([1000, 1000])
    Traceback (most recent call last):
    ...
    ValueError: edges: must be strictly increasing, got [1000, 1000]
    """
    arr = as_int_array(edges, name, ndim=1, allow_empty=allow_empty)
    if (arr <= 0).any():
        raise ValueError(f"{name}: must be positive, got {arr.tolist()}")
    if (np.diff(arr) <= 0).any():
        raise ValueError(f"{name}: must be strictly increasing, got {arr.tolist()}")
    return tuple(int(e) for e in arr)


def bucket_of(total_tokens: Any, /, *, edges: Any = DEFAULT_EDGES) -> Any:
    """Bucket index of each request, by its total prompt length.

    Parameters
    ----------
    total_tokens : int or array_like of int, any shape
        Prompt length including the cached prefix, tokens (>= 0).
    edges : sequence of int, default ``DEFAULT_EDGES``
        Strictly increasing positive bucket edges; lower edge inclusive.

    Returns
    -------
    int or ndarray of int64 (same shape as ``total_tokens``)
        Bucket index in ``0 .. len(edges)``.

    Raises
    ------
    ValueError
        Negative or non-integer token counts, or invalid edges.

    Runtime complexity: O(n log(len(edges))).

    Examples
    --------
    >>> bucket_of([100, 16383, 16384, 70000, 300000])
    array([0, 0, 1, 2, 3])
    >>> bucket_of(5000, edges=(4096,))
    1
    """
    e = np.asarray(check_edges(edges), dtype=np.int64)
    t = as_int_array(total_tokens, "total_tokens", min_value=0)
    out = np.searchsorted(e, t, side="right").astype(np.int64)
    return int(out) if out.ndim == 0 else out
