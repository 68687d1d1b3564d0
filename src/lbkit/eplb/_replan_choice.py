"""The choice of one candidate per layer of a re-plan: the fewest total moves within the mean
tolerance (an exact multiple-choice knapsack), and the total-budget mode (``replan.py``'s
module docstring states the rules)."""

from __future__ import annotations

import numpy as np

from lbkit.eplb._replan_candidates import (
    Candidate,
    context,
    mean_candidates,
    replan_all,
    row_lb,
)
from lbkit.eplb._replan_layer import ReplanArgs

__all__ = ["DEFAULT_TOLERANCE", "replan_mean", "replan_total", "select"]

#: Relative gap of the mean ``moe_lb`` over layers to a fresh default plan's that a re-plan may
#: keep (``tolerance_scope="mean"``; per layer with ``"layer"``).
DEFAULT_TOLERANCE = 0.01


def select(moves: np.ndarray, lb: np.ndarray, cap: float, limit: int | None = None) -> np.ndarray:
    """Exact choice of one candidate per layer with at most ``limit`` total moves (default: no
    limit): the fewest total moves such that ``sum(lb) <= cap``, then the smallest ``sum(lb)``;
    the choice with the smallest ``sum(lb)`` (then fewest moves) if none fits. ``moves`` (int)
    and ``lb`` are ``(layers, C)``; ``lb = inf`` marks a missing candidate, and some candidate
    of every layer must have at most ``limit`` moves (column 0 has zero moves in every
    caller). Dynamic programme over the total moves (a multiple-choice knapsack); ties: lowest
    candidate index.

    Runtime complexity: O(layers × C × min(limit, total moves of the largest candidates)).
    """
    layers, width = lb.shape
    ok = np.isfinite(lb)
    m = np.where(ok, moves, 0).astype(np.int64)
    top = int(np.where(ok, m, 0).max(axis=1).sum())
    if limit is not None:
        ok &= m <= limit
        top = min(top, int(limit))
    best = np.zeros(top + 1)  # best[t]: smallest sum of lb with exactly t moves so far
    best[1:] = np.inf
    arg = np.zeros((layers, top + 1), dtype=np.int16)  # candidate index
    cand = np.empty((width, top + 1))
    cols = np.arange(top + 1)
    for i in range(layers):
        cand[:] = np.inf
        for c in range(width):
            if ok[i, c]:
                k = int(m[i, c])
                cand[c, k:] = best[: top + 1 - k] + lb[i, c]
        arg[i] = np.argmin(cand, axis=0)  # the first of the smallest: lowest candidate index
        best = cand[arg[i], cols]
    fits = np.flatnonzero(best <= cap)
    t = int(fits[0]) if len(fits) else int(np.argmin(best))
    choice = np.empty(layers, dtype=np.int64)
    for i in range(layers - 1, -1, -1):
        choice[i] = arg[i, t]
        t -= int(m[i, choice[i]])
    return choice


def _choose(
    cands: list[list[Candidate]], cap: float, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One candidate per layer by :func:`select`: ``(phy2log, moves, regrouped)``."""
    layers = len(cands)
    width = max(len(c) for c in cands)
    m = np.zeros((layers, width), dtype=np.int64)
    v = np.full((layers, width), np.inf)
    for i, opts in enumerate(cands):
        for j, (used, lb, _, _) in enumerate(opts):
            m[i, j], v[i, j] = used, lb
    choice = select(m, v, cap, limit)
    phy2log = np.stack([cands[i][choice[i]][2] for i in range(layers)])
    regrouped = np.array([cands[i][choice[i]][3] for i in range(layers)], dtype=bool)
    return phy2log, m[np.arange(layers), choice], regrouped


def replan_mean(args: ReplanArgs, budgets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean mode: candidates per layer, then the fewest moves with the mean ``moe_lb`` within
    ``tolerance`` of the fresh plan's (module docstring)."""
    ctx = context(args)
    cands = mean_candidates(args, ctx, args.tolerance, budgets)
    return _choose(cands, float(ctx.fresh_lb.sum()) * (1.0 + args.tolerance))


def _budget_ladder(limit: int) -> list[int]:
    out = {0, limit}
    b = 1.0
    while b < limit:
        out.add(int(b))
        b *= 1.5
    return sorted(out)


def replan_total(args: ReplanArgs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-plan under the total budget ``args.total`` (module docstring). The candidates do not
    depend on the total, so that (mean scope) a larger total never gives a mean ``moe_lb``
    above both a smaller total's and the tolerance target, and never above both the default
    re-plan's (when its moves fit) and the target."""
    p = args.problem
    ctx = context(args)
    layers = p.weight.shape[0]
    cap = float(ctx.fresh_lb.sum()) * (1.0 + args.tolerance)
    first = replan_all(args, args.budget, ctx)
    if args.scope == "mean":
        cands = mean_candidates(args, ctx, args.tolerance, args.budget)
    elif first[1].sum() <= args.total:
        return first
    else:
        cands = [[(0, float(ctx.old_lb[i]), args.previous[i], False)] for i in range(layers)]
    if args.tolerance != DEFAULT_TOLERANCE or args.scope != "mean":
        # The default re-plan's candidates: never worse than the default when it fits.
        extra = mean_candidates(args, ctx, DEFAULT_TOLERANCE, args.budget)
        for opts, more in zip(cands, extra, strict=True):
            opts.extend(more[1:])
    ladders = [[b for b in _budget_ladder(int(first[1][i])) if b > 0] or [0] for i in range(layers)]
    runs = [first]
    for k in range(max(len(lad) for lad in ladders)):
        b = np.array([lad[min(k, len(lad) - 1)] for lad in ladders], dtype=np.int64)
        runs.append(replan_all(args, b, ctx))
    for run in runs:
        for i in range(layers):
            if run[1][i] > 0:
                v = row_lb(p.weight[i], run[0][i], p.num_gpus)
                cands[i].append((int(run[1][i]), v, run[0][i], bool(run[2][i])))
    if args.scope != "mean":
        cap = -np.inf  # layer scope: the lowest mean within the total
    return _choose(cands, cap, args.total)
