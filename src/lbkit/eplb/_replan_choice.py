"""The choice of one candidate per layer of a re-plan: the candidates of the mean mode, the
fewest total moves within the mean tolerance (an exact multiple-choice knapsack), and the
total-budget mode (``replan.py``'s module docstring states the rules)."""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import entry, jit_disabled, jit_mode
from lbkit.eplb._replan_candidates import (
    Candidate,
    Context,
    context,
    map_layers,
    matched_fresh,
    regrouped,
    replan_all,
    replan_levels,
    replan_one,
    row_lb,
)
from lbkit.eplb._replan_layer import ReplanArgs

__all__ = [
    "DEFAULT_TOLERANCE",
    "mean_candidates",
    "programme_tables",
    "programme_tables_numpy",
    "replan_mean",
    "replan_total",
    "select",
    "warmup",
]

#: Relative gap of the mean ``moe_lb`` over layers to a fresh default plan's that a re-plan may
#: keep (``tolerance_scope="mean"``; per layer with ``"layer"``).
DEFAULT_TOLERANCE = 0.01


def _feasible_moves(m: np.ndarray, lb: np.ndarray, ok: np.ndarray, cap: float) -> int | None:
    """Total moves of some choice with ``sum(lb) <= cap`` found by bisection on a Lagrange
    multiplier (each layer takes the candidate minimising ``moves + lam * lb``), or ``None``
    when even the most balanced choice does not fit. An upper bound on the fewest total moves
    that fit, which caps the range of :func:`select`'s dynamic programme."""
    layers = lb.shape[0]
    rows = np.arange(layers)
    lbv = np.where(ok, lb, 0.0)

    def choose(lam: float) -> tuple[int, float]:
        cost = np.where(ok, m + lam * lbv, np.inf)
        c = np.argmin(cost, axis=1)
        total = 0.0
        for v in lbv[rows, c].tolist():  # summed in layer order, as the programme does
            total += v
        return int(m[rows, c].sum()), total

    lo, hi = 0.0, 1e18
    moves, total = choose(hi)
    if total > cap:
        return None
    for _ in range(64):  # geometric bisection: the fitting multipliers form a half-line
        mid = np.sqrt(max(lo, 1e-9) * hi)
        got = choose(mid)
        if got[1] <= cap:
            hi, (moves, total) = mid, got
        else:
            lo = mid
        if hi <= lo * 1.01:
            break
    return moves


def select(moves: np.ndarray, lb: np.ndarray, cap: float, limit: int | None = None) -> np.ndarray:
    """Exact choice of one candidate per layer with at most ``limit`` total moves (default: no
    limit): the fewest total moves such that ``sum(lb) <= cap``, then the smallest ``sum(lb)``;
    the choice with the smallest ``sum(lb)`` (then fewest moves) if none fits. ``moves`` (int)
    and ``lb`` are ``(layers, C)``; ``lb = inf`` marks a missing candidate, and some candidate
    of every layer must have at most ``limit`` moves (column 0 has zero moves in every
    caller). Dynamic programme over the total moves (a multiple-choice knapsack); ties: lowest
    candidate index. The programme runs up to the total moves of a fitting choice found by a
    Lagrangian bisection (:func:`_feasible_moves`), the answer's upper bound, and over every
    total only when that range holds no fitting total.

    Runtime complexity: O(layers × C × min(limit, moves of a fitting choice)), at most
    O(layers × C × min(limit, total moves of the largest candidates)).
    """
    ok = np.isfinite(lb)
    m = np.where(ok, moves, 0).astype(np.int64)
    top = int(np.where(ok, m, 0).max(axis=1).sum())
    if limit is not None:
        ok &= m <= limit
        top = min(top, int(limit))
    bound = _feasible_moves(m, lb, ok, cap)
    if bound is not None and bound < top:
        choice = _programme(m, lb, ok, cap, bound, require_fit=True)
        if choice is not None:
            return choice
    return _programme(m, lb, ok, cap, top, require_fit=False)


