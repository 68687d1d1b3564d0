"""Measure the ``moe_lb`` of the ``h800_dsv3`` cost preset on SGLang's DeepSeek-V3 expert loads.

For each kind of engine (prefill: 8 GPUs, 288 slots = 36 per GPU, one node, hierarchical policy;
decode: 64 GPUs, 320 slots = 5 per GPU, 8 nodes, global policy, as DeepSeek plans each stage),
plan every load file of that stage with :func:`lbkit.eplb.rebalance_experts` and report the
``moe_lb`` (max GPU load / mean GPU load, mean over the 58 MoE layers):

- *in-sample*: the plan evaluated on the loads it was computed from;
- *cross-file*: the plan of one file evaluated on every other file of the stage (a plan serves
  traffic it was not computed from), mean over ordered pairs; the preset uses this figure;
- *no EPLB*: the 256 experts placed in order, 256 / GPUs per GPU, no redundancy.

Run: ``python benchmarks/moe_lb_preset.py [--loads DIR]`` (about a minute on one core).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np

from lbkit.eplb import moe_lb, read_expert_load, rebalance_experts

DEFAULT_LOADS = Path("/work/shared/traces/moe_expert_load_deepseek_v3")
NUM_GROUPS = 8  # DeepSeek-V3's expert groups (node-limited routing)
NUM_EXPERTS = 256
#: stage, physical slots, GPUs, nodes, policy (None: hierarchical when nodes divide groups)
STAGES = (("prefill", 288, 8, 1, None), ("decode", 320, 64, 8, "global"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=Path, default=DEFAULT_LOADS, help="directory of *.json")
    args = parser.parse_args()
    for stage, slots, gpus, nodes, policy in STAGES:
        files = sorted(args.loads.glob(f"{stage}_*.json"))
        if not files:
            raise SystemExit(f"--loads: no {stage}_*.json in {args.loads}")
        weights = [read_expert_load(f, drop_zero_layers=True).weight for f in files]
        plans = [
            rebalance_experts(w, slots, NUM_GROUPS, nodes, gpus, policy=policy).phy2log
            for w in weights
        ]
        in_sample = [
            moe_lb(w, p, num_gpus=gpus).mean() for w, p in zip(weights, plans, strict=True)
        ]
        cross = [
            moe_lb(weights[j], plans[i], num_gpus=gpus).mean()
            for i, j in itertools.permutations(range(len(files)), 2)
        ]
        identity = np.arange(NUM_EXPERTS)
        no_eplb = [
            moe_lb(w, np.tile(identity, (w.shape[0], 1)), num_gpus=gpus).mean() for w in weights
        ]
        print(
            f"{stage}: {len(files)} files, {slots} slots on {gpus} GPUs ({slots // gpus} per GPU), "
            f"{nodes} node(s), policy {policy or 'hierarchical'}\n"
            f"  moe_lb in-sample  mean {np.mean(in_sample):.4f} (per file "
            f"{', '.join(f'{x:.4f}' for x in in_sample)})\n"
            f"  moe_lb cross-file mean {np.mean(cross):.4f} (min {min(cross):.4f}, "
            f"max {max(cross):.4f}, {len(cross)} pairs)\n"
            f"  no EPLB           mean {np.mean(no_eplb):.4f}"
        )


if __name__ == "__main__":
    main()
