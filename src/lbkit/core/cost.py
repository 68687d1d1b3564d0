"""Step-cost models of prefill and decode ranks.

A prefill rank that runs chunks ``c_i`` (new tokens) on top of prefixes ``p_i`` (tokens already
in KV cache) in one step has *local* work

.. math::

    L = \\sum_i \\left(b c_i + k c_i p_i + q c_i^2 + \\gamma p_i\\right)

seconds: linear work ``b`` per token on the rank's own tokens (MLA projections, norms, shared
expert, dense layers), attention ``k`` per (new, cached) token pair and ``q`` per new-token pair,
and an optional cost ``gamma`` per cached token read. Causal attention gives the physical tie
``q = k/2``; under it the local work of a request does not depend on how it is chunked, which is
what makes its *quota* (local work) a property of the request.

The routed experts of an expert-parallel MoE run on the tokens of *every* rank of the engine
(all-to-all), balanced by EPLB, not by the router: a rank of an engine of ``R`` ranks pays
``shared = b_moe * moe_lb * sum_r C_r / R`` per step, ``C_r`` being the tokens rank ``r`` runs.
Rank ``r`` takes ``T_r = a + L_r + shared`` (``a``: fixed cost of a step) and the engine's
synchronous step takes ``max_r T_r``. With ``b_moe = 0`` (the default) this is the plain model
``a + L``.

A decode rank with ``B`` requests holding ``S`` KV tokens has local work ``b_d*B + k_d*S``
(``combine="sum"``) or ``max(b_d*B, k_d*S)`` (``combine="max"``: two micro-batches overlap
attention with MoE and communication), and pays ``b_d_moe * moe_lb * sum_r B_r / R`` shared.

The prefill model is :class:`QuadraticCost` (in :mod:`lbkit.core._prefill_cost`), the decode
model :class:`DecodeCost` (in :mod:`lbkit.core._decode_cost`); this module holds the built-in
presets and is where every name is imported from.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from lbkit.core._decode_cost import DecodeCost
from lbkit.core._fit import CostFit
from lbkit.core._prefill_cost import QuadraticCost
from lbkit.core.validation import check_choice

__all__ = [
    "PRESETS",
    "CostFit",
    "CostPreset",
    "DecodeCost",
    "QuadraticCost",
    "preset",
]


class CostPreset(NamedTuple):
    """A named pair of prefill and decode cost models."""

    prefill: QuadraticCost
    decode: DecodeCost


#: Built-in cost presets. ``h800_dsv3`` is *derived* from public DeepSeek-V3 hyper-parameters and
#: published throughput (per GPU), not measured: the linear cost is split into local ``b`` and
#: shared routed-expert ``b_moe`` in proportion to the work per token of each part, with
#: ``moe_lb`` measured by :func:`lbkit.eplb.rebalance_experts` on SGLang's DeepSeek-V3 expert
#: loads (docs/cost-model.md has the derivation); replace it by :meth:`QuadraticCost.fit` on your
#: own step timings. ``unit`` has round numbers for tests (attention overtakes linear work at
#: 2,000 tokens) and no shared cost.
PRESETS: Mapping[str, CostPreset] = MappingProxyType(
    {
        "h800_dsv3": CostPreset(
            prefill=QuadraticCost(
                a=10e-3, b=62.4e-6, k=11.1e-9, q=5.55e-9, b_moe=81.1e-6, moe_lb=1.03
            ),
            decode=DecodeCost(a=5e-3, b=0.123e-3, k=23.4e-9, b_moe=0.124e-3, moe_lb=1.03),
        ),
        "unit": CostPreset(
            prefill=QuadraticCost(a=1.0, b=1.0, k=0.001, q=0.0005),
            decode=DecodeCost(a=1.0, b=1.0, k=0.001),
        ),
    }
)


def preset(name: str) -> CostPreset:
    """Return the built-in cost preset ``name`` (see :data:`PRESETS`).

    Examples
    --------
    >>> preset("h800_dsv3").prefill.a
    0.01
    >>> preset("h100")
    Traceback (most recent call last):
    ...
    ValueError: name: must be one of 'h800_dsv3', 'unit'; got 'h100'
    """
    return PRESETS[check_choice(name, "name", tuple(PRESETS))]
