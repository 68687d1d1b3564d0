"""Shared foundation of lbkit: cost models, balance metrics and input validation.

``lbkit.core`` imports nothing from the balancers; :mod:`lbkit.prefill`, :mod:`lbkit.decode` and
:mod:`lbkit.eplb` build on it (a test enforces this layering).
"""

from lbkit.core.cost import PRESETS, CostFit, CostPreset, DecodeCost, QuadraticCost, preset
from lbkit.core.metrics import balance_efficiency, gpu_loads, imbalance, max_over_mean, moe_lb

__all__ = [
    "PRESETS",
    "CostFit",
    "CostPreset",
    "DecodeCost",
    "QuadraticCost",
    "balance_efficiency",
    "gpu_loads",
    "imbalance",
    "max_over_mean",
    "moe_lb",
    "preset",
]
