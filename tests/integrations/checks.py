"""Checks shared by the adapter tests: a map is a valid plan; how many slots a new plan changes."""

from __future__ import annotations

from typing import Any

import numpy as np

from lbkit.eplb import check_placement


def as_array(value: Any) -> np.ndarray:
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def check_map(
    phy2log: Any,
    *,
    experts: int,
    num_gpus: int,
    num_groups: int | None = None,
    num_nodes: int | None = None,
    policy: str | None = None,
) -> np.ndarray:
    """Assert that a physical-to-logical map is a valid plan; return its replica counts.

    Builds the ``log2phy`` and ``logcnt`` the map implies and runs lbkit's public validator
    (every logical expert has a slot in every layer, counts add up to the slots, ``num_gpus``
    divides the slots, and under the hierarchical policy every group sits on one node).
    """
    p2l = as_array(phy2log)
    layers, slots = p2l.shape
    assert p2l.min() >= 0 and p2l.max() < experts
    logcnt = np.stack([np.bincount(row, minlength=experts) for row in p2l])
    log2phy = np.full((layers, experts, int(logcnt.max())), -1, dtype=np.int64)
    for layer in range(layers):
        for e in range(experts):
            where = np.flatnonzero(p2l[layer] == e)
            log2phy[layer, e, : len(where)] = where
    check_placement(
        p2l,
        log2phy,
        logcnt,
        num_experts=experts,
        num_gpus=num_gpus,
        num_groups=num_groups,
        num_nodes=num_nodes,
        policy=policy,
    )
    assert (logcnt >= 1).all() and (logcnt.sum(axis=1) == slots).all()
    return logcnt


def moves(old: Any, new: Any) -> int:
    """Slots whose expert changes between two maps (the expert weights an engine copies)."""
    return int((as_array(old) != as_array(new)).sum())
