"""Threads over layers: the layers of an EPLB plan are independent, and the compiled kernels
release the GIL (``numba.njit(nogil=True)``), so contiguous blocks of layers can be planned on
threads with the same results as one loop."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any, TypeVar

from lbkit.core.validation import check_int

__all__ = [
    "BLOCKS_PER_WORKER",
    "available_cpus",
    "layer_blocks",
    "on_blocks",
    "resolve_workers",
    "thread_map",
]

T = TypeVar("T")
R = TypeVar("R")

#: Blocks of layers per thread: more blocks than threads even out layers of unequal cost.
BLOCKS_PER_WORKER = 4


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)  # pragma: no cover - platforms without affinity


def resolve_workers(workers: Any, layers: int) -> int:
    """``workers`` checked (an integer of at least 1; ``None``: :func:`available_cpus`) and
    capped at ``layers``.

    Examples
    --------
    >>> resolve_workers(3, 2), resolve_workers(1, 58)
    (2, 1)
    """
    if workers is None:
        workers = available_cpus()
    return max(1, min(check_int(workers, "workers", min_value=1), layers))


def layer_blocks(layers: int, workers: int) -> list[slice]:
    """Contiguous blocks covering ``range(layers)`` in order: one block for one worker,
    otherwise up to ``BLOCKS_PER_WORKER * workers`` blocks whose sizes differ by at most one.

    Examples
    --------
    >>> layer_blocks(5, 1)
    [slice(0, 5, None)]
    >>> layer_blocks(5, 2)
    [slice(0, 1, None), slice(1, 2, None), slice(2, 3, None), slice(3, 4, None), slice(4, 5, None)]
    """
    if workers <= 1 or layers <= 1:
        return [slice(0, layers)]
    count = min(layers, BLOCKS_PER_WORKER * workers)
    bounds = [layers * k // count for k in range(count + 1)]
    return [slice(a, b) for a, b in pairwise(bounds)]


def thread_map(func: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``[func(x) for x in items]``, on ``workers`` threads when there are several threads and
    items; results in order.

    Examples
    --------
    >>> thread_map(abs, [-1, 2, -3], 2)
    [1, 2, 3]
    """
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [func(x) for x in items]
    with ThreadPoolExecutor(min(workers, len(items))) as pool:
        return list(pool.map(func, items))


def on_blocks(func: Callable[[slice], None], layers: int, workers: int) -> None:
    """Call ``func`` on every block of :func:`layer_blocks` (on ``workers`` threads when there
    are several); ``func`` must write only its own layers."""
    thread_map(func, layer_blocks(layers, workers), workers)