def _programme(
    m: np.ndarray, lb: np.ndarray, ok: np.ndarray, cap: float, top: int, require_fit: bool
) -> np.ndarray | None:
    """:func:`select`'s dynamic programme over totals ``0 .. top``; ``None`` when
    ``require_fit`` and no total in that range fits ``cap``. ``best[t]`` depends only on
    smaller totals, so a shorter range gives the same values and the same first fitting total.
    The tables come from :func:`programme_tables` once it is compiled, else from
    :func:`programme_tables_numpy` (the same values: a re-plan never waits for a compiler).
    """
    layers = lb.shape[0]
    best = np.empty(top + 1)  # best[t]: smallest sum of lb with exactly t moves so far
    arg = np.empty((layers, top + 1), dtype=np.int16)  # candidate index
    args = (m, lb, ok, top, best, arg)
    if not jit_disabled() and (jit_mode() == "inline" or programme_tables.is_compiled(*args)):
        programme_tables(*args)
    else:
        programme_tables_numpy(*args)
    fits = np.flatnonzero(best <= cap)
    if require_fit and not len(fits):
        return None
    t = int(fits[0]) if len(fits) else int(np.argmin(best))
    choice = np.empty(layers, dtype=np.int64)
    for i in range(layers - 1, -1, -1):
        choice[i] = arg[i, t]
        t -= int(m[i, choice[i]])
    return choice


@entry
def programme_tables(m, lb, ok, top, best, arg):
    """The tables of :func:`select`'s dynamic programme, ``(layers, C)`` candidates: ``best[t]``
    (``(top + 1,)``) the smallest sum of ``lb`` over all layers with exactly ``t`` moves
    (``inf``: none), ``arg[i, t]`` (``(layers, top + 1)``, int16) the candidate of layer ``i``
    on that path (the first of the smallest, as ``np.argmin``; 0 where none).

    Runtime complexity: O(layers × top × C).
    """
    layers, width = lb.shape
    best[0] = 0.0
    for t in range(1, top + 1):
        best[t] = np.inf
    row = np.empty(top + 1)
    for i in range(layers):
        for t in range(top + 1):
            bv = np.inf
            bc = 0
            for c in range(width):
                if ok[i, c] and m[i, c] <= t:
                    v = best[t - m[i, c]] + lb[i, c]
                    if v < bv:
                        bv = v
                        bc = c
            row[t] = bv
            arg[i, t] = bc
        best[:] = row


def programme_tables_numpy(
    m: np.ndarray, lb: np.ndarray, ok: np.ndarray, top: int, best: np.ndarray, arg: np.ndarray
) -> None:
    """:func:`programme_tables` in numpy (vectorised over the totals): the same tables, for the
    calls made before the kernel is compiled."""
    layers, width = lb.shape
    best[0] = 0.0
    best[1:] = np.inf
    cand = np.empty((width, top + 1))
    cols = np.arange(top + 1)
    for i in range(layers):
        cand[:] = np.inf
        for c in range(width):
            if ok[i, c]:
                k = int(m[i, c])
                if k <= top:
                    cand[c, k:] = best[: top + 1 - k] + lb[i, c]
        arg[i] = np.argmin(cand, axis=0)  # the first of the smallest: lowest candidate index
        best[:] = cand[arg[i], cols]


def warmup() -> None:
    """Compile :func:`programme_tables` (or load it from the disk cache) on a tiny input."""
    m = np.zeros((1, 2), dtype=np.int64)
    lb = np.ones((1, 2))
    ok = np.ones((1, 2), dtype=np.bool_)
    programme_tables.dispatcher(m, lb, ok, 2, np.empty(3), np.empty((1, 3), dtype=np.int16))


def _select_candidates(
    cands: list[list[Candidate]], cap: float, limit: int | None = None
) -> np.ndarray:
    """:func:`select` over candidate lists: the index of the candidate chosen in each layer."""
    layers = len(cands)
    width = max(len(c) for c in cands)
    m = np.zeros((layers, width), dtype=np.int64)
    v = np.full((layers, width), np.inf)
    for i, opts in enumerate(cands):
        for j, (used, lb, _, _) in enumerate(opts):
            m[i, j], v[i, j] = used, lb
    return select(m, v, cap, limit)


