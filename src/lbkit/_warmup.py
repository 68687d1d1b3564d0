"""Compile every numba kernel ahead of the first decision."""

from __future__ import annotations

import argparse
import importlib
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["WarmupReport", "warmup"]

#: Kernel modules of each subpackage; each exposes a ``warmup()`` function.
_KERNEL_MODULES = {
    "core": ("_kernels",),
    "prefill": ("_kernels", "lockstep"),
    "decode": ("_kernels",),
    "eplb": ("greedy", "balanced", "_bound_kernels", "_replan_layer", "_replan_choice"),
    "sim": ("engine",),
}
_KERNEL_PACKAGES = tuple(_KERNEL_MODULES)


class WarmupReport(NamedTuple):
    """What :func:`warmup` made ready, and how long it took.

    Attributes
    ----------
    seconds : dict of str to float
        Wall clock per subpackage (for reporting only; decisions never read it).
    kernels : tuple of KernelEvent
        One ``(kernel, how, seconds, nested)`` per lbkit kernel made ready, in order: ``how``
        is ``"compiled"`` or ``"cache"`` (loaded from the disk cache); ``nested`` marks a kernel
        compiled or loaded for another one (its time is included in that one's). Kernels that
        were already compiled in this process are not listed.
    cache_dir : str or None
        The disk cache used (``None``: off).
    """

    seconds: dict[str, float]
    kernels: tuple[Any, ...]
    cache_dir: str | None

    @property
    def total_s(self) -> float:
        """Seconds spent in all subpackages."""
        return sum(self.seconds.values())

    def per_kernel(self, how: str | None = None) -> dict[str, float]:
        """Seconds per top-level kernel (not nested), optionally only those made ready ``how``."""
        out: dict[str, float] = {}
        for event in self.kernels:
            if not event.nested and (how is None or event.how == how):
                out[event.kernel] = out.get(event.kernel, 0.0) + event.seconds
        return out


def warmup(*, packages: tuple[str, ...] | None = None) -> WarmupReport:
    """Compile the numba kernels of lbkit's balancers (or load them from the disk cache).

    The first call of a numba kernel compiles it, which takes from tenths of a second (router
    kernels) to minutes (the EPLB planners, which until then run as plain Python; see
    :mod:`lbkit.core._jit`). A router calls ``warmup()`` once at start-up so that no decision
    pays for compilation; compiled kernels are kept in a disk cache, so that the next process
    on the machine loads them in about a second. Kernels run as plain Python when
    ``NUMBA_DISABLE_JIT=1``; ``warmup()`` is then cheap and harmless.

    Parameters
    ----------
    packages : tuple of str, optional
        Names of the subpackages to warm up (``"eplb"``, ``"prefill"``, ``"decode"``, ...).
        Default: every subpackage that has kernels.

    Returns
    -------
    WarmupReport
        Seconds per subpackage and one entry per kernel compiled or loaded.

    Raises
    ------
    ValueError
        If ``packages`` names an unknown subpackage.

    Runtime complexity: one compile of every kernel; about a second with a full disk cache.

    Examples
    --------
    >>> import lbkit
    >>> report = lbkit.warmup(packages=("eplb",))
    >>> sorted(report.seconds)
    ['eplb']
    >>> all(event.how in ("compiled", "cache") for event in report.kernels)
    True
    """
    names = _KERNEL_PACKAGES if packages is None else tuple(packages)
    unknown = [n for n in names if n not in _KERNEL_PACKAGES]
    if unknown:
        raise ValueError(
            f"packages: unknown subpackage(s) {unknown}; expected a subset of {_KERNEL_PACKAGES}"
        )
    jit = importlib.import_module("lbkit.core._jit")
    spent: dict[str, float] = {}
    with jit.record_kernels() as events:
        for name in names:
            start = time.perf_counter()
            found = False
            for kernels in _KERNEL_MODULES[name]:
                try:
                    module = importlib.import_module(f"lbkit.{name}.{kernels}")
                except ModuleNotFoundError as exc:
                    # A subpackage without kernels has nothing to compile.
                    if exc.name in (f"lbkit.{name}", f"lbkit.{name}.{kernels}"):
                        continue
                    raise
                module.warmup()
                found = True
            if found:
                spent[name] = time.perf_counter() - start
    return WarmupReport(spent, tuple(events), jit.cache_dir())


def main(argv: Sequence[str] | None = None) -> int:
    """Command line ``[--background] [PACKAGE ...]``: warm up and print a summary.

    ``--background`` is how an EPLB entry kernel fills the disk cache without blocking
    (:mod:`lbkit.core._jit`): low priority, one such process at a time per cache directory,
    silent.
    """
    parser = argparse.ArgumentParser(prog="lbkit._warmup")
    parser.add_argument("packages", nargs="*", metavar="PACKAGE")
    parser.add_argument("--background", action="store_true")
    args = parser.parse_args(argv)
    packages = tuple(args.packages) or None
    if not args.background:
        report = warmup(packages=packages)
        for kernel, seconds in sorted(report.per_kernel().items(), key=lambda kv: -kv[1]):
            print(f"{seconds:8.2f} s  {kernel}")
        print(f"{report.total_s:8.2f} s  total (disk cache: {report.cache_dir})")
        return 0
    jit = importlib.import_module("lbkit.core._jit")
    if hasattr(os, "nice"):
        os.nice(10)
    with jit.file_lock("compile.lock") as held:
        if held:
            warmup(packages=packages)
    return 0
