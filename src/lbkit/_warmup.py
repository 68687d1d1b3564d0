"""Compile every numba kernel ahead of the first routing decision."""

from __future__ import annotations

import importlib
import time

__all__ = ["warmup"]

#: Kernel modules of each subpackage; each exposes a ``warmup()`` function.
_KERNEL_MODULES = {
    "core": ("_kernels",),
    "prefill": ("_kernels", "lockstep"),
    "decode": ("_kernels",),
    "eplb": ("_kernels", "_replan_kernels"),
    "sim": ("engine",),
}
_KERNEL_PACKAGES = tuple(_KERNEL_MODULES)


def warmup(*, packages: tuple[str, ...] | None = None) -> dict[str, float]:
    """Compile the numba kernels of lbkit's balancers.

    The first call of a numba kernel compiles it, which takes from tenths of a second to a few
    seconds. A router calls ``warmup()`` once at start-up so that no routing decision pays for
    compilation. Kernels run as plain Python when ``NUMBA_DISABLE_JIT=1``; ``warmup()`` is then
    cheap and harmless.

    Parameters
    ----------
    packages : tuple of str, optional
        Names of the subpackages to warm up (``"eplb"``, ``"prefill"``, ``"decode"``, ...).
        Default: every subpackage that has kernels.

    Returns
    -------
    dict of str to float
        Seconds spent per subpackage (wall clock, for reporting only; decisions never read it).

    Raises
    ------
    ValueError
        If ``packages`` names an unknown subpackage.

    Examples
    --------
    >>> import lbkit
    >>> seconds = lbkit.warmup(packages=("eplb",))
    >>> sorted(seconds)
    ['eplb']
    """
    names = _KERNEL_PACKAGES if packages is None else tuple(packages)
    unknown = [n for n in names if n not in _KERNEL_PACKAGES]
    if unknown:
        raise ValueError(
            f"packages: unknown subpackage(s) {unknown}; expected a subset of {_KERNEL_PACKAGES}"
        )
    spent: dict[str, float] = {}
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
    return spent
