"""lbkit: load-balancing algorithms for large-model serving.

Three balancers, each a set of pure decision functions plus a small stateful scheduler that a
router can embed:

- :mod:`lbkit.eplb`: expert-parallel load balancing with redundant experts, a drop-in for
  DeepSeek's ``rebalance_experts``.
- :mod:`lbkit.core`: cost models, balance metrics and input validation shared by the balancers.

Importing :mod:`lbkit` is cheap; subpackages are imported on demand. Call :func:`lbkit.warmup`
at router start-up to compile the numba kernels (or load them from the disk cache) before the
first decision; it returns a :class:`WarmupReport`.
"""

from lbkit._warmup import WarmupReport, warmup

__version__ = "0.1.0"

__all__ = ["WarmupReport", "__version__", "warmup"]