def _choose(
    cands: list[list[Candidate]], cap: float, limit: int | None = None, choice=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One candidate per layer by :func:`select` (or the ``choice`` it already made over these
    candidates): ``(phy2log, moves, regrouped)``."""
    if choice is None:
        choice = _select_candidates(cands, cap, limit)
    chosen = [opts[int(c)] for opts, c in zip(cands, choice, strict=True)]
    phy2log = np.stack([row for _, _, row, _ in chosen])
    moves = np.array([used for used, _, _, _ in chosen], dtype=np.int64)
    regrouped = np.array([regroup for _, _, _, regroup in chosen], dtype=bool)
    return phy2log, moves, regrouped


#: Per-layer tolerances of the mean mode, as multiples of ``tolerance``. A layer's moves fall
#: in steps as its tolerance loosens, and the choice over layers can only use the steps it is
#: shown: twelve levels instead of five (0.5, 0.75, 1, 1.4, 2) cut the moves by 2-4% (288 slots
#: / 32 GPUs, drift 0.05-0.1, seeds 1-5).
_LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.6, 2.0)

#: Levels re-planned first in every layer by the level search of the global policy
#: (:func:`mean_candidates`); the others only next to a level the choice takes.
_FIRST_LEVELS = (2.0, 1.2, 0.8)

#: Levels on each side of a layer's chosen level that a round of the level search re-plans.
_NEIGHBOURS = 2


def _base_candidates(
    args: ReplanArgs, ctx: Context, layer: int, budget: int, tightest: float
) -> list[Candidate]:
    """The old row (zero moves), then the matched fresh plan unless the old row is within the
    tightest level of the fresh plan or the budget excludes it."""
    p = args.problem
    prev = args.previous[layer]
    opts: list[Candidate] = [(0, float(ctx.old_lb[layer]), prev, False)]
    if ctx.old_lb[layer] > ctx.fresh_lb[layer] * (1.0 + tightest):
        row, used = matched_fresh(prev, ctx.fresh[layer], args)
        if used <= budget:
            f_lb = row_lb(p.weight[layer], row, p.num_gpus)
            old_part = None if ctx.old_parts is None else ctx.old_parts[layer]
            opts.append((used, f_lb, row, regrouped(row, old_part, args)))
    return opts


class _Levels:
    """The per-layer re-plans of one layer computed so far, by level (loose first)."""

    def __init__(self, args: ReplanArgs, ctx: Context, layer: int, budget: int, levels: list):
        self.args, self.ctx, self.layer, self.budget, self.levels = args, ctx, layer, budget, levels
        self.done: dict[int, Candidate | None] = {}  # level index -> result (None: no move)

    def compute(self, j: int) -> bool:
        """Re-plan at level ``j`` unless done or out of range (then ``False``); skipped (no
        candidate) when a looser level's result already meets it."""
        if j < 0 or j >= len(self.levels) or j in self.done:
            return False
        tol = self.levels[j]
        fresh_lb = self.ctx.fresh_lb[self.layer]
        for k, got in self.done.items():
            if k < j and got is not None and got[1] <= fresh_lb * (1.0 + tol) * (1.0 + 1e-12):
                self.done[j] = None  # a looser level's result already meets this one
                return True
        row, used, regroup, v = replan_one(self.args, self.ctx, self.layer, tol, self.budget)
        self.done[j] = (used, v, row, regroup) if used > 0 else None
        return True

    def compute_all(self) -> None:
        """:meth:`compute` at every level, loose first; the re-plans of all levels in one kernel
        call (:func:`replan_levels`, which leaves out the levels a looser result certainly
        meets)."""
        replan_levels(self.args, self.ctx, self.layer, self.levels, self.budget)
        for j in range(len(self.levels)):
            self.compute(j)

    def candidates(self) -> tuple[list[Candidate], list[int]]:
        """The results with moves, loose first, and their level indices."""
        js = [j for j in sorted(self.done) if self.done[j] is not None]
        return [self.done[j] for j in js], js


def _neighbours(chosen: tuple[_Levels, int]) -> bool:
    """Re-plan the ``_NEIGHBOURS`` levels on each side of a layer's chosen level index (none
    for the old row and the fresh plan, index ``-1``); whether any was computed."""
    each, j = chosen
    grew = False
    for k in range(1, _NEIGHBOURS + 1) if j >= 0 else ():
        grew = each.compute(j - k) | grew
        grew = each.compute(j + k) | grew
    return grew


def mean_candidates(
    args: ReplanArgs, ctx: Context, tolerance: float, budgets: np.ndarray
) -> list[list[Candidate]]:
    """:func:`_mean_search`'s candidates."""
    return _mean_search(args, ctx, tolerance, budgets)[0]


def _mean_search(
    args: ReplanArgs, ctx: Context, tolerance: float, budgets: np.ndarray
) -> tuple[list[list[Candidate]], np.ndarray | None]:
    """Candidates of every layer in the mean mode at ``tolerance`` (module docstring): the old
    row first, the matched fresh plan, then the re-plans at the per-layer levels, loose first.

    Hierarchical policy: every level of every layer (a tighter level skipped when a looser one
    already meets it). Global policy, where a layer's re-plan costs far more than a choice
    over layers: the levels ``_FIRST_LEVELS`` first, then rounds of the choice of
    :func:`replan_mean`, each computing the ``_NEIGHBOURS`` levels on each side of the one
    chosen in every layer (where not done), until no round adds one: the expensive tight levels
    mostly where the choice wants them. Over twelve synthetic drift cases (288/32 and 320/64,
    lognormal and Zipf loads, drift 0.05-0.3) 2.8x faster than every level for 0.6% more moves
    (one neighbour: 4.1x, 1.5%); under the hierarchical policy the per-level work is cheap and
    the levels not searched cost 6-16% more moves.

    The layers of each round are re-planned on ``args.workers`` threads (:func:`map_layers`).
    Returns the candidates and, under the global policy, the last round's choice over them
    (:func:`select` at the mean target of ``tolerance``), else ``None``.

    Runtime complexity: at most ``len(_LEVELS)`` re-plans per layer; in the global policy at
    most as many choice rounds (:func:`select`).
    """
    p = args.problem
    layers = args.previous.shape[0]
    levels = sorted({tolerance * f for f in _LEVELS}, reverse=True)  # loose first
    base = [_base_candidates(args, ctx, i, int(budgets[i]), min(levels)) for i in range(layers)]
    found = [_Levels(args, ctx, i, int(budgets[i]), levels) for i in range(layers)]
    if p.hierarchical:
        map_layers(args, lambda each: each.compute_all(), found)
        return [base[i] + found[i].candidates()[0] for i in range(layers)], None
    first = sorted({levels.index(tolerance * f) for f in _FIRST_LEVELS})
    map_layers(args, lambda each: [each.compute(j) for j in first], found)
    cap = float(ctx.fresh_lb.sum()) * (1.0 + tolerance)
    while True:
        cands, level_of = [], []
        for i in range(layers):
            more, js = found[i].candidates()
            cands.append(base[i] + more)
            level_of.append([-1] * len(base[i]) + js)
        choice = _select_candidates(cands, cap)
        chosen = [(found[i], level_of[i][int(choice[i])]) for i in range(layers)]
        if not any(map_layers(args, _neighbours, chosen)):
            return cands, choice  # the choice of select over these very candidates


def replan_mean(args: ReplanArgs, budgets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean mode: candidates per layer, then the fewest moves with the mean ``moe_lb`` within
    ``tolerance`` of the fresh plan's (module docstring)."""
    ctx = context(args)
    cands, choice = _mean_search(args, ctx, args.tolerance, budgets)
    return _choose(cands, float(ctx.fresh_lb.sum()) * (1.0 + args.tolerance), choice=choice)


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
