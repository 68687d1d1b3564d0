"""Golden outputs of DeepSeek's published ``eplb.py`` (github.com/deepseek-ai/EPLB, commit
``d52c72d``) on seeded loads, so that CI compares lbkit's ``method="greedy"`` with the reference
code's own results without shipping it or fetching it.

The cases are those of ``test_greedy_matches_deepseek_code``: five shapes, three seeds, three
log-normal spreads, global and (where groups divide over nodes) hierarchical. Regenerate with
a copy of ``eplb.py`` and torch installed::

    python tests/eplb/deepseek_golden.py /path/to/eplb.py

which runs ``rebalance_experts_hierarchical`` on every case and writes ``deepseek_golden.npz``
(its ``phy2log`` and ``logcnt`` per case; the loads are regenerated from the seeds).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).with_name("deepseek_golden.npz")
#: (layers, experts, replicas, groups, nodes, gpus).
SHAPES = (
    (3, 12, 16, 4, 2, 8),
    (2, 256, 288, 8, 4, 32),
    (2, 256, 320, 8, 8, 64),
    (2, 64, 96, 8, 2, 16),
    (2, 24, 30, 4, 3, 6),
)
SEEDS = (0, 1, 2)
SPREADS = (0.5, 1.0, 1.5)


def cases():
    """``(key, weight, shape, hierarchical)`` of every case, loads regenerated from the seeds.

    Tie-free: distinct float32 loads (integer loads make ties such as ``w_a / 2 == w_b``, where
    the published code's unstable sorts pick either order).
    """
    for shape in SHAPES:
        layers, experts, _, k, n, _ = shape
        for seed in SEEDS:
            rng = np.random.default_rng(seed)
            for spread in SPREADS:
                weight = rng.lognormal(0, spread, (layers, experts)) * 1000
                for hier in (False, True) if k % n == 0 else (False,):
                    key = f"{'x'.join(map(str, shape))}_s{seed}_v{spread}_{'h' if hier else 'g'}"
                    yield key, weight, shape, hier


def load_reference(path: str | Path):
    """Import a copy of DeepSeek's ``eplb.py`` as a module."""
    spec = importlib.util.spec_from_file_location("deepseek_eplb", str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("deepseek_eplb", module)
    spec.loader.exec_module(module)
    return module


def generate(path: str | Path) -> dict[str, np.ndarray]:
    import torch

    ds = load_reference(path)
    out: dict[str, np.ndarray] = {}
    for key, weight, (_, _, r, k, n, g), hier in cases():
        groups, nodes = (k, n) if hier else (1, 1)
        p2l, _, cnt = ds.rebalance_experts_hierarchical(
            torch.tensor(weight).float(), r, groups, nodes, g
        )
        out[f"{key}/phy2log"] = p2l.numpy().astype(np.int16)
        out[f"{key}/logcnt"] = cnt.numpy().astype(np.int16)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/eplb/deepseek_golden.py /path/to/eplb.py")
    np.savez_compressed(GOLDEN, **generate(sys.argv[1]))
    print(f"wrote {GOLDEN}")
