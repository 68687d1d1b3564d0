"""Golden EPLB plans: fixed shapes and loads whose plans must never change by accident.

``python tests/eplb/golden.py`` (from the repository root, with ``PYTHONPATH=src``) records the
plans of every case into ``golden_plans.npz`` beside this file; ``test_golden.py`` recomputes
them and requires bit-identical arrays. Re-record only for a deliberate change of a method's
result, and say so in the commit message.

The cases cover every branch of the planners: global and hierarchical policies, one, two and
more slots per GPU, sub-problems of at most 32 replicas (exact search) and larger ones (count
search, second starts, the two-slot count search), zero and integer loads, and both methods.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).with_name("golden_plans.npz")


def _loads() -> dict[str, np.ndarray]:
    """Named load matrices (layers, experts); seeded, small enough for a quick test."""
    from lbkit.eplb import synthetic_expert_load

    rng = np.random.default_rng(20240614)
    zipf = synthetic_expert_load(3, 256, kind="zipf", exponent=1.0, rng=1)
    sparse = rng.integers(0, 50, size=(2, 64)).astype(np.float64)
    sparse[:, ::5] = 0.0
    return {
        "v3_lognormal": synthetic_expert_load(3, 256, rng=0),
        "v3_zipf": zipf,
        "v2lite_int": rng.integers(1, 5000, size=(3, 64)).astype(np.float64),
        "sparse_64": sparse,
        "small_16": rng.gamma(0.7, 100.0, size=(4, 16)),
        "readme_12": np.array(
            [
                [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
            ],
            dtype=np.float64,
        ),
    }


#: (name, loads, num_replicas, num_groups, num_nodes, num_gpus, policy)
CASES = (
    ("v3_288_32_global", "v3_lognormal", 288, 8, 4, 32, "global"),
    ("v3_288_32_hier", "v3_lognormal", 288, 8, 4, 32, "hierarchical"),
    ("v3_320_64_global", "v3_lognormal", 320, 8, 8, 64, "global"),
    ("v3_320_64_hier", "v3_lognormal", 320, 8, 8, 64, "hierarchical"),
    ("v3_288_144_global", "v3_lognormal", 288, 8, 8, 144, "global"),
    ("v3_320_160_hier", "v3_lognormal", 320, 8, 8, 160, "hierarchical"),
    ("v3_256_256_global", "v3_lognormal", 256, 8, 8, 256, "global"),
    ("zipf_288_32_global", "v3_zipf", 288, 8, 4, 32, "global"),
    ("zipf_320_64_hier", "v3_zipf", 320, 8, 8, 64, "hierarchical"),
    ("v2lite_128_64_global", "v2lite_int", 128, 1, 1, 64, "global"),
    ("v2lite_96_16_hier", "v2lite_int", 96, 8, 4, 16, "hierarchical"),
    ("sparse_80_16_global", "sparse_64", 80, 4, 2, 16, "global"),
    ("small_24_8_global", "small_16", 24, 4, 2, 8, "global"),
    ("small_32_8_hier", "small_16", 32, 4, 2, 8, "hierarchical"),
    ("small_32_16_global", "small_16", 32, 4, 2, 16, "global"),
    ("readme_16_8_hier", "readme_12", 16, 4, 2, 8, "hierarchical"),
    ("readme_16_8_global", "readme_12", 16, 4, 2, 8, "global"),
)

METHODS = ("default", "greedy")


def compute(cases: tuple[tuple, ...] | list[tuple] = CASES) -> dict[str, np.ndarray]:
    """Every array of the golden record for ``cases``, keyed ``case/method/field``."""
    from lbkit.eplb import lower_bound, rebalance_experts

    loads = _loads()
    out: dict[str, np.ndarray] = {}
    for name, load, replicas, groups, nodes, gpus, policy in cases:
        w = loads[load]
        for method in METHODS:
            plan = rebalance_experts(w, replicas, groups, nodes, gpus, method=method, policy=policy)
            for field, value in zip(plan._fields, plan, strict=True):
                out[f"{name}/{method}/{field}"] = np.asarray(value)
        out[f"{name}/lower_bound"] = lower_bound(w, replicas, groups, nodes, gpus, policy=policy)
    return out


def record(path: Path = FIXTURE) -> None:
    """Write :func:`compute` to ``path`` (compressed, integers as ``int16``)."""
    arrays = {
        key: value.astype(np.int16) if value.dtype.kind == "i" else value
        for key, value in compute().items()
    }
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE)
