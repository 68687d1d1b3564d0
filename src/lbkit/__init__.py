"""lbkit: load-balancing algorithms for large-model serving.

Three balancers, each a set of pure decision functions plus a small stateful scheduler that a
router can embed:

- :mod:`lbkit.eplb`: expert-parallel load balancing with redundant experts, a drop-in for
  DeepSeek's ``rebalance_experts``.
- :mod:`lbkit.core`: cost models, balance metrics and input validation shared by the balancers.

Importing :mod:`lbkit` is cheap; subpackages are imported on demand. Call :func:`lbkit.warmup`
at router start-up to compile the numba kernels before the first decision.
"""

from lbkit._warmup import warmup

__version__ = "0.1.0"

__all__ = ["__version__", "warmup"]
