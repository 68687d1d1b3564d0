"""Shared Hypothesis strategies for the EPLB tests: small but realistic instances."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

__all__ = ["instances", "loads", "tie_free_loads"]


@st.composite
def loads(draw, layers: int, experts: int, *, zeros: bool = True) -> np.ndarray:
    """Expert loads: lognormal (skew 0.3 to 2), power law, or integer token counts."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["lognormal", "zipf", "tokens"]))
    if kind == "lognormal":
        w = rng.lognormal(0.0, draw(st.floats(0.3, 2.0)), (layers, experts)) * 100
    elif kind == "zipf":
        a = draw(st.floats(0.4, 1.5))
        w = np.stack([rng.permutation(np.arange(1, experts + 1) ** -a) for _ in range(layers)])
        w = w * 1000
    else:
        w = rng.integers(0, 5000, (layers, experts)).astype(np.float64)
    if zeros and draw(st.booleans()):
        w[rng.random((layers, experts)) < 0.15] = 0.0
    if draw(st.integers(0, 9)) == 0:
        w[0] = 0.0  # an idle layer
    return w


@st.composite
def tie_free_loads(draw, layers: int, experts: int) -> np.ndarray:
    """Distinct float32-representable loads, far from one another (no ties in either dtype)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, draw(st.floats(0.3, 2.0)), (layers, experts)) * 1000
    return w.astype(np.float32).astype(np.float64)


@st.composite
def instances(draw, *, max_layers: int = 3, policy: str | None = "any", tie_free: bool = False):
    """``(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)``.

    ``policy="any"`` draws global or (when the sizes allow) hierarchical.
    """
    layers = draw(st.integers(1, max_layers))
    num_nodes = draw(st.sampled_from([1, 1, 2, 3, 4]))
    groups_per_node = draw(st.integers(1, 3))
    num_groups = num_nodes * groups_per_node
    group_size = draw(st.integers(1, 4))
    experts = num_groups * group_size
    gpus_per_node = draw(st.integers(1, 4))
    num_gpus = num_nodes * gpus_per_node
    slots = draw(st.integers(max(1, -(-experts // num_gpus)), max(1, -(-experts // num_gpus)) + 3))
    num_replicas = slots * num_gpus
    if policy == "any":
        policy = draw(st.sampled_from(["global", "hierarchical"]))
    weight = draw(tie_free_loads(layers, experts) if tie_free else loads(layers, experts))
    return weight, num_replicas, num_groups, num_nodes, num_gpus, policy
