"""lbkit.integrations.sglang against SGLang 0.5.23's EPLB algorithm interface (``engines.py``).

The exact signature of SGLang's dispatcher, registration (lbkit for the ``deepseek*``
algorithms, SGLang's own for the others) and the plugin, a plan computed the way
``init_by_eplb`` asks for it (torch in and out, shapes, dtypes, a valid plan, SGLang's padding),
few moves when re-planning from the plan in service, agreement with lbkit's own EPLB functions,
and clear errors for bad input.
"""

from __future__ import annotations

import inspect
import sys

import numpy as np
import pytest

from lbkit.eplb import drift, moe_lb, rebalance_experts, replan_experts, synthetic_expert_load
from lbkit.integrations import sglang as adapter
from lbkit.integrations.sglang import LBKIT_ALGORITHMS, load_plugin, register, unregister

from . import engines
from .checks import check_map, moves
from .engines import SGLANG_VERSION, EplbAlgorithm, normalised_signature

# (layers, experts, num_physical_experts, ep_size, num_groups, num_nodes)
SIZES = (4, 32, 48, 8, 4, 2)


def _counts(torch, seed=0, windows=3, sizes=SIZES):
    layers, experts = sizes[:2]
    w = synthetic_expert_load(layers, experts, rng=seed)
    parts = np.random.default_rng(seed).dirichlet(np.ones(windows), size=(layers, experts))
    per_window = np.rint(np.moveaxis(parts, -1, 0) * w)  # (windows, layers, experts) counts
    return torch.tensor(per_window, dtype=torch.int64)


def test_signature_is_sglangs(sglang):
    theirs = normalised_signature(engines.rebalance_experts)
    assert normalised_signature(adapter.rebalance_experts) == theirs
    register()
    installed = sglang.algorithms.rebalance_experts
    assert [p.name for p in inspect.signature(installed).parameters.values()] == list(
        theirs.parameters
    )
    assert adapter.SGLANG_VERSION_CHECKED == SGLANG_VERSION


def test_lbkit_covers_the_deepseek_algorithms():
    names = {a.name for a in EplbAlgorithm}
    assert set(LBKIT_ALGORITHMS) == {n for n in names if n.startswith("deepseek")}
    for name, policy in LBKIT_ALGORITHMS.items():
        assert policy == ("hierarchical" if name.endswith("_hierarchical") else "global")


@pytest.mark.parametrize("raw", ["auto", "deepseek", "deepseek_vec_hierarchical"])
def test_a_plan_as_init_by_eplb_asks_for_it(sglang, torch, raw):
    layers, experts, slots, ep_size, groups, nodes = SIZES
    register()
    counts = _counts(torch)
    meta = sglang.init_by_eplb(
        counts,
        num_physical_experts=slots,
        ep_size=ep_size,
        num_groups=groups,
        num_nodes=nodes,
        raw_algorithm=raw,
    )
    assert engines.SGLANG_CALLS == []  # SGLang's own planner was not asked
    p2l, l2p = meta.physical_to_logical_map, meta.logical_to_all_physical_map
    assert p2l.dtype == torch.int64 and p2l.device.type == "cpu" and p2l.is_contiguous()
    assert tuple(p2l.shape) == (layers, slots)
    assert l2p.dtype == torch.int64 and tuple(l2p.shape) == (layers, experts, slots)
    policy = "global" if raw == "deepseek" else "hierarchical"  # auto: 2 nodes divide 4 groups
    counts_per_expert = check_map(
        p2l, experts=experts, num_gpus=ep_size, num_groups=groups, num_nodes=nodes, policy=policy
    )
    np.testing.assert_array_equal(meta.logical_to_all_physical_map_num_valid, counts_per_expert)
    for layer in range(layers):  # every listed slot holds its expert, each slot listed once
        listed = l2p[layer][l2p[layer] >= 0]
        assert sorted(listed.tolist()) == list(range(slots))
        for e in range(experts):
            slots_of_e = l2p[layer, e][l2p[layer, e] >= 0]
            assert (p2l[layer, slots_of_e] == e).all()
    expected = rebalance_experts(counts.sum(dim=0), slots, groups, nodes, ep_size, policy=policy)
    assert torch.equal(p2l, expected.phy2log)


