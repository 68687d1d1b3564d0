"""Re-plan an EPLB placement for new loads while moving few expert replicas.

Moving a replica means copying an expert's weights to another GPU while serving, so a re-plan
should keep what it can. A **move** is a replica that a GPU holds in the new plan and did not hold
in the old one, counted with multiplicity per ``(layer, GPU, expert)``:

    moves = sum over layers l, GPUs g, experts e of max(0, new[l, g, e] - old[l, g, e])

The position of a replica among a GPU's slots is free: unchanged replicas keep their slots.

**Tolerance** (``tolerance_scope``). ``"mean"`` (default): the mean ``moe_lb`` over layers may be at
most ``1 + tolerance`` times that of a fresh default plan for the new loads. A layer is
re-planned at per-layer tolerances from the twelve levels ``t = (0.5, 0.6, ..., 1.4, 1.6, 2) *
tolerance`` (a tighter one is skipped when a looser one already reached it); the candidates of a
layer are these results, the old plan (zero moves) and the fresh plan with its GPUs (and nodes)
relabelled to keep the most replicas in place (an assignment problem). One candidate per layer is
chosen exactly (a dynamic programme over the total moves, a multiple-choice knapsack): the fewest
total moves such that the mean ``moe_lb`` stays within the tolerance, then the lowest mean. Layers
where balance is cheap take a tight result, layers where it costs many moves a loose one. The
fresh plan makes the mean target always reachable when the budgets allow it. Under the
hierarchical policy every level of every layer is re-planned. Under the global policy, where one
level's re-plan of a layer costs far more than the choice, a **level search** re-plans the
levels ``(2, 1.2, 0.8) * tolerance`` first, then repeats the choice, each time re-planning the two
levels on each side of the one chosen in every layer, until a choice adds none: the tight and
slow levels mostly where the choice wants them (``_replan_choice.mean_candidates``).
``"layer"``: every layer is re-planned once at ``t = tolerance``.

Per sub-problem (a layer under the global policy, a node of a layer under the hierarchical one)
and per-layer tolerance ``t``, with a target largest GPU load ``T = (1 + t) * max(bound, fresh)``
(``bound`` from
:func:`lbkit.eplb.lower_bound` of the sub-problem's new loads, hierarchical: the largest node
bound of the layer, so that lighter nodes stop earlier; ``fresh`` the largest GPU load of the
default method's fresh plan for the layer). A layer whose old plan is already within ``t`` of
the fresh plan's ``moe_lb`` is kept as it is (zero drift moves nothing):

1. **Counts** stay as they were unless a replica is too large for any GPU holding it to reach
   ``T``; then that expert gains a replica from the expert that loses least.
2. **Keep, then fill**: every other old replica stays; the new replicas fill the freed slots,
   largest first, each into the lightest GPU with a free slot.
3. **Exchange cycles**: GPUs above ``T`` are fixed by cycles that keep replica counts: ``m``
   GPUs above ``T`` each pass a replica to the next, larger than the one they receive by at
   least their excess, and a light GPU closes the cycle (``m + 1`` moves for ``m`` GPUs; the
   fixed-count lower bound on moves is ``H + k`` for ``H`` GPUs above ``T`` and ``k`` light
   GPUs whose room covers the excess). If some GPU stays above ``T``, the **excess descent**
   continues: the step that lowers the total excess ``sum_g max(0, load_g - T)`` most per
   move: a count change (one slot given from an expert with several replicas to another
   expert: one move), a swap of a replica of a GPU above ``T`` with a smaller one elsewhere
   (two moves), or a chain of exchanges. Only GPUs above ``T`` are ever unloaded; a local
   search on the most loaded GPU follows if the descent stops short.
4. The best state within the movement budget is kept (lowest largest load, then fewest moves),
   then moves that are not needed are given back (a swap or count change that saves a move
   and keeps every GPU at or below that load). A layer whose re-plan is not better than keeping
   the old plan under the new loads keeps the old plan (zero moves).

**Hierarchical policy**: groups stay on the node of the old plan unless that costs balance. The
rule: over every group-to-node assignment (``num_groups / num_nodes`` groups per node; when there
are more than 50 000 assignments, over those reached by exchanging pairs of groups from the old
one), let ``best`` be the smallest largest node load; the assignment kept is the one that moves
the fewest groups among those whose largest node load is at most ``(1 + regroup_tolerance) *
best`` (then the smaller largest node load, then enumeration order). If the layer then stays
above ``T`` and the fresh plan's assignment differs, the layer is also re-planned with the fresh
plan's assignment, kept if its largest GPU load is lower by more than ``t``. Moving a
group moves all of its replicas, typically an eighth of a layer's slots or more.

**Budgets**: ``max_moves`` caps moves per layer (candidates above it are dropped);
``max_moves_total`` caps their sum. With a total budget the candidates of every layer are those
of the mean mode at ``tolerance`` and at :data:`DEFAULT_TOLERANCE` (the default re-plan's), and
the re-plans at ``t = tolerance`` at a ladder of per-layer budgets (factors of 1.5 up to that
layer's moves); one candidate per layer is chosen exactly within the total (the dynamic
programme above, restricted to totals within the budget): the fewest moves reaching the mean
target if any choice within the budget does, else the lowest mean ``moe_lb``. The candidates do
not depend on the total, so a larger total never gives a mean ``moe_lb`` above both a smaller
one's and the target, nor above both the default re-plan's (when its moves fit) and the target.
:func:`replan_tradeoff` returns the curve of (moves, moe_lb) over a few budgets.

**Threads**: the layers are independent, so every round of re-plans runs on ``workers`` threads
(default: the CPUs the process may use); the kernels release the GIL, and the result is the
same for every number of threads. Under the hierarchical policy a layer's levels are re-planned
in one kernel call, so that threads are not held back by the Python around small kernels.

**The first re-plans of a process** (``LBKIT_JIT`` other than ``"inline"``, re-planning kernels
neither loaded nor in the disk cache): the searches would run as Python for minutes, so each
layer chooses only between its old row and the fresh plan matched to it, under the same rules
(``_replan_first``): seconds, valid and as balanced as a fresh plan, with more moves. The
background compiler starts on that call; once its kernels are on disk, re-plans search in full.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from lbkit.core.validation import as_int_array, check_choice, check_int, check_real
from lbkit.eplb._plan import EplbPlan, finish_plan, rebalance_iv
from lbkit.eplb._regroup import old_partition
from lbkit.eplb._replan_candidates import replan_all
from lbkit.eplb._replan_choice import DEFAULT_TOLERANCE, replan_mean, replan_total
from lbkit.eplb._replan_first import replan_kernels_ready, replan_matched
from lbkit.eplb._replan_layer import ReplanArgs
from lbkit.eplb._threads import resolve_workers
from lbkit.eplb.bounds import moe_lb

__all__ = [
    "DEFAULT_REGROUP_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "TOLERANCE_SCOPES",
    "ExpertMoves",
    "ReplanResult",
    "ReplanTradeoff",
    "apply_moves",
    "replan_experts",
    "replan_tradeoff",
]

#: Values of ``tolerance_scope=``: the tolerance bounds the mean over layers, or every layer.
TOLERANCE_SCOPES = ("mean", "layer")

#: Relative loss of node balance accepted to keep groups on their old nodes (hierarchical).
DEFAULT_REGROUP_TOLERANCE = 0.005


class ExpertMoves(NamedTuple):
    """The copies a transfer engine makes to go from the old plan to the new one.

    One entry per move, sorted by layer then slot; all arrays ``int64`` of the same length.

    Attributes
    ----------
    layer : ndarray
        Layer of the move.
    gpu : ndarray
        Destination GPU (``slot // S``).
    slot : ndarray
        Physical slot (column of ``phy2log``) that receives the expert.
    new_expert : ndarray
        Logical expert copied into the slot.
    old_expert : ndarray
        Logical expert the slot held in the old plan (the replica it replaces).
    source_gpu : ndarray
        A GPU that holds ``new_expert`` under the old plan: one that keeps it in the new plan if
        any, then one on the destination's node, lowest index among equals; ``-1`` if none.
    """

    layer: np.ndarray
    gpu: np.ndarray
    slot: np.ndarray
    new_expert: np.ndarray
    old_expert: np.ndarray
    source_gpu: np.ndarray


class ReplanResult(NamedTuple):
    """Result of :func:`replan_experts`.

    Attributes
    ----------
    plan : EplbPlan
        The new plan (torch tensors when ``weight`` was one).
    moves : ExpertMoves
        The moves, ``len(moves.slot) == num_moves.sum()``.
    num_moves : ndarray of int64, shape (layers,)
        Moves per layer.
    moe_lb : ndarray of float64, shape (layers,)
        ``moe_lb`` of the new plan under the new loads.
    previous_moe_lb : ndarray of float64, shape (layers,)
        ``moe_lb`` of the old plan under the new loads (what keeping it would give).
    regrouped : ndarray of bool, shape (layers,)
        Layers whose group-to-node assignment changed (hierarchical policy).
    """

    plan: EplbPlan
    moves: ExpertMoves
    num_moves: np.ndarray
    moe_lb: np.ndarray
    previous_moe_lb: np.ndarray
    regrouped: np.ndarray


class ReplanTradeoff(NamedTuple):
    """Moves against balance over total budgets (:func:`replan_tradeoff`); arrays of one length.

    Attributes
    ----------
    max_moves_total : ndarray of int64
        Total budget.
    num_moves : ndarray of int64
        Moves made (at most the budget).
    mean_moe_lb, worst_moe_lb : ndarray of float64
        Mean and largest ``moe_lb`` over layers under the new loads.
    """

    max_moves_total: np.ndarray
    num_moves: np.ndarray
    mean_moe_lb: np.ndarray
    worst_moe_lb: np.ndarray


def replan_iv(
    weight: Any,
    previous_phy2log: Any,
    num_replicas: Any,
    num_groups: Any,
    num_nodes: Any,
    num_gpus: Any,
    policy: Any,
    max_moves: Any,
    max_moves_total: Any,
    tolerance: Any,
    regroup_tolerance: Any,
    tolerance_scope: Any = "mean",
    workers: Any = None,
) -> ReplanArgs:
    problem = rebalance_iv(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    layers, experts = problem.weight.shape
    slots = problem.num_replicas
    prev = np.array(as_int_array(previous_phy2log, "previous_phy2log", ndim=2))  # own copy
    if prev.shape != (layers, slots):
        raise ValueError(
            f"previous_phy2log: must have shape (layers, num_replicas) = ({layers}, {slots}), "
            f"got {prev.shape}"
        )
    if prev.min() < 0 or prev.max() >= experts:
        bad = np.argwhere((prev < 0) | (prev >= experts))[0]
        raise ValueError(
            f"previous_phy2log: slots must name experts in [0, {experts}) (layer {bad[0]}, slot "
            f"{bad[1]} holds {prev[bad[0], bad[1]]})"
        )
    held = np.zeros((layers, experts), dtype=np.int64)
    np.add.at(held, (np.repeat(np.arange(layers), slots), prev.ravel()), 1)
    if (held == 0).any():
        layer, expert = (int(i) for i in np.argwhere(held == 0)[0])
        raise ValueError(
            f"previous_phy2log: every expert needs a replica (layer {layer} has none of expert "
            f"{expert})"
        )
    if problem.hierarchical:
        old_partition(prev, experts, int(num_groups), int(num_nodes))  # raises if invalid
    if max_moves is None:
        budget = np.full(layers, slots, dtype=np.int64)
    elif np.ndim(max_moves) == 0:
        budget = np.full(layers, check_int(max_moves, "max_moves", min_value=0), dtype=np.int64)
    else:
        budget = as_int_array(max_moves, "max_moves", shape=(layers,), min_value=0)
    budget = np.minimum(budget, slots)
    total = None
    if max_moves_total is not None:
        total = check_int(max_moves_total, "max_moves_total", min_value=0)
    tolerance = check_real(tolerance, "tolerance", min_value=0.0)
    regroup_tolerance = check_real(regroup_tolerance, "regroup_tolerance", min_value=0.0)
    scope = check_choice(tolerance_scope, "tolerance_scope", TOLERANCE_SCOPES)
    workers = resolve_workers(workers, layers)
    return ReplanArgs(
        problem,
        prev,
        budget,
        total,
        tolerance,
        scope,
        regroup_tolerance,
        int(num_groups),
        int(num_nodes),
        workers,
    )


def moves_list(prev: np.ndarray, new: np.ndarray, num_gpus: int, num_nodes: int) -> ExpertMoves:
    slots = prev.shape[1]
    layers = prev.shape[0]
    per_gpu = slots // num_gpus
    gpus_per_node = num_gpus // max(num_nodes, 1)
    layer_idx, slot_idx = np.nonzero(prev != new)
    gpu_of_slot = np.arange(slots) // per_gpu
    experts = int(max(prev.max(), new.max())) + 1 if prev.size else 1
    held = np.zeros((layers, num_gpus, experts), dtype=bool)  # under the old plan
    kept = np.zeros((layers, num_gpus, experts), dtype=bool)  # under the new plan
    rows = np.repeat(np.arange(layers), slots)
    held[rows, np.tile(gpu_of_slot, layers), prev.ravel()] = True
    kept[rows, np.tile(gpu_of_slot, layers), new.ravel()] = True
    e = new[layer_idx, slot_idx]
    dest_node = gpu_of_slot[slot_idx] // gpus_per_node
    same = (np.arange(num_gpus) // gpus_per_node)[None, :] == dest_node[:, None]
    # the source: a GPU that held the expert; one that keeps it first, then one on the
    # destination's node, then the lowest GPU (argmax takes the first of the largest)
    rank = held[layer_idx, :, e] * (4 * kept[layer_idx, :, e] + 2 * same + 1)
    src = np.where(rank.max(axis=1) > 0, rank.argmax(axis=1), -1) if len(e) else e.copy()
    return ExpertMoves(
        layer_idx.astype(np.int64),
        (slot_idx // per_gpu).astype(np.int64),
        slot_idx.astype(np.int64),
        new[layer_idx, slot_idx],
        prev[layer_idx, slot_idx],
        src.astype(np.int64),
    )


def replan_experts(
    weight: Any,
    previous_phy2log: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    policy: str | None = None,
    max_moves: Any = None,
    max_moves_total: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    tolerance_scope: str = "mean",
    regroup_tolerance: float = DEFAULT_REGROUP_TOLERANCE,
    workers: int | None = None,
) -> ReplanResult:
    """Plan replicas for new loads starting from ``previous_phy2log``, moving few replicas.

    Parameters
    ----------
    weight : array_like or torch.Tensor, shape (layers, experts)
        New load of each logical expert, as in :func:`lbkit.eplb.rebalance_experts`.
    previous_phy2log : array_like of int, shape (layers, num_replicas)
        The plan in service: expert held by each physical slot. Every expert must have a slot in
        every layer; under the hierarchical policy every group must sit on one node with
        ``num_groups / num_nodes`` groups per node.
    num_replicas, num_groups, num_nodes, num_gpus : int
        As in :func:`lbkit.eplb.rebalance_experts` (same validation and policy rule).
    policy : {None, "global", "hierarchical"}
        As in :func:`lbkit.eplb.rebalance_experts`.
    max_moves : int or array_like of int, shape (layers,), optional
        Moves allowed per layer (default: unlimited). ``0`` keeps the old plan.
    max_moves_total : int, optional
        Moves allowed over all layers (default: unlimited); combined with ``max_moves``. The
        fewest moves reaching the tolerance target within it, else the lowest mean ``moe_lb``
        within it (module docstring); never worse than the default re-plan when that one fits.
    tolerance : float, default :data:`DEFAULT_TOLERANCE`
        Relative gap to a fresh default plan on the new loads that the re-plan may keep: of
        the mean ``moe_lb`` over layers (``tolerance_scope="mean"``), or the per-layer target
        of every sub-problem, ``max(lower bound, fresh plan)`` (``"layer"``; module docstring).
    tolerance_scope : {"mean", "layer"}, default "mean"
        ``"mean"``: fewest moves with ``mean(moe_lb) <= (1 + tolerance) * mean(fresh moe_lb)``
        (guaranteed unless ``max_moves`` excludes the fresh plan for a layer); ``"layer"``:
        one re-plan per layer at the tolerance (three to eleven times faster, more moves).
    regroup_tolerance : float, default :data:`DEFAULT_REGROUP_TOLERANCE`
        Hierarchical policy: node balance given up to keep groups on their nodes (module
        docstring).
    workers : int, optional
        Threads re-planning layers at once, at most one per layer; the result does not depend
        on them. Default: the CPUs this process may run on (the layers are independent and the
        kernels release the GIL; for 58 × 256 on 2 cores, 2 threads take 0.55-0.62 of one
        thread's time under the global policy, 0.77-0.78 under the hierarchical one).

    Returns
    -------
    ReplanResult
        ``plan`` (a valid placement), ``moves`` (one entry per move; applying them to the old
        plan gives the new one, see :func:`apply_moves`), ``num_moves``, ``moe_lb`` and
        ``previous_moe_lb`` per layer, ``regrouped``. Per layer, ``moe_lb <=
        previous_moe_lb`` (strictly where replicas move), ``num_moves <= max_moves`` and the
        sum is at most ``max_moves_total``.

    Raises
    ------
    TypeError
        Non-numeric arrays or non-integer sizes or budgets.
    ValueError
        Everything :func:`lbkit.eplb.rebalance_experts` rejects; ``previous_phy2log`` of the
        wrong shape, naming unknown experts, missing an expert or (hierarchical) splitting a
        group across nodes; negative budgets or tolerances; an unknown ``tolerance_scope``.

    Notes
    -----
    Until the re-planning kernels are compiled (``LBKIT_JIT`` other than ``"inline"``), each
    layer chooses between its old row and the fresh plan matched to it, under the same rules:
    seconds instead of minutes, as balanced as a fresh plan, more moves (module docstring).
    ``lbkit.warmup()`` compiles them beforehand.

    Runtime complexity: per sub-problem (``G`` GPUs of ``S`` slots, ``E`` experts) and per-layer
    tolerance, O(C × G² × S²) for ``C`` exchange cycles, plus O(U × (G × S × E + H × G × S² ×
    8)) for ``U <= G × S + 8`` steps of each search (excess descent, local search, give-back;
    only where the cycles fall short, ``H`` GPUs above the target); times up to twelve per-layer
    tolerances in the mean scope, plus the fresh plan, the lower bound and O(layers × 14 ×
    total moves) for the choice (up to twelve times with the level search); with
    ``max_moves_total``, the mean scope twice (at ``tolerance`` and the default) plus about
    ``log1.5(moves per layer)`` times the layer scope.

    Examples
    --------
    >>> import numpy as np
    >>> from lbkit.eplb import rebalance_experts, synthetic_expert_load, drift
    >>> w = synthetic_expert_load(4, 64, rng=0)
    >>> old = rebalance_experts(w, 80, 8, 2, 16, policy="global")
    >>> new_w = drift(w, sigma=0.1, rng=1)
    >>> r = replan_experts(new_w, old.phy2log, 80, 8, 2, 16, policy="global")
    >>> bool((r.moe_lb <= r.previous_moe_lb).all()), int(r.num_moves.sum()) < 4 * 80 // 4
    (True, True)
    >>> fresh = rebalance_experts(new_w, 80, 8, 2, 16, policy="global").phy2log
    >>> bool(r.moe_lb.mean() <= 1.01 * moe_lb(new_w, fresh, num_gpus=16).mean())
    True
    >>> bool(np.array_equal(apply_moves(old.phy2log, r.moves), r.plan.phy2log))
    True
    """
    args = replan_iv(
        weight,
        previous_phy2log,
        num_replicas,
        num_groups,
        num_nodes,
        num_gpus,
        policy,
        max_moves,
        max_moves_total,
        tolerance,
        regroup_tolerance,
        tolerance_scope,
        workers,
    )
    p = args.problem
    if not replan_kernels_ready():  # the first calls of a process: see _replan_first
        phy2log, moves, regrouped = replan_matched(args)
    elif args.total is not None:
        phy2log, moves, regrouped = replan_total(args)
    elif args.scope == "mean":
        phy2log, moves, regrouped = replan_mean(args, args.budget)
    else:
        phy2log, moves, regrouped = replan_all(args, args.budget)
    logcnt = np.zeros_like(p.weight, dtype=np.int64)
    layers, slots = phy2log.shape
    np.add.at(logcnt, (np.repeat(np.arange(layers), slots), phy2log.ravel()), 1)
    plan = finish_plan(p, phy2log, logcnt)
    return ReplanResult(
        plan,
        moves_list(args.previous, phy2log, p.num_gpus, args.num_nodes),
        moves,
        moe_lb(p.weight, phy2log, num_gpus=p.num_gpus),
        moe_lb(p.weight, args.previous, num_gpus=p.num_gpus),
        regrouped,
    )


def apply_moves(previous_phy2log: Any, moves: ExpertMoves, /) -> np.ndarray:
    """Apply a move list to the old ``phy2log`` (a transfer engine's job, for checking).

    Raises ``ValueError`` when a move's ``old_expert`` is not what the slot holds.

    Examples
    --------
    >>> moves = ExpertMoves(*(np.array([v]) for v in (0, 1, 2, 0, 1, 0)))
    >>> apply_moves([[0, 1, 1, 1]], moves)
    array([[0, 1, 0, 1]])
    """
    out = as_int_array(previous_phy2log, "previous_phy2log", ndim=2).copy()
    if len(moves.layer) and (out[moves.layer, moves.slot] != moves.old_expert).any():
        raise ValueError("moves: old_expert must be what previous_phy2log holds in the slot")
    out[moves.layer, moves.slot] = moves.new_expert
    return out


def replan_tradeoff(
    weight: Any,
    previous_phy2log: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    /,
    *,
    fractions: Any = (0.0, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
    policy: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    tolerance_scope: str = "mean",
    regroup_tolerance: float = DEFAULT_REGROUP_TOLERANCE,
) -> ReplanTradeoff:
    """Moves against balance: :func:`replan_experts` at total budgets of ``fractions`` of all
    replicas (``layers × num_replicas``).

    Runtime complexity: ``len(fractions)`` calls of :func:`replan_experts` with a total budget.

    Examples
    --------
    >>> from lbkit.eplb import rebalance_experts, synthetic_expert_load, drift
    >>> w = synthetic_expert_load(4, 64, rng=0)
    >>> old = rebalance_experts(w, 80, 8, 2, 16, policy="global").phy2log
    >>> t = replan_tradeoff(drift(w, sigma=0.3, rng=1), old, 80, 8, 2, 16, policy="global",
    ...                     fractions=(0.0, 0.05, 1.0))
    >>> int(t.num_moves[0]), bool(t.mean_moe_lb[2] <= t.mean_moe_lb[0])
    (0, True)
    """
    rows = []
    layers = np.shape(previous_phy2log)[0] if np.ndim(previous_phy2log) == 2 else 0
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.ndim != 1 or len(fr) == 0 or (fr < 0).any() or not np.isfinite(fr).all():
        raise ValueError("fractions: must be a non-empty 1-D sequence of non-negative numbers")
    for f in fr.tolist():
        total = math.floor(f * layers * int(num_replicas))
        r = replan_experts(
            weight,
            previous_phy2log,
            num_replicas,
            num_groups,
            num_nodes,
            num_gpus,
            policy=policy,
            max_moves_total=total,
            tolerance=tolerance,
            tolerance_scope=tolerance_scope,
            regroup_tolerance=regroup_tolerance,
        )
        rows.append((total, int(r.num_moves.sum()), float(r.moe_lb.mean()), float(r.moe_lb.max())))
    cols = list(zip(*rows, strict=True))
    return ReplanTradeoff(
        np.array(cols[0], dtype=np.int64),
        np.array(cols[1], dtype=np.int64),
        np.array(cols[2]),
        np.array(cols[3]),
    )
