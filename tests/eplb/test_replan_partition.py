"""Group-to-node assignments of the hierarchical re-plan: the enumeration against brute force,
its size, and single-expert groups (many assignments from few groups) re-planned at once."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lbkit.eplb import check_placement, moe_lb, rebalance_experts, replan_experts
from lbkit.eplb._regroup import MAX_ASSIGNMENTS, all_assignments, choose_partitions


def rule_by_brute_force(group_load, old, nodes, tol):
    """The module's rule, one layer at a time over every assignment: fewest groups moved among
    those whose largest node load is within ``tol`` of the best, then the smaller largest node
    load, then enumeration order."""
    cands = all_assignments(group_load.shape[1], nodes)
    out = []
    for w, o in zip(group_load, old, strict=True):
        top = np.array([max(w[c == n].sum() for n in range(nodes)) for c in cands])
        best = top.min()
        ok = top <= best * (1 + tol) + 1e-12 * max(best, 1.0)
        keys = [(int((c != o).sum()) if ok[a] else 10**9, top[a], a) for a, c in enumerate(cands)]
        out.append(cands[min(keys)[2]])
    return np.array(out)


@pytest.mark.parametrize(("groups", "nodes"), [(4, 2), (6, 3), (8, 4)])
@pytest.mark.parametrize("tol", [0.0, 0.01, 0.05])
def test_partitions_of_all_layers_at_once_follow_the_rule(groups, nodes, tol):
    """choose_partitions (every layer at once) against the rule layer by layer, with equal
    group loads and equal layers among random ones (ties)."""
    rng = np.random.default_rng(groups * 100 + nodes)
    load = np.round(rng.lognormal(0, 1, (12, groups)) * 8)  # small integers: exact sums, ties
    load[3] = load[4]
    load[5] = 7.0
    cands = all_assignments(groups, nodes)
    old = cands[rng.integers(0, len(cands), 12)]
    np.testing.assert_array_equal(
        choose_partitions(load, old, nodes, tol), rule_by_brute_force(load, old, nodes, tol)
    )


@pytest.mark.parametrize(
    ("groups", "nodes"), [(1, 1), (2, 1), (2, 2), (4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3)]
)
def test_assignments_are_the_distinct_permutations_in_order(groups, nodes):
    base = np.repeat(np.arange(nodes), groups // nodes).tolist()
    brute = np.array(sorted(set(itertools.permutations(base))), dtype=np.int64)
    np.testing.assert_array_equal(all_assignments(groups, nodes), brute)


@pytest.mark.parametrize(("groups", "nodes"), [(12, 2), (12, 3), (15, 3), (16, 8), (20, 2)])
def test_assignments_are_counted_not_enumerated_from_permutations(groups, nodes):
    """12 groups on 2 nodes have 924 assignments but 12! = 479 001 600 permutations: the
    enumeration builds only the assignments (each row distinct, each node ``per`` times)."""
    per = groups // nodes
    count = math.factorial(groups) // math.factorial(per) ** nodes
    got = all_assignments(groups, nodes)
    if count > MAX_ASSIGNMENTS:
        assert got is None
        return
    assert got.shape == (count, groups)
    assert (np.apply_along_axis(np.bincount, 1, got, minlength=nodes) == per).all()
    assert len(np.unique(got, axis=0)) == count
    assert (np.diff(got @ (nodes ** np.arange(groups - 1, -1, -1))) > 0).all()  # lexicographic


def test_single_expert_groups_on_two_nodes_replan():
    """12 groups of one expert on 2 nodes (one GPU each), no redundancy: once a minutes-long
    enumeration of 12! permutations for the 924 assignments."""
    rng = np.random.default_rng(0)
    w_old = rng.integers(0, 1000, (1, 12))
    w_new = rng.integers(0, 1000, (1, 12))
    old = rebalance_experts(w_old, 12, 12, 2, 2).phy2log
    res = replan_experts(w_new, old, 12, 12, 2, 2)
    check_placement(*res.plan, num_experts=12, num_gpus=2, num_groups=12, num_nodes=2,
                    policy="hierarchical")  # fmt: skip
    assert (res.moe_lb <= res.previous_moe_lb).all()
    fresh = rebalance_experts(w_new, 12, 12, 2, 2).phy2log
    assert res.moe_lb.mean() <= 1.01 * moe_lb(w_new, fresh, num_gpus=2).mean() + 1e-12