def test_two_dimensional_counts_are_one_window(sglang, torch):
    _, _, slots, ep_size, groups, nodes = SIZES
    register()
    counts = _counts(torch, windows=1)
    kw = dict(num_physical_experts=slots, ep_size=ep_size, num_groups=groups, num_nodes=nodes)
    flat = sglang.init_by_eplb(counts[0], **kw)  # SGLang unsqueezes a 2-D count
    assert torch.equal(
        flat.physical_to_logical_map, sglang.init_by_eplb(counts, **kw).physical_to_logical_map
    )


def test_other_algorithms_stay_sglangs(sglang, torch):
    _, _, slots, ep_size, groups, nodes = SIZES
    register()
    out = sglang.algorithms.rebalance_experts(
        tokens_per_expert=_counts(torch),
        num_physical_experts=slots,
        num_local_physical_experts=slots // ep_size,
        num_groups=groups,
        num_nodes=nodes,
        algorithm=EplbAlgorithm.elasticity_aware,
    )
    assert out == ("sglang's own plan", EplbAlgorithm.elasticity_aware)
    assert engines.SGLANG_CALLS == [EplbAlgorithm.elasticity_aware]


def test_register_is_idempotent_and_undone_by_unregister(sglang):
    original = sglang.algorithms.rebalance_experts
    register()
    first = sglang.algorithms.rebalance_experts
    assert first is not original
    register(keep_plan=False)
    assert sglang.algorithms.rebalance_experts.__lbkit_original__ is original
    unregister()
    assert sglang.algorithms.rebalance_experts is original
    unregister()  # nothing to undo
    assert sglang.algorithms.rebalance_experts is original
    with pytest.raises(TypeError, match="keep_plan: must be a bool"):
        register(keep_plan=1)


def test_register_without_sglang_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="SGLang is not importable"):
        register()
    with pytest.raises(ImportError, match="SGLang is not importable"):
        unregister()


def test_plugin_registers_only_when_enabled(sglang, monkeypatch):
    original = sglang.algorithms.rebalance_experts
    load_plugin()
    assert sglang.algorithms.rebalance_experts is original
    monkeypatch.setenv("LBKIT_EPLB", "1")
    load_plugin()
    load_plugin()
    assert sglang.algorithms.rebalance_experts.__lbkit_original__ is original


@pytest.mark.parametrize("keep_plan", [True, False])
def test_the_plan_in_service_makes_a_replan_move_few_experts(sglang, torch, keep_plan):
    _, _, slots, ep_size, groups, nodes = SIZES
    register(keep_plan=keep_plan)
    kw = dict(num_physical_experts=slots, ep_size=ep_size, num_groups=groups, num_nodes=nodes)
    first = sglang.init_by_eplb(_counts(torch, seed=1), **kw)  # start-up: no plan in service
    sglang.set_plan_in_service(first)
    new_counts = torch.tensor(
        np.rint(drift(_counts(torch, seed=1).sum(dim=0).numpy(), sigma=0.2, rng=2))[None],
        dtype=torch.int64,
    )
    second = sglang.init_by_eplb(new_counts, **kw)
    old, new = first.physical_to_logical_map, second.physical_to_logical_map
    w = new_counts.sum(dim=0)
    fresh = rebalance_experts(w, slots, groups, nodes, ep_size).phy2log
    if not keep_plan:
        assert torch.equal(new, fresh)
        return
    assert moves(old, new) <= moves(old, fresh) // 2
    assert torch.equal(new, replan_experts(w, old, slots, groups, nodes, ep_size).plan.phy2log)
    assert moe_lb(w, new, num_gpus=ep_size).mean() <= 1.01 * moe_lb(
        w, fresh, num_gpus=ep_size
    ).mean() * (1 + 1e-12)


