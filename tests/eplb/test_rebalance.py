"""rebalance_experts: DeepSeek's README example, the greedy method against a plain-Python oracle,
validity of every plan, the default never worse than greedy and never better than the bound,
metamorphic properties, duplicates, the hierarchical node partition, torch in and out."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lbkit.eplb import (
    DEFAULT_METHOD,
    METHODS,
    check_placement,
    lower_bound,
    moe_lb,
    rebalance_experts,
)
from lbkit.eplb.balanced import STOP_GAP

from .oracle import greedy_oracle, max_gpu_load
from .strategies import instances

README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def _check(plan, weight, num_groups, num_nodes, num_gpus, policy):
    check_placement(
        *plan,
        num_experts=np.shape(weight)[1],
        num_gpus=num_gpus,
        num_groups=num_groups,
        num_nodes=num_nodes,
        policy=policy,
    )


def test_greedy_reproduces_deepseek_readme_example():
    plan = rebalance_experts(README_WEIGHT, 16, 4, 2, 8, method="greedy")
    assert plan.phy2log.tolist() == README_PHY2LOG
    assert plan.logcnt.sum(axis=1).tolist() == [16, 16]
    _check(plan, README_WEIGHT, 4, 2, 8, "hierarchical")
    phy2log, log2phy, logcnt = plan  # unpacks like DeepSeek's tuple
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == np.int64


def test_methods_mapping_and_default():
    assert set(METHODS) == {"greedy", "default"}
    assert DEFAULT_METHOD == "default"


@given(instances(tie_free=False))
def test_greedy_equals_plain_python_oracle_in_float32(inst):
    weight, r, k, n, g, policy = inst
    plan = rebalance_experts(weight, r, k, n, g, method="greedy", policy=policy)
    p2l, rank, cnt = greedy_oracle(
        weight, r, k, n, g, hierarchical=policy == "hierarchical", dtype=np.float32
    )
    assert np.array_equal(plan.phy2log, p2l)
    assert np.array_equal(plan.logcnt, cnt)
    expect = np.full(plan.log2phy.shape, -1)
    for layer, slot in itertools.product(range(len(p2l)), range(r)):
        expect[layer, p2l[layer, slot], rank[layer, slot]] = slot
    assert np.array_equal(plan.log2phy, expect)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "shape", [(2, 256, 288, 8, 4, 32), (2, 256, 320, 8, 8, 64), (2, 64, 80, 8, 2, 16)]
)
def test_greedy_equals_oracle_at_deepseek_sizes(seed, shape):
    layers, experts, r, k, n, g = shape
    weight = np.random.default_rng(seed).lognormal(0, 1.0, (layers, experts)) * 1000
    for policy in ("global", "hierarchical"):
        plan = rebalance_experts(weight, r, k, n, g, method="greedy", policy=policy)
        p2l, _, cnt = greedy_oracle(
            weight, r, k, n, g, hierarchical=policy == "hierarchical", dtype=np.float32
        )
        assert np.array_equal(plan.phy2log, p2l) and np.array_equal(plan.logcnt, cnt)


@pytest.mark.parametrize("method", sorted(METHODS))
@given(inst=instances())
def test_every_plan_is_valid(method, inst):
    weight, r, k, n, g, policy = inst
    plan = rebalance_experts(weight, r, k, n, g, method=method, policy=policy)
    _check(plan, weight, k, n, g, policy)
    assert plan.phy2log.shape == (len(weight), r)
    assert plan.log2phy.shape[2] == plan.logcnt.max()


@pytest.mark.parametrize("method", sorted(METHODS))
@given(inst=instances(max_layers=9))
def test_threads_do_not_change_the_plan(method, inst):
    """Blocks of layers planned on several threads give the plan of one thread."""
    weight, r, k, n, g, policy = inst
    one = rebalance_experts(weight, r, k, n, g, method=method, policy=policy, workers=1)
    for workers in (2, 3):
        many = rebalance_experts(weight, r, k, n, g, method=method, policy=policy, workers=workers)
        for a, b in zip(one, many, strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize(("experts", "replicas", "gpus"), [(64, 128, 64), (64, 96, 16)])
def test_threads_do_not_change_the_plan_at_engine_sizes(experts, replicas, gpus):
    """Two slots per GPU (the pairing search) and six (the count search), 12 layers."""
    weight = np.random.default_rng(7).lognormal(0.0, 1.0, size=(12, experts))
    one = rebalance_experts(weight, replicas, 8, 1, gpus, workers=1)
    two = rebalance_experts(weight, replicas, 8, 1, gpus, workers=2)
    assert np.array_equal(one.phy2log, two.phy2log)


@pytest.mark.parametrize(
    ("workers", "error"), [(0, ValueError), (1.5, TypeError), ("2", TypeError)]
)
def test_bad_workers_are_refused(workers, error):
    with pytest.raises(error, match="workers"):
        rebalance_experts(README_WEIGHT, 16, 4, 2, 8, workers=workers)


@given(inst=instances())
def test_default_is_never_worse_than_greedy_and_never_beats_the_bound(inst):
    weight, r, k, n, g, policy = inst
    ours = rebalance_experts(weight, r, k, n, g, policy=policy)
    greedy = rebalance_experts(weight, r, k, n, g, method="greedy", policy=policy)
    lb = lower_bound(weight, r, k, n, g, policy=policy)
    ours_lb = moe_lb(weight, ours.phy2log, num_gpus=g)
    greedy_lb = moe_lb(weight, greedy.phy2log, num_gpus=g)
    assert (ours_lb <= greedy_lb * (1 + 1e-9)).all()
    assert (ours_lb >= lb * (1 - 1e-9)).all()
    assert (greedy_lb >= lb * (1 - 1e-9)).all()
    assert (lb >= 1.0).all()


@given(inst=instances(tie_free=True), scale=st.sampled_from([2.0**-10, 0.5, 8.0, 2.0**14]))
def test_scaling_loads_by_a_power_of_two_changes_nothing(inst, scale):
    """A power of two scales every load exactly: the plan is the same, slot for slot."""
    weight, r, k, n, g, policy = inst
    base = rebalance_experts(weight, r, k, n, g, policy=policy)
    again = rebalance_experts(weight * scale, r, k, n, g, policy=policy)
    np.testing.assert_array_equal(again.phy2log, base.phy2log)
    np.testing.assert_array_equal(
        lower_bound(weight * scale, r, k, n, g, policy=policy),
        lower_bound(weight, r, k, n, g, policy=policy),
    )


@given(inst=instances(tie_free=True), scale=st.sampled_from([1e-3, 7.0, 1e4]))
@example(
    inst=(
        np.array([
            [721.8805542, 916.34838867, 2297.59277344, 1390.37548828, 440.12405396,
             997.4017334, 732.17779541, 1077.14685059, 447.4932251, 1128.49621582,
             1124.89587402, 2198.58300781],
            [1171.54394531, 1290.81433105, 473.99508667, 3084.42285156, 383.72744751,
             1734.81530762, 847.93438721, 643.82824707, 720.26037598, 714.61785889,
             1209.3638916, 946.45739746],
        ]),
        36, 6, 3, 9, "global",
    ),
    scale=0.001,
)  # fmt: skip
def test_scaling_loads_keeps_the_balance(inst, scale):
    """Other scales round every load: the search may end at another plan of about the same
    balance, never beyond 0.1% (pinned: at 1e-3 the second layer's plan moved from 1.003105 to
    1.003463 of the mean), and the lower bound stays the same."""
    weight, r, k, n, g, policy = inst
    base = moe_lb(weight, rebalance_experts(weight, r, k, n, g, policy=policy).phy2log, num_gpus=g)
    scaled = weight * scale
    again = rebalance_experts(scaled, r, k, n, g, policy=policy)
    assert np.allclose(moe_lb(scaled, again.phy2log, num_gpus=g), base, rtol=1e-3)
    assert np.allclose(
        lower_bound(scaled, r, k, n, g, policy=policy),
        lower_bound(weight, r, k, n, g, policy=policy),
        rtol=1e-6,
    )


@given(inst=instances(tie_free=True, policy="global"), seed=st.integers(0, 1000))
def test_permuting_experts_and_layers_keeps_the_balance(inst, seed):
    weight, r, k, n, g, policy = inst
    rng = np.random.default_rng(seed)
    perm = np.stack([rng.permutation(weight.shape[1]) for _ in weight])
    shuffled = np.take_along_axis(weight, perm, axis=1)[rng.permutation(len(weight))]
    a = moe_lb(weight, rebalance_experts(weight, r, k, n, g, policy=policy).phy2log, num_gpus=g)
    plan = rebalance_experts(shuffled, r, k, n, g, policy=policy)
    b = moe_lb(shuffled, plan.phy2log, num_gpus=g)
    assert np.allclose(np.sort(a), np.sort(b), rtol=1e-6)


def test_idle_layers_get_a_valid_plan_without_duplicates():
    weight = np.zeros((2, 16))
    weight[1, 3] = 5.0
    for method in METHODS:
        plan = rebalance_experts(weight, 32, 4, 2, 8, method=method, policy="global")
        _check(plan, weight, 4, 2, 8, "global")
        assert moe_lb(weight, plan.phy2log, num_gpus=8)[0] == 1.0
    plan = rebalance_experts(weight, 32, 4, 2, 8, policy="global")
    per_gpu = plan.phy2log[0].reshape(8, 4)
    assert all(len(set(row)) == 4 for row in per_gpu)  # idle: spread, no duplicates


def _duplicates(phy2log, num_gpus):
    rows = np.asarray(phy2log).reshape(len(phy2log), num_gpus, -1)
    return sum(len(r) - len(set(r.tolist())) for layer in rows for r in layer)


@pytest.mark.parametrize("seed", range(6))
def test_far_fewer_duplicates_than_greedy(seed):
    """Replica counts stay below the GPU count, so duplicates are avoidable: lbkit's local
    search never creates one and its packing avoids them where a GPU without the expert has
    room, so it places (almost) none, far fewer than greedy's packing."""
    rng = np.random.default_rng(seed)
    weight = rng.lognormal(0, 1.0, (4, 64)) * 100
    plan = rebalance_experts(weight, 320, 8, 1, 64, policy="global")
    greedy = rebalance_experts(weight, 320, 8, 1, 64, method="greedy", policy="global")
    keep = plan.logcnt.max(axis=1) <= 64  # layers where every expert fits on distinct GPUs
    assert keep.any()
    assert _duplicates(plan.phy2log[keep], 64) <= 2 < _duplicates(greedy.phy2log[keep], 64)


