"""The move list of a re-plan against a plain reading of its rule: one entry per changed slot,
and the source GPU is one that held the expert under the old plan, preferring one that keeps it
in the new plan, then one on the destination's node, then the lowest index (-1 if none)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lbkit.eplb.replan import moves_list


def plain_source(prev_row, new_row, slot, num_gpus, num_nodes):
    per = len(prev_row) // num_gpus
    gpn = num_gpus // num_nodes
    e = new_row[slot]
    dest_node = (slot // per) // gpn
    best, best_key = -1, None
    for g in range(num_gpus):
        if e not in prev_row[g * per : (g + 1) * per].tolist():
            continue
        keeps = e in new_row[g * per : (g + 1) * per].tolist()
        key = (not keeps, g // gpn != dest_node, g)
        if best_key is None or key < best_key:
            best, best_key = g, key
    return best


@st.composite
def plans(draw):
    num_gpus = draw(st.sampled_from([1, 2, 4, 8]))
    num_nodes = draw(st.sampled_from([n for n in (1, 2, 4) if num_gpus % n == 0]))
    per = draw(st.integers(1, 4))
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(1, num_gpus * per))
    cells = st.integers(0, experts - 1)
    size = layers * num_gpus * per
    prev = np.array(draw(st.lists(cells, min_size=size, max_size=size)))
    new = prev.copy()
    for k in draw(st.lists(st.integers(0, prev.size - 1), max_size=prev.size)):
        new[k] = draw(cells)
    return prev.reshape(layers, -1), new.reshape(layers, -1), num_gpus, num_nodes


@given(plans())
def test_moves_list_follows_its_rule(case):
    prev, new, num_gpus, num_nodes = case
    m = moves_list(prev, new, num_gpus, num_nodes)
    layer_idx, slot_idx = np.nonzero(prev != new)
    per = prev.shape[1] // num_gpus
    assert np.array_equal(m.layer, layer_idx) and np.array_equal(m.slot, slot_idx)
    assert np.array_equal(m.gpu, slot_idx // per)
    assert np.array_equal(m.new_expert, new[layer_idx, slot_idx])
    assert np.array_equal(m.old_expert, prev[layer_idx, slot_idx])
    want = [plain_source(prev[lay], new[lay], s, num_gpus, num_nodes)
            for lay, s in zip(layer_idx, slot_idx, strict=True)]  # fmt: skip
    assert m.source_gpu.tolist() == want
    assert all(a.dtype == np.int64 for a in m)