def test_a_plan_in_service_of_another_size_gives_a_fresh_plan(sglang, torch):
    _, _, slots, ep_size, groups, nodes = SIZES
    register()
    kw = dict(num_physical_experts=slots, ep_size=ep_size, num_groups=groups, num_nodes=nodes)
    counts = _counts(torch, seed=3)
    fresh = sglang.init_by_eplb(counts, **kw)
    wider = torch.cat([fresh.physical_to_logical_map] * 2, dim=1)  # elastic EP before a scale
    sglang.set_plan_in_service(engines.ExpertLocationMetadata(wider, wider, None, None))
    assert torch.equal(
        sglang.init_by_eplb(counts, **kw).physical_to_logical_map, fresh.physical_to_logical_map
    )


def test_numpy_in_numpy_out():
    layers, experts, slots, ep_size, groups, nodes = SIZES
    counts = synthetic_expert_load(layers, experts, rng=4)[None]
    plan = adapter.rebalance_experts(counts, slots, slots // ep_size, groups, nodes, "deepseek")
    assert all(isinstance(a, np.ndarray) and a.dtype == np.int64 for a in plan)
    direct = rebalance_experts(counts[0], slots, groups, nodes, ep_size, policy="global")
    for ours, theirs in zip(plan, direct, strict=True):
        np.testing.assert_array_equal(ours, theirs)


_C = [[[5.0, 1.0, 3.0, 2.0]]]


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([[5.0, 1.0]], 4, 2, 1, 1, "deepseek"), ValueError, "tokens_per_expert: must be 3-dim"),
        (
            ([[[5.0, -1.0]]], 4, 2, 1, 1, "deepseek"),
            ValueError,
            "tokens_per_expert: must be non-neg",
        ),
        (("counts", 4, 2, 1, 1, "deepseek"), TypeError, "tokens_per_expert"),
        ((_C, 4, 3, 1, 1, "deepseek"), ValueError, "num_local_physical_experts: must divide"),
        ((_C, 4, 0, 1, 1, "deepseek"), ValueError, "num_local_physical_experts: must be >= 1"),
        ((_C, 8, 2, 1, 3, "deepseek"), ValueError, "num_nodes: must divide the number of GPUs"),
        ((_C, 4, 2, None, 1, "deepseek_hierarchical"), ValueError, "num_groups: algorithm"),
        ((_C, 4, 2, 3, 1, "deepseek"), ValueError, "num_groups: must divide the number of exp"),
        ((_C, 4, 2, 1, 1, "elasticity_aware"), ValueError, "algorithm: lbkit plans for"),
        ((_C, 4, 2, 1, 1, 3), TypeError, "algorithm: must be an EplbAlgorithm"),
        ((_C, 4.0, 2, 1, 1, "deepseek"), TypeError, "num_physical_experts: must be an integer"),
        ((_C, 2, 1, 1, 1, "deepseek"), ValueError, "num_replicas: must be >= the number of exp"),
    ],
)
def test_bad_input_is_named(args, error, match):
    with pytest.raises(error, match=match):
        adapter.rebalance_experts(*args)


def test_global_algorithm_without_groups():
    plan = adapter.rebalance_experts(_C, 4, 2, None, 1, EplbAlgorithm.deepseek_vec)
    np.testing.assert_array_equal(plan.phy2log, rebalance_experts(_C[0], 4, 1, 1, 2).phy2log)


@pytest.mark.parametrize(
    ("previous", "match"),
    [
        ([[0, 1, 2, 3], [0, 1, 2, 3]], "one row per layer"),
        ([[0, 1, 2, 7]], r"logical experts in \[0, 4\) or -1"),
        ([[0, 1, 1, 2]], "every logical expert needs a slot"),
    ],
)
def test_bad_plan_in_service_is_named(previous, match):
    with pytest.raises(ValueError, match=match) as info:
        adapter.replan_experts(
            _C, 4, 2, 1, 1, "deepseek", previous_physical_to_logical_map=previous
        )
    assert str(info.value).startswith("previous_physical_to_logical_map: ")