@pytest.mark.parametrize(("experts", "gpus", "count"), [(6, 3, 30), (8, 4, 8)])
def test_duplicates_only_where_no_duplicate_free_plan_is_as_good(experts, gpus, count):
    """Sub-problems of at most ``EXACT_MAX_REPLICAS`` replicas (here 6 to 12): wherever the
    default places two replicas of one expert on a GPU, CP-SAT proves that no duplicate-free
    plan reaches the same largest load; and the default matches the exact optimum."""
    pytest.importorskip("ortools")
    from lbkit.eplb._exact import EXACT_MAX_REPLICAS
    from lbkit.eplb._reference import optimal_max_load

    rng = np.random.default_rng(experts)
    checked = 0
    for _ in range(count):
        slots = int(rng.integers(2, 4))
        assert gpus * slots <= EXACT_MAX_REPLICAS
        w = rng.lognormal(0, 1.5, experts) * 100
        plan = rebalance_experts(w[None], gpus * slots, 1, 1, gpus, policy="global")
        ours = max_gpu_load(w[None], plan.phy2log, plan.logcnt, gpus)[0]
        opt, proven = optimal_max_load(
            w, num_gpus=gpus, slots=slots, upper_bound=ours, time_limit_s=120
        )
        assert proven and ours <= opt * (1 + STOP_GAP + 1e-9)  # the search stops within STOP_GAP
        if _duplicates(plan.phy2log, gpus) == 0:
            continue
        value, proven = optimal_max_load(
            w, num_gpus=gpus, slots=slots, forbid_duplicates=True, max_load=ours, time_limit_s=120
        )
        assert proven
        assert value == float("inf"), f"a duplicate-free plan reaches {ours} for {w.tolist()}"
        checked += 1
    assert checked >= 1  # the instances do force duplicates sometimes


