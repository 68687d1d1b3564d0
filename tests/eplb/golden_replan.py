"""Golden EPLB re-plans: fixed shapes, loads and old plans whose re-plans must never change by
accident.

``python tests/eplb/golden_replan.py`` (from the repository root, with ``PYTHONPATH=src``)
records every case's re-plan (``phy2log``, moves per layer, the move list, ``regrouped``,
``moe_lb``) into ``golden_replans.npz`` beside this file; ``test_golden_replan.py`` recomputes
them and requires bit-identical arrays. Re-record only for a deliberate change of the re-plan's
result, and say so in the commit message. The loads come from seeded generators whose results do
not depend on the CPU (``drift`` draws its factors with ``Generator.lognormal``; ``numpy.exp``
on arrays runs vector code that differs by an ulp on CPUs with AVX-512, which once made this
record fail on other machines).

The cases cover the branches of the re-planner: global and hierarchical policies, the mean and
layer tolerance scopes, per-layer and total budgets, tight and loose tolerances, one and two
slots per GPU, one GPU per node, single-expert groups, zero drift, zero loads and a phase change
(the old plan made for other loads).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

FIXTURE = Path(__file__).with_name("golden_replans.npz")


def _loads() -> dict[str, np.ndarray]:
    """Named load matrices (layers, experts); seeded, small enough for a quick test."""
    from lbkit.eplb import synthetic_expert_load

    rng = np.random.default_rng(20251202)
    sparse = rng.integers(0, 50, size=(2, 64)).astype(np.float64)
    sparse[:, ::5] = 0.0
    single = np.random.default_rng(0)
    return {
        "v3": synthetic_expert_load(3, 256, rng=0),
        "v3_zipf": synthetic_expert_load(3, 256, kind="zipf", exponent=1.0, rng=1),
        "v2lite": rng.integers(1, 5000, size=(3, 64)).astype(np.float64),
        "sparse": sparse,
        "small": rng.gamma(0.7, 100.0, size=(4, 16)),
        "single_old": single.integers(0, 1000, (1, 12)).astype(np.float64),
        "single_new": single.integers(0, 1000, (1, 12)).astype(np.float64),
    }


#: (name, old loads, new loads or drift sigma, num_replicas, num_groups, num_nodes, num_gpus,
#: policy, keyword arguments of replan_experts). A float as the new loads drifts the old ones
#: (seed 1).
CASES: tuple[tuple[Any, ...], ...] = (
    ("v3_288_32_global", "v3", 0.1, 288, 8, 4, 32, "global", {}),
    ("v3_288_32_hier", "v3", 0.1, 288, 8, 4, 32, "hierarchical", {}),
    ("v3_320_64_global", "v3", 0.1, 320, 8, 8, 64, "global", {}),
    ("v3_320_64_hier", "v3", 0.1, 320, 8, 8, 64, "hierarchical", {}),
    ("v3_288_32_layer", "v3", 0.1, 288, 8, 4, 32, "global", {"tolerance_scope": "layer"}),
    ("v3_288_32_total", "v3", 0.1, 288, 8, 4, 32, "global", {"max_moves_total": 20}),
    ("v3_320_64_hier_max", "v3", 0.3, 320, 8, 8, 64, "hierarchical", {"max_moves": 4}),
    ("v3_320_64_loose", "v3", 0.3, 320, 8, 8, 64, "global", {"tolerance": 0.05}),
    ("phase_320_64_global", "v3_zipf", "v3", 320, 8, 8, 64, "global", {}),
    ("phase_320_64_hier", "v3_zipf", "v3", 320, 8, 8, 64, "hierarchical", {}),
    ("v2lite_128_64_global", "v2lite", 0.3, 128, 1, 1, 64, "global", {}),
    (
        "v2lite_128_64_budget",
        "v2lite",
        0.3,
        128,
        1,
        1,
        64,
        "global",
        {"tolerance": 0.001, "max_moves_total": 40},
    ),
    ("v2lite_96_16_hier", "v2lite", 0.3, 96, 8, 4, 16, "hierarchical", {}),
    ("sparse_80_16_global", "sparse", 0.5, 80, 4, 2, 16, "global", {}),
    ("small_24_8_global", "small", 1.0, 24, 4, 2, 8, "global", {}),
    ("small_32_8_hier", "small", 0.3, 32, 4, 2, 8, "hierarchical", {}),
    ("small_16_2_hier", "small", 0.3, 16, 4, 2, 2, "hierarchical", {}),
    ("small_zero_drift", "small", 0.0, 24, 4, 2, 8, "global", {}),
    ("single_12_2_hier", "single_old", "single_new", 12, 12, 2, 2, "hierarchical", {}),
)

#: Fields of the record of every case.
FIELDS = ("phy2log", "num_moves", "moe_lb", "regrouped", "move_slot", "move_source_gpu")


def compute(cases: tuple[tuple[Any, ...], ...] | list[tuple[Any, ...]] = CASES) -> dict[str, Any]:
    """Every array of the golden record for ``cases``, keyed ``case/field``."""
    from lbkit.eplb import drift, rebalance_experts, replan_experts

    loads = _loads()
    out: dict[str, np.ndarray] = {}
    for name, old_w, new_w, replicas, groups, nodes, gpus, policy, kwargs in cases:
        w_old = loads[old_w]
        w_new = drift(w_old, sigma=new_w, rng=1) if isinstance(new_w, float) else loads[new_w]
        old = rebalance_experts(w_old, replicas, groups, nodes, gpus, policy=policy).phy2log
        r = replan_experts(w_new, old, replicas, groups, nodes, gpus, policy=policy, **kwargs)
        out[f"{name}/phy2log"] = np.asarray(r.plan.phy2log)
        out[f"{name}/num_moves"] = r.num_moves
        out[f"{name}/moe_lb"] = r.moe_lb
        out[f"{name}/regrouped"] = r.regrouped
        out[f"{name}/move_slot"] = r.moves.slot
        out[f"{name}/move_source_gpu"] = r.moves.source_gpu
    return out


def record(path: Path = FIXTURE) -> None:
    """Write :func:`compute` to ``path`` (compressed, integers as ``int16``)."""
    arrays = {
        key: value.astype(np.int16) if value.dtype.kind == "i" else value
        for key, value in compute().items()
    }
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    # The full re-plan, as the tests run it (conftest.py): compiled on first use, never the
    # first-call path of a process whose kernels are not compiled yet.
    os.environ.setdefault("LBKIT_JIT", "inline")
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE)
