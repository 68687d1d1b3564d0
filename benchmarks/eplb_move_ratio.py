"""Moves of the default re-plan against the fixed-count lower bound, layer by layer.

For every layer whose replica counts the re-plan kept, the bound of ``eplb_drift.py``
(``fixed_count_bound``) at the largest GPU load that the re-plan reached on that layer: any plan
that keeps the counts and reaches that load moves at least ``H + k`` replicas (``H`` GPUs above
it under the old plan, ``k`` the fewest GPUs below it whose room covers their excess). The
ratio is the re-plan's moves over the bound, summed over those layers; layers where the re-plan
changed replica counts are counted apart (the bound does not hold there). Global policy,
58 x 256, 8 groups; lognormal (sigma 1) and Zipf (exponent 1) loads drifted by lognormal 0.05,
0.1 and 0.3 (seed 1), as the target table of ``eplb_drift.py``. Issue 14 asks for at most 1.1.

Run: ``python benchmarks/eplb_move_ratio.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import lbkit
from lbkit.eplb import drift, rebalance_experts, synthetic_expert_load
from lbkit.eplb.replan import replan_experts

try:
    from eplb_drift import fixed_count_bound
    from run_record import ROOT, git_commit, load_avg, write_results
except ImportError:  # run from the repository root
    from benchmarks.eplb_drift import fixed_count_bound
    from benchmarks.run_record import ROOT, git_commit, load_avg, write_results

SHAPES = [(288, 32, 4), (320, 64, 8)]
DRIFTS = (0.05, 0.1, 0.3)
#: Largest ratio of moves to the fixed-count bound that issue 14 asks for.
TARGET_RATIO = 1.1


def case(w0: np.ndarray, w1: np.ndarray, slots: int, gpus: int, nodes: int) -> list:
    old = rebalance_experts(w0, slots, 8, nodes, gpus, policy="global").phy2log
    res = replan_experts(w1, old, slots, 8, nodes, gpus, policy="global")
    new = res.plan.phy2log
    experts = w0.shape[1]
    moves = bound = kept = 0
    for i in range(len(w1)):
        counts = np.bincount(new[i], minlength=experts)
        if (np.bincount(old[i], minlength=experts) != counts).any():
            continue
        kept += 1
        top = (w1[i][new[i]] / counts[new[i]]).reshape(gpus, -1).sum(axis=1).max()
        moves += int(res.num_moves[i])
        bound += fixed_count_bound(w1[i], old[i], gpus, top * (1 + 1e-12))[1]
    return [
        kept,
        moves,
        round(float(bound)),
        round(moves / bound, 3) if bound else None,
        int(res.num_moves.sum()) - moves,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the table to this file")
    a = ap.parse_args()
    start = time.perf_counter()
    out = {
        "command": " ".join(["python", "benchmarks/eplb_move_ratio.py", *sys.argv[1:]]),
        "commit": git_commit(ROOT),
        "load_avg_start": load_avg(),
    }
    lbkit.warmup(packages=("eplb",))
    rows = []
    for slots, gpus, nodes in SHAPES:
        for kind in ("lognormal", "zipf"):
            w0 = synthetic_expert_load(58, 256, kind=kind, sigma=1.0, rng=0)
            for sigma in DRIFTS:
                w1 = drift(w0, sigma=sigma, rng=1)
                rows.append([f"{slots}/{gpus}/{nodes}", f"{kind} drift {sigma}",
                             *case(w0, w1, slots, gpus, nodes)])  # fmt: skip
                print(*rows[-1], sep=" | ", flush=True)
    table = {
        "title": "Re-plan moves against the fixed-count bound at the balance reached",
        "note": "global policy, default re-plan; per layer that kept its replica counts, the "
        "bound H + k at the largest GPU load the re-plan reached there (eplb_drift.py's "
        f"fixed_count_bound); ratio = moves / bound over those layers (target at most "
        f"{TARGET_RATIO}); the other layers changed counts, where the bound does not hold.",
        "columns": [
            "slots/GPUs/nodes",
            "loads",
            "layers with counts kept",
            "their moves",
            "their bound",
            "ratio",
            "moves in other layers",
        ],
        "rows": rows,
    }
    out["tables"] = [table]
    write_results(out, Path(a.json) if a.json else None, start)


if __name__ == "__main__":
    main()