def _zipf_hot_node(seed: int) -> np.ndarray:
    """The hottest group (32 experts) of a Zipf-1.0 layer of 256 experts in 8 groups."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, 257) ** -1.0
    p /= p.sum()
    w = rng.multinomial(1_600_000, rng.permutation(p)).astype(float)
    groups = w.reshape(8, 32)
    return groups[np.argmax(groups.sum(axis=1))]


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_hot_zipf_node_is_within_two_percent_of_the_optimum(seed):
    """The hottest node of a Zipf-1.0 layer under the hierarchical policy (32 experts, one of
    them over 60% of the load, 8 GPUs of 5 slots, beyond the exact search): the default is
    within 2% of the optimum, proven by the lower bound or else by CP-SAT (no plan 2% lower).
    The min-max apportionment puts the hot expert on 7 GPUs; the plans found without the
    second start were 13-20% above the bound on these nodes."""
    w = _zipf_hot_node(seed)
    plan = rebalance_experts(w[None], 40, 1, 1, 8, policy="global")
    ours = max_gpu_load(w[None], plan.phy2log, plan.logcnt, 8)[0]
    bound = lower_bound(w[None], 40, 1, 1, 8, policy="global")[0] * w.sum() / 8
    assert ours >= bound * (1 - 1e-9)
    if ours <= bound * 1.02:
        return
    pytest.importorskip("ortools")
    from lbkit.eplb._reference import optimal_max_load

    value, proven = optimal_max_load(
        w, num_gpus=8, slots=5, max_load=ours / 1.02, upper_bound=ours, time_limit_s=120
    )
    assert proven and value == float("inf"), f"a plan 2% below {ours} exists for seed {seed}"


@pytest.mark.parametrize("seed", range(8))
def test_hierarchical_default_uses_the_best_group_partition(seed):
    """The node loads of the default plan are those of an optimal group-to-node partition."""
    rng = np.random.default_rng(seed)
    weight = rng.lognormal(0, 1.0, (1, 64)) * 100
    num_groups, num_nodes, num_gpus = 8, 4, 16
    plan = rebalance_experts(weight, 96, num_groups, num_nodes, num_gpus, policy="hierarchical")
    node_load = np.bincount(
        np.arange(96) // 24,
        weights=(weight[0] / plan.logcnt[0])[plan.phy2log[0]],
        minlength=num_nodes,
    )
    group_load = weight[0].reshape(num_groups, -1).sum(axis=1)
    best = min(
        max(group_load[list(p[i : i + 2])].sum() for i in range(0, 8, 2))
        for p in itertools.permutations(range(8))
        if all(p[i] < p[i + 1] for i in range(0, 8, 2))
    )
    assert node_load.max() == pytest.approx(best, rel=1e-9)


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    weight = torch.tensor(README_WEIGHT, dtype=torch.float32)
    for method in METHODS:
        plan = rebalance_experts(weight, 16, 4, 2, 8, method=method)
        assert all(isinstance(a, torch.Tensor) and a.dtype == torch.int64 for a in plan)
        numpy_plan = rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8, method=method)
        for a, b in zip(plan, numpy_plan, strict=True):
            assert np.array_equal(a.numpy(), b)
