"""The first re-plan of a process whose re-planning kernels are not compiled yet.

Re-planning runs its searches (``_replan_layer`` and the kernels it calls) up to twelve times per
layer. Run as Python, before the background compiler (``lbkit.core._jit``) has produced them,
that takes minutes: 490 s for 58 x 256 at 288 slots / 32 GPUs on a busy 2-core machine, against
4.7 s compiled. An engine cannot block its first EPLB step for that long, so while those kernels
are not compiled (and ``LBKIT_JIT`` is not ``"inline"``) :func:`lbkit.eplb.replan_experts`
chooses, per layer, between only two candidates, both cheap as Python: the old row, and the
fresh plan's row with its GPUs (and nodes) relabelled to keep the most replicas in place (an
assignment problem, scipy's ``linear_sum_assignment``). The choice and every rule of the
arguments (tolerance and its scope, per-layer and total move budgets, never worse than the old
plan) are those of the full re-plan, so the result is valid and as balanced as a fresh plan
where it moves; it only moves more replicas than the full search would. The first call starts
the background compiler, and later calls re-plan in full once its kernels are on disk.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit_disabled, jit_mode
from lbkit.eplb._regroup import old_partition
from lbkit.eplb._replan_candidates import fresh_plan, matched_fresh, regrouped, row_lb
from lbkit.eplb._replan_choice import select
from lbkit.eplb._replan_layer import ReplanArgs, replan_nodes, replan_nodes_levels
from lbkit.eplb.bounds import moe_lb

__all__ = ["replan_kernels_ready", "replan_matched"]


def replan_kernels_ready() -> bool:
    """Whether a re-plan runs its full searches: with ``LBKIT_JIT=inline`` (they compile on
    the call) or without numba's JIT (nothing will ever be compiled: the caller asked for Python
    throughout), or when the search kernels (one level, and the levels of a layer at once) are
    loaded or on disk for the argument types every layer uses: the compiler writes them one
    after the other, and a re-plan between the two would run the second as Python."""
    if jit_mode() == "inline" or jit_disabled():
        return True
    grid = np.zeros((1, 1), dtype=np.int64)
    row = np.zeros(1, dtype=np.int64)
    w = np.zeros((1, 1))
    if not replan_nodes.is_compiled(w, grid[None], grid, row, row, 1.0, 1, row):
        return False
    levels = np.zeros(1)
    return replan_nodes_levels.is_compiled(
        w, grid[None], grid, row, row, levels, 1, levels, levels, 1.0, grid
    )


def replan_matched(args: ReplanArgs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-plan from the old and the matched fresh row of every layer (module docstring):
    ``(phy2log, moves, regrouped)``.

    Runtime complexity: one fresh plan, plus O(layers × G³) for the assignments.
    """
    p = args.problem
    w, prev = p.weight, args.previous
    layers, experts = w.shape
    fresh, fresh_lb = fresh_plan(args)
    old_lb = moe_lb(w, prev, num_gpus=p.num_gpus)
    old_parts = (
        old_partition(prev, experts, args.num_groups, args.num_nodes) if p.hierarchical else None
    )
    rows = np.empty((layers, 2, prev.shape[1]), dtype=np.int64)
    moves = np.zeros((layers, 2), dtype=np.int64)
    lb = np.full((layers, 2), np.inf)
    regroup = np.zeros((layers, 2), dtype=bool)
    rows[:, 0], lb[:, 0] = prev, old_lb
    for layer in range(layers):
        tol = args.tolerance if args.scope == "layer" else 0.0
        if old_lb[layer] <= fresh_lb[layer] * (1.0 + tol):
            continue  # the old row is as good as a fresh one: nothing to move
        row, used = matched_fresh(prev[layer], fresh[layer], args)
        v = row_lb(w[layer], row, p.num_gpus)
        if used > args.budget[layer] or v >= old_lb[layer] * (1.0 - 1e-12):
            continue  # over the layer's budget, or no better than keeping the old row
        rows[layer, 1], moves[layer, 1], lb[layer, 1] = row, used, v
        old_part = None if old_parts is None else old_parts[layer]
        regroup[layer, 1] = regrouped(row, old_part, args)
    if args.scope == "layer" and args.total is None:
        choice = np.isfinite(lb[:, 1]).astype(np.int64)  # every layer that can reach a fresh row
    else:
        cap = float(fresh_lb.sum()) * (1.0 + args.tolerance)
        choice = select(moves, lb, cap, args.total)
    pick = np.arange(layers)
    return rows[pick, choice], moves[pick, choice], regroup[pick, choice]
